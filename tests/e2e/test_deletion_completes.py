"""A deletion cut between its keys' destruction and its request's append (a failed
append here; a SIGKILL between the two leaves the same state on disk) completes itself:
at the next start of the server, or at the next write to the bank, ingest appends the
request the key store kept with the destroyed keys. Before, the stores served the deleted
content while its copy on the log was unreadable, the operation was never found, and
``mneme replay`` refused ("vector store has N units, live N+k")."""

from __future__ import annotations

import time

import grpc
import pytest

from mneme.bus import codec
from mneme.errors import Unavailable
from mneme.v1 import generations_pb2, operations_pb2

pytestmark = pytest.mark.slow

BANK = "b"
DELETIONS = {"document": "DocumentDeleteRequested", "memory": "MemoryDeleteRequested",
             "bank": "BankDeleted"}


class RefusedDeletions:
    """Ingest's event log, refusing the append of a deletion request (after ingest has
    destroyed the deletion's keys) while :attr:`refusing`; the operation ids refused."""

    def __init__(self, log, kind: str) -> None:
        self.log, self.kind, self.refusing, self.refused = log, kind, True, []

    def append(self, records):
        for r in records:
            msg = codec.decode(r).message
            if self.refusing and msg.DESCRIPTOR.name == self.kind:
                self.refused.append(msg.operation_id)
                raise Unavailable("injected: the event log did not take the record")
        return self.log.append(records)

    def __getattr__(self, name):
        return getattr(self.log, name)


def _start(data_dir):
    from mneme.client import MnemeClient
    from mneme.config import Settings
    from mneme.runtime.embedded import bootstrap
    n = bootstrap(Settings(data_dir=data_dir))
    n.start()
    n.client = MnemeClient(f"127.0.0.1:{n.serve('127.0.0.1:0')}", timeout=120)
    return n


def _stop(n) -> None:
    n.client.close()
    n.close()


def _memories(m, document_id: str) -> list[str]:
    return [x.id for x in m.list_memories(BANK, document_id=document_id)]


def _ended(m, operation_id: str, timeout: float = 120.0):
    """The operation once it has ended (NOT_FOUND while the catalog has not projected it
    yet, then fails the test at ``timeout``)."""
    end = time.monotonic() + timeout
    while True:
        try:
            op = m.get_operation(operation_id)
            if op.state in (operations_pb2.SUCCEEDED, operations_pb2.FAILED):
                return op
        except grpc.RpcError as e:
            if e.code() != grpc.StatusCode.NOT_FOUND or time.monotonic() > end:
                raise
        assert time.monotonic() < end, f"operation {operation_id} did not end"
        time.sleep(0.1)


def _settle(m, timeout: float = 120.0) -> None:
    end = time.monotonic() + timeout
    while m.bank_stats(BANK).pending_records and time.monotonic() < end:
        time.sleep(0.1)
    assert not m.bank_stats(BANK).pending_records


def _cut_deletion(n, kind: str) -> tuple[str, dict]:
    """Retain two documents, then a deletion of ``kind`` whose append fails: (its
    operation id, the memory ids per document before it)."""
    m = n.client
    m.upsert_bank(BANK)
    m.retain(BANK, [{"content": "Alice keeps bees on her roof in Porto.", "document_id": "d1"},
                    {"content": "Bob repairs old clocks in Lyon.", "document_id": "d2"}])
    _settle(m)
    before = {d: _memories(m, d) for d in ("d1", "d2")}
    assert before["d1"] and before["d2"]
    refusing = n.ingest.log = RefusedDeletions(n.ingest.log, DELETIONS[kind])
    with pytest.raises(grpc.RpcError) as e:
        if kind == "document":
            m.delete_document(BANK, "d1")
        elif kind == "memory":
            m.delete_memory(BANK, before["d1"][0])
        else:
            m.delete_bank(BANK)
    assert e.value.code() == grpc.StatusCode.UNAVAILABLE
    (op_id,) = refusing.refused
    return op_id, before


