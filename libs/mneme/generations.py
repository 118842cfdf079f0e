"""Projection generations: search's stores (vectors, text, graph) and, embedded,
consolidation's observation projection are numbered sets.

A replay builds generation *n + 1* next to the live generation *n* while *n* keeps
serving, and switches only when the new one has caught up and passed a check
(:mod:`mneme.runtime.rebuild`); a replay that fails or is cancelled leaves *n* as it was.
Generation 1 has the configured names unchanged (data dirs and collections made before
generations existed are generation 1); generation *g* > 1 has versioned names
(:func:`versioned_url`). Which one is live is recorded in the data dir's
``generations.json`` (:class:`Generations`), written atomically, so a restart opens the
generation that was live.

Why a pointer in the data dir and not a store alias: the generations a process switches
are its own store files (the embedded stores and each replica's local copies). Store
servers shared by replicas take the live generation from ``MNEME_STORE_GENERATION``
instead (every replica must agree, so it is configuration; README "Replay generations"),
and run it under the consumer group :func:`generation_group`.
"""

from __future__ import annotations

import json
import re
import shutil
import threading
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path, PurePosixPath
from typing import Any
from urllib.parse import parse_qs, unquote, urlencode, urlsplit, urlunsplit

from mneme.datadir import write_atomic
from mneme.errors import ConfigurationError
from mneme.stores import LOCAL_SCHEMES, is_local

POINTER = "generations.json"

#: Generation states: BUILDING (replaying the log), LIVE (serving), RETIRED (was live;
#: kept until dropped), FAILED (a replay that failed or was cancelled; kept to be dropped),
#: READY (built and checked on shared store servers; live once the replicas are
#: configured with it).
STATES = ("BUILDING", "LIVE", "RETIRED", "FAILED", "READY")

# The name each server adapter takes from its URL, and its default (the adapters' own
# COLLECTION, INDEX and GRAPH_NAME, not imported: that would load their client libraries).
_SERVER_NAMES = {"http": None, "https": None, "qdrant": ("collection", "mneme_facts"),
                 "qdrants": ("collection", "mneme_facts"), "redis": ("graph", "mneme"),
                 "rediss": ("graph", "mneme")}
_HTTP_NAMES = {"vector": ("collection", "mneme_facts"), "text": ("index", "mneme-facts")}
_NEO4J = ("bolt", "bolt+s", "bolt+ssc", "neo4j", "neo4j+s", "neo4j+ssc")


def versioned_url(kind: str, url: str, generation: int) -> str:
    """The URL of the ``kind`` store (vector, text, graph) of ``generation`` (>= 1), given
    its configured ``url`` (which is generation 1's).

    Local files get a suffix: ``/d/vectors`` → ``/d/vectors.g2``, ``/d/graph.db`` →
    ``/d/graph.g2.db``. Servers get a versioned name: Qdrant collection and OpenSearch
    index ``<name>_g2``, FalkorDB graph ``<name>_g2``, Neo4j database ``<db>-g2`` (a
    database per generation needs Neo4j Enterprise; the URL must name its database).
    ConfigurationError for a Neo4j URL without a database, ValueError for ``generation``
    < 1."""
    if generation < 1:
        raise ValueError(f"generation must be >= 1, got {generation}")
    if generation == 1:
        return url
    parts = urlsplit(url)
    scheme = parts.scheme.lower()
    g = f"g{generation}"
    if scheme in LOCAL_SCHEMES:
        path = PurePosixPath(unquote(parts.path))
        name = (f"{path.stem}.{g}{path.suffix}" if scheme == "falkordblite"
                else f"{path.name}.{g}")
        # urlunsplit would drop the empty authority: scheme:///abs/path stays as written.
        query = f"?{parts.query}" if parts.query else ""
        return f"{parts.scheme}://{path.with_name(name)}{query}"
    if scheme in _NEO4J:
        db = unquote(parts.path.strip("/"))
        if not db:
            raise ConfigurationError(
                f"MNEME_GRAPH_URL {url!r}: a generation > 1 on Neo4j is a database of its "
                "own; name generation 1's database in the URL path (bolt://host:7687/mneme)")
        return urlunsplit(parts._replace(path=f"/{db}-{g}"))
    key, default = (_HTTP_NAMES.get(kind) if scheme in ("http", "https")
                    else _SERVER_NAMES.get(scheme)) or (None, None)
    if key is None:
        raise ConfigurationError(f"MNEME_{kind.upper()}_URL {url!r}: no generation naming "
                                 f"for scheme {scheme!r}")
    query = {k: v[-1] for k, v in parse_qs(parts.query, keep_blank_values=True).items()}
    query[key] = f"{query.get(key) or default}_{g}"
    return urlunsplit(parts._replace(query=urlencode(query)))


