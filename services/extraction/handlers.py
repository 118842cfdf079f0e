"""extraction's handlers: intake events → memory events.

Derived events carry everything a projection needs (text, times, entities, the
embedding and its model name), so replaying ``mneme.memory.v1`` never calls a model.
Event ids derive from the causing event's id, so redelivery yields identical events.
"""

from __future__ import annotations

import logging
import threading
from dataclasses import replace
from datetime import datetime, timezone
from typing import Callable

from mneme import telemetry
from typing import TYPE_CHECKING

from mneme import bank_catalog
from mneme.bus import PART_BYTES, codec, pack
from mneme.domain import EventMeta
from mneme.errors import Cancelled, quotes, resource_shortage
from mneme.events.v1 import events_pb2 as ev
from mneme.keys import document_scope, retain_scope
from mneme.ports import Catalog, Embedder, EventLog, StoredEntity
from services.extraction.llm import CANCELLED, ExtractionIncomplete
from services.extraction.vectors import unit_vectors

if TYPE_CHECKING:
    from services.extraction.resolver import EntityResolver

log = logging.getLogger(__name__)
_EPOCH = datetime(1970, 1, 1, tzinfo=timezone.utc)


class CancelWatch:
    """Whether a retain's operation was cancelled (CancelOperation), asked by extraction
    between items, in any topology: ingest appends OperationCancelRequested keyed by the
    bank, so it lands on the retain's own intake partition after the retain; the watch
    reads that partition forward from the retain's record (the log is the state every
    process shares; a catalog is a per-process projection that would see the cancel only
    after the retain is handled). Each ask reads only the records appended since the last
    one; a cancel once seen stays seen. A read that fails counts as "not cancelled"
    (cancellation is best effort and must never sink an extraction). ``log`` may be the
    raw (sealed) log: only headers and the cancel's unsealed ids are read, so the retains
    queued behind are never decrypted to be skipped."""

    PAGE = 500  # records per read

    def __init__(self, log: EventLog) -> None:
        self.log = log

    def watch(self, operation_id: str, meta: EventMeta) -> Callable[[], bool]:
        """``cancelled() -> bool`` for the retain ``operation_id`` handled as ``meta``
        (never true for an event that came from no log position). Thread-safe."""
        if meta.position is None:
            return lambda: False
        topic, partition, offset = meta.position
        state = {"next": offset + 1, "hit": False}
        lock = threading.Lock()
        cancel_type = codec.event_type(ev.OperationCancelRequested)

        def cancelled() -> bool:
            with lock:
                try:
                    # nothing new (the usual answer) costs one end-offset lookup, no fetch
                    while not state["hit"] and \
                            self.log.end_offset(topic, partition) > state["next"]:
                        recs = self.log.read(topic, partition, state["next"], self.PAGE)
                        if not recs:
                            break
                        for r in recs:
                            if r.headers.get("ce_type") == cancel_type:
                                msg = codec.decode(r).message
                                state["hit"] |= getattr(msg, "operation_id", "") == operation_id
                        state["next"] = recs[-1].offset + 1
                except Exception:  # noqa: BLE001 -- best effort, logged
                    log.warning("could not look for a cancellation of %s", operation_id,
                                exc_info=True)
                return state["hit"]
        return cancelled


