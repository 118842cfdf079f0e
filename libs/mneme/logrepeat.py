"""Repeated client-library log lines, summarised.

With the brokers away, aiokafka logs an error for every reconnect attempt of every
client (a process has a dozen: producer, admin, metadata, one consumer per group), every
~100 ms: thousands of lines a minute that bury mneme's own messages and fill the log
pipeline. :class:`RepeatLimiter` lets the first of each message (logger + template) through,
drops its repeats for ``window_s`` seconds, and then lets the next one through with how
many it dropped meanwhile. mneme's own loggers are left alone.
"""

from __future__ import annotations

import logging
import threading
import time
from typing import Callable

#: Loggers whose repeats are summarised (their children too).
NOISY = ("aiokafka", "faststream")


class RepeatLimiter(logging.Filter):
    """A handler filter: a warning or error of a :data:`NOISY` logger whose (logger, template) was
    let through less than ``window_s`` seconds ago is dropped and counted; the next one
    after the window gets ``" (N more like it in the last W s)"`` appended to its
    message. ``clock``: seconds (monotonic); a parameter for tests."""

    def __init__(self, window_s: float = 30.0,
                 clock: Callable[[], float] = time.monotonic) -> None:
        super().__init__()
        self.window_s = window_s
        self.clock = clock
        self._seen: dict[tuple[str, str], tuple[float, int]] = {}  # → (let through at, dropped)
        self._lock = threading.Lock()

    def filter(self, record: logging.LogRecord) -> bool:
        if record.levelno < logging.WARNING or not record.name.startswith(NOISY):
            return True  # its INFO lines (a group's coordinator, assignments) are few
        key, now = (record.name, str(record.msg)), self.clock()
        with self._lock:
            at, dropped = self._seen.get(key, (None, 0))
            if at is not None and now - at < self.window_s:
                self._seen[key] = (at, dropped + 1)
                return False
            self._seen[key] = (now, 0)
            if len(self._seen) > 1000:  # templates are few; bound it anyway
                self._seen = {key: (now, 0)}
        if dropped:
            record.msg = f"{record.msg} ({dropped} more like it in the last " \
                         f"{self.window_s:.0f} s)"
        return True


def limit_repeats(window_s: float = 30.0) -> None:
    """Add a :class:`RepeatLimiter` to every handler of the root logger (after
    ``logging.basicConfig``); adding it twice changes nothing."""
    for handler in logging.getLogger().handlers:
        if not any(isinstance(f, RepeatLimiter) for f in handler.filters):
            handler.addFilter(RepeatLimiter(window_s))


__all__ = ["NOISY", "RepeatLimiter", "limit_repeats"]
