"""Locks by key, for a check-then-append on one id that must be one step in a process."""

from __future__ import annotations

import contextlib
import threading
import weakref
from typing import Hashable, Iterator


class KeyedLocks:
    """One lock per key, made on first use and gone with its last holder (a weak
    mapping), so callers of different keys never wait for each other. Thread-safe."""

    def __init__(self) -> None:
        self._locks: weakref.WeakValueDictionary = weakref.WeakValueDictionary()
        self._guard = threading.Lock()

    @contextlib.contextmanager
    def hold(self, key: Hashable) -> Iterator[None]:
        """Held by one caller at a time per ``key``."""
        with self._guard:
            lock = self._locks.setdefault(key, threading.Lock())
        with lock:
            yield
