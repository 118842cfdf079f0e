"""Many clients on one bank at once, against a real ``mneme up``: writes racing a
DeleteBank, sync calls whose bank goes away, and a graceful stop with work in flight.
Every call ends with a status that says what happened, every operation ends, and
nothing of a deleted bank comes back."""

from __future__ import annotations

import itertools
import sqlite3
import threading
import time

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from mneme.events.v1 import events_pb2 as ev
from mneme.v1 import entities_pb2, operations_pb2
from tests.e2e.server import Server
from tests.waits import drained

pytestmark = pytest.mark.slow
PENDING, RUNNING = operations_pb2.PENDING, operations_pb2.RUNNING


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    s = Server(tmp_path_factory.mktemp("concurrency") / "data").start()
    yield s
    s.stop()
    # no client's action may cost the server a traceback
    assert "Traceback" not in s.log.read_text(errors="replace"), s.log.read_text()[-3000:]


@pytest.fixture(scope="module")
def m(server):
    with server.client(timeout=120) as c:
        yield c


def _delete_bank(m, bank: str, timeout: float = 120.0) -> None:
    """DeleteBank; on a loaded machine the call may run out of its 30 s (the deletion goes
    on): then until the catalog no longer lists the bank."""
    try:
        m.delete_bank(bank)
        return
    except grpc.RpcError as e:
        if e.code() != grpc.StatusCode.DEADLINE_EXCEEDED:
            raise
    end = time.monotonic() + timeout
    while any(b.name == f"banks/{bank}" for b in m.list_banks()):
        assert time.monotonic() < end, f"bank {bank!r} still listed {timeout}s after its deletion"
        time.sleep(0.1)


def _hammer(server, bank: str, writers: int, stop: threading.Event, errors: list,
            async_: bool) -> list[threading.Thread]:
    """``writers`` threads retaining into ``bank`` until ``stop``, each on a client of its
    own; every status other than OK and NOT_FOUND (the bank is gone) lands in ``errors``."""
    def write(n: int) -> None:
        with server.client(timeout=60) as c:
            i = 0
            while not stop.is_set():
                i += 1
                try:
                    c.retain(bank, [{"content": f"Writer {n} saw heron number {i} at the lake.",
                                     "document_id": f"w{n}-{i}"}], async_=async_)
                except grpc.RpcError as e:
                    if e.code() != grpc.StatusCode.NOT_FOUND:
                        errors.append((e.code(), e.details()))
    threads = [threading.Thread(target=write, args=(n,), daemon=True) for n in range(writers)]
    for t in threads:
        t.start()
    return threads


@pytest.mark.parametrize("async_", [True, False], ids=["async", "sync"])
def test_retains_racing_delete_bank_leave_nothing_in_the_bank_made_again(server, m, async_):
    """Writers retain into a bank while it is deleted. A retain either lands before the
    deletion (and goes with it) or is refused NOT_FOUND; none is stored after it, so the
    bank created again under the same id starts empty, and a sync retain whose bank is
    deleted under it ends at once (it does not wait out its deadline)."""
    bank = f"race-{'a' if async_ else 's'}"
    for round_ in range(3):
        m.upsert_bank(bank)
        stop, errors = threading.Event(), []
        threads = _hammer(server, bank, 6, stop, errors, async_)
        try:
            # deleted once writes are flowing: some retains are in flight at that moment
            while not list(m.list_operations(bank, page_size=1)):
                time.sleep(0.02)
            _delete_bank(m, bank)
        finally:  # the writers stop also when the deletion failed
            stop.set()
        for t in threads:
            t.join(120)
        assert not any(t.is_alive() for t in threads), "a retain did not return"
        assert not errors, errors[:3]
        m.upsert_bank(bank)
        drained(m, bank)
        assert not list(m.list_memories(bank)), f"round {round_}: memories after deletion"
        assert not list(m.list_documents(bank)), f"round {round_}: documents after deletion"
        assert not m.recall(bank, "heron at the lake").results
        _delete_bank(m, bank)


def test_updates_racing_delete_bank_never_bring_the_bank_back(server, m):
    """UpdateBank calls while the bank is deleted: each lands before the deletion or is
    NOT_FOUND. An update appended after the deletion would create the bank again (with
    the masked fields only) after DeleteBank returned."""
    for round_ in range(3):
        bank = f"upd-{round_}"
        m.upsert_bank(bank)
        stop, errors, done = threading.Event(), [], []

        def update(n: int) -> None:
            with server.client(timeout=60) as c:
                while not stop.is_set():
                    try:
                        c.update_bank(bank, retain_mission=f"mission {n}")
                        done.append(n)
                    except grpc.RpcError as e:
                        if e.code() != grpc.StatusCode.NOT_FOUND:
                            errors.append((e.code(), e.details()))
        threads = [threading.Thread(target=update, args=(n,), daemon=True) for n in range(6)]
        for t in threads:
            t.start()
        try:
            while not done:  # updates are flowing
                time.sleep(0.01)
            _delete_bank(m, bank)
        finally:
            stop.set()
        for t in threads:
            t.join(120)
        assert not errors, errors[:3]
        with pytest.raises(grpc.RpcError) as e:
            m.get_bank(bank)
        assert e.value.code() == grpc.StatusCode.NOT_FOUND, f"round {round_}: bank is back"


