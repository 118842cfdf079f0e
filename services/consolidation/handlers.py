"""consolidation's handlers: facts → observation decisions → ``ObservationsChanged``.

Consumes ``mneme.memory.v1`` (FactsExtracted, FactsRetracted, ConsolidationScheduled and
its own ObservationsChanged) and ``mneme.intake.v1`` (bank upserts/deletes, projected into
its own catalog in the distributed topology). Its state is a :class:`mneme.ports.ObservationStore`, a
projection of those events alone: every decision is expressed as an ObservationsChanged
(full observation states, consolidated / reset fact ids) that is applied to the store at
once (so the next fact sees it) and again, as a no-op, when it comes back from the log.
Replay (``decide=False``) applies the recorded events and decides nothing — no model.

Lifecycle: a retracted memory (deleted memory or document, replaced document) deletes the
observations it supported and resets their other sources to pending; with
``auto_consolidate`` they are re-derived in the same event. With ``auto_consolidate`` off,
new facts stay pending and the observations of their scopes are marked ``stale`` until a
Consolidate request. Event ids derive from the causing event (redelivery → same ids).
"""

from __future__ import annotations

import logging
from collections import OrderedDict
from dataclasses import dataclass
from datetime import datetime
from typing import Callable, Hashable

from mneme.bus import PART_BYTES, codec, pack
from mneme.domain import CONSOLIDATION_REQUEST_TRIGGERS, BankConfig, EventMeta
from mneme.errors import Cancelled
from mneme.events.v1 import events_pb2 as ev
from mneme.ports import ObservationStore
from services.consolidation import engine, opinions

log = logging.getLogger(__name__)

# Index rows (ScopeIndex.capacity: its observations and room for more) the scopes a
# Consolidator keeps between events may hold in all. A row is a float64 embedding and, when
# used, an observation's state: ~5 KB at 384 dimensions, so ~100 MB. The scopes used least
# recently are dropped first; a larger scope is read per event, as before.
SCOPE_CACHE_ROWS = 20_000

# The events consolidation decides on (the others it applies): their outputs are recorded
# with their writes (ObservationStore.record_decision).
_DECIDING = (ev.FactsExtracted, ev.FactsRetracted, ev.ConsolidationScheduled, ev.EntitiesMerged)


@dataclass
class _Scope:
    """One scope's live observations (id → state) and their index, as the store held
    them at ``revision``."""
    revision: Hashable
    current: dict[str, ev.Observation]
    index: engine.ScopeIndex


