"""Observation decisions without a model (DESIGN §1 Observation, issue 5).

Pure functions over ``mneme.events.v1`` messages: a fact (``ev.Fact``, with its
embedding and entities) is compared with the observations (``ev.Observation``) of its
scope and either reinforces one, revises one, creates one, or is left alone. Every
decision returns new observation *states* (version + 1); the caller emits them as
``ObservationsChanged`` and never mutates a stored state in place.

Offline thresholds (cosine of all-MiniLM-L6-v2 vectors, measured on LoCoMo turns and the
issue's examples; paraphrases of one statement score 0.75–0.95, different statements
about the same person 0.3–0.6):

* :data:`REINFORCE_SIM` 0.80 — a compatible fact at or above it reinforces the nearest
  observation (evidence appended, text kept);
* :data:`REVISE_SIM` 0.70 — a fact at or above it that *conflicts* (a different number,
  a flipped negation) with an observation sharing its named entities revises it: the new
  text replaces the old, the old text goes to ``history`` ("was …, now …");
* below both: a new observation.

Single-valued attributes (:mod:`services.consolidation.attributes`: name, home, employer,
age, relationship status, favourite X) come first: a fact that gives a subject's
attribute a different value than a live observation of its scope *contradicts* it,
whatever the cosine. The newer statement wins — by the time the facts were true and told
(:func:`statement_time`), not by processing order: a newer fact revises the observation
("was …, now …"), an older one arriving later only joins its evidence and its history.

Every observation carries the occurred range of its evidence (:func:`stamp_occurred`),
so time-scoped recall finds it by when its facts happened, not when it was decided.

"Compatible" (:func:`compatible`): same numbers, same polarity, same proper names. The
same test keeps near-duplicates apart in :func:`reconcile` (bank ``dedup_threshold``).
Counts are never computed: text only ever comes from a source fact (offline) or from
the model with :func:`invented_numbers` rejecting numbers no source states.
"""

from __future__ import annotations

import functools
import json
import re
from datetime import datetime
from typing import Callable, Iterable, Sequence

import numpy as np
from google.protobuf.timestamp_pb2 import Timestamp

from mneme.cjk import segment
from mneme.domain import derive_id
from mneme.events.v1 import events_pb2 as ev
from services.consolidation import attributes

#: Looks facts up by id (those it knows): ``lookup(ids) -> {id: ev.Fact}``.
FactLookup = Callable[[Iterable[str]], dict[str, ev.Fact]]

#: The representable range of a protobuf Timestamp (0001-01-01 … 9999-12-31T23:59:59.999999999Z)
#: in nanoseconds; derived times are clamped into it.
MIN_NANOS = -62135596800 * 10**9
MAX_NANOS = 253402300799 * 10**9 + 999_999_999

REINFORCE_SIM = 0.80
REVISE_SIM = 0.70
#: Facts shorter than this (in words) or questions are not beliefs: left alone.
MIN_WORDS = 3
#: Longest evidence quote (characters); quotes are verbatim substrings of the memory.
MAX_QUOTE = 300

_NUM_WORDS = {"zero", "one", "two", "three", "four", "five", "six", "seven", "eight", "nine",
              "ten", "eleven", "twelve", "dozen", "hundred", "thousand", "million",
              "once", "twice", "first", "second", "third"}
_NEG = {"not", "no", "never", "none", "nobody", "nothing", "neither", "nor", "without",
        "cannot", "n't", "dont", "doesnt", "didnt", "isnt", "wasnt", "arent", "werent",
        "wont", "hasnt", "havent", "hadnt", "anymore", "longer"}
_NOT_NAMES = {"I", "The", "A", "An", "My", "We", "She", "He", "It", "They", "This", "That",
              "Yes", "No", "Oh", "Wow", "Thanks", "Hey", "Hi", "So", "But", "And", "Our",
              "Your", "You", "His", "Her", "Their", "Its", "What", "When", "Where", "Why",
              "How", "Who", "Also", "Now", "Then", "Well", "Sure", "Yeah", "Just", "In",
              "On", "At", "For", "Of", "As", "If", "Is", "Was", "Do", "Did", "Not", "Was"}


def scope_key(tags: Iterable[str]) -> str:
    """Canonical key of a scope (a tag set): JSON of the sorted, deduplicated tags."""
    return json.dumps(sorted(set(tags)))


