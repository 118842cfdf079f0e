"""Deletions are physical in the search stores, against a real ``mneme up``: once a sync
DeleteDocument or DeleteBank returns, no file under the data dir holds the deleted
fact's text nor its embedding (float32 little endian, whole or in 16-byte windows, as
the log carried it or L2-normalised as the vector store keeps it); recall and
ListMemories return nothing of it, the other document is still recalled, also after a
restart. Before the deletion the same search finds them (the check can fail)."""

from __future__ import annotations

import os
import struct
from pathlib import Path

import numpy as np
import pytest

from mneme.bus import MEMORY
from mneme.bus.codec import decode
from mneme.bus.sealing import Sealer
from mneme.bus.sqlite_log import SqliteEventLog
from mneme.events.v1 import events_pb2 as ev
from mneme.keys import Keyring, local_kms
from mneme.stores.keys_sqlite import SqliteKeyStore
from mneme.v1 import operations_pb2
from tests.e2e.server import Server

pytestmark = pytest.mark.slow

SECRET = "Alice's phone number is 415-555-0199."
MARKER = b"415-555-0199"
KEEP = "Bob grows tomatoes in his garden in Porto."


def _embedding(data: Path, bank: str, document_id: str) -> list[float]:
    """The embedding of the document's fact, read from the log with the data dir's keys
    (they are destroyed by the deletion, so call it before)."""
    keys = SqliteKeyStore(str(data / "keys.db"))
    log = SqliteEventLog(data / "log.db")
    try:
        sealer = Sealer(Keyring(keys, local_kms(data)))
        for p in range(log.partitions(MEMORY)):
            for rec in log.read(MEMORY, p, 0, 100_000):
                m = decode(sealer.open(rec)).message
                if isinstance(m, ev.FactsExtracted) and m.bank_id == bank:
                    for f in m.facts:
                        if f.document_id == document_id and len(f.embedding):
                            return list(f.embedding)
    finally:
        log.close()
        keys.close()
    raise AssertionError(f"no fact of document {document_id!r} on the log")


def _needles(vector: list[float]) -> dict[str, bytes]:
    """The marker, and the vector's float32 bytes (as logged and normalised), whole and
    in a few 16-byte windows."""
    out = {"marker": MARKER}
    v = np.asarray(vector, dtype=np.float32)
    for name, arr in (("logged", v), ("normalised", v / np.linalg.norm(v))):
        raw = arr.astype("<f4").tobytes()
        out[f"{name} vector"] = raw
        for i in (0, 37, 150, 301, 380):
            out[f"{name} floats {i}..{i + 3}"] = raw[4 * i:4 * i + 16]
    return out


def _holders(data: Path, needles: dict[str, bytes]) -> dict[str, list[str]]:
    """needle name → files under ``data`` holding it (the event log, whose content is
    sealed, included)."""
    found: dict[str, list[str]] = {}
    for root, _, files in os.walk(data):
        for name in files:
            path = os.path.join(root, name)
            try:
                with open(path, "rb") as f:
                    blob = f.read()
            except OSError:  # a socket, or a file removed meanwhile
                continue
            for key, needle in needles.items():
                if needle in blob:
                    found.setdefault(key, []).append(os.path.relpath(path, data))
    return found


def _setup(data: Path, m, bank: str) -> dict[str, bytes]:
    m.upsert_bank(bank)
    for doc, text in (("secret", SECRET), ("keep", KEEP)):
        op = m.retain(bank, [{"content": text, "document_id": doc}]).operation
        assert op.state == operations_pb2.SUCCEEDED, op
    needles = _needles(_embedding(data, bank, "secret"))
    # the check can fail: the stores hold the text and the vector now
    held = _holders(data, needles)
    assert "marker" in held and any("normalised" in k or "logged" in k for k in held), held
    return needles


def test_delete_document_leaves_no_trace_in_any_file(tmp_path):
    data = tmp_path / "data"
    server = Server(data).start()
    try:
        with server.client(timeout=120) as m:
            needles = _setup(data, m, "erase")
            op = m.delete_document("erase", "secret")
            assert op.state == operations_pb2.SUCCEEDED, op
            assert _holders(data, needles) == {}
            assert not any("415" in mem.text for mem in m.list_memories("erase"))
            assert not any("415" in r.memory.text for r in m.recall("erase", "Alice phone number").results)
            assert any("tomatoes" in r.memory.text for r in m.recall("erase", "Bob tomatoes").results)
        server.stop()
        assert _holders(data, needles) == {}
        server.start()
        with server.client(timeout=120) as m:
            assert not any("415" in mem.text for mem in m.list_memories("erase"))
            assert any("tomatoes" in r.memory.text for r in m.recall("erase", "tomatoes garden").results)
            # later deletions still purge (the stores reopened keep doing it)
            assert m.delete_document("erase", "keep").state == operations_pb2.SUCCEEDED
            assert _holders(data, {"keep": b"tomatoes"}) == {}
            assert list(m.list_memories("erase")) == []
    finally:
        server.stop()
    assert _holders(data, needles) == {}


def test_delete_bank_leaves_no_trace_in_any_file(tmp_path):
    data = tmp_path / "data"
    server = Server(data).start()
    try:
        with server.client(timeout=120) as m:
            m.upsert_bank("other")
            assert m.retain("other", [{"content": "Carol sails to Madeira every June.",
                                       "document_id": "c"}]).operation.state \
                == operations_pb2.SUCCEEDED
            needles = _setup(data, m, "gone")
            m.delete_bank("gone")
            assert _holders(data, {**needles, "keep": b"tomatoes"}) == {}
            assert "gone" not in [b.name.split("/", 1)[1] for b in m.list_banks()]
            assert any("Madeira" in r.memory.text for r in m.recall("other", "Carol Madeira").results)
        server.stop()
        server.start()
        with server.client(timeout=120) as m:
            assert any("Madeira" in r.memory.text for r in m.recall("other", "sails Madeira").results)
            m.upsert_bank("gone")  # a new bank under the same name starts empty
            assert list(m.list_memories("gone")) == []
    finally:
        server.stop()
    assert _holders(data, {**needles, "keep": b"tomatoes"}) == {}
