"""The embedded event log (SQLite) and the consumer runner."""

from __future__ import annotations

import logging
import signal
import subprocess
import sys
import sqlite3
import textwrap
import threading
import time
from collections import defaultdict

import pytest

from mneme import bus
from mneme.bus import DLQ, INTAKE, MEMORY, PROGRESS, StaleCommitError, partition_for
from mneme.bus.codec import decode, encode
from mneme.bus.consumer import Consumer
from mneme.bus.sqlite_log import SqliteEventLog
from mneme.events.v1 import events_pb2 as ev
from mneme.ports import OutRecord, Record

# Kafka Java client: org.apache.kafka.common.utils.Utils.murmur2 (UtilsTest vectors).
MURMUR2_VECTORS = {
    b"21": -973932308,
    b"foobar": -790332482,
    b"a-little-bit-long-string": -985981536,
    b"a-little-bit-longer-string": -1486304829,
    b"lkjh234lh9fiuh90y23oiuhsafujhadof229phr9h19h89h8": -58897971,
    b"abc": 479470107,
}


@pytest.fixture
def path(tmp_path):
    return str(tmp_path / "log" / "events.db")


@pytest.fixture
def elog(path):
    log = SqliteEventLog(path)
    yield log
    log.close()


def rec(topic: str, key: str, value: bytes | str, **headers: str) -> OutRecord:
    return OutRecord(topic, key, value.encode() if isinstance(value, str) else value, headers)


def all_records(log, topic: str) -> list[Record]:
    out = []
    for p in range(log.partitions(topic)):
        out.extend(log.read(topic, p, 0, 1_000_000))
    return out


def assert_dense(log, topic: str) -> int:
    total = 0
    for p in range(log.partitions(topic)):
        offs = [r.offset for r in log.read(topic, p, 0, 1_000_000)]
        assert offs == list(range(len(offs))), f"partition {p} offsets not dense"
        assert log.end_offset(topic, p) == len(offs)
        total += len(offs)
    return total


# ---- partitioning ----------------------------------------------------------------------


@pytest.mark.parametrize("data,expected", MURMUR2_VECTORS.items())
def test_murmur2_matches_kafka_java_client(data, expected):
    from aiokafka.partitioner import murmur2  # what partition_for uses (unsigned 32-bit)

    assert murmur2(data) == expected & 0xFFFFFFFF


def test_partition_for_is_kafka_default_partitioner():
    for data, h in MURMUR2_VECTORS.items():
        for n in (1, 3, 4, 7, 12):
            assert partition_for(data.decode(), n) == (h & 0x7FFFFFFF) % n
    assert partition_for("héllo", 5) == partition_for("héllo".encode(), 5)
    with pytest.raises(ValueError):
        partition_for("x", 0)


def test_appended_records_land_on_partition_for_key(elog):
    elog.ensure_topic("t", 4)
    out = elog.append([rec("t", f"bank-{i}", str(i)) for i in range(50)])
    assert {r.partition for r in out} == {0, 1, 2, 3}
    for r in out:
        assert r.partition == partition_for(r.key, 4)


def test_order_per_key_and_dense_offsets(elog):
    elog.ensure_topic("t", 3)
    keys = [f"k{i}" for i in range(7)]
    sent = defaultdict(list)
    for batch in range(20):
        recs = [rec("t", k, f"{k}:{batch}:{j}") for j in range(3) for k in keys]
        out = elog.append(recs)
        assert [r.value for r in out] == [r.value for r in recs]
        for r in recs:
            sent[r.key].append(r.value)
    assert assert_dense(elog, "t") == 20 * 3 * 7
    got = defaultdict(list)
    seen_partition = {}
    for r in all_records(elog, "t"):
        got[r.key].append(r.value)
        assert seen_partition.setdefault(r.key, r.partition) == r.partition
    assert got == sent


def test_read_window_end_offset_and_headers(elog):
    elog.ensure_topic("t", 1)
    elog.append([rec("t", "k", bytes([i]), n=str(i)) for i in range(10)])
    assert [r.offset for r in elog.read("t", 0, 4, 3)] == [4, 5, 6]
    assert elog.read("t", 0, 10) == [] and elog.read("t", 0, 0, 0) == []
    r = elog.read("t", 0, 7, 1)[0]
    assert (r.topic, r.partition, r.key, r.value, r.headers) == ("t", 0, "k", b"\x07", {"n": "7"})
    assert abs(r.timestamp - time.time()) < 60
    assert elog.end_offset("t", 0) == 10
    assert elog.end_offset("nope", 0) == 0 and elog.read("nope", 0, 0) == []


def test_topics_auto_create_and_keep_partition_count(elog):
    assert elog.partitions(INTAKE) == 0
    elog.append([rec(INTAKE, "b", "x"), rec(DLQ, "b", "y")])
    assert elog.partitions(INTAKE) == bus.TOPIC_PARTITIONS[INTAKE]
    assert elog.partitions(DLQ) == 1
    elog.ensure_topic(INTAKE, 9)  # existing topic keeps its count
    assert elog.partitions(INTAKE) == bus.TOPIC_PARTITIONS[INTAKE]
    assert elog.topics() == {INTAKE: 4, DLQ: 1}
    with pytest.raises(ValueError):
        elog.ensure_topic("x", 0)


def test_append_validates_and_is_all_or_nothing(elog):
    elog.ensure_topic("t", 2)
    with pytest.raises(TypeError):
        bad = OutRecord("t", "b", "not bytes")  # type: ignore[arg-type]
        elog.append([rec("t", "a", "ok"), bad])
    assert all_records(elog, "t") == []


def test_open_event_log_by_url(tmp_path):
    p = tmp_path / "sub" / "dir" / "e.db"
    from mneme.bus.logs import open_event_log
    log = open_event_log(f"sqlite://{p}")
    try:
        assert isinstance(log, SqliteEventLog) and log.path == str(p)
        assert p.exists()
    finally:
        log.close()
    with pytest.raises(ValueError, match="'redis'"):
        open_event_log("redis://localhost:6379")
    with pytest.raises(ValueError, match="absolute path"):
        open_event_log("sqlite://")


# ---- consumer-group offsets, replay, transactions, durability ---------------------------


def test_group_offsets_independent_and_survive_reopen(path):
    log = SqliteEventLog(path)
    log.ensure_topic("t", 2)
    log.append([rec("t", "k", str(i)) for i in range(5)])
    p = partition_for("k", 2)
    assert log.committed("g1", "t", p) == 0
    log.commit("g1", {("t", p): 3})
    log.commit("g2", {("t", p): 1})
    assert log.committed("g1", "t", p) == 3 and log.committed("g2", "t", p) == 1
    assert log.committed("g1", "t", 1 - p) == 0
    log.close()
    with pytest.raises(RuntimeError):
        log.append([rec("t", "k", "late")])

    log = SqliteEventLog(path)
    try:
        assert log.committed("g1", "t", p) == 3 and log.committed("g2", "t", p) == 1
        assert [r.value for r in log.read("t", p, log.committed("g1", "t", p))] == [b"3", b"4"]
        assert log.group_offsets("g1") == {("t", p): 3}
    finally:
        log.close()


