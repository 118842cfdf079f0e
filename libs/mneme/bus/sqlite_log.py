"""The embedded event log: Kafka's model (topics, partitions, offsets, consumer groups)
in one SQLite file.

Layout (schema version 1, ``PRAGMA user_version``)::

    topics        (name PK, partitions)
    records       (topic, partition, offset, key, value BLOB, headers JSON, timestamp)
                  PRIMARY KEY (topic, partition, offset)
    group_offsets (group, topic, partition, next_offset)
                  PRIMARY KEY (group, topic, partition)

Guarantees:

* Offsets are dense per (topic, partition), starting at 0; one key always maps to one
  partition (:func:`mneme.bus.partition_for`), so one key's records keep append order.
* Durable: WAL journal with ``synchronous=FULL``, so an ``append``/``commit`` that
  returned survives SIGKILL and power loss (the WAL is fsynced at every commit).
* ``append`` is atomic for the whole batch; ``commit`` appends its ``produce`` records
  and moves the group's offsets in one transaction (exactly-once for consumers whose
  effects are all events on this log).
* Safe for many threads (one writer connection behind a lock shared by every instance
  on the same file in the process, plus one read connection per thread, so reads never
  wait for an fsync) and for several processes on the same file (SQLite file locking:
  writes take ``BEGIN IMMEDIATE``; a busy timeout waits out other writers). The file must
  be on a local filesystem (WAL needs shared memory; not NFS).
* Records are never deleted: there is no retention or compaction (out of scope); the
  file grows with the history, which is what makes replay from offset 0 possible.
  (After :func:`recover` a partition may have gaps where records were lost; readers
  skip them, as Kafka readers skip compacted offsets.)

Integrity: opening checks the file (:func:`check_file`: the SQLite header, the file size
against the page count the header records, then ``PRAGMA quick_check``; about 40 ms per
50 MB with a warm page cache; ``integrity_check`` would also cross-check the index and costs
twice that) and raises :class:`LogDamaged` rather than serve a truncated or garbled log.
Before SQLite touches a log left with frames in its WAL (a kill), :func:`wal_state`
compares the frames the last writer committed (its ``-shm`` wal-index) with those SQLite
will accept: SQLite silently drops every frame from the first bad one, so a WAL cut or
garbled at rest would lose committed writes (and roll back pages already copied into the
file). And a consumer group whose committed offset is past the end of its partition
(:func:`_offsets_problem`) means the log lost records its projections already hold.
A log that becomes damaged while open (SQLite reports SQLITE_CORRUPT / SQLITE_NOTADB, or
:meth:`SqliteEventLog.check` finds the file changed under it) stays damaged: every later
call raises :class:`LogDamaged` at once (gRPC UNAVAILABLE), so writers fail fast instead of
waiting on consumers that cannot read. ``mneme log recover`` (:func:`recover`) copies every
readable record into a new file.

Waiting without busy polling: :meth:`SqliteEventLog.wait_for_append` wakes on a
``threading.Condition`` notified by appends in this process, and polls SQLite's
``PRAGMA data_version`` (changes whenever another connection, in any process, commits)
every ``poll_interval`` seconds for appends by other processes.
"""

from __future__ import annotations

import functools
import json
import logging
import os
import sqlite3
import struct
import sys
import threading
import time
from contextlib import contextmanager, suppress
from dataclasses import dataclass, field
from typing import BinaryIO, Iterator, Sequence

from mneme.bus import StaleCommitError, default_partitions, partition_for
from mneme.errors import Unavailable
from mneme.ports import OutRecord, Record

log = logging.getLogger(__name__)

SCHEMA_VERSION = 1

_SCHEMA = """
CREATE TABLE IF NOT EXISTS topics (
    name        TEXT PRIMARY KEY,
    partitions  INTEGER NOT NULL CHECK (partitions > 0)
);
CREATE TABLE IF NOT EXISTS records (
    topic       TEXT    NOT NULL,
    "partition" INTEGER NOT NULL,
    "offset"    INTEGER NOT NULL,
    key         TEXT    NOT NULL,
    value       BLOB    NOT NULL,
    headers     TEXT    NOT NULL,
    timestamp   REAL    NOT NULL,
    PRIMARY KEY (topic, "partition", "offset")
);
CREATE TABLE IF NOT EXISTS group_offsets (
    "group"     TEXT    NOT NULL,
    topic       TEXT    NOT NULL,
    "partition" INTEGER NOT NULL,
    next_offset INTEGER NOT NULL,
    PRIMARY KEY ("group", topic, "partition")
);
"""

_END_SQL = 'SELECT MAX("offset") FROM records WHERE topic = ? AND "partition" = ?'
_INSERT_SQL = ('INSERT INTO records (topic, "partition", "offset", key, value, headers, '
               'timestamp) VALUES (?, ?, ?, ?, ?, ?, ?)')
_READ_SQL = ('SELECT "offset", key, value, headers, timestamp FROM records '
             'WHERE topic = ? AND "partition" = ? AND "offset" >= ? '
             'ORDER BY "offset" LIMIT ?')


_MAGIC = b"SQLite format 3\x00"
#: SQLite result codes that mean the file itself is damaged (primary codes).
_DAMAGE_CODES = (sqlite3.SQLITE_CORRUPT, sqlite3.SQLITE_NOTADB)


class LogDamaged(Unavailable):
    """The event log file is damaged (truncated, garbage appended or overwritten, or SQLite
    found a malformed page). ``path`` is the file, ``problem`` what was found. The message
    says what to do: stop mneme, restore the file from a backup, or run ``mneme log
    recover`` (which keeps every intact record). Subclass of
    :class:`mneme.errors.Unavailable`, so the gRPC API answers UNAVAILABLE."""

    def __init__(self, path: str, problem: str) -> None:
        self.path, self.problem = path, problem
        data_dir = os.path.dirname(path) or "."
        super().__init__(
            f"event log {path} is damaged: {problem}. Stop mneme, then restore the file "
            f"from a backup or run `mneme log recover --data-dir {data_dir}` (copies every "
            f"intact record into a new log and keeps the damaged file beside it)")


