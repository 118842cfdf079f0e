"""Mental models: named, user-curated standing answers of a bank, kept by reflect.

Every change is a ``MentalModelChanged`` event on ``mneme.intake.v1`` (keyed by bank, so in
order with the bank's creation and deletion). Every bank catalog projects it, and
:mod:`mneme.bank_catalog` keeps each content change as a revision.

- **Refresh.** A full refresh runs reflect on the model's ``source_query`` within its
  tags: the reflect model's agent, or the extractive answer without one. A delta refresh
  (:meth:`MentalModels.refresh` with ``mode="delta"``) revises the current content with
  only what changed in its scope since it was made (:meth:`MentalModels.changes`, read
  from the log like staleness): statements whose cited memories were all retracted or
  deleted drop out, the rest is kept, and the new memories are merged in, by the reflect
  model (:meth:`services.reflect.agent.ReflectAgent.revise`) or, without one, appended as
  cited sentences within ``max_tokens``. The event records the content, the memory ids it
  cites and the mode, so replay rebuilds models and history without a model call.
- **Staleness** is read from the log. The event records where the bank's partition of
  ``mneme.memory.v1`` ended when the content was made. A model is stale once a later record
  of that partition changes a fact or observation of its bank in its scope: untagged models
  see every change, tagged ones those on untagged units or units sharing a tag, and any
  retraction. Replay rebuilds the same offsets, so staleness survives it.
- **Scheduled refreshes.** The group ``reflect-refresh`` follows ``mneme.memory.v1`` and
  refreshes the models whose policy is due (:meth:`refresh_due`). It is not a projection:
  replay does not run it, and the refreshes it made are on the log already.
- **Search** (:meth:`MentalModels.search`, reflect's ``search_mental_models`` tool, and
  the offline early answer) fuses two rankings with reciprocal rank fusion: keyword
  overlap of the question's content words with the name and query (and, at half weight,
  the content), and the cosine of the bank's embedder between the question and
  name + query + content (cached per model revision). RRF rather than a weighted sum: the
  two scores are on unrelated scales (a share of words; a cosine whose spread depends on
  the embedding model), and ranks need no calibration per embedder.
- **Reflect.** Offline, a fresh model whose name and query cover the question answers it
  (:meth:`answer_offline`); a stale one is not trusted alone: the answer comes from recall
  and quotes the model as context. With a model, the agent sees stale models marked so
  and must search observations or facts before answering.
"""

from __future__ import annotations

import contextlib
import logging
import math
import re
import threading
import uuid
from collections import OrderedDict
from dataclasses import dataclass, field, replace
from datetime import datetime, timezone
from typing import Callable, ContextManager, Iterable, Sequence

from mneme.domain import (MENTAL_MODEL_FIELDS, REFRESH_POLICIES, MentalModel, MentalModelRevision,
                          Memory, from_epoch)
from mneme.domain import tags_match as match_tags
from mneme.errors import AlreadyExists, InvalidArgument, NotFound
from mneme.locks import KeyedLocks
from mneme.names import check_uuid
from mneme.events.v1 import events_pb2 as ev
from mneme.ports import Catalog, Embedder, Record
from mneme.retrieval import RRF_K
from services.reflect.handlers import (NO_MEMORIES, STALE_MARK, Reflection, content_terms,
                                      quote_line)

log = logging.getLogger(__name__)

#: Records of the bank's memory partition a staleness check reads at most; beyond it the
#: model counts as stale (many changes since its refresh in any case).
STALE_SCAN = 10_000
#: A model's content when ``max_tokens`` is 0, in tokens (~4 characters each).
DEFAULT_MAX_TOKENS = 2_048
#: Share of a question's content words a fresh model's name and query must cover for the
#: offline reflect to answer with it.
OFFLINE_COVERAGE = 0.6
#: Cosine between a question and a fresh model's name and query above which the offline
#: reflect answers with it even when their words differ (a paraphrase).
OFFLINE_SIMILARITY = 0.8
#: Least cosine of the semantic ranking: models below it are not ranked by meaning.
SEMANTIC_MIN = 0.3
#: Models of one bank a search ranks at most (id order); more are not searched.
SEARCH_MAX_MODELS = 1_000
#: Embeddings kept in memory (per model revision: two vectors each).
EMBED_CACHE = 4_096
#: New memories a delta refresh takes in at most (the most relevant to the model first).
DELTA_MAX_NEW = 50

