"""The Kafka runner (:class:`mneme.runtime.kafka.KafkaRunner`: FastStream subscribers
and publishers built from a Service declaration) on a tansu broker: outputs produced
before the input offset is committed, retry then dead letter, a consumer group shared by
two runners, resuming after a stop, and per-partition order.

A toy service consumes ``MemoryDeleteRequested`` from ``mneme.intake.v1`` and produces
``FactsRetracted`` on ``mneme.memory.v1``. The broker is shared by the session, so each
test uses its own consumer group, banks and DLQ topic, and looks only at its own banks."""

from __future__ import annotations

import dataclasses
import threading
import time
import uuid
from collections import defaultdict

import pytest

from mneme import deadline
from mneme.bus import INTAKE, MEMORY, PROGRESS, codec, partition_for
from mneme.events.v1 import events_pb2 as ev
from mneme.router import Group, Router, Service
from mneme.runtime.kafka import KafkaRunner
from tests.integration.conftest import KAFKA_TEST_OPTIONS, banks_over_partitions


def _varint(n: int) -> bytes:
    """``n`` as a protobuf varint."""
    out = bytearray()
    while True:
        out.append((n & 0x7F) | (0x80 if n > 0x7F else 0))
        n >>= 7
        if not n:
            return bytes(out)


def _uid() -> str:
    return uuid.uuid4().hex[:8]


