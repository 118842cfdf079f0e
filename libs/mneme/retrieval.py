"""Retrieval math for recall (DESIGN §5): rank fusion, boosts, token-budget filling.

Pure functions, no I/O. Scores live on the scale of Reciprocal Rank Fusion: one arm's
vote for its top item is ``1 / (k + 1)`` = 1/21 ≈ 0.048 (:data:`RRF_UNIT`), and every
boost here is a bounded fraction of that (all boosts together ≤ 0.25 × RRF_UNIT ≈ 0.0119),
so a boost reorders near-ties but cannot outweigh an additional arm agreeing on an item
unless that arm ranked it below ~64 (1/(20 + 64) ≈ 0.0119), deeper than a mid budget's
lists. Two context steps are larger on purpose: a reply inherits a share of the fused
score of the turn it answers (:func:`reply_share`, up to ``REPLY_WEIGHT`` × that score),
and the head reranker adds up to (ENTITY_WEIGHT + ADJACENT_WEIGHT + SPEAKER_WEIGHT +
ANSWER_TYPE_WEIGHT) × RRF_UNIT (:func:`rerank_head`).

Source: G. V. Cormack, C. L. A. Clarke, S. Büttcher, "Reciprocal Rank Fusion outperforms
Condorcet and individual Rank Learning Methods", SIGIR 2009 — score(d) = Σ_r 1/(k + r(d)),
ranks 1-based. The paper's k = 60 was tuned for fusing 1000-deep TREC runs; recall fuses
short lists (≤ 150 candidates per arm) and only the head is returned, where a smaller k
lets a strong first place count for more against agreement far down the lists. k = 20
(see :data:`RRF_K`) measured better on LoCoMo evidence retrieval (recall@10 +0.025 over
k = 60 with the same arms; k = 10 and 30 were within ±0.01 of it).
"""

from __future__ import annotations

import functools
import math
import re
from dataclasses import dataclass
from datetime import datetime
from typing import Hashable, Iterable, Iterator, Mapping, Sequence

from mneme.domain import Fact, Scored, TimeWindow, utc

#: RRF's constant k (Cormack et al. 2009 use 60; see the module docs for why 20).
RRF_K = 20

#: One arm's vote for its rank-1 item under RRF with k = :data:`RRF_K` (1/21 ≈ 0.048).
RRF_UNIT = 1.0 / (RRF_K + 1)

#: Caps of the boosts, as fractions of :data:`RRF_UNIT` (sum 0.25). The query's own time
#: window is the strongest signal of the three (the user asked about that time); proof
#: count says a belief is well supported; recency is weakest so old memories stay findable.
RECENCY_WEIGHT = 0.04
TEMPORAL_WEIGHT = 0.13
PROOF_WEIGHT = 0.08

#: Half-life of the recency boost. Long on purpose: a memory system must not bury a
#: fact because it is a year old; recency only separates otherwise-equal candidates.
RECENCY_HALF_LIFE_DAYS = 365.0

#: proof_count at which the proof boost reaches half its cap (saturating curve).
PROOF_HALF_COUNT = 3.0

#: Factor on the fused score of a fact that only asks (see :func:`is_question`).
QUESTION_WEIGHT = 0.5

#: Share of the fused score of the turn a reply answers that the reply inherits
#: (:func:`reply_share`). Measured on LoCoMo dev (2 conversations): 0.2 → recall@10
#: +0.016, 0.3 → +0.031, 0.5 → +0.033 but multi-hop −0.03 (replies crowd out other
#: sessions' evidence); inheriting only from questions gained less (+0.009 at 0.5).
REPLY_WEIGHT = 0.3

