"""The KeyStore contract (:class:`mneme.ports.KeyStore`) against both adapters: the
embedded SQLite file (``:memory:`` and a file, two instances on it for the sharing tests)
and the compacted Kafka topic on a real tansu broker (two instances on their own
connections: two processes), each test on a topic of its own. The Kafka cases skip only
when the tansu binary is missing."""

from __future__ import annotations

import secrets
import threading
import time
import uuid
from pathlib import Path

import pytest

from mneme.keys import Keyring, LocalKms
from mneme.ports import PendingDeletion
from mneme.stores.keys_sqlite import SqliteKeyStore
from tests.integration.conftest import KAFKA_TEST_OPTIONS, running_tansu

W1, W2, W3 = b"\x01" * 40, b"\x02" * 40, b"\x03" * 40


@pytest.fixture(scope="module")
def broker(tmp_path_factory):
    with running_tansu(tmp_path_factory.mktemp("tansu") / "tansu.log") as b:
        yield b


class Backend:
    """Opens store instances over one place (a file, a topic); ``shared``: instances see
    each other's writes (all but ``:memory:``)."""

    shared = True

    def open(self):  # pragma: no cover - abstract
        raise NotImplementedError

    def close(self) -> None:
        pass


class SqliteMemory(Backend):
    shared = False

    def open(self):
        return SqliteKeyStore(":memory:")


class SqliteFile(Backend):
    def __init__(self, path: Path) -> None:
        self.path = str(path)

    def open(self):
        return SqliteKeyStore(self.path)


class Kafka(Backend):
    def __init__(self, url: str) -> None:
        self.url, self.topic = url, f"keys-{uuid.uuid4().hex[:8]}"
        self.logs, self.stores = [], []

    def open(self):
        from mneme.bus.logs import open_event_log
        from mneme.stores.keys_kafka import KafkaKeyStore
        log = open_event_log(self.url, **KAFKA_TEST_OPTIONS)
        self.logs.append(log)
        self.stores.append(KafkaKeyStore(log, self.topic, poll_s=0.2))
        return self.stores[-1]

    def close(self) -> None:  # also after a failed test: stop the background reads first
        for s in self.stores:
            s.close()
        for log in self.logs:
            log.close()


@pytest.fixture(params=["sqlite-memory", "sqlite-file", "kafka"])
def backend(request, tmp_path):
    if request.param == "kafka":
        b = Kafka(request.getfixturevalue("broker").url)
    elif request.param == "sqlite-file":
        b = SqliteFile(tmp_path / "keys.db")
    else:
        b = SqliteMemory()
    yield b
    b.close()


@pytest.fixture
def shared(backend):
    if not backend.shared:
        pytest.skip("one instance only (:memory:)")
    return backend


def test_first_writer_wins(backend):
    s = backend.open()
    assert s.bank_key("b") is None and s.get("b", "d:x#1") is None
    assert s.add_bank_key("b", W1) == W1
    assert s.add_bank_key("b", W2) == W1
    row = s.add("b", "d:x#1", "d:x", W1)
    assert (row.scope, row.wrapped) == ("d:x", W1)
    again = s.add("b", "d:x#1", "d:y", W2)
    assert (again.scope, again.wrapped) == ("d:x", W1)
    assert s.get("b", "d:x#1").wrapped == W1
    assert s.get("other", "d:x#1") is None  # per bank
    s.close()


def test_add_many_is_add_of_every_row_at_once(backend):
    s = backend.open()
    s.add("b", "f:1", "d:x", W1)
    s.destroy("b", ["f:2"])
    got = s.add_many("b", [("f:1", "d:x", W2), ("f:2", "d:x", W2), ("f:3", "d:x", W2),
                           ("f:3", "d:y", W1)])
    assert got["f:1"].wrapped == W1  # the first writer's
    assert got["f:2"].wrapped is None  # destroyed stays destroyed
    assert (got["f:3"].scope, got["f:3"].wrapped) == ("d:x", W2)
    assert s.get("b", "f:3").wrapped == W2 and s.add_many("b", []) == {}
    s.close()



