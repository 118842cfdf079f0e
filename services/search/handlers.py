"""search's projection handlers: memory events → upserts and deletes in the three
stores, then an OperationProgress event (read-your-writes for sync retain).

Upserts are idempotent by fact id, so a redelivered event changes nothing."""

from __future__ import annotations

import logging
import threading
from dataclasses import dataclass, field, replace

from mneme import telemetry
from mneme.bus import codec
from mneme.domain import CONSOLIDATION_REQUEST_TRIGGERS, OPINION, EventMeta
from mneme.events.v1 import events_pb2 as ev
from mneme.ports import GraphStore, TextStore, VectorStore
from services.search.observations import OBSERVATION, project_observations, retract_observations
from services.search.opinions import project_opinions, retract_opinions

log = logging.getLogger(__name__)


class EmbeddingModelMismatch(ValueError):
    """An event carries vectors of another embedding model than the vector store holds
    (cosines across two models mean nothing): a model change must be explicit, never
    mixed in by a projection or a replay."""


@dataclass
class Projections:
    """The three search projections, written together. ``embedding_model`` names the
    model of the vector store's vectors (:attr:`mneme.ports.Embedder.model_name`); events
    recording another model are refused (:class:`EmbeddingModelMismatch`); "" accepts
    any (tests without a model).

    ``adopt`` (a replay's build of a new generation, :meth:`building`): a bank's events of
    another model are accepted, and the bank remembered as holding that model's vectors
    until a complete :class:`~mneme.events.v1.events_pb2.VectorsReplaced` of this store's
    model (``mneme reembed`` appended it after them) re-embeds it. :meth:`unswitched`
    lists the banks left with another model's vectors at the end (the replay's check
    refuses to switch to them). Old-model events after a re-embed are not refused here
    (a server under the old model may have written them after an interrupted re-embed,
    which the complete one re-embeds again): the check reports them if none did."""

    vectors: VectorStore
    text: TextStore
    graph: GraphStore
    embedding_model: str = ""
    adopt: bool = False
    #: bank → the other model whose vectors it holds (adopt: not re-embedded since)
    foreign: dict = field(default_factory=dict, repr=False)

    def building(self, vectors, text, graph) -> "Projections":
        """Projections over other adapters (a new generation's, wrapped) with this
        model, in adopt mode (see the class docstring)."""
        return Projections(vectors, text, graph, self.embedding_model, adopt=True)

    def check_model(self, bank_id: str, model: str, what: str) -> None:
        """Raise :class:`EmbeddingModelMismatch` when ``model`` (recorded on an event of
        ``bank_id`` that carries ``what``) is set and is not this store's model (adopt:
        remembered instead: :meth:`unswitched`)."""
        if self.embedding_model and model and model != self.embedding_model:
            if self.adopt:
                self.foreign[bank_id] = model
                return
            raise EmbeddingModelMismatch(
                f"bank {bank_id}: {what} embedded with {model!r}, this vector store holds "
                f"{self.embedding_model!r} vectors (MNEME_EMBEDDING_MODEL); run with "
                f"MNEME_EMBEDDING_MODEL={model} or re-embed: mneme reembed --model "
                f"{self.embedding_model}")

    def switch(self, bank_id: str) -> None:
        """``bank_id``'s vectors are this store's model's from here on (a complete
        re-embed) or gone (a deleted bank)."""
        self.foreign.pop(bank_id, None)

    def unswitched(self) -> list[str]:
        """Problems: the banks holding vectors of another model (adopt mode)."""
        return [f"bank {b}: its vectors are {m!r}'s, not {self.embedding_model!r}'s (no "
                f"re-embed on the log: mneme reembed --model {self.embedding_model})"
                for b, m in sorted(self.foreign.items())]

    def all(self):
        return (self.vectors, self.text, self.graph)

    def each(self, op: str, bank_id: str):
        """(store, span) for every store: one ``store.<op>`` span around each write. A
        "delete" writes the vector store last: a deletion retried after another store
        failed reads the vector store to learn what it deletes (the units of a document,
        whether a memory exists), so that must still hold them."""
        stores = (("vector", self.vectors), ("text", self.text), ("graph", self.graph))
        if op == "delete":
            stores = stores[1:] + stores[:1]
        for kind, s in stores:
            with telemetry.span(f"store.{op} {kind}", mneme__store=kind,
                                mneme__store_class=type(getattr(s, "target", s)).__name__, mneme__bank_id=bank_id):
                yield s

    def reset(self) -> None:
        for s in self.all():
            s.reset()

    def flush(self) -> None:
        """Make every write to the three stores durable (``VectorStore.flush``): the
        runners call it before they commit the offsets of the records written. Raises
        what a store raises (after flushing the others: a retry has less to do)."""
        errors: list[Exception] = []

        def flush(store) -> None:
            try:
                store.flush()
            except Exception as exc:  # flush the others anyway
                errors.append(exc)

        # The graph's purge after deletions is a rewrite in the graph server's own
        # process: started first, it overlaps the in-process purges of the other two
        # (Qdrant Edge's holds the GIL), so a deletion waits for the longest, not the sum.
        graph = threading.Thread(target=flush, args=(self.graph,), name="mneme-graph-flush")
        graph.start()
        flush(self.vectors)
        flush(self.text)
        graph.join()
        if errors:
            raise errors[0]

    def upsert(self, bank_id: str, facts) -> None:
        """Upsert ``facts`` (of ``bank_id``) into every store, all or nothing: when a
        store fails, the units are deleted again from every store written so far (the
        failing one included: it may have written a batch) before the error is raised, so
        no unit is left in one store but not another. A retry writes them all again; a
        dead letter leaves them in none (and fails the operation)."""
        written = []
        for s in self.each("upsert", bank_id):
            written.append(s)
            try:
                s.upsert(facts)
            except Exception:
                ids = [f.id for f in facts]
                for w in written:
                    try:
                        w.delete(bank_id, ids)
                    except Exception:  # keep undoing the others; the retry repairs it
                        log.exception("search: cannot undo %d units in %s", len(ids),
                                      type(w).__name__)
                raise