def test_commit_never_moves_backwards_except_reset(elog):
    elog.ensure_topic("t", 1)
    elog.append([rec("t", "k", str(i)) for i in range(5)])
    elog.commit("g", {("t", 0): 4})
    with pytest.raises(StaleCommitError):
        elog.commit("g", {("t", 0): 2})
    with pytest.raises(StaleCommitError):  # same offset with outputs = duplicate outputs
        elog.commit("g", {("t", 0): 4}, produce=[rec("out", "k", "dup")])
    assert elog.committed("g", "t", 0) == 4 and elog.partitions("out") == 0
    elog.commit("g", {("t", 0): 4})  # idempotent re-commit without outputs is fine
    with pytest.raises(ValueError):
        elog.commit("g", {("t", 0): -1})
    elog.reset_group("g", ["t"])
    assert elog.committed("g", "t", 0) == 0
    elog.commit("g", {("t", 0): 1})
    elog.reset_group("g")
    assert elog.group_offsets("g") == {}


def test_commit_and_produce_are_one_transaction(elog, monkeypatch):
    elog.ensure_topic("in", 1)
    elog.ensure_topic("out", 2)
    elog.append([rec("in", "k", "a"), rec("in", "k", "b")])
    made = elog.commit("g", {("in", 0): 1}, produce=[rec("out", "k", "A"), rec("out", "j", "A2")])
    assert [r.value for r in made] == [b"A", b"A2"]
    assert elog.committed("g", "in", 0) == 1

    # Crash inside the transaction, after the outputs were inserted: nothing is kept.
    real = elog._append_tx

    def crash(*args, **kwargs):
        real(*args, **kwargs)
        raise RuntimeError("simulated crash")

    monkeypatch.setattr(elog, "_append_tx", crash)
    with pytest.raises(RuntimeError, match="simulated crash"):
        elog.commit("g", {("in", 0): 2}, produce=[rec("out", "k", "B")])
    monkeypatch.undo()
    assert elog.committed("g", "in", 0) == 1
    assert sorted(r.value for r in all_records(elog, "out")) == [b"A", b"A2"]
    # A half-invalid batch is rejected whole as well.
    with pytest.raises(TypeError):
        bad = OutRecord("out", 5, b"")  # type: ignore[arg-type]
        elog.commit("g", {("in", 0): 2}, produce=[rec("out", "k", "B"), bad])
    assert elog.committed("g", "in", 0) == 1 and assert_dense(elog, "out") == 2
    # And it still works afterwards, offsets dense.
    elog.commit("g", {("in", 0): 2}, produce=[rec("out", "k", "B")])
    assert assert_dense(elog, "out") == 3


CHILD_APPEND = textwrap.dedent("""
    import os, signal, sys
    from mneme.bus.sqlite_log import SqliteEventLog
    from mneme.ports import OutRecord
    log = SqliteEventLog(sys.argv[1])
    n, mode = int(sys.argv[2]), sys.argv[3]
    for i in range(n):
        log.append([OutRecord("t", f"key{i % 5}", f"child:{i}".encode())])
    if mode == "kill":
        print("appended", flush=True)
        os.kill(os.getpid(), signal.SIGKILL)  # no close(), no atexit: durability on crash
    log.close()
""")


def run_child(path: str, n: int, mode: str = "close") -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-c", CHILD_APPEND, path, str(n), mode],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE)


def test_durability_settings(elog):
    # SIGKILL durability needs only the page cache; power loss needs the WAL fsynced at
    # every commit, i.e. journal_mode=WAL with synchronous=FULL (2) on the writer.
    assert elog._writer.execute("PRAGMA journal_mode").fetchone()[0] == "wal"
    assert elog._writer.execute("PRAGMA synchronous").fetchone()[0] == 2


def test_appends_survive_sigkill_of_the_writer(path):
    SqliteEventLog(path).close()
    child = run_child(path, 30, "kill")
    out, err = child.communicate(timeout=60)
    assert child.returncode == -signal.SIGKILL, err.decode()
    assert out.strip() == b"appended"
    log = SqliteEventLog(path)
    try:
        values = sorted(r.value for r in all_records(log, "t"))
        assert values == sorted(f"child:{i}".encode() for i in range(30))
        assert assert_dense(log, "t") == 30
    finally:
        log.close()