def is_damage(exc: BaseException) -> bool:
    """True when ``exc`` is SQLite saying a file itself is damaged (corrupt, not a
    database), not a busy or full disk."""
    if not isinstance(exc, sqlite3.DatabaseError):
        return False
    code = getattr(exc, "sqlite_errorcode", None)
    if code is not None:
        return (code & 0xFF) in _DAMAGE_CODES
    text = str(exc)
    return "malformed" in text or "not a database" in text


def _wal_frames(path: str) -> bool:
    """True when ``path``'s WAL file holds frames (more than its 32-byte header)."""
    try:
        return os.path.getsize(path + "-wal") > 32
    except OSError:
        return False


def header_problem(path: str, min_size: int = 0) -> str | None:
    """What is wrong with the SQLite file at ``path`` judged from its header and size
    alone (reads 100 bytes; no SQLite call), or None when it looks whole. A missing or
    empty file is whole (a new log). While the WAL holds no frames the main file is
    exactly ``page count × page size`` bytes (SQLite truncates it so at every full
    checkpoint), so a shorter file was truncated and a longer one has bytes appended.
    With frames in the WAL the main file may legitimately lag the header, so only these
    hold: its size is a whole number of pages, and at least ``min_size`` bytes (the size
    last seen; the log never shrinks: no auto-vacuum, no VACUUM)."""
    try:
        size = os.path.getsize(path)
        if size == 0:
            return None
        with open(path, "rb") as f:
            head = f.read(100)
    except FileNotFoundError:
        return None
    if len(head) < 100 or not head.startswith(_MAGIC):
        return (f"not an SQLite database (file of {size} bytes without the SQLite header; "
                "overwritten or truncated)")
    page_size = int.from_bytes(head[16:18], "big")
    page_size = 65536 if page_size == 1 else page_size
    if page_size < 512 or page_size & (page_size - 1):
        return f"invalid page size {page_size} in the header"
    change_counter = int.from_bytes(head[24:28], "big")
    pages = int.from_bytes(head[28:32], "big")
    valid_for = int.from_bytes(head[92:96], "big")
    problem = _size_problem(size, page_size, min_size) or wal_problem(path)
    if problem:
        return problem
    if _wal_frames(path) or pages == 0 or valid_for != change_counter:
        return None
    return _pages_problem_of(size, pages, page_size)


def _size_problem(size: int, page_size: int, min_size: int = 0) -> str | None:
    """What a file size alone says is wrong (it shrank below ``min_size``, or it is not a
    whole number of pages), or None."""
    if size < min_size:
        return f"truncated: the file shrank from {min_size} to {size} bytes while open"
    if size % page_size:
        return (f"{size} bytes is not a whole number of {page_size}-byte pages (truncated, "
                "or bytes appended)")
    return None


def _pages_problem_of(size: int, pages: int, page_size: int) -> str | None:
    """What a file of ``size`` bytes whose header records ``pages`` pages of
    ``page_size`` bytes says is wrong (truncated, or bytes after its last page), or None."""
    expected = pages * page_size
    if size < expected:
        return (f"truncated: the file has {size} bytes, its header records {pages} pages "
                f"of {page_size} bytes ({expected} bytes)")
    if size > expected:
        return (f"{size - expected} bytes after its last page (the header records {pages} "
                f"pages of {page_size} bytes = {expected} bytes; garbage appended?)")
    return None


def _pages_problem(conn: sqlite3.Connection, path: str) -> str | None:
    """:func:`header_problem`'s size checks with the header read through ``conn``
    (``PRAGMA page_size``/``page_count``), for a file this process holds open: opening
    and closing a descriptor of it would drop every POSIX lock the process holds on it,
    SQLite's included, and another process closing the log would then delete the WAL and
    shm that the open connections still use."""
    size = os.path.getsize(path)
    page_size = conn.execute("PRAGMA page_size").fetchone()[0]
    problem = _size_problem(size, page_size)
    if problem or _wal_frames(path):
        return problem
    pages = conn.execute("PRAGMA page_count").fetchone()[0]
    return _pages_problem_of(size, pages, page_size)


def check_file(path: str, conn: sqlite3.Connection | None = None) -> str | None:
    """Full open-time check of the log file at ``path``: :func:`header_problem` (only
    without ``conn``: given one, the caller checked the header before connecting, and a
    descriptor opened now would drop ``conn``'s locks), then (on ``conn``, or a
    connection of its own) :func:`_offsets_problem` (a consumer group past the end of its
    partition), a checkpoint so the WAL's frames reach the main file, the size check
    again, and ``PRAGMA quick_check`` (every page and record of every table: O(file
    size)). Returns a description of the damage or None; a damaged file's WAL is left
    as it was (for ``mneme log recover``)."""
    own = conn is None
    problem = header_problem(path) if own else None
    if problem or not os.path.exists(path):
        return problem
    try:
        if own:
            conn = sqlite3.connect(path, isolation_level=None, timeout=30)
        # before the checkpoint below writes the WAL's frames into the file for good
        problem = _offsets_problem(conn)
        if problem:
            _keep_wal_on_close(conn)
            return problem
        if _wal_frames(path):
            # busy (another process reading) leaves frames behind; the size check then
            # cannot judge the size, and quick_check still reads every page
            conn.execute("PRAGMA wal_checkpoint(TRUNCATE)").fetchone()
            problem = _pages_problem(conn, path)
            if problem:
                return problem
        rows = [r[0] for r in conn.execute("PRAGMA quick_check(20)").fetchall()]
        if rows != ["ok"]:
            return "SQLite quick_check: " + "; ".join(rows)
    except sqlite3.DatabaseError as e:
        if is_damage(e):
            return f"SQLite: {e}"
        raise
    finally:
        if own and conn is not None:
            conn.close()
    return None


