"""In-process counters of the LLM paths (thread-safe), until mneme's telemetry module
exports them through OpenTelemetry: each name follows the semantic-convention style and
maps 1:1 to an OTel counter with the same attributes.

Names (attributes):

- ``mneme.llm.requests`` {operation, model, outcome: ok|error} — finished calls;
- ``mneme.llm.retries`` {operation, reason: rate_limited|timeout|unavailable} — retried attempts;
- ``mneme.llm.tokens`` {operation, model, direction: input|output} — token counts;
- ``mneme.llm.cost`` {operation, model} — USD (0 for models without a price, e.g. local ones);
- ``mneme.llm.output_errors`` {operation, reason: malformed|schema|truncated} — re-asked replies;
- ``mneme.llm.breaker.opened`` {model} — times an endpoint's circuit breaker opened
  (:mod:`mneme.llm.breaker`; a failed half-open trial opens it again);
- ``mneme.llm.breaker.rejected`` {operation, model} — calls failed at once by an open breaker;
- ``mneme.retain.documents`` {outcome: extracted|no_facts|failed} — LLM extraction per item;
- ``mneme.reflect.invalid_citations`` {} — cited ids dropped because they were never shown;
- ``mneme.rerank.requests`` {outcome: ok|error}.
"""

from __future__ import annotations

import threading
from collections import defaultdict


class Counters:
    """Monotonic counters keyed by (name, sorted attribute items)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._values: dict[tuple, float] = defaultdict(float)

    def add(self, name: str, value: float = 1, **attrs: str) -> None:
        key = (name, tuple(sorted((k, str(v)) for k, v in attrs.items())))
        with self._lock:
            self._values[key] += value

    def get(self, name: str, **attrs: str) -> float:
        """Sum of ``name`` over every series whose attributes include ``attrs``."""
        want = {(k, str(v)) for k, v in attrs.items()}
        with self._lock:
            return sum(v for (n, a), v in self._values.items() if n == name and want <= set(a))

    def snapshot(self) -> dict[tuple, float]:
        with self._lock:
            return dict(self._values)

    def reset(self) -> None:
        with self._lock:
            self._values.clear()


#: The process-wide counters.
METRICS = Counters()
