"""The composition root: wires adapters into the services' handlers once.

:class:`Root` opens what the settings name (event log, stores, models), lazily and at
most once; one builder per service (:data:`BUILDERS`) turns a Root into that service's
:class:`ServiceParts`: a :class:`mneme.router.Router` per consumer group of its routes
(``services/<name>/routes.py``, :func:`services`) with the ports its handlers name, and
its gRPC servicers. The runtimes (:mod:`mneme.runtime`) run them: embedded (``mneme
up``), one service per process over Kafka (``mneme serve <service>``), and replay.
"""

from __future__ import annotations

import contextlib
import functools
import importlib
import logging
import os
from concurrent import futures
from dataclasses import dataclass, field
from functools import cached_property
from pathlib import Path
from typing import Any, Callable, Iterable

import grpc

from mneme.bus import codec, partition_for, topics
from mneme.bus.logs import open_event_log
from mneme.config import Settings
from mneme.datadir import DataDirLocked, lock, replica_id, unlock
from mneme.errors import ConfigurationError, MnemeError
from mneme.generations import generation_group
from mneme.router import Group, Router, Service, group_ids

log = logging.getLogger("mneme")

SERVICES = ("ingest", "extraction", "search", "reflect", "consolidation")


@functools.cache
def services() -> dict[str, Service]:
    """Every service's declaration (``services/<name>/routes.py``), by name."""
    return {n: importlib.import_module(f"services.{n}.routes").SERVICE for n in SERVICES}


#: Why a missing projection file is refused (:class:`ProjectionUnreadable`).
_LOST = "it is missing, although the log says it was projected"


class ProjectionUnreadable(MnemeError):
    """A projection file of the data dir (the catalog, search's document projection,
    extraction's entity resolver or a store of the live generation) is damaged, or
    missing although the log says it was projected: serving would answer from an empty
    or broken copy. The message names the file and the remedy, ``mneme replay -d``
    (every projection is rebuilt from the log)."""

    def __init__(self, path: str, what: str, problem: str, data_dir: Path) -> None:
        path = str(Path(path).resolve())  # a "sqlite:////d/x" URL's path reads "//d/x"
        self.path = path
        super().__init__(f"{what} {path}: {problem}. It is a projection of the event log: "
                         f"rebuild it with `mneme replay -d {data_dir}` (mneme stopped)")