def test_get_many_is_get_of_every_id_at_once(backend):
    s = backend.open()
    s.add_many("b", [(f"f:{i}", "d:x", W1) for i in range(600)])  # past one IN (...) batch
    s.add("other", "f:1", "d:x", W2)
    s.destroy("b", ["f:7", "f:gone"])
    ids = [f"f:{i}" for i in range(600)] + ["f:gone", "f:never", "f:3"]
    got = s.get_many("b", ids)
    assert set(got) == {f"f:{i}" for i in range(600)} | {"f:gone"}  # unknown ids absent
    assert all(got[k] == s.get("b", k) for k in got)
    assert got["f:7"].wrapped is None and got["f:gone"].wrapped is None  # tombstones
    assert got["f:1"].wrapped == W1  # this bank's, not the other bank's
    assert s.get_many("b", []) == {} and s.get_many("nobank", ["f:1"]) == {}
    s.close()

def test_first_writer_wins_across_two_instances(shared):
    a, b = shared.open(), shared.open()
    assert a.add_bank_key("b", W1) == W1
    assert b.add_bank_key("b", W2) == W1
    assert a.add("b", "f:1", "d:x", W1).wrapped == W1
    assert b.add("b", "f:1", "d:x", W2).wrapped == W1
    # racing writers of one new id, one per instance: both get the same winner
    got: dict[str, bytes] = {}
    barrier = threading.Barrier(2)

    def write(name, store, wrapped):
        barrier.wait()
        got[name] = store.add("b", "f:race", "d:x", wrapped).wrapped
    threads = [threading.Thread(target=write, args=("a", a, W2)),
               threading.Thread(target=write, args=("b", b, W3))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert got["a"] == got["b"] in (W2, W3)
    assert a.get("b", "f:race").wrapped == b.get("b", "f:race").wrapped == got["a"]
    a.close()
    b.close()
    c = shared.open()  # a replay (reopen) picks the same winner
    assert c.get("b", "f:race").wrapped == got["a"] and c.bank_key("b") == W1
    c.close()


def test_destroyed_ids_stay_destroyed_across_a_reopen(shared):
    s = shared.open()
    s.add_bank_key("b", W1)
    s.add("b", "d:x#1", "d:x", W1)
    assert s.destroy("b", ["d:x#1", "f:never-made"]) == ["d:x#1", "f:never-made"]
    for k in ("d:x#1", "f:never-made"):
        assert s.get("b", k).wrapped is None
        assert s.add("b", k, "d:x", W2).wrapped is None  # never created again
    assert s.get("b", "d:x#1").scope == "d:x"
    s.close()
    r = shared.open()
    for k in ("d:x#1", "f:never-made"):
        assert r.get("b", k) is not None and r.get("b", k).wrapped is None
        assert r.add("b", k, "d:x", W3).wrapped is None
    assert r.current("b", "d:x") is None
    r.close()


def test_current_is_the_newest_live_generation(backend):
    s = backend.open()
    assert s.current("b", "d:x") is None
    s.add("b", "d:x#1", "d:x", W1)
    time.sleep(0.002)  # the SQLite adapter orders by creation time
    s.add("b", "d:x#2", "d:x", W2)
    time.sleep(0.002)
    s.add("b", "f:fact", "d:x", W3)  # in the scope, but not a generation
    s.add("b", "d:xy#1", "d:xy", W3)  # a scope sharing the prefix
    assert s.current("b", "d:x") == "d:x#2"
    s.destroy("b", ["d:x#2"])
    assert s.current("b", "d:x") == "d:x#1"
    assert s.current("b", "d:xy") == "d:xy#1"
    assert s.current("other", "d:x") is None
    s.close()


def test_destroy_scope_and_destroy_bank(backend):
    s = backend.open()
    s.add_bank_key("b", W1)
    s.add_bank_key("c", W2)
    for k, scope in (("d:x#1", "d:x"), ("f:1", "d:x"), ("d:y#1", "d:y"), ("bank", "bank")):
        s.add("b", k, scope, W1)
    s.add("c", "d:x#1", "d:x", W2)
    assert sorted(s.destroy_scope("b", "d:x")) == ["d:x#1", "f:1"]
    assert s.destroy_scope("b", "d:x") == []  # nothing live left in it
    assert s.get("b", "f:1").wrapped is None and s.get("b", "d:y#1").wrapped == W1
    assert s.get("c", "d:x#1").wrapped == W2  # another bank's scope of the same name
    s.destroy_bank("b")
    assert s.bank_key("b") is None
    assert all(s.get("b", k) is None for k in ("d:x#1", "f:1", "d:y#1", "bank"))
    assert s.current("b", "d:y") is None
    assert s.bank_key("c") == W2 and s.get("c", "d:x#1").wrapped == W2
    # the bank can be made again, from scratch
    assert s.add_bank_key("b", W3) == W3
    assert s.add("b", "d:y#2", "d:y", W3).wrapped == W3
    s.close()
    if backend.shared:
        r = backend.open()
        assert r.bank_key("b") == W3 and r.get("b", "d:y#1") is None
        assert r.get("b", "d:y#2").wrapped == W3 and r.get("c", "d:x#1").wrapped == W2
        r.close()


def test_listeners_hear_of_destructions(backend):
    s = backend.open()
    heard: list = []
    s.listen(lambda bank, ids: heard.append((bank, ids)))
    s.add("b", "d:x#1", "d:x", W1)
    s.destroy_scope("b", "d:x")
    s.destroy_bank("b")
    assert ("b", ["d:x#1"]) in heard and ("b", None) in heard
    s.close()


def _wait(predicate, timeout: float = 10.0) -> bool:
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.05)
    return True


