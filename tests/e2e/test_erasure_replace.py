"""Erasure of a replaced document, embedded: retaining a document id again replaces the
document, and the replaced version's text must then be readable from no record of the
event log (opened with every key there is), while the new version stays whole --
live and after ``mneme replay``. Also a retry (same request_id) of the replacing
retain, and an async replacing retain."""

from __future__ import annotations

import time

import pytest

from mneme.events.v1 import events_pb2 as ev
from tests.e2e.server import Server
from tests.e2e.test_erasure import Everything

MARKER = "Zebulon-7731"
V1 = [f"Wanda keeps the spare key under the blue pot; the alarm code is {MARKER}.",
      f"Wanda told Tom the code {MARKER} on Monday."]
V2 = ["Wanda moved the spare key to the garage shelf.",
      "Wanda changed the alarm and told nobody the new code."]
V3 = ["Wanda sold the house in June."]


def _opened_text(data) -> str:
    ext = Everything(data)
    try:
        return "\n".join(str(msg) for _, msg in ext.opened())
    finally:
        ext.close()


def _retained(data, bank: str) -> list[str]:
    ext = Everything(data)
    try:
        return sorted(i.content for r, msg in ext.opened() if r.key == bank
                      and isinstance(msg, ev.RetainRequested) for i in msg.items if i.content)
    finally:
        ext.close()


def _texts(m, bank: str) -> str:
    out = [x.text for x in m.list_memories(bank)]
    for q in ("Where is the spare key?", "alarm code", MARKER):
        r = m.recall(bank, q, budget="high", max_tokens=8192)
        out += [x.memory.text for x in r.results]
    return "\n".join(out)


@pytest.fixture(scope="module")
def replaced(tmp_path_factory):
    data = tmp_path_factory.mktemp("replace") / "data"
    server = Server(data).start()
    try:
        with server.client() as m:
            m.upsert_bank("rp")
            m.retain("rp", [{"content": c, "document_id": "house"} for c in V1])
            assert MARKER in _texts(m, "rp")
            assert MARKER in _opened_text(data)
            # the replacement, sent twice with one request_id (a retry whose answer was
            # lost): the repeat must not destroy what the first wrote
            items = [{"content": c, "document_id": "house"} for c in V2]
            first = m.retain("rp", items, request_id="replace-1")
            again = m.retain("rp", items, request_id="replace-1")
            assert first.operation.name == again.operation.name
            # async, on another bank: the replaced version of it goes just the same
            m.upsert_bank("ra")
            m.retain("ra", [{"content": c, "document_id": "house"} for c in V1])
            op = m.retain("ra", [{"content": c, "document_id": "house"} for c in V3],
                          async_=True).operation
            deadline = time.monotonic() + 300
            while m.get_operation(op.name).state not in (3, 4):  # SUCCEEDED, FAILED
                assert time.monotonic() < deadline, "the async retain did not end"
                time.sleep(0.1)
            assert m.get_operation(op.name).state == 3
        yield server
    finally:
        server.stop()


def test_the_replaced_text_is_in_no_readable_record_and_the_new_one_is_whole(replaced):
    assert MARKER not in _opened_text(replaced.data_dir)
    assert _retained(replaced.data_dir, "rp") == sorted(V2)
    assert _retained(replaced.data_dir, "ra") == sorted(V3)
    with replaced.client() as m:
        texts = _texts(m, "rp")
        assert MARKER not in texts
        assert "garage shelf" in texts
        assert m.get_document("rp", "house").original_text == "\n\n".join(V2)
        assert "June" in _texts(m, "ra")


def _history(doc) -> list[tuple]:
    return [(h.revision, h.operation, h.item_count, list(h.tags), h.content_hash,
             h.content_chars, h.context, h.text_stored) for h in doc.history]


def _entities(m, bank: str) -> list[tuple]:
    return sorted((e.display_name, list(e.aliases), e.mention_count)
                  for e in m.list_entities(bank))


def test_the_replaced_revision_keeps_no_fingerprint_of_its_text(replaced):
    with replaced.client() as m:
        doc = m.get_document("rp", "house")
    first, latest = doc.history
    assert (first.content_hash, first.content_chars, first.text_stored) == ("", 0, False)
    assert first.item_count == 2 and latest.content_chars == len("\n\n".join(V2))


def test_a_replay_keeps_the_new_version_and_brings_nothing_of_the_old_back(replaced):
    with replaced.client() as m:
        before = sorted(x.text for x in m.list_memories("rp"))
        doc = m.get_document("rp", "house")
        entities = _entities(m, "rp")
        assert before and doc.original_text
    replaced.replay()
    assert MARKER not in _opened_text(replaced.data_dir)
    with replaced.client() as m:
        assert sorted(x.text for x in m.list_memories("rp")) == before
        again = m.get_document("rp", "house")
        assert again.original_text == doc.original_text
        assert _history(again) == _history(doc)
        assert _entities(m, "rp") == entities
        texts = _texts(m, "rp")
        assert MARKER not in texts and "garage shelf" in texts


def test_a_replacing_retain_cut_after_its_keys_destruction_completes_and_stays_readable(
        tmp_path):
    """The replaced version's keys are destroyed before the new version's append; an
    append that fails then (a kill leaves the same keys.db and log) leaves the request
    kept, sealed, in the key store: the old text is unreadable at once, and the retain is
    appended at the next start, readable, once also when the client retries it."""
    import grpc

    from mneme.v1 import operations_pb2
    from tests.e2e.test_deletion_completes import RefusedDeletions, _ended, _start, _stop
    data = tmp_path / "data"
    items = [{"content": c, "document_id": "house"} for c in V2]
    n = _start(data)
    try:
        m = n.client
        m.upsert_bank("b")
        m.retain("b", [{"content": c, "document_id": "house"} for c in V1])
        refusing = n.ingest.log = RefusedDeletions(n.ingest.log, "RetainRequested")
        with pytest.raises(grpc.RpcError) as e:
            m.retain("b", items, request_id="cut")
        assert e.value.code() == grpc.StatusCode.UNAVAILABLE
        (op_id,) = refusing.refused
        (kept,) = n.ingest.keys.pending_deletions("b")
        assert kept.operation_id == op_id
    finally:
        _stop(n)
    assert MARKER not in _opened_text(data)  # the old version: unreadable at once
    keys = (data / "keys.db").read_bytes() + (
        (data / "keys.db-wal").read_bytes() if (data / "keys.db-wal").exists() else b"")
    assert b"garage shelf" not in keys  # the kept request is sealed
    n = _start(data)
    try:
        m = n.client
        assert _ended(m, op_id).state == operations_pb2.SUCCEEDED
        again = m.retain("b", items, request_id="cut")  # the client's retry
        assert again.operation.name.endswith(op_id)
        assert n.ingest.keys.pending_deletions() == []
        assert "garage shelf" in _texts(m, "b") and MARKER not in _texts(m, "b")
    finally:
        _stop(n)
    assert MARKER not in _opened_text(data)
    assert _retained(data, "b") == sorted(V2)  # appended once, readable