# ---- the write-ahead log at rest --------------------------------------------------------
# SQLite reads a WAL's frames up to the first one whose checksum or salt does not match
# and silently drops the rest (https://www.sqlite.org/fileformat2.html#walformat), so a
# WAL cut or garbled while the log was closed loses committed writes without an error.
# After a crash the -shm file still holds the wal-index header of the last writer: how
# many frames were committed (mxFrame) and how many were already copied into the main
# file (nBackfill). Comparing it with the frames SQLite will accept finds the loss.

_WAL_MAGIC = (0x377F0682, 0x377F0683)  # the low bit: checksums over big-endian words
_WAL_VERSION = 3007000
_WAL_HEADER, _FRAME_HEADER = 32, 24


@dataclass(frozen=True)
class WalState:
    """What the write-ahead log of a closed log holds. ``committed``: frames of committed
    transactions the last writer recorded in the ``-shm`` wal-index (mxFrame);
    ``backfilled``: those of them already copied into the main file (nBackfill);
    ``readable``: the frames SQLite will accept, up to the last commit (0 for a missing,
    empty or unreadable WAL)."""

    committed: int
    backfilled: int
    readable: int

    @property
    def damaged(self) -> bool:
        """True when SQLite would read another state than the last writer committed:
        frames of committed writes dropped, unless every frame is dropped and all of them
        were already copied into the main file (a WAL emptied after its checkpoint)."""
        return self.readable < self.committed and not (
            self.readable == 0 and self.backfilled >= self.committed)

    @property
    def unsaved(self) -> int:
        """Dropped frames whose writes are nowhere else (not yet in the main file)."""
        return max(0, self.committed - max(self.readable, self.backfilled))

    @property
    def main_file_is_newer(self) -> bool:
        """True when the main file alone holds a later state than SQLite would read from
        both (the frames it keeps are older than pages already copied into the file)."""
        return self.damaged and self.readable <= self.backfilled


def _checksum(data: bytes, big: bool, s0: int, s1: int) -> tuple[int, int]:
    """SQLite's WAL checksum of ``data`` (a multiple of 8 bytes) going on from (s0, s1)."""
    words = struct.unpack(f"{'>' if big else '<'}{len(data) // 4}I", data)
    for i in range(0, len(words), 2):
        s0 = (s0 + words[i] + s1) & 0xFFFFFFFF
        s1 = (s1 + words[i + 1] + s0) & 0xFFFFFFFF
    return s0, s1


def _wal_index(path: str) -> tuple[int, int, bytes] | None:
    """(mxFrame, nBackfill, the WAL salts) from ``path``'s ``-shm`` wal-index header
    (native byte order; two equal copies, initialised, checksum right), or None."""
    try:
        with open(path + "-shm", "rb") as f:
            head = f.read(136)
    except OSError:
        return None
    if len(head) < 136 or head[:48] != head[48:96]:
        return None
    version, _, _, init, _, _, mx_frame = struct.unpack_from("=IIIBBHI", head, 0)
    if version != _WAL_VERSION or not init:
        return None
    big = sys.byteorder == "big"
    if struct.pack("=II", *_checksum(head[:40], big, 0, 0)) != head[40:48]:
        return None
    (backfilled,) = struct.unpack_from("=I", head, 96)
    return mx_frame, backfilled, head[32:40]


def _readable_frames(wal: BinaryIO, salts: bytes, limit: int) -> int | None:
    """The frames of the WAL file ``wal`` SQLite accepts (salts, checksums), up to its
    last commit frame, reading at most ``limit`` frames; None when its header is not
    the one of ``salts`` (another WAL than the wal-index describes)."""
    head = wal.read(_WAL_HEADER)
    if len(head) < _WAL_HEADER:
        return 0
    magic, version, page_size = struct.unpack_from(">III", head, 0)
    if magic not in _WAL_MAGIC or version != _WAL_VERSION:
        return 0  # SQLite ignores the whole file
    if head[16:24] != salts:
        return None
    big = bool(magic & 1)
    sums = _checksum(head[:24], big, 0, 0)
    if struct.pack(">II", *sums) != head[24:32]:
        return 0
    readable = 0
    for n in range(1, limit + 1):
        frame = wal.read(_FRAME_HEADER + page_size)
        if len(frame) < _FRAME_HEADER + page_size or frame[8:16] != salts:
            break
        pgno, commit = struct.unpack_from(">II", frame, 0)
        sums = _checksum(frame[_FRAME_HEADER:], big, *_checksum(frame[:8], big, *sums))
        if pgno == 0 or struct.pack(">II", *sums) != frame[16:24]:
            break
        if commit:
            readable = n
    return readable


def wal_state(path: str) -> WalState | None:
    """The :class:`WalState` of the closed log at ``path``, or None when there is nothing
    to judge (no wal-index from a last writer, or it describes another WAL than the
    file, or the WAL changed while read: a process has the log open). Reads the -shm
    header and up to ``committed`` frames (checksums in Python: ~0.3 s per 1,000
    frames); opens no SQLite connection, so call it before any is open."""
    index = _wal_index(path)
    if index is None or index[0] == 0:
        return None
    committed, backfilled, salts = index
    try:
        with open(path + "-wal", "rb") as wal:
            readable = _readable_frames(wal, salts, committed)
            wal.seek(0)
            again = wal.read(_WAL_HEADER)
    except FileNotFoundError:
        readable, again = 0, b""
    if readable is None or _wal_index(path) != index or (again and again[16:24] != salts):
        return None
    return WalState(committed, backfilled, readable)


def wal_problem(path: str) -> str | None:
    """What :func:`wal_state` says is wrong with the closed log at ``path``'s write-ahead
    log, or None."""
    state = wal_state(path)
    if state is None or not state.damaged:
        return None
    older = (f"; {path} already holds later versions of pages in the frames it keeps"
             if 0 < state.readable < state.backfilled else "")
    return (f"its write-ahead log {path}-wal was cut or damaged while the log was closed: "
            f"the last writer committed {state.committed} frames ({state.backfilled} of "
            f"them copied into {path} since), SQLite can read {state.readable}, so the "
            f"writes of {state.unsaved} committed frames would be lost{older}")


