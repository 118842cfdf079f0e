"""Recall (DESIGN §5): four retrieval arms, rank fusion, boosts, token budget.

Arms, all scoped to the query's bank and filters:

- semantic — kNN over fact embeddings (``VectorStore.search``), score = cosine;
- keyword — BM25 over fact text (``TextStore.search``), score = BM25;
- graph — spreading activation (``GraphStore.spread``) from the top semantic and keyword
  hits (seeds) and from the units mentioning the query's entities, so units that share
  entities or links with the best hits are found even when their own text does not match
  (multi-hop); score = activation;
- temporal — when the query names a time ("last week"), the units whose occurred range
  overlaps that window, ranked by (1 + cosine)/2 × the fraction of the unit's span inside
  the window.

The candidates are hydrated from the vector store (the payload source), the arms fused
with Reciprocal Rank Fusion (Cormack et al. SIGIR 2009; k = ``mneme.retrieval.RRF_K``;
facts of one passage, the same document and item, share one rank per arm; equal scores
ordered by where the fact was told, ``mneme.retrieval.tie_key``, so two copies of the same
content rank alike whatever their random ids), the
candidates re-checked against the filters, the fused score of facts that only ask a question
halved (``mneme.retrieval.is_question``: a question shares its words with the query but
states nothing), boosted
(recency, temporal proximity, proof count; see ``mneme.retrieval``), each reply given a
share of the fused score of the turn it answers (``mneme.retrieval.reply_share``), the head
reordered by entity overlap with the query, its speaker, adjacency to other hits, naming an
entity of the kind the question asks for, length (more for a question that asks for
several things) and the temporal arm's rank (``mneme.retrieval.rerank_head``,
``head_features``, ``answer_labels``, ``asks_for_list``; no model) and filled greedily
into ``max_tokens``.
"""

from __future__ import annotations

import math
import threading
from concurrent.futures import Executor, ThreadPoolExecutor
from concurrent.futures import TimeoutError as FutureTimeout
from dataclasses import replace
from typing import Callable, Hashable, Mapping

from mneme.domain import (
    BANK_ID_RE, Fact, Filters, Hit, RecallOutcome, RecallQuery, Scored, TimeWindow, utc,
)
from mneme.deadline import current as current_deadline
from mneme.errors import DeadlineExceeded
from mneme.ports import (
    DocumentStore, Embedder, GraphStore, QueryAnalyzer, TextStore, TokenCounter, VectorStore,
)
from mneme.retrieval import (
    BUDGETS, RRF_K, answer_labels, fact_span, fill_budget, passage_of, passage_ranks,
    asks_for_list, proof_boost, question_factor, recency_boost, reply_share, rerank_head,
    temporal_proximity_boost, tie_key, window_overlap, rrf,
)
from mneme.timeparse import time_zone, wall_clock
from services.search import include

ARMS = ("semantic", "keyword", "graph", "temporal")

#: Default token budget when the request leaves ``max_tokens`` at 0.
DEFAULT_MAX_TOKENS = 4096

#: How many of each of the semantic and keyword arms' top passages seed the graph arm.
#: On LoCoMo dev (make bench order, deterministic; recall@10 / nDCG@10): 5 → 0.797 /
#: 0.626, 10 → 0.801 / 0.625, 15 → 0.805 / 0.627 (20 and 30 answer as 15 does: a seed
#: below rank 15 starts under 0.3 and passes on less than the arm's 60th activation).
#: 10 is kept: with a retain model's facts beside the offline ones (the ``sentences``
#: stand-in), 15 measures 0.800 against 10's 0.803, below the offline figure.
GRAPH_SEEDS = 10

TAGS_MATCH_MODES = ("any", "all", "any_strict", "all_strict", "exact")

_pool: ThreadPoolExecutor | None = None
_pool_lock = threading.Lock()


def _default_executor() -> Executor:
    """A process-wide pool for the arms. Arm tasks never wait on each other (the caller
    sequences the phases), so sharing one pool between concurrent recalls cannot deadlock."""
    global _pool
    with _pool_lock:
        if _pool is None:
            _pool = ThreadPoolExecutor(max_workers=8, thread_name_prefix="mneme-recall")
        return _pool