class Consolidator:
    """Decisions for one process. ``bank_config(bank_id)`` → BankConfig or None
    (defaults); ``embedder`` embeds model-written texts; ``llm`` is the gateway or None
    (offline); ``embedding_model``: the model of the vectors the store holds (default the
    embedder's; "" takes any), whose re-embeds (VectorsReplaced) it applies.
    ``part_bytes``: an ObservationsChanged larger goes out in parts (:func:`split_change`)."""

    def __init__(self, store: ObservationStore, bank_config: Callable[[str], BankConfig | None],
                 embedder=None, llm=None, embedding_model: str | None = None,
                 part_bytes: int = PART_BYTES):
        self.store, self.bank_config = store, bank_config
        self.part_bytes = part_bytes  # an ObservationsChanged larger goes out in parts
        self.embedder, self.llm = embedder, llm
        self.embedding_model = (embedding_model if embedding_model is not None
                                else getattr(embedder, "model_name", ""))
        # (bank, fact id) → (fact, its occurred window): the facts read during one event
        self._memo: dict[tuple[str, str], tuple[ev.Fact, tuple[int, int] | None]] = {}
        # (bank, scope key) → _Scope kept between events, least recently used first; and
        # those an event has taken (changed by its decisions until its change is applied)
        self._scopes: OrderedDict[tuple[str, str], _Scope] = OrderedDict()
        self._working: dict[tuple[str, str], _Scope] = {}

    def _facts_by_id(self, bank_id: str, ids) -> dict[str, ev.Fact]:
        """:meth:`ObservationStore.facts_by_id`, remembered for the event being handled:
        every revision of an observation re-reads all its evidence (to stamp its span and
        seal it), which made one event with many revisions read and parse the same facts
        again and again. Facts never change under an id, so within one event the memo is
        exact; it is dropped when the next event starts (bounded by one event's facts). Each
        fact's :func:`engine.fact_window` is kept with it (stamping a revision's span read
        every cited fact's times again)."""
        memo = self._memo
        want = [i for i in ids if (bank_id, i) not in memo]
        if want:
            for i, f in self.store.facts_by_id(bank_id, want).items():
                memo[(bank_id, i)] = (f, engine.fact_window(f))
        return {i: memo[(bank_id, i)][0] for i in sorted(set(ids)) if (bank_id, i) in memo}

    def _scope(self, bank_id: str, scope: list[str], key: str) -> _Scope:
        """The live observations of one scope and their :class:`engine.ScopeIndex`, for
        this event to decide with (and change). Kept from an earlier event while the
        store's :meth:`~mneme.ports.ObservationStore.revision` of the bank is the one they
        were kept at; else read from the store and indexed again (what every batch did
        before: reading and indexing a whole scope grew with the bank)."""
        s = self._working.get((bank_id, key))
        if s is not None:
            return s
        rev = self.store.revision(bank_id)
        s = self._scopes.pop((bank_id, key), None)
        if s is None or s.revision != rev:
            current = self.store.observations(bank_id, scope)
            s = _Scope(rev, current, engine.ScopeIndex(current))
        self._working[(bank_id, key)] = s
        return s

    def _apply(self, change: ev.ObservationsChanged) -> None:
        """Apply this event's ``change`` to the store, then keep the scopes it took, brought
        to the states the store now holds -- unless the store changed otherwise since they
        were read (then they are read again when next needed)."""
        bank = change.bank_id
        before = self.store.revision(bank)
        self.store.apply(change)
        after = self.store.revision(bank)
        for (b, key), s in self._working.items():
            if b != bank or s.revision != before:
                continue
            for o in change.observations:
                if o.deleted:
                    s.current.pop(o.id, None)
                    s.index.put(o)
                elif engine.scope_key(o.scope) == key:
                    cur = s.current.get(o.id)
                    if cur is None or cur.version <= o.version:
                        kept = ev.Observation()
                        kept.CopyFrom(o)
                        s.current[o.id] = kept
                        s.index.put(kept)
            if s.index.rows > 2 * len(s.current) + 64:  # mostly deleted rows: index anew
                s.index = engine.ScopeIndex(s.current)
            s.index.prime(())  # this event's queries are done
            s.revision = after
            self._scopes[(b, key)] = s
        self._working = {}
        held = sum(s.index.capacity for s in self._scopes.values())
        while held > SCOPE_CACHE_ROWS and self._scopes:
            held -= self._scopes.popitem(last=False)[1].index.capacity

    def _config(self, bank_id: str) -> BankConfig:
        return self.bank_config(bank_id) or BankConfig()

    # ---- entry point ------------------------------------------------------------------

    def handle(self, m, meta: EventMeta, decide: bool = True) -> list:
        """One memory event → the ObservationsChanged and OpinionsChanged it causes (none
        when ``decide`` is False: replay applies recorded decisions only)."""
        self._memo, self._working = {}, {}
        decides = decide and isinstance(m, _DECIDING)
        try:
            # One store transaction with the decisions it made: the log commits the outputs
            # after the store has, so after a crash in between the event comes again and
            # gets the decisions it made (deciding again from a store that holds them
            # would decide nothing, and the log, which replay rebuilds from, miss them).
            with self.store.transaction():
                if decides and (done := self.store.decision(meta.id)) is not None:
                    out = done
                else:
                    out = self._handle(m, meta, decide)
                    if decides:
                        self.store.record_decision(m.bank_id, meta.id, out)
        except BaseException:
            self._scopes.clear()  # they may hold states the rollback undid
            raise
        finally:
            self._working = {}  # taken and not kept by _apply: read again when needed
        return [p for o in out for p in (split_change(o, self.part_bytes) if isinstance(
            o, ev.ObservationsChanged) else (o,))]

    def _handle(self, m, meta: EventMeta, decide: bool) -> list:
        if isinstance(m, ev.ObservationsChanged):
            self.store.apply(m)
            return []
        if isinstance(m, ev.OpinionsChanged):
            self.store.apply_opinions(m)
            return []
        if isinstance(m, ev.VectorsReplaced):
            # a re-embed: the stored facts', observations' and opinions' vectors, when
            # they are of its model (another model's re-embed is not this store's)
            if not self.embedding_model or m.embedding_model == self.embedding_model:
                self.store.replace_vectors(m.bank_id, {u.id: list(u.vector) for u in m.units
                                                       if u.vector}, m.embedding_model)
            return []
        at, cause = meta.time, meta.id
        out: list = []  # this event's opinion changes, after its observation change
        if isinstance(m, ev.EntitiesMerged):  # opinions follow the user's correction
            return self._opinions([opinions.merge_entities(
                self.store, m.bank_id, m.survivor_id, m.merged_ids, m.display_name, at)]
                if decide else [])
        if decide and isinstance(m, ev.ConsolidationScheduled) and m.action == "delete_opinion":
            return self._opinions([opinions.delete(self.store, m.bank_id, m.memory_id,
                                                   m.operation_id, at)])
        change = ev.ObservationsChanged(bank_id=getattr(m, "bank_id", ""),
                                        operation_id=getattr(m, "operation_id", ""),
                                        decided_by="offline")
        if isinstance(m, ev.FactsExtracted):
            for doc in m.replaced_document_ids:
                ids = self.store.fact_ids_of_document(m.bank_id, doc)
                new_ids = {f.id for f in m.facts}
                gone = [i for i in ids if i not in new_ids]
                if decide:
                    self._retract(m.bank_id, gone, change, at, cause)
                    # applied now: the revision below must not see (and write back) the
                    # opinions that rested on the replaced facts
                    out += self._opinions([opinions.retract(self.store, m.bank_id, gone, at)])
                self.store.delete_facts(m.bank_id, gone)
            tags = {t for f in m.facts for t in f.tags}
            spec = m.observation_scopes if m.HasField("observation_scopes") else None
            self.store.add_facts(m.bank_id, [(f, engine.scopes_for(f.tags, spec, tags))
                                             for f in m.facts])
            if not decide:
                return []
            # opinions about the new facts' entities (a model judges; offline none)
            out.append(opinions.revise(self.store, self.llm, m.bank_id, m.facts, at))
            change.trigger = "auto"
            ids = [f.id for f in m.facts] + list(change.reset_memory_ids)
            if self._config(m.bank_id).auto_consolidate:
                self._consolidate(m.bank_id, self.store.facts(m.bank_id, ids, pending=True),
                                  change, at, cause)
            else:
                self._mark_stale(m.bank_id, [s for f in m.facts for s in
                                             engine.scopes_for(f.tags, spec, tags)], change, at)
        elif isinstance(m, ev.FactsRetracted):
            if m.bank_deleted:
                self.store.delete_bank(m.bank_id)
                return []
            ids = list(m.memory_ids)
            if m.document_id:
                ids += self.store.fact_ids_of_document(m.bank_id, m.document_id)
            if decide:
                change.trigger = "retract"
                self._retract(m.bank_id, ids, change, at, cause)
                out.append(opinions.retract(self.store, m.bank_id, ids, at))
                if self._config(m.bank_id).auto_consolidate:
                    self._consolidate(m.bank_id, self.store.facts(
                        m.bank_id, change.reset_memory_ids, pending=True), change, at, cause)
            self.store.delete_facts(m.bank_id, ids)
        elif isinstance(m, ev.ConsolidationScheduled):
            if not decide:
                return []
            self._request(m, change, at, cause)
        else:
            return []
        if not (change.observations or change.consolidated_memory_ids or change.reset_memory_ids
                or change.trigger in CONSOLIDATION_REQUEST_TRIGGERS):
            return self._opinions(out)
        self._apply(change)
        return [change, *self._opinions(out)]

    def _opinions(self, changes) -> list[ev.OpinionsChanged]:
        """The opinion changes decided (None: none), applied to the store at once (a
        change applied already is applied again: idempotent)."""
        done = [c for c in changes if c is not None]
        for c in done:
            self.store.apply_opinions(c)
        return done

    # ---- decisions --------------------------------------------------------------------

    def _put(self, change: ev.ObservationsChanged, obs: ev.Observation) -> None:
        """Record ``obs`` in ``change`` (replacing this event's earlier state of it). A live
        one is stamped with the occurred span of its evidence first — the one place every
        decision (offline, model, merge, stale marks) passes, so the span never lags."""
        if obs.deleted:  # no content: the deletion stays readable once its keys are gone
            obs = codec.tombstone(obs)
        else:
            cited = self._facts_by_id(change.bank_id, [e.memory_id for e in obs.evidence])
            engine.stamp_span(obs, (self._memo[(change.bank_id, i)][1] for i in cited))
            # Sealed with every key of every fact it has ever cited (its history quotes
            # them): deleting any of those facts makes all its states unreadable on the log.
            have, new = set(obs.seal.keys), []
            for f in cited.values():  # (a set: an observation cites hundreds of keys)
                for k in f.seal.keys:
                    if k not in have:
                        have.add(k)
                        new.append(k)
            obs.seal.keys.extend(new)
        for i, o in enumerate(change.observations):
            if o.id == obs.id:
                change.observations[i].CopyFrom(obs)
                return
        change.observations.append(obs)

    def _retract(self, bank_id: str, ids, change, at: datetime, cause: str) -> None:
        """Delete the observations whose evidence cites ``ids``; reset their other sources."""
        gone = set(ids)
        if not gone:
            return
        reset: set[str] = set()
        for o in self.store.observations(bank_id).values():
            cited = {e.memory_id for e in o.evidence}
            if cited & gone:
                new = engine.next_state(o, at)
                new.deleted = True
                new.history.add(text=o.text, at=new.updated_at, reason="evidence retracted")
                self._put(change, new)
                reset |= cited - gone
        have = set(change.reset_memory_ids)
        change.reset_memory_ids.extend(sorted(reset - have))
        # Apply now: the re-derivation below must see the deletions and pending sources.
        self.store.apply(ev.ObservationsChanged(bank_id=bank_id, observations=change.observations,
                                                reset_memory_ids=change.reset_memory_ids))

    def _mark_stale(self, bank_id: str, scopes, change, at: datetime) -> None:
        keys = {engine.scope_key(s) for s in scopes}
        for o in self.store.observations(bank_id).values():
            if engine.scope_key(o.scope) in keys and not o.stale:
                new = engine.next_state(o, at)
                new.updated_at.CopyFrom(o.updated_at)  # stale is not a revision
                new.stale = True
                self._put(change, new)

    def _consolidate(self, bank_id: str, facts, change, at: datetime, cause: str,
                     only_scopes: set[str] | None = None) -> None:
        """Consolidate ``facts`` [(ev.Fact, scopes)] into their scopes' observations."""
        if not facts:
            return
        cfg = self._config(bank_id)
        by_scope: dict[str, tuple[list[str], list[ev.Fact]]] = {}
        for f, scopes in facts:
            for s in scopes:
                k = engine.scope_key(s)
                if only_scopes is None or k in only_scopes:
                    by_scope.setdefault(k, (sorted(set(s)), []))[1].append(f)
        done: set[str] = set()
        model = getattr(self.embedder, "model_name", "")
        for k in sorted(by_scope):
            scope, scope_facts = by_scope[k]
            kept = self._scope(bank_id, scope, k)
            current, index = kept.current, kept.index
            for o in change.observations:  # this event's earlier decisions win
                if engine.scope_key(o.scope) == k:
                    if o.deleted:
                        current.pop(o.id, None)
                    else:
                        current[o.id] = o
                    index.put(o)
            touched: list[str] = []
            by_model = False
            if self.llm is not None and self.llm.configured("consolidation"):
                try:
                    touched = self._llm(bank_id, scope, scope_facts, current, change, at, cause,
                                        cfg, index)
                    change.decided_by, by_model = "llm", True
                except Cancelled:  # the process is stopping: decide again after the restart
                    raise
                except Exception as e:  # the model failed: decide offline, say so in the log
                    log.warning("consolidation model failed (%r); deciding offline", e)
                    touched = []
            if not by_model:
                self._offline(scope, scope_facts, current, change, at, cause, model, touched,
                              index)
            if touched and cfg.dedup_threshold < 1.0:
                for o in engine.reconcile(current, touched, cfg.dedup_threshold, at, index):
                    self._put(change, o)
            for o in current.values():  # the scope is consolidated now: nothing is stale
                if o.stale and not o.deleted:
                    new = engine.next_state(o, at)
                    new.updated_at.CopyFrom(o.updated_at)
                    self._put(change, new)
            for i in [i for i, o in current.items() if o.deleted]:  # a merge's losers
                del current[i]
            done |= {f.id for f in scope_facts}
        have = set(change.consolidated_memory_ids)
        change.consolidated_memory_ids.extend(sorted(done - have))

    def _offline(self, scope, facts, current, change, at, cause, model, touched,
                 index: engine.ScopeIndex) -> None:
        def lookup(ids):
            return self._facts_by_id(change.bank_id, ids)
        index.prime(f.embedding for f in facts)
        for f in facts:
            new = engine.decide_offline(f, scope, current, at, cause, model, lookup, index)
            if new is not None:
                current[new.id] = new
                index.put(new)
                self._put(change, new)
                touched.append(new.id)

    def _llm(self, bank_id, scope, facts, current, change, at, cause, cfg,
             index: engine.ScopeIndex) -> list[str]:
        from services.consolidation import llm as llm_decide
        texts = {f.id: f.text for f in facts}
        shown = llm_decide.nearest(facts, current)
        for o in shown:
            for f, _ in self.store.facts(bank_id, [e.memory_id for e in o.evidence]):
                texts[f.id] = f.text
        changed, usage = llm_decide.decide(
            self.llm, facts, scope, current, texts, at, f"{cause}/{engine.scope_key(scope)}",
            self.embedder.embed, getattr(self.embedder, "model_name", ""),
            cfg.observations_mission)
        u = change.llm_usage
        u.model = usage.model or u.model
        u.calls += usage.calls
        u.input_tokens += usage.input_tokens
        u.output_tokens += usage.output_tokens
        u.cost_usd += usage.cost_usd
        for o in changed:
            if o.deleted:
                current.pop(o.id, None)
            else:
                current[o.id] = o
            index.put(o)
            self._put(change, o)
        return [o.id for o in changed if not o.deleted]

    def _request(self, m: ev.ConsolidationScheduled, change, at: datetime, cause: str) -> None:
        change.trigger = m.action or "consolidate"
        bank = m.bank_id
        if m.action in ("reconsolidate", "clear"):
            live = self.store.observations(bank)
            for o in live.values():
                new = engine.next_state(o, at)
                new.deleted = True
                new.history.add(text=o.text, at=new.updated_at, reason=f"{m.action} requested")
                self._put(change, new)
            change.reset_memory_ids.extend(f.id for f, _ in self.store.facts(bank))
            self.store.apply(ev.ObservationsChanged(bank_id=bank, observations=change.observations,
                                                    reset_memory_ids=change.reset_memory_ids))
            if m.action == "reconsolidate":
                self._consolidate(bank, self.store.facts(bank, pending=True), change, at, cause)
        elif m.action == "clear_memory":
            self._retract(bank, [m.memory_id], change, at, cause)
            if m.memory_id not in change.reset_memory_ids:
                change.reset_memory_ids.append(m.memory_id)
            ids = list(change.reset_memory_ids)
            self.store.apply(ev.ObservationsChanged(bank_id=bank, reset_memory_ids=[m.memory_id]))
            self._consolidate(bank, self.store.facts(bank, ids, pending=True), change, at, cause)
        else:
            only = None
            if m.HasField("observation_scopes") and m.observation_scopes.scopes:
                only = {engine.scope_key(s.tags) for s in m.observation_scopes.scopes}
            self._consolidate(bank, self.store.facts(bank, pending=True), change, at, cause, only)