def _keep_wal_on_close(conn: sqlite3.Connection) -> None:
    """Close ``conn`` later without SQLite's checkpoint of the last connection, which
    would write a damaged log's WAL into its main file for good."""
    with suppress(AttributeError, sqlite3.Error):  # (Python 3.12+, SQLite 3.16+)
        conn.setconfig(sqlite3.SQLITE_DBCONFIG_NO_CKPT_ON_CLOSE, True)

def _offsets_problem(conn: sqlite3.Connection) -> str | None:
    """A consumer group whose committed offset is past the end of its partition, or
    None: the log lost records the group had already handled (a cut WAL, a file put
    back from an older copy without the others), so the projections hold what the log
    no longer has, and the group would skip the records appended next under the lost
    offsets. One index lookup per (group, partition)."""
    try:
        rows = conn.execute(
            'SELECT g."group", g.topic, g."partition", g.next_offset, '
            '(SELECT MAX(r."offset") FROM records r WHERE r.topic = g.topic '
            'AND r."partition" = g."partition") FROM group_offsets g').fetchall()
    except sqlite3.OperationalError:
        return None  # a new log: no tables yet
    ahead = [(g, t, p, n, -1 if end is None else end) for g, t, p, n, end in rows
             if n > (-1 if end is None else end) + 1]
    if not ahead:
        return None
    g, t, p, n, end = ahead[0]
    return (f"consumer group {g!r} has handled {t}[{p}] up to offset {n}, but the log "
            f"ends at {end + 1}: {n - end - 1} records it handled are gone (and "
            f"{len(ahead) - 1} more partitions of groups likewise), so the projections hold "
            "what the log no longer has")

def _guarded(method):
    """Fail fast once the log is known to be damaged; mark it damaged (and raise
    :class:`LogDamaged`) when SQLite reports a corrupt file."""

    @functools.wraps(method)
    def wrapper(self, *args, **kwargs):
        if self.damage is not None:
            raise LogDamaged(self.path, self.damage)
        try:
            return method(self, *args, **kwargs)
        except sqlite3.DatabaseError as e:
            if not is_damage(e):
                raise
            self._mark_damaged(f"SQLite: {e}")
            raise LogDamaged(self.path, self.damage) from e
    return wrapper


class _Shared:
    """State shared by every instance on one file in this process: the write lock (so
    in-process writers queue on a lock instead of SQLite's sleeping busy handler) and the
    append sequence waiters watch."""

    def __init__(self) -> None:
        self.write_lock = threading.Lock()
        self.cond = threading.Condition()
        self.seq = 0     # bumped after every committed append in this process
        self.wakes = 0   # bumped by wake(), so a stopping consumer returns at once
        self.opened = 0  # instances open on the file in this process


_SHARED: dict[str, _Shared] = {}
_SHARED_LOCK = threading.Lock()


def _shared_for(path: str) -> _Shared:
    with _SHARED_LOCK:
        return _SHARED.setdefault(path, _Shared())