def versioned_file(path: Path, generation: int) -> Path:
    """The file of a local single-file projection (consolidation's ``observations.db``)
    in ``generation``: ``path`` itself for 1, ``observations.g2.db`` for 2 (as the
    FalkorDB file of :func:`versioned_url`). ValueError for ``generation`` < 1."""
    if generation < 1:
        raise ValueError(f"generation must be >= 1, got {generation}")
    return path if generation == 1 else path.with_name(f"{path.stem}.g{generation}{path.suffix}")


def sqlite_files(path: Path) -> tuple[Path, Path, Path]:
    """A SQLite database file and its ``-wal``/``-shm`` companions (whether they exist or not)."""
    return path, path.with_name(path.name + "-wal"), path.with_name(path.name + "-shm")


def remove_file(path: Path) -> None:
    """Delete a SQLite projection file and its companions (:func:`sqlite_files`)."""
    for p in sqlite_files(path):
        p.unlink(missing_ok=True)


def configured(settings) -> int | None:
    """The live generation ``settings`` fix (``MNEME_STORE_GENERATION``) when search's
    stores are servers its replicas share (a Kafka bus and no local store file); None
    when the stores are this process's own files, whose data dir records it."""
    shared = (settings.url("bus").lower().startswith("kafka:")
              and not any(is_local(settings.url(k)) for k in ("vector", "text", "graph")))
    return settings.store_generation if shared else None


def generation_group(name: str, generation: int) -> str:
    """The consumer group id of a projection group ``name`` over shared store servers in
    ``generation``: ``name`` for 1, ``<name>@g<n>`` after (each generation's stores are
    at their own offsets)."""
    return name if generation == 1 else f"{name}@g{generation}"


def local_path(url: str) -> Path | None:
    """The file or directory of a local store URL (None for a server)."""
    parts = urlsplit(url)
    if parts.scheme.lower() in LOCAL_SCHEMES:
        return Path(unquote(parts.path))
    return None


def remove_local(urls: dict[str, str]) -> None:
    """Delete the files of the local stores among ``urls`` (kind → URL), FalkorDB's
    companion files included; servers are left alone."""
    for url in urls.values():
        path = local_path(url)
        if path is None:
            continue
        # Only FalkorDB's file has companions (``graph.db.aof``, ``graph.db.settings``);
        # a directory's siblings ``vectors.g2`` are other generations, and so is
        # ``graph.g2`` (and its companions) beside a graph file named without a suffix.
        file_store = urlsplit(url).scheme.lower() == "falkordblite"
        other = re.compile(re.escape(path.name) + r"\.g[0-9]+(\..*)?")
        companions = [p for p in path.parent.glob(path.name + ".*")
                      if not other.fullmatch(p.name)] if file_store else []
        for p in [path, *companions]:
            if p.is_dir():
                shutil.rmtree(p, ignore_errors=True)
            elif p.exists():
                p.unlink(missing_ok=True)
            if p.exists():  # kept: the caller keeps the generation's record
                raise OSError(f"cannot delete {p}")


@dataclass
class Generation:
    """One generation's record: ``generation`` (>= 1), ``state`` (:data:`STATES`),
    ``create_time``/``update_time`` (Unix seconds), ``records_done``/``records_total``
    (log records replayed so far / to replay), ``error`` (why it FAILED), ``check``
    (what the switch compared: banks, units per store, recalls sampled and their
    agreement), ``embedding_model`` (the model of its vectors; "" in records written
    before it was kept: the data dir's ``embedding_model`` file says)."""

    generation: int
    state: str
    create_time: float = 0.0
    update_time: float = 0.0
    records_done: int = 0
    records_total: int = 0
    error: str = ""
    check: dict[str, Any] = field(default_factory=dict)
    embedding_model: str = ""