class Root:
    """Settings plus every adapter they name, opened on first use and closed by
    :meth:`close` (in reverse order of opening). Locks ``settings.data_dir`` (raises
    DataDirLocked when another process holds it). Opening the event log connects to the
    broker for a Kafka URL (ConnectionError after ``kafka_connect_timeout_s``)."""

    def __init__(self, settings: Settings | None = None, reembedding: bool = False,
                 rebuilding: bool = False) -> None:
        self.settings = settings or Settings()
        #: ``mneme reembed``: the live stores may hold another model's vectors than
        #: ``MNEME_EMBEDDING_MODEL`` (the one the new generation is built with)
        self.reembedding = reembedding
        #: ``mneme replay -d``: the local projection files are rebuilt from the log, so a
        #: damaged or missing one is not an error (a damaged one is deleted and made anew)
        self.rebuilding = rebuilding
        self.data_dir = self.settings.data_dir.resolve()
        try:
            self.data_dir.mkdir(parents=True, exist_ok=True)
            self._lock_fd: int | None = lock(self.data_dir)
        except OSError as e:  # a file, no permission, a read-only file system
            raise ConfigurationError(f"MNEME_DATA_DIR (--data-dir) {self.data_dir} cannot be "
                                     f"the data directory: {e.strerror or e}") from None
        self._closers: list[Callable[[], None]] = []

    def _opened(self, obj, close: Callable[[], None] | None = None):
        self._closers.append(close or obj.close)
        return obj

    @property
    def distributed(self) -> bool:
        """True when the event log is Kafka (one service per process)."""
        return self.settings.url("bus").lower().startswith("kafka:")

    @property
    def part_bytes(self) -> int:
        """Bytes of facts or observations one event record carries at most before the
        event goes out in parts (:func:`mneme.bus.part_bytes` of
        ``MNEME_KAFKA_MAX_REQUEST_SIZE``; on the embedded log too, so both log the same)."""
        from mneme.bus import part_bytes
        return part_bytes(self.settings.kafka_max_request_size)

    @cached_property
    def wait_slots(self):
        """The process's one bound on calls waiting for the consumers
        (:class:`mneme.slots.WaitSlots`): ``MNEME_SYNC_CALLS``, else the gRPC workers less
        four, at most ``MNEME_SYNC_CALLS_PER_TENANT`` of them for one tenant. Shared by
        every service the process runs (embedded: all five, one pool of workers)."""
        from mneme.slots import WaitSlots
        st = self.settings
        return WaitSlots(st.sync_calls or max(1, st.grpc_workers - 4),
                         st.sync_calls_per_tenant or None)

    @cached_property
    def raw_log(self):
        """The event log adapter itself, with mneme's topics created; raises
        :class:`mneme.bus.topics.TopicConfigError` (a configuration error) when a history
        topic would lose records. What it holds is sealed; read it through :attr:`log`."""
        st = self.settings
        event_log = self._opened(open_event_log(st.url("bus"), **st.kafka_options()))
        topics.ensure(event_log, st.topic_partitions(), keys=self.distributed)
        # TopicConfigError: history would expire, or the partition count changed
        topics.require_history(event_log, st.partitions)
        return event_log

    @cached_property
    def log(self):
        """The event log as every service uses it: user content sealed on append and
        opened on read (:class:`mneme.bus.sealing.SealedLog`)."""
        from mneme.bus.sealing import SealedLog
        raw = self.raw_log  # first: the bus settings are checked before the key settings
        return SealedLog(raw, self.sealer)

    @cached_property
    def keyring(self):
        """The data keys of crypto-shredding (:class:`mneme.keys.Keyring`): the key store
        of the topology under the master key of :func:`mneme.keys.local_kms`. Embedded:
        a file in the data dir, the master key from ``MNEME_MASTER_KEY`` or
        ``<data_dir>/master.key``. Distributed: the compacted key topic
        (:class:`mneme.stores.keys_kafka.KafkaKeyStore`, over a Kafka connection of its
        own so that its background reads never wait on the services' ones), and
        ``MNEME_MASTER_KEY`` is required (every process unwraps every bank's key);
        ConfigurationError without it."""
        from mneme.keys import MASTER_KEY_ENV, Keyring, local_kms
        env = {MASTER_KEY_ENV: self.settings.master_key}
        if self.distributed:
            from mneme.stores.keys_kafka import KafkaKeyStore
            kms = local_kms(None, env)  # ConfigurationError before any connection
            self.raw_log  # noqa: B018 - the topics (the key topic too) exist and are checked
            st = self.settings
            conn = self._opened(open_event_log(st.url("bus"), **st.kafka_options(),
                                               client_id="mneme-keys"))
            return Keyring(self._opened(KafkaKeyStore(conn)), kms)
        from mneme.stores.keys_sqlite import SqliteKeyStore
        self._check_key_files()
        kms = local_kms(self.data_dir, env)
        store = SqliteKeyStore(str(self.data_dir / "keys.db"))
        return Keyring(self._opened(store), kms)

    def _check_key_files(self) -> None:
        """Embedded: ConfigurationError naming the file when ``master.key`` is missing
        (and ``MNEME_MASTER_KEY`` unset) although ``keys.db`` holds bank keys it wrapped,
        or ``keys.db`` is missing although ``master.key`` exists and the log holds
        records. They are no projections: opening them anew made a key that unwraps
        nothing, or an empty key store, and every record on the log unreadable (a replay
        erased it all). Checked before opening, which would create them."""
        import sqlite3

        from mneme.errors import ConfigurationError
        keys, master = self.data_dir / "keys.db", self.data_dir / "master.key"
        remedy = ("restore it from a backup; mneme does not start without it, as the "
                  "content on the event log is sealed under its keys")
        if not self.settings.master_key and not master.exists() and keys.exists():
            try:
                db = sqlite3.connect(f"file:{keys}?mode=ro", uri=True)
                try:
                    wrapped = db.execute("SELECT 1 FROM bank_keys LIMIT 1").fetchone()
                finally:
                    db.close()
            except sqlite3.DatabaseError:
                wrapped = None  # the key store reports its own damage when it opens
            if wrapped:
                raise ConfigurationError(f"{master} is missing, although {keys} holds "
                                         f"bank keys it wrapped (or set MNEME_MASTER_KEY to "
                                         f"it): {remedy}")
        if master.exists() and not keys.exists():
            events = self.raw_log
            if any(events.end_offset(t, p) > 0 for t in events.topics()
                   for p in range(events.partitions(t))):
                raise ConfigurationError(f"{keys} is missing, although the event log holds "
                                         f"records: {remedy}")

    @cached_property
    def sealer(self):
        """Seals and opens user content on the log (:class:`mneme.bus.sealing.Sealer`),
        per bank as its ``erasure`` setting says (a bank unknown here is sealed)."""
        from mneme.bus.sealing import Sealer

        def erasure(bank_id: str) -> bool:
            config = self.bank_config(bank_id)
            return config is None or config.erasure != "none"
        return Sealer(self.keyring, erasure)

    @cached_property
    def catalog(self):
        """The local catalog (banks, operations): ingest's projection, or a service's own
        bank list in the distributed topology."""
        import sqlite3

        from mneme.stores.catalog_sqlite import SqliteCatalog
        url = self.settings.url("catalog")
        path = url.split("://", 1)[1] if "://" in url else url
        try:
            os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
            return self._local_projection(path, "the catalog", ("ingest",), SqliteCatalog)
        except (OSError, sqlite3.OperationalError) as e:
            if not os.path.isdir(os.path.dirname(path) or "."):  # not damage: the place
                raise ConfigurationError(f"MNEME_CATALOG_URL {url}: cannot open the "
                                         f"catalog there: {e}") from None
            raise

    @cached_property
    def documents(self):
        """search's document projection (:class:`mneme.stores.documents_sqlite.
        SqliteDocumentStore`, ``<data_dir>/documents.db``): this process's own full copy,
        like the catalog (group ``search-documents`` runs once per replica)."""
        from mneme.stores.documents_sqlite import SqliteDocumentStore
        return self._local_projection(str(self.data_dir / "documents.db"),
                                      "search's document projection", ("search-documents",),
                                      SqliteDocumentStore)

    def _local_projection(self, path: str, what: str, groups: tuple[str, ...], open_):
        """``open_(path)``: a SQLite projection of this data dir, opened. Embedded, a file
        that is damaged, or missing although its ``groups`` have consumed the intake topic
        (so they would not project it again: it would be served empty), raises
        :class:`ProjectionUnreadable` naming the file and the remedy (``mneme replay -d``,
        which rebuilds it: :attr:`rebuilding`, where a damaged file is deleted and made
        anew)."""
        import sqlite3

        from mneme.bus import INTAKE
        from mneme.bus.sqlite_log import is_damage
        from mneme.generations import remove_file, sqlite_files
        # checked before opening, which would create it: a refused start must leave no
        # empty file that the next start takes for the projection
        if path != ":memory:" and not os.path.exists(path) and self._projected(groups, INTAKE):
            raise ProjectionUnreadable(path, what, _LOST, self.data_dir)
        try:
            store = open_(path)
        except sqlite3.DatabaseError as e:
            if not is_damage(e):
                raise
            if not self.rebuilding:
                raise ProjectionUnreadable(path, what, f"it is damaged ({e})",
                                           self.data_dir) from None
            log.warning("%s %s is damaged (%s): deleted, rebuilt from the log", what, path, e)
            for f in sqlite_files(Path(path)):
                remove_file(f)
            store = open_(path)
        return self._opened(store)

    @cached_property
    def embedder(self):
        """The process's embedder: the packaged model ``MNEME_EMBEDDING_MODEL`` names."""
        from mneme.embedding import default_embedder
        return default_embedder(self.settings.embedding_model)

    @cached_property
    def generations(self):
        """The generations of search's stores in this data dir
        (:class:`mneme.generations.Generations`); one left BUILDING by a process that
        stopped is marked FAILED here (this process holds the data dir)."""
        from mneme.generations import Generations, configured
        gens = Generations(self.data_dir, configured(self.settings))
        gens.recover()
        return gens

    @property
    def owns_stores(self) -> bool:
        """True when search's stores are this process's own (embedded, or a replica's
        local files): it switches their generations itself. False with store servers the
        search replicas share (the generation is ``MNEME_STORE_GENERATION``)."""
        from mneme.generations import configured
        return configured(self.settings) is None

    def store_urls(self, generation: int) -> dict[str, str]:
        """kind (vector, text, graph) → the URL of that store of ``generation``
        (:func:`mneme.generations.versioned_url`)."""
        from mneme.generations import versioned_url
        return {k: versioned_url(k, self.settings.url(k), generation)
                for k in ("vector", "text", "graph")}

    def _check_live_stores(self, generation: int) -> None:
        """Embedded: :class:`ProjectionUnreadable` when a local store of the live
        ``generation`` is missing although group ``search`` has consumed the memory topic
        (it would be served empty, and never projected again)."""
        from mneme.bus import MEMORY
        from mneme.generations import local_path
        if self.rebuilding or self.distributed:  # no local files of its own to check
            return

        def absent(p: Path) -> bool:
            # FalkorDB keeps its data in the append-only dir "<file>.aof" and writes
            # "<file>" only at a save point: a hard stop before the first leaves none
            return not p.exists() and not p.with_name(p.name + ".aof").exists()
        missing = [p for p in (local_path(u) for u in self.store_urls(generation).values())
                   if p is not None and absent(p)]
        if missing and self._projected(("search",), MEMORY):
            raise ProjectionUnreadable(str(missing[0]), "search's store", _LOST, self.data_dir)

    def _projected(self, groups: tuple[str, ...], topic: str) -> bool:
        """Embedded, outside a rebuild: True when one of ``groups`` has consumed some of
        ``topic`` (so its projection must exist: the group would not project it again)."""
        if self.rebuilding or self.distributed:
            return False
        events = self.raw_log
        return any(events.committed(g, topic, p) > 0 for g in groups
                   for p in range(events.partitions(topic)))

    def open_stores(self, generation: int):
        """search's three stores of ``generation``, opened (the caller closes them)."""
        from mneme.stores import open_graph_store, open_text_store, open_vector_store
        from services.search.handlers import Projections
        urls = self.store_urls(generation)
        opened = []
        try:
            opened.append(open_vector_store(urls["vector"], dim=self.embedder.dim))
            opened.append(open_text_store(urls["text"]))
            opened.append(open_graph_store(urls["graph"]))
        except BaseException:
            for s in opened:
                s.close()
            raise
        return Projections(*opened, embedding_model=self.embedder.model_name)

    def stored_embedding_model(self) -> str:
        """The model of the live generation's vectors: its generation record's
        (:attr:`mneme.generations.Generation.embedding_model`, set by the switch, so a
        re-embed's switch and its model change are one write), else
        ``<data_dir>/embedding_model`` (written on first use); a data dir with vectors but
        neither predates the choice and holds all-MiniLM-L6-v2's; "" for a new one."""
        from mneme.embedding import MODEL_NAME as LEGACY
        live = self.generations.get(self.generations.live())
        if live is not None and live.embedding_model:
            return live.embedding_model
        mark = self.data_dir / "embedding_model"
        return (mark.read_text().strip() if mark.exists() else
                LEGACY if any(self.data_dir.glob("vectors*")) else "")

    def check_embedding_model(self) -> None:
        """The data dir keeps the embedding model its vectors were made with
        (:meth:`stored_embedding_model`): raises :class:`mneme.errors.ConfigurationError`
        when ``MNEME_EMBEDDING_MODEL`` names another (recall would compare a query of one
        model with vectors of another), unless this Root is a re-embed's
        (``reembedding``). ``<data_dir>/embedding_model`` is written on first use and
        kept equal to the live generation's model. Store servers shared by replicas are
        not checked here (projections refuse events of another model:
        :class:`services.search.handlers.EmbeddingModelMismatch`)."""
        from mneme.errors import ConfigurationError
        if not self.owns_stores:
            return
        if self.reembedding:
            return
        want = self.embedder.model_name
        have = self.stored_embedding_model()
        if have and have != want:
            raise ConfigurationError(
                f"{self.data_dir} holds vectors of embedding model {have!r}, "
                f"MNEME_EMBEDDING_MODEL is {want!r}: set MNEME_EMBEDDING_MODEL={have}, or "
                f"re-embed the data dir with the server stopped: mneme reembed --data-dir "
                f"{self.data_dir} --model {want}")
        mark = self.data_dir / "embedding_model"
        if not mark.exists() or mark.read_text().strip() != want:
            from mneme.datadir import write_atomic
            write_atomic(mark, want + "\n")

    @cached_property
    def stores(self):
        """search's three projections (vector, text, graph) of the live generation, each
        a :class:`mneme.generations.Switchable` (a replay switches them to a new
        generation while they serve)."""
        from mneme.generations import Switchable
        from services.search.handlers import Projections
        self.check_embedding_model()
        self._check_live_stores(self.generations.live())
        live = self.open_stores(self.generations.live())
        # a re-embed's live stores hold the old model's vectors (its new generation the
        # configured one's)
        model = (self.stored_embedding_model() or live.embedding_model if self.reembedding
                 else live.embedding_model)
        stores = Projections(*(Switchable(s) for s in live.all()), embedding_model=model)
        return self._opened(stores, lambda: [s.target.close() for s in stores.all()])

    @cached_property
    def resolver(self):
        """extraction's entity resolver over ``<data_dir>/entities.db``; mentions of an
        entities.db from before they named their memories are refined from the log
        first (:meth:`_refine_mentions`). Embedded, a missing (although extraction has
        consumed the log) or damaged file raises :class:`ProjectionUnreadable`."""
        from mneme.stores.entities_sqlite import SqliteEntityStore
        from services.extraction.resolver import EntityResolver
        path = str(self.data_dir / "entities.db")
        if self.distributed:  # restored on assignment from the changelog (restored.json)
            store = SqliteEntityStore(path)
        else:  # one process, no restore: lost or damaged, `mneme replay -d` rebuilds it
            store = self._local_projection(path, "extraction's entity resolver",
                                           ("extraction",), SqliteEntityStore)
        if store.unrefined_mentions():
            self._refine_mentions(store)
        return EntityResolver(store)

    def _refine_mentions(self, store) -> None:
        """An entities.db written before mentions named their memories (or before it
        recorded mentions at all): which memory names which entity is read from the facts
        on ``mneme.memory.v1`` (opened with the bank keys; erased facts are gone, as their
        memories are), so that deleting content retained before the upgrade forgets the
        names only it gave. Once; a read that stops short of the log's end leaves it for
        the next start."""
        from mneme.bus import MEMORY
        from mneme.bus.codec import decode
        from mneme.bus.sealing import check_opened, erased_record
        from services.extraction.handlers import FactMentions
        seen, events = FactMentions(), self.log
        for p in range(events.partitions(MEMORY)):
            offset, end = 0, events.end_offset(MEMORY, p)
            while offset < end:
                records = events.read(MEMORY, p, offset, 1000)
                if not records:
                    log.warning("entities.db: mentions from before they named their "
                                "memories not refined (%s[%d] read up to %d of %d); "
                                "retried at the next start", MEMORY, p, offset, end)
                    return
                for rec in records:
                    if erased_record(rec):
                        continue
                    try:
                        check_opened(rec)
                        m = decode(rec).message
                    except Exception:  # noqa: BLE001 - dead-lettered by its consumers
                        continue
                    if m is not None:
                        seen.add(m)
                offset = records[-1].offset + 1
        rows = seen.rows()
        dropped = store.refine_mentions(rows)
        log.info("entities.db: mentions per memory recorded from the log (%d mention(s) "
                 "in %d bank(s); %d mention(s) without a memory refined)",
                 sum(map(len, rows.values())), len(rows), dropped)

    @cached_property
    def llm(self):
        """The LLM gateway (``MNEME_LLM_*``); litellm is imported only on a first call."""
        from mneme.llm import LlmGateway, LlmSettings
        return LlmGateway(LlmSettings())

    @cached_property
    def replica(self) -> str:
        """This process's replica id (:func:`mneme.datadir.replica_id` of its data dir)."""
        return replica_id(self.data_dir, self.settings.replica_id or None)

    @property
    def local_stores(self) -> bool:
        """True when any of search's stores is a file of this process (embedded adapters),
        so each search replica keeps its own copy (:attr:`mneme.router.Group.state`)."""
        from mneme.stores import is_local
        return any(is_local(self.settings.url(k)) for k in ("vector", "text", "graph"))

    def group_id(self, group: Group) -> str:
        """The consumer group id ``group`` runs under here: its name, or in the
        distributed topology ``<name>.<replica>`` for a group each replica runs on its
        own (:meth:`mneme.router.Group.per_replica`)."""
        if self.distributed and group.per_replica(self.local_stores):
            return f"{group.name}.{self.replica}"
        if group.state == "stores" and not self.owns_stores:
            return generation_group(group.name, self.settings.store_generation)
        return group.name

    def group_ids(self, own: Iterable[str] = ()) -> dict[str, tuple[str, ...]]:
        """Every consumer group of the topology as the log knows it → its topics
        (:func:`mneme.router.group_ids`): a group run per replica under the id of every
        live replica (a removed replica's copies are not pending work) and of ``own``
        (this process's groups, which may not have committed yet)."""
        known = self.log.groups(live_only=True) if self.distributed else []
        # A group on shared store servers runs under its generation's id (search@g2):
        # looked up by name, listed under that id. Which layout runs is what the log knows
        # (another service's settings may name other stores than search's own).
        live = {g.name: self.group_id(g) for svc in services().values() for g in svc.groups
                if g.state == "stores" and not self.owns_stores}
        by_id = {gid: name for name, gid in live.items()}
        ids = group_ids(services().values(), self.distributed,
                        [by_id.get(k, k) for k in [*known, *own]])
        return {live.get(k, k): t for k, t in ids.items()}

    def bank_config(self, bank_id: str):
        """The bank's config from this process's catalog, or None when unknown here."""
        bank = self.catalog.get_bank(bank_id)
        return bank.config if bank is not None else None

    def own_catalog(self) -> dict[str, Any]:
        """``{"catalog": …, "keyring": …}`` for a service that keeps its own bank catalog
        (distributed topology; the keys tell its projection which deleted facts a mental
        model's observations stood on); {} in the embedded one, where ingest's is shared."""
        if not self.distributed:
            return {}
        self.raw_log  # noqa: B018 - first: the bus settings are checked before the key settings
        return {"catalog": self.catalog, "keyring": self.keyring}

    def close(self) -> None:
        for close in reversed(self._closers):
            try:
                close()
            except Exception:  # keep closing the others
                log.exception("closing an adapter failed")
        self._closers.clear()
        if self._lock_fd is not None:
            unlock(self._lock_fd)
            self._lock_fd = None