class SqliteEventLog:
    """A durable partitioned append-only log with consumer-group offsets on one SQLite
    file; implements :class:`mneme.ports.EventLog`.

    ``path``: the database file (created with its parent directories if missing).
    ``busy_timeout``: seconds a write waits for another process's write lock before
    raising ``sqlite3.OperationalError`` ("database is locked").
    ``poll_interval``: seconds between cross-process change checks in
    :meth:`wait_for_append`.

    ``check``: run :func:`check_file` on open (raises :class:`LogDamaged`); off only
    for tools that must read a damaged file (:func:`recover`).

    Topics that are appended to before :meth:`ensure_topic` are created with
    :func:`mneme.bus.default_partitions` (like Kafka's ``auto.create.topics.enable``).
    Not fork-safe: open a new instance in a child process.
    """

    def __init__(self, path: str | os.PathLike[str], *, busy_timeout: float = 30.0,
                 poll_interval: float = 0.1, check: bool = True) -> None:
        self.path = os.path.abspath(os.fspath(path))
        os.makedirs(os.path.dirname(self.path) or ".", exist_ok=True)
        self.busy_timeout = busy_timeout
        self.poll_interval = poll_interval
        self._shared = _shared_for(os.path.realpath(self.path))
        self._local = threading.local()
        # (thread, its read connection): closed once the thread has ended
        self._readers: list[tuple[threading.Thread, sqlite3.Connection]] = []
        self._readers_lock = threading.Lock()
        self._pcache: dict[str, int] = {}  # partition counts never change once created
        self._closed = False
        #: What is wrong with the file once damage was seen (None while whole).
        self.damage: str | None = None
        self._size = 0  # main file size after our last commit (it never shrinks)
        # Counted as open from before its first connection, and the header read (before
        # SQLite touches the file) under the same lock, only while no other instance of
        # this process is open or opening: reading it by a descriptor of its own would
        # drop their connections' locks (two instances opened at once by two threads).
        with _SHARED_LOCK:
            others = self._shared.opened
            self._shared.opened += 1
            try:
                problem = header_problem(self.path) if check and not others else None
            except BaseException:
                self._shared.opened -= 1
                raise
        try:
            if problem:
                raise LogDamaged(self.path, problem)
            self._writer = self._connect()
            if check:
                problem = check_file(self.path, self._writer)
                if problem:
                    _keep_wal_on_close(self._writer)
                    self._writer.close()
                    raise LogDamaged(self.path, problem)
            self._init_schema()
            self._size = os.path.getsize(self.path)
            self._page_size = self._writer.execute("PRAGMA page_size").fetchone()[0]
        except BaseException as e:
            with _SHARED_LOCK:
                self._shared.opened -= 1
            if isinstance(e, sqlite3.DatabaseError) and is_damage(e):
                raise LogDamaged(self.path, f"SQLite: {e}") from e
            raise

    # ---- connections -------------------------------------------------------------

    def _connect(self) -> sqlite3.Connection:
        # isolation_level=None: autocommit; transactions are explicit BEGIN IMMEDIATE.
        conn = sqlite3.connect(self.path, timeout=self.busy_timeout, isolation_level=None,
                               check_same_thread=False)
        conn.execute(f"PRAGMA busy_timeout = {int(self.busy_timeout * 1000)}")
        conn.execute("PRAGMA synchronous = FULL")
        return conn

    def _init_schema(self) -> None:
        with self._shared.write_lock:
            mode = self._writer.execute("PRAGMA journal_mode = WAL").fetchone()[0]
            if str(mode).lower() != "wal":
                raise RuntimeError(f"{self.path}: could not enable WAL (journal_mode={mode})")
            self._writer.execute("BEGIN IMMEDIATE")
            try:
                version = self._writer.execute("PRAGMA user_version").fetchone()[0]
                if version > SCHEMA_VERSION:
                    raise RuntimeError(f"{self.path}: event log schema {version} is newer "
                                       f"than this code ({SCHEMA_VERSION})")
                for stmt in _SCHEMA.split(";"):
                    if stmt.strip():
                        self._writer.execute(stmt)
                self._writer.execute(f"PRAGMA user_version = {SCHEMA_VERSION}")
            except BaseException:
                self._writer.execute("ROLLBACK")
                raise
            self._writer.execute("COMMIT")

    def _reader(self) -> sqlite3.Connection:
        """This thread's read connection (WAL readers see the last committed state and
        never block on the writer)."""
        conn = getattr(self._local, "conn", None)
        if conn is None:
            self._check_open()
            conn = self._connect()
            conn.execute("PRAGMA query_only = ON")
            with self._readers_lock:
                # Threads come and go (a metrics scrape or a short-lived worker each get
                # one): close the connections of ended threads, or descriptors leak.
                alive = []
                for thread, old in self._readers:
                    if thread.is_alive():
                        alive.append((thread, old))
                    else:
                        old.close()
                alive.append((threading.current_thread(), conn))
                self._readers = alive
            self._local.conn = conn
        return conn

    def _mark_damaged(self, problem: str) -> None:
        if self.damage is None:
            self.damage = problem
            log.error("event log %s is damaged: %s", self.path, problem)
            self.wake()  # waiting consumers see it at once

    def check(self) -> str | None:
        """Cheap health probe (one stat): the recorded damage, or what the file's size
        says now (it shrank, or is no longer a whole number of pages; then the log is
        marked damaged for good); None while the file looks whole. It opens no file
        descriptor of its own: closing one would drop SQLite's POSIX locks on the file.
        Takes the write lock, so this process's checkpoints (which run inside commits)
        cannot race the size check. Damage a probe cannot see (bytes overwritten in
        place) is still caught when SQLite reads the page."""
        if self.damage is None and not self._closed:
            with self._shared.write_lock:
                try:
                    problem = _size_problem(os.path.getsize(self.path), self._page_size,
                                            self._size)
                except FileNotFoundError:
                    problem = "the file was removed while open"
            if problem:
                self._mark_damaged(problem)
        return self.damage

    def _check_open(self) -> None:
        if self._closed:
            raise RuntimeError(f"event log {self.path} is closed")

    @contextmanager
    def _write_tx(self) -> Iterator[sqlite3.Connection]:
        """One write transaction: the in-process lock, then SQLite's RESERVED lock
        (BEGIN IMMEDIATE) so cross-process writers queue instead of deadlocking on a
        read→write upgrade. Rolls back on any error."""
        self._check_open()
        with self._shared.write_lock:
            conn = self._writer
            conn.execute("BEGIN IMMEDIATE")
            try:
                yield conn
                conn.execute("COMMIT")
            except BaseException:
                if conn.in_transaction:
                    conn.execute("ROLLBACK")
                raise
            # a checkpoint (run by COMMIT) is the only legitimate change of the main file
            self._size = os.path.getsize(self.path)

    def _notify(self) -> None:
        with self._shared.cond:
            self._shared.seq += 1
            self._shared.cond.notify_all()

    # ---- topics ------------------------------------------------------------------

    @_guarded
    def ensure_topic(self, topic: str, partitions: int) -> None:
        """Create ``topic`` with ``partitions`` partitions if it does not exist.

        An existing topic keeps its partition count (changing it would move keys to
        other partitions and break per-key order); a different request is logged.
        Raises ValueError when ``partitions`` < 1 or ``topic`` is empty.
        """
        if not topic:
            raise ValueError("topic name must not be empty")
        if partitions < 1:
            raise ValueError(f"partitions must be >= 1, got {partitions}")
        with self._write_tx() as conn:
            existing = self._topic_partitions(conn, topic)
            if existing is None:
                conn.execute("INSERT INTO topics (name, partitions) VALUES (?, ?)",
                             (topic, partitions))
                existing = partitions
        if existing != partitions:
            log.warning("topic %s exists with %d partitions; keeping them (asked for %d)",
                        topic, existing, partitions)
        self._pcache[topic] = existing

    @_guarded
    def partitions(self, topic: str) -> int:
        """Partition count of ``topic``; 0 when the topic does not exist."""
        n = self._pcache.get(topic)
        if n is None:
            n = self._topic_partitions(self._reader(), topic)
            if n is None:
                return 0
            self._pcache[topic] = n
        return n

    @_guarded
    def topics(self) -> dict[str, int]:
        """Every topic with its partition count."""
        rows = self._reader().execute("SELECT name, partitions FROM topics ORDER BY name")
        return {name: n for name, n in rows.fetchall()}

    @staticmethod
    def _topic_partitions(conn: sqlite3.Connection, topic: str) -> int | None:
        row = conn.execute("SELECT partitions FROM topics WHERE name = ?", (topic,)).fetchone()
        return None if row is None else row[0]

    # ---- append / read -----------------------------------------------------------

    @_guarded
    def append(self, records: Sequence[OutRecord]) -> list[Record]:
        """Append ``records`` atomically (all or none) and durably (fsynced before
        return); returns them in order with their partitions, offsets and the append
        timestamp (epoch seconds, one value for the batch).

        Raises TypeError for a record whose key is not ``str``, value not bytes or
        headers not ``str`` → ``str``; ``sqlite3.OperationalError`` when another process
        holds the write lock longer than ``busy_timeout``.
        """
        records = list(records)
        if not records:
            return []
        created: dict[str, int] = {}
        with self._write_tx() as conn:
            out = self._append_tx(conn, records, created)
        self._pcache.update(created)
        self._notify()
        return out

    def _append_tx(self, conn: sqlite3.Connection, records: list[OutRecord],
                   created: dict[str, int]) -> list[Record]:
        now = time.time()
        ends: dict[tuple[str, int], int] = {}
        rows = []
        out = []
        for r in records:
            headers = _check_record(r)
            n = self._pcache.get(r.topic) or created.get(r.topic)
            if n is None:
                n = self._topic_partitions(conn, r.topic)
                if n is None:
                    n = default_partitions(r.topic)
                    conn.execute("INSERT INTO topics (name, partitions) VALUES (?, ?)",
                                 (r.topic, n))
                created[r.topic] = n
            p = partition_for(r.key, n)
            tp = (r.topic, p)
            off = ends.get(tp)
            if off is None:
                last = conn.execute(_END_SQL, tp).fetchone()[0]
                off = 0 if last is None else last + 1
            ends[tp] = off + 1
            value = bytes(r.value)
            rows.append((r.topic, p, off, r.key, value, json.dumps(headers), now))
            out.append(Record(r.topic, p, off, r.key, value, headers, now))
        conn.executemany(_INSERT_SQL, rows)
        return out

    @_guarded
    def read(self, topic: str, partition: int, offset: int, limit: int = 100) -> list[Record]:
        """Records of (``topic``, ``partition``) with offset >= ``offset``, in offset
        order, at most ``limit``; [] past the end or for an unknown topic."""
        if limit <= 0:
            return []
        rows = self._reader().execute(_READ_SQL, (topic, partition, offset, limit)).fetchall()
        return [Record(topic, partition, off, key, value, json.loads(headers), ts)
                for off, key, value, headers, ts in rows]

    @_guarded
    def end_offset(self, topic: str, partition: int) -> int:
        """The offset the next record appended to (``topic``, ``partition``) will get
        (the high watermark); 0 for an empty or unknown partition."""
        last = self._reader().execute(_END_SQL, (topic, partition)).fetchone()[0]
        return 0 if last is None else last + 1

    # ---- consumer groups ---------------------------------------------------------

    @_guarded
    def committed(self, group: str, topic: str, partition: int) -> int:
        """The next offset ``group`` will read on (``topic``, ``partition``); 0 when it
        never committed there."""
        row = self._reader().execute(
            'SELECT next_offset FROM group_offsets WHERE "group" = ? AND topic = ? '
            'AND "partition" = ?', (group, topic, partition)).fetchone()
        return 0 if row is None else row[0]

    @_guarded
    def groups(self, live_only: bool = False) -> list[str]:
        """Ids of the consumer groups that have committed offsets, sorted (the embedded
        log has no membership: ``live_only`` changes nothing)."""
        return [r[0] for r in self._reader().execute(
            'SELECT DISTINCT "group" FROM group_offsets ORDER BY 1')]

    @_guarded
    def commit(self, group: str, offsets: dict[tuple[str, int], int],
               produce: Sequence[OutRecord] = ()) -> list[Record]:
        """Append ``produce`` and set ``group``'s next offsets to ``offsets``
        ({(topic, partition): next offset}) in ONE transaction: either both happen or
        neither (exactly-once for the embedded topology). Returns the produced records.

        Offsets never move backwards (only :meth:`reset_group` does that): raises
        :class:`mneme.bus.StaleCommitError`, writing nothing, when an offset is lower
        than the stored one, or equal to it while ``produce`` is non-empty (those
        records were already handled and their outputs produced). Raises ValueError for a
        negative offset, TypeError as :meth:`append` does.
        """
        produce = list(produce)
        for (topic, partition), off in offsets.items():
            if off < 0:
                raise ValueError(f"negative offset {off} for {topic}[{partition}]")
        created: dict[str, int] = {}
        with self._write_tx() as conn:
            for (topic, partition), off in offsets.items():
                row = conn.execute(
                    'SELECT next_offset FROM group_offsets WHERE "group" = ? AND topic = ? '
                    'AND "partition" = ?', (group, topic, partition)).fetchone()
                if row is not None and (off < row[0] or (off == row[0] and produce)):
                    raise StaleCommitError(
                        f"group {group!r} is at offset {row[0]} on {topic}[{partition}]; "
                        f"refusing commit of {off}" + (" with records" if produce else ""))
            out = self._append_tx(conn, produce, created) if produce else []
            conn.executemany(
                'INSERT INTO group_offsets ("group", topic, "partition", next_offset) '
                'VALUES (?, ?, ?, ?) ON CONFLICT ("group", topic, "partition") '
                'DO UPDATE SET next_offset = excluded.next_offset',
                [(group, t, p, off) for (t, p), off in offsets.items()])
        self._pcache.update(created)
        if out:
            self._notify()
        return out

    @_guarded
    def reset_group(self, group: str, topics: Sequence[str] | None = None) -> None:
        """Forget ``group``'s offsets on ``topics`` (all topics when None), so it reads
        them again from offset 0 (replay)."""
        with self._write_tx() as conn:
            if topics is None:
                conn.execute('DELETE FROM group_offsets WHERE "group" = ?', (group,))
            else:
                conn.executemany('DELETE FROM group_offsets WHERE "group" = ? AND topic = ?',
                                 [(group, t) for t in topics])

    @_guarded
    def group_offsets(self, group: str) -> dict[tuple[str, int], int]:
        """Every committed next offset of ``group``: {(topic, partition): offset}."""
        rows = self._reader().execute(
            'SELECT topic, "partition", next_offset FROM group_offsets WHERE "group" = ?',
            (group,)).fetchall()
        return {(t, p): off for t, p, off in rows}

    # ---- waiting -----------------------------------------------------------------

    @_guarded
    def change_token(self) -> tuple[int, int, int]:
        """An opaque token of the log's state as this thread sees it; take it *before*
        reading, then pass it to :meth:`wait_for_append` so an append that lands in
        between is not missed. Thread-specific (it includes this thread's connection's
        ``data_version``)."""
        with self._shared.cond:
            seq, wakes = self._shared.seq, self._shared.wakes
        return seq, wakes, self._data_version()

    def _data_version(self) -> int:
        return self._reader().execute("PRAGMA data_version").fetchone()[0]

    @_guarded
    def wait_for_append(self, timeout: float,
                        since: tuple[int, int, int] | None = None) -> bool:
        """Block up to ``timeout`` seconds until something may have been appended since
        ``since`` (a :meth:`change_token` of this thread; default: now). Returns True on
        an append in this process (woken at once), a change by another process (seen
        within ``poll_interval``) or :meth:`wake`; False on timeout. May return True
        spuriously (e.g. after an offset commit): callers re-read and wait again."""
        if since is None:
            since = self.change_token()
        seq0, wakes0, dv0 = since
        deadline = time.monotonic() + timeout
        cond = self._shared.cond
        while True:
            with cond:
                if self._shared.seq != seq0 or self._shared.wakes != wakes0:
                    return True
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    return False
                cond.wait(min(remaining, self.poll_interval))
                if self._shared.seq != seq0 or self._shared.wakes != wakes0:
                    return True
            if self._closed or self.damage is not None or self._data_version() != dv0:
                return True

    def wake(self) -> None:
        """Wake every :meth:`wait_for_append` on this file in this process (used by a
        consumer's ``stop``)."""
        with self._shared.cond:
            self._shared.wakes += 1
            self._shared.cond.notify_all()

    # ---- lifecycle ---------------------------------------------------------------

    def close(self) -> None:
        """Close every connection, the readers first, then checkpoint the WAL into the
        main file (TRUNCATE) and close the writer, so a log at rest is one whole file
        (what the next open's header check judges). Stop consumers first; later calls
        raise RuntimeError (or ``sqlite3.ProgrammingError`` from a thread's closed
        connection)."""
        if self._closed:
            return
        self._closed = True
        self.wake()
        try:
            with self._readers_lock:
                for _, conn in self._readers:
                    conn.close()
                self._readers.clear()
            with self._shared.write_lock:
                # SQLite checkpoints when the last connection closes, but not while another
                # one (another instance on the file) is open: do it here, best effort
                with suppress(sqlite3.Error):
                    self._writer.execute("PRAGMA wal_checkpoint(TRUNCATE)").fetchone()
                self._writer.close()
        finally:
            with _SHARED_LOCK:  # its connections are closed: the header may be read again
                self._shared.opened -= 1

    def __enter__(self) -> "SqliteEventLog":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"SqliteEventLog({self.path!r})"


