"""search's document projection (group ``search-documents``): every retain of a
document (an item with a ``document_id``) from ``mneme.intake.v1`` into a
:class:`mneme.ports.DocumentStore` -- its history and, when the bank stores documents,
its original text -- and its erasure with the document or bank.

Replay rebuilds it from the log alone (no model). The log's copy of an item whose
document was deleted since is unreadable (its key destroyed: the item arrives as an
``erased`` placeholder), so such an item adds a revision without text or fingerprint,
and the deletion that follows it on the log removes what the live projection held: a
replay never brings deleted text back. A retain of a document that replaces it erased
the earlier versions from the log likewise (ingest destroys their keys), so a new
revision clears the earlier ones' fingerprints live as well: live and replayed
histories agree. Idempotent: a redelivered retain is known by its operation id."""

from __future__ import annotations

import hashlib
from dataclasses import replace

from mneme.bus import codec
from mneme.domain import DOCUMENT_JOIN, DocumentRevision, EventMeta
from mneme.events.v1 import events_pb2 as ev
from mneme.ports import DocumentStore

#: The BankUpserted update_mask paths that change whether a bank stores documents.
_STORAGE_PATHS = frozenset(("config", "config.store_documents"))


def on_bank_upserted(m: ev.BankUpserted, meta: EventMeta, *, documents: DocumentStore):
    """The bank's ``store_documents`` setting, in log order with its retains (a full
    upsert sets it, an update only when its mask names it). Produces nothing."""
    if not m.update_mask or _STORAGE_PATHS & set(m.update_mask):
        config = codec.bank_config_from_pb(m.config if m.HasField("config") else None)
        documents.set_storage(m.bank_id, config.store_documents)
    return []


def on_retain_requested(m: ev.RetainRequested, meta: EventMeta, *, documents: DocumentStore):
    """One revision per document the retain carries: its items (those ingest accepted)
    in item order, their contents joined by :data:`~mneme.domain.DOCUMENT_JOIN`; the
    text and the first item's context kept when the bank stores documents. A document
    whose content is erased (its keys destroyed) gets a revision with its item count and
    tags only, and no text. Produces nothing."""
    refused = {r.item_index for r in m.rejected_items if r.reason != "erased"}
    erased = {r.item_index for r in m.rejected_items if r.reason == "erased"}
    by_doc: dict[str, list[ev.RetainItem]] = {}
    gone: set[str] = set()  # documents with an item whose content is erased
    for i, item in enumerate(m.items):
        if i not in refused and item.document_id:
            by_doc.setdefault(item.document_id, []).append(item)
            if i in erased:
                gone.add(item.document_id)
    store_text = documents.storage(m.bank_id) if by_doc else False
    entries = []
    for document_id, items in by_doc.items():
        tags = tuple(sorted({t for i in items for t in i.tags}))  # (in the clear)
        rev = DocumentRevision(revision=0, operation_id=m.operation_id,
                               at=meta.time.timestamp(), items=len(items), content_hash="",
                               chars=0, tags=tags, context="", text_stored=False)
        if document_id in gone:
            # its keys were destroyed (a later retain replaced it, or it was deleted):
            # the revision as the live projection holds it since (no text, no fingerprint)
            entries.append((document_id, rev, None))
            continue
        text = DOCUMENT_JOIN.join(i.content for i in items)
        rev = replace(rev, content_hash=hashlib.sha256(text.encode()).hexdigest(),
                      chars=len(text), context=items[0].context if store_text else "",
                      text_stored=store_text)
        entries.append((document_id, rev, text if store_text else None))
    if entries:
        documents.add_revisions(m.bank_id, entries)
    return []


def on_document_delete_requested(m: ev.DocumentDeleteRequested, meta: EventMeta, *,
                                 documents: DocumentStore):
    """The document, its text and history are erased. Produces nothing."""
    documents.delete_document(m.bank_id, m.document_id)
    return []


def on_bank_deleted(m: ev.BankDeleted, meta: EventMeta, *, documents: DocumentStore):
    """The bank's documents and setting are erased. Produces nothing."""
    documents.delete_bank(m.bank_id)
    return []


#: The projection's routes, for a group reading ``mneme.intake.v1``.
ROUTES = {ev.BankUpserted: on_bank_upserted, ev.BankDeleted: on_bank_deleted,
          ev.RetainRequested: on_retain_requested,
          ev.DocumentDeleteRequested: on_document_delete_requested}