@dataclass
class ServiceParts:
    """What one service contributes to a process: a Router per consumer group that runs
    in this topology, a ``register(server) -> [service names]`` for its gRPC servicers
    (None: no API), the objects the servicers call (``api``), readiness checks beyond the
    broker, and ``runner`` (set by the runtime that runs the routers; its
    ``wait_idle(group, timeout)`` lets an API catch up with its own projection)."""

    name: str
    routers: dict[str, Router] = field(default_factory=dict)
    register: Callable[[grpc.Server], list[str]] | None = None
    api: dict = field(default_factory=dict)
    checks: list[Callable[[], bool]] = field(default_factory=list)
    runner: Any = None
    restorers: dict[str, Router] = field(default_factory=dict)


def _routers(root: Root, name: str, **deps) -> dict[str, Router]:
    return {g.name: Router(services()[name], g.name, deps, group_id=root.group_id(g))
            for g in services()[name].groups if g.runs_in(root.distributed)}


def _restorers(root: Root, name: str, **deps) -> dict[str, Router]:
    """The restore routers (:attr:`mneme.router.Group.restore`) of the service's groups
    that keep replica-local state, in the distributed topology (embedded, one process
    owns every partition and its state persists in the data dir)."""
    if not root.distributed:
        return {}
    return {g.name: Router(services()[name], g.name, deps, group_id=root.group_id(g),
                           restore=True)
            for g in services()[name].groups if g.restore}