def test_a_second_process_learns_a_destruction(backend):
    """Two processes on one Kafka key topic: keys destroyed by one leave the other's
    Keyring caches (it no longer decrypts), without it asking the store."""
    if not isinstance(backend, Kafka):
        pytest.skip("the embedded key store has one process (its data dir's lock)")
    kms = LocalKms(secrets.token_bytes(32))
    here, there = Keyring(backend.open(), kms), Keyring(backend.open(), kms)
    doc = here.current("b", "d:doc1")
    other = here.current("b", "d:doc2")
    k1, k2 = here.key("b", doc), here.key("b", other)
    assert there.key("b", doc) == k1 and there.key("b", other) == k2  # now cached there
    assert there.combined("b", [doc]) is not None
    here.destroy_scope("b", "d:doc1")
    assert _wait(lambda: there.key("b", doc) is None)
    assert there.combined("b", [doc]) is None and there.key("b", other) == k2
    here.destroy_bank("b")
    assert _wait(lambda: there.key("b", other) is None)
    assert there.store.bank_key("b") is None
    here.store.close()
    there.store.close()


def test_kafka_a_late_candidate_loses_in_every_replay(backend):
    """A writer that decided before it saw the winner's record appends its own candidate
    after it: every instance, and every replay, keeps the first in partition order."""
    if not isinstance(backend, Kafka):
        pytest.skip("candidates are records of the Kafka key topic")
    import base64
    import json

    from mneme.ports import OutRecord
    a = backend.open()
    assert a.add("b", "f:1", "d:x", W1).wrapped == W1
    late = {"bank": "b", "key": "f:1", "scope": "d:x",
            "wrapped": base64.b64encode(W2).decode()}
    backend.logs[0].append([OutRecord(backend.topic, "b/f:1/late", json.dumps(late).encode())])
    a.catch_up()
    assert a.get("b", "f:1").wrapped == W1
    b = backend.open()
    assert b.get("b", "f:1").wrapped == W1 and b.add("b", "f:1", "d:x", W3).wrapped == W1
    # destroying overwrites every candidate, the late one too: no wrapped bytes remain in
    # the records' latest values (what compaction keeps)
    b.destroy("b", ["f:1"])
    latest: dict[str, bytes] = {}
    offset = 0
    while batch := backend.logs[0].read(backend.topic, 0, offset, 500):
        for r in batch:
            latest[r.key] = r.value
        offset = batch[-1].offset + 1
    assert "b/f:1/late" in latest
    assert all(json.loads(v).get("destroyed") for k, v in latest.items() if "f:1" in k)
    assert a.get("b", "f:1").wrapped is None
    a.close()
    b.close()


def test_a_destroy_keeps_its_deletion_pending_until_cleared(backend):
    """A destroy given the deletion's request keeps it with the destruction (also when
    nothing was live to destroy), across a reopen, until it is cleared: what ingest
    appends again when the append after the destroy never happened."""
    s = backend.open()
    s.add("b", "d:x#1", "d:x", W1)
    s.add("b", "f:1", "d:x", W1)
    p1, p2 = PendingDeletion("b", "op1", b"req1"), PendingDeletion("b", "op2", b"req2")
    p3 = PendingDeletion("c", "op3", b"\x00req3")
    assert sorted(s.destroy_scope("b", "d:x", p1)) == ["d:x#1", "f:1"]
    assert s.destroy("b", ["f:9"], p2) == ["f:9"]
    assert s.destroy_scope("c", "d:none", p3) == []  # nothing live: still kept
    assert s.destroy("b", ["f:2"]) == ["f:2"]  # without a request: nothing kept
    assert s.get("b", "f:1").wrapped is None and s.get("b", "f:9").wrapped is None
    assert s.pending_deletions() == [p1, p2, p3]
    assert s.pending_deletions("b") == [p1, p2] and s.pending_deletions("d") == []
    s.clear_pending("b", "op1")
    s.clear_pending("b", "unknown")  # no-op
    assert s.pending_deletions() == [p2, p3]
    s.close()
    if backend.shared:
        r = backend.open()
        assert r.pending_deletions() == [p2, p3]
        r.clear_pending("c", "op3")
        assert r.pending_deletions() == [p2]
        r.close()