@pytest.mark.parametrize("kind", list(DELETIONS))
def test_a_deletion_whose_append_failed_completes_at_the_next_start(tmp_path, kind):
    n = _start(tmp_path / "data")
    try:
        op_id, before = _cut_deletion(n, kind)
    finally:
        _stop(n)
    n = _start(tmp_path / "data")  # a restart (a kill leaves the same keys.db and log)
    try:
        m = n.client
        op = _ended(m, op_id)
        assert op.state == operations_pb2.SUCCEEDED, op
        if kind == "bank":
            with pytest.raises(grpc.RpcError) as e:
                m.get_bank(BANK)
            assert e.value.code() == grpc.StatusCode.NOT_FOUND
        else:
            _settle(m)
            gone = before["d1"] if kind == "document" else before["d1"][:1]
            left = _memories(m, "d1") + _memories(m, "d2")
            assert not set(gone) & set(left)
            assert set(before["d2"]) <= set(left)
        # the log now says what the stores hold: a replay agrees and switches
        g = m.replay()
        assert g.state == generations_pb2.Generation.LIVE, g
    finally:
        _stop(n)


def test_a_deletion_whose_append_failed_completes_before_the_next_write_to_its_bank(tmp_path):
    """Without a restart: the next write to the bank appends the kept request first, so
    the deletion lands before the write (a document retained again after it stays)."""
    n = _start(tmp_path / "data")
    try:
        op_id, before = _cut_deletion(n, "document")
        m = n.client
        n.ingest.log.refusing = False  # the event log takes records again
        m.retain(BANK, [{"content": "Alice now keeps goats in Braga.", "document_id": "d1"}])
        assert _ended(m, op_id).state == operations_pb2.SUCCEEDED
        _settle(m)
        now = _memories(m, "d1")
        assert now and not set(now) & set(before["d1"])  # the old facts gone, the new kept
        assert set(before["d2"]) <= set(_memories(m, "d2"))
    finally:
        _stop(n)


@pytest.mark.parametrize("kind", list(DELETIONS))
def test_a_deletion_appended_again_after_a_start_is_harmless(tmp_path, kind):
    """A deletion whose append landed but whose kept request was not cleared (a kill
    right after the append) is appended again at the next start: the repeat leaves the
    operation SUCCEEDED, deletes nothing more, and a replay agrees."""
    n = _start(tmp_path / "data")
    try:
        m = n.client
        m.upsert_bank(BANK)
        m.retain(BANK, [{"content": "Alice keeps bees on her roof in Porto.",
                         "document_id": "d1"},
                        {"content": "Bob repairs old clocks in Lyon.", "document_id": "d2"}])
        _settle(m)
        before = {d: _memories(m, d) for d in ("d1", "d2")}

        def not_cleared(bank_id, operation_id):
            raise OSError("injected: killed before the kept request was cleared")
        n.ingest.keys.clear_pending = not_cleared
        if kind == "document":
            op = m.delete_document(BANK, "d1")
        elif kind == "memory":
            op = m.delete_memory(BANK, before["d1"][0])
        else:
            op = m.delete_bank(BANK)
        op_id = op.name.rsplit("/", 1)[-1] if op is not None else ""
        if kind == "bank":  # DeleteBank answers Empty: its operation from the kept request
            (kept,) = n.ingest.keys.pending_deletions(BANK)
            op_id = kept.operation_id
        assert _ended(m, op_id).state == operations_pb2.SUCCEEDED
    finally:
        _stop(n)
    n = _start(tmp_path / "data")
    try:
        m = n.client
        assert n.ingest.keys.pending_deletions() == []  # appended again, and cleared
        if kind != "bank":
            _settle(m)
            left = _memories(m, "d1") + _memories(m, "d2")
            gone = before["d1"] if kind == "document" else before["d1"][:1]
            assert not set(gone) & set(left) and set(before["d2"]) <= set(left)
        else:
            with pytest.raises(grpc.RpcError) as e:
                m.get_bank(BANK)
            assert e.value.code() == grpc.StatusCode.NOT_FOUND
        # the repeat is projected (every group idle) and the operation kept its end
        assert n.wait_idle(120)
        assert _ended(m, op_id).state == operations_pb2.SUCCEEDED
        assert m.replay().state == generations_pb2.Generation.LIVE
    finally:
        _stop(n)