def _retains_on_the_log(server, operation_id: str) -> int:
    """How many RetainRequested of ``operation_id`` the intake topic holds (ids are in
    the clear; the log is read while the server runs, as any reader of its file may)."""
    db = sqlite3.connect(f"file:{server.data_dir / 'log.db'}?mode=ro", uri=True)
    try:
        rows = db.execute("SELECT value FROM records WHERE topic = 'mneme.intake.v1' AND "
                          "headers LIKE '%RetainRequested%'").fetchall()
    finally:
        db.close()
    return sum(ev.RetainRequested.FromString(v).operation_id == operation_id for v, in rows)


def test_the_same_retry_asked_for_at_once_is_appended_once(server, m):
    """RetryOperation called by several clients at the same moment (a client's retry of
    the retry racing the first): one new operation, appended once. Each extra copy was
    extracted again and replaced its documents' facts a second time."""
    m.upsert_bank("retry-race")
    for round_ in range(3):
        # a slow retain ahead keeps the next one pending, so its cancel stops it whole
        m.retain("retry-race", [{"content": "Boats rest in the harbour all winter. " * 60,
                                 "document_id": f"filler-{round_}-{j}"} for j in range(3)],
                 async_=True)
        op = m.retain("retry-race", [{"content": f"Ola{round_} sails to Bergen, leg {j}.",
                                      "document_id": f"trip-{round_}"} for j in range(5)],
                      async_=True).operation
        m.cancel_operation(op.name)
        while m.get_operation(op.name).state in (PENDING, RUNNING):
            time.sleep(0.05)
        assert m.get_operation(op.name).state == operations_pb2.FAILED
        barrier, names = threading.Barrier(4), []

        def retry() -> None:
            with server.client(timeout=60) as c:
                barrier.wait()
                names.append(c.retry_operation(op.name).name)
        threads = [threading.Thread(target=retry) for _ in range(4)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(120)
        assert len(names) == 4 and len(set(names)) == 1, names
        assert _retains_on_the_log(server, names[0].split("/", 1)[1]) == 1, f"round {round_}"
        while m.get_operation(names[0]).state in (PENDING, RUNNING):
            time.sleep(0.05)
        assert m.get_operation(names[0]).state == operations_pb2.SUCCEEDED
        assert len(list(m.list_memories("retry-race", document_id=f"trip-{round_}"))) == 5


def _after(order, entities: dict[str, frozenset], merges) -> dict[str, frozenset]:
    """The entities (id → aliases) after ``merges`` [(survivor, merged ids)] applied one
    after another in ``order``: a merge whose survivor is gone changes nothing (it would
    have been refused had it come a moment later), merged ids already gone are skipped."""
    ents = dict(entities)
    for i in order:
        survivor, merged = merges[i]
        if survivor not in ents:
            continue
        for e in merged:
            if e in ents and e != survivor:
                ents[survivor] = ents[survivor] | ents.pop(e)
    return ents


def test_merges_of_the_same_entities_at_once_end_as_some_serial_order(server, m):
    """Three clients merge overlapping entities at the same moment (Liz into Elizabeth,
    Elizabeth into Liz, Liz into Beth). Each merge is checked against the graph as it
    was, so all three can reach the log. The entities must then be what the merges give
    applied one after another in some order, and every merge operation must end. Before,
    a merge whose survivor had been merged away meanwhile built it anew from the entity
    it named, and Liz came back holding Elizabeth's alias while Beth held Liz's."""
    for round_ in range(8):
        bank = f"merge-race-{round_}"
        m.upsert_bank(bank)
        m.retain(bank, [{"content": "Liz adopted a puppy in March."},
                        {"content": "Elizabeth started a pottery class."},
                        {"content": "Beth went to Paris with Tom."}])
        by_name = {e.display_name: e.name.rsplit("/", 1)[1] for e in m.list_entities(bank)}
        liz, eliz, beth = by_name["Liz"], by_name["Elizabeth"], by_name["Beth"]
        before = {e.name.rsplit("/", 1)[1]: frozenset(e.aliases)
                  for e in m.list_entities(bank) if e.display_name in ("Liz", "Elizabeth", "Beth")}
        merges = [(eliz, [liz]), (liz, [eliz]), (beth, [liz])]
        barrier, answers = threading.Barrier(len(merges)), []

        def merge(survivor: str, merged: list[str]) -> None:
            with server.client(timeout=60) as c:
                barrier.wait()
                try:
                    c.merge_entities(bank, [survivor, *merged])
                    answers.append("OK")
                except grpc.RpcError as e:
                    answers.append(e.code().name)
        threads = [threading.Thread(target=merge, args=mg) for mg in merges]
        for t in threads:
            t.start()
        for t in threads:
            t.join(120)
        assert set(answers) <= {"OK", "NOT_FOUND"}, answers
        # every merge that reached the log ends (its progress reaches the catalog just
        # after the call returns)
        end = time.monotonic() + 60
        while True:
            ops = [o for o in m.list_operations(bank) if o.kind == "merge_entities"]
            if ops and all(o.state in (operations_pb2.SUCCEEDED, operations_pb2.FAILED)
                           for o in ops):
                break
            assert time.monotonic() < end, ops
            time.sleep(0.05)
        after = {e.name.rsplit("/", 1)[1]: frozenset(e.aliases) for e in m.list_entities(bank)
                 if e.name.rsplit("/", 1)[1] in before}
        serial = [_after(order, before, merges)
                  for order in itertools.permutations(range(len(merges)))]
        assert after in serial, (round_, answers, after, serial)
        # the mentions stay where the entities are: three memories, each on one of them
        assert sum(e.mention_count for e in m.list_entities(bank)
                   if e.name.rsplit("/", 1)[1] in after) == 3


def test_corrections_waiting_behind_a_large_retain_leave_threads_for_other_calls(tmp_path):
    """Entity merges wait until extraction and the graph have applied them, minutes behind
    a large retain. With 6 gRPC workers (so 2 waiting calls) and 6 merges sent at once,
    2 wait and the others are RESOURCE_EXHAUSTED at once without writing anything, and a
    health check, a GetBank and the CancelOperation that frees extraction are served
    while the 2 still wait; when their callers cancel, their slots are free at once.
    Before, the merges took every worker: the health check and every other call queued
    until a merge gave up after 60 s, cancelled or not."""
    s = Server(tmp_path / "data", env={"MNEME_GRPC_WORKERS": "6"}).start()
    try:
        with s.client(timeout=120) as m:
            m.upsert_bank("busy")
            names = ["Alice", "Bruno", "Carla", "Dmitri", "Elena", "Farid", "Greta", "Hiro",
                     "Ines", "Jonas", "Kofi", "Lena", "Mateo", "Nadia", "Oskar", "Priya"]
            m.retain("busy", [{"content": f"{n} visited the museum on Friday."} for n in names])
            ids = {e.display_name: e.name.rsplit("/", 1)[1] for e in m.list_entities("busy")}
            people = [n for n in names if n in ids][:12]  # those the offline extractor found
            pairs = [(ids[a], ids[b]) for a, b in zip(people[::2], people[1::2])]
            assert len(pairs) >= 6, ids
            big = m.retain("busy", [{"content": f"The committee reviewed budget line {j} and "
                                                "approved the transfer to the harbour fund. " * 25}
                                    for j in range(1000)], async_=True).operation

            def merge(pair):
                return m.entities.MergeEntities.future(entities_pb2.MergeEntitiesRequest(
                    parent="banks/busy", entities=[f"banks/busy/entities/{e}" for e in pair]),
                    timeout=300)

            def code(call) -> str:
                return call.code().name if call.exception() else "OK"
            first = [merge(p) for p in pairs[:6]]
            while sum(c.done() for c in first) < 4:
                time.sleep(0.05)
            done = [c for c in first if c.done()]
            assert [code(c) for c in done] == ["RESOURCE_EXHAUSTED"] * 4
            health = health_pb2_grpc.HealthStub(m.channel)
            assert health.Check(health_pb2.HealthCheckRequest(), timeout=120).status == \
                health_pb2.HealthCheckResponse.SERVING
            assert m.get_bank("busy").name == "banks/busy"
            waiting = [c for c in first if c not in done]
            assert len(waiting) == 2 and not any(c.done() for c in waiting)
            # the callers of the two waiting merges go away: their threads and slots are
            # free again (the merges are on the log and still apply), long before the
            # 60 s a merge waits at most
            for c in waiting:
                c.cancel()
            end = time.monotonic() + 30
            while True:
                again = merge(pairs[-1])
                try:
                    again.exception(timeout=2)  # a refusal answers at once
                except grpc.FutureTimeoutError:
                    break  # it waits: it got a slot
                assert again.code() == grpc.StatusCode.RESOURCE_EXHAUSTED, again.exception()
                assert time.monotonic() < end, "cancelled merges still hold their slots"
                time.sleep(0.05)
            m.cancel_operation(big.name)  # extraction is free: the merges apply
            again.result(timeout=300)
            end = time.monotonic() + 60  # their progress reaches the catalog just after
            while True:
                merges = [o for o in m.list_operations("busy") if o.kind == "merge_entities"]
                if all(o.state == operations_pb2.SUCCEEDED for o in merges):
                    break
                assert time.monotonic() < end, merges
                time.sleep(0.05)
            assert len(merges) == 3, merges  # the two cancelled calls' merges, the last one
    finally:
        s.stop()