class Toy:
    """The handler's dependency: what it saw, and failures to inject."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.seen: list[tuple[str, str, str]] = []   # (runner, bank, memory id)
        self.fail: set[str] = set()                  # memory ids that always fail
        self.attempts: dict[str, int] = defaultdict(int)
        self.slow: dict[str, float] = {}             # bank → seconds per record
        self.stuck: set[str] = set()                 # memory ids that wait for a stop
        self.huge: set[str] = set()                  # memory ids whose output is > 1 MiB
        self.no_room: set[str] = set()               # memory ids that fail: disk full


def on_delete(m: ev.MemoryDeleteRequested, meta, *, toy: Toy, name: str):
    with toy.lock:
        toy.attempts[m.memory_id] += 1
    if m.memory_id in toy.fail:
        raise RuntimeError(f"boom {m.memory_id}")
    if m.memory_id in toy.no_room:
        raise OSError(28, "No space left on device")
    while m.memory_id in toy.stuck:  # a long handler: stops when the runner does
        deadline.current().check("toy")
        time.sleep(0.01)
    if m.bank_id in toy.slow:
        time.sleep(toy.slow[m.bank_id])
    with toy.lock:
        toy.seen.append((name, m.bank_id, m.memory_id))
    pad = ["x" * 1_200_000] if m.memory_id in toy.huge else []  # more than Kafka takes
    return [ev.FactsRetracted(bank_id=m.bank_id, operation_id=m.operation_id,
                              memory_ids=[m.memory_id, *pad])]


def toy_service(group: str) -> Service:
    return Service("toy", groups=(Group(group, {INTAKE: {ev.MemoryDeleteRequested: on_delete}}),),
                   produces={MEMORY: (ev.FactsRetracted,)})


def runner(kafka_log, group: str, toy: Toy, name: str = "a", dlq: str | None = None,
           **kw) -> KafkaRunner:
    svc = toy_service(group)
    routers = {group: Router(svc, group, {"toy": toy, "name": name})}
    return KafkaRunner(kafka_log, routers, max_attempts=kw.pop("max_attempts", 3),
                       backoff=0.01, backoff_max=0.05, dlq_topic=dlq or f"test.dlq.{_uid()}",
                       **kw)


def delete(bank: str, n: int, op: str = "") -> object:
    return codec.encode(ev.MemoryDeleteRequested(bank_id=bank, memory_id=f"{bank}:{n}",
                                                 operation_id=op),
                        bank_id=bank, source="mneme/ingest")


def mine(kafka_log, topic: str, banks: set[str] | None):
    """Every record of ``topic`` keyed by one of ``banks`` (None: every record), in offset
    order per partition. The session's broker is shared: intake holds other tests'
    records (poison ones included), so assertions look at their own banks. Reads up to
    the end offsets as of the call: a runner still producing (one retrying a failing
    flush produces its outputs again every few ms) is not chased (that took minutes)."""
    out = []
    n = kafka_log.partitions(topic)
    ends = kafka_log.end_offsets([(topic, p) for p in range(n)])
    for p in range(n):
        off = 0
        while off < ends[(topic, p)]:
            got = kafka_log.read(topic, p, off, 500)
            if not got:
                break
            out += [r for r in got if banks is None or r.key in banks]
            off = got[-1].offset + 1
    return out


def test_outputs_are_produced_then_the_offset_committed(kafka_log):
    group, toy = f"toy-{_uid()}", Toy()
    bank = f"bank-{_uid()}"
    kafka_log.ensure_topic(INTAKE, 4)
    inputs = kafka_log.append([delete(bank, i) for i in range(5)])
    r = runner(kafka_log, group, toy).start()
    try:
        assert r.wait_idle(timeout=60), r.lag(group)
        p = inputs[0].partition
        assert kafka_log.committed(group, INTAKE, p) == inputs[-1].offset + 1
        assert sum(r.lag(group).values()) == 0
        outs = mine(kafka_log, MEMORY, {bank})
        assert [codec.decode(o).message.memory_ids[0] for o in outs] == \
            [f"{bank}:{i}" for i in range(5)]
        # deterministic ids from the input's, CloudEvents headers set by the router
        envs = [codec.decode(o) for o in outs]
        assert all(e.source == "mneme/toy" and e.type.endswith("FactsRetracted") for e in envs)
        assert len({e.id for e in envs}) == 5
        assert all(o.headers["content-type"] == codec.CONTENT_TYPE for o in outs)
        assert r.groups[group].stats["handled"] >= 5
        # other types on the topic are skipped and committed
        kafka_log.append([codec.encode(ev.BankDeleted(bank_id=bank), bank_id=bank,
                                       source="mneme/ingest")])
        assert r.wait_idle(timeout=30)
        assert r.groups[group].stats["skipped"] >= 1
        assert len(mine(kafka_log, MEMORY, {bank})) == 5
        # the lag snapshot the metric reads is refreshed by the runner every second or so
        end = time.monotonic() + 15
        while True:
            snap = r.lag_snapshot()
            if snap and all(n == 0 for (t, _), n in snap.items() if t == INTAKE) \
                    or time.monotonic() > end:
                break
            time.sleep(0.2)
        assert snap and all(n == 0 for (t, _), n in snap.items() if t == INTAKE), snap
    finally:
        assert r.stop(30)


def test_a_failing_record_is_retried_then_dead_lettered_and_fails_its_operation(kafka_log):
    group, toy, dlq = f"toy-{_uid()}", Toy(), f"test.dlq.{_uid()}"
    bank = f"bank-{_uid()}"
    kafka_log.ensure_topic(INTAKE, 4)
    toy.fail = {f"{bank}:1"}
    kafka_log.append([delete(bank, i, op="op-1") for i in range(3)])
    r = runner(kafka_log, group, toy, dlq=dlq).start()
    try:
        assert r.wait_idle(timeout=60), r.lag(group)
    finally:
        assert r.stop(30)
    assert toy.attempts[f"{bank}:1"] == 3
    # the records after the poison one were handled: the partition kept flowing
    assert [s[2] for s in toy.seen if s[1] == bank] == [f"{bank}:0", f"{bank}:2"]
    [dead] = mine(kafka_log, dlq, {bank})
    h = dead.headers
    assert h["dlq_topic"] == INTAKE and h["dlq_group"] == group and h["dlq_attempts"] == "3"
    assert h["dlq_error"] == f"RuntimeError: boom {bank}:1" and "Traceback" in h["dlq_traceback"]
    assert codec.decode(dead).message.memory_id == f"{bank}:1"
    [failed] = [codec.decode(p).message for p in mine(kafka_log, PROGRESS, {bank})]
    assert failed.state == "failed" and failed.kind == "delete_memory"
    assert failed.operation_id == "op-1" and f"{group} could not process" in failed.error
    # the counter agrees with this runner's own DLQ (other tests' poison included)
    assert r.groups[group].stats["dead_lettered"] == len(mine(kafka_log, dlq, None))


def test_a_record_failing_for_want_of_disk_space_is_handled_again_not_dead_lettered(kafka_log):
    """A store on a full disk failed a record's every try and the record was
    dead-lettered (its operation FAILED, its effects never made) although it succeeds
    once there is room: it is handled again after a backoff until it does."""
    group, toy, dlq = f"toy-{_uid()}", Toy(), f"test.dlq.{_uid()}"
    bank = f"bank-{_uid()}"
    kafka_log.ensure_topic(INTAKE, 4)
    toy.no_room = {f"{bank}:1"}
    kafka_log.append([delete(bank, i, op="op-1") for i in range(3)])
    r = runner(kafka_log, group, toy, dlq=dlq).start()
    try:
        deadline_at = time.monotonic() + 60
        while toy.attempts[f"{bank}:1"] <= 3 and time.monotonic() < deadline_at:
            time.sleep(0.05)  # more tries than max_attempts: not dead-lettered
        assert toy.attempts[f"{bank}:1"] > 3
        toy.no_room.clear()  # room again
        assert r.wait_idle(timeout=60), r.lag(group)
    finally:
        assert r.stop(30)
    assert [s[2] for s in toy.seen if s[1] == bank] == [f"{bank}:0", f"{bank}:1", f"{bank}:2"]
    assert mine(kafka_log, dlq, {bank}) == [] and mine(kafka_log, PROGRESS, {bank}) == []


def test_an_output_larger_than_kafka_takes_fails_its_operation_at_once(kafka_log):
    """An output over Kafka's record size (a retain whose facts encode to more than
    1 MiB) would be as large on every attempt: it is dead-lettered at once, not retried
    (each retry re-ran the whole extraction), and its operation fails saying why."""
    group, toy, dlq = f"toy-{_uid()}", Toy(), f"test.dlq.{_uid()}"
    bank = f"bank-{_uid()}"
    kafka_log.ensure_topic(INTAKE, 4)
    toy.huge = {f"{bank}:1"}
    kafka_log.append([delete(bank, i, op=f"op-{i}") for i in range(3)])
    r = runner(kafka_log, group, toy, dlq=dlq).start()
    try:
        assert r.wait_idle(timeout=60), r.lag(group)
    finally:
        assert r.stop(30)
    assert toy.attempts[f"{bank}:1"] == 1
    assert [s[2] for s in toy.seen if s[1] == bank] == [f"{bank}:{i}" for i in range(3)]
    [dead] = mine(kafka_log, dlq, {bank})
    assert dead.headers["dlq_attempts"] == "1"
    assert dead.headers["dlq_error"].startswith("RecordTooLarge: FactsRetracted")
    [failed] = [m for m in (codec.decode(p).message for p in mine(kafka_log, PROGRESS, {bank}))
                if m.state == "failed"]
    assert failed.operation_id == "op-1" and "more than the event log takes" in failed.error


def test_a_dead_letter_too_large_for_the_dlq_goes_without_its_value(kafka_log):
    """A failing record close to Kafka's record size does not fit the DLQ with its
    ``dlq_*`` headers: its copy goes without the value (the original stays on its
    topic, where the headers point), and the partition flows on -- it used to retry
    producing the copy forever, stalling every bank on the partition."""
    from mneme.bus.dead_letter import VALUE_OMITTED

    group, toy, dlq = f"toy-{_uid()}", Toy(), f"test.dlq.{_uid()}"
    bank = f"bank-{_uid()}"
    kafka_log.ensure_topic(INTAKE, 4)
    toy.fail = {f"{bank}:1"}
    # padded with an unknown field (kept by protobuf): fits Kafka alone, not with the
    # dlq_* headers (a traceback) beside it
    pad = 1_047_500
    padding = bytes([15 << 3 | 2]) + _varint(pad) + b"y" * pad
    rec = delete(bank, 1, op="op-big")
    poison = dataclasses.replace(rec, value=rec.value + padding)
    inputs = kafka_log.append([delete(bank, 0), poison, delete(bank, 2)])
    r = runner(kafka_log, group, toy, dlq=dlq).start()
    try:
        assert r.wait_idle(timeout=60), r.lag(group)
    finally:
        assert r.stop(30)
    assert [s[2] for s in toy.seen if s[1] == bank] == [f"{bank}:0", f"{bank}:2"]
    [dead] = mine(kafka_log, dlq, {bank})
    assert dead.value == b"" and dead.headers[VALUE_OMITTED] == str(len(poison.value))
    assert dead.headers["dlq_offset"] == str(inputs[1].offset)
    assert dead.headers["dlq_error"] == f"RuntimeError: boom {bank}:1"
    [failed] = [codec.decode(p).message for p in mine(kafka_log, PROGRESS, {bank})]
    assert failed.operation_id == "op-big" and failed.state == "failed"


def test_two_runners_share_the_partitions_and_handle_each_record_once(kafka_log, tansu):
    from mneme.bus.logs import open_event_log

    group, toy = f"toy-{_uid()}", Toy()
    kafka_log.ensure_topic(INTAKE, 4)
    banks = banks_over_partitions(kafka_log.partitions(INTAKE), 8, f"bank-{_uid()}-")
    other = open_event_log(tansu.url, **KAFKA_TEST_OPTIONS)
    a = runner(kafka_log, group, toy, "a").start()
    b = runner(other, group, toy, "b").start()
    try:
        # both members in the group first, so the records are spread over them
        deadline = time.monotonic() + 60
        mine_a = mine_b = set()
        while time.monotonic() < deadline:
            kafka_log.append([delete(bk, 0) for bk in banks])
            time.sleep(0.5)
            assert a.wait_idle(timeout=60)
            with toy.lock:
                mine_a = {s[1] for s in toy.seen if s[0] == "a" and s[1] in banks}
                mine_b = {s[1] for s in toy.seen if s[0] == "b" and s[1] in banks}
            if mine_a and mine_b:
                break
        assert mine_a and mine_b, "both runners got partitions"
        with toy.lock:
            toy.seen.clear()
        kafka_log.append([delete(bk, n) for n in range(1, 6) for bk in banks])
        assert a.wait_idle(timeout=60) and b.wait_idle(timeout=60)
    finally:
        assert a.stop(30) and b.stop(30)
        other.close()
    handled = [(s[1], s[2]) for s in toy.seen if s[1] in banks]
    want = {(bk, f"{bk}:{n}") for n in range(1, 6) for bk in banks}
    # every record, none lost; once each (a revocation waits for the commit), unless a
    # member missed its heartbeats on a busy machine and its commit was refused: then the
    # new owner handles those records again (at least once)
    assert set(handled) == want
    assert len(handled) == len(want) or any(r.groups[group].stats["commit_failures"]
                                            for r in (a, b))
    by = {s[0] for s in toy.seen if s[1] in banks}
    assert by == {"a", "b"}


def test_a_new_runner_resumes_from_the_committed_offset_without_loss(kafka_log):
    """Stopped mid-stream, with a long handler in hand (it sees the stop as a cancelled
    deadline): nothing after the last committed record is lost or dead-lettered."""
    group, toy, dlq = f"toy-{_uid()}", Toy(), f"test.dlq.{_uid()}"
    bank = f"bank-{_uid()}"
    kafka_log.ensure_topic(INTAKE, 4)
    n = 40
    inputs = kafka_log.append([delete(bank, i) for i in range(n)])
    toy.slow[bank] = 0.02
    toy.stuck = {f"{bank}:12"}
    r = runner(kafka_log, group, toy, dlq=dlq).start()
    until = time.monotonic() + 60
    while time.monotonic() < until and not toy.attempts[f"{bank}:12"]:
        time.sleep(0.05)
    t0 = time.monotonic()
    assert r.stop(30) and time.monotonic() - t0 < 10
    first = [s[2] for s in toy.seen if s[1] == bank]
    assert first == [f"{bank}:{i}" for i in range(12)], "stopped mid-stream, in order"
    assert not mine(kafka_log, dlq, {bank})
    assert r.groups[group].stats["dead_lettered"] == len(mine(kafka_log, dlq, None))
    toy.stuck.clear()
    p = partition_for(bank, kafka_log.partitions(INTAKE))
    committed = kafka_log.committed(group, INTAKE, p)
    toy.slow.clear()
    r2 = runner(kafka_log, group, toy, "b").start()
    try:
        assert r2.wait_idle(timeout=60), r2.lag(group)
    finally:
        assert r2.stop(30)
    second = [s[2] for s in toy.seen if s[1] == bank and s[0] == "b"]
    ids = [f"{bank}:{i}" for i in range(n)]
    # the second runner starts exactly where the first committed; nothing is lost
    resume = next(i for i, rec in enumerate(inputs) if rec.offset >= committed)
    assert second == ids[resume:] and first[:resume] == ids[:resume]
    outs = {codec.decode(o).message.memory_ids[0] for o in mine(kafka_log, MEMORY, {bank})}
    assert outs == set(ids)


def test_records_of_one_partition_are_handled_in_order(kafka_log):
    group, toy = f"toy-{_uid()}", Toy()
    kafka_log.ensure_topic(INTAKE, 4)
    banks = banks_over_partitions(kafka_log.partitions(INTAKE), 4, f"bank-{_uid()}-")
    # interleaved appends: each bank's records are in order on its own partition
    kafka_log.append([delete(bk, i) for i in range(15) for bk in banks])
    r = runner(kafka_log, group, toy).start()
    try:
        assert r.wait_idle(timeout=60), r.lag(group)
    finally:
        assert r.stop(30)
    for bk in banks:
        assert [s[2] for s in toy.seen if s[1] == bk] == [f"{bk}:{i}" for i in range(15)]
    outs = mine(kafka_log, MEMORY, set(banks))
    for bk in banks:
        got = [codec.decode(o).message.memory_ids[0] for o in outs if o.key == bk]
        assert got == [f"{bk}:{i}" for i in range(15)]


@pytest.fixture(autouse=True)
def _quiet_faststream(caplog):
    caplog.set_level("WARNING", logger="faststream")


# ---- restore on assignment (Group.restore) -----------------------------------------------


def _decide(m: ev.FactsExtracted, meta, *, seen: list):
    """A consolidation-like handler: a decision per fact event, which comes back to it."""
    seen.append(("live", "FactsExtracted", m.operation_id))
    return [ev.ObservationsChanged(bank_id=m.bank_id, operation_id=m.operation_id)]


def _apply(m: ev.ObservationsChanged, meta, *, seen: list):
    seen.append(("live", "ObservationsChanged", m.operation_id))
    return []


def _restore(m, meta, *, seen: list):
    seen.append(("restore", type(m).__name__, m.operation_id))
    return []


def _self_loop() -> Service:
    kinds = (ev.FactsExtracted, ev.ObservationsChanged)
    return Service("loop", groups=(Group(
        "loop", {MEMORY: {ev.FactsExtracted: _decide, ev.ObservationsChanged: _apply}},
        restore={MEMORY: dict.fromkeys(kinds, _restore)}),),
        produces={MEMORY: (ev.ObservationsChanged,)})


def test_a_new_owner_restores_up_to_the_committed_offset_and_its_decisions(fresh_tansu,
                                                                          tmp_path):
    # The previous owner handled f1 and f2 (committed 2) and had decided f3 too, without
    # committing it: the log holds f1 f2 f3, then the decisions for all three, then one
    # of another cause. A new owner restores f1, f2 and *their* decisions only, then
    # handles f3 onwards itself, in order.
    from mneme.bus.logs import open_event_log

    log = open_event_log(fresh_tansu.url, **KAFKA_TEST_OPTIONS)
    try:
        log.ensure_topic(MEMORY, 1)
        bank, svc = "b", _self_loop()
        facts = log.append([codec.encode(ev.FactsExtracted(bank_id=bank, operation_id=f"f{i}"),
                                         bank_id=bank, source="mneme/extraction")
                            for i in (1, 2, 3)])
        encoder = Router(svc, "loop", {"seen": []})
        decisions = [encoder.encode([ev.ObservationsChanged(bank_id=bank, operation_id=f"f{i}")],
                                    codec.decode(rec).id)[0] for i, rec in zip((1, 2, 3), facts)]
        other = encoder.encode([ev.ObservationsChanged(bank_id=bank, operation_id="x")], "else")
        log.append(decisions + other)
        log.commit("loop", {(MEMORY, 0): 2})

        def start(seen: list) -> KafkaRunner:
            deps = {"seen": seen}
            return KafkaRunner(log, {"loop": Router(svc, "loop", deps)},
                               restorers={"loop": Router(svc, "loop", deps, restore=True)},
                               checkpoints=tmp_path / "restored.json",
                               dlq_topic=f"test.dlq.{_uid()}").start()

        seen: list = []
        r = start(seen)
        try:
            assert r.wait_idle(timeout=60), r.lag("loop")
        finally:
            assert r.stop(30)
        assert [s for s in seen if s[0] == "restore"] == [
            ("restore", "FactsExtracted", "f1"), ("restore", "FactsExtracted", "f2"),
            ("restore", "ObservationsChanged", "f1"), ("restore", "ObservationsChanged", "f2")]
        live = [s[1:] for s in seen if s[0] == "live"]
        assert live[:5] == [("FactsExtracted", "f3"), ("ObservationsChanged", "f1"),
                            ("ObservationsChanged", "f2"), ("ObservationsChanged", "f3"),
                            ("ObservationsChanged", "x")]
        assert ("ObservationsChanged", "f3") in live[5:]  # its own decision, come back
        # a restart on the same data dir resumes its state where it left it: nothing to
        # restore, and nothing handled twice
        again: list = []
        r = start(again)
        try:
            assert r.wait_idle(timeout=60)
            assert r.groups["loop"].restored == 0
        finally:
            assert r.stop(30)
        assert again == []
    finally:
        log.close()


def _slow_restore(m, meta, *, seen: list):
    time.sleep(0.03)  # a long history: the restore outlasts max.poll.interval.ms
    seen.append(("restore", type(m).__name__, m.operation_id, time.monotonic()))
    return []


def test_a_restore_longer_than_the_poll_interval_keeps_the_member_and_the_other_partitions(
        fresh_tansu, tmp_path):
    """A partition's restore runs step by step while the partition is paused: the
    consumer goes on polling, so a restore longer than ``max.poll.interval.ms`` does not
    drop the member (which would restore again, forever), and the group's other
    partitions are handled meanwhile; the restored partition's records come after."""
    from mneme.bus.logs import open_event_log

    log = open_event_log(fresh_tansu.url, **{**KAFKA_TEST_OPTIONS, "max_poll_interval_ms": 2000})
    try:
        log.ensure_topic(MEMORY, 2)
        old, new = banks_over_partitions(2, 2)
        kinds = (ev.FactsExtracted, ev.ObservationsChanged)
        svc = Service("slow", groups=(Group(
            "slow", {MEMORY: {ev.FactsExtracted: _decide, ev.ObservationsChanged: _apply}},
            restore={MEMORY: dict.fromkeys(kinds, _slow_restore)}),),
            produces={MEMORY: (ev.ObservationsChanged,)})
        history = 150
        log.append([codec.encode(ev.FactsExtracted(bank_id=old, operation_id=f"h{i}"),
                                 bank_id=old, source="mneme/extraction") for i in range(history)])
        p_old = partition_for(old, 2)
        log.commit("slow", {(MEMORY, p_old): history})  # handled before: restored, not decided
        seen: list = []
        deps = {"seen": seen}
        r = KafkaRunner(log, {"slow": Router(svc, "slow", deps)},
                        restorers={"slow": Router(svc, "slow", deps, restore=True)},
                        checkpoints=tmp_path / "restored.json",
                        dlq_topic=f"test.dlq.{_uid()}").start()
        try:
            deadline_at = time.monotonic() + 60
            while not any(s[0] == "restore" for s in seen) and time.monotonic() < deadline_at:
                time.sleep(0.05)
            # During the restore: a record of the other partition, and one of the restoring.
            log.append([codec.encode(ev.FactsExtracted(bank_id=b, operation_id=f"n-{b}"),
                                     bank_id=b, source="mneme/extraction") for b in (new, old)])
            assert r.wait_idle(timeout=120), r.lag("slow")
        finally:
            assert r.stop(30)
        restores = [s for s in seen if s[0] == "restore"]
        assert [s[2] for s in restores] == [f"h{i}" for i in range(history)]  # once, in order
        assert restores[-1][3] - restores[0][3] > 2.0  # longer than the poll interval
        live = [s[1:] for s in seen if s[0] == "live"]
        order = [s[:2] for s in seen]
        # the other partition was handled while the restore ran; the restored one after it
        assert order.index(("live", "FactsExtracted")) < len(restores)
        assert ("FactsExtracted", f"n-{old}") in live and ("FactsExtracted", f"n-{new}") in live
        first_old = next(i for i, s in enumerate(seen) if s[0] == "live" and s[2] == f"n-{old}")
        assert first_old > seen.index(restores[-1])
        assert r.groups["slow"].restored == history
    finally:
        log.close()


