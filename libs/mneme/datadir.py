"""The data directory's lock (one mneme process per data directory, since the embedded
stores -- SQLite files, Qdrant Edge, Tantivy, FalkorDB -- are single-process) and the
replica id its state goes by."""

from __future__ import annotations

import fcntl
import os
import re
import secrets
import socket
from pathlib import Path

_REPLICA_FILE = "replica-id"


class DataDirLocked(RuntimeError):
    """Another process holds the data directory (the embedded stores are single-process)."""


def lock(data_dir: Path) -> int:
    """Hold ``data_dir/LOCK`` exclusively (``flock``) for this process; returns the file
    descriptor to pass to :func:`unlock`. Raises DataDirLocked when another process
    holds it."""
    return hold(data_dir / "LOCK", DataDirLocked(
        f"{data_dir} is in use by another mneme process (stop its `mneme up` or `mneme "
        "serve` first)"))


def hold(path: str | Path, refused: DataDirLocked) -> int:
    """Hold the file ``path`` (created if missing) exclusively with ``flock`` until its
    descriptor, returned, is closed (:func:`unlock`); raises ``refused`` when another
    process holds it. The kernel releases it when the process dies, however it dies."""
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        os.close(fd)
        raise refused from None
    return fd


def unlock(fd: int) -> None:
    """Release a lock :func:`lock` took."""
    os.close(fd)


def replica_id(data_dir: Path, name: str | None = None) -> str:
    """The id of the state in ``data_dir``: ``<name>-<8 hex>``, made once when the
    directory holds none and kept in ``data_dir/replica-id``. ``name`` is the replica's
    name (``MNEME_REPLICA_ID``, e.g. the pod name; default the host name), reduced to
    ``[a-z0-9-]``, at most 40 characters.

    Why the random part: a consumer group that keeps a replica's own copy of a projection
    (``<group>.<replica id>``) must start from offset 0 whenever that copy starts empty.
    A fresh data dir gets a fresh id, hence a fresh group; a restarted process on the same
    dir resumes where its copy stopped."""
    path = data_dir / _REPLICA_FILE
    try:
        known = path.read_text().strip()
    except FileNotFoundError:
        known = ""
    if known:
        return known
    base = re.sub(r"[^a-z0-9-]+", "-", (name or socket.gethostname() or "mneme").lower())
    rid = f"{base.strip('-')[:40] or 'mneme'}-{secrets.token_hex(4)}"
    write_atomic(path, rid + "\n")
    return rid


def write_atomic(path: Path, text: str) -> None:
    """Replace ``path``'s content with ``text`` in one step (a temporary file renamed over
    it), so a crash leaves the old content or the new one, never half of it."""
    tmp = path.with_suffix(path.suffix + ".tmp")
    tmp.write_text(text)
    os.replace(tmp, path)