def split_change(m: ev.ObservationsChanged, budget: int | None = None
                 ) -> list[ev.ObservationsChanged]:
    """``m`` as one record, or, when it encodes to more than ``budget`` bytes (default
    :data:`mneme.bus.PART_BYTES`), as parts 1..n of n (``part``/``parts``): its reset
    ids, then its observations, then its consolidated ids, in that order, packed into
    consecutive parts of at most ``budget`` bytes (one observation larger than that goes
    alone). A fact both reset and consolidated is listed as consolidated only: what one
    record leaves (:meth:`mneme.ports.ObservationStore.apply` marks reset ids, then
    consolidated ones), without the fact reading as pending between the parts. Only the
    last part carries ``llm_usage``. Deterministic, so a redelivery splits alike."""
    budget = PART_BYTES if budget is None else budget
    if m.ByteSize() <= budget:
        return [m]
    done = set(m.consolidated_memory_ids)
    # (field, element, its encoded size with the field's tag and length)
    entries = [*(("reset_memory_ids", i, len(i) + 3) for i in m.reset_memory_ids
                 if i not in done),
               *(("observations", o, o.ByteSize() + 8) for o in m.observations),
               *(("consolidated_memory_ids", i, len(i) + 3) for i in m.consolidated_memory_ids)]
    groups = pack(entries, lambda e: e[2], budget)
    if len(groups) == 1:
        return [m]
    out = []
    for k, group in enumerate(groups, 1):
        part = ev.ObservationsChanged(bank_id=m.bank_id, operation_id=m.operation_id,
                                      trigger=m.trigger, decided_by=m.decided_by, part=k,
                                      parts=len(groups))
        for field, element, _ in group:
            getattr(part, field).append(element)
        if k == len(groups) and m.HasField("llm_usage"):
            part.llm_usage.CopyFrom(m.llm_usage)
        out.append(part)
    return out


def on_memory_event(m, meta: EventMeta, *, consolidator: Consolidator,
                    decide: bool = True) -> list:
    """FactsExtracted, FactsRetracted, ConsolidationScheduled and consolidation's own
    ObservationsChanged and OpinionsChanged (see :meth:`Consolidator.handle`)."""
    return consolidator.handle(m, meta, decide=decide)


def on_memory_restore(m, meta: EventMeta, *, consolidator: Consolidator) -> list:
    """Restore: a memory event applied as replay applies it (recorded decisions only,
    nothing decided, no model), so a replica assigned a partition holds the observation
    state its previous owners left. Produces nothing."""
    consolidator.handle(m, meta, decide=False)
    return []