def _check_record(r: OutRecord) -> dict[str, str]:
    """Validate an OutRecord's types before it reaches SQLite; returns its headers."""
    if not isinstance(r.topic, str) or not r.topic:
        raise TypeError(f"record topic must be a non-empty str, got {r.topic!r}")
    if not isinstance(r.key, str):
        raise TypeError(f"record key must be str, got {type(r.key).__name__}")
    if not isinstance(r.value, (bytes, bytearray, memoryview)):
        raise TypeError(f"record value must be bytes, got {type(r.value).__name__}")
    headers = dict(r.headers)
    for k, v in headers.items():
        if not isinstance(k, str) or not isinstance(v, str):
            raise TypeError(f"record headers must be str -> str, got {k!r}: {v!r}")
    return headers


# ---- recovery ----------------------------------------------------------------------------


@dataclass
class RecoveryReport:
    """What :func:`recover` did. ``kept``: records copied, per topic; ``lost``: offsets
    found missing (gaps below the highest kept offset) plus rows that could not be read,
    per topic (a lost tail cannot be counted); ``groups``: consumer-group offsets copied
    (clamped to the new end of their partition); ``damaged``: where the old file is now;
    ``problem``: what the check found before recovery (None: it looked whole);
    ``unreadable_rows``: rows SQLite could not read (their offsets are among ``lost``)."""

    path: str
    damaged: str
    problem: str | None
    kept: dict[str, int] = field(default_factory=dict)
    lost: dict[str, int] = field(default_factory=dict)
    unreadable_rows: int = 0
    groups: int = 0
    groups_lost: bool = False

    @property
    def kept_total(self) -> int:
        return sum(self.kept.values())

    @property
    def lost_total(self) -> int:
        return sum(self.lost.values())


