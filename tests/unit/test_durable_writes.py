"""Writes visible at once, durable at the offset commit: EdgeVectorStore defers its fsync
to ``flush()``; the embedded Consumer flushes a group's durable deps
(:attr:`mneme.router.Group.durable`) once before each commit, and a flush that raises
commits nothing (the records are handled again)."""

from __future__ import annotations

import subprocess
import sys
import pytest

from mneme.bus import MEMORY, codec
from mneme.bus.consumer import Consumer, FlushFailed
from mneme.bus.sqlite_log import SqliteEventLog
from mneme.domain import Fact
from mneme.events.v1 import events_pb2 as ev
from mneme.generations import Switchable
from mneme.router import Group, Router, Service
from mneme.stores.vector_edge import EdgeVectorStore

DIM = 8


def _fact(n: int, bank: str = "b") -> Fact:
    vec = [0.0] * DIM
    vec[n % DIM] = 1.0
    return Fact(id=f"00000000-0000-0000-0000-{n:012d}", bank_id=bank, text=f"fact {n}",
                embedding=vec)


class _CountingShard:
    """The Edge shard, counting its flushes (each is an fsync)."""

    def __init__(self, shard) -> None:
        self.shard, self.flushes = shard, 0

    def flush(self):
        self.flushes += 1
        return self.shard.flush()

    def __getattr__(self, name):
        return getattr(self.shard, name)


# ---- EdgeVectorStore ----------------------------------------------------------------


def test_an_edge_write_is_searchable_before_any_flush_and_flushed_once_when_asked(tmp_path):
    store = EdgeVectorStore(str(tmp_path / "v"), DIM)
    shard = store._shard = _CountingShard(store._shard)
    try:
        store.upsert([_fact(1), _fact(2)])
        hits = store.search("b", _fact(1).embedding, 1)
        assert [h.id for h in hits] == [_fact(1).id]  # visible, nothing flushed yet
        assert [f.text for f in store.get("b", [_fact(2).id])] == ["fact 2"]
        store.delete("b", [_fact(2).id])
        assert store.count("b") == 1
        assert shard.flushes == 0
        store.flush()
        assert shard.flushes == 1  # one fsync for every write before it
        store.flush()  # clean: nothing to do, nothing harmed
        assert shard.flushes == 1 and store.count("b") == 1
        assert store.delete_where("b", "no-such-document") == []
        store.flush()
        assert shard.flushes == 1  # a delete that matched nothing wrote nothing
        store.delete_where("b", None)
        store.flush()
        assert shard.flushes == 2 and store.count("b") == 0
    finally:
        store.close()
    assert shard.flushes == 3  # close flushes
    store.flush()  # closed: close flushed everything, nothing left to do


_CHILD = """
import os, sys
sys.path[:0] = {path!r}
from mneme.stores.vector_edge import EdgeVectorStore
from tests.unit.test_durable_writes import DIM, _fact
store = EdgeVectorStore(sys.argv[1], DIM)
store.upsert([_fact(7), _fact(8)])
store.flush()
os._exit(0)  # no close: the process ends as if killed
"""


def test_flushed_edge_writes_are_there_for_a_new_store_object_after_the_process_dies(tmp_path):
    path = str(tmp_path / "v")
    subprocess.run([sys.executable, "-c", _CHILD.format(path=sys.path), path], check=True,
                   timeout=60)
    store = EdgeVectorStore(path, DIM)
    try:
        assert store.count("b") == 2
        assert [f.text for f in store.get("b", [_fact(7).id, _fact(8).id])] == \
            ["fact 7", "fact 8"]
        assert [h.id for h in store.search("b", _fact(8).embedding, 1)] == [_fact(8).id]
    finally:
        store.close()


def test_a_switchable_store_flushes_its_current_target(tmp_path):
    a, b = EdgeVectorStore(str(tmp_path / "a"), DIM), EdgeVectorStore(str(tmp_path / "b"), DIM)
    try:
        s = Switchable(a)
        s.swap(b)
        b._shard = _CountingShard(b._shard)
        s.upsert([_fact(1)])
        s.flush()
        assert b._shard.flushes == 1 and a.count("b") == 0
    finally:
        a.close()
        b.close()


# ---- the router's durable deps --------------------------------------------------------


class Durable:
    """A dep whose writes need a flush: records what happens, in order, with the offset
    committed at each flush; ``fail`` flushes raise."""

    def __init__(self, log, group: str, events: list) -> None:
        self.log, self.group, self.events, self.fail = log, group, events, 0

    def flush(self) -> None:
        self.events.append(("flush", self.log.committed(self.group, MEMORY, 0)))
        if self.fail:
            self.fail -= 1
            raise OSError("disk full")


def _service(group: str, durable=("dep",)) -> Service:
    return Service("t", groups=(Group(group, {MEMORY: {ev.FactsRetracted: _on_retracted}},
                                      durable=durable),))


