"""The bank catalog projection every service keeps of ``mneme.intake.v1``.

ingest (banks and operations), and in the distributed topology search, extraction and
consolidation (each its own copy, so it knows a bank's config and existence without
asking ingest) apply the same events the same way: :data:`ROUTES` (banks and their directives).
"""

from __future__ import annotations

from mneme.bus import codec
from mneme.domain import Directive, EventMeta, MentalModel, MentalModelRevision
from mneme.events.v1 import events_pb2 as ev
from mneme.keys import Keyring, fact_key_id
from mneme.ports import Catalog


def bank_ids(catalog: Catalog, page: int = 500) -> list[str]:
    """Every bank id of ``catalog``, in id order, read ``page`` banks at a time."""
    banks, after = [], ""
    while True:
        got = catalog.list_banks(page, after)
        banks += [b.bank_id for b in got]
        if len(got) < page:
            return banks
        after = got[-1].bank_id


def on_bank_upserted(m: ev.BankUpserted, meta: EventMeta, *, catalog: Catalog | None = None):
    """A create, a replace, or the masked fields of an update, into ``catalog`` at the
    event's time (so replay reproduces it). Idempotent; produces nothing. Without a
    ``catalog`` (a service sharing the embedded process's catalog) it does nothing."""
    if catalog is not None:
        catalog.upsert_bank(m.bank_id, m.display_name, codec.bank_config_from_pb(
            m.config if m.HasField("config") else None), meta.time.timestamp(),
            mask=tuple(m.update_mask))
    return []


def on_bank_deleted(m: ev.BankDeleted, meta: EventMeta, *, catalog: Catalog | None = None):
    """The bank leaves ``catalog`` (its operations with it). Idempotent; produces nothing."""
    if catalog is not None:
        catalog.delete_bank(m.bank_id, meta.time.timestamp())
    return []


def on_directive_changed(m: ev.DirectiveChanged, meta: EventMeta, *,
                         catalog: Catalog | None = None):
    """A directive created, changed (the fields of ``update_mask``) or deleted, into
    ``catalog`` at the event's time. Idempotent; produces nothing."""
    if catalog is None:
        return []
    if m.deleted:
        catalog.delete_directive(m.bank_id, m.id)
    else:
        catalog.upsert_directive(Directive(
            id=m.id, bank_id=m.bank_id, title=m.title, text=m.text, priority=m.priority,
            active=m.active, tags=tuple(m.tags), updated_at=meta.time.timestamp()),
            mask=tuple(m.update_mask))
    return []


def on_mental_model_changed(m: ev.MentalModelChanged, meta: EventMeta, *,
                            catalog: Catalog | None = None):
    """A mental model created, changed, refreshed (its content and what it is based on,
    as the refresh computed them: no model is called) or deleted, into ``catalog`` at the
    event's time. Idempotent; produces nothing."""
    if catalog is None:
        return []
    if m.deleted:
        catalog.delete_mental_model(m.bank_id, m.id)
        return []
    refresh = (MentalModelRevision(0, m.content, tuple(m.refresh.based_on),
                                   m.refresh.source or "refresh", mode=m.refresh.mode or "full",
                                   documents=_documents(m.refresh),
                                   evidence=tuple(m.refresh.evidence_memory_ids))
               if m.HasField("refresh") else None)
    catalog.upsert_mental_model(MentalModel(
        id=m.id, bank_id=m.bank_id, display_name=m.display_name, source_query=m.source_query,
        content=m.content, tags=tuple(m.tags), max_tokens=m.max_tokens,
        refresh_policy=m.refresh_policy or "manual", refresh_every=m.refresh_every,
        memory_offset=m.memory_offset, updated_at=meta.time.timestamp()),
        mask=tuple(m.update_mask), refresh=refresh)
    return []


def _documents(r: ev.MentalModelRefresh) -> tuple[str, ...]:
    """The refresh's documents, parallel to its ``based_on`` (padded with "" for an event
    from before the field)."""
    docs = list(r.based_on_documents)[:len(r.based_on)]
    return tuple(docs + [""] * (len(r.based_on) - len(docs)))


def on_sources_deleted(m: ev.DocumentDeleteRequested | ev.MemoryDeleteRequested,
                       meta: EventMeta, *, catalog: Catalog | None = None,
                       keyring: Keyring | None = None):
    """A deleted document or memory leaves the bank's mental models: the contents that
    cite it, directly or through an observation whose facts it deletes, are erased and a
    model falls back to its latest content that does not
    (:meth:`mneme.ports.Catalog.erase_mental_model_sources`), as a replay would have it
    (those contents are sealed under the deleted facts' keys). An observation's facts
    are known by id, not document: they count as deleted when ``keyring`` (the keys the
    deletion destroyed before it was appended) no longer opens their key. Idempotent;
    produces nothing."""
    if catalog is None:
        return []
    gone = None
    if keyring is not None:
        def gone(fact_id: str) -> bool:
            return keyring.destroyed(m.bank_id, fact_key_id(fact_id))
    if isinstance(m, ev.DocumentDeleteRequested):
        catalog.erase_mental_model_sources(m.bank_id, (), m.document_id, gone)
    elif _names_a_fact(m, catalog, keyring):
        catalog.erase_mental_model_sources(m.bank_id, (m.memory_id,), "", gone)
    return []


def _names_a_fact(m: ev.MemoryDeleteRequested, catalog: Catalog,
                  keyring: Keyring | None) -> bool:
    """False when the deleted id is known not to be a fact: in a sealed bank, a fact has
    a key of its own (live, or destroyed by this deletion) and an observation or an
    opinion has none. Search refuses such a deletion, so it must erase nothing here. In
    an ``erasure: none`` bank (no keys) every id counts as a fact's; so does, in a sealed
    bank, a fact retained while the bank was ``none`` (a caveat: its deletion erases no
    mental-model content)."""
    if keyring is None:
        return True
    bank = catalog.get_bank(m.bank_id)
    if bank is not None and bank.config.erasure == "none":
        return True
    return keyring.known(m.bank_id, fact_key_id(m.memory_id))


#: The bank projection's routes, for a group reading ``mneme.intake.v1``.
ROUTES = {ev.BankUpserted: on_bank_upserted, ev.BankDeleted: on_bank_deleted,
          ev.DirectiveChanged: on_directive_changed,
          ev.MentalModelChanged: on_mental_model_changed,
          ev.DocumentDeleteRequested: on_sources_deleted,
          ev.MemoryDeleteRequested: on_sources_deleted}