#: The head reranker (:func:`rerank_head`): how many of the fused results it reorders,
#: and its features' weights as fractions of :data:`RRF_UNIT` (:func:`head_features`).
#:
#: The weights of adjacency, speaker, length and time rank were fitted together on
#: LoCoMo dev by coordinate ascent on recall@10 (D. Metzler, W. B. Croft, "Linear
#: feature-based models for information retrieval", Information Retrieval 10(3), 2007;
#: ``tests/bench/fit_head.py`` does the same). Leaving each conversation out in turn,
#: the fits on the other six (with 5 to 21 free weights) moved adjacency from 0.2 to
#: 1.1–2.2, speaker from 0.6 to 1.0–1.6, length on other questions to 0.25–0.75 and time
#: rank to 1.25–1.5, and scored 0.790–0.795 out of fold against 0.777 for the weights
#: before. The kept values were picked on a small grid of round values around the fits
#: on all seven (adjacency 1.2–1.6, speaker 1.1–1.35, length 0.25–0.5, time rank
#: 1.1–1.5): recall@10 0.800 over the heads the fits used (each left at its old value:
#: adjacency −0.015, length −0.004, time rank −0.003, speaker −0.002).
RERANK_HEAD = 50
ENTITY_WEIGHT = 0.3
#: A turn next to another head result (a question and its answer, a statement and its
#: follow-up). First set to 0.2 with the reranker alone; with the answer type, speaker
#: and length beside it, the fit wants it stronger than one arm's first place.
ADJACENT_WEIGHT = 1.2
#: A fact naming an entity of the kind the question asks for (:func:`answer_labels`).
#: Stronger than one arm's first place on purpose: the kind of the answer is known from
#: the question alone, and facts that share the question's words but name no such thing
#: crowd the head otherwise. Measured on LoCoMo dev (all 7 conversations, recall@10 over
#: the same run without it): 0.3 +0.006, 0.6 +0.007, 1.0 +0.013, 1.5 +0.021 (multi-hop
#: +0.030, open-domain +0.031, temporal +0.020, single-hop +0.016), 2.0 +0.021 with a
#: lower nDCG@10; a head of 80 instead of 50 gained nothing more.
ANSWER_TYPE_WEIGHT = 1.5
#: A fact said by a person the query names (its speaker is a query entity), on top of
#: the entity overlap: who says it is a stronger field than a name in passing, as a
#: title match counts more than a body match in BM25F (S. Robertson, H. Zaragoza,
#: M. Taylor, "Simple BM25 extension to multiple weighted fields", CIKM 2004). Measured
#: on LoCoMo dev (all 7 conversations, with the answer type on; recall@10 / nDCG@10 over
#: the same run without it): 0.3 +0.000 / +0.012, 0.6 +0.002 / +0.015 (multi-hop +0.012,
#: open-domain +0.033, temporal −0.004, single-hop −0.003), 1.0 +0.003 / +0.016; 1.0 in
#: the joint fit above.
SPEAKER_WEIGHT = 1.0
#: Length prior: + weight × RRF_UNIT × min(1, words / LENGTH_PIVOT) of a fact's statement
#: (:func:`statement_words`), :data:`LIST_LENGTH_WEIGHT` for a question that asks for
#: several things (:func:`asks_for_list`), :data:`LENGTH_WEIGHT` for any other. Longer
#: passages are more often relevant than short ones at the same match score (A. Singhal,
#: C. Buckley, M. Mitra, "Pivoted document length normalization", SIGIR 1996): on LoCoMo
#: dev a turn of 0–11 words is an evidence turn 0.13–0.31 times as often as the average
#: turn, one of 32–47 words 1.7–2.1 times. Alone (all 7 dev conversations retained once,
#: variants recalled in one process; recall@10 against 0.776 / multi-hop 0.509 without
#: it): on every question, 0.5 → 0.775 (multi-hop 0.517, single-hop −0.010), 1.0 → 0.771
#: (0.536, single-hop −0.016): single-hop answers are often short turns. On list questions
#: only (against 0.778 / 0.507): 1.0 → 0.780 (0.519), 1.5 with a pivot of 40 → 0.779
#: (0.526), 1.5 with 25 → 0.781 (0.524, single-hop unchanged). With the stronger
#: adjacency, 0.5 on the other questions pays too (joint fit above).
LENGTH_WEIGHT = 0.5
LIST_LENGTH_WEIGHT = 1.5
LENGTH_PIVOT = 25
#: When the query names a time, the fact's place in the temporal arm counts again in the
#: head: + weight × RRF_UNIT × (RRF_K + 1) / (RRF_K + place) (scaled to 1 at the first
#: place; the place among the arm's facts, where :func:`rrf` ranks passages).
TIME_RANK_WEIGHT = 1.0