def _decide_retract(m: ev.MemoryDeleteRequested, meta, *, seen: list, name: str):
    """An extraction-like handler: a decision per input, on a changelog it does not read."""
    seen.append((name, "live", m.bank_id, m.memory_id))
    return [ev.FactsRetracted(bank_id=m.bank_id, memory_ids=[m.memory_id])]


def _restore_retract(m: ev.FactsRetracted, meta, *, seen: list, name: str):
    seen.append((name, "restore", m.bank_id, m.memory_ids[0]))
    return []


def test_a_partition_lost_before_a_stop_is_restored_later_with_the_new_owners_decisions(
        fresh_tansu, tmp_path):
    """Replica A loses a partition to B in a rebalance, B decides on it (its decisions on
    a changelog A does not read, as extraction's EntitiesResolved), then A stops: A's
    checkpoint must not claim B's decisions. When A gets the partition back, it restores
    them -- its stop marked the changelog's end for every partition it had ever handled,
    so it skipped them and resolved on stale state."""
    from mneme.bus.logs import open_event_log

    svc = Service("resolver", groups=(Group(
        "resolver", {INTAKE: {ev.MemoryDeleteRequested: _decide_retract}},
        restore={MEMORY: {ev.FactsRetracted: _restore_retract}}),),
        produces={MEMORY: (ev.FactsRetracted,)})
    logs = [open_event_log(fresh_tansu.url, **KAFKA_TEST_OPTIONS) for _ in range(3)]
    seen: list = []
    lock = threading.Lock()

    def start(log, name: str) -> KafkaRunner:
        deps = {"seen": seen, "name": name}
        return KafkaRunner(log, {"resolver": Router(svc, "resolver", deps)},
                           restorers={"resolver": Router(svc, "resolver", deps, restore=True)},
                           checkpoints=tmp_path / f"{name[0]}.json",
                           dlq_topic=f"test.dlq.{_uid()}").start()
    try:
        for t in (INTAKE, MEMORY):
            logs[0].ensure_topic(t, 2)
        banks = banks_over_partitions(2, 2)
        logs[0].append([delete(b, 0) for b in banks])
        a = start(logs[0], "a")
        assert a.wait_idle(timeout=60), a.lag("resolver")
        b = start(logs[1], "b")
        try:  # until each replica handles one of the banks
            deadline_at, n, owner = time.monotonic() + 120, 1, {}
            while time.monotonic() < deadline_at:
                logs[0].append([delete(bk, n) for bk in banks])
                assert a.wait_idle(timeout=60) and b.wait_idle(timeout=60)
                with lock:
                    owner = {bk: next(s[0] for s in reversed(seen) if s[1] == "live"
                                      and s[2] == bk) for bk in banks}
                n += 1
                if set(owner.values()) == {"a", "b"}:
                    break
            assert set(owner.values()) == {"a", "b"}, owner
            lost = next(bk for bk, who in owner.items() if who == "b")
            logs[0].append([delete(lost, f"by-b-{k}") for k in range(3)])
            assert b.wait_idle(timeout=60)
            by_b = [s[3] for s in seen if s[:3] == ("b", "live", lost)]
            assert {f"{lost}:by-b-{k}" for k in range(3)} <= set(by_b)
            assert a.stop(30)
        finally:
            a.stop(30)
            b.stop(30)
        seen.clear()
        again = start(logs[2], "a2")  # A's data dir, alone: both partitions back
        try:
            # every record is committed already (by a and b), so wait_idle alone can
            # return before a2 is assigned both partitions and has restored them
            run = again.groups["resolver"]
            deadline_at = time.monotonic() + 60
            while time.monotonic() < deadline_at and not (
                    run.owned.get(INTAKE) == {0, 1} and not run.restoring
                    and not run.restore_tasks):
                time.sleep(0.05)
            assert run.owned.get(INTAKE) == {0, 1} and not run.restoring, run.owned
            assert again.wait_idle(timeout=60), again.lag("resolver")
        finally:
            assert again.stop(30)
        restored = [s[3] for s in seen if s[:3] == ("a2", "restore", lost)]
        assert set(by_b) <= set(restored), (by_b, restored)
    finally:
        for log in logs:
            log.close()