#: Most directives of a bank reflect reads (the highest priorities of them apply).
MAX_DIRECTIVES_READ = 1_000
#: Seconds a read waits for this replica's own copies to catch up (then it serves them).
CATCH_UP_S = 5.0


def _own_copies(parts: ServiceParts) -> list[Router]:
    """The routers of ``parts`` whose group keeps this replica's own copy."""
    return [r for r in parts.routers.values() if r.group_id != r.group.name]


def _read_your_writes(root: Root, parts: ServiceParts) -> Callable[[str | None], bool]:
    """``catch_up(bank_id)``: before a read of ``bank_id`` (every bank when None), wait
    until this replica's own copies (groups run per replica) have handled every record
    now on the bank's partitions, so a write another replica acknowledged is seen here.
    True when caught up (or there is nothing to catch up), False after
    :data:`CATCH_UP_S`."""
    def catch_up(bank_id: str | None) -> bool:
        if parts.runner is None:  # not consuming yet
            return False
        wanted = {}
        for r in _own_copies(parts):
            tps = wanted[r.group.name] = []
            for t in r.topics:
                n = root.log.partitions(t)
                tps += ([(t, partition_for(bank_id, n))] if bank_id is not None
                        else [(t, p) for p in range(n)])
        if not wanted or parts.runner.catch_up(wanted, CATCH_UP_S):
            return True
        _stale_read(parts.name, bank_id, sorted(wanted))
        return False
    return catch_up