def head_weights() -> dict[str, float]:
    """The weight of each feature of :func:`head_features` (× :data:`RRF_UNIT`), read
    from the module's constants when called."""
    return {"entity": ENTITY_WEIGHT, "speaker": SPEAKER_WEIGHT,
            "adjacent": ADJACENT_WEIGHT, "answer_type": ANSWER_TYPE_WEIGHT,
            "length": LENGTH_WEIGHT, "list_length": LIST_LENGTH_WEIGHT,
            "time_rank": TIME_RANK_WEIGHT}


_DAY = 86400.0


@dataclass(frozen=True)
class Budget:
    """How hard recall searches: ``candidates`` per arm (the k asked of each store) and
    ``hops`` of spreading activation in the graph arm."""

    candidates: int
    hops: int


#: ``RecallQuery.budget`` → :class:`Budget`. Low keeps latency small (a chat turn); high
#: digs for multi-hop evidence (reflect, benchmarks).
BUDGETS: dict[str, Budget] = {
    "low": Budget(candidates=20, hops=1),
    "mid": Budget(candidates=60, hops=2),
    "high": Budget(candidates=150, hops=3),
}


# ---- fusion -------------------------------------------------------------------------------


def rrf(rankings: Mapping[str, Sequence[str]], k: int = RRF_K,
        passage: Mapping[str, Hashable] | None = None,
        order: Mapping[str, tuple] | None = None) -> list[tuple[str, float]]:
    """Reciprocal Rank Fusion of ranked id lists.

    ``rankings`` maps an arm name to its ids, best first (rank 1 = index 0); an id listed
    twice in one arm counts once, at its better rank. Returns ``(id, score)`` best first,
    where score(d) = Σ_arms 1 / (k + rank_arm(d)) over the arms that ranked d.

    ``passage`` (optional) maps ids to the source passage they were extracted from: ids
    of one passage share one rank in an arm (that of its first id there) and the ids
    after them move up, so a passage told in several facts (a model's facts beside the
    offline ones) takes one place per arm and does not push other passages down. Ids
    not in ``passage`` are passages of their own.

    Ties (equal scores) are broken deterministically: better best single rank first, then
    the smaller ``order`` key (optional, id → a tuple, e.g. :func:`tie_key`; ids without
    one come after those with one), then the smaller id. Terms are summed in a fixed order
    (smallest rank first) so equal rank multisets give bit-identical floats regardless of
    arm order.

    Raises ValueError if ``k`` < 0. Source: Cormack, Clarke & Büttcher, SIGIR 2009.
    """
    if k < 0:
        raise ValueError("k: must be >= 0")
    passage = passage or {}
    ranks: dict[str, list[int]] = {}
    for ids in rankings.values():
        seen: set[str] = set()
        at: dict[Hashable, int] = {}  # passage → its rank in this arm
        pos = 0
        for doc in ids:
            if doc in seen:  # a repeated id keeps its place in the list
                pos += 1
                continue
            seen.add(doc)
            key = passage.get(doc, ("id", doc))
            if key not in at:
                pos += 1
                at[key] = pos
            ranks.setdefault(doc, []).append(at[key])
    order = order or {}
    fused = []
    for doc, rs in ranks.items():
        rs.sort()
        score = math.fsum(1.0 / (k + r) for r in rs)
        key = order.get(doc)
        fused.append((doc, score, rs[0], (0, key) if key is not None else (1, ())))
    fused.sort(key=lambda t: (-t[1], t[2], t[3], t[0]))
    return [(t[0], t[1]) for t in fused]


