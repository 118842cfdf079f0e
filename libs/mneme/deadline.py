"""Deadlines and cancellation for one request's work, independent of the transport.

A transport builds a :class:`Deadline` from its call (gRPC: ``context.time_remaining()``
and ``context.is_active()``); the work checks it between phases and inside loops
(``deadline.check("recall: graph arm")``) and stops with
:class:`mneme.errors.DeadlineExceeded` or :class:`mneme.errors.Cancelled` once the
caller no longer waits, so an abandoned request stops using CPU and memory.
"""

from __future__ import annotations

import contextlib
import contextvars
import time
from typing import Callable

from mneme.errors import Cancelled, DeadlineExceeded


class Deadline:
    """``expires``: :func:`time.monotonic` seconds after which the work is pointless
    (None: no deadline); ``active``: False once the caller has gone (cancelled)."""

    __slots__ = ("expires", "_active")

    def __init__(self, expires: float | None = None,
                 active: Callable[[], bool] | None = None) -> None:
        self.expires, self._active = expires, active

    @classmethod
    def after(cls, seconds: float | None, active: Callable[[], bool] | None = None) -> "Deadline":
        """A deadline ``seconds`` from now (None: none)."""
        return cls(None if seconds is None else time.monotonic() + seconds, active)

    def remaining(self) -> float | None:
        """Seconds left (never negative, at most a day: waits take it as a timeout),
        None without a deadline."""
        if self.expires is None:
            return None
        return min(max(0.0, self.expires - time.monotonic()), 86_400.0)

    def cancelled(self) -> bool:
        """True once the caller has gone away."""
        return self._active is not None and not self._active()

    def check(self, what: str = "the request") -> None:
        """Raise Cancelled when the caller went away, DeadlineExceeded when time is up."""
        if self._active is not None and not self._active():
            raise Cancelled(f"{what}: the call was cancelled; work stopped")
        if self.expires is not None and time.monotonic() >= self.expires:
            raise DeadlineExceeded(f"{what}: deadline exceeded; work stopped")


#: No deadline, never cancelled.
NONE = Deadline()


_current: "contextvars.ContextVar[Deadline]" = contextvars.ContextVar("mneme_deadline",
                                                                     default=NONE)


def current() -> Deadline:
    """The deadline of the request this thread is serving (:data:`NONE` outside one), for
    work deep in a call tree (the reflect loop, its recalls) that is not handed one."""
    return _current.get()


@contextlib.contextmanager
def bind(deadline: Deadline):
    """Make ``deadline`` :func:`current` for the block (a transport wraps each call)."""
    token = _current.set(deadline)
    try:
        yield deadline
    finally:
        _current.reset(token)
