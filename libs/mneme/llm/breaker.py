"""A circuit breaker per model endpoint, so a model that is down fails calls at once.

Without it every call to a dead endpoint spends the whole timeout on each of its retries:
with the defaults (120 s, 4 retries) about 10 minutes per extraction item, so a 1,000-item
retain held its partition for a day and a half before it ended FAILED.

States (the usual ones; ``pybreaker``/``aiobreaker`` were not installed here, and neither
fits calls that run on the gateway's own event loop but are awaited from worker threads):

- **closed** — calls go through; consecutive *transient* failures (timeouts, connection
  errors, 5xx) are counted, any answer resets the count; the ``failures``-th opens it;
- **open** — calls fail at once (:class:`CircuitOpen`) for ``cooldown_s`` seconds;
- **half-open** — after the cool-down one trial call is let through and the others wait
  for its outcome (at most their own timeout): its success closes the breaker and lets
  them go, its transient failure opens it again for another cool-down (they fail at once),
  any other outcome (a 4xx, the caller's cancel) makes the next of them the trial. Waiting
  rather than failing matters after an outage: a retried batch's concurrent items would
  otherwise fail beside the one trial that found the model healthy again.

What counts is the caller's decision (:meth:`CircuitBreaker.failure` vs
:meth:`CircuitBreaker.release`): rejections, malformed answers and the caller's own
cancellation or deadline say nothing about the endpoint's health. Thread-safe.
"""

from __future__ import annotations

import logging
import threading
import time
from typing import Callable

log = logging.getLogger("mneme.llm")

CLOSED, OPEN, HALF_OPEN = "closed", "open", "half_open"


class CircuitOpen(Exception):
    """The endpoint's breaker is open: the call was not made."""


class CircuitBreaker:
    """The breaker of one endpoint ``name`` (for logs and errors). ``failures`` consecutive
    transient failures open it for ``cooldown_s`` seconds (``clock`` is monotonic seconds,
    injectable for tests); ``failures`` or ``cooldown_s`` of 0 disables it (every call
    goes through, nothing is counted). ``on_open(name)`` is called on each opening."""

    def __init__(self, name: str, failures: int, cooldown_s: float,
                 clock: Callable[[], float] = time.monotonic,
                 on_open: Callable[[str], None] | None = None) -> None:
        self.name, self.threshold, self.cooldown_s = name, failures, cooldown_s
        self.enabled = failures > 0 and cooldown_s > 0
        self._clock, self._on_open = clock, on_open
        self._lock = threading.Lock()
        self._changed = threading.Condition(self._lock)  # a trial's outcome is known
        self._state = CLOSED
        self._count = 0  # consecutive transient failures while closed
        self._until = 0.0  # while open: when the trial call may go
        self._trial = False  # half-open: the trial call is under way
        self._last = ""  # reason of the failure that opened it

    def acquire(self, wait_s: float = 0.0, check: Callable[[], None] | None = None) -> bool:
        """Admit one call: returns True when it is the half-open trial (pass that to
        :meth:`success`/:meth:`failure`/:meth:`release`). While a trial is under way it
        waits up to ``wait_s`` seconds (real time) for its outcome, calling ``check()``
        every quarter second (it raises to stop waiting: the caller's cancel). Raises
        CircuitOpen (with what happened and when calls go again) when the breaker is open
        or the trial outlasted ``wait_s``."""
        if not self.enabled:
            return False
        end = time.monotonic() + wait_s
        with self._lock:
            while True:
                if self._state == OPEN and self._clock() >= self._until:
                    self._state, self._trial = HALF_OPEN, False
                    log.info("model endpoint %s: cool-down over, letting one trial call "
                             "through", self.name)
                if self._state == CLOSED:
                    return False
                if self._state == HALF_OPEN and not self._trial:
                    self._trial = True
                    return True
                left = end - time.monotonic()
                if self._state == OPEN or left <= 0:
                    raise CircuitOpen(self._describe())
                self._changed.wait(min(left, 0.25))
                if check is not None:
                    check()

    def admits(self) -> bool:
        """Whether :meth:`acquire` would admit a call now (changes nothing): a retry
        loop stops early when it would not."""
        if not self.enabled:
            return True
        with self._lock:
            return (self._state == CLOSED or (self._state == OPEN and self._clock() >= self._until)
                    or (self._state == HALF_OPEN and not self._trial))

    def success(self, trial: bool) -> None:
        """The endpoint answered: the breaker closes (count reset)."""
        if not self.enabled:
            return
        with self._lock:
            if self._state != CLOSED:
                log.warning("model endpoint %s answered again: circuit closed", self.name)
            self._state, self._count, self._trial = CLOSED, 0, False
            self._changed.notify_all()

    def failure(self, trial: bool, reason: str) -> None:
        """A transient failure (``reason``: timeout, unavailable) of an admitted call:
        counted while closed, reopens after a failed trial; a failure of a call admitted
        before the breaker opened changes nothing."""
        if not self.enabled:
            return
        with self._lock:
            if self._state == CLOSED:
                self._count += 1
                if self._count < self.threshold:
                    return
            elif not (trial and self._state == HALF_OPEN):
                return
            self._state, self._trial, self._last = OPEN, False, reason
            self._until = self._clock() + self.cooldown_s
            self._changed.notify_all()
            msg = self._describe()
        log.warning("model endpoint %s: %s", self.name, msg)
        if self._on_open is not None:
            self._on_open(self.name)

    def release(self, trial: bool) -> None:
        """An outcome that says nothing about the endpoint's health (a 4xx, a malformed
        answer, the caller's cancel or deadline): a trial's slot is freed, nothing counted."""
        if trial:
            with self._lock:
                self._trial = False
                self._changed.notify_all()

    def state(self) -> str:
        """``closed``, ``open`` (calls fail at once) or ``half_open`` (the cool-down is
        over: the next call is the trial)."""
        with self._lock:
            if self._state == OPEN and self._clock() >= self._until:
                return HALF_OPEN
            return self._state

    def describe(self) -> str:
        """One line for an operator: the state and, when open, why and for how long."""
        with self._lock:
            return self._describe()

    def _describe(self) -> str:
        if self._state == CLOSED:
            return "circuit closed"
        if self._state == HALF_OPEN and self._trial:
            return f"circuit half-open (last failure: {self._last}): a trial call is under way"
        left = self._until - self._clock()
        if self._state == HALF_OPEN or left <= 0:
            return "circuit half-open: the next call is a trial"
        return (f"circuit open after consecutive failures (last: {self._last}): calls fail "
                f"at once for another {left:.1f} s")


__all__ = ["CLOSED", "HALF_OPEN", "OPEN", "CircuitBreaker", "CircuitOpen"]