def tie_key(fact: Fact) -> tuple[str, int, str, str]:
    """A key that orders facts the stores score alike by where they were told: document
    id, item index, then the fact's text and id. Fact ids are random (uuid4), so breaking
    ties by id alone would order equal scores differently each time the same content is
    retained; the graph arm's activations tie often (every seed of one rank, every unit
    one hop from it). A fact without a document sorts by text and id."""
    return (fact.document_id or "", fact.item_index if fact.document_id else 0,
            fact.text or "", fact.id)


# ---- boosts -------------------------------------------------------------------------------


def fact_span(fact: Fact) -> tuple[datetime, datetime] | None:
    """When ``fact`` happened as a closed UTC interval: its occurred range, a missing end
    taken from the other end, falling back to ``mentioned_at`` (what a speaker says is
    usually about around when they say it). None when the fact has no time at all."""
    start = fact.occurred_start or fact.occurred_end or fact.mentioned_at
    end = fact.occurred_end or fact.occurred_start or fact.mentioned_at
    if start is None or end is None:
        return None
    start, end = utc(start), utc(end)
    return (start, end) if start <= end else (end, start)


def recency_boost(fact: Fact, now: datetime) -> float:
    """Boost in [0, RECENCY_WEIGHT × RRF_UNIT] decaying exponentially with the distance in
    time between the fact and ``now`` (the query timestamp), half-life
    :data:`RECENCY_HALF_LIFE_DAYS`. The fact's time is the end of its occurred range (the
    latest moment it was true), else ``mentioned_at``; 0 when it has none. Distance is
    absolute, so a planned event just after ``now`` counts as recent too."""
    span = fact_span(fact)
    if span is None:
        return 0.0
    age_days = abs((utc(now) - span[1]).total_seconds()) / _DAY
    return RECENCY_WEIGHT * RRF_UNIT * 0.5 ** (age_days / RECENCY_HALF_LIFE_DAYS)


def window_overlap(start: datetime, end: datetime, window: TimeWindow) -> float:
    """Fraction in [0, 1] of [start, end] that lies inside ``window`` (open ends of the
    window are unbounded). A point (start == end) scores 1 inside, 0 outside. A fact
    spanning a whole year scores low for a one-week window: it is less specific."""
    if not window.overlaps(start, end):
        return 0.0
    length = (end - start).total_seconds()
    if length <= 0:
        return 1.0
    lo = max(start, utc(window.start)) if window.start is not None else start
    hi = min(end, utc(window.end)) if window.end is not None else end
    return max(0.0, min(1.0, (hi - lo).total_seconds() / length))


def window_distance_days(start: datetime, end: datetime, window: TimeWindow) -> float:
    """Gap in days between [start, end] and ``window``; 0 when they overlap."""
    if window.overlaps(start, end):
        return 0.0
    if window.end is not None and start > utc(window.end):
        return (start - utc(window.end)).total_seconds() / _DAY
    return (utc(window.start) - end).total_seconds() / _DAY


def temporal_proximity_boost(fact: Fact, window: TimeWindow | None) -> float:
    """Boost in [0, TEMPORAL_WEIGHT × RRF_UNIT] for a fact close to the query's window.

    Inside the window: half the cap plus half × the fraction of the fact's span inside it
    (so specific facts beat broad ones). Outside: at most half the cap, halving for every
    window-width (at least one day) of distance, so near misses ("the day after") still
    get something. 0 when there is no window or the fact has no time.
    """
    if window is None:
        return 0.0
    span = fact_span(fact)
    if span is None:
        return 0.0
    cap = TEMPORAL_WEIGHT * RRF_UNIT
    inside = window_overlap(span[0], span[1], window)
    if inside > 0.0 or window.overlaps(span[0], span[1]):
        return cap * (0.5 + 0.5 * inside)
    width_days = 1.0
    if window.start is not None and window.end is not None:
        width_days = max(1.0, (utc(window.end) - utc(window.start)).total_seconds() / _DAY)
    gap = window_distance_days(span[0], span[1], window)
    return cap * 0.5 * 0.5 ** (gap / width_days)