def on_retain_requested(m: ev.RetainRequested, meta: EventMeta, *, extractor,
                        embedder: Embedder, resolver: EntityResolver,
                        cancels: CancelWatch | None = None, part_bytes: int = PART_BYTES
                        ) -> list[ev.EntitiesResolved | ev.FactsExtracted]:
    """The request's items → one FactsExtracted (or its parts: :func:`split_facts`),
    preceded by the EntitiesResolved of the entity-resolution decisions it took (none
    when it took none): the resolver's
    changelog, which another replica restores (:func:`on_entities_resolved`). Fact ids
    derive from the operation, so a retried request (same request_id, hence same
    operation) or a redelivered event yields the same ids, and a redelivered event
    resolves its mentions as they were resolved the first time and publishes the
    decisions its first delivery took again (:meth:`EntityResolver.begin`).

    With ``cancels``, a cancelled operation (:class:`CancelWatch`) stops before its next
    item: the facts of the items extracted by then go out, the others are failures with
    reason "cancelled", and ``FactsExtracted.cancelled`` is set. ``part_bytes``: the
    largest facts' encoding one FactsExtracted carries (:func:`mneme.bus.part_bytes`)."""
    stop = cancels.watch(m.operation_id, meta) if cancels is not None else None
    # the decisions are recorded under this event, so a redelivery publishes them again
    # (the first delivery may have been killed before its outputs were on the log); the
    # operation is part of it, so an event reusing another's id never publishes its
    resolver.begin(m.bank_id, f"{meta.id}/{m.operation_id}")
    unstored: list[tuple[str, int]] = []
    facts = extract(m, m.operation_id, extractor, embedder, at=meta.time, stop=stop,
                    unstored=unstored)
    if m.HasField("observation_scopes"):
        facts.observation_scopes.CopyFrom(m.observation_scopes)

    def scope(document_id: str) -> str:
        return document_scope(document_id) if document_id else retain_scope(m.operation_id)
    # which document names which entity: deleting the document forgets the names only it
    # gave, also those a cancelled item gave before the cancel came (in no stored fact)
    # (per fact too: deleting the memory forgets the names only it gave)
    resolver.note_mentions(m.bank_id, [
        *((e.id, scope(f.document_id), f.id) for f in facts.facts for e in f.entities),
        *((i, scope(m.items[k].document_id)) for i, k in unstored)])
    entities, claims, aliases = resolver.drain(m.bank_id)
    parts = split_facts(facts, part_bytes)
    if not (entities or claims or aliases):
        return parts
    # An entity's name is sealed with the keys of the items that mention it: deleting
    # every document that named it makes the name unreadable on the log.
    keys_of: dict[str, list[str]] = {}
    for f in facts.facts:
        for e in f.entities:
            ks = keys_of.setdefault(e.id, [])
            ks.extend(k for k in f.seal.keys if k not in ks)
    every = list(dict.fromkeys(k for it in m.items for k in it.seal.keys))

    def resolved(e) -> ev.ResolvedEntity:
        return ev.ResolvedEntity(id=e.id, key=e.key, name=e.name, label=e.label, kind=e.kind,
                                 seal=ev.Seal(keys=keys_of.get(e.id) or every))
    return [ev.EntitiesResolved(
        bank_id=m.bank_id, operation_id=m.operation_id,
        entities=[resolved(e) for e in entities], claims=[resolved(e) for e in claims],
        aliases=[ev.EntityAlias(alias=a, entity_id=i, seal=ev.Seal(keys=keys_of.get(i) or every))
                 for a, i in aliases]), *parts]


