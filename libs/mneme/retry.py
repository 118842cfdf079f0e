"""mneme's retry policies as tenacity building blocks (waits and stop conditions).

Every retry loop of mneme is a :class:`tenacity.Retrying` (or ``AsyncRetrying``) made of
these parts and tenacity's own (``stop_after_attempt``, ``stop_after_delay``,
``stop_when_event_set``, ``sleep_using_event``, ``wait_fixed``), so a policy reads as one
declaration instead of a hand-written loop. All durations are seconds.

* :class:`backoff` — exponential backoff with a cap and optional jitter;
* :class:`at_least_hint` — a wait raised to a server's hint (``Retry-After``), capped;
* :class:`within_deadline` — a wait cut to what is left of a :class:`mneme.deadline.Deadline`;
* :class:`stop_on_deadline` — stop once a deadline has passed or its caller went away.

Importing this module imports tenacity: a few ms beyond the standard modules mneme loads
anyway (logging, inspect, concurrent.futures); not asyncio.
"""

from __future__ import annotations

import random
from typing import Callable

import tenacity
from tenacity import RetryCallState

from mneme.deadline import Deadline


class backoff(tenacity.wait.wait_base):  # noqa: N801 - named like tenacity's waits
    """Exponential backoff: before retry *n* (n = 1 after the first failed attempt) wait
    ``min(cap, base * 2**(n-1))`` seconds, multiplied by a factor drawn uniformly from
    ``[1 - jitter, 1 + jitter]`` (``jitter`` 0: exactly that; 0.2: ±20 %, so many
    workers retrying at once spread out). ``uniform(a, b)`` is injectable for tests.

    Raises ValueError for a negative ``base``/``cap`` or a ``jitter`` outside [0, 1]."""

    def __init__(self, base: float, cap: float, jitter: float = 0.0,
                 uniform: Callable[[float, float], float] = random.uniform) -> None:
        if base < 0 or cap < 0:
            raise ValueError(f"backoff base and cap must be >= 0, got {base}, {cap}")
        if not 0.0 <= jitter <= 1.0:
            raise ValueError(f"jitter must be within [0, 1], got {jitter}")
        self.base, self.cap, self.jitter, self._uniform = base, cap, jitter, uniform

    def delay(self, retry: int) -> float:
        """Seconds to wait before retry number ``retry`` (1-based)."""
        wait = min(self.cap, self.base * 2 ** (retry - 1))
        if self.jitter:
            wait *= self._uniform(1.0 - self.jitter, 1.0 + self.jitter)
        return wait

    def __call__(self, retry_state: RetryCallState) -> float:
        return self.delay(retry_state.attempt_number)


class at_least_hint(tenacity.wait.wait_base):  # noqa: N801
    """``wait``, raised to the seconds ``hint(exception)`` of the failed attempt asks for
    (e.g. an HTTP ``Retry-After``; None: no hint), never above ``cap`` when hinted."""

    def __init__(self, wait: tenacity.wait.wait_base,
                 hint: Callable[[BaseException], float | None], cap: float) -> None:
        self.wait, self.hint, self.cap = wait, hint, cap

    def __call__(self, retry_state: RetryCallState) -> float:
        wait = self.wait(retry_state)
        outcome = retry_state.outcome
        exc = outcome.exception() if outcome is not None and outcome.failed else None
        hinted = self.hint(exc) if exc is not None else None
        return wait if hinted is None else min(self.cap, max(wait, hinted))


class within_deadline(tenacity.wait.wait_base):  # noqa: N801
    """``wait``, cut to the seconds left before ``deadline`` (unchanged without one), so
    a retry never sleeps past the time its caller waits for the answer."""

    def __init__(self, wait: tenacity.wait.wait_base, deadline: Deadline) -> None:
        self.wait, self.deadline = wait, deadline

    def __call__(self, retry_state: RetryCallState) -> float:
        wait = self.wait(retry_state)
        left = self.deadline.remaining()
        return wait if left is None else min(wait, left)


class stop_on_deadline(tenacity.stop.stop_base):  # noqa: N801
    """Stop retrying once ``deadline`` has expired or its caller was cancelled (a
    deadline without expiry and activity check never stops)."""

    def __init__(self, deadline: Deadline) -> None:
        self.deadline = deadline

    def __call__(self, retry_state: RetryCallState) -> bool:
        return self.deadline.cancelled() or self.deadline.remaining() == 0.0


__all__ = ["at_least_hint", "backoff", "stop_on_deadline", "within_deadline"]
