"""search's document projection (:mod:`services.search.documents`) over the in-memory
store: revisions per retain, text joined from a retain's items, the bank's
``store_documents`` setting in log order, erased and refused items, redelivery and
erasure."""

from __future__ import annotations

import hashlib
from datetime import datetime, timezone

from mneme.bus import codec
from mneme.domain import BankConfig, EventMeta
from mneme.events.v1 import events_pb2 as ev
from mneme.stores.memory import MemoryDocumentStore
from services.search import documents as h

T1 = datetime(2026, 1, 1, tzinfo=timezone.utc)
T2 = datetime(2026, 1, 2, tzinfo=timezone.utc)


def meta(at=T1, i="e1") -> EventMeta:
    return EventMeta(id=i, time=at)


def item(content: str, doc: str = "d", tags=(), context: str = "") -> ev.RetainItem:
    return ev.RetainItem(content=content, document_id=doc, tags=list(tags), context=context)


def retain(op: str, *items: ev.RetainItem, rejected=()) -> ev.RetainRequested:
    return ev.RetainRequested(bank_id="b", operation_id=op, items=list(items),
                              rejected_items=[ev.ItemFailure(item_index=i, reason=r)
                                              for i, r in rejected])


def upsert(store: bool | None, mask=()) -> ev.BankUpserted:
    config = codec.bank_config_to_pb(BankConfig(store_documents=bool(store)))
    if store is None:
        config.ClearField("store_documents")  # an event written before the field
    return ev.BankUpserted(bank_id="b", config=config, update_mask=list(mask))


def test_each_retain_adds_a_revision_and_replaces_the_text():
    s = MemoryDocumentStore()
    h.on_retain_requested(retain("o1", item("Part one.", tags=["b", "a"], context="chat"),
                                 item("Part two.", tags=["a"]), item("Other doc.", doc="e"),
                                 item("No document.", doc="")), meta(), documents=s)
    d = s.get("b", "d")
    assert d.text == "Part one.\n\nPart two." and d.revisions == 1
    assert d.latest.items == 2 and d.latest.tags == ("a", "b") and d.latest.context == "chat"
    assert d.latest.content_hash == hashlib.sha256(d.text.encode()).hexdigest()
    assert d.latest.chars == len(d.text) and d.created_at == T1.timestamp()
    assert s.get("b", "e").text == "Other doc." and s.count("b") == 2
    h.on_retain_requested(retain("o2", item("Rewritten.")), meta(T2, "e2"), documents=s)
    d = s.get("b", "d")
    assert (d.text, d.revisions, d.created_at, d.updated_at) == (
        "Rewritten.", 2, T1.timestamp(), T2.timestamp())
    # a redelivered retain adds nothing
    before = s.dump("b")
    h.on_retain_requested(retain("o1", item("Part one."), item("Part two.")), meta(), documents=s)
    assert s.dump("b") == before


def test_refused_items_add_nothing_and_erased_ones_a_revision_without_text():
    """An erased item keeps its document id and tags in the clear (its content is gone):
    its document gets the revision the live projection holds once a later retain replaced
    it (item count and tags; no text, hash or size), so a replay agrees with it."""
    s = MemoryDocumentStore()
    h.on_retain_requested(retain("o1", ev.RetainItem(), item("", doc="gone"), item("Kept."),
                                 rejected=[(0, "rejected"), (1, "erased")]), meta(), documents=s)
    gone = s.get("b", "gone")
    assert gone.text is None and gone.revisions == 1
    assert (gone.latest.items, gone.latest.content_hash, gone.latest.chars,
            gone.latest.text_stored) == (1, "", 0, False)
    assert s.get("b", "d").text == "Kept."


def test_the_bank_setting_applies_in_log_order():
    s = MemoryDocumentStore()
    h.on_bank_upserted(upsert(None), meta(), documents=s)  # unset: stored
    h.on_retain_requested(retain("o1", item("Stored.", context="c")), meta(), documents=s)
    h.on_bank_upserted(upsert(False, ["config.store_documents"]), meta(), documents=s)
    h.on_bank_upserted(upsert(True, ["config.retain_mission"]), meta(), documents=s)  # not it
    h.on_retain_requested(retain("o2", item("Not stored.", context="c")), meta(T2), documents=s)
    d = s.get("b", "d")
    assert d.text is None and not d.latest.text_stored and d.latest.context == ""
    assert d.latest.chars == len("Not stored.")  # its size and hash are kept
    # the replaced revision keeps no fingerprint of its text, stored or not
    assert [(r.text_stored, r.chars) for r in s.revisions("b", "d", 10)] == [
        (False, 0), (False, len("Not stored."))]
    h.on_bank_upserted(upsert(True), meta(), documents=s)  # a full upsert sets it
    assert s.storage("b")


def test_deletions_erase_the_document_and_the_bank():
    s = MemoryDocumentStore()
    h.on_retain_requested(retain("o1", item("A."), item("B.", doc="e")), meta(), documents=s)
    h.on_bank_upserted(upsert(False), meta(), documents=s)
    h.on_document_delete_requested(ev.DocumentDeleteRequested(bank_id="b", document_id="d"),
                                   meta(), documents=s)
    assert s.get("b", "d") is None and s.get("b", "e") is not None
    h.on_bank_deleted(ev.BankDeleted(bank_id="b"), meta(), documents=s)
    assert s.count("b") == 0 and s.storage("b")


def test_get_document_caps_history_and_memories_and_counts_them():
    """The latest 100 revisions (oldest first) with the total; the first 1000 facts in
    item order with the exact count; a document only the vector store knows (its retain
    not projected yet) is still found; an unknown one is NOT_FOUND."""
    from dataclasses import replace as dc_replace

    import pytest

    from mneme.domain import DocumentRevision, Fact
    from mneme.errors import NotFound
    from services.search import reads
    from tests.fakes import FakeStore

    s, vectors = MemoryDocumentStore(), FakeStore("vector")
    for n in range(105):  # one retain after the other
        s.add_revisions("b", [("d", DocumentRevision(0, f"o{n:03d}", float(n)), f"t{n}")])
    base = Fact(id="", bank_id="b", text="x", fact_type="world", document_id="d")
    vectors.upsert([dc_replace(base, id=f"f{n:04d}", item_index=1005 - n) for n in range(1005)])
    view = reads.get_document(s, vectors, "b", "d")
    assert view.stored.revisions == 105 and view.stored.text == "t104"
    assert [r.revision for r in view.history] == list(range(6, 106))
    assert len(view.facts) == reads.DOCUMENT_MEMORIES and view.memory_count == 1005
    assert [f.item_index for f in view.facts] == sorted(f.item_index for f in view.facts)
    vectors.upsert([dc_replace(base, id="g1", document_id="only-units")])
    only = reads.get_document(s, vectors, "b", "only-units")
    assert only.stored is None and only.history == [] and only.memory_count == 1
    with pytest.raises(NotFound):
        reads.get_document(s, vectors, "b", "unknown")