def proof_boost(proof_count: int) -> float:
    """Boost in [0, PROOF_WEIGHT × RRF_UNIT) for an observation backed by ``proof_count``
    facts: saturating count / (count + PROOF_HALF_COUNT), so 3 proofs give half the cap and
    evidence beyond ~10 adds little. 0 for count <= 0 (plain facts)."""
    if proof_count <= 0:
        return 0.0
    return PROOF_WEIGHT * RRF_UNIT * proof_count / (proof_count + PROOF_HALF_COUNT)


_CAPTION_RE = re.compile(r"\s*\[shares a photo:[^\]]*\]\s*$")
_SPEAKER_RE = re.compile(r"^[^\s:][^:\n]{0,39}:\s+")
_SENTENCE_RE = re.compile(r"(?<=[.!?])\s+")


@functools.lru_cache(maxsize=20_000)
def is_question(text: str) -> bool:
    """True when the fact ``text`` only asks: every sentence of its statement (without a
    "Speaker: " prefix and a trailing "[shares a photo: ...]") ends with a question mark.

    A question states nothing, yet it shares its words with questions put to recall
    ("What did Melanie paint?" looks most like "Melanie: What did you paint?"), so recall
    multiplies its fused score by :data:`QUESTION_WEIGHT`: the answer, usually the next
    turn, ranks above the question that prompted it, and a question alone is still found.
    The answers for the last 20,000 texts are kept (recall asks about the same candidates
    query after query)."""
    body = _without_speaker(_CAPTION_RE.sub("", text or ""))
    sentences = [s for s in _SENTENCE_RE.split(body) if s.strip()]
    return bool(sentences) and all(s.rstrip(" \"'\u201d\u2019)").endswith("?")
                                   for s in sentences)


@functools.lru_cache(maxsize=20_000)
def statement_words(text: str) -> int:
    """Words of the fact ``text`` without a "Speaker: " prefix (a shared photo's caption
    counts: it is part of what the turn tells)."""
    return len(_without_speaker(text or "").split())


def _without_speaker(text: str) -> str:
    """``text`` stripped, without a leading "Speaker: " prefix."""
    body = text.strip()
    m = _SPEAKER_RE.match(body)
    return body[m.end():] if m else body


def question_factor(fact: Fact) -> float:
    """:data:`QUESTION_WEIGHT` for a fact that only asks (:func:`is_question`), else 1."""
    return QUESTION_WEIGHT if is_question(fact.text) else 1.0


# ---- context: replies and the head ------------------------------------------------------


def replies_to(fact: Fact) -> str | None:
    """The id of the fact that ``fact`` answers: the target of its ``temporal`` link of
    weight < 1, which an extractor puts on the first fact of a turn towards the last fact
    of the turn before it in the same conversation (``link_adjacent``); None otherwise."""
    return next((lk.target_id for lk in fact.links if lk.kind == "temporal" and lk.weight < 1.0),
                None)


