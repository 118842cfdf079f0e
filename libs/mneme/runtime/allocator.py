"""The C allocator's settings for a long-running server process (glibc malloc only).

glibc gives every thread that allocates an arena of its own, up to 8 per core, and memory
freed in an arena stays there for that arena's threads. A server's threads (gRPC workers,
consumers, the embedding model's) each leave their peaks behind, so a server that
retained for an hour held hundreds of MB that no thread used. Measured on an in-process
fill to 7.6k facts: 438 MB of anonymous RSS with the defaults, 309 MB with two arenas
(glibc's free lists: ~320 MB before, ~150 MB after); `make bench-load` on conv-26, three
pairs: retain and recall no slower.

Set with ``mallopt(3)`` before the worker threads start, unless the operator set it
through glibc's own variable (``MALLOC_ARENA_MAX``, or ``glibc.malloc.arena_max`` in
``GLIBC_TUNABLES``), which then wins. (The embedded graph server gets its own settings:
``graph_falkor.SERVER_MALLOC``.)

Even with two arenas, free chunks inside the heaps keep their pages: glibc gives back
only the top of a heap by itself. :func:`trim_every` calls ``malloc_trim(3)`` from a
background thread, which returns every whole free page (``madvise(MADV_DONTNEED)``):
on a server filling a bank, at ~10k facts, 418 → 380 MB of anonymous memory in one
call; one call over a 200 MB heap took 2-3 ms.
"""

from __future__ import annotations

import ctypes
import logging
import os
import platform
import threading
from typing import Any

log = logging.getLogger(__name__)

#: ``mallopt`` parameter (glibc ``malloc.h``).
M_ARENA_MAX = -8
#: Arenas of a server process: one per core of the 2-core machines this was measured on
#: (fewer arenas strand less memory; more would only ease lock contention).
ARENAS = 2


def _glibc(name: str) -> Any | None:
    """glibc's function ``name`` through ctypes, or None off glibc or in a static or odd
    build (``platform.libc_ver()`` is ("", "") off Linux)."""
    if platform.libc_ver()[0] != "glibc":
        return None
    try:
        return getattr(ctypes.CDLL(None), name)
    except (OSError, AttributeError):
        return None


def tune(arenas: int = ARENAS) -> dict[str, int]:
    """Limit glibc malloc to ``arenas`` arenas in this process.

    Call once, early, before threads that allocate start (arenas already made stay).
    Returns the settings applied, by glibc's variable name: {} on another C library or
    when the environment sets it. Never raises: a failed ``mallopt`` is logged."""
    if "MALLOC_ARENA_MAX" in os.environ or \
            "glibc.malloc.arena_max=" in os.environ.get("GLIBC_TUNABLES", ""):
        return {}
    mallopt = _glibc("mallopt")
    if mallopt is None:  # keep the default
        return {}
    mallopt.argtypes, mallopt.restype = [ctypes.c_int, ctypes.c_int], ctypes.c_int
    if mallopt(M_ARENA_MAX, arenas) != 1:
        log.warning("mallopt(M_ARENA_MAX=%d) failed; glibc's default stays", arenas)
        return {}
    return {"MALLOC_ARENA_MAX": arenas}


def trim_every(interval_s: float) -> threading.Thread | None:
    """Start a daemon thread that calls glibc's ``malloc_trim(0)`` every ``interval_s``
    seconds for the rest of the process; returns it, or None when ``interval_s`` ≤ 0 or
    the C library is not glibc. Never raises: a failed call is logged once and ends the
    thread."""
    malloc_trim = _glibc("malloc_trim") if interval_s > 0 else None
    if malloc_trim is None:
        return None
    malloc_trim.argtypes, malloc_trim.restype = [ctypes.c_size_t], ctypes.c_int

    def run() -> None:
        wake = threading.Event()  # never set: a sleep that is not a busy loop
        while not wake.wait(interval_s):
            try:
                malloc_trim(0)
            except Exception:  # noqa: BLE001 (ctypes: never expected; stop, don't spin)
                log.exception("malloc_trim failed; no more trimming in this process")
                return

    thread = threading.Thread(target=run, name="malloc-trim", daemon=True)
    thread.start()
    return thread