def validate(q: RecallQuery) -> None:
    """Raise ValueError("<field>: <problem>") for an invalid request (→ INVALID_ARGUMENT)."""
    if not BANK_ID_RE.fullmatch(q.bank_id or ""):
        raise ValueError("bank_id: must be a slug of lowercase letters, digits, '-' or '_'")
    if not (q.query or "").strip():
        raise ValueError("query: must not be empty")
    if q.budget not in BUDGETS:
        raise ValueError(f"budget: must be one of {', '.join(BUDGETS)}")
    if q.max_tokens < 0:
        raise ValueError("max_tokens: must be >= 0")
    if q.query_timestamp is None:
        raise ValueError("query_timestamp: must be set")
    try:
        time_zone(q.time_zone)
    except ValueError as e:
        raise ValueError(f"time_zone: {e}") from None
    mode = q.filters.tags_match or "any"
    if mode not in TAGS_MATCH_MODES:
        raise ValueError(f"filters.tags_match: must be one of {', '.join(TAGS_MATCH_MODES)}")
    if q.include_entities is not None:
        include.check_budget(q.include_entities, "include.entities.max_tokens",
                             include.MAX_ENTITY_TOKENS)
    if q.include_documents is not None:
        include.check_budget(q.include_documents, "include.documents.max_tokens",
                             include.MAX_DOCUMENT_TOKENS)