def _on_retracted(m: ev.FactsRetracted, meta, *, dep: Durable, boom: set):
    dep.events.append(("handle", m.memory_ids[0]))
    if m.memory_ids[0] in boom:
        boom.discard(m.memory_ids[0])  # fails once
        raise RuntimeError("transient")
    return []


class _RecordingLog(SqliteEventLog):
    """The embedded log, recording each commit into ``events``."""

    events: list

    def commit(self, group, offsets, produce=()):
        out = super().commit(group, offsets, produce=produce)
        self.events.append(("commit", offsets[(MEMORY, 0)]))
        return out


@pytest.fixture
def log(tmp_path):
    lg = _RecordingLog(str(tmp_path / "log.db"))
    lg.events = []
    lg.ensure_topic(MEMORY, 1)
    yield lg
    lg.close()


def _append(log, n: int, start: int = 0) -> None:
    log.append([codec.encode(ev.FactsRetracted(bank_id="b", memory_ids=[f"m{i}"]),
                             bank_id="b", source="mneme/test") for i in range(start, start + n)])


def test_a_named_durable_dep_must_exist_and_have_a_flush(log):
    dep = Durable(log, "g", [])
    with pytest.raises(ValueError, match="durable dep 'stores' is not provided"):
        Router(_service("g", durable=("stores",)), "g", {"dep": dep, "boom": set()})
    with pytest.raises(ValueError, match="durable dep 'stores'.*has no flush"):
        Router(_service("g", durable=("stores",)), "g",
               {"dep": dep, "boom": set(), "stores": object()})
    Router(_service("g", durable=()), "g", {"dep": dep, "boom": set()}).flush()  # none
    assert dep.events == []


def test_the_consumer_flushes_once_per_batch_before_each_commit(log):
    events = log.events
    dep = Durable(log, "g", events)
    router = Router(_service("g"), "g", {"dep": dep, "boom": set()})
    c = Consumer(log, "g", (MEMORY,), router, batch_size=100)
    _append(log, 5)
    assert c.run_once() == 5
    assert events == [*(("handle", f"m{i}") for i in range(5)), ("flush", 0), ("commit", 5)]
    events.clear()
    _append(log, 3, start=5)
    assert c.run_once() == 3
    assert events == [("handle", "m5"), ("handle", "m6"), ("handle", "m7"), ("flush", 5),
                      ("commit", 8)]
    assert c.run_once() == 0 and events[-1] == ("commit", 8)  # nothing read: no flush


def test_the_prefix_committed_before_a_retry_is_flushed_first(log):
    events = log.events
    dep = Durable(log, "g", events)
    router = Router(_service("g"), "g", {"dep": dep, "boom": {"m2"}})
    c = Consumer(log, "g", (MEMORY,), router, backoff=0.001, backoff_max=0.001)
    _append(log, 4)
    assert c.run_once() == 4
    assert events == [("handle", "m0"), ("handle", "m1"), ("handle", "m2"),
                      ("flush", 0), ("commit", 2),  # the handled prefix, durable first
                      ("handle", "m2"), ("handle", "m3"), ("flush", 2), ("commit", 4)]


def test_a_failing_flush_commits_nothing_and_the_records_are_handled_again(log):
    events = log.events
    dep = Durable(log, "g", events)
    dep.fail = 2
    router = Router(_service("g"), "g", {"dep": dep, "boom": set()})
    c = Consumer(log, "g", (MEMORY,), router, backoff=0.01, error_backoff_max=0.05)
    _append(log, 3)
    with pytest.raises(FlushFailed, match="disk full"):
        c.run_once()  # in the caller's thread the failure is raised
    assert log.committed("g", MEMORY, 0) == 0 and c.stats["flush_failures"] == 1
    assert not [e for e in events if e[0] == "commit"]
    c.start()  # the thread backs off and tries again (one more failure, then it works)
    try:
        assert c.wait_idle(10)
    finally:
        c.stop()
    assert log.committed("g", MEMORY, 0) == 3
    assert c.stats["flush_failures"] == 2 and c.stats["errors"] == 1
    handled = [e[1] for e in events if e[0] == "handle"]
    assert handled == ["m0", "m1", "m2"] * 3  # read and handled again: nothing lost
    assert [e for e in events if e[0] != "handle"] == [
        ("flush", 0), ("flush", 0), ("flush", 0), ("commit", 3)]  # never committed past it


def test_a_consumer_without_durable_deps_commits_as_before(log):
    dep = Durable(log, "g", log.events)
    router = Router(_service("g", durable=()), "g", {"dep": dep, "boom": set()})
    c = Consumer(log, "g", (MEMORY,), router)
    _append(log, 2)
    assert c.run_once() == 2 and log.committed("g", MEMORY, 0) == 2
    assert ("flush", 0) not in log.events  # the dep is not named durable: never flushed