#: Seconds between two log lines of one service about reads served from stale copies
#: (each such read is counted in ``mneme.reads.stale``).
STALE_LOG_INTERVAL_S = 60.0
_stale_logged: dict[str, float] = {}


def _stale_read(service: str, bank_id: str | None, groups: list[str]) -> None:
    """Tell the operator that a read of ``service`` serves copies still behind the log
    after :data:`CATCH_UP_S`: counted every time, logged at most once per
    :data:`STALE_LOG_INTERVAL_S`."""
    import time
    from mneme import telemetry
    telemetry.count_stale_read(service)
    now = time.monotonic()
    if now - _stale_logged.get(service, -STALE_LOG_INTERVAL_S) < STALE_LOG_INTERVAL_S:
        return
    _stale_logged[service] = now
    log.warning("%s: a read of bank %s waited %.0f s for this replica's copies (groups %s) "
                "and serves what they hold: they are behind the log, so it may miss writes "
                "other replicas acknowledged (mneme_consumer_lag of those groups; "
                "mneme_reads_stale_total counts such reads)", service,
                bank_id or "(every bank)", CATCH_UP_S, ", ".join(groups))


def _projected(root: Root, parts: ServiceParts, group: str) -> Callable[[str], bool]:
    """``current(bank_id)``: before a read of ``group``'s projection, wait until the group
    has committed every record now on the bank's partitions (read-your-writes: a retain
    or deletion acknowledged by ingest is seen). In the distributed topology the group
    is this replica's own copy, which the read's bank check caught up already. True when
    caught up, False after :data:`CATCH_UP_S` (the caller serves what it has)."""
    def current(bank_id: str) -> bool:
        r = parts.routers.get(group)
        if r is None or root.distributed:
            return True
        import time
        wanted = []
        for t in r.topics:
            p = partition_for(bank_id, root.log.partitions(t))
            wanted.append((t, p, root.log.end_offset(t, p)))
        end = time.monotonic() + CATCH_UP_S
        while any(root.log.committed(r.group_id, t, p) < e for t, p, e in wanted):
            if time.monotonic() > end:
                _stale_read(parts.name, bank_id, [r.group_id])
                return False
            time.sleep(0.005)
        return True
    return current


def _caught_up_once(parts: ServiceParts) -> Callable[[], bool]:
    """A readiness check: False until this replica's own copies have caught up with the
    log once (a fresh replica rebuilds them first), True from then on."""
    state = {"ready": False}

    def check() -> bool:
        if not state["ready"] and parts.runner is not None:
            state["ready"] = all(parts.runner.wait_idle(r.group.name, 0.0)
                                 for r in _own_copies(parts))
        return state["ready"]
    return check


def build_ingest(root: Root) -> ServiceParts:
    """ingest: the write API and its catalog projection. A sync retain waits until its
    operation's progress is in the catalog, woken by each write of the projection."""
    from mneme.bus import partition_for
    from services.ingest import grpc_api
    from services.ingest.handlers import CatalogChanges, Ingest
    # the partitioner imports aiokafka on first use (~80 ms): paid at start, not by the
    # first retain or GetBankStats (which was 55-66 ms instead of 2-3 on a restarted
    # 100k-fact server)
    partition_for("", 1)
    svc = services()["ingest"]
    catalog = CatalogChanges(root.catalog)  # its writes wake the sync waits
    ingest = Ingest(root.log, catalog, root.settings.retain_timeout_s, llm=root.llm,
                    group=root.group_id(svc.groups[0]), source=svc.source,
                    groups=lambda: root.group_ids([r.group_id for r in parts.routers.values()]),
                    stores=None if root.distributed else root.stores,  # for GetBankStats
                    documents=None if root.distributed else root.documents,  # and profiles
                    keys=root.keyring, wait_projections=not root.distributed,
                    slots=root.wait_slots)
    if not root.rebuilding:  # a deletion a kill or a failed append cut short completes
        ingest.complete_deletions()
    parts = ServiceParts("ingest", _routers(root, "ingest", catalog=catalog, keyring=root.keyring),
                         lambda server: grpc_api.register(server, ingest), {"ingest": ingest})
    if _own_copies(parts):  # replicas each keep a catalog: reads catch up first
        ingest.catch_up = _read_your_writes(root, parts)
        parts.checks.append(_caught_up_once(parts))
    return parts