def recall(q: RecallQuery, *, vectors: VectorStore, text: TextStore, graph: GraphStore,
           embedder: Embedder, analyzer: QueryAnalyzer, tokens: TokenCounter,
           executor: Executor | None = None,
           reranker: Callable[[str, list[Scored]], list[Scored]] | None = None,
           documents: DocumentStore | None = None) -> RecallOutcome:
    """Recall the bank's facts that matter for ``q.query``, best first, within
    ``q.max_tokens`` (0 → :data:`DEFAULT_MAX_TOKENS`) tokens of fact text.

    Each result carries per-arm raw ``scores`` and 1-based ``ranks`` (keys in
    :data:`ARMS`), the fused ``rrf`` score, the ``boost`` and the ``final`` score. The
    outcome also returns the time window parsed from the query (None if none). ``rrf`` is
    the fused score times ``question_factor`` (0.5 for a fact that only asks).

    ``executor`` runs the arms concurrently (default: a shared module pool); tasks never
    block on each other, but do not pass the pool that is running this call if it can be
    saturated by callers. Raises ValueError("<field>: ...") for invalid requests; store
    errors propagate.

    ``q.include_entities`` / ``q.include_documents`` (token budgets, None: off) add the
    outcome's ``entities`` and ``documents`` (:mod:`services.search.include`; the
    documents from ``documents``, the document projection).
    """
    validate(q)
    from mneme.stores.filters import fact_matches  # lazy: adapters are optional at import

    ex = executor or _default_executor()
    budget = BUDGETS[q.budget]
    n = budget.candidates
    filters = q.filters
    if not filters.tags_match:
        filters = replace(filters, tags_match="any")
    now = utc(q.query_timestamp)

    deadline = q.deadline or current_deadline()

    def wait(f, phase: str):
        # The caller's deadline bounds every wait; an abandoned call stops between phases.
        try:
            return f.result(timeout=deadline.remaining())
        except FutureTimeout:
            f.cancel()
            deadline.check(f"recall: {phase}")
            raise DeadlineExceeded(f"recall: {phase}: deadline exceeded; work stopped") from None

    deadline.check("recall")
    # Phase 1: everything that depends only on the query.
    f_vec = ex.submit(lambda: embedder.embed([q.query])[0])
    # Each store is asked for one hit more than the arm keeps: a tie across the n-th
    # place shows that the store chose among equals (see _by_score).
    f_kw = ex.submit(text.search, q.bank_id, q.query, n + 1, filters)
    f_ents = ex.submit(_query_entities, graph, analyzer, q.bank_id, q.query)
    # "yesterday" is a date of the asker's calendar (q.time_zone), as at retain
    f_win = ex.submit(analyzer.time_window, q.query, wall_clock(now, q.time_zone))

    # Phase 2: the vector arms (need the query embedding and the window).
    vec = wait(f_vec, "query embedding")
    window = wait(f_win, "time window")
    deadline.check("recall: vector arms")
    f_sem = ex.submit(vectors.search, q.bank_id, vec, n + 1, filters)
    f_tmp = ex.submit(_temporal_arm, vectors, q.bank_id, vec, n, filters, window)

    # Phase 3: graph, seeded by the best semantic and keyword hits (runs here, alongside
    # the temporal arm).
    semantic, keyword = wait(f_sem, "semantic arm"), wait(f_kw, "keyword arm")
    entity_ids = wait(f_ents, "query entities")
    deadline.check("recall: graph arm")
    # Hydrated now (all of them: their ties are ordered by where they were told, and the
    # seeds are passages, which may span several facts); read once for the whole recall.
    head = list(dict.fromkeys(h.id for hits in (semantic, keyword) for h in hits))
    facts = {f.id: f for f in vectors.get(q.bank_id, head)} if head else {}
    ties = {i: tie_key(f) for i, f in facts.items()}
    semantic, keyword = _by_score(semantic, ties, n), _by_score(keyword, ties, n)
    seeds = _seeds(semantic, keyword, {i: passage_of(f) for i, f in facts.items()})
    graph_hits: list[Hit] = []
    if seeds or entity_ids:
        graph_hits = graph.spread(q.bank_id, seeds, entity_ids, n + 1, budget.hops)
    temporal = wait(f_tmp, "temporal arm")
    deadline.check("recall: fusion")

    arms = {"semantic": semantic, "keyword": keyword, "graph": graph_hits, "temporal": temporal}
    candidates = list(dict.fromkeys(h.id for hits in arms.values() for h in hits))
    if not candidates:
        return RecallOutcome(results=[], total_tokens=0, time_window=window)
    rest = [i for i in candidates if i not in facts]
    for f in (vectors.get(q.bank_id, rest) if rest else ()):
        facts[f.id], ties[f.id] = f, tie_key(f)
    arms["graph"] = _by_score(graph_hits, ties, n)
    arms["temporal"] = _by_score(temporal, ties)  # cut by cosine in _temporal_arm
    rankings = {arm: [h.id for h in hits] for arm, hits in arms.items()}
    fused = rrf(rankings, k=RRF_K, passage={f.id: passage_of(f) for f in facts.values()},
                order=ties)

    # arm → id → (1-based rank, raw score); the first (best) occurrence wins, as in rrf().
    per_arm: dict[str, dict[str, tuple[int, float]]] = {}
    for arm, hits in arms.items():
        index = per_arm[arm] = {}
        for rank, h in enumerate(hits, start=1):
            index.setdefault(h.id, (rank, h.score))
    results: list[Scored] = []
    for doc, score in fused:
        fact = facts.get(doc)
        # Stores may not push every filter down (and a stale index may name a deleted
        # unit), so the hydrated payload is the final word; never leak another bank.
        if fact is None or fact.bank_id != q.bank_id or not fact_matches(fact, filters):
            continue
        s = Scored(fact=fact, rrf=score * question_factor(fact))
        for arm, index in per_arm.items():
            if doc in index:
                s.ranks[arm], s.scores[arm] = index[doc]
        s.boost = (recency_boost(fact, now) + temporal_proximity_boost(fact, window)
                   + proof_boost(_proof_count(fact)))
        s.final = s.rrf + s.boost
        results.append(s)
    reply_share(results)
    # Stable sort: equal finals keep RRF's deterministic order.
    results.sort(key=lambda s: -s.final)
    results = rerank_head(results, entity_ids, labels=answer_labels(q.query),
                          listing=asks_for_list(q.query))
    if reranker is not None:  # a cross-encoder reorders the fused head (mneme.llm.rerank)
        deadline.check("recall: rerank")
        results = reranker(q.query, results)
    deadline.check("recall: token budget")
    kept, total = fill_budget(results, q.max_tokens or DEFAULT_MAX_TOKENS, tokens)
    out = RecallOutcome(results=kept, total_tokens=total, time_window=window)
    if q.include_entities is not None:
        deadline.check("recall: include entities")
        out.entities = include.entities(kept, q.include_entities, bank_id=q.bank_id,
                                        filters=filters, vectors=vectors, query_vector=vec,
                                        tokens=tokens)
    if q.include_documents is not None:
        deadline.check("recall: include documents")
        out.documents = include.documents(kept, q.include_documents, bank_id=q.bank_id,
                                          filters=filters, store=documents, vectors=vectors,
                                          tokens=tokens)
    return out


# ---- arms ---------------------------------------------------------------------------------


