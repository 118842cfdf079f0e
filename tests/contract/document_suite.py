"""Contract of :class:`mneme.ports.DocumentStore`, written once; subclass per adapter and
implement ``make_documents(path)`` (same path → same data where it persists)."""

from __future__ import annotations

import pytest

from mneme.domain import DocumentRevision


def rev(op: str, at: float, text: str | None = "t", tags=(), context: str = "") -> DocumentRevision:
    return DocumentRevision(revision=0, operation_id=op, at=at, items=1,
                            content_hash=f"h-{op}", chars=len(text or ""), tags=tuple(tags),
                            context=context, text_stored=text is not None)


class DocumentStoreSuite:
    def make_documents(self, path):  # pragma: no cover - abstract
        raise NotImplementedError

    @pytest.fixture
    def store(self, tmp_path):
        s = self.make_documents(tmp_path)
        yield s
        s.close()

    def test_revisions_in_order_the_latest_text_and_times(self, store):
        assert store.add_revisions("a", [("d", rev("o1", 10.0, "first", ["x"], "chat"), "first")]) == 1
        assert store.add_revisions("a", [("d", rev("o2", 20.0, "second", ["y"]), "second")]) == 1
        got = store.get("a", "d")
        assert (got.document_id, got.created_at, got.updated_at, got.revisions, got.text) == (
            "d", 10.0, 20.0, 2, "second")
        assert got.latest.operation_id == "o2" and got.latest.revision == 2
        hist = store.revisions("a", "d", 10)
        assert [(r.revision, r.operation_id, r.at, r.tags) for r in hist] == [
            (1, "o1", 10.0, ("x",)), (2, "o2", 20.0, ("y",))]
        # the replaced revision keeps no fingerprint of its text (erased on the log: a
        # replay reads it so); the latest keeps its own
        assert (hist[0].context, hist[0].content_hash, hist[0].chars,
                hist[0].text_stored) == ("", "", 0, False)
        assert (hist[1].content_hash, hist[1].chars, hist[1].text_stored) == (
            "h-o2", len("second"), True)
        assert [r.revision for r in store.revisions("a", "d", 1)] == [2]  # the latest, oldest first
        assert store.get("b", "d") is None and store.get("a", "other") is None
        assert store.revisions("a", "other", 10) == []

    def test_a_redelivered_retain_changes_nothing(self, store):
        store.add_revisions("a", [("d", rev("o1", 10.0, "one"), "one")])
        store.add_revisions("a", [("d", rev("o2", 20.0, "two"), "two")])
        before = store.dump("a")
        assert not store.add_revisions("a", [("d", rev("o1", 10.0, "one"), "one")])
        assert store.dump("a") == before and store.get("a", "d").text == "two"

    def test_a_retain_without_text_drops_the_earlier_text(self, store):
        store.add_revisions("a", [("d", rev("o1", 10.0, "secret"), "secret")])
        store.add_revisions("a", [("d", rev("o2", 20.0, None), None)])
        got = store.get("a", "d")
        assert got.text is None and not got.latest.text_stored and got.revisions == 2

    def test_list_pages_in_id_order_without_text(self, store):
        # one retain of three documents, one write; a redelivery of it adds nothing
        batch = [(d, rev("o1", 1.0, d), d) for d in ("c", "a", "b")]
        assert store.add_revisions("bank", batch) == 3
        assert store.add_revisions("bank", batch) == 0
        store.add_revisions("other", [("a0", rev("o", 1.0), "t")])
        page = store.list("bank", 2)
        assert [d.document_id for d in page] == ["a", "b"] and all(d.text is None for d in page)
        assert [d.document_id for d in store.list("bank", 2, "b")] == ["c"]
        assert store.count("bank") == 3 and store.count("none") == 0

    def test_delete_document_and_bank_forget_text_and_history(self, store):
        store.add_revisions("a", [("d", rev("o1", 10.0, "gone"), "gone")])
        store.add_revisions("a", [("e", rev("o2", 10.0, "kept"), "kept")])
        store.set_storage("a", False)
        assert store.delete_document("a", "d") and not store.delete_document("a", "d")
        assert store.get("a", "d") is None and store.revisions("a", "d", 10) == []
        # a document retained again after its deletion starts a new history
        store.add_revisions("a", [("d", rev("o1", 30.0, "again"), "again")])
        assert store.get("a", "d").revisions == 1 and store.get("a", "d").created_at == 30.0
        store.delete_bank("a")
        assert store.count("a") == 0 and store.storage("a") is True

    def test_storage_per_bank_defaults_to_true(self, store):
        assert store.storage("a") is True
        store.set_storage("a", False)
        assert store.storage("a") is False and store.storage("b") is True
        store.set_storage("a", True)
        assert store.storage("a") is True

    def test_dump_is_deterministic_and_reset_forgets_everything(self, store):
        store.add_revisions("a", [("d", rev("o1", 10.0, "x", ["t"]), "x")])
        dump = store.dump("a")
        assert len(dump) == 1 and b'"text": "x"' in dump[0]
        store.reset()
        assert store.dump("a") == [] and store.count("a") == 0
        store.add_revisions("a", [("d", rev("o1", 10.0, "x", ["t"]), "x")])
        assert store.dump("a") == dump
