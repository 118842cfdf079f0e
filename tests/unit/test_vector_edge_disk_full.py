"""Qdrant Edge on a full disk: it writes points through memory-mapped files, and a write
into a page the disk cannot back killed ``mneme up`` with SIGBUS (exit 135, no error, no
log line: seen with the data dir on a full tmpfs). The store refuses to write with less
than ``MIN_FREE_BYTES`` free, with ENOSPC, which the consumers retry until there is room;
nothing stored is touched and reads go on."""

from __future__ import annotations

import errno
import os
from types import SimpleNamespace

import pytest

from mneme.domain import Fact
from mneme.stores import vector_edge
from mneme.stores.vector_edge import EdgeVectorStore

DIM = 4
#: (getattr: the test ran against the store from before the guard too, and failed)
MARGIN = getattr(vector_edge, "MIN_FREE_BYTES", 64 << 20)


def _fact(i: int) -> Fact:
    return Fact(id=f"f{i}", bank_id="b", text=f"unit {i}", embedding=[1.0, float(i), 0.5, 0.25])


def test_a_write_on_a_nearly_full_disk_is_refused_before_the_shard_writes(tmp_path, monkeypatch):
    store = EdgeVectorStore(str(tmp_path / "vectors"), DIM)
    store.upsert([_fact(1)])
    real = os.statvfs
    free = [MARGIN - 4096]

    def statvfs(path):
        st = real(path)
        return SimpleNamespace(f_bavail=free[0] // st.f_frsize, f_frsize=st.f_frsize)

    monkeypatch.setattr(vector_edge.os, "statvfs", statvfs)
    with pytest.raises(OSError) as err:
        store.upsert([_fact(2)])
    assert err.value.errno == errno.ENOSPC
    with pytest.raises(OSError):
        store.delete("b", ["f1"])
    assert [f.id for f in store.get("b", ["f1", "f2"])] == ["f1"]  # reads go on
    assert store.count("b") == 1
    free[0] = MARGIN  # room again
    store.upsert([_fact(2)])
    assert sorted(f.id for f in store.get("b", ["f1", "f2"])) == ["f1", "f2"]
    assert store.count("b") == 2
    store.close()