def build_extraction(root: Root) -> ServiceParts:
    """extraction: intake → facts. Each bank's ``extraction_mode`` picks the LLM
    extractor (when a retain model is configured) or the offline one."""
    from services.extraction.llm import BankModeExtractor, LlmExtractor
    from services.extraction.offline import OfflineExtractor
    llm = None
    if root.llm.configured("retain"):
        llm = root._opened(LlmExtractor(root.llm, resolver=root.resolver,
                                        bank_config=root.bank_config))
    extractor = BankModeExtractor(OfflineExtractor(resolver=root.resolver), llm,
                                  bank_config=root.bank_config)
    from services.extraction.handlers import CancelWatch
    deps = dict(extractor=extractor, embedder=root.embedder, resolver=root.resolver,
                cancels=CancelWatch(root.raw_log), part_bytes=root.part_bytes,
                **root.own_catalog())
    return ServiceParts("extraction", _routers(root, "extraction", **deps),
                        api={"extractor": extractor},  # a re-embed embeds facts as it did
                        restorers=_restorers(root, "extraction", **deps))


def build_search(root: Root, bank_exists: Callable[[str], bool] | None = None) -> ServiceParts:
    """search: the three projections and the Recall / memory read API. Without
    ``bank_exists`` (distributed) unknown banks are looked up in its own catalog."""
    from mneme.embedding import default_token_counter
    from mneme.nlp import QueryAnalyzer
    from services.search import grpc_api
    from services.search.observations import with_default_types
    from services.search.recall import recall
    stores = root.stores
    pool = root._opened(futures.ThreadPoolExecutor(max_workers=4, thread_name_prefix="recall"),
                        lambda: pool.shutdown(wait=False))
    reranker = None
    if root.llm.configured("rerank"):  # cross-encoder over the fused head
        from mneme.llm.rerank import Reranker
        reranker = Reranker(root.llm)
    analyzer, tokens = QueryAnalyzer(), default_token_counter()

    # Observations are units too: recall returns them only when `types` asks for them.
    recall_fn = with_default_types(functools.partial(
        recall, vectors=stores.vectors, text=stores.text, graph=stores.graph,
        embedder=root.embedder, analyzer=analyzer, tokens=tokens, executor=pool,
        reranker=reranker, documents=root.documents))
    parts = ServiceParts("search", _routers(root, "search", stores=stores,
                                            documents=root.documents, **root.own_catalog()))
    documents_current = _projected(root, parts, "search-documents")
    if bank_exists is None:  # its own catalog, projected by its distributed-only group
        catalog, catch_up = root.catalog, _read_your_writes(root, parts)
        parts.checks.append(_caught_up_once(parts))

        def bank_exists(bank_id: str) -> bool:
            # Every read names its bank first: this replica's copies (its catalog, and its
            # stores when they are its own files) catch up with the bank's partitions.
            catch_up(bank_id)
            return catalog.get_bank(bank_id) is not None
    corrections = _entity_corrections(root, parts)
    servicer = grpc_api.RecallServicer(recall_fn, stores.vectors, bank_exists, stores.graph,
                                       corrections, documents=root.documents,
                                       documents_current=documents_current)
    parts.api = {"recall": recall_fn, "bank_exists": bank_exists, "corrections": corrections,
                 "documents": root.documents}
    from mneme.runtime import generations_api
    from mneme.runtime.live_replay import LiveReplay
    svc = services()["search"]

    def make_router(other, group_id: str) -> Router:
        return Router(svc, "search", {"stores": other, **root.own_catalog()}, group_id=group_id)
    # Replays of this process's stores (GenerationService where it owns them: embedded,
    # or a replica's local files; see mneme.runtime.process for store servers).
    replay = root._opened(LiveReplay(root, parts.routers["search"], make_router))
    parts.api["replay"] = replay
    generations = generations_api.GenerationServicer(replay)
    parts.register = lambda server: (grpc_api.register(server, servicer)
                                     + generations_api.register(server, generations))
    return parts