def on_facts_extracted(m: ev.FactsExtracted, meta: EventMeta, *,
                       stores: Projections) -> list[ev.OperationProgress]:
    """The facts into every store (a replaced document's old units out first, all or
    nothing: :meth:`Projections.upsert`); the retain's progress (failed only when every
    item failed), on its last part when it came in several (``parts``), with the fact
    ids of every part."""
    for doc in m.replaced_document_ids:
        for s in stores.each("delete", m.bank_id):
            s.delete_where(m.bank_id, doc)
    if m.facts:
        stores.check_model(m.bank_id, m.embedding_model, "facts")
    facts = [codec.fact_from_pb(f, m.bank_id) for f in m.facts]
    if facts:
        stores.upsert(m.bank_id, facts)
    if m.part < m.parts:
        return []  # the operation ends with its last part
    ids = [*m.earlier_fact_ids, *(f.id for f in facts)]
    failed = {f.item_index for f in m.failures}
    # a cancelled retain fails (what was extracted before the cancel is stored)
    state = "failed" if m.cancelled or failed and len(failed) == m.items_total else "succeeded"
    skipped = sum(f.reason == "cancelled" for f in m.failures)
    error = "; ".join(f"items[{f.item_index}]: {f.error}" for f in m.failures
                      if f.reason != "cancelled")
    if m.cancelled:
        error = (f"cancelled: {skipped} of {m.items_total} item(s) were not processed "
                 "(CancelOperation)" + (f"; {error}" if error else ""))
    return [ev.OperationProgress(
        bank_id=m.bank_id, operation_id=m.operation_id, kind="retain", state=state,
        items_total=m.items_total, items_done=m.items_total - skipped, facts=len(ids),
        error=error, cancelled=m.cancelled,
        memory_ids=ids, items_no_facts=len(m.no_fact_items),
        failures=list(m.failures))]