def test_a_catch_up_is_bounded_when_the_broker_stops_answering_offset_fetches(kafka_log,
                                                                              monkeypatch):
    """A read's catch-up promises an answer within its timeout: a broker that answers the
    high-watermark fetch but then not the committed-offset fetch (it went away between
    the two) makes it return False, not wait for the OffsetFetch (40 s and more)."""
    import asyncio

    group, toy = f"toy-{_uid()}", Toy()
    bank = f"bank-{_uid()}"
    kafka_log.ensure_topic(INTAKE, 4)
    toy.stuck.add(f"{bank}:0")  # a record in hand, none handled: nothing done on it yet
    (rec,) = kafka_log.append([delete(bank, 0)])
    r = runner(kafka_log, group, toy).start()
    done: list[bool] = []
    try:
        while not toy.attempts.get(f"{bank}:0"):
            time.sleep(0.01)

        async def unanswered(*_):
            await asyncio.sleep(3600)

        monkeypatch.setattr(kafka_log, "_committed", unanswered)
        t = threading.Thread(target=lambda: done.append(
            r.catch_up({group: [(INTAKE, rec.partition)]}, timeout=1.0)), daemon=True)
        t.start()
        t.join(30)
        assert done == [False]
    finally:
        monkeypatch.undo()
        toy.stuck.clear()
        assert r.stop(30)