def build_reflect(root: Root, recall: Callable | None = None,
                  bank_exists: Callable[[str], bool] | None = None) -> ServiceParts:
    """reflect: the Reflect API over search's recall, in process (embedded) or, when
    ``recall`` is None, through ``MNEME_SEARCH_ADDRESS`` (which also answers NOT_FOUND).
    Each reflection is recorded on ``mneme.reflect.v1``."""
    from services.reflect import grpc_api
    from services.reflect.agent import ReflectAgent
    from services.reflect.handlers import Reflector
    checks = []
    if recall is None:
        from mneme.grpc_util import ClientTLS
        from services.reflect.remote import RemoteRecall
        if not root.settings.search_address:
            raise ValueError("reflect needs MNEME_SEARCH_ADDRESS (the search service) "
                             "in the distributed topology")
        remote = root._opened(RemoteRecall(root.settings.search_address,
                                           tls=ClientTLS.from_settings(root.settings)))
        recall, checks = remote, [remote.ping]
    exists = bank_exists or (lambda bank_id: True)  # remote: search answers NOT_FOUND
    event_log, source = root.log, services()["reflect"].source
    # Embedded, reflect reads ingest's catalog; distributed, its own copy (group
    # reflect-catalog), caught up with the bank's partition before each read.
    parts = ServiceParts("reflect", checks=checks)
    catch_up = lambda bank_id: True  # noqa: E731 - embedded: the shared catalog is current
    if root.distributed:
        catch_up = _read_your_writes(root, parts)
        parts.checks.append(_caught_up_once(parts))

    def bank_config(bank_id: str):
        catch_up(bank_id)
        return root.bank_config(bank_id)

    def directives(bank_id: str):
        catch_up(bank_id)
        return root.catalog.list_directives(bank_id, MAX_DIRECTIVES_READ)
    from mneme.embedding import default_token_counter  # recall's (loads when first used)
    agent = None
    if root.llm.configured("reflect"):
        from services.search.observations import observation_search
        # observations through the same recall: in process, or search's RecallService
        agent = ReflectAgent(root.llm, recall, bank_config=bank_config,
                             tokens=default_token_counter(),
                             observations=observation_search(recall))
    # a request's max_tokens is capped by the model's output cap, offline as well
    reflector = Reflector(agent, recall, lambda msg: event_log.append(
        [codec.encode(msg, bank_id=msg.bank_id, source=source)]), directives=directives,
        tokens=default_token_counter(), answer_cap=root.llm.settings.llm_max_output_tokens)
    models = _mental_models(root, reflector, catch_up, source)
    reflector.mental_models = models
    from services.reflect.opinions import OpinionFormer
    # opinions are formed only by a model: offline, the follower forms none (and loads
    # no embedder for them)
    opinions = OpinionFormer(root.llm if agent is not None else None,
                             root.embedder if agent is not None else None, bank_config)
    parts.routers = _routers(root, "reflect", mental_models=models, opinions=opinions,
                             **root.own_catalog())
    if agent is not None:
        agent.mental_models = models.search
    # A reflection with a model waits on it (seconds a turn): one of the process's
    # waiting calls. Offline it is a few recalls, as quick as any read.
    slot = root.wait_slots.hold if agent is not None else contextlib.nullcontext
    servicer = grpc_api.ReflectServicer(reflector.reflect, exists, stream=reflector.stream,
                                        slot=slot)
    parts.register = lambda server: grpc_api.register(server, servicer, models)
    parts.api = {"reflect": reflector.reflect, "reflect_stream": reflector.stream,
                 "mental_models": models}
    return parts


#: Seconds a mental-model write waits for the catalog to project it.
PROJECTED_S = 30.0


def _caller_waits(msg) -> None:
    """Before an API write's append (mental models, entity corrections):
    DeadlineExceeded / Cancelled once the caller's deadline has passed or the caller went
    away (:func:`mneme.deadline.current`), so a call already answered with that status
    appends nothing its retry would append again (ingest's writes: ``Ingest._caller_waits``)."""
    from mneme.deadline import current
    current().check(f"{msg.DESCRIPTOR.name} not appended")


def _entity_corrections(root: Root, parts: ServiceParts):
    """search's :class:`services.search.corrections.EntityCorrections`: a correction is
    appended to the intake topic; the call waits until extraction's group has handled it
    (so what it caused is on the bank's memory partition), then until this process's
    search group has handled the bank's memory partition up to there."""
    import time

    from mneme.bus import MEMORY
    from mneme.deadline import current as current_deadline
    from mneme.errors import Cancelled, DeadlineExceeded
    from services.search.corrections import EntityCorrections
    source = services()["search"].source
    extraction = root.group_id(services()["extraction"].group("extraction"))

    def append(msg, bank_id: str):
        _caller_waits(msg)
        return root.log.append([codec.encode(msg, bank_id=bank_id, source=source)])[0]

    def projected(rec, bank_id: str, timeout: float) -> None:
        end_at = time.monotonic() + timeout
        call = current_deadline()

        def until(done: Callable[[], bool], what: str) -> None:
            while not done():
                if time.monotonic() > end_at:
                    raise DeadlineExceeded(f"{what} did not apply the correction within "
                                           f"{timeout:.1f}s; it is on the log and will apply")
                if call.cancelled():  # the caller went away: its thread is free again
                    raise Cancelled(f"{what}: the call was cancelled; the correction is on "
                                    "the log and will apply")
                time.sleep(0.01)
        until(lambda: root.log.committed(extraction, rec.topic, rec.partition) > rec.offset,
              "entity resolution")
        p = partition_for(bank_id, root.log.partitions(MEMORY))
        end = root.log.end_offset(MEMORY, p)
        group = parts.routers["search"].group_id
        until(lambda: root.log.committed(group, MEMORY, p) >= end, "the graph projection")

    return EntityCorrections(append, projected, root.wait_slots.hold)


def _mental_models(root: Root, reflector, catch_up: Callable[[str], Any], source: str):
    """reflect's :class:`services.reflect.mental_models.MentalModels` over this process's
    catalog: embedded, ingest's (a write waits for ingest's group to commit its event);
    distributed, reflect's own copy (a write waits for it to catch up with the bank)."""
    import time

    from mneme.bus import MEMORY
    from mneme.deadline import current as current_deadline
    from mneme.errors import Cancelled, DeadlineExceeded
    from services.reflect.mental_models import MentalModels

    def append(msg, bank_id: str):
        _caller_waits(msg)
        return root.log.append([codec.encode(msg, bank_id=bank_id, source=source)])[0]

    ingest_group = root.group_id(services()["ingest"].group("ingest"))

    def projected(rec, bank_id: str) -> None:
        if root.distributed:
            if not catch_up(bank_id):
                raise DeadlineExceeded(f"bank {bank_id!r}: this reflect replica's catalog "
                                       "did not catch up in time; the change is on the log")
            return
        call = current_deadline()  # the caller's deadline and cancellation bound it too
        left = call.remaining()
        end = time.monotonic() + (PROJECTED_S if left is None else min(PROJECTED_S, left))
        while root.log.committed(ingest_group, rec.topic, rec.partition) <= rec.offset:
            if time.monotonic() > end:
                raise DeadlineExceeded("the catalog did not project the change in time; it "
                                       "is on the log and will apply")
            if call.cancelled():  # the caller went away: its thread and slot are free again
                raise Cancelled("the call was cancelled; the change is on the log and "
                                "will apply")
            time.sleep(0.005)

    def memory_partition(bank_id: str) -> int:
        return partition_for(bank_id, root.raw_log.partitions(MEMORY))

    def memory_end(bank_id: str) -> int:
        return root.raw_log.end_offset(MEMORY, memory_partition(bank_id))

    def memory_read(bank_id: str, start: int, limit: int,
                    opened: bool = False) -> list[tuple[int, Any]]:
        # Staleness needs bank ids and tags only: sealed content stays sealed. A delta
        # refresh quotes the new memories: opened.
        p, out, offset = memory_partition(bank_id), [], start
        log = root.log if opened else root.raw_log
        while offset < start + limit:
            batch = log.read(MEMORY, p, offset, min(500, start + limit - offset))
            if not batch:
                break
            for rec in batch:
                try:
                    msg = codec.decode(rec).message
                except Exception:  # noqa: BLE001 - a record no consumer could read either
                    continue
                if msg is not None:
                    out.append((rec.offset, msg))
            offset = batch[-1].offset + 1
        return out

    return MentalModels(root.catalog, append, projected, catch_up, reflector.reflect,
                        memory_end, memory_read, revise=reflector.revise,
                        embedder=root.embedder, slot=root.wait_slots.hold)


