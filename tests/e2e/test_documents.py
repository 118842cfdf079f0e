"""Documents through a real ``mneme up``: a document retained twice (an upsert) has two
revisions and the latest original text, its memories are those ListMemories lists for it,
a bank with ``store_documents`` off keeps the history without the text, DeleteDocument
erases text and history (from the projection's file too), and ``mneme replay`` rebuilds
the same documents byte for byte without bringing the deleted text back; the ``mneme
documents get`` CLI shows text and history."""

from __future__ import annotations

import hashlib
import json
from datetime import datetime, timezone

import grpc
import pytest
from typer.testing import CliRunner

from mneme.cli import app
from mneme.v1 import documents_pb2

BANK, PRIVATE = "docs", "private-docs"
AT = datetime(2024, 3, 1, tzinfo=timezone.utc)
# what must not survive the deletion of "handbook" anywhere in the data dir's projection
SECRET = "Zanzibarina's badge code is 4471-KESTREL"
V1 = f"Onboarding handbook, first draft. {SECRET}. New staff meet Maria on Mondays."
V2 = ["Onboarding handbook, second edition. New staff meet Maria on Tuesdays in Lisbon.",
      "Laptops are issued by the IT desk on the first day; Tom runs the IT desk."]
KEEP = "The travel policy: trains under four hours, flights otherwise. Ana approves trips."


def refused(call) -> grpc.RpcError:
    with pytest.raises(grpc.RpcError) as e:
        call()
    return e.value


def cli(server, *args) -> str:
    out = CliRunner().invoke(app, [*args, "-a", server.address])
    assert out.exit_code == 0, out.output
    return out.stdout


def snapshot(m, bank: str) -> dict:
    """Every document of the bank as GetDocument serialises it (deterministic bytes)."""
    return {d.document_id: m.get_document(bank, d.document_id).SerializeToString(deterministic=True)
            for d in m.list_documents(bank, page_size=1)}


def projection_holds(server, text: str) -> list[str]:
    """The files of the document projection holding ``text``."""
    return [p.name for p in server.data_dir.glob("documents.db*") if text.encode() in p.read_bytes()]