class Generations:
    """The generations of one data dir's search stores, kept in ``<data_dir>/
    generations.json`` (rewritten atomically on every change; thread-safe). A data dir
    without the file has generation 1 live.

    ``configured``: the live generation is configuration (``MNEME_STORE_GENERATION``,
    store servers every replica shares), not the file's; the file then only records
    this process's replays (READY or FAILED)."""

    def __init__(self, data_dir: Path, configured: int | None = None) -> None:
        self.path = Path(data_dir) / POINTER
        self.configured = configured
        self._lock = threading.Lock()

    def _load(self) -> dict[int, Generation]:
        try:
            raw = json.loads(self.path.read_text())
            gens = {int(g["generation"]): Generation(**g) for g in raw.get("generations", [])}
        except FileNotFoundError:
            gens = {1: Generation(1, "LIVE")}
        if self.configured is not None:  # the configuration says which one serves
            for x in gens.values():
                if x.state in ("LIVE", "RETIRED"):
                    x.state = "RETIRED"
            gens.setdefault(self.configured, Generation(self.configured, "LIVE")).state = "LIVE"
        return gens

    def _save(self, gens: dict[int, Generation]) -> None:
        write_atomic(self.path, json.dumps(
            {"live": next((g for g, x in gens.items() if x.state == "LIVE"), 1),
             "generations": [asdict(gens[g]) for g in sorted(gens)]}, indent=1) + "\n")

    def list(self) -> list[Generation]:
        """Every generation on record, oldest first."""
        with self._lock:
            return [v for _, v in sorted(self._load().items())]

    def get(self, generation: int) -> Generation | None:
        """The record of ``generation``, or None."""
        with self._lock:
            return self._load().get(generation)

    def live(self) -> int:
        """The number of the live generation."""
        return next((g.generation for g in self.list() if g.state == "LIVE"), 1)

    def begin(self) -> Generation:
        """Record a new generation (one more than any on record) as BUILDING. Raises
        RuntimeError while another one is BUILDING (one replay at a time)."""
        with self._lock:
            gens = self._load()
            building = [g for g, x in gens.items() if x.state == "BUILDING"]
            if building:
                raise RuntimeError(f"generation {building[0]} is being built")
            now = time.time()
            new = Generation(max(gens) + 1, "BUILDING", now, now)
            gens[new.generation] = new
            self._save(gens)
            return new

    def update(self, generation: int, **fields: Any) -> Generation:
        """Change fields of ``generation``'s record (``state="LIVE"`` retires the live
        one in the same write: the switch). KeyError for an unknown generation."""
        with self._lock:
            gens = self._load()
            rec = gens[generation]
            if fields.get("state") == "LIVE":
                for x in gens.values():
                    if x.state == "LIVE":
                        x.state, x.update_time = "RETIRED", time.time()
            for k, v in fields.items():
                setattr(rec, k, v)
            rec.update_time = time.time()
            self._save(gens)
            return rec

    def forget(self, generation: int) -> None:
        """Remove ``generation``'s record (after its stores were dropped)."""
        with self._lock:
            gens = self._load()
            gens.pop(generation, None)
            self._save(gens)

    def recover(self) -> None:
        """Mark a generation left BUILDING by a process that stopped as FAILED (called at
        start, when no replay of this data dir can be running)."""
        with self._lock:
            gens = self._load()
            changed = False
            for x in gens.values():
                if x.state == "BUILDING":
                    x.state, x.error, changed = "FAILED", "the process stopped during the replay", True
            if changed:
                self._save(gens)


def drop_stores(stores: Any, urls: dict[str, str]) -> None:
    """Delete a generation's stores for good. ``stores``: its opened ``Projections``
    (vectors, text, graph; None: nothing opened); a server's is dropped (the adapter's
    ``drop()`` deletes the collection, index or graph; ``reset()`` empties it where the
    adapter cannot delete it) and closed. Then the local files among ``urls`` (kind →
    URL) are removed."""
    for kind, s in zip(("vector", "text", "graph"), stores.all() if stores else ()):
        try:
            if local_path(urls[kind]) is None:
                (getattr(s, "drop", None) or s.reset)()
        finally:
            s.close()
    remove_local(urls)


class Switchable:
    """A store port whose adapter can be replaced while it is in use: every attribute
    is looked up on the current ``target`` (so a call started before :meth:`swap` ends
    on the old adapter, the next one goes to the new)."""

    def __init__(self, target: Any) -> None:
        object.__setattr__(self, "target", target)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.target, name)

    def swap(self, target: Any) -> Any:
        """Make ``target`` current; returns the previous adapter (still open)."""
        old = self.target
        object.__setattr__(self, "target", target)
        return old


__all__ = ["Generation", "Generations", "STATES", "Switchable", "configured", "drop_stores",
           "generation_group", "local_path", "remove_file", "remove_local", "sqlite_files",
           "versioned_file", "versioned_url"]