def scopes_for(fact_tags: Sequence[str], spec: ev.ObservationScopes | None,
               all_tags: Iterable[str] = ()) -> list[list[str]]:
    """The scopes (sorted tag lists) a fact with ``fact_tags`` consolidates into under
    ``spec`` (see ``ev.ObservationScopes.mode``); ``all_tags`` are the tags of every
    fact of the request (for "combined"). Unknown modes act as "exact"."""
    mode = spec.mode if spec is not None else ""
    if mode == "shared":
        return [[]]
    if mode == "per_tag":
        return [[t] for t in sorted(set(fact_tags))] or [[]]
    if mode == "combined":
        return [sorted(set(all_tags))]
    if mode == "explicit" and spec.scopes:
        out = {scope_key(s.tags): sorted(set(s.tags)) for s in spec.scopes}
        return [out[k] for k in sorted(out)]
    return [sorted(set(fact_tags))]


# ---- text signatures -------------------------------------------------------------------


def _words(text: str) -> list[str]:
    """The words of ``text`` in any script: runs of letters and digits (an apostrophe
    inside one joins it, "don't"); a CJK run counts as its character bigrams
    (:func:`mneme.cjk.segment`), as keyword search counts it."""
    return re.findall(r"[^\W_]+(?:'[^\W_]+)*", segment(text))


def numbers(text: str) -> set[str]:
    """Numbers a text states: digit runs and number words (lowercased)."""
    out = set(re.findall(r"\d+(?:\.\d+)?", text))
    out |= {w.lower() for w in _words(text) if w.lower() in _NUM_WORDS}
    return out


def negated(text: str) -> bool:
    """Whether the text contains a negation ("not", "never", "n't", "no longer", …)."""
    low = text.lower().replace("\u2019", "'")
    if "n't" in low:
        return True
    return any(w in _NEG for w in re.findall(r"[a-z']+", low))


def proper_names(text: str) -> set[str]:
    """Capitalised words that are not sentence-starting function words (a cheap named-
    entity signature that needs no model and is deterministic)."""
    return {w for w in re.findall(r"\b[A-Z][a-zA-Z]+\b", text) if w not in _NOT_NAMES}


def compatible(a: str, b: str) -> bool:
    """Two texts may describe one belief: same numbers, same polarity, same names.
    Texts that differ in a number, a negation or a named entity are kept apart."""
    return (numbers(a) == numbers(b) and negated(a) == negated(b)
            and proper_names(a) == proper_names(b))


def invented_numbers(text: str, sources: Iterable[str]) -> set[str]:
    """Numbers in ``text`` that no source states (the model computed or guessed them)."""
    stated: set[str] = set()
    for s in sources:
        stated |= numbers(s)
    return numbers(text) - stated


def quote_of(memory_text: str) -> str:
    """The evidence quote of a memory: its first sentence, at most :data:`MAX_QUOTE`
    characters — always a verbatim substring of ``memory_text``."""
    t = memory_text.strip()
    m = re.search(r"(?<=[.!?])\s", t)
    q = t[:m.start()] if m and m.start() >= 20 else t
    return q[:MAX_QUOTE]


def cosine(a: Sequence[float], b: Sequence[float]) -> float:
    """Cosine of two vectors (0.0 when either is empty or zero)."""
    if not len(a) or not len(b) or len(a) != len(b):
        return 0.0
    x, y = np.asarray(a, dtype=np.float64), np.asarray(b, dtype=np.float64)
    na, nb = float(np.linalg.norm(x)), float(np.linalg.norm(y))
    return float(x @ y) / (na * nb) if na and nb else 0.0