def observations_file(data_dir: Path, generation: int) -> Path:
    """consolidation's projection file of ``generation`` in ``data_dir``:
    ``observations.db`` for 1, ``observations.g<n>.db`` after."""
    from mneme.generations import versioned_file
    return versioned_file(Path(data_dir) / "observations.db", generation)


def adopt_observations_file(data_dir: Path, live: int) -> Path:
    """The live generation's observation file (:func:`observations_file` of ``live``).
    A data dir written before consolidation's projection had generations keeps its state
    in ``observations.db`` while search's stores went on to generation ``live``: that
    file is the live state, so it takes the live name first, and dropping generation 1
    cannot delete it (call with the data dir's lock held)."""
    from mneme.generations import sqlite_files
    base, live_file = observations_file(data_dir, 1), observations_file(data_dir, live)
    if not live_file.exists() and base.exists():
        for src, dst in zip(sqlite_files(base), sqlite_files(live_file)):
            if src.exists():
                src.rename(dst)
    return live_file


def build_consolidation(root: Root, decide: bool = True) -> ServiceParts:
    """consolidation: facts → ObservationsChanged, over its projection
    ``<data_dir>/observations.db``. Decisions use the "consolidation" model when one is
    configured, else the offline rules; ``decide=False`` (replay) only rebuilds it.

    The projection is a generation (``observations.g<n>.db`` for n > 1), rebuilt by a
    replay while it serves and switched through ``api["follower"]``
    (:class:`mneme.runtime.live_replay.Follower`). Embedded, it is part of the
    generation of search's stores (search's replay builds and switches both).
    Distributed, it is replica-local state, restored on partition assignment, with
    generations of its own in this replica's data dir: ``api["replay"]`` (a
    :class:`~mneme.runtime.live_replay.LiveReplay` of the follower alone, served as
    GenerationService) rebuilds it from the log, every partition up to where its
    group is, and switches."""
    from mneme.generations import Generations, Switchable
    from mneme.runtime.live_replay import Follower, LiveReplay
    from mneme.stores.observations_sqlite import SqliteObservationStore
    from services.consolidation.handlers import Consolidator
    base = observations_file(root.data_dir, 1)
    # Distributed, this data dir's generations are consolidation's own (search's stores,
    # and MNEME_STORE_GENERATION, belong to other processes).
    generations = Generations(root.data_dir) if root.distributed else root.generations
    if root.distributed:  # a replay this replica was running when it stopped has ended
        generations.recover()

    def path(g: int) -> Path:
        return observations_file(root.data_dir, g)
    live_file = adopt_observations_file(root.data_dir, generations.live())
    store = Switchable(SqliteObservationStore(str(live_file)))
    root._opened(store, lambda: store.target.close())
    parts = ServiceParts("consolidation", api={"observations": store})
    bank_config = root.bank_config
    if root.distributed:  # its own catalog copy: a bank it does not know yet catches up
        catch_up = _read_your_writes(root, parts)

        def bank_config(bank_id: str):
            return root.bank_config(bank_id) or (catch_up(bank_id) and root.bank_config(bank_id))
    # the model of the store's vectors (a re-embed's VectorsReplaced of another is not
    # applied); a name only: no model is loaded for it
    model = root.embedder.model_name
    consolidator = Consolidator(store, bank_config, embedder=root.embedder if decide else None,
                                llm=root.llm if decide else None, embedding_model=model,
                                part_bytes=root.part_bytes)
    deps = dict(consolidator=consolidator, decide=decide, **root.own_catalog())
    parts.routers = _routers(root, "consolidation", **deps)
    parts.restorers = _restorers(root, "consolidation", **deps)
    svc = services()["consolidation"]

    def make_router(other, group_id: str) -> Router:
        # its restore handlers: the recorded decisions applied, nothing decided
        return Router(svc, "consolidation", {"consolidator": Consolidator(
            other, bank_config, embedding_model=model), **root.own_catalog()},
            group_id=group_id, restore=True)
    follower = parts.api["follower"] = Follower(
        router=parts.routers["consolidation"], make_router=make_router,
        open=lambda g: SqliteObservationStore(str(path(g)), durable=False), path=path,
        live=store,
        # replicas share the group "consolidation": each builds under its own
        suffix=f".{root.replica}" if root.distributed else "")
    if root.distributed:  # served as GenerationService (mneme.runtime.process)
        parts.api["replay"] = root._opened(LiveReplay(
            root, None, None, followers=[follower], generations=generations))
    return parts


BUILDERS: dict[str, Callable[[Root], ServiceParts]] = {
    "ingest": build_ingest, "extraction": build_extraction, "search": build_search,
    "reflect": build_reflect, "consolidation": build_consolidation,
}