_ROW_SQL = ('SELECT topic, "partition", "offset", key, value, headers, timestamp FROM records '
            'WHERE rowid >= ? AND rowid < ? ORDER BY rowid')


def _read_rows(conn: sqlite3.Connection, lo: int, hi: int, report: RecoveryReport):
    """Rows with rowid in [lo, hi): in one query, or one by one when that fails (a
    damaged page loses only its own rows)."""
    try:
        return conn.execute(_ROW_SQL, (lo, hi)).fetchall()
    except sqlite3.DatabaseError:
        pass
    rows = []
    for rowid in range(lo, hi):
        try:
            rows.extend(conn.execute(_ROW_SQL, (rowid, rowid + 1)).fetchall())
        except sqlite3.DatabaseError:
            report.unreadable_rows += 1
    return rows


def _max_rowid(conn: sqlite3.Connection) -> int:
    try:
        return conn.execute("SELECT MAX(rowid) FROM records").fetchone()[0] or 0
    except sqlite3.DatabaseError:  # the right edge is damaged: probe upwards
        hi, step, misses = 0, 1, 0
        while misses < 64:
            try:
                row = conn.execute("SELECT rowid FROM records WHERE rowid >= ? ORDER BY rowid "
                                   "LIMIT 1", (hi + step,)).fetchone()
            except sqlite3.DatabaseError:
                row = None
            if row is None:
                misses += 1
            else:
                hi, misses = row[0], 0
            step = step * 2 if row is not None else step + 1000
        return hi