def test_a_bank_deletion_replaces_the_banks_pending_deletions(backend):
    """A DeleteBank's request deletes what the bank's earlier pending deletions would:
    it replaces them; another bank's stay, and so do those made after it."""
    s = backend.open()
    s.add_bank_key("b", W1)
    s.add("b", "d:x#1", "d:x", W1)
    p1, p3 = PendingDeletion("b", "op1", b"r1"), PendingDeletion("c", "op3", b"r3")
    pb, p4 = PendingDeletion("b", "opb", b"rb"), PendingDeletion("b", "op4", b"r4")
    s.destroy_scope("b", "d:x", p1)
    s.destroy("c", ["f:1"], p3)
    s.destroy_bank("b", pb)
    assert s.bank_key("b") is None
    assert s.pending_deletions() == [p3, pb] and s.pending_deletions("b") == [pb]
    s.add_bank_key("b", W2)  # the bank made again, and a document of it deleted
    s.destroy("b", ["f:2"], p4)
    assert s.pending_deletions("b") == [pb, p4]
    s.close()
    if backend.shared:
        r = backend.open()
        assert r.pending_deletions() == [p3, pb, p4]
        r.close()


def test_kafka_a_pending_deletion_whose_markers_were_cut_destroys_its_keys(backend):
    """On Kafka a deletion's request goes first, then its markers (one append is not
    atomic): a crash between them leaves the request with live keys. pending_deletions
    produces the missing markers before it returns the deletion."""
    if not isinstance(backend, Kafka):
        pytest.skip("the SQLite store writes the request and the destruction in one "
                    "transaction")
    import base64
    import json

    from mneme.ports import OutRecord
    a = backend.open()
    a.add_bank_key("b", W1)
    a.add("b", "f:1", "d:x", W1)
    a.add("b", "f:2", "d:x", W2)
    a.add_bank_key("c", W3)

    def request_only(bank, op, keys):  # what a crash after the first record leaves
        backend.logs[0].append([OutRecord(backend.topic, f"{bank}//pending/{op}", json.dumps({
            "bank": bank, "key": None, "pending": op, "keys": keys,
            "request": base64.b64encode(op.encode()).decode()}).encode())])
    request_only("b", "op1", ["f:1"])
    request_only("c", "opc", None)  # a DeleteBank
    b = backend.open()
    assert b.get("b", "f:1").wrapped == W1 and b.bank_key("c") == W3  # still live
    assert b.pending_deletions() == [PendingDeletion("b", "op1", b"op1"),
                                     PendingDeletion("c", "opc", b"opc")]
    assert b.get("b", "f:1").wrapped is None and b.get("b", "f:2").wrapped == W2
    assert b.bank_key("c") is None
    a.catch_up()
    assert a.get("b", "f:1").wrapped is None and a.bank_key("c") is None
    assert a.pending_deletions() == b.pending_deletions()  # kept until cleared
    a.close()
    b.close()


def test_kafka_pending_records_are_skipped_by_earlier_versions(backend):
    """A process of an earlier version (a rolling upgrade) reads a record with a null
    ``key`` as a bank key candidate and failed on a pending deletion's (KeyError
    'wrapped', stuck at that offset) unless it says ``destroyed``, which it skips."""
    if not isinstance(backend, Kafka):
        pytest.skip("records of the Kafka key topic")
    import json
    s = backend.open()
    s.destroy("b", ["f:1"], PendingDeletion("b", "op1", b"r"))
    s.destroy_bank("c", PendingDeletion("c", "op2", b"r"))
    s.clear_pending("b", "op1")
    values = [json.loads(r.value) for r in backend.logs[0].read(backend.topic, 0, 0, 500)]
    pending = [v for v in values if "pending" in v]
    assert len(pending) == 3 and all(v["key"] is None and v["destroyed"] for v in pending)
    s.close()