def reply_share(results: Sequence[Scored]) -> None:
    """Let each reply among ``results`` inherit :data:`REPLY_WEIGHT` × the fused score of
    the turn it answers (:func:`replies_to`), when that turn is among ``results`` too.

    Why: the turn that looks most like a query is often the question asked in the
    conversation ("What got you into running?" for "Why did Melanie start running?") or
    the statement a reply comments on; the answer is the next turn, and shares few words
    with either. The inherited score is the other turn's ``rrf`` before its question
    factor (a question is weighed down as an answer, not as a pointer to one). It is added
    to ``boost`` and ``final`` in place; call before sorting by ``final``. Unlike the
    other boosts it is not capped below :data:`RRF_UNIT`: it carries another result's
    fused evidence. A reply to a statement (not a question) gets at most what brings it
    just below that statement: the statement is the evidence, the reply a comment on it
    (on the dev split this kept recall@10 within 0.004 and raised temporal nDCG@10 from
    0.606 to 0.650)."""
    by_id = {s.fact.id: s for s in results}
    before = {id(s): s.final for s in results}
    for s in results:
        prev = by_id.get(replies_to(s.fact) or "")
        if prev is None or prev is s:
            continue
        factor = question_factor(prev.fact)
        add = REPLY_WEIGHT * prev.rrf / factor
        if factor == 1.0:
            # a statement's reply may come close to it, not pass it: the statement is
            # the evidence (a dated event, a fact), the reply only comments on it
            add = min(add, max(0.0, before[id(prev)] - before[id(s)]) * 0.999)
        s.boost += add
        s.final += add


# ---- head reranking -----------------------------------------------------------------------

#: Question patterns → the spaCy entity labels an answer names (see :func:`answer_labels`).
_PLACES = ("GPE", "LOC", "FAC")
_WORKS = ("WORK_OF_ART", "PRODUCT")
_ANSWER_TYPES: tuple[tuple[re.Pattern[str], tuple[str, ...]], ...] = tuple(
    (re.compile(pattern, re.IGNORECASE), labels) for pattern, labels in (
        (r"^\s*where\b|\b(?:countr(?:y|ies)|cit(?:y|ies)|places?|locations?|states?|towns?|"
         r"destinations?|travell?ed|visited)\b", _PLACES),
        (r"\b(?:books?|novels?|movies?|films?|songs?|albums?|shows?|series|games?|"
         r"authors?|artists?|bands?|musicians?)\b", _WORKS),
        (r"\b(?:compan(?:y|ies)|organi[sz]ations?|teams?|schools?|universit(?:y|ies)|"
         r"charit(?:y|ies)|brands?)\b", ("ORG",)),
        (r"\b(?:nationality|religio(?:n|us)|political|ethnicity)\b", ("NORP",)),
        (r"\blanguages?\b", ("LANGUAGE",)),
    ))


_LIST_QUESTION = re.compile(
    r"^\s*(?:how\s+many\b|what\s+are\b|(?:what|which)\s+(?:\S+\s+){0,3}?"
    r"(?!(?:does|is|was|has|this|its|his|hers)\b)[\w+-]+s\s+"
    r"(?:has|have|had|does|do|did|is|are|was|were)\b)", re.IGNORECASE)


def asks_for_list(query: str) -> bool:
    """Whether ``query`` asks for several things: "how many ...", "what are ...", or
    "what/which" with a plural noun before its verb ("What activities does Melanie
    partake in?", "Which countries has Tim visited?"). The answer of such a question is
    spread over several passages, each telling one item at length; one short passage
    that shares the question's words is rarely one of them."""
    return bool(_LIST_QUESTION.search(query or ""))


def answer_labels(query: str) -> frozenset[str]:
    """The spaCy entity labels (``mneme.nlp.NER_LABELS``) an answer to ``query`` would
    name, from its wording: places (GPE, LOC, FAC) for "where ..." or "which countries
    ...", works (WORK_OF_ART, PRODUCT) for books, films, songs, games; ORG for companies,
    teams, schools, charities; NORP for nationality or religion; LANGUAGE. Empty when
    the question names no such kind (most questions). "Who ..." gets no PERSON: nearly
    every fact of a conversation names a person, and the small NER model labels short
    first names in other ways ("Carol sang fado" → ORG), so the boost would lift every
    fact about someone else above the one that answers.

    This is the expected answer type of question answering: classify the question, then
    prefer passages naming an entity of that type (X. Li, D. Roth, "Learning Question
    Classifiers", COLING 2002; J. Prager et al., "Question-Answering by Predictive
    Annotation", SIGIR 2000), here with a few English patterns and no model."""
    out: set[str] = set()
    for pattern, labels in _ANSWER_TYPES:
        if pattern.search(query or ""):
            out.update(labels)
    return frozenset(out)


