"""The data directory's lock: one mneme process per data directory, since the embedded
stores (SQLite files, Qdrant Edge, Tantivy, FalkorDB) are single-process."""

from __future__ import annotations

import fcntl
import os
from pathlib import Path


class DataDirLocked(RuntimeError):
    """Another process holds the data directory (the embedded stores are single-process)."""


def lock(data_dir: Path) -> int:
    """Hold ``data_dir/LOCK`` exclusively (``flock``) for this process; returns the file
    descriptor to pass to :func:`unlock`. Raises DataDirLocked when another process
    holds it."""
    fd = os.open(data_dir / "LOCK", os.O_RDWR | os.O_CREAT, 0o644)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        os.close(fd)
        raise DataDirLocked(f"{data_dir} is in use by another mneme process "
                            "(stop `mneme up` first)") from None
    return fd


def unlock(fd: int) -> None:
    """Release a lock :func:`lock` took."""
    os.close(fd)