def split_facts(m: ev.FactsExtracted, budget: int | None = None) -> list[ev.FactsExtracted]:
    """``m`` as one record, or, when its facts encode to more than ``budget`` bytes, as
    parts 1..n of n (``part``/``parts``) of consecutive facts of at most ``budget``
    bytes each (one fact larger than that goes alone). Every part keeps the retain's
    ids, model, ``items_total`` and observation scopes ("combined" sent as "explicit"
    with the union of the facts' tags, since a part sees only its own); the first keeps
    ``replaced_document_ids``; the last keeps the outcome and names the earlier parts'
    facts (``earlier_fact_ids``): what search needs to end the operation with every
    fact id. Part boundaries depend only on the facts, so a redelivery splits alike.
    ``budget``: bytes, default :data:`mneme.bus.PART_BYTES`."""
    budget = PART_BYTES if budget is None else budget
    if m.ByteSize() <= budget:
        return [m]
    scopes = None
    if m.HasField("observation_scopes"):
        scopes = ev.ObservationScopes()
        scopes.CopyFrom(m.observation_scopes)
        if scopes.mode == "combined":
            union = sorted({t for f in m.facts for t in f.tags})
            scopes = ev.ObservationScopes(mode="explicit", scopes=[ev.ScopeTags(tags=union)])
    # room in every part for what a part may carry besides its facts (the scopes, the
    # outcome, the replaced documents) and for the last part's earlier_fact_ids (what is
    # last is known only at the end), these at most half of it
    shell = ev.FactsExtracted()
    shell.CopyFrom(m)
    shell.ClearField("facts")
    if scopes is not None:
        shell.observation_scopes.CopyFrom(scopes)
    room = max(budget // 8, budget - shell.ByteSize() - 16
               - min(budget // 2, sum(len(f.id) + 2 for f in m.facts)))
    # a fact's size with its field's tag and length
    groups = pack(m.facts, lambda f: f.ByteSize() + 8, room)
    if len(groups) == 1:
        return [m]
    out, earlier = [], []
    for k, group in enumerate(groups, 1):
        part = ev.FactsExtracted(bank_id=m.bank_id, operation_id=m.operation_id, facts=group,
                                 embedding_model=m.embedding_model, items_total=m.items_total,
                                 observation_scopes=scopes, part=k, parts=len(groups))
        if k == 1:
            part.replaced_document_ids.extend(m.replaced_document_ids)
        if k == len(groups):
            part.failures.extend(m.failures)
            part.no_fact_items.extend(m.no_fact_items)
            if m.HasField("llm_usage"):
                part.llm_usage.CopyFrom(m.llm_usage)
            part.cancelled = m.cancelled
            part.earlier_fact_ids.extend(earlier)
        earlier.extend(f.id for f in group)
        out.append(part)
    return out


def on_entities_resolved(m: ev.EntitiesResolved, meta: EventMeta, *,
                         resolver: EntityResolver) -> list:
    """Restore: another replica's resolution decisions become this resolver's
    (:meth:`EntityResolver.learn`). Idempotent; produces nothing."""
    def stored(e: ev.ResolvedEntity) -> StoredEntity:
        return StoredEntity(id=e.id, key=e.key, name=e.name, label=e.label, kind=e.kind)
    resolver.learn(m.bank_id, [stored(e) for e in m.entities], [stored(e) for e in m.claims],
                   [(a.alias, a.entity_id) for a in m.aliases])
    return []


def on_entity_merge_requested(m: ev.EntityMergeRequested, meta: EventMeta, *,
                              resolver: EntityResolver) -> list[ev.EntitiesMerged]:
    """A user's merge: the resolver resolves every name of the merged entities to the
    survivor from now on (:meth:`EntityResolver.merge`), and the merge goes on to
    mneme.memory.v1 (same fields) for the projections, after the facts before it.

    A merge whose survivor is gone by now (merged away or deleted after the request was
    checked: corrections sent at once reach the log in either order) applies nowhere: it
    goes on naming no merged entity, so that no projection (the graph, consolidation's
    opinions) moves anything to an entity that no longer exists, and search ends its
    operation FAILED. A survivor never goes by its own merge, so a redelivery decides
    alike."""
    out = ev.EntitiesMerged()
    out.ParseFromString(m.SerializeToString())  # the same fields, seal keys included
    if not resolver.knows(m.bank_id, m.survivor_id):
        del out.merged_ids[:]
        out.display_name = ""
        return [out]
    resolver.merge(m.bank_id, m.survivor_id, list(m.merged_ids), m.display_name)
    return [out]


def on_entity_split_requested(m: ev.EntitySplitRequested, meta: EventMeta, *,
                              resolver: EntityResolver) -> list[ev.EntitySplit]:
    """A user's split: the moved aliases resolve to the new entity from now on
    (:meth:`EntityResolver.split`); the split goes on to mneme.memory.v1."""
    resolver.split(m.bank_id, m.entity_id, m.new_entity_id, list(m.aliases), m.display_name)
    out = ev.EntitySplit()
    out.ParseFromString(m.SerializeToString())
    return [out]


def on_entities_merged(m: ev.EntitiesMerged, meta: EventMeta, *,
                       resolver: EntityResolver) -> list:
    """Restore: a merge this service passed on applies to this replica's resolver too
    (idempotent). Produces nothing."""
    resolver.merge(m.bank_id, m.survivor_id, list(m.merged_ids), m.display_name)
    return []


def on_entity_split(m: ev.EntitySplit, meta: EventMeta, *, resolver: EntityResolver) -> list:
    """Restore: as :func:`on_entities_merged`, for a split."""
    resolver.split(m.bank_id, m.entity_id, m.new_entity_id, list(m.aliases), m.display_name)
    return []


def on_facts_restored(m: ev.FactsExtracted, meta: EventMeta, *,
                      resolver: EntityResolver) -> list:
    """Restore: which content names which entity, as :func:`on_retain_requested` noted
    it (per fact, in its document's or retain's scope), so the retractions after it
    forget what they forgot on the replica that extracted them. Facts erased on the log
    (deleted since) are not in ``m``. Produces nothing."""
    resolver.note_mentions(m.bank_id, [
        (e.id, document_scope(f.document_id) if f.document_id
         else retain_scope(m.operation_id), f.id) for f in m.facts for e in f.entities])
    return []


class FactMentions:
    """Which memory names which entity in which scope, as :func:`on_facts_restored`
    notes it, for the memories still there at the end of a bank's events on
    ``mneme.memory.v1``: :meth:`add` each event in log order, then :meth:`rows`. What
    entities.db records of mentions from before they named their memories is refined
    from it (:meth:`mneme.stores.entities_sqlite.SqliteEntityStore.refine_mentions`)."""

    def __init__(self) -> None:
        # bank → fact id → (scope, entity ids)
        self._facts: dict[str, dict[str, tuple[str, list[str]]]] = {}

    def add(self, m) -> None:
        """One event of the log (others are ignored): FactsExtracted records its facts'
        entities (a replaced document's earlier facts dropped); FactsRetracted drops
        the retracted memories, document or bank; EntitiesMerged and EntitySplit move
        the mentions as :meth:`EntityResolver.merge` and ``split`` do."""
        if isinstance(m, ev.FactsExtracted):
            facts = self._facts.setdefault(m.bank_id, {})
            for d in m.replaced_document_ids:
                self._drop_scope(m.bank_id, document_scope(d))
            for f in m.facts:
                scope = (document_scope(f.document_id) if f.document_id
                         else retain_scope(m.operation_id))
                facts[f.id] = (scope, [e.id for e in f.entities])
        elif isinstance(m, ev.FactsRetracted):
            if m.bank_deleted:
                self._facts.pop(m.bank_id, None)
            elif m.document_id:
                self._drop_scope(m.bank_id, document_scope(m.document_id))
            for f in m.memory_ids:
                self._facts.get(m.bank_id, {}).pop(f, None)
        elif isinstance(m, (ev.EntitiesMerged, ev.EntitySplit)):
            # as the resolver moves mentions: a merge's survivor takes the merged
            # entities' ones, a split's new entity gets (a copy of) its origin's
            merge = isinstance(m, ev.EntitiesMerged)
            facts = self._facts.get(m.bank_id, {})
            for f, (scope, ids) in facts.items():
                if merge and set(ids) & set(m.merged_ids):
                    ids = [m.survivor_id if i in m.merged_ids else i for i in ids]
                elif not merge and m.entity_id in ids:
                    ids = [*ids, m.new_entity_id]
                facts[f] = (scope, list(dict.fromkeys(ids)))

    def _drop_scope(self, bank_id: str, scope: str) -> None:
        facts = self._facts.get(bank_id, {})
        for f in [f for f, (sc, _) in facts.items() if sc == scope]:
            del facts[f]

    def rows(self) -> dict[str, list[tuple[str, str, str]]]:
        """bank id → [(entity id, scope, fact id)] of the memories still there."""
        return {b: [(e, sc, f) for f, (sc, es) in facts.items() for e in es]
                for b, facts in self._facts.items() if facts}


def on_facts_retracted(m: ev.FactsRetracted, meta: EventMeta, *,
                       resolver: EntityResolver) -> list:
    """Restore: a retraction forgets here what it forgot where it was decided
    (:func:`on_document_delete_requested`, :func:`on_memory_delete_requested`,
    :func:`on_bank_deleted`), in changelog order: a deleted bank's entities (so a bank
    created again under the same id starts afresh), or the entities only the deleted
    document or memories named. Produces nothing."""
    if m.bank_deleted:
        resolver.forget(m.bank_id)
    elif m.document_id:
        resolver.forget_scope(m.bank_id, document_scope(m.document_id))
    elif m.memory_ids:
        resolver.forget_facts(m.bank_id, list(m.memory_ids))
    # what the deciding replica forgot, by id: this replica may not know the mentions
    # that tell (a deleted memory's facts are erased on the log; older events lack it)
    resolver.forget_entities(m.bank_id, list(m.forgotten_entity_ids))
    return []


def on_consolidation_requested(m: ev.ConsolidationRequested,
                               meta: EventMeta) -> list[ev.ConsolidationScheduled]:
    """Scheduled through here (like deletions) so consolidation sees the request after
    the bank's earlier facts (one partition, one order)."""
    return [ev.ConsolidationScheduled(
        bank_id=m.bank_id, operation_id=m.operation_id, action=m.action,
        observation_scopes=m.observation_scopes if m.HasField("observation_scopes") else None,
        memory_id=m.memory_id)]


def on_document_delete_requested(m: ev.DocumentDeleteRequested, meta: EventMeta, *,
                                 resolver: EntityResolver) -> list[ev.FactsRetracted]:
    """The document's facts are retracted (every projection drops them), and the entities
    only it mentioned are forgotten by entity resolution."""
    gone = resolver.forget_scope(m.bank_id, document_scope(m.document_id))
    return [ev.FactsRetracted(bank_id=m.bank_id, operation_id=m.operation_id,
                              document_id=m.document_id, forgotten_entity_ids=gone)]


def on_memory_delete_requested(m: ev.MemoryDeleteRequested, meta: EventMeta, *,
                               resolver: EntityResolver) -> list[ev.FactsRetracted]:
    """The memory is retracted, and the entities only it mentioned are forgotten by
    entity resolution (as for a document: their names are user content)."""
    gone = resolver.forget_facts(m.bank_id, [m.memory_id])
    return [ev.FactsRetracted(bank_id=m.bank_id, operation_id=m.operation_id,
                              memory_ids=[m.memory_id], forgotten_entity_ids=gone)]


def on_bank_deleted(m: ev.BankDeleted, meta: EventMeta, *, resolver: EntityResolver,
                    catalog: Catalog | None = None) -> list[ev.FactsRetracted]:
    """The bank's entities are forgotten (and, with its own ``catalog``, the bank), and
    all of its facts retracted."""
    bank_catalog.on_bank_deleted(m, meta, catalog=catalog)
    resolver.forget(m.bank_id)
    return [ev.FactsRetracted(bank_id=m.bank_id, bank_deleted=True,
                              operation_id=m.operation_id)]


def extract(m: ev.RetainRequested, source_id: str, extractor, embedder: Embedder,
            at: datetime | None = None, stop: Callable[[], bool] | None = None,
            unstored: list[tuple[str, int]] | None = None) -> ev.FactsExtracted:
    """Extract and embed every item of a retain request. An item that fails is recorded
    in ``failures`` with its reason; the others still yield facts. Items ingest refused
    (``rejected_items``, empty placeholders) are not extracted and fail with ingest's
    error; the extractor sees the other items in order, and the item indexes of facts,
    failures and no-fact items are mapped back to the request's. An item without a
    timestamp (hand-written or very old events) is dated ``at``, the event's time.
    ``stop()`` true (the operation was cancelled) before extraction starts fails every
    item with reason "cancelled"; the extractor asks it again between items (an LLM
    extractor) or slices of items (the offline one). When extraction ran to its end,
    embedding asks it between slices of texts, and an item whose facts were not all
    embedded when it turned true is cancelled too: every item either has all its facts,
    with their vectors, or fails. ``unstored`` (a list) gets (entity id, item index) for
    the entities resolved for a cancelled item (its speakers, the facts cancelled while
    embedding): names it gave that no stored fact carries."""
    unstored = unstored if unstored is not None else []
    rejected = {r.item_index: r for r in m.rejected_items}
    keep = [i for i in range(len(m.items)) if i not in rejected]
    items = [codec.retain_item_from_pb(m.items[i]) for i in keep]
    items = [it if it.timestamp is not None else replace(it, timestamp=at or _EPOCH)
             for it in items]
    failures: list[ev.ItemFailure] = []
    if not items:
        facts = []
    elif stop is not None and stop():
        facts, failures = [], [_cancelled(i) for i in range(len(items))]
    else:
        facts, failures, resolved = _extract_items(m, items, source_id, extractor, stop)
        unstored.extend((i, keep[k]) for k, ids in resolved.items() for i in ids)
    report = getattr(extractor, "report", lambda _: None)(source_id) if items else None
    # the model found nothing in an item, but facts kept beside the model's (offline
    # ones) may have: such an item is not a no-fact item
    with_facts = {f.item_index for f in facts}
    for f in facts:
        f.item_index = keep[f.item_index]
    for f in failures:
        f.item_index = keep[f.item_index]
    no_fact_items = [keep[i] for i in (report.no_fact_items if report is not None else [])
                     if i not in with_facts]
    if facts:
        # An extractor may embed a fact as other texts than its own (its sentences, the
        # turn it answers or follows); the vector travels in the event, so replay reuses it.
        # (A per-bank-mode extractor answers for the extractor this bank used.)
        # a cancel seen during extraction already cut it short: what it extracted is
        # embedded and kept; otherwise a cancel stops embedding between slices
        cut_short = any(f.reason == CANCELLED for f in failures)
        vectors = unit_vectors(facts, embedder, extractor, m.bank_id,
                               stop=None if cut_short else stop)
        for f, v in zip(facts, vectors):
            f.embedding = list(v)
        if len(vectors) < len(facts):  # cancelled while embedding: drop the items not done
            undone = sorted({f.item_index for f in facts[len(vectors):]})
            gone = set(undone)
            unstored.extend((e.id, f.item_index) for f in facts if f.item_index in gone
                            for e in f.entities)
            facts = [f for f in facts[:len(vectors)] if f.item_index not in gone]
            failures += [_cancelled(i) for i in undone]
    failures = sorted([*failures, *(ev.ItemFailure(item_index=i, error=r.error, field=r.field,
                                                   reason=r.reason or "rejected")
                                    for i, r in rejected.items())],
                      key=lambda f: f.item_index)
    # a document replaces its old facts only when the retain reached it: one whose items
    # were all cancelled keeps what it had
    skipped = {f.item_index for f in failures if f.reason == CANCELLED}
    docs = sorted({it.document_id for i, it in zip(keep, items)
                   if it.document_id and i not in skipped})
    failed = {f.item_index for f in failures}
    no_facts = set(no_fact_items) - failed
    telemetry.count_retain_documents(len(m.items) - len(failed) - len(no_facts), len(no_facts),
                                     len(failed))
    usage = None
    if report is not None and report.usage.calls:
        u = report.usage
        usage = ev.LlmUsage(model=u.model, calls=u.calls, failed_calls=u.failed_calls,
                            input_tokens=u.input_tokens, output_tokens=u.output_tokens,
                            cost_usd=u.cost_usd)
    out = ev.FactsExtracted(
        bank_id=m.bank_id, operation_id=m.operation_id,
        facts=[codec.fact_to_pb(f) for f in facts], embedding_model=embedder.model_name,
        replaced_document_ids=docs, items_total=len(m.items), failures=failures,
        no_fact_items=no_fact_items, llm_usage=usage,
        cancelled=any(f.reason == CANCELLED for f in failures))
    for f in out.facts:  # a fact is sealed with its item's keys (mneme.bus.sealing)
        f.seal.keys.extend(m.items[f.item_index].seal.keys)
    return out


def _cancelled(i: int) -> ev.ItemFailure:
    return ev.ItemFailure(item_index=i, reason=CANCELLED,
                          error="cancelled: the operation was cancelled before this item "
                                "was extracted")


def _failure(i: int, e: BaseException, item, reason: str = "") -> ev.ItemFailure:
    """Item ``i``'s failure ``e`` as it goes on the log, in the clear: the error's message
    left out when it quotes the item's text, context or metadata (an extractor's error on
    the text it choked on, a provider's echo), which the deletion of its document could
    not reach there."""
    said = [item.content, item.context, *item.metadata.keys(), *item.metadata.values()]
    error = f"{type(e).__name__}: {e}"
    if quotes(error, said):
        error = f"{type(e).__name__}: (its message quotes the item: not repeated)"
    return ev.ItemFailure(item_index=i, error=error, reason=reason)


def _extract_items(m: ev.RetainRequested, items: list, source_id: str,
                   extractor, stop: Callable[[], bool] | None = None
                   ) -> tuple[list, list[ev.ItemFailure], dict[int, list[str]]]:
    """(facts, failures, entity ids resolved for failed items:
    :attr:`ExtractionIncomplete.resolved`) of ``items``, indexes local to ``items``."""
    failures: list[ev.ItemFailure] = []
    resolved: dict[int, list[str]] = {}
    more = {"stop": stop} if stop is not None else {}
    try:
        with telemetry.span("extraction.extract", mneme__bank_id=m.bank_id,
                            mneme__items=len(items), mneme__extractor=type(extractor).__name__):
            facts = extractor.extract_many(m.bank_id, items, source_id, **more)
    except ExtractionIncomplete as e:  # per-item outcomes are known: no second pass
        for f in e.failures.values():
            if resource_shortage(f) is not None:  # the process's failure, not the item's
                raise f
        facts, resolved = e.facts, e.resolved
        failures = [_cancelled(i) if f.reason == CANCELLED else
                    _failure(i, f, items[i], f.reason) for i, f in sorted(e.failures.items())]
    except Cancelled:  # the process is stopping: the event is handled again on restart
        raise
    except Exception as e:  # one bad item must not sink the batch: retry item by item
        # A full disk or the open-file limit is no item's fault: recorded as the items'
        # failures, their facts would be lost for good; raised, the event is handled
        # again once there is room (mneme.bus.consumer.ShortOfResources)
        if resource_shortage(e) is not None:
            raise
        # (no traceback: the error may quote the items' text, which a log keeps)
        log.warning("batch extraction failed (%s); retrying per item", type(e).__name__)
        facts = []
        for i, item in enumerate(items):
            if stop is not None and stop():
                failures.append(_cancelled(i))
                continue
            try:
                facts.extend(extractor.extract(m.bank_id, item, i, source_id))
            except Cancelled:
                raise
            except Exception as e:
                if resource_shortage(e) is not None:
                    raise
                failures.append(_failure(i, e, item))
    return facts, failures, resolved