def recover(path: str | os.PathLike[str], chunk: int = 1000) -> RecoveryReport:
    """Rebuild the log at ``path`` from whatever of it SQLite can still read: the file
    (with its ``-wal``/``-shm``) is copied to ``<path>.damaged-<UTC time>``, a new log is
    built beside it from that copy, and every readable record is copied with its topic,
    partition, offset, key, value, headers and timestamp (offsets keep their numbers, so
    a lost record leaves a gap that readers skip), then the topics and the consumer-group
    offsets that are readable (each clamped to the new end of its partition, so records
    appended after recovery are not skipped). Only then does the new log replace the old
    one, in one rename: a recovery interrupted before (Ctrl-C) leaves the log as it was.
    A log that :func:`check_file` finds whole is left as it is (the report's ``damaged``
    is then ""). A write-ahead log cut at rest (:func:`wal_state`) is read as far as
    SQLite accepts it, or not at all when the main file alone holds a later state. Reads rows ``chunk`` rowids at a time, falling back to one by one
    around damage. Stop every process using the log first. Raises FileNotFoundError
    when ``path`` does not exist."""
    import shutil

    path = os.path.abspath(os.fspath(path))
    if not os.path.exists(path):
        raise FileNotFoundError(path)
    wal = wal_state(path)  # before any connection: SQLite's recovery rewrites the -shm
    try:
        problem = check_file(path)
    except sqlite3.DatabaseError as e:
        problem = f"SQLite: {e}"
    if problem is None:
        return RecoveryReport(path=path, damaged="", problem=None)
    stamp = time.strftime("%Y%m%dT%H%M%SZ", time.gmtime())
    damaged, fresh = f"{path}.damaged-{stamp}", f"{path}.recovering-{stamp}"
    # A cut WAL whose readable frames are older than pages already in the main file
    # would roll those pages back: then the main file alone is read (its WAL is kept
    # beside it once the reading is done).
    main_only = wal is not None and wal.main_file_is_newer
    for suffix in ("",) if main_only else ("", "-wal", "-shm"):
        if os.path.exists(path + suffix):
            shutil.copy2(path + suffix, damaged + suffix)
    report = RecoveryReport(path=path, damaged=damaged, problem=problem)
    src = sqlite3.connect(damaged, isolation_level=None)
    # closing it must not checkpoint the copy's WAL into it and delete it: the frames
    # SQLite does not accept are committed writes only that WAL still holds
    _keep_wal_on_close(src)
    try:
        # writable_schema lets SQLite open a file shorter than its header says
        for pragma in ("writable_schema = ON", "query_only = ON"):
            try:
                src.execute(f"PRAGMA {pragma}")
            except sqlite3.DatabaseError:
                pass
        new = SqliteEventLog(fresh, check=False)
        try:
            _copy(src, new, report, chunk)
        finally:
            new.close()  # checkpointed: the new log is one whole file
    except BaseException:
        for suffix in ("", "-wal", "-shm"):
            with suppress(OSError):
                os.remove(fresh + suffix)
        raise
    finally:
        src.close()
        # the log's own WAL and wal-index as they were (reading the copy rewrote its
        # wal-index; main_only: they were not beside it)
        for suffix in ("-wal", "-shm"):
            if os.path.exists(path + suffix):
                shutil.copy2(path + suffix, damaged + suffix)
    # The old WAL must not meet the new file (SQLite would apply its frames to it); the
    # copy at ``damaged`` keeps them.
    for suffix in ("-wal", "-shm"):
        with suppress(FileNotFoundError):
            os.remove(path + suffix)
        with suppress(FileNotFoundError):
            os.remove(fresh + suffix)
    os.replace(fresh, path)
    return report


def _copy(src: sqlite3.Connection, new: SqliteEventLog, report: RecoveryReport,
          chunk: int) -> None:
    topics: dict[str, int] = {}
    try:
        topics = dict(src.execute("SELECT name, partitions FROM topics").fetchall())
    except sqlite3.DatabaseError:
        log.warning("recover: the topics table is unreadable; partition counts from records")
    seen: dict[tuple[str, int], list[int]] = {}
    top = _max_rowid(src)
    for lo in range(1, top + 1, chunk):
        rows = _read_rows(src, lo, min(lo + chunk, top + 1), report)
        if not rows:
            continue
        with new._write_tx() as conn:
            conn.executemany(_INSERT_SQL, rows)
        for t, p, off, *_ in rows:
            seen.setdefault((t, p), []).append(off)
    for t, p in seen:
        topics[t] = max(topics.get(t, 0), p + 1)
    ends: dict[tuple[str, int], int] = {}
    for (t, p), offs in seen.items():
        report.kept[t] = report.kept.get(t, 0) + len(offs)
        gaps = max(offs) + 1 - len(set(offs))
        if gaps:
            report.lost[t] = report.lost.get(t, 0) + gaps
        ends[(t, p)] = max(offs) + 1
    groups = []
    try:
        groups = src.execute('SELECT "group", topic, "partition", next_offset '
                             'FROM group_offsets').fetchall()
    except sqlite3.DatabaseError:
        report.groups_lost = True
        log.warning("recover: consumer-group offsets unreadable; groups start from 0")
    with new._write_tx() as conn:
        for name, n in topics.items():
            conn.execute("INSERT OR REPLACE INTO topics (name, partitions) VALUES (?, ?)",
                         (name, n))
        conn.executemany(
            'INSERT OR REPLACE INTO group_offsets ("group", topic, "partition", next_offset) '
            'VALUES (?, ?, ?, ?)',
            [(g, t, p, min(off, ends.get((t, p), 0))) for g, t, p, off in groups])
    report.groups = len(groups)