def on_facts_retracted(m: ev.FactsRetracted, meta: EventMeta, *,
                       stores: Projections) -> list[ev.OperationProgress]:
    """A deleted bank, document or memories out of every store; the deletion's progress
    (none for a retraction that is not an operation: a bank deleted before DeleteBank
    had one). A DeleteMemory of a memory the bank does not hold (never there, or deleted
    already) fails with "memory not found", as DeleteOpinion does, and one of an
    observation or an opinion fails too (they are consolidation's to delete), deleting
    nothing. The progress is committed after the stores' flush, which makes the deletion
    physical (:meth:`mneme.ports.VectorStore.flush`), once per batch."""
    missing = False
    if m.memory_ids and not m.bank_deleted and not m.document_id:
        units = stores.vectors.get(m.bank_id, list(m.memory_ids))
        kinds = {u.fact_type for u in units}
        # DeleteMemory deletes facts. An observation or opinion is consolidation's: deleted
        # here only, consolidation would bring it back with its next change.
        refused = ("an observation, not a fact: ClearObservations re-derives it"
                   if OBSERVATION in kinds else
                   "an opinion, not a fact: DeleteOpinion deletes it" if OPINION in kinds
                   else "")
        if refused:
            return ([ev.OperationProgress(bank_id=m.bank_id, operation_id=m.operation_id,
                                          kind="delete_memory", state="failed", error=refused)]
                    if m.operation_id else [])
        # Not found: the deletes below still run (idempotent), finishing a deletion this
        # event began before a store failed (the vector store is deleted last).
        missing = not units
    if m.bank_deleted:
        stores.switch(m.bank_id)
        for s in stores.each("delete", m.bank_id):
            s.delete_where(m.bank_id, None)
    gone = list(m.memory_ids)
    if m.document_id:
        for s in stores.each("delete", m.bank_id):
            ids = s.delete_where(m.bank_id, m.document_id)
            if s is stores.vectors:
                gone.extend(ids or ())
    if m.memory_ids:
        for s in stores.each("delete", m.bank_id):
            s.delete(m.bank_id, list(m.memory_ids))
    if gone and not m.bank_deleted:
        # the observations quoting them hold their text and (one source) their vector
        retract_observations(stores.vectors, m.bank_id, gone)
        retract_opinions(stores.vectors, m.bank_id, gone)
    if not m.operation_id:
        return []
    kind = ("delete_bank" if m.bank_deleted else
            "delete_document" if m.document_id else "delete_memory")
    if missing:
        return [ev.OperationProgress(bank_id=m.bank_id, operation_id=m.operation_id,
                                     kind=kind, state="failed", error="memory not found")]
    return [ev.OperationProgress(bank_id=m.bank_id, operation_id=m.operation_id, kind=kind,
                                 state="succeeded")]


def on_observations_changed(m: ev.ObservationsChanged, meta: EventMeta, *,
                            stores: Projections) -> list[ev.OperationProgress]:
    """Observations into the vector store (units of fact_type "observation"); progress
    only when the change completes a Consolidate / ClearObservations request (on its
    last part, when it came in several: ``parts``)."""
    for o in m.observations:
        if not o.deleted:
            stores.check_model(m.bank_id, o.embedding_model, "observations")
    project_observations(m, stores.vectors)
    if m.part < m.parts or not (m.operation_id and m.trigger in CONSOLIDATION_REQUEST_TRIGGERS):
        return []
    return [ev.OperationProgress(bank_id=m.bank_id, operation_id=m.operation_id,
                                 kind="consolidate", state="succeeded")]


def on_opinions_changed(m: ev.OpinionsChanged, meta: EventMeta, *,
                        stores: Projections) -> list[ev.OperationProgress]:
    """Opinions into the vector store (units of fact_type "opinion"); a DeleteOpinion's
    progress: succeeded, or failed when the bank held no such opinion."""
    for o in m.opinions:
        if not o.deleted:
            stores.check_model(m.bank_id, o.embedding_model, "opinions")
    project_opinions(m, stores.vectors)
    if not (m.operation_id and m.trigger == "delete_opinion"):
        return []
    if m.opinions:
        return [ev.OperationProgress(bank_id=m.bank_id, operation_id=m.operation_id,
                                     kind="delete_opinion", state="succeeded")]
    return [ev.OperationProgress(bank_id=m.bank_id, operation_id=m.operation_id,
                                 kind="delete_opinion", state="failed",
                                 error="opinion not found")]