def _speaker_id(fact: Fact) -> str | None:
    """The entity id of the speaker of a "Speaker: ..." fact (extraction puts the speaker
    first among its entities), else None."""
    if fact.entities and _SPEAKER_RE.match(fact.text or ""):
        return fact.entities[0].id
    return None


def _names_answer_type(fact: Fact, labels: frozenset[str], skip: set[str],
                       spoken: bool) -> bool:
    """Whether ``fact`` mentions an entity labelled one of ``labels`` other than those in
    ``skip`` and, when ``spoken`` (a "Speaker: ..." fact), other than its speaker (its
    first entity)."""
    ents = fact.entities[1:] if spoken else fact.entities
    return any(e.label in labels and e.id not in skip for e in ents)


def head_features(top: Sequence[Scored], query_entities: Sequence[str],
                  labels: frozenset[str] = frozenset(),
                  listing: bool = False) -> list[dict[str, float]]:
    """The features of each of ``top`` (the head of the fused results, sorted by
    ``final``) that :func:`rerank_head` weighs with :func:`head_weights`; one dict per
    result, in order, each value in [0, 1]:

    - ``entity``: the fraction of ``query_entities`` (entity ids the query names) that the
      fact mentions — a fact about the people and things asked about beats one that only
      shares words;
    - ``speaker``: 1 when the fact's speaker is one of ``query_entities`` (what a person
      says about themselves answers most questions about them);
    - ``adjacent``: the best neighbour's ``rrf`` / the head's best ``rrf``, where a
      neighbour is another result of ``top`` of the same document whose ``item_index``
      differs by 1 (the turn before or after in one conversation): a question and its
      answer, or a statement and its follow-up, support each other;
    - ``answer_type``: 1 when the fact names an entity of one of ``labels``
      (:func:`answer_labels` of the query), not counting its speaker and the query's own
      entities;
    - ``length`` (``list_length`` when ``listing``, the query asks for several things,
      :func:`asks_for_list`): min(1, :func:`statement_words` / :data:`LENGTH_PIVOT`);
    - ``time_rank``: (RRF_K + 1) / (RRF_K + place) for a fact the temporal arm returned
      at that 1-based place (``Scored.ranks``; only when the query names a time), else 0.
    """
    qents = set(query_entities)
    best_rrf = max((s.rrf for s in top), default=0.0) or 1.0
    by_pos: dict[tuple[str, int], float] = {}
    for s in top:
        if s.fact.document_id:
            key = (s.fact.document_id, s.fact.item_index)
            by_pos[key] = max(by_pos.get(key, 0.0), s.rrf)
    out = []
    for s in top:
        speaker = _speaker_id(s.fact)
        near = 0.0
        if s.fact.document_id:
            near = max(by_pos.get((s.fact.document_id, s.fact.item_index + d), 0.0)
                       for d in (-1, 1))
        length = min(1.0, statement_words(s.fact.text) / LENGTH_PIVOT)
        rank = s.ranks.get("temporal")
        out.append({
            "entity": (len(qents & {e.id for e in s.fact.entities}) / len(qents)
                       if qents else 0.0),
            "speaker": 1.0 if qents and speaker in qents else 0.0,
            "adjacent": near / best_rrf,
            "answer_type": 1.0 if labels and _names_answer_type(
                s.fact, labels, qents, speaker is not None) else 0.0,
            "length": 0.0 if listing else length,
            "list_length": length if listing else 0.0,
            "time_rank": (RRF_K + 1) / (RRF_K + rank) if rank else 0.0,
        })
    return out