_CITES = re.compile(r"\s?\[(\d+(?:\s*,\s*\d+)*)\][.;,!?]?")


def _cut(text: str, max_tokens: int) -> str:
    """``text`` cut to about ``max_tokens`` tokens (4 characters each) at a line or word."""
    limit = 4 * (max_tokens or DEFAULT_MAX_TOKENS)
    if len(text) <= limit:
        return text
    cut = text[:limit]
    at = max(cut.rfind("\n"), cut.rfind(" "))
    return (cut[:at] if at > limit // 2 else cut).rstrip() + " …"


@dataclass
class MentalModels:
    """The MentalModelService's operations over ports.

    ``catalog`` is this process's bank catalog. ``append(message, bank_id)`` appends an
    event and returns its record. ``projected(record, bank_id)`` waits until
    ``catalog`` has handled the record (read-your-writes). ``caught_up(bank_id)`` brings
    ``catalog`` up to the bank's partition before a read. ``reflect`` is
    :meth:`services.reflect.handlers.Reflector.reflect`. ``memory_end(bank_id)`` is the end
    offset of the bank's ``mneme.memory.v1`` partition, and ``memory_read(bank_id, start,
    limit, opened)`` the (offset, decoded message) pairs of that partition from ``start``
    (``opened``: user content unsealed, else left sealed). ``revise`` is
    :meth:`services.reflect.handlers.Reflector.revise` (the reflect model's update of a
    content; None without one). ``embedder`` ranks models by meaning (None: by words only).
    ``slot(bank_id)`` is held by each write from before its append to the end of its wait for
    the catalog (a context manager: :meth:`mneme.slots.WaitSlots.hold`, the process's one
    bound on waiting calls, which raises ResourceExhausted, nothing written, when they are
    all taken), so that writes waiting behind a slow projection cannot take every gRPC
    worker."""

    catalog: Catalog
    append: Callable[[object, str], Record]
    projected: Callable[[Record, str], None]
    caught_up: Callable[[str], object]
    reflect: Callable[..., Reflection]
    memory_end: Callable[[str], int]
    memory_read: Callable[..., list[tuple[int, object]]]
    revise: Callable[..., Reflection | None] | None = None
    embedder: Embedder | None = None
    slot: Callable[[str], ContextManager] = contextlib.nullcontext
    _vectors: OrderedDict = field(default_factory=OrderedDict, repr=False)
    _vectors_lock: threading.Lock = field(default_factory=threading.Lock, repr=False)
    #: A lock per (bank id, model id) created with a client-chosen id: check and append
    #: are one step in this process.
    _creating: KeyedLocks = field(default_factory=KeyedLocks, repr=False)

    # ---- reads ----

    def require_bank(self, bank_id: str) -> None:
        """NotFound unless the bank exists (this catalog caught up with it first)."""
        self.caught_up(bank_id)
        if self.catalog.get_bank(bank_id) is None:
            raise NotFound(f"bank {bank_id!r} not found")

    def get(self, bank_id: str, model_id: str) -> MentalModel:
        """The model; NotFound for an unknown bank or model."""
        self.require_bank(bank_id)
        m = self.catalog.get_mental_model(bank_id, model_id)
        if m is None:
            raise NotFound(f"mental model {model_id!r} not found in bank {bank_id!r}")
        return m

    def list(self, bank_id: str, limit: int, after: str = "",
             tags: Sequence[str] = (), tags_match: str = "any") -> list[MentalModel]:
        """Up to ``limit`` models with ids after ``after``, in id order; with ``tags``,
        those that match them in ``tags_match`` mode (:func:`mneme.domain.tags_match`;
        "any": sharing one, or untagged)."""
        self.require_bank(bank_id)
        out: list[MentalModel] = []
        while len(out) < limit:
            page = self.catalog.list_mental_models(bank_id, limit, after)
            out += [m for m in page if match_tags(m.tags, tags, tags_match)]
            if len(page) < limit:
                break
            after = page[-1].id
        return out[:limit]

    def history(self, bank_id: str, model_id: str) -> list[MentalModelRevision]:
        """Every revision of the model's content, oldest first."""
        self.get(bank_id, model_id)
        return self.catalog.mental_model_revisions(bank_id, model_id)

    def is_stale(self, m: MentalModel) -> bool:
        """True when a fact or observation in the model's scope changed after its content
        was made (see the module docstring)."""
        return m.id in self.stale_ids([m])

    def stale_ids(self, models: Sequence[MentalModel]) -> set[str]:
        """The ids of the stale ones among ``models`` (all of one bank), from one read of
        the bank's memory partition (from the oldest of their offsets)."""
        if not models:
            return set()
        bank_id = models[0].bank_id
        end = self.memory_end(bank_id)
        pending = [m for m in models if m.memory_offset < end]
        out = {m.id for m in pending if end - m.memory_offset > STALE_SCAN}
        pending = [m for m in pending if m.id not in out]
        if not pending:
            return out
        start = min(m.memory_offset for m in pending)
        for offset, msg in self.memory_read(bank_id, start, end - start):
            if getattr(msg, "bank_id", None) != bank_id:
                continue
            for m in pending:
                if m.id not in out and offset >= m.memory_offset and _in_scope(msg, m.tags):
                    out.add(m.id)
            if len(out) == len(models):
                break
        return out

    # ---- writes ----

    def create(self, m: MentalModel, timeout: float, model_id: str = "") -> MentalModel:
        """A new model, under ``model_id`` (a UUID the client chose, AIP-133) or an id the
        server picks. InvalidArgument naming ``mental_model.<field>`` for an empty name
        or query, a bad policy, a negative number or refresh_every 0 with policy
        every_n_facts, ``mental_model_id`` for an id that is not a UUID; AlreadyExists
        when the bank has a model of that id (a retry of a create whose answer was
        lost)."""
        self.require_bank(m.bank_id)
        _check(m, MENTAL_MODEL_FIELDS)
        _check_refresh(m)
        if model_id:
            check_uuid(model_id, "mental_model_id", "mental model id")
        m = replace(m, id=model_id or str(uuid.uuid4()))
        # one create of an id at a time here, until it is projected (two replicas may race)
        with self.slot(m.bank_id), self._creating.hold((m.bank_id, m.id)):
            if model_id and self.catalog.get_mental_model(m.bank_id, m.id) is not None:
                raise AlreadyExists(f"mental model {m.id!r} exists in bank {m.bank_id!r}")
            msg = _event(m, ())
            msg.memory_offset = self.memory_end(m.bank_id)
            self.projected(self.append(msg, m.bank_id), m.bank_id)
        return self.get(m.bank_id, m.id)

    def update(self, m: MentalModel, paths: Sequence[str], timeout: float) -> MentalModel:
        """Change the fields ``paths`` (some of :data:`~mneme.domain.MENTAL_MODEL_FIELDS`:
        :func:`mneme.apiconv.update_paths`; none: no change); InvalidArgument naming
        ``mental_model.<field>`` for a bad value."""
        current = self.get(m.bank_id, m.id)
        paths = [p for p in MENTAL_MODEL_FIELDS if p in paths]
        if not paths:  # nothing to change (an event without a mask would replace it all)
            return current
        _check(m, paths)
        if {"refresh_policy", "refresh_every"} & set(paths):
            # the policy and its count as they will be, whichever of the two the mask names
            # (a model stored so before this check can still be renamed)
            _check_refresh(replace(current, **{p: getattr(m, p) for p in paths}))
        with self.slot(m.bank_id):
            self.projected(self.append(_event(m, paths), m.bank_id), m.bank_id)
        return self.get(m.bank_id, m.id)

    def clear(self, bank_id: str, model_id: str) -> MentalModel:
        """Empty the model's content (a revision of its own, based on nothing; the next
        refresh fills it again). NotFound when unknown."""
        m = self.get(bank_id, model_id)
        return self.update(replace(m, content=""), ["content"], 0.0)

    def delete(self, bank_id: str, model_id: str) -> None:
        """Delete the model and its history; NotFound when unknown."""
        self.get(bank_id, model_id)
        with self.slot(bank_id):
            rec = self.append(ev.MentalModelChanged(bank_id=bank_id, id=model_id,
                                                    deleted=True), bank_id)
            self.projected(rec, bank_id)

    def refresh(self, bank_id: str, model_id: str, now: datetime, budget: str = "mid",
                dry_run: bool = False, mode: str = "full") -> tuple[MentalModel, Reflection]:
        """Make the model's content anew and store it (cut to ``max_tokens``) with the ids
        it cites; with ``dry_run`` store nothing. ``mode`` "full" answers its
        ``source_query`` again (reflect within its tags); "delta" revises the current
        content with what changed in its scope since it was made (:meth:`delta`), and is a
        full refresh when the content is empty or the changes are too many to read.
        Returns (the model as it is, or would be, after it; the reflection).
        InvalidArgument for another ``mode``."""
        if mode not in ("full", "delta"):
            raise InvalidArgument("mode", "must be FULL or DELTA")
        m = self.get(bank_id, model_id)
        start = self.memory_end(bank_id)  # changes while it runs count as after it
        r = self.delta(m, now) if mode == "delta" else None
        if r is None:
            mode = "full"
            r = self.reflect(bank_id, m.source_query, "", budget, now, None, m.tags,
                             mental_models=False)
            if r.extractive:  # the extractive answer quotes one memory a line, in order
                r = replace(r, text=_cite_lines(r.text, len(r.based_on)))
        content = _cut(r.text, m.max_tokens)
        source = "refresh_offline" if r.extractive else "refresh"
        # where each cited memory was retained: deleting that document erases this content
        docs = dict(zip(m.based_on, m.based_on_documents))  # what a delta kept
        docs.update({x.id: x.document_id for x in r.evidence if x.document_id})
        docs.update({i: d for i, d in r.documents.items() if d})
        documents = [docs.get(i, "") for i in r.based_on]
        # the facts behind the observations it cites: deleting one erases this content
        # (a delta keeps the whole earlier set: which kept line stood on which is not known)
        evidence = list(dict.fromkeys(
            [*(m.based_on_evidence if mode == "delta" else ()),
             *(f for i in r.based_on for f in r.sources.get(i, ()))]))
        if dry_run:
            return replace(m, content=content, based_on=tuple(r.based_on),
                           based_on_documents=tuple(documents),
                           based_on_evidence=tuple(evidence)), r
        msg = ev.MentalModelChanged(bank_id=bank_id, id=model_id, content=content,
                                    update_mask=["content"], memory_offset=start,
                                    refresh=ev.MentalModelRefresh(based_on=r.based_on,
                                                                  source=source, mode=mode,
                                                                  based_on_documents=documents,
                                                                  evidence_memory_ids=evidence))
        self.projected(self.append(msg, bank_id), bank_id)
        return self.get(bank_id, model_id), r

    def changes(self, m: MentalModel) -> tuple[list[Memory], set[str]] | None:
        """What changed in the model's scope since its content was made, read from its
        bank's memory partition (opened): (facts and observations added or revised, one
        per id with its latest text, oldest first; ids retracted or deleted). None when
        more than :data:`STALE_SCAN` records would have to be read."""
        end = self.memory_end(m.bank_id)
        if end - m.memory_offset > STALE_SCAN:
            return None
        new: dict[str, Memory] = {}
        gone: set[str] = set()
        wanted = set(m.tags)

        def scoped(tags) -> bool:
            return not wanted or not tags or bool(set(tags) & wanted)

        for _, msg in self.memory_read(m.bank_id, m.memory_offset,
                                       max(0, end - m.memory_offset), True):
            if getattr(msg, "bank_id", None) != m.bank_id:
                continue
            if isinstance(msg, ev.FactsRetracted):
                for i in msg.memory_ids:
                    gone.add(i)
                    new.pop(i, None)
            elif isinstance(msg, ev.FactsExtracted):
                for f in msg.facts:
                    if scoped(f.tags) and f.text.strip():  # erased content: nothing to quote
                        when = f.occurred_start if f.HasField("occurred_start") else (
                            f.mentioned_at if f.HasField("mentioned_at") else None)
                        new.pop(f.id, None)
                        new[f.id] = Memory(f.id, f.text, "fact", _dt(when), f.fact_type,
                                           document_id=f.document_id)
                        gone.discard(f.id)
            elif isinstance(msg, ev.ObservationsChanged):
                for o in msg.observations:
                    if o.deleted:
                        gone.add(o.id)
                        new.pop(o.id, None)
                    elif scoped(o.scope) and o.text.strip():
                        when = o.occurred_end if o.HasField("occurred_end") else None
                        new.pop(o.id, None)
                        new[o.id] = Memory(o.id, o.text, "observation", _dt(when), sources=tuple(
                            dict.fromkeys(e.memory_id for e in o.evidence if e.memory_id)))
                        gone.discard(o.id)
        return list(new.values()), gone

    def delta(self, m: MentalModel, now: datetime) -> Reflection | None:
        """The content of a delta refresh of ``m`` (not stored), None when a full refresh
        is needed instead (empty content, or too many changes to read).

        The current content is cut into statements, each ending with its citations
        (``[n]``: the n-th id of ``based_on``). A statement whose cited memories were all
        retracted, deleted or revised since drops out (a revised one comes back with its
        new text below); uncited text (a user's, a heading) stays. The new memories, most
        relevant to the model's name and query first (at most :data:`DELTA_MAX_NEW`), are
        merged in: by the reflect model (``revise``) when there is one, else the most
        relevant ones that fit within ``max_tokens`` (only those sharing a word or, with an
        embedder, the meaning of the query) are appended as quoted, cited lines, oldest
        first."""
        if not m.content.strip():
            return None
        found = self.changes(m)
        if found is None:
            return None
        new, gone = found
        gone = gone | {x.id for x in new if x.id in m.based_on}
        kept_text, kept = _prune(m.content, m.based_on, gone)
        # One statement once: an offline observation often quotes its fact word for word
        # (the first, oldest, is kept), and a line the content still quotes is not added.
        said = [" ".join(line.lower().split()) for line in kept_text.splitlines()]
        unique: dict[str, Memory] = {}
        for x in new:
            key = " ".join(x.text.lower().split())
            if key not in unique and not any(_quotes(line, key) for line in said):
                unique[key] = x
        new = list(unique.values())
        ranked = self._relevant(m, new)[:DELTA_MAX_NEW]
        if ranked and self.revise is not None:
            # the revision restates the kept content: which kept line stood on which
            # facts is not known, so the whole earlier set (as the refresh event keeps)
            r = self.revise(m.bank_id, m.source_query, kept_text, kept,
                            [x for x, _ in ranked], now, m.tags,
                            evidence=m.based_on_evidence)
            if r is not None:
                return replace(r, documents={x.id: x.document_id for x, _ in ranked},
                               sources={**r.sources, **{x.id: x.sources for x, _ in ranked
                                                        if x.sources}})
        limit = 4 * (m.max_tokens or DEFAULT_MAX_TOKENS)
        text = kept_text
        if not kept and text.strip().startswith(NO_MEMORIES[:40]):
            text = ""  # "no memories" is no longer true once one is added
        based_on = list(kept)
        room, chosen = limit - len(text), set()
        for x, relevant in ranked:  # the most relevant that fit, then quoted oldest first
            size = len(quote_line(x.text, x.when)) + 8
            if relevant and size <= room:
                chosen.add(x.id)
                room -= size
        for x in new:
            if x.id in chosen:
                line = f"{quote_line(x.text, x.when)} [{len(based_on) + 1}]"
                text = f"{text.rstrip()}\n{line}" if text.strip() else line
                based_on.append(x.id)
        if not text.strip():
            text = NO_MEMORIES
        return Reflection(text, based_on, True, documents={x.id: x.document_id for x in new},
                          sources={x.id: x.sources for x in new if x.sources})

    def _relevant(self, m: MentalModel, new: Sequence[Memory]) -> list[tuple[Memory, bool]]:
        """``new`` ranked by relevance to the model's name and query (shared content words,
        then, with an embedder, cosine; ties newest first), each with whether it is
        relevant at all (a shared word, or a cosine of at least :data:`SEMANTIC_MIN`)."""
        q = content_terms(f"{m.display_name} {m.source_query}")
        sims = [0.0] * len(new)
        if self.embedder is not None and new:
            try:
                qv, *vs = self.embedder.embed([f"{m.display_name}. {m.source_query}"]
                                              + [x.text for x in new])
                sims = [_dot(qv, v) for v in vs]
            except Exception:  # noqa: BLE001 - words alone still rank them
                log.exception("mental model %s: embedding failed; ranked by words only", m.id)
        scored = [(len(q & content_terms(x.text)), sims[i], i, x) for i, x in enumerate(new)]
        scored.sort(key=lambda t: (-t[0], -t[1], -t[2]))
        return [(x, words > 0 or sim >= SEMANTIC_MIN) for words, sim, _, x in scored]


    # ---- scheduled refreshes ----

    def new_facts(self, m: MentalModel, limit: int = STALE_SCAN) -> int:
        """Facts of the model's bank in its scope extracted since its content was made
        (counted on the bank's memory partition, at most ``limit`` records read)."""
        end = self.memory_end(m.bank_id)
        if end <= m.memory_offset:
            return 0
        wanted, n = set(m.tags), 0
        for _, msg in self.memory_read(m.bank_id, m.memory_offset,
                                       min(limit, end - m.memory_offset)):
            if isinstance(msg, ev.FactsExtracted) and msg.bank_id == m.bank_id:
                n += sum(1 for f in msg.facts
                         if not wanted or not f.tags or set(f.tags) & wanted)
        return n

    def refresh_due(self, bank_id: str, consolidated: bool, now: datetime) -> list[str]:
        """Refresh the bank's models whose policy is due: ``after_consolidation`` when
        ``consolidated`` (an observation changed) and the model is stale, ``every_n_facts``
        once ``refresh_every`` facts in its scope arrived since its content was made.
        Returns the ids refreshed. A model that fails to refresh is logged and left as it
        was (the next change tries again)."""
        done = []
        after = ""
        while True:
            page = self.catalog.list_mental_models(bank_id, 500, after)
            for m in page:
                due = ((m.refresh_policy == "after_consolidation" and consolidated
                        and self.is_stale(m))
                       or (m.refresh_policy == "every_n_facts" and m.refresh_every > 0
                           and self.new_facts(m) >= m.refresh_every))
                if not due:
                    continue
                try:
                    self.refresh(bank_id, m.id, now)
                    done.append(m.id)
                except Exception:  # noqa: BLE001 - one model's failure must not stop the rest
                    log.exception("mental model %s of bank %s: scheduled refresh failed",
                                  m.id, bank_id)
            if len(page) < 500:
                return done
            after = page[-1].id

    # ---- reflect's uses ----

    def _embedding(self, m: MentalModel) -> tuple[list[float], list[float]] | None:
        """(name + query + content, name + query) embeddings of ``m``'s current revision,
        cached (at most :data:`EMBED_CACHE`); None without an embedder."""
        if self.embedder is None:
            return None
        key = (m.bank_id, m.id, m.revision, m.updated_at)
        with self._vectors_lock:
            if key in self._vectors:
                self._vectors.move_to_end(key)
                return self._vectors[key]
        full, head = self.embedder.embed([
            f"{m.display_name}. {m.source_query}\n{m.content}",
            f"{m.display_name}. {m.source_query}"])
        with self._vectors_lock:
            self._vectors[key] = (full, head)
            while len(self._vectors) > EMBED_CACHE:
                self._vectors.popitem(last=False)
        return full, head

    def _ranked(self, bank_id: str, query: str, tags: Sequence[str] = (),
                tags_match: str = "any") -> list[tuple[float, MentalModel, float]]:
        """The bank's models with content (within ``tags`` in ``tags_match`` mode,
        :func:`mneme.domain.tags_match`; "any": sharing one, or untagged) that match ``query`` by words or meaning, best first: (RRF score, model, cosine of
        the question with its name and query; 0 without an embedder). At most
        :data:`SEARCH_MAX_MODELS` models are considered."""
        self.caught_up(bank_id)
        q = content_terms(query)
        models: list[MentalModel] = []
        after = ""
        while len(models) < SEARCH_MAX_MODELS:
            page = self.catalog.list_mental_models(bank_id, 500, after)
            models += [m for m in page if m.content.strip()
                       and match_tags(m.tags, tags, tags_match)]
            if len(page) < 500:
                break
            after = page[-1].id
        models = models[:SEARCH_MAX_MODELS]
        if not models or not query.strip():
            return []
        words = {}
        for m in models:
            if q:
                head = content_terms(f"{m.display_name} {m.source_query}")
                score = len(q & head) / len(q) + 0.5 * len(q & content_terms(m.content)) / len(q)
                if score > 0:
                    words[m.id] = score
        sims, heads = {}, {}
        if self.embedder is not None:
            try:
                qv = self.embedder.embed([query])[0]
                for m in models:
                    full, head = self._embedding(m)
                    heads[m.id] = _dot(qv, head)
                    sim = _dot(qv, full)
                    if sim >= SEMANTIC_MIN:
                        sims[m.id] = sim
            except Exception:  # noqa: BLE001 - words alone still rank them
                log.exception("mental models of bank %s: embedding failed; keyword search only",
                              bank_id)
                sims, heads = {}, {}
        fused: dict[str, float] = {}
        for ranking in (words, sims):
            for rank, mid in enumerate(sorted(ranking, key=lambda i: (-ranking[i], i)), 1):
                fused[mid] = fused.get(mid, 0.0) + 1.0 / (RRF_K + rank)
        by_id = {m.id: m for m in models}
        out = [(score, by_id[mid], heads.get(mid, 0.0)) for mid, score in fused.items()]
        out.sort(key=lambda p: (-p[0], p[1].id))
        return out

    def search(self, bank_id: str, query: str, now: datetime, limit: int,
               tags: Sequence[str] = (), tags_match: str = "any") -> list[Memory]:
        """The agent's ``search_mental_models``: models (within ``tags`` in ``tags_match``
        mode) that match
        ``query`` by words or meaning (:meth:`_ranked`), best first, each marked stale or
        fresh (a stale one comes with ``kind`` "mental_model" and the mark in its text;
        :func:`services.reflect.handlers.is_stale_memory` tells)."""
        hits = [m for _, m, _ in self._ranked(bank_id, query, tags, tags_match)[:limit]]
        stale = self.stale_ids(hits)
        out = []
        for m in hits:
            state = STALE_MARK if m.id in stale else "fresh"
            out.append(Memory(m.id, f"{m.display_name} ({state}; answers \"{m.source_query}\"): "
                              f"{m.content}", "mental_model",
                              from_epoch(m.refreshed_at or m.updated_at), sources=_facts(m)))
        return out

    def answer_offline(self, bank_id: str, query: str, tags: Sequence[str] = (),
                       recall_answer: Callable[[], Reflection] | None = None,
                       tags_match: str = "any") -> Reflection | None:
        """The extractive reflect's first step. A model covers the question when its name
        and query hold :data:`OFFLINE_COVERAGE` of the question's content words, or mean
        the same (cosine of at least :data:`OFFLINE_SIMILARITY`). The best fresh one (in
        scope of ``tags``, matched in ``tags_match`` mode) answers, citing itself; when all that cover it are stale, none is
        trusted alone: the answer is ``recall_answer()`` (the extractive answer from
        recall) with the best of them quoted as context after it, both cited. None when no
        model covers the question (or only stale ones and no ``recall_answer``)."""
        q = content_terms(query)
        covering = [m for _, m, sim in self._ranked(bank_id, query, tags, tags_match)
                    if sim >= OFFLINE_SIMILARITY or (q and len(
                        q & content_terms(f"{m.display_name} {m.source_query}")) / len(q)
                        >= OFFLINE_COVERAGE)]
        stale = self.stale_ids(covering)
        for m in covering:
            if m.id not in stale:
                return Reflection(f"{m.content}\n(from the mental model \"{m.display_name}\", "
                                  "extractive answer, no language model configured)",
                                  [m.id], True, kinds={m.id: "mental_model"},
                                  sources={m.id: _facts(m)})
        if not covering or recall_answer is None:
            return None
        m = covering[0]
        r = recall_answer()
        return Reflection(
            f"{r.text}\n\nContext: the mental model \"{m.display_name}\" answers this but "
            "is stale (facts in its scope changed since its content was made), so the "
            f"memories above answer; it said:\n{m.content}",
            [*r.based_on, m.id], True, kinds={**r.kinds, m.id: "mental_model"},
            sources={**r.sources, m.id: _facts(m)})


def _facts(m: MentalModel) -> tuple[str, ...]:
    """The memories a model's content stands on: the ids it cites and the facts behind
    its cited observations (what an answer quoting it is sealed under)."""
    return tuple(dict.fromkeys((*m.based_on, *m.based_on_evidence)))


def _dot(a: Sequence[float], b: Sequence[float]) -> float:
    """Cosine of two L2-normalised vectors."""
    return math.fsum(x * y for x, y in zip(a, b))


def _dt(ts) -> datetime | None:
    return ts.ToDatetime(tzinfo=timezone.utc) if ts is not None else None


#: What may follow a quoted text on its line: the date :func:`quote_line` writes, then
#: citations ("(01 may 2023) [3]", lower-cased).
_QUOTE_TAIL = re.compile(r"(?: \(\d{1,2} [a-z]+ \d{4}\))?(?: ?\[[0-9, ]+\])?\s*")


def _quotes(line: str, text: str) -> bool:
    """Whether ``line`` (of a content, lower-cased, spaces collapsed) is the quote of
    ``text`` (likewise) as :func:`quote_line` writes it: "- <text>", then nothing, a
    date in parentheses or citations."""
    head = f"- {text}"
    return line.startswith(head) and bool(_QUOTE_TAIL.fullmatch(line[len(head):]))


def _cite_lines(text: str, n: int) -> str:
    """The extractive answer ``text`` with its i-th quoted line ("- …") cited ``[i]``
    (``n`` lines at most): a delta refresh tells from the citations which memory a
    line quotes."""
    out, i = [], 0
    for line in text.split("\n"):
        if line.startswith("- ") and i < n:
            i += 1
            line = f"{line} [{i}]"
        out.append(line)
    return "\n".join(out)


def _prune(content: str, based_on: Sequence[str], gone: set[str]) -> tuple[str, list[str]]:
    """``content`` without the statements whose cited memories are all in ``gone``
    (a statement ends with its citations ``[n]``, n-th id of ``based_on``; the text after
    a line's last citation belongs to the statement before it), the other citations to
    ``gone`` removed and all renumbered. Returns (text, the cited ids in their new order)."""
    kept: list[str] = []

    def number(i: str) -> int:
        if i not in kept:
            kept.append(i)
        return kept.index(i) + 1

    lines = []
    for line in content.split("\n"):
        statements, at = [], 0  # (text before the citation, the citation, what follows)
        for mt in _CITES.finditer(line):
            punct = mt.group(0)[-1] if mt.group(0)[-1] in ".;,!?" else ""
            statements.append([line[at:mt.start()], mt, punct])
            at = mt.end()
        if not statements:
            lines.append(line)
            continue
        statements[-1][2] += line[at:]
        out = ""
        for body, mt, rest in statements:
            cite = line[mt.start():mt.end() - (1 if mt.group(0)[-1] in ".;,!?" else 0)]
            ids = [based_on[int(n) - 1] for n in re.split(r"\s*,\s*", mt.group(1))
                   if 0 < int(n) <= len(based_on)]
            if not ids:  # not a citation of this content: text as written
                out += body + cite + rest
                continue
            alive = [i for i in ids if i not in gone]
            if not alive:
                continue  # every memory it stood on is gone
            lead = " " if cite.startswith(" ") else ""
            out += f"{body}{lead}[{', '.join(str(number(i)) for i in alive)}]{rest}"
        if out.strip() and out.strip() != "-":
            lines.append(out)
    text = "\n".join(lines).strip("\n")
    return text, kept


def _in_scope(msg, tags: Sequence[str]) -> bool:
    """True when memory event ``msg`` changes a unit in the scope ``tags`` (untagged: any
    scope; untagged units: every scope) or retracts any."""
    if isinstance(msg, ev.FactsRetracted):
        return True
    if isinstance(msg, ev.FactsExtracted):
        sets = [set(f.tags) for f in msg.facts]
    elif isinstance(msg, ev.ObservationsChanged):
        sets = [set(o.scope) for o in msg.observations]
    else:
        return False
    wanted = set(tags)
    return any(not wanted or not s or s & wanted for s in sets)


def _check(m: MentalModel, fields: Iterable[str]) -> None:
    fields = set(fields)
    if "display_name" in fields and not m.display_name.strip():
        raise InvalidArgument("mental_model.display_name", "required")
    if "source_query" in fields and not m.source_query.strip():
        raise InvalidArgument("mental_model.source_query", "required: the question it answers")
    if "tags" in fields:
        for i, t in enumerate(m.tags):
            if not t.strip():
                raise InvalidArgument(f"mental_model.tags[{i}]", "must not be empty")
    if "max_tokens" in fields and m.max_tokens < 0:
        raise InvalidArgument("mental_model.max_tokens", "must not be negative")
    if "refresh_policy" in fields and m.refresh_policy not in REFRESH_POLICIES:
        raise InvalidArgument("mental_model.refresh_policy",
                              f"one of {', '.join(REFRESH_POLICIES)}")
    if "refresh_every" in fields and m.refresh_every < 0:
        raise InvalidArgument("mental_model.refresh_every", "must not be negative")


def _check_refresh(m: MentalModel) -> None:
    """A model as it would be stored: every_n_facts needs refresh_every >= 1 (with 0 it
    would never refresh). InvalidArgument naming ``mental_model.refresh_every``."""
    if m.refresh_policy == "every_n_facts" and m.refresh_every < 1:
        raise InvalidArgument("mental_model.refresh_every",
                              "must be at least 1 with refresh_policy EVERY_N_FACTS")


def _event(m: MentalModel, mask: Sequence[str]) -> ev.MentalModelChanged:
    """The MentalModelChanged of creating ``m`` (empty ``mask``) or of changing its
    ``mask`` fields (only those are carried)."""
    msg = ev.MentalModelChanged(bank_id=m.bank_id, id=m.id, update_mask=list(mask))
    for f in mask or MENTAL_MODEL_FIELDS:
        value = getattr(m, f)
        if f == "tags":
            msg.tags.extend(dict.fromkeys(value))
        else:
            setattr(msg, f, value)
    return msg