def test_upserts_history_text_units_deletion_and_replay(server):
    with server.client() as m:
        m.upsert_bank(BANK)
        first = m.retain(BANK, [{"content": V1, "document_id": "handbook", "tags": ["hr"],
                                 "context": "intranet page", "timestamp": AT},
                                {"content": KEEP, "document_id": "travel", "timestamp": AT}])
        second = m.retain(BANK, [{"content": V2[0], "document_id": "handbook",
                                  "tags": ["hr", "it"], "timestamp": AT},
                                 {"content": V2[1], "document_id": "handbook", "timestamp": AT}])
        assert first.operation.state == second.operation.state == 3

        doc = m.get_document(BANK, "handbook")
        text = "\n\n".join(V2)
        assert doc.original_text == text and doc.text_stored
        assert doc.content_hash == hashlib.sha256(text.encode()).hexdigest()
        assert doc.content_chars == len(text) and list(doc.tags) == ["hr", "it"]
        assert doc.revision_count == 2
        # the replaced revision keeps no fingerprint of its text (erased on the log)
        assert [(r.revision, r.operation, r.item_count, r.content_chars, list(r.tags), r.context,
                 bool(r.content_hash)) for r in doc.history] == [
            (1, first.operation.name, 1, 0, ["hr"], "", False),
            (2, second.operation.name, 2, len(text), ["hr", "it"], "", True)]
        assert doc.create_time == doc.history[0].retain_time
        assert doc.update_time == doc.history[1].retain_time
        assert doc.update_time.ToDatetime() >= doc.create_time.ToDatetime()
        # its units: the memories of the latest retain, as ListMemories lists them
        units = [x.name for x in m.list_memories(BANK, document_id="handbook")]
        assert units and sorted(x.name for x in doc.memories) == sorted(units)
        assert doc.memory_count == len(units)
        assert set(doc.chunk_ids) <= {x.chunk_id for x in doc.memories}
        assert all(x.document_id == "handbook" for x in doc.memories)

        # paged, without text or history
        page = m.documents.ListDocuments(documents_pb2.ListDocumentsRequest(
            parent=f"banks/{BANK}", page_size=1))
        assert [d.document_id for d in page.documents] == ["handbook"] and page.next_page_token
        listed = list(m.list_documents(BANK, page_size=1))
        assert [d.document_id for d in listed] == ["handbook", "travel"]
        assert listed[0].revision_count == 2 and not listed[0].original_text
        assert not listed[0].history and listed[0].memory_count == doc.memory_count

        # a bank that keeps no text: the history only
        m.upsert_bank(PRIVATE)
        m.update_bank(PRIVATE, store_documents=False)
        assert not m.get_bank(PRIVATE).config.store_documents
        m.retain(PRIVATE, [{"content": KEEP, "document_id": "policy", "context": "wiki",
                            "timestamp": AT}])
        private = m.get_document(PRIVATE, "policy")
        assert (private.original_text, private.text_stored, private.history[0].context) == (
            "", False, "")
        assert private.content_chars == len(KEEP) and private.revision_count == 1
        assert private.memory_count > 0

    got = json.loads(cli(server, "documents", "get", BANK, "handbook", "--json"))
    assert got["original_text"] == text and len(got["history"]) == 2
    assert got["history"][0]["operation"] == first.operation.name  # full ids
    assert got["history"][1]["retain_time"].endswith("Z")  # RFC 3339, not epoch seconds
    shown = cli(server, "documents", "get", BANK, "handbook")
    assert text in shown and "2 revisions" in shown and first.operation.name in shown
    assert text not in cli(server, "documents", "get", BANK, "handbook", "--no-text")

    with server.client() as m:
        assert projection_holds(server, "Tom runs the IT desk")  # the stored text is there
        assert not projection_holds(server, SECRET)  # the replaced text is not
    assert "deleted document handbook: succeeded" in cli(server, "documents", "delete", BANK,
                                                         "handbook")
    with server.client() as m:
        assert refused(lambda: m.get_document(BANK, "handbook")).code() == grpc.StatusCode.NOT_FOUND
        assert [d.document_id for d in m.list_documents(BANK)] == ["travel"]
        assert not projection_holds(server, "Tom runs the IT desk")
        # retained again after its deletion: a new history
        again = m.retain(BANK, [{"content": "Handbook, third edition.",
                                 "document_id": "handbook", "timestamp": AT}])
        doc = m.get_document(BANK, "handbook")
        assert doc.revision_count == 1 and doc.history[0].operation == again.operation.name
        before = {b: snapshot(m, b) for b in (BANK, PRIVATE)}

    server.stop()
    for f in server.data_dir.glob("documents.db*"):  # rebuilt from the log alone, where
        f.unlink()  # the deleted retains' items are unreadable
    server.replay()
    with server.client() as m:
        assert {b: snapshot(m, b) for b in (BANK, PRIVATE)} == before
        assert m.get_document(BANK, "handbook").original_text == "Handbook, third edition."
    assert not projection_holds(server, "Tom runs the IT desk")
    assert not projection_holds(server, SECRET)


def test_bank_deletion_erases_its_documents(server):
    with server.client() as m:
        m.upsert_bank("gone-docs")
        m.retain("gone-docs", [{"content": KEEP + " Marker Quetzalina.", "document_id": "d",
                                "timestamp": AT}])
        assert m.get_document("gone-docs", "d").text_stored
        m.delete_bank("gone-docs")
        m.upsert_bank("gone-docs")  # the same id again: nothing of the old bank
        assert refused(lambda: m.get_document("gone-docs", "d")).code() == grpc.StatusCode.NOT_FOUND
        assert list(m.list_documents("gone-docs")) == []
    assert not projection_holds(server, "Marker Quetzalina")