def test_concurrent_appends_from_threads_and_another_process(path):
    log = SqliteEventLog(path)
    log.ensure_topic("t", 4)
    child = run_child(path, 150)
    n_threads, per_thread = 6, 60
    errors = []

    def worker(w: int) -> None:
        try:
            for i in range(per_thread):
                if i % 10 == 0:  # mix batches and singles
                    log.append([rec("t", f"w{w}", f"w{w}:{i}:{j}") for j in range(5)])
                else:
                    log.append([rec("t", f"w{w}", f"w{w}:{i}")])
        except Exception as exc:  # pragma: no cover - reported below
            errors.append(exc)

    threads = [threading.Thread(target=worker, args=(w,)) for w in range(n_threads)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    _, err = child.communicate(timeout=60)
    try:
        assert not errors and child.returncode == 0, (errors, err.decode())
        expected = n_threads * (per_thread - per_thread // 10 + per_thread // 10 * 5) + 150
        assert assert_dense(log, "t") == expected
        recs = all_records(log, "t")
        assert len({(r.partition, r.offset) for r in recs}) == expected
        # Each thread's key stayed in its own order.
        for w in range(n_threads):
            vals = [r.value.decode() for r in sorted(recs, key=lambda r: r.offset)
                    if r.key == f"w{w}"]
            idx = [(int(v.split(":")[1]), int(v.split(":")[2]) if v.count(":") == 2 else 0)
                   for v in vals]
            assert idx == sorted(idx) and len(idx) == len(set(idx))
        child_vals = [int(r.value.split(b":")[1]) for r in sorted(recs, key=lambda r: r.offset)
                      if r.value.startswith(b"child:") and r.key == "key0"]
        assert child_vals == sorted(child_vals) and len(child_vals) == 30
    finally:
        log.close()


def test_wait_for_append_wakes_in_process_and_across_processes(path):
    log = SqliteEventLog(path, poll_interval=0.05)
    log.ensure_topic("t", 1)
    try:
        token = log.change_token()
        t0 = time.monotonic()
        assert log.wait_for_append(0.05, token) is False
        assert time.monotonic() - t0 >= 0.04

        woke = []

        def waiter():
            tok = log.change_token()
            ready.set()
            woke.append((log.wait_for_append(5.0, tok), time.monotonic()))

        ready = threading.Event()
        th = threading.Thread(target=waiter)
        th.start()
        ready.wait(5)
        sent = time.monotonic()
        with SqliteEventLog(path) as other:  # another instance on the same file
            other.append([rec("t", "k", "x")])
        th.join(5)
        assert woke and woke[0][0] is True and woke[0][1] - sent < 0.5

        # An append from another process is noticed by polling data_version.
        token = log.change_token()
        child = run_child(path, 1)
        t0 = time.monotonic()
        assert log.wait_for_append(20.0, token) is True
        child.communicate(timeout=60)
        assert time.monotonic() - t0 < 20
        assert log.end_offset("t", 0) == 2
    finally:
        log.close()


# ---- consumer runner --------------------------------------------------------------------


def intake(msg, bank="b1"):
    return encode(msg, bank_id=bank, source="mneme/test")


def retract_for(env, _rec):
    """Handler: each MemoryDeleteRequested becomes a FactsRetracted on mneme.memory.v1."""
    m = env.message
    out = ev.FactsRetracted(bank_id=m.bank_id, operation_id=m.operation_id,
                            memory_ids=[m.memory_id])
    return [encode(out, bank_id=m.bank_id, source="mneme/test", event_id=f"{env.id}/r")]


def test_consumer_end_to_end_outputs_dlq_unknown_and_restart(elog):
    seen: list[str] = []

    def handler(env, record):
        m = env.message
        seen.append(m.memory_id)
        if m.memory_id == "poison":
            raise ValueError("cannot handle poison")
        return retract_for(env, record)

    c = Consumer(elog, "extraction", [INTAKE], handler, batch_size=4, max_attempts=3,
                 backoff=0.001, idle_wait=0.5)
    c.start()
    unknown = OutRecord(INTAKE, "b1", b"\x01\x02", {"ce_type": "mneme.events.v1.FromTheFuture",
                                                     "ce_id": "u1", "ce_specversion": "1.0"})
    first = [intake(ev.MemoryDeleteRequested(bank_id="b1", operation_id=f"op{i}",
                                             memory_id=f"m{i}")) for i in range(3)]
    elog.append(first[:2] + [unknown, intake(ev.MemoryDeleteRequested(
        bank_id="b1", operation_id="opx", memory_id="poison"))] + first[2:])
    assert c.wait_idle(10), c.lag()

    outs = [decode(r) for r in all_records(elog, MEMORY)]
    assert [list(e.message.memory_ids) for e in outs] == [["m0"], ["m1"], ["m2"]]
    assert [e.id for e in outs] == [f"{r.headers['ce_id']}/r" for r in first]
    assert seen == ["m0", "m1", "poison", "poison", "poison", "m2"]  # unknown never handled
    dlq = all_records(elog, DLQ)
    assert len(dlq) == 1
    d = dlq[0]
    poison = [r for r in all_records(elog, INTAKE) if decode(r).message is not None
              and decode(r).message.memory_id == "poison"][0]
    assert d.value == poison.value and d.key == "b1"
    assert d.headers["dlq_topic"] == INTAKE
    assert int(d.headers["dlq_partition"]) == poison.partition
    assert int(d.headers["dlq_offset"]) == poison.offset
    assert d.headers["dlq_error"] == "ValueError: cannot handle poison"
    assert d.headers["dlq_attempts"] == "3" and d.headers["dlq_group"] == "extraction"
    assert d.headers["ce_type"] == "mneme.events.v1.MemoryDeleteRequested"
    assert d.headers["ce_id"] == poison.headers["ce_id"]
    assert c.stats["dead_lettered"] == 1 and c.stats["skipped"] == 1
    assert sum(c.lag().values()) == 0

    # Stop, append more, restart: committed records are not handled again.
    assert c.stop(5)
    elog.append([intake(ev.MemoryDeleteRequested(bank_id="b1", operation_id="op9",
                                                 memory_id="m9"))])
    seen.clear()
    c2 = Consumer(elog, "extraction", [INTAKE], handler, backoff=0.001).start()
    try:
        assert c2.wait_idle(10)
        assert seen == ["m9"]
        assert len(all_records(elog, MEMORY)) == 4
    finally:
        assert c2.stop(5)


def test_consumer_replay_from_zero_after_reset(elog):
    banks = ["alpha", "beta", "gamma", "delta", "eps"]
    elog.append([intake(ev.MemoryDeleteRequested(bank_id=b, operation_id=f"{b}{i}",
                                                 memory_id=f"{b}-{i}"), bank=b)
                 for i in range(6) for b in banks])
    got: list[str] = []

    def handler(env, _r):
        got.append(env.message.memory_id)

    c = Consumer(elog, "proj", [INTAKE], handler, batch_size=4)
    while c.run_once():  # synchronous driving, no thread
        pass
    first = list(got)
    assert sorted(first) == sorted(f"{b}-{i}" for i in range(6) for b in banks)
    for b in banks:  # per bank in append order
        assert [x for x in first if x.startswith(b)] == [f"{b}-{i}" for i in range(6)]
    assert c.run_once() == 0

    elog.reset_group("proj")
    got.clear()
    c = Consumer(elog, "proj", [INTAKE], handler, batch_size=4).start()
    try:
        assert c.wait_idle(10)
    finally:
        c.stop(5)
    assert sorted(got) == sorted(first)
    for b in banks:
        assert [x for x in got if x.startswith(b)] == [f"{b}-{i}" for i in range(6)]


def test_failure_mid_batch_commits_the_handled_prefix_first(elog):
    elog.ensure_topic(INTAKE, 1)
    elog.append([intake(ev.MemoryDeleteRequested(bank_id="b1", memory_id=str(i)))
                 for i in range(6)])
    committed_during_retry = []
    attempts = defaultdict(int)

    def handler(env, record):
        i = int(env.message.memory_id)
        attempts[i] += 1
        if i == 3 and attempts[i] == 1:
            raise RuntimeError("transient")
        if i == 3:
            committed_during_retry.append(elog.committed("g", INTAKE, 0))
        return retract_for(env, record)

    c = Consumer(elog, "g", [INTAKE], handler, batch_size=6, backoff=0.001)
    assert c.run_once() == 6
    assert committed_during_retry == [3]  # records 0..2 and their outputs were committed
    assert elog.committed("g", INTAKE, 0) == 6
    assert dict(attempts) == {0: 1, 1: 1, 2: 1, 3: 2, 4: 1, 5: 1}
    assert len(all_records(elog, MEMORY)) == 6 and all_records(elog, DLQ) == []


def test_stop_during_retry_leaves_the_record_uncommitted(elog):
    elog.ensure_topic(INTAKE, 1)
    elog.append([intake(ev.MemoryDeleteRequested(bank_id="b1", memory_id=str(i)))
                 for i in range(3)])
    failing = threading.Event()

    def handler(env, record):
        if env.message.memory_id == "1":
            failing.set()
            raise RuntimeError("down")
        return retract_for(env, record)

    c = Consumer(elog, "g", [INTAKE], handler, backoff=30).start()
    assert failing.wait(5)
    t0 = time.monotonic()
    assert c.stop(5)
    assert time.monotonic() - t0 < 2  # the backoff wait is interrupted
    assert elog.committed("g", INTAKE, 0) == 1
    assert len(all_records(elog, MEMORY)) == 1 and all_records(elog, DLQ) == []


def test_corrupt_payload_is_dead_lettered_without_retries(elog):
    good = intake(ev.MemoryDeleteRequested(bank_id="b1", memory_id="ok"))
    bad = OutRecord(INTAKE, "b1", b"\xff\xff\xff", dict(good.headers))
    elog.append([bad, good])
    calls = []
    c = Consumer(elog, "g", [INTAKE], lambda env, r: calls.append(env) or [])
    while c.run_once():
        pass
    assert len(calls) == 1
    [d] = all_records(elog, DLQ)
    assert d.headers["dlq_attempts"] == "0" and "DecodeError" in d.headers["dlq_error"]


def test_bad_handler_output_is_a_handler_failure(elog):
    elog.append([intake(ev.BankDeleted(bank_id="b1"))])
    c = Consumer(elog, "g", [INTAKE], lambda env, r: ["not a record"], max_attempts=2,
                 backoff=0.001)
    while c.run_once():
        pass
    [d] = all_records(elog, DLQ)
    assert d.headers["dlq_error"].startswith("TypeError")
    assert sum(c.lag().values()) == 0


def test_lag_and_two_groups_consume_independently(elog):
    elog.append([intake(ev.BankDeleted(bank_id=f"b{i}"), bank=f"b{i}") for i in range(10)])
    a = Consumer(elog, "a", [INTAKE], lambda e, r: [])
    b = Consumer(elog, "b", [INTAKE], lambda e, r: [])
    assert sum(a.lag().values()) == 10
    while a.run_once():
        pass
    assert sum(a.lag().values()) == 0 and sum(b.lag().values()) == 10
    assert b.wait_idle(0.05) is False


def test_stale_commit_from_a_second_consumer_is_not_duplicated(elog):
    """Two consumers of one group (a mistake, or a zombie): outputs are not duplicated."""
    elog.ensure_topic(INTAKE, 1)
    elog.append([intake(ev.MemoryDeleteRequested(bank_id="b1", memory_id=str(i)))
                 for i in range(4)])
    a = Consumer(elog, "g", [INTAKE], retract_for)
    b = Consumer(elog, "g", [INTAKE], retract_for)
    b._position(INTAKE, 0)  # b read its position (0) before a committed
    assert a.run_once() == 4
    b.run_once()  # handles the same records, but its commit is refused
    assert b.stats["stale_commits"] == 1
    assert len(all_records(elog, MEMORY)) == 4
    assert b.run_once() == 0  # re-read the committed offset: nothing left


def test_failing_dlq_reader_does_not_feed_the_dlq(elog):
    elog.append([OutRecord(DLQ, "b1", ev.BankDeleted(bank_id="b1").SerializeToString(),
                           {"ce_type": "mneme.events.v1.BankDeleted"})])
    c = Consumer(elog, "dlq-reader", [DLQ], lambda e, r: 1 / 0, max_attempts=1)
    while c.run_once():
        pass
    assert len(all_records(elog, DLQ)) == 1 and c.stats["dead_lettered"] == 1
    assert sum(c.lag().values()) == 0


# ---- dead letters fail their operation (issue 9, item 3) ------------------------------

def test_dead_letter_of_an_operation_event_fails_the_operation_in_the_same_commit(elog):
    def handler(env, record):
        raise RuntimeError("graph store refused the text")

    c = Consumer(elog, "search", [MEMORY], handler, max_attempts=2, backoff=0.001)
    facts = ev.FactsExtracted(bank_id="b1", operation_id="op1", items_total=2,
                              facts=[ev.Fact(id="f1", text="x")])
    no_op = ev.FactsRetracted(bank_id="b1", memory_ids=["m"])  # no operation: no progress
    elog.append([encode(facts, bank_id="b1", source="t"), encode(no_op, bank_id="b1", source="t")])
    with c:
        assert c.wait_idle(10)
    assert len(all_records(elog, DLQ)) == 2
    progress = [decode(r) for r in all_records(elog, PROGRESS)]
    assert len(progress) == 1
    p = progress[0].message
    assert (p.bank_id, p.operation_id, p.kind, p.state) == ("b1", "op1", "retain", "failed")
    assert "graph store refused the text" in p.error and "search" in p.error
    assert p.items_total == 2 and list(p.memory_ids) == ["f1"]
    # the DLQ copy and the progress were written together with the offset commit
    dlq_ts = {r.timestamp for r in all_records(elog, DLQ)}
    assert progress and all_records(elog, PROGRESS)[0].timestamp in dlq_ts


def test_a_dead_letter_off_the_operations_path_does_not_fail_it(elog):
    # consolidation follows facts that search has already made searchable: its routes
    # declare FactsExtracted secondary, so a dead letter there does not fail the retain
    from mneme.router import Router
    from services.consolidation.routes import SERVICE

    class Broken:
        def handle(self, *a, **k):
            raise RuntimeError("no model")

    router = Router(SERVICE, "consolidation", {"consolidator": Broken()})
    c = Consumer(elog, "consolidation", router.topics, router, max_attempts=1,
                 fails_operation=router.fails_operation)
    elog.append([encode(ev.FactsExtracted(bank_id="b1", operation_id="op1", items_total=1),
                        bank_id="b1", source="t")])
    c.run_once()
    assert len(all_records(elog, DLQ)) == 1 and all_records(elog, PROGRESS) == []


def test_a_consumer_that_does_not_produce_appends_not_even_a_dead_letter(elog):
    c = Consumer(elog, "search", [MEMORY], lambda env, rec: 1 / 0, max_attempts=1)
    c.produce = False  # replay
    elog.append([encode(ev.FactsExtracted(bank_id="b1", operation_id="op1", items_total=1),
                        bank_id="b1", source="t")])
    assert c.run_once() == 1
    assert all_records(elog, DLQ) == [] and all_records(elog, PROGRESS) == []
    # ... and its offset is committed all the same: the partition moves on.
    assert sum(elog.committed("search", MEMORY, p) for p in range(elog.partitions(MEMORY))) == 1


def test_a_failing_progress_event_is_dead_lettered_without_more_progress(elog):
    c = Consumer(elog, "ingest", [PROGRESS], lambda env, rec: 1 / 0, max_attempts=1)
    elog.append([encode(ev.OperationProgress(bank_id="b1", operation_id="op1", kind="retain",
                                             state="succeeded"), bank_id="b1", source="t")])
    c.run_once()
    assert len(all_records(elog, DLQ)) == 1 and len(all_records(elog, PROGRESS)) == 1


# ---- log integrity (issue 9, item 5) ---------------------------------------------------

def _filled(path: str, n: int = 3000) -> int:
    log = SqliteEventLog(path)
    for i in range(0, n, 500):
        log.append([rec(INTAKE, f"b{j % 7}", b"v" * 300) for j in range(i, i + 500)])
    log.commit("g", {(INTAKE, 0): 7})
    log.close()
    import os
    return os.path.getsize(path)


@pytest.mark.parametrize("damage", ["truncate_half", "truncate_page", "garbage", "zeros",
                                    "header"])
def test_a_damaged_log_refuses_to_open_naming_the_file_and_the_remedy(path, damage):
    import os

    from mneme.bus.sqlite_log import LogDamaged
    size = _filled(path)
    if damage == "truncate_half":
        os.truncate(path, size // 2)
    elif damage == "truncate_page":
        os.truncate(path, size - 4096)
    else:
        with open(path, "r+b") as f:
            if damage == "header":
                f.write(b"garbage garbage!")
            else:
                f.seek(0, 2)
                f.write(os.urandom(5000) if damage == "garbage" else b"\0" * 8192)
    with pytest.raises(LogDamaged) as e:
        SqliteEventLog(path)
    msg = str(e.value)
    assert path in msg and "mneme log recover" in msg and "backup" in msg


def test_an_intact_log_opens_after_a_kill_with_frames_in_the_wal(path):
    import os
    _filled(path, 500)
    # a writer killed with frames in its WAL: the file is shorter than the WAL says
    code = textwrap.dedent(f"""
        import os, sys
        sys.path.insert(0, {str(bus.__file__.rsplit('/mneme/', 1)[0])!r})
        from mneme.bus.sqlite_log import SqliteEventLog
        from mneme.ports import OutRecord
        log = SqliteEventLog({path!r})
        log._writer.execute("PRAGMA wal_autocheckpoint = 0")
        for i in range(20):
            log.append([OutRecord("{INTAKE}", "k", b"x" * 4000, {{}}) for _ in range(50)])
        os.kill(os.getpid(), 9)
    """)
    subprocess.run([sys.executable, "-c", code], check=False)
    assert os.path.getsize(path + "-wal") > 4096
    log = SqliteEventLog(path)
    try:
        assert assert_dense(log, INTAKE) == 1500 and log.check() is None
    finally:
        log.close()


# ---- a write-ahead log cut at rest ---------------------------------------------------------

_KILLED_WRITER = """
import os, sys
sys.path.insert(0, sys.argv[2])
from mneme.bus.sqlite_log import SqliteEventLog
from mneme.ports import OutRecord
log = SqliteEventLog(sys.argv[1])
log._writer.execute("PRAGMA wal_autocheckpoint = 0")  # every frame stays in the WAL
for n in map(int, sys.argv[3:]):
    if n == 0:  # a full checkpoint: every frame so far is copied into the main file
        assert log._writer.execute("PRAGMA wal_checkpoint(PASSIVE)").fetchone()[0] == 0
        continue
    for i in range(n):
        log.append([OutRecord("t", "k", b"x" * 3000, {})])
        log.commit("g", {("t", 0): log.end_offset("t", 0)})
os.kill(os.getpid(), 9)
"""


def _killed_writer(path: str, *appends: int) -> int:
    """A writer that appends (and commits group g to the end after each) ``appends``
    records in turn, a 0 making a full checkpoint, and is SIGKILLed with the rest in its
    WAL; returns the WAL's frame count."""
    import os
    SqliteEventLog(path).close()
    subprocess.run([sys.executable, "-c", _KILLED_WRITER, path,
                    str(bus.__file__.rsplit("/mneme/", 1)[0]), *map(str, appends)], check=False)
    return (os.path.getsize(path + "-wal") - 32) // (24 + 4096)


@pytest.mark.parametrize("damage", ["cut_frames", "cut_in_a_frame", "garbled_frame",
                                    "wal_removed", "wal_header"])
def test_a_wal_cut_at_rest_refuses_to_open_naming_it_and_the_lost_frames(path, damage):
    """A WAL cut or damaged while the log was closed (after a kill) lost the tail of the
    history without a word: SQLite reads frames up to the first bad one. Records and the
    consumers' offsets went back, while the projections kept what the lost records
    made. Opening now refuses, naming the WAL and the frames lost."""
    import os

    from mneme.bus.sqlite_log import LogDamaged
    frames = _killed_writer(path, 40)
    wal, frame = path + "-wal", 24 + 4096
    size = os.path.getsize(wal)
    if damage == "cut_frames":
        os.truncate(wal, size - 3 * frame)
    elif damage == "cut_in_a_frame":
        os.truncate(wal, size - frame // 2)
    elif damage == "wal_removed":
        os.remove(wal)
    else:
        with open(wal, "r+b") as f:
            f.seek(8 if damage == "wal_header" else 32 + (frames // 2) * frame + 100)
            f.write(b"garbage!")
    with pytest.raises(LogDamaged) as e:
        SqliteEventLog(path)
    msg = str(e.value)
    assert wal in msg and "mneme log recover" in msg, msg
    assert f"committed {frames} frames" in msg, msg


def test_a_wal_reused_after_a_checkpoint_opens_with_every_record(path):
    """After a full checkpoint SQLite writes the WAL from its start again, leaving older
    frames (of another salt) after the new ones: not damage."""
    import os
    _killed_writer(path, 60, 0, 5)
    assert os.path.getsize(path + "-wal") > 40 * (24 + 4096)  # the older frames behind
    log = SqliteEventLog(path)
    try:
        assert assert_dense(log, "t") == 65 and log.committed("g", "t", 0) == 65
    finally:
        log.close()


def test_a_wal_removed_after_its_checkpoint_loses_nothing(path):
    """Every frame already copied into the main file: without the WAL the log is whole."""
    import os
    _killed_writer(path, 30, 0)
    os.remove(path + "-wal")
    log = SqliteEventLog(path)
    try:
        assert assert_dense(log, "t") == 30 and log.committed("g", "t", 0) == 30
    finally:
        log.close()


@pytest.mark.parametrize("checkpointed", [False, True])
def test_recover_keeps_what_a_cut_wal_still_holds(path, checkpointed):
    """`mneme log recover` of a log whose WAL was cut keeps the records SQLite can read;
    when pages were already copied into the main file (``checkpointed``) the frames
    left in the WAL are older than them, so the main file alone is read (reading both
    rolled those pages back) and every checkpointed record is kept."""
    import os

    from mneme.bus.sqlite_log import recover
    _killed_writer(path, *((30, 0) if checkpointed else (30,)))
    wal = path + "-wal"
    os.truncate(wal, 32 + 5 * (24 + 4096))
    report = recover(path)
    assert report.problem and "was cut or damaged" in report.problem
    if checkpointed:  # not read, so kept as it was beside the damaged copy
        assert os.path.getsize(report.damaged + "-wal") == 32 + 5 * (24 + 4096)
    log = SqliteEventLog(path)
    try:
        kept = assert_dense(log, "t")
        assert kept == 30 if checkpointed else 0 < kept < 30, kept
        assert log.committed("g", "t", 0) <= kept
    finally:
        log.close()


@pytest.mark.parametrize("damage", ["cut", "garbled_frame"])
def test_recover_keeps_the_damaged_log_and_its_wal_as_they_were(path, damage):
    """The damaged copy `mneme log recover` keeps beside the new log is the log as it
    was, WAL included: the frames past a cut or garbled one are committed writes only
    it still holds. (Closing the connection that read the copy checkpointed the frames
    SQLite accepts into the copy's main file and deleted the copy's WAL, and the log's
    own WAL was removed: those frames were gone for good.)"""
    import os

    from mneme.bus.sqlite_log import recover
    frames = _killed_writer(path, 30)
    wal, frame = path + "-wal", 24 + 4096
    if damage == "cut":
        os.truncate(wal, 32 + 5 * frame)
    else:
        with open(wal, "r+b") as f:
            f.seek(32 + (frames // 2) * frame + 100)
            f.write(b"garbage!")
    before = {s: open(path + s, "rb").read() for s in ("", "-wal", "-shm")}
    report = recover(path)
    assert report.problem and "was cut or damaged" in report.problem
    for suffix, data in before.items():
        with open(report.damaged + suffix, "rb") as f:
            assert f.read() == data, f"the damaged copy's {suffix or 'main file'} changed"


def test_a_log_that_lost_records_its_consumers_handled_refuses_to_open(path):
    """Without the -shm wal-index the cut cannot be measured, but its effect can: a cut
    WAL whose older frames SQLite read over newer pages of the main file left 1 of 30
    records while consumer group g had handled 30 (the projections held all 30, and
    the group would have skipped the next 29 appended). Opening refuses, and leaves
    the WAL as it was for `mneme log recover` (closing used to checkpoint it in)."""
    import os

    from mneme.bus.sqlite_log import LogDamaged
    _killed_writer(path, 30, 0)
    os.truncate(path + "-wal", 32 + 5 * (24 + 4096))
    os.remove(path + "-shm")
    for _ in range(2):
        with pytest.raises(LogDamaged, match="consumer group 'g' has handled t.0. up to "
                                             "offset 30, but the log ends at"):
            SqliteEventLog(path)
        assert os.path.getsize(path + "-wal") > 32


def test_a_consumer_group_past_the_end_of_its_partition_refuses_to_open(path):
    import sqlite3

    from mneme.bus.sqlite_log import LogDamaged
    log = SqliteEventLog(path)
    log.append([rec("t", "k", f"v{i}") for i in range(5)])
    log.commit("g", {("t", 0): 5})
    log.close()
    conn = sqlite3.connect(path)  # the tail lost some other way (a file put back)
    conn.execute('DELETE FROM records WHERE "offset" >= 3')
    conn.commit()
    conn.close()
    with pytest.raises(LogDamaged, match=r"up to offset 5, but the log ends at 3: 2 records"):
        SqliteEventLog(path)


def test_opening_with_frames_in_the_wal_keeps_this_process_s_locks(path):
    """A log opened with frames in its WAL (after a kill) is checked without dropping the
    process's POSIX locks on the file: another process opening and closing the log (an
    external reader of the history) must not then delete the WAL and shm the open log
    still uses (its reads failed with "disk I/O error", its appends went to an unlinked
    WAL)."""
    import os
    SqliteEventLog(path).close()
    child = run_child(path, 5, "kill")  # leaves frames in the WAL
    child.communicate(timeout=60)
    assert os.path.getsize(path + "-wal") > 32
    log = SqliteEventLog(path)
    try:
        SqliteEventLog(path).close()  # another instance of this process: same locks kept
        _open_and_close_in_another_process(path)
        assert os.path.exists(path + "-wal") and os.path.exists(path + "-shm")
        log.append([OutRecord("t", "k", b"after")])
        assert b"after" in [r.value for r in all_records(log, "t")]
    finally:
        log.close()
    _reopened_holds(path, b"after")


def _reopened_holds(path: str, value: bytes) -> None:
    """The log at ``path``, opened again, holds a record ``value`` on topic "t"."""
    again = SqliteEventLog(path)
    try:
        assert value in [r.value for r in all_records(again, "t")]
    finally:
        again.close()


def _open_and_close_in_another_process(path: str) -> None:
    """What an external reader of the history does (README): open the log and close it."""
    reader = textwrap.dedent("""
        import sys
        from mneme.bus.sqlite_log import SqliteEventLog
        SqliteEventLog(sys.argv[1]).close()
    """)
    subprocess.run([sys.executable, "-c", reader, path], check=True, timeout=60)


def test_two_instances_opened_at_once_keep_the_process_s_locks(path, monkeypatch):
    """Two instances of one file opened at once in a process (threads): the second must
    not read the header by a descriptor of its own while the first, still being checked,
    holds a connection: closing that descriptor drops the process's locks, and another
    process closing the log then deletes the WAL and shm in use."""
    import os

    from mneme.bus import sqlite_log
    SqliteEventLog(path).close()
    real, first = sqlite_log.check_file, threading.Event()
    connected, second_done = threading.Event(), threading.Event()

    def check_file(p, conn=None):  # the first instance pauses here, connected
        out = real(p, conn)
        if not first.is_set():
            first.set()
            connected.set()
            assert second_done.wait(60)
        return out
    monkeypatch.setattr(sqlite_log, "check_file", check_file)
    opened = []
    t = threading.Thread(target=lambda: opened.append(SqliteEventLog(path)))
    t.start()
    assert connected.wait(60)
    threading.Timer(0.5, second_done.set).start()  # the second may wait for the first
    second = SqliteEventLog(path)
    second_done.set()
    t.join(60)
    (log,) = opened
    try:
        _open_and_close_in_another_process(path)
        assert os.path.exists(path + "-wal") and os.path.exists(path + "-shm")
        log.append([OutRecord("t", "k", b"after")])
    finally:
        second.close()
        log.close()
    _reopened_holds(path, b"after")


def test_damage_while_open_fails_fast_and_consumers_back_off(path):
    import os

    from mneme.bus.sqlite_log import LogDamaged
    _filled(path, 1000)
    log = SqliteEventLog(path)
    calls = []
    c = Consumer(log, "g2", [INTAKE], lambda env, rec: calls.append(1), backoff=0.05,
                 error_backoff_max=0.4)
    try:
        c.start()
        assert c.wait_idle(10) and c.stats["errors"] == 0
        calls.clear()
        assert log.check() is None
        with open(path, "ab") as f:
            f.write(os.urandom(3000))
        assert "bytes appended" in log.check()
        t = time.monotonic()
        with pytest.raises(LogDamaged):
            log.append([rec(INTAKE, "b", "x")])
        with pytest.raises(LogDamaged):
            log.read(INTAKE, 0, 0)
        assert time.monotonic() - t < 0.1
        log.wake()
        # every pass fails (waited for: on a loaded machine the first may come late) ...
        end = time.monotonic() + 60
        while c.stats["errors"] < 3:
            assert time.monotonic() < end, c.stats
            time.sleep(0.05)
        # ... and the passes back off (0.1, 0.2, 0.4, 0.4, … s): in one more second a
        # few more at most, not a spin
        before = c.stats["errors"]
        time.sleep(1.0)
        assert c.stats["errors"] - before <= 4, c.stats
        assert isinstance(c.last_error, LogDamaged) and not calls
    finally:
        c.stop(5)
        log.close()


def test_sqlite_corruption_seen_by_a_query_marks_the_log_damaged(path, monkeypatch):
    import sqlite3

    from mneme.bus.sqlite_log import LogDamaged
    log = SqliteEventLog(path)
    try:
        log.append([rec(INTAKE, "b", "x")])

        class Broken:
            def execute(self, *a):
                raise sqlite3.DatabaseError("database disk image is malformed")
        monkeypatch.setattr(log, "_reader", lambda: Broken())
        with pytest.raises(LogDamaged):
            log.read(INTAKE, 0, 0)
        monkeypatch.undo()
        assert "malformed" in log.check()
        with pytest.raises(LogDamaged):  # stays damaged: writes fail at once
            log.append([rec(INTAKE, "b", "y")])
    finally:
        log.close()


def test_a_sync_wait_ends_at_once_when_the_log_is_found_damaged():
    from types import SimpleNamespace

    from mneme.errors import Unavailable
    from services.ingest.handlers import Ingest
    ingest = Ingest(log=SimpleNamespace(damage="truncated"), catalog=None)
    t = time.monotonic()
    with pytest.raises(Unavailable, match="truncated"):
        ingest._wait(lambda: False, 30, "retain")
    assert time.monotonic() - t < 1


def test_stop_cancels_a_long_handler_and_leaves_its_record_for_the_next_start(elog):
    from mneme import deadline
    from mneme.errors import Cancelled
    started, calls = threading.Event(), []

    def slow(env, record):  # a long extraction: checks the call between its steps
        calls.append(record.offset)
        started.set()
        for _ in range(600):
            deadline.current().check("step")
            time.sleep(0.05)
        return []

    elog.append([encode(ev.FactsExtracted(bank_id="b1", operation_id="op1"), bank_id="b1",
                        source="t")])
    c = Consumer(elog, "search", [MEMORY], slow, max_attempts=3, backoff=0.001)
    c.start()
    assert started.wait(10)
    assert c.stop(timeout=5)  # not the handler's 30 s
    assert c.stats["dead_lettered"] == 0 and all_records(elog, DLQ) == []
    assert sum(elog.committed("search", MEMORY, p) for p in range(elog.partitions(MEMORY))) == 0
    done = Consumer(elog, "search", [MEMORY], lambda env, rec: [])
    done.run_once()  # handled again after the restart
    assert sum(elog.committed("search", MEMORY, p) for p in range(elog.partitions(MEMORY))) == 1
    with pytest.raises(Cancelled):
        with deadline.bind(deadline.Deadline(None, lambda: False)):
            deadline.current().check()


def test_read_connections_of_ended_threads_are_closed(tmp_path):
    import os
    log = SqliteEventLog(str(tmp_path / "log.db"))
    log.append([rec(INTAKE, "b", b"v")])

    def fds() -> int:
        return len(os.listdir("/proc/self/fd"))

    def read_once():
        log.end_offset(INTAKE, 0)

    for _ in range(5):  # warm up: this thread's and the first workers' connections
        t = threading.Thread(target=read_once)
        t.start()
        t.join()
    before = fds()
    for _ in range(100):  # e.g. one thread per metrics scrape
        t = threading.Thread(target=read_once)
        t.start()
        t.join()
    assert fds() - before < 10
    log.close()


def test_a_call_waiting_on_a_stopped_kafka_loop_ends_instead_of_hanging():
    # A thread blocked on the Kafka client's loop when the log closes (a lag read during
    # shutdown) must not wait forever: the process could not exit.
    import asyncio
    from concurrent.futures import CancelledError

    from mneme.bus.kafka_log import _LoopThread

    loop = _LoopThread("test-kafka-loop")
    outcome = []

    def call() -> None:
        try:
            loop.run(asyncio.sleep(3600))
        except CancelledError:
            outcome.append("cancelled")

    t = threading.Thread(target=call)
    t.start()
    end = time.monotonic() + 10  # the call is in flight before the loop stops
    while not loop._pending and time.monotonic() < end:
        time.sleep(0.01)
    assert loop._pending
    loop.stop()
    t.join(5)
    assert not t.is_alive() and outcome == ["cancelled"]
    with pytest.raises(RuntimeError, match="closed"):
        loop.run(asyncio.sleep(0))


def _filled_log(path: str, n: int = 50) -> None:
    log = SqliteEventLog(path)
    log.append([rec(INTAKE, f"b{i % 3}", f"v{i}") for i in range(n)])
    log.close()


def test_recover_leaves_a_whole_log_as_it_is(path):
    """`mneme log recover` on a log its check finds whole changes nothing: no rewrite,
    no copy of the file set aside as "damaged" (each run used to add one)."""
    from mneme.bus.sqlite_log import recover
    import os

    _filled_log(path)
    before = open(path, "rb").read()
    report = recover(path)
    assert report.problem is None and report.damaged == ""
    assert open(path, "rb").read() == before
    assert sorted(os.listdir(os.path.dirname(path))) == ["events.db"]


def test_an_interrupted_recovery_leaves_the_damaged_log_in_place(path, monkeypatch):
    """A recovery stopped halfway (Ctrl-C while it copies) leaves the log as it was, not
    a log holding only the records copied so far that the server would then start on."""
    from mneme.bus import sqlite_log
    import os

    _filled_log(path)
    with open(path, "ab") as f:
        f.write(b"\x00garbage" * 500)  # damage: bytes after the log's end
    damaged = open(path, "rb").read()
    real_copy = sqlite_log._copy

    def interrupted(src, new, report, chunk):
        real_copy(src, new, report, chunk)
        raise KeyboardInterrupt

    monkeypatch.setattr(sqlite_log, "_copy", interrupted)
    with pytest.raises(KeyboardInterrupt):
        sqlite_log.recover(path)
    assert open(path, "rb").read() == damaged
    monkeypatch.setattr(sqlite_log, "_copy", real_copy)
    report = sqlite_log.recover(path)  # run again: it completes
    assert report.problem and report.kept_total == 50 and os.path.exists(report.damaged)
    log = SqliteEventLog(path)
    try:
        assert len(all_records(log, INTAKE)) == 50
    finally:
        log.close()


@pytest.mark.parametrize("shortage", [
    OSError(28, "No space left on device"),
    sqlite3.OperationalError("database or disk is full"),
    ValueError("An IO error occurred: 'Too many open files (os error 24)'")])
def test_a_record_failing_for_want_of_disk_or_files_is_handled_again_not_dead_lettered(
        elog, shortage):
    """A projection's store on a full disk (or at the open-file limit) failed every try
    of a FactsExtracted, and the record was dead-lettered after its three quick retries:
    its retain FAILED and its facts stayed out of the store for good, although the same
    write succeeds once there is room. Such a record is not committed: the pass stops
    (ShortOfResources), and a later pass handles it."""
    _held_back_until_it_passes(elog, shortage)


def _held_back_until_it_passes(elog, error: BaseException) -> None:
    """A FactsExtracted whose handler raises ``error`` until told otherwise: the pass
    stops uncommitted (ShortOfResources), nothing is dead-lettered, and a later pass,
    once the handler succeeds, handles the record."""
    fixed = threading.Event()

    def handler(env, record):
        if not fixed.is_set():
            raise error
        return []

    c = Consumer(elog, "search", [MEMORY], handler, max_attempts=2, backoff=0.001)
    elog.append([encode(ev.FactsExtracted(bank_id="b1", operation_id="op1", items_total=1,
                                          facts=[ev.Fact(id="f1", text="x")]),
                        bank_id="b1", source="t")])
    with pytest.raises(Exception) as stopped:  # (the old code dead-lettered: no raise)
        c.run_once()
    assert type(stopped.value).__name__ == "ShortOfResources", stopped.value
    assert all_records(elog, DLQ) == [] and all_records(elog, PROGRESS) == []
    assert sum(c.lag().values()) == 1  # not committed
    fixed.set()
    c._positions.clear()  # (as the run loop does after a failed pass)
    assert c.run_once() == 1
    assert all_records(elog, DLQ) == [] and sum(c.lag().values()) == 0


def _store_errors():
    import httpx
    import redis.exceptions
    from qdrant_client.http.exceptions import ResponseHandlingException
    return [redis.exceptions.ConnectionError("Error 111 connecting to graph.sock. Connection refused."),
            redis.exceptions.TimeoutError("Timeout reading from socket"),
            ResponseHandlingException(httpx.ConnectError("All connection attempts failed")),
            ConnectionRefusedError(111, "Connection refused")]


@pytest.mark.parametrize("unreachable", _store_errors(), ids=lambda e: type(e).__name__)
def test_a_record_failing_while_its_store_is_unreachable_is_handled_again_not_dead_lettered(
        elog, unreachable):
    """The embedded graph server stopped (SIGSTOP) or died for ~30 s: search's three quick
    retries of a FactsExtracted failed with the store client's ConnectionError /
    TimeoutError, the record was dead-lettered and its retain FAILED for good, although
    the same write succeeds once the store answers (and a re-drive from the DLQ could
    not make the operation succeed). Such a record is not committed: the pass stops, and a
    later pass handles it."""
    _held_back_until_it_passes(elog, unreachable)


def _grpc_error(code: str) -> BaseException:
    """The error a gRPC client raises for a call answered ``code`` (grpc's own
    _InactiveRpcError, from a call to a server of this test)."""
    from concurrent import futures

    import grpc

    def answer(request, context):
        context.abort(getattr(grpc.StatusCode, code), f"answered {code}")

    server = grpc.server(futures.ThreadPoolExecutor(1))
    server.add_generic_rpc_handlers([grpc.method_handlers_generic_handler(
        "t.T", {"M": grpc.unary_unary_rpc_method_handler(answer)})])
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    try:
        with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
            try:
                channel.unary_unary("/t.T/M")(b"", timeout=10)
            except grpc.RpcError as e:
                return e
    finally:
        server.stop(None)
    raise AssertionError("the call did not fail")


def test_a_store_reached_over_grpc_that_does_not_answer_holds_the_record_back(elog):
    """Qdrant's client with prefer_grpc=1 (MNEME_VECTOR_URL ...?prefer_grpc=1) raises
    grpc's RpcError, code UNAVAILABLE, when the server is away: it was dead-lettered (its
    retain FAILED for good) where the same outage over HTTP holds the record back. Only
    UNAVAILABLE is the server's: another code (INVALID_ARGUMENT) is the request's."""
    from mneme.errors import store_unavailable
    away, refused = _grpc_error("UNAVAILABLE"), _grpc_error("INVALID_ARGUMENT")
    assert store_unavailable(refused) is None
    assert "UNAVAILABLE" in (store_unavailable(away) or "")
    _held_back_until_it_passes(elog, away)


def test_an_error_raised_from_none_while_a_store_was_away_is_the_records_own():
    """A permanent error raised ``from None`` in an except block that handled a store's
    ConnectionError (its code says: not caused by it; a traceback does not print it) was
    read as the store being away, so its record was held back for ever and its partition
    stopped. Only the chain a traceback prints is read."""
    from mneme.errors import held_back, store_unavailable

    def raised(suppress: bool) -> BaseException:
        try:
            try:
                raise ConnectionRefusedError(111, "Connection refused")
            except ConnectionError:
                if suppress:
                    raise ValueError("the fact has no text") from None
                raise ValueError("the fact has no text")
        except ValueError as e:
            return e

    assert store_unavailable(raised(suppress=True)) is None
    assert held_back(raised(suppress=True)) is None
    assert store_unavailable(raised(suppress=False)) is not None  # raised while handling it


def test_a_model_endpoint_that_is_unreachable_is_not_taken_for_a_store():
    """A model provider's connection error (litellm's, raised from httpx's) is the model's:
    it still fails the item or dead-letters as before, never loops as a store outage."""
    import httpx
    import litellm
    from mneme.errors import store_unavailable
    try:
        try:
            raise httpx.ConnectError("All connection attempts failed")
        except httpx.ConnectError as e:
            raise litellm.APIConnectionError(message="Connection error.", llm_provider="openai",
                                             model="m") from e
    except litellm.APIConnectionError as e:
        model_error = e
    assert store_unavailable(model_error) is None
    assert store_unavailable(ValueError("Connection refused")) is None  # words alone: no


def test_the_log_lines_of_a_failing_record_name_its_bank_event_and_operation(elog, caplog):
    """An operator paged for a dead letter read only "consumer search: dead-lettering
    mneme.memory.v1[0]@4 after 3 attempts: network:ConnectionError" (redis' repr): no
    bank, event or operation to follow the request by (GetOperation, the DLQ listing,
    the trace), and not even the error's message. The retry warnings and the dead-letter
    line now carry the bank, the event's type and id, its operation and the error."""
    def handler(env, record):
        raise RuntimeError("graph store refused the text")

    c = Consumer(elog, "search", [MEMORY], handler, max_attempts=2, backoff=0.001)
    [rec] = elog.append([encode(ev.FactsExtracted(bank_id="b1", operation_id="op1",
                                                  items_total=1, facts=[ev.Fact(id="f1")]),
                                bank_id="b1", source="t")])
    with caplog.at_level(logging.WARNING):
        while c.run_once():
            pass
    [event_id] = [v for k, v in rec.headers.items() if k == "ce_id"]
    lines = [r.getMessage() for r in caplog.records if "mneme.memory.v1" in r.getMessage()]
    assert len(lines) == 2, lines  # the retry's warning and the dead letter's error
    for line in lines:
        for part in ("bank b1", "FactsExtracted", event_id, "operations/op1",
                     "RuntimeError: graph store refused the text"):
            assert part in line, (part, line)


def test_a_record_held_back_is_logged_as_such_not_as_a_broken_log(elog, caplog):
    """A record held back by a store that did not answer was logged as "consumer search:
    pass failed; backing off" with a traceback, and its end as "the log answers again
    after 3 failures": the operator was sent to the event log, which was fine. The lines
    now say the record is held back (and why), and that it is handled again."""
    import redis.exceptions
    back, tried = threading.Event(), threading.Event()

    def handler(env, record):
        if not back.is_set():
            tried.set()
            raise redis.exceptions.ConnectionError("Error 111 connecting to graph.sock.")
        return []

    c = Consumer(elog, "search", [MEMORY], handler, max_attempts=1, backoff=0.001,
                 error_backoff_max=0.01)
    elog.append([encode(ev.FactsExtracted(bank_id="b1", operation_id="op1", items_total=1,
                                          facts=[ev.Fact(id="f1", text="x")]),
                        bank_id="b1", source="t")])
    with caplog.at_level(logging.WARNING), c:
        assert tried.wait(10)
        back.set()
        assert c.wait_idle(10)
    lines = [r.getMessage() for r in caplog.records if r.name == "mneme.bus.consumer"]
    assert not any("the log answers" in line or "pass failed" in line for line in lines), lines
    assert any("held back" in line and "bank b1" in line and "a store that answers" in line
               for line in lines), lines
    assert any("handled again" in line and "search" in line for line in lines), lines
    assert all_records(elog, DLQ) == []
