"""Recall's optional cross-encoder (DESIGN §5): reorder the fused head with
``litellm.rerank`` when ``MNEME_RERANK_MODEL`` is set; otherwise fusion order stands.

Where it sits: after fusion and boosts (the list recall sorted by ``final``), before the
token-budget fill, so the budget keeps what the cross-encoder rates highest. Only the
first ``MNEME_RERANK_HEAD`` candidates are scored (a cross-encoder costs a forward pass
per document); the tail keeps its order after the head. Any rerank failure leaves the
order unchanged: recall must answer even when the reranker is down.
"""

from __future__ import annotations

import logging
from typing import Sequence

from mneme.domain import Scored
from mneme.llm.gateway import LlmError, Usage
from mneme.llm.metrics import METRICS
from mneme.ports import Llm

log = logging.getLogger("mneme.llm.rerank")


class Reranker:
    """``reranker(query, results) -> results`` (see the module docs). ``gateway`` None
    or without a rerank model makes it the identity (and litellm is never imported).
    ``last_usage`` is the usage of the latest call (for tracing)."""

    def __init__(self, gateway: Llm | None):
        self.gateway = gateway
        self.head = gateway.settings.rerank_head if gateway is not None else 0
        self.last_usage = Usage()

    @property
    def enabled(self) -> bool:
        return self.gateway is not None and self.gateway.configured("rerank")

    def __call__(self, query: str, results: Sequence[Scored]) -> list[Scored]:
        return rerank(query, results, self.gateway, head=self.head, sink=self)


def rerank(query: str, results: Sequence[Scored], gateway: Llm | None, *,
           head: int | None = None, sink: Reranker | None = None) -> list[Scored]:
    """``results`` with their first ``head`` (default ``MNEME_RERANK_HEAD``) items
    reordered by cross-encoder relevance to ``query``, best first; the rest follow in
    their order. Each reranked item gets ``scores["rerank"]`` (the model's relevance,
    higher is better) and ``ranks["rerank"]`` (1-based); ``final`` is left as fusion
    computed it. Without a rerank model, or when the call fails, returns ``list(results)``
    unchanged. Never raises for model errors."""
    out = list(results)
    if gateway is None or not gateway.configured("rerank") or len(out) < 2 or not query.strip():
        return out
    n = head or gateway.settings.rerank_head
    top, tail = out[:n], out[n:]
    try:
        ranked, usage = gateway.rerank(query, [s.fact.text for s in top], top_n=len(top))
    except LlmError as e:
        METRICS.add("mneme.rerank.requests", outcome="error")
        log.warning("rerank failed, keeping fusion order: %s", e)
        return out
    if sink is not None:
        sink.last_usage = usage
    seen: set[int] = set()
    reordered: list[Scored] = []
    for rank, (i, score) in enumerate(ranked, start=1):
        if 0 <= i < len(top) and i not in seen:
            seen.add(i)
            top[i].scores["rerank"] = score
            top[i].ranks["rerank"] = rank
            reordered.append(top[i])
    # a server that returned fewer results than asked: the unscored keep fusion order
    reordered += [s for i, s in enumerate(top) if i not in seen]
    METRICS.add("mneme.rerank.requests", outcome="ok")
    return reordered + tail