class ScopeIndex:
    """The live observations of one scope as a matrix of their embeddings, so the cosine
    of one vector with every observation is one matrix product rather than a
    :func:`cosine` per pair (those made consolidation quadratic in the bank: a batch of 50
    facts took ~5 s at 5k observations). Same values as :func:`cosine`, in float64: 0.0
    for an empty or zero vector or a pair of different dimensions (a state whose
    dimension is not the index's -- another embedding model -- is compared one by one).

    Built from ``current`` (id → state) and kept in step by :meth:`put` with every state
    the caller decides; deleted states are left out. Not thread-safe (one decision's)."""

    def __init__(self, current: dict[str, ev.Observation]) -> None:
        self._row: dict[str, int] = {}
        self._ids: list[str] = []
        self._dim = next((len(o.embedding) for o in current.values() if len(o.embedding)), 0)
        # room for a batch's new observations: growing copies the whole matrix
        self._m = np.zeros((len(current) + 64, max(self._dim, 1)))
        self._norm = np.zeros(self._m.shape[0])
        self._live = np.zeros(self._m.shape[0], dtype=bool)
        self._odd: dict[int, Sequence[float]] = {}  # row → an embedding of another dimension
        # prime(): a vector's bytes → its cosines with the first _primed_n rows, and the
        # rows put since (their cosines are computed again)
        self._primed: dict[bytes, np.ndarray] = {}
        self._primed_n = 0
        self._dirty: set[int] = set()
        for o in current.values():
            self.put(o)

    @property
    def capacity(self) -> int:
        """Rows the matrix has room for (what it holds in memory: ``capacity`` ×
        dimension float64 values)."""
        return self._m.shape[0]

    @property
    def rows(self) -> int:
        """Rows in use: every observation put, including those deleted since (a deleted
        one keeps its row, not live)."""
        return len(self._ids)

    def put(self, o: ev.Observation) -> None:
        """Add or replace ``o``'s row (a deleted state drops it)."""
        r = self._row.get(o.id)
        if r is None:
            if o.deleted:
                return
            r = self._row[o.id] = len(self._ids)
            self._ids.append(o.id)
            if r == self._m.shape[0]:  # grow by half
                extra = max(64, r // 2)
                self._m = np.vstack([self._m, np.zeros((extra, self._m.shape[1]))])
                self._norm = np.concatenate([self._norm, np.zeros(extra)])
                self._live = np.concatenate([self._live, np.zeros(extra, dtype=bool)])
        if self._primed:
            self._dirty.add(r)
        if not self._dim and len(o.embedding) and not o.deleted:
            # built empty (a new scope): the first embedding sets the dimension, else
            # every row would be compared one by one (no row holds a vector yet)
            self._dim = len(o.embedding)
            self._m = np.zeros((self._m.shape[0], self._dim))
        ok = not o.deleted and len(o.embedding) == self._dim and self._dim > 0
        self._m[r] = np.asarray(o.embedding, dtype=np.float64) if ok else 0.0
        self._norm[r] = float(np.linalg.norm(self._m[r])) if ok else 0.0
        self._live[r] = not o.deleted
        self._odd.pop(r, None)
        if not o.deleted and not ok and len(o.embedding):
            self._odd[r] = list(o.embedding)

    def prime(self, vecs: Iterable[Sequence[float]]) -> None:
        """Compute now, in one matrix product, the cosines of each of ``vecs`` with every
        row, for the queries of a batch: a query with one of them then reads its column
        and computes only the rows :meth:`put` since (one product per query read the
        whole matrix once per fact of the batch). Replaces an earlier priming; a vector
        of another dimension or zero is left to the query."""
        n = len(self._ids)
        xs = {}
        for v in vecs:
            x = np.asarray(v, dtype=np.float64)
            if len(x) == self._dim and self._dim > 0 and np.linalg.norm(x) > 0:
                xs[x.tobytes()] = x
        self._primed, self._primed_n, self._dirty = {}, n, set()
        if not xs or not n:
            return
        xm = np.stack(list(xs.values()))
        nx = np.linalg.norm(xm, axis=1)
        with np.errstate(divide="ignore", invalid="ignore"):
            sims = np.where(self._norm[:n, None] > 0,
                            (self._m[:n] @ xm.T) / (self._norm[:n, None] * nx[None, :]), 0.0)
        self._primed = {k: sims[:, j] for j, k in enumerate(xs)}

    def _cosines(self, vec: Sequence[float]) -> np.ndarray:
        """Cosine of ``vec`` with every row (NaN for rows not live)."""
        n = len(self._ids)
        x = np.asarray(vec, dtype=np.float64)
        nx = float(np.linalg.norm(x)) if len(x) else 0.0
        col = self._primed.get(x.tobytes()) if self._primed and nx else None
        if len(x) != self._dim or not nx:
            sims = np.zeros(n)
        elif col is not None:  # primed: only the rows put since
            sims = np.zeros(n)
            sims[:self._primed_n] = col
            rows = np.array(sorted(self._dirty | set(range(self._primed_n, n))), dtype=np.intp)
            if len(rows):
                with np.errstate(divide="ignore", invalid="ignore"):
                    sims[rows] = np.where(self._norm[rows] > 0,
                                          (self._m[rows] @ x) / (self._norm[rows] * nx), 0.0)
        else:
            with np.errstate(divide="ignore", invalid="ignore"):
                sims = np.where(self._norm[:n] > 0, (self._m[:n] @ x) / (self._norm[:n] * nx),
                                0.0)
        for r, other in self._odd.items():
            sims[r] = cosine(vec, other)
        sims[~self._live[:n]] = np.nan
        return sims

    def similar(self, vec: Sequence[float], threshold: float) -> list[str]:
        """Ids of the live observations whose cosine with ``vec`` is at least
        ``threshold``, in id order."""
        sims = self._cosines(vec)
        with np.errstate(invalid="ignore"):
            rows = np.flatnonzero(sims >= threshold)
        return sorted(self._ids[r] for r in rows)

    def best_of(self, vecs: Sequence[Sequence[float]]) -> dict[str, float]:
        """id → the highest cosine of any of ``vecs`` with each live observation (0.0
        with no ``vecs``)."""
        n = len(self._ids)
        best = np.zeros(n) if not vecs else np.fmax.reduce([self._cosines(v) for v in vecs])
        return {self._ids[r]: float(best[r]) for r in range(n) if self._live[r]}

    def nearest(self, vec: Sequence[float]) -> tuple[str | None, float]:
        """(id, cosine) of the live observation nearest ``vec`` (ties: lowest id), or
        (None, -1.0) when there is none."""
        sims = self._cosines(vec)
        if not len(sims) or np.isnan(sims).all():
            return None, -1.0
        best = float(np.nanmax(sims))
        return min(self._ids[r] for r in np.flatnonzero(sims == best)), best


def worth_keeping(fact: ev.Fact) -> bool:
    """Offline default rule of what is worth an observation: a statement (not a
    question) of at least :data:`MIN_WORDS` words."""
    text = fact.text.strip()
    return len(_words(text)) >= MIN_WORDS and not text.endswith(("?", "？", "؟"))


# ---- times ------------------------------------------------------------------------------


def _ns(msg, field: str) -> int | None:
    """A set Timestamp field as nanoseconds clamped into the representable range."""
    if not msg.HasField(field):
        return None
    t = getattr(msg, field)
    return min(max(t.seconds * 10**9 + t.nanos, MIN_NANOS), MAX_NANOS)


def _from_ns(n: int) -> Timestamp:
    t = Timestamp()
    t.seconds, t.nanos = divmod(n, 10**9)  # floor: nanos stays in [0, 1e9)
    return t


def fact_window(fact: ev.Fact) -> tuple[int, int] | None:
    """When ``fact`` happened, as clamped nanoseconds (start, end): its occurred range, a
    missing end taken from the other, falling back to ``mentioned_at``; None if timeless."""
    s, e, m = _ns(fact, "occurred_start"), _ns(fact, "occurred_end"), _ns(fact, "mentioned_at")
    start = next((t for t in (s, e, m) if t is not None), None)
    end = next((t for t in (e, s, m) if t is not None), None)
    if start is None or end is None:
        return None
    return min(start, end), max(start, end)


def statement_time(fact: ev.Fact) -> tuple[int, int]:
    """Order of statements of a state ("I live in Lisbon"): the latest moment the fact is
    known true — the later of its occurred end and ``mentioned_at`` (a present-tense
    state holds when it is told) — then ``mentioned_at`` to order two statements of one
    day (their default occurred window is that whole day). Nanoseconds; timeless facts
    sort first."""
    times = [t for t in (_ns(fact, "occurred_end"), _ns(fact, "occurred_start"),
                         _ns(fact, "mentioned_at")) if t is not None]
    if not times:
        return MIN_NANOS, MIN_NANOS
    m = _ns(fact, "mentioned_at")
    return max(times), (m if m is not None else max(times))


def stamp_occurred(obs: ev.Observation, facts: Iterable[ev.Fact]) -> None:
    """Set ``obs.occurred_start/end`` to the span of ``facts``' windows (its evidence
    facts; see :func:`fact_window`), clamped to years 1..9999. Left as it was when no
    fact has a time (e.g. the evidence is no longer known)."""
    stamp_span(obs, map(fact_window, facts))


def stamp_span(obs: ev.Observation, windows: Iterable[tuple[int, int] | None]) -> None:
    """:func:`stamp_occurred` from the evidence's :func:`fact_window` values (None for a
    timeless fact), for callers that keep them."""
    spans = [w for w in windows if w is not None]
    if not spans:
        return
    obs.occurred_start.CopyFrom(_from_ns(min(w[0] for w in spans)))
    obs.occurred_end.CopyFrom(_from_ns(max(w[1] for w in spans)))


# ---- state changes ---------------------------------------------------------------------


def _ts(at: datetime) -> Timestamp:
    t = Timestamp()
    t.FromDatetime(at)
    return t


def _names_overlap(fact: ev.Fact, obs: ev.Observation) -> bool:
    a = {e.id for e in fact.entities if e.label != "CONCEPT"}
    b = {e.id for e in obs.entities if e.label != "CONCEPT"}
    return not a or not b or bool(a & b)


def next_state(obs: ev.Observation, at: datetime) -> ev.Observation:
    """A copy of ``obs`` as the next version, stamped ``updated_at = at``."""
    new = ev.Observation()
    new.CopyFrom(obs)
    new.version = obs.version + 1
    new.updated_at.CopyFrom(_ts(at))
    new.stale = False
    return new


def add_evidence(obs: ev.Observation, memory_id: str, quote: str) -> None:
    """Append evidence (skipping an identical pair) and recount ``proof_count`` as the
    number of distinct source memories."""
    if not any(e.memory_id == memory_id and e.quote == quote for e in obs.evidence):
        obs.evidence.add(memory_id=memory_id, quote=quote)
    obs.proof_count = len({e.memory_id for e in obs.evidence})


def add_entities(obs: ev.Observation, entities) -> None:
    have = {e.id for e in obs.entities}
    for e in entities:
        if e.id not in have:
            obs.entities.add(id=e.id, name=e.name, label=e.label)
            have.add(e.id)


def revise(obs: ev.Observation, text: str, at: datetime, reason: str) -> None:
    """Replace the text, keeping the old one in ``history`` (never a silent overwrite)."""
    if text == obs.text:
        return
    obs.history.add(text=obs.text, at=_ts(at), reason=reason)
    obs.text = text


def create(fact: ev.Fact, scope: list[str], at: datetime, cause: str, model: str,
           text: str | None = None, embedding: Sequence[float] | None = None) -> ev.Observation:
    """A new observation backed by ``fact``; its id derives from the causing event
    (``cause``), the fact and the scope, so redelivery and replay give the same id."""
    obs = ev.Observation(
        id=derive_id(cause, "observation", fact.id, scope_key(scope)), text=text or fact.text,
        scope=scope, created_at=_ts(at), updated_at=_ts(at), version=1,
        embedding=list(embedding if embedding is not None else fact.embedding),
        embedding_model=model)
    add_evidence(obs, fact.id, quote_of(fact.text))
    add_entities(obs, fact.entities)
    stamp_occurred(obs, [fact])
    return obs


def _value_time(obs: ev.Observation, key: attributes.Key, value: str,
                lookup: FactLookup | None) -> tuple[int, int]:
    """When ``obs``'s current ``value`` of ``key`` was last stated: the latest
    :func:`statement_time` of its evidence facts that state it (else the end of its
    occurred range; else the beginning of time)."""
    known = lookup([e.memory_id for e in obs.evidence]) if lookup is not None else {}
    times = [statement_time(f) for _, f in sorted(known.items())
             if attributes.statements(f.text).get(key) == value]
    if times:
        return max(times)
    end = _ns(obs, "occurred_end")
    return (end, end) if end is not None else (MIN_NANOS, MIN_NANOS)


def contradict(fact: ev.Fact, current: dict[str, ev.Observation], at: datetime,
               lookup: FactLookup | None = None) -> ev.Observation | None:
    """The decision for a fact that states a single-valued attribute
    (:func:`attributes.statements`) of a subject differently than a live observation of
    its scope — None when it states none, or when some observation already holds the
    values it states (the ordinary rules decide then). Of several contradicted
    observations the one whose value was stated last is taken (ties: lowest id).

    The newer statement (:func:`statement_time`; the current value's time comes from the
    observation's evidence through ``lookup``) wins: a fact at least as new revises the
    observation (its text, embedding; the old text to ``history`` as "was: … — now: …");
    an older one leaves the text and joins ``history`` and evidence only, so the result
    does not depend on the order the facts arrive in."""
    said = attributes.statements(fact.text)
    if not said:
        return None
    best: tuple[tuple[int, int], ev.Observation] | None = None
    for obs in sorted(current.values(), key=lambda o: o.id):
        held = _held(obs.text)
        shared = [k for k in said if k in held]
        if not shared:
            continue
        if all(held[k] == said[k] for k in shared):
            return None  # already believed
        t = max(_value_time(obs, k, held[k], lookup) for k in shared if held[k] != said[k])
        if best is None or t > best[0]:
            best = (t, obs)
    if best is None:
        return None
    held_time, obs = best
    new = next_state(obs, at)
    if statement_time(fact) >= held_time:
        revise(new, fact.text, at, f"was: {obs.text} — now: {fact.text}")
        new.embedding[:] = list(fact.embedding)
    elif not any(h.text == fact.text for h in obs.history):
        new.history.add(text=fact.text, at=_ts(at),
                        reason=f"was: {fact.text} — now: {obs.text} (an earlier statement, told later)")
    add_evidence(new, fact.id, quote_of(fact.text))
    add_entities(new, fact.entities)
    return new


@functools.lru_cache(maxsize=65536)
def _held(text: str) -> dict:
    """:func:`attributes.statements` of an observation's text, cached: every fact that
    states an attribute reads those of every observation of its scope (treat as read-only)."""
    return attributes.statements(text)


def decide_offline(fact: ev.Fact, scope: list[str], current: dict[str, ev.Observation],
                   at: datetime, cause: str, model: str,
                   lookup: FactLookup | None = None,
                   index: ScopeIndex | None = None) -> ev.Observation | None:
    """The offline decision for one fact in one scope; ``current`` (id → state, this
    scope, not deleted) is read, not changed; ``lookup`` finds the evidence facts of an
    observation (for :func:`contradict`); ``index``: ``current``'s :class:`ScopeIndex`
    when the caller keeps one (else one is built). Returns the new or changed
    observation, or None when the fact is left alone."""
    if not worth_keeping(fact):
        return None
    changed = contradict(fact, current, at, lookup)
    if changed is not None:
        return changed
    best_id, best_sim = (index or ScopeIndex(current)).nearest(fact.embedding)
    best = current.get(best_id) if best_id is not None else None
    if best is not None and _names_overlap(fact, best):
        same = compatible(fact.text, best.text)
        if same and best_sim >= REINFORCE_SIM:
            new = next_state(best, at)
            add_evidence(new, fact.id, quote_of(fact.text))
            add_entities(new, fact.entities)
            return new
        if (not same and best_sim >= REVISE_SIM
                and proper_names(fact.text) == proper_names(best.text)):
            # A change of state ("2 dogs" → "a dog named Rex", "likes" → "no longer likes"):
            # the newer fact's words become the text; the old ones stay in history.
            new = next_state(best, at)
            revise(new, fact.text, at, f"was: {best.text} — now: {fact.text}")
            new.embedding[:] = list(fact.embedding)
            add_evidence(new, fact.id, quote_of(fact.text))
            add_entities(new, fact.entities)
            return new
    return create(fact, scope, at, cause, model)


def reconcile(scope_obs: dict[str, ev.Observation], touched: Iterable[str], threshold: float,
              at: datetime, index: ScopeIndex | None = None) -> list[ev.Observation]:
    """Near-duplicate reconciliation in one scope: each touched observation is merged
    with every other live one at or above ``threshold`` (cosine; 1.0 disables) that is
    :func:`compatible` — the older (created_at, then id) survives with the evidence of
    both folded in; the other is deleted with a history note. Returns the changed states
    (``scope_obs`` is updated with them, and ``index``, ``scope_obs``'s
    :class:`ScopeIndex` when the caller keeps one)."""
    if threshold >= 1.0:
        return []
    index = index or ScopeIndex(scope_obs)
    index.prime(scope_obs[t].embedding for t in sorted(set(touched)) if t in scope_obs)
    changed: dict[str, ev.Observation] = {}
    for tid in sorted(set(touched)):
        a = scope_obs.get(tid)
        if a is None or a.deleted:
            continue
        # a merge keeps embeddings (next_state copies them): one product per touched one
        for bid in index.similar(a.embedding, threshold):
            b = scope_obs.get(bid)
            if b is None or bid == a.id or b.deleted or a.deleted:
                continue
            if not compatible(a.text, b.text):
                continue
            keep, drop = sorted((a, b), key=lambda o: (o.created_at.ToNanoseconds(), o.id))
            survivor = changed.get(keep.id) or next_state(keep, at)
            for e in drop.evidence:
                add_evidence(survivor, e.memory_id, e.quote)
            add_entities(survivor, drop.entities)
            gone = changed.get(drop.id) or next_state(drop, at)
            gone.deleted = True
            gone.history.add(text=drop.text, at=_ts(at), reason=f"merged into {keep.id}")
            changed[keep.id], changed[drop.id] = survivor, gone
            scope_obs[keep.id], scope_obs[drop.id] = survivor, gone
            index.put(survivor)
            index.put(gone)
            a = scope_obs[tid]
    return [changed[k] for k in sorted(changed)]