def on_vectors_replaced(m: ev.VectorsReplaced, meta: EventMeta, *,
                        stores: Projections) -> list:
    """A re-embed (``mneme reembed``): when its model is this store's (or the store
    names none), each unit still held gets the new vector (vector store only: the text
    and the graph do not depend on the model), and its bank's last batch marks the bank
    re-embedded (:meth:`Projections.switch`; an interrupted re-embed's first batches do
    not); a store of another model ignores it (a re-embed that has not switched yet, or
    one to another model). Units gone since (deleted, or erased: their seal's key was
    destroyed) are skipped. Idempotent; produces nothing."""
    model = stores.embedding_model
    if model and m.embedding_model != model:
        log.info("search: bank %s: ignoring vectors of %r (this store holds %r)",
                 m.bank_id, m.embedding_model, model)
        return []
    if m.batch >= m.batches - 1:
        stores.switch(m.bank_id)
    vectors = {u.id: list(u.vector) for u in m.units if u.vector}
    if vectors:
        held = stores.vectors.get(m.bank_id, list(vectors))
        if held:
            stores.vectors.upsert([replace(f, embedding=vectors[f.id])
                                   for f in held])
    return []


def on_entities_merged(m: ev.EntitiesMerged, meta: EventMeta, *,
                       stores: Projections) -> list[ev.OperationProgress]:
    """A user's merge into the graph (:meth:`mneme.ports.GraphStore.merge_entities`), in
    order with the facts: those extracted before it are rewritten, those after it name the
    survivor already. Idempotent. The merge's progress: failed when the survivor is gone
    (:func:`_gone`)."""
    gone = _gone(stores, m.bank_id, m.survivor_id, "merge_entities", m.operation_id)
    if gone:
        return gone
    stores.graph.merge_entities(m.bank_id, m.survivor_id, list(m.merged_ids), m.display_name)
    return [ev.OperationProgress(bank_id=m.bank_id, operation_id=m.operation_id,
                                 kind="merge_entities", state="succeeded")]


def _gone(stores: Projections, bank_id: str, entity_id: str, kind: str,
          operation_id: str) -> list[ev.OperationProgress]:
    """A correction is checked against the graph when it is requested, but corrections
    and deletions requested at once reach the log in either order: when the entity it
    keeps (a merge's survivor, the entity a split takes from) was merged away or deleted
    before it applies, it changes nothing and its operation fails, as it would have been
    refused had it been requested a moment later (entity resolution ignores it too). A
    correction never deletes that entity itself, so one applied again still finds it.
    [] when the entity exists."""
    if stores.graph.entity(bank_id, entity_id, units=0, neighbours=0) is not None:
        return []
    return [ev.OperationProgress(
        bank_id=bank_id, operation_id=operation_id, kind=kind, state="failed",
        error=f"entity {entity_id!r} was merged into another or deleted after this "
              "correction was requested; nothing was changed")]


def on_entity_split(m: ev.EntitySplit, meta: EventMeta, *,
                    stores: Projections) -> list[ev.OperationProgress]:
    """A user's split into the graph (:meth:`mneme.ports.GraphStore.split_entity`).
    Idempotent. The split's progress: failed when the entity is gone (:func:`_gone`)."""
    gone = _gone(stores, m.bank_id, m.entity_id, "split_entity", m.operation_id)
    if gone:
        return gone
    stores.graph.split_entity(m.bank_id, m.entity_id, m.new_entity_id, list(m.aliases),
                              m.display_name, list(m.memory_ids))
    return [ev.OperationProgress(bank_id=m.bank_id, operation_id=m.operation_id,
                                 kind="split_entity", state="succeeded")]