def rerank_head(results: list[Scored], query_entities: Sequence[str],
                head: int = RERANK_HEAD,
                labels: frozenset[str] = frozenset(),
                listing: bool = False) -> list[Scored]:
    """Reorder the head of ``results`` (sorted by ``final``, best first) with cheap
    features, no model; the tail keeps its order after the head. The head is the results
    of the first ``head`` passages (a passage: one document's item, see :func:`passage_of`),
    so a turn told in several facts (a model's beside the offline one) takes one of its
    places, as it takes one rank per arm in :func:`rrf`.

    Each head result gets + RRF_UNIT × Σ :func:`head_weights` × :func:`head_features`
    (entity overlap with ``query_entities``, speaker, adjacency, answer type of
    ``labels``, length — stronger when ``listing`` — and the temporal arm's rank).

    The added amount goes into ``boost`` and ``final``; ties keep the incoming order
    (stable sort). Returns a new list; ``results`` items are updated in place.
    """
    top = results[:head_end(results, head)]
    if not top:
        return list(results)
    weights = head_weights()
    for s, feats in zip(top, head_features(top, query_entities, labels, listing)):
        add = RRF_UNIT * math.fsum(weights[k] * v for k, v in feats.items())
        s.boost += add
        s.final += add
    return sorted(top, key=lambda s: -s.final) + list(results[len(top):])


def passage_of(fact: Fact) -> Hashable:
    """The passage ``fact`` was extracted from: (document id, item index), or the fact's
    own id when it has no document. Unique among a bank's live facts, because a retain
    with a document id replaces that document's facts."""
    return (fact.document_id, fact.item_index) if fact.document_id else ("id", fact.id)


def passage_ranks(keys: Iterable[Hashable]) -> Iterator[int]:
    """The 1-based rank of each of ``keys`` (passages, best first) among the distinct
    passages so far: a passage seen before keeps the rank it got then."""
    at: dict[Hashable, int] = {}
    for key in keys:
        yield at.setdefault(key, len(at) + 1)


def head_end(results: Sequence[Scored], head: int) -> int:
    """How many of ``results`` (best first) hold their first ``head`` distinct passages
    (:func:`passage_of`): the head that :func:`rerank_head` reorders is
    ``results[:head_end(results, head)]``."""
    for k, rank in enumerate(passage_ranks(passage_of(s.fact) for s in results)):
        if rank > head:
            return k
    return len(results)


# ---- token budget -------------------------------------------------------------------------


def fill_budget(items: Iterable[Scored], max_tokens: int, counter) -> tuple[list[Scored], int]:
    """Greedily keep ``items`` in order while their texts fit into ``max_tokens``.

    Each item's ``fact.text`` is counted with ``counter.count`` (a TokenCounter) and stored
    in ``Scored.tokens``. An item that does not fit in what is left is skipped and filling
    continues with later (possibly smaller) items; it stops once the budget is used up.
    Returns (kept items in order, their token total ≤ max_tokens). ``max_tokens`` <= 0
    keeps nothing.
    """
    kept: list[Scored] = []
    total = 0
    if max_tokens <= 0:
        return kept, total
    for item in items:
        remaining = max_tokens - total
        if remaining <= 0:
            break
        n = counter.count(item.fact.text)
        item.tokens = n
        if n <= remaining:
            kept.append(item)
            total += n
    return kept, total


#: Words dropped from keyword (BM25) queries on top of the engines' short English stop
#: lists (Lucene's): question words, auxiliaries, pronouns and other function words. A question's "what
#: did she ..." matches nearly every text, so as query terms these only add noise to
#: BM25; the indexed text keeps them (this filters queries only).
QUERY_STOP_WORDS = tuple("""
what when where which who whom whose why how whats did does do done doing is are was were
am be been being has have had having can could would should will shall may might must
i me my mine myself you your yours yourself he him his himself she her hers herself it
its itself we us our ours ourselves they them their theirs themselves
a an the and or but if so than then that this these those there here
of in on at to by as for with from about into over after before during up down out off
any some all both each other such own same too very also just again ever still yet
not no nor only one ones
""".split())