def _by_score(hits: list[Hit], order: Mapping[str, tuple], limit: int | None = None) -> list[Hit]:
    """``hits`` best first: by score (rounded to 6 places: stores differ in the last bits;
    NaN last), ties by ``order`` (id → :func:`mneme.retrieval.tie_key` of the hydrated
    facts, as :func:`mneme.retrieval.rrf` takes it; hits without one, e.g. of a stale
    index, after those with one, by id). Not by the store's
    order, which may depend on its write history, nor by the random id alone: the same
    content retained twice, or replayed, ranks the same.

    ``limit``: at most that many are kept, from a store asked for ``limit`` + 1. When the
    hits at places ``limit`` and ``limit`` + 1 tie, the store chose which of a larger group
    of equals to return by its own order, so that whole tie group is dropped, even when
    it is every hit: an arbitrary subset of equals would rank differently in each copy
    of the bank, and its ranks say nothing the arm knows. The graph arm's activations
    tie often (every unit one hop from seeds of one rank)."""
    def score(h: Hit) -> float:
        return -round(h.score, 6) if h.score == h.score else math.inf

    def key(h: Hit):
        tie = order.get(h.id)
        return (score(h), (0, tie) if tie is not None else (1, h.id))
    out = sorted(hits, key=key)
    if limit is None or len(out) <= limit:
        return out
    if limit <= 0:
        return []
    edge = score(out[limit])
    return [h for h in out[:limit] if score(h) != edge]


def _query_entities(graph: GraphStore, analyzer: QueryAnalyzer, bank_id: str,
                    query: str) -> list[str]:
    """Ids of the bank's entities the query mentions (by canonical key)."""
    keys = analyzer.entity_keys(query)
    if not keys:
        return []
    return [e.id for e in graph.find_entities(bank_id, keys)]


def _seeds(semantic: list[Hit], keyword: list[Hit],
           passage: Mapping[str, Hashable] | None = None) -> dict[str, float]:
    """Seed activations for the graph arm from the hits of the top :data:`GRAPH_SEEDS`
    passages of each arm (``passage``: id → passage, as :func:`mneme.retrieval.rrf`
    takes it; an id not in it is a passage of its own): 1.0 at rank 1 falling by 0.05 a
    rank (0.55 at rank 10; rank, not raw score, because cosine and BM25 are on different
    scales); the facts of one passage share its rank, and a unit in both arms keeps the
    higher value."""
    passage = passage or {}
    seeds: dict[str, float] = {}
    for hits in (semantic, keyword):
        ranks = passage_ranks(passage.get(h.id, ("id", h.id)) for h in hits)
        for h, rank in zip(hits, ranks):
            a = 1.0 - 0.05 * (rank - 1)
            if rank > GRAPH_SEEDS or a <= 0.0:
                break
            seeds[h.id] = max(seeds.get(h.id, 0.0), a)
    return seeds


def _intersect(a: TimeWindow | None, b: TimeWindow) -> TimeWindow | None:
    """Intersection of two windows (None bounds are open); None when empty."""
    if a is None:
        return b
    starts = [utc(t) for t in (a.start, b.start) if t is not None]
    ends = [utc(t) for t in (a.end, b.end) if t is not None]
    w = TimeWindow(start=max(starts) if starts else None, end=min(ends) if ends else None)
    if w.start is not None and w.end is not None and w.start > w.end:
        return None
    return w


def _temporal_arm(vectors: VectorStore, bank_id: str, vec: list[float], n: int,
                  filters: Filters, window: TimeWindow | None) -> list[Hit]:
    """Units whose time overlaps ``window`` (intersected with any time filter of the
    request), ranked by (1 + cosine)/2 × fraction of the unit's span inside the window: relevant
    and specific to that time first. Empty when the query names no time. Candidates
    come from the store's time filter, which (like ``fact_matches``) looks at occurred
    times only: a unit known only by ``mentioned_at`` is not a temporal candidate."""
    if window is None:
        return []
    w = _intersect(filters.time_range, window)
    if w is None:
        return []
    hits = vectors.search(bank_id, vec, n + 1, replace(filters, time_range=w))
    if not hits:
        return []
    # The store's time filter may be coarser than ours (or absent): check each unit's span.
    by_id = {f.id: f for f in vectors.get(bank_id, [h.id for h in hits])}
    hits = _by_score(hits, {i: tie_key(f) for i, f in by_id.items()}, n)  # the store's cut
    scored: list[Hit] = []
    for h in hits:
        fact = by_id.get(h.id)
        span = fact_span(fact) if fact is not None else None
        if span is None or not w.overlaps(*span):
            continue
        inside = window_overlap(span[0], span[1], w)
        # Cosine in [-1, 1] mapped to [0, 1] so the product orders sensibly; a unit that
        # only touches the window's edge keeps a tiny positive score.
        scored.append(Hit(id=h.id, score=(1.0 + h.score) / 2.0 * max(inside, 1e-3)))
    scored.sort(key=lambda h: -h.score)
    return scored


def _proof_count(fact: Fact) -> int:
    """An observation's ``proof_count`` from its metadata (plain facts have none → 0)."""
    try:
        return int(fact.metadata.get("proof_count", 0))
    except (TypeError, ValueError):
        return 0
