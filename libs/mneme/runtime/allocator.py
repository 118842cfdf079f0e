"""The C allocator's settings for a long-running server process (glibc malloc only).

Two glibc defaults make a server that retains for hours hold far more memory than it uses
(measured on an in-process 7.6k-fact fill: anonymous RSS 438 MB with the defaults, 309 MB
with two arenas, 316 MB with a fixed mmap threshold; glibc's own free lists held ~320 MB):

* every thread that allocates gets its own arena, up to 8 per core, and freed memory stays
  in the arena it came from;
* the mmap threshold rises to the size of each large block freed (up to 32 MiB), so the
  embedding model's per-batch buffers of a few MiB move from mmap (returned to the OS on
  free) into the arenas, where they fragment.

Both are set with ``mallopt(3)`` before the worker threads start, unless the operator set
them through glibc's own variables (``MALLOC_ARENA_MAX``, ``MALLOC_MMAP_THRESHOLD_``, or
``glibc.malloc.arena_max`` / ``glibc.malloc.mmap_threshold`` in ``GLIBC_TUNABLES``), which
then win. (The embedded graph server gets its own settings: ``graph_falkor.SERVER_MALLOC``.)
"""

from __future__ import annotations

import ctypes
import logging
import os
import platform

log = logging.getLogger(__name__)

#: ``mallopt`` parameters (glibc ``malloc.h``).
M_MMAP_THRESHOLD = -3
M_ARENA_MAX = -8
#: Arenas of a server process: one per core of the 2-core machines this was measured on
#: (fewer arenas, less memory stranded in them; more would only ease lock contention).
ARENAS = 2
#: Blocks of at least this many bytes are mmapped and unmapped on free (glibc's initial
#: threshold, kept fixed: ``mallopt`` turns the dynamic threshold off).
MMAP_THRESHOLD = 128 * 1024


def tune(arenas: int = ARENAS, mmap_threshold: int = MMAP_THRESHOLD) -> dict[str, int]:
    """Set glibc malloc's arena count and a fixed mmap threshold (bytes) for this process.

    Call once, early, before threads that allocate start (arenas already made stay).
    Returns the settings applied, by glibc's variable name ({} on another C library, or
    when the environment sets both). Never raises: a failed ``mallopt`` is logged."""
    if platform.system() != "Linux" or platform.libc_ver()[0] != "glibc":
        return {}
    try:
        libc = ctypes.CDLL(None)
        mallopt = libc.mallopt
    except (OSError, AttributeError):  # a static or odd build: keep the defaults
        return {}
    mallopt.argtypes, mallopt.restype = [ctypes.c_int, ctypes.c_int], ctypes.c_int
    applied = {}
    tunables = os.environ.get("GLIBC_TUNABLES", "")
    for env, tunable, param, value in (
            ("MALLOC_ARENA_MAX", "glibc.malloc.arena_max", M_ARENA_MAX, arenas),
            ("MALLOC_MMAP_THRESHOLD_", "glibc.malloc.mmap_threshold", M_MMAP_THRESHOLD,
             mmap_threshold)):
        if env in os.environ or tunable + "=" in tunables:
            continue
        if mallopt(param, value) == 1:
            applied[env] = value
        else:
            log.warning("mallopt(%s=%d) failed; glibc's default stays", env, value)
    return applied
