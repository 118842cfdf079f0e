"""The composition root: wires adapters into the services' handlers once.

:class:`Root` opens what the settings name (event log, stores, models), lazily and at
most once; one builder per service (:data:`BUILDERS`) turns a Root into that service's
:class:`ServiceParts` (consumer groups and gRPC servicers). Two topologies use them:

* embedded (``mneme up``, :func:`bootstrap`): ingest, extraction, search, consolidation
  (and reflect, calling search in process) in one process over the embedded log and stores, every
  gRPC API on one port;
* distributed (``mneme serve <service>``, ``python -m services.<service>``,
  :func:`run_service`): one service per process over Kafka (``MNEME_BUS_URL=kafka://…``),
  each with its own data directory for local state, gRPC health and readiness.
"""

from __future__ import annotations

import fcntl
import functools
import logging
import os
import signal
import threading
import time
from concurrent import futures
from dataclasses import dataclass, field
from functools import cached_property
from pathlib import Path
from typing import Callable

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from mneme.bus import (AUDIT, DLQ, INTAKE, MEMORY, PROGRESS, REFLECT, default_partitions,
                       open_event_log)
from mneme.bus.consumer import Consumer
from mneme.config import Settings
from mneme.errors import InvalidArgument, Unavailable

log = logging.getLogger("mneme")

TOPICS = (INTAKE, MEMORY, PROGRESS, REFLECT, DLQ, AUDIT)
SERVICES = ("ingest", "extraction", "search", "reflect", "consolidation")
_SERVING = health_pb2.HealthCheckResponse.SERVING
_NOT_SERVING = health_pb2.HealthCheckResponse.NOT_SERVING


def _path(url: str) -> str:
    return url.split("://", 1)[1] if "://" in url else url


class DataDirLocked(RuntimeError):
    """Another process holds the data directory (the embedded stores are single-process)."""


def _lock(data_dir: Path) -> int:
    fd = os.open(data_dir / "LOCK", os.O_RDWR | os.O_CREAT, 0o644)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        os.close(fd)
        raise DataDirLocked(f"{data_dir} is in use by another mneme process "
                            "(stop `mneme up` first)") from None
    return fd


# ---- the composition root ---------------------------------------------------------------


class Root:
    """Settings plus every adapter they name, opened on first use and closed by
    :meth:`close` (in reverse order of opening). Locks ``settings.data_dir`` (raises
    DataDirLocked when another process holds it). Opening the event log connects to the
    broker for a Kafka URL (ConnectionError after ``kafka_connect_timeout_s``)."""

    def __init__(self, settings: Settings | None = None) -> None:
        self.settings = settings or Settings()
        self.data_dir = self.settings.data_dir.resolve()
        self.data_dir.mkdir(parents=True, exist_ok=True)
        self._lock_fd: int | None = _lock(self.data_dir)
        self._closers: list[Callable[[], None]] = []

    def _opened(self, obj, close: Callable[[], None] | None = None):
        self._closers.append(close or obj.close)
        return obj

    @property
    def distributed(self) -> bool:
        """True when the event log is Kafka (one service per process)."""
        return self.settings.url("bus").lower().startswith("kafka:")

    @cached_property
    def log(self):
        """The event log, with mneme's topics created."""
        st = self.settings
        event_log = self._opened(open_event_log(st.url("bus"), **st.kafka_options()))
        for t in TOPICS:
            event_log.ensure_topic(t, 1 if t in (DLQ, AUDIT)
                                   else st.partitions or default_partitions(t))
        return event_log

    @cached_property
    def catalog(self):
        """The local catalog (banks, operations): ingest's projection, or search's bank
        list in the distributed topology."""
        from mneme.stores.catalog_sqlite import SqliteCatalog
        return self._opened(SqliteCatalog(_path(self.settings.url("catalog"))))

    @cached_property
    def embedder(self):
        from mneme.embedding import default_embedder
        return default_embedder()

    @cached_property
    def stores(self):
        """search's three projections (vector, text, graph), by URL."""
        from mneme.stores import open_graph_store, open_text_store, open_vector_store
        from services.search.handlers import Projections
        st = self.settings
        stores = Projections(open_vector_store(st.url("vector"), dim=self.embedder.dim),
                             open_text_store(st.url("text")), open_graph_store(st.url("graph")))
        return self._opened(stores, lambda: [s.close() for s in stores.all()])

    @cached_property
    def resolver(self):
        from mneme.stores.entities_sqlite import SqliteEntityStore
        from services.extraction.resolver import EntityResolver
        return EntityResolver(SqliteEntityStore(str(self.data_dir / "entities.db")))

    @cached_property
    def llm(self):
        """The LLM gateway (``MNEME_LLM_*``); litellm is imported only on a first call."""
        from mneme.llm import LlmGateway, LlmSettings
        return LlmGateway(LlmSettings())

    def bank_config(self, bank_id: str):
        """The bank's config from this process's catalog, or None when unknown here."""
        bank = self.catalog.get_bank(bank_id)
        return bank.config if bank is not None else None

    def consumer(self, group: str, topics, handler) -> Consumer:
        """A consumer of ``group`` on this root's log (not started)."""
        return Consumer(self.log, group, topics, handler)

    def close(self) -> None:
        for close in reversed(self._closers):
            try:
                close()
            except Exception:  # keep closing the others
                log.exception("closing an adapter failed")
        self._closers.clear()
        if self._lock_fd is not None:
            os.close(self._lock_fd)
            self._lock_fd = None


@dataclass
class ServiceParts:
    """What one service contributes to a process: its consumer groups (by group name),
    a ``register(server) -> [service names]`` for its gRPC servicers (None: no API),
    the objects the servicers call (``api``), and readiness checks beyond the broker."""

    name: str
    consumers: dict[str, Consumer] = field(default_factory=dict)
    register: Callable[[grpc.Server], list[str]] | None = None
    api: dict = field(default_factory=dict)
    checks: list[Callable[[], bool]] = field(default_factory=list)


def build_ingest(root: Root) -> ServiceParts:
    """ingest: the write API and its catalog projection (group ``ingest`` over intake
    and progress). Sync retains wait for progress events in the catalog."""
    from services.ingest import grpc_api
    from services.ingest.handlers import GROUP, Ingest, project_catalog

    ingest = Ingest(root.log, root.catalog, root.settings.retain_timeout_s, llm=root.llm)
    return ServiceParts(
        "ingest", {GROUP: root.consumer(GROUP, [INTAKE, PROGRESS],
                                        functools.partial(project_catalog, catalog=root.catalog))},
        lambda server: grpc_api.register(server, ingest), {"ingest": ingest})


def build_extraction(root: Root) -> ServiceParts:
    """extraction: group ``extraction`` over intake → facts on ``mneme.memory.v1``.
    Each bank's ``extraction_mode`` picks the LLM extractor (when a retain model is
    configured) or the offline one; in the distributed topology extraction projects
    bank configs into its own catalog from the same intake partition."""
    from services.extraction.handlers import GROUP, handle_intake
    from services.extraction.llm import BankModeExtractor, LlmExtractor
    from services.extraction.offline import OfflineExtractor

    llm = None
    if root.llm.configured("retain"):
        llm = root._opened(LlmExtractor(root.llm, resolver=root.resolver,
                                        bank_config=root.bank_config))
    extractor = BankModeExtractor(OfflineExtractor(resolver=root.resolver), llm,
                                  bank_config=root.bank_config)
    handler = functools.partial(handle_intake, extractor=extractor, embedder=root.embedder,
                                resolver=root.resolver,
                                catalog=root.catalog if root.distributed else None)
    return ServiceParts("extraction", {GROUP: root.consumer(GROUP, [INTAKE], handler)})


def build_search(root: Root, bank_exists: Callable[[str], bool] | None = None) -> ServiceParts:
    """search: group ``search`` over memory → the three projections (+ progress), and
    the Recall / memory read API. Without ``bank_exists`` (distributed topology) search
    keeps its own bank catalog, group ``search-catalog`` over intake."""
    from mneme.embedding import default_token_counter
    from mneme.nlp import QueryAnalyzer
    from services.search import grpc_api
    from mneme.bank_catalog import project_banks
    from services.search.handlers import CATALOG_GROUP, GROUP, project_memory
    from services.search.recall import recall

    stores = root.stores
    pool = futures.ThreadPoolExecutor(max_workers=4, thread_name_prefix="recall")
    root._opened(pool, lambda: pool.shutdown(wait=False))
    from services.search.observations import with_default_types
    # Observations are units too: recall returns them only when `types` asks for them.
    reranker = None
    if root.llm.configured("rerank"):  # cross-encoder over the fused head
        from mneme.llm.rerank import Reranker
        reranker = Reranker(root.llm)
    recall_fn = with_default_types(functools.partial(
        recall, vectors=stores.vectors, text=stores.text, graph=stores.graph,
        embedder=root.embedder, analyzer=QueryAnalyzer(), tokens=default_token_counter(),
        executor=pool, reranker=reranker))
    consumers = {GROUP: root.consumer(GROUP, [MEMORY],
                                      functools.partial(project_memory, stores=stores))}
    if bank_exists is None:
        catalog = root.catalog
        banks = root.consumer(CATALOG_GROUP, [INTAKE],
                              functools.partial(project_banks, catalog=catalog))
        consumers[CATALOG_GROUP] = banks

        def bank_exists(bank_id: str) -> bool:
            if catalog.get_bank(bank_id) is not None:
                return True
            # A bank created a moment ago may not be projected here yet: catch up briefly.
            return banks.wait_idle(2.0) and catalog.get_bank(bank_id) is not None

    servicer = grpc_api.RecallServicer(recall_fn, stores.vectors, bank_exists)
    return ServiceParts("search", consumers, lambda server: grpc_api.register(server, servicer),
                        {"recall": recall_fn, "bank_exists": bank_exists})


def build_reflect(root: Root, recall: Callable | None = None,
                  bank_exists: Callable[[str], bool] | None = None) -> ServiceParts:
    """reflect: the Reflect API. ``recall`` is search's in process (embedded) or, when
    None, a gRPC client of ``MNEME_SEARCH_ADDRESS`` (which then also answers NOT_FOUND
    for unknown banks). Reflections are appended to ``mneme.reflect.v1``."""
    from services.reflect import grpc_api
    from services.reflect.agent import Done, ReflectAgent
    from services.reflect.handlers import record_reflection, reflect_offline

    checks = []
    if recall is None:
        from services.reflect.remote import RemoteRecall
        if not root.settings.search_address:
            raise ValueError("reflect needs MNEME_SEARCH_ADDRESS (the search service) "
                             "in the distributed topology")
        remote = root._opened(RemoteRecall(root.settings.search_address))
        recall, checks = remote, [remote.ping]
    exists = bank_exists or (lambda bank_id: True)  # remote: search answers NOT_FOUND
    event_log = root.log

    agent = None
    if root.llm.configured("reflect"):
        from mneme.embedding import default_token_counter
        # Bank traits: from this process's catalog when it has one (embedded); the
        # distributed reflect process has none, so traits default to 3/3/3.
        from services.search.observations import observation_search
        # Observations through search's recall in process (embedded); the distributed
        # reflect has none yet (its remote recall speaks facts only).
        agent = ReflectAgent(root.llm, recall, bank_config=root.bank_config if bank_exists else None,
                             tokens=default_token_counter(),
                             **({"observations": observation_search(recall)} if bank_exists else {}))

    def reflect_fn(bank_id, query, context, budget, now, response_schema=None):
        if agent is None and response_schema is not None:
            raise InvalidArgument("response_schema", "needs a reflect model "
                                  "(MNEME_REFLECT_LLM_MODEL or MNEME_LLM_MODEL)")
        r = (agent(bank_id, query, context, budget, now, response_schema) if agent
             else reflect_offline(bank_id, query, context, budget, now, recall))
        event_log.append([record_reflection(bank_id, query, r)])
        return r

    def reflect_stream(bank_id, query, context, budget, now, response_schema=None):
        if agent is None:
            yield Done(reflect_fn(bank_id, query, context, budget, now, response_schema))
            return
        for event in agent.stream(bank_id, query, context, budget, now, response_schema):
            if isinstance(event, Done):
                event_log.append([record_reflection(bank_id, query, event.reflection)])
            yield event

    servicer = grpc_api.ReflectServicer(reflect_fn, exists, stream=reflect_stream)
    return ServiceParts("reflect", {}, lambda server: grpc_api.register(server, servicer),
                        {"reflect": reflect_fn, "reflect_stream": reflect_stream}, checks)


def build_consolidation(root: Root, decide: bool = True) -> ServiceParts:
    """consolidation: group ``consolidation`` over memory and intake → ObservationsChanged.
    Its projection is ``<data_dir>/observations.db``; bank configs come from the embedded
    catalog, or (distributed) from its own catalog projected from intake. Decisions use
    the "consolidation" model when one is configured, else the offline rules.
    ``decide=False`` (replay) only rebuilds the projection."""
    from services.consolidation.handlers import GROUP, Consolidator, handle
    from mneme.stores.observations_sqlite import SqliteObservationStore

    store = root._opened(SqliteObservationStore(str(root.data_dir / "observations.db")))
    consolidator = Consolidator(store, root.bank_config, embedder=root.embedder if decide else None,
                                llm=root.llm if decide else None,
                                catalog=root.catalog if root.distributed else None)
    handler = functools.partial(handle, consolidator=consolidator, decide=decide)
    return ServiceParts("consolidation", {GROUP: root.consumer(GROUP, [MEMORY, INTAKE], handler)},
                        api={"observations": store})


BUILDERS: dict[str, Callable[[Root], ServiceParts]] = {
    "ingest": build_ingest, "extraction": build_extraction, "search": build_search,
    "reflect": build_reflect, "consolidation": build_consolidation,
}


def _guard(settings: Settings):
    """The gRPC auth interceptor of ``MNEME_AUTH_MODE`` (see :mod:`mneme.auth`); its
    ``audit`` is set once the event log is open (:func:`_audit_to`)."""
    from mneme import auth
    keys = (auth.KeyStore(auth.default_keys_file(settings))
            if settings.auth_mode != "open" else None)
    return auth.AuthInterceptor(settings.auth_mode, keys)


def _audit_to(event_log) -> Callable:
    """Append AuditRecorded messages to ``mneme.audit.v1`` (key: the bank, or "_")."""
    from mneme.bus import codec

    def append(msg) -> None:
        event_log.append([codec.encode(msg, bank_id=msg.bank_id or "_", source="mneme/auth")])
    return append


def _grpc_server(settings: Settings, guard=None) -> grpc.Server:
    """A gRPC server with the tracing interceptor (spans, ``rpc.server.duration``),
    inside it ``guard`` (authentication, authorisation, audit), and innermost the
    request limits (:class:`mneme.grpc_util.ValidationInterceptor`). Requests larger
    than ``MNEME_LIMIT_REQUEST_BYTES`` are refused by gRPC itself (RESOURCE_EXHAUSTED)."""
    from mneme import telemetry
    from mneme.grpc_util import ValidationInterceptor
    from mneme.limits import limits
    interceptors = ([telemetry.TracingInterceptor()] + ([guard] if guard is not None else [])
                    + [ValidationInterceptor()])
    return grpc.server(futures.ThreadPoolExecutor(max_workers=settings.grpc_workers),
                       interceptors=interceptors,
                       options=[("grpc.max_receive_message_length", limits().request_bytes),
                                ("grpc.max_send_message_length", 64 << 20)])


def _bind(server: grpc.Server, address: str, settings: Settings) -> int:
    """Listen on ``address``: TLS requiring a client certificate for ``mtls``, plaintext
    otherwise. Returns the port (0 when it cannot bind)."""
    if settings.auth_mode != "mtls":
        return server.add_insecure_port(address)
    if not (settings.tls_cert and settings.tls_key and settings.tls_client_ca):
        raise ValueError("MNEME_AUTH_MODE=mtls needs MNEME_TLS_CERT, MNEME_TLS_KEY and "
                         "MNEME_TLS_CLIENT_CA")
    read = lambda p: Path(p).read_bytes()  # noqa: E731
    creds = grpc.ssl_server_credentials([(read(settings.tls_key), read(settings.tls_cert))],
                                        root_certificates=read(settings.tls_client_ca),
                                        require_client_auth=True)
    return server.add_secure_port(address, creds)


def setup_telemetry(service_name: str, settings: Settings) -> dict:
    """OpenTelemetry for this process (:func:`mneme.telemetry.setup`): the Prometheus
    endpoint on ``MNEME_METRICS_PORT`` at the gRPC listen host (all interfaces for a
    wildcard address)."""
    from mneme import telemetry
    host = settings.grpc_address.rsplit(":", 1)[0].strip("[]")
    host = "0.0.0.0" if host in ("", "::", "0.0.0.0", "*") else host
    return telemetry.setup(service_name, metrics_port=settings.metrics_port, metrics_host=host)


def _add_health(server: grpc.Server, names: list[str], status) -> health.HealthServicer:
    servicer = health.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(servicer, server)
    for n in names + [""]:
        servicer.set(n, status)
    reflection.enable_server_reflection(
        names + [health.SERVICE_NAME, reflection.SERVICE_NAME], server)
    return servicer


# ---- embedded topology --------------------------------------------------------------------


@dataclass
class Embedded:
    """Every service of mneme in one process. Build with :func:`bootstrap`; ``start()``
    runs the consumers, ``serve()`` the gRPC server; ``close()`` stops both."""

    settings: Settings
    log: object
    catalog: object
    stores: object
    ingest: object
    recall: object
    reflect: object
    consumers: dict = field(default_factory=dict)
    server: grpc.Server | None = None
    root: Root | None = None
    parts: list[ServiceParts] = field(default_factory=list)
    _closing: threading.Event = field(default_factory=threading.Event, repr=False)

    def start(self, groups: tuple[str, ...] | None = None) -> None:
        for name, c in self.consumers.items():
            if groups is None or name in groups:
                c.start()

    def wait_idle(self, timeout: float = 600.0) -> bool:
        return all(c.wait_idle(timeout) for c in self.consumers.values())

    def serve(self, address: str | None = None) -> int:
        """Start the gRPC server (every API, health, reflection); returns the bound port."""
        guard = _guard(self.settings)
        guard.audit = _audit_to(self.log)
        server = _grpc_server(self.settings, guard)
        names = [n for p in self.parts if p.register for n in p.register(server)]
        health_servicer = _add_health(server, names, _SERVING)
        port = _bind(server, address or self.settings.grpc_address, self.settings)
        if port == 0:
            raise RuntimeError(f"cannot bind {address or self.settings.grpc_address}")
        server.start()
        self.server = server
        threading.Thread(target=self._watch_log, args=(health_servicer, names),
                         name="log-health", daemon=True).start()
        return port

    def _watch_log(self, servicer: health.HealthServicer, names: list[str]) -> None:
        """Health NOT_SERVING for good once the event log reports damage (its
        ``check()``, a stat and a header read, at most every second): the data on disk
        can no longer be trusted, and only a restart after recovery clears it."""
        check = getattr(self.log, "check", None)
        if check is None:
            return
        while not self._closing.wait(min(self.settings.health_interval_s, 1.0)):
            try:
                problem = check()
            except Exception as exc:  # a probe that fails says the same
                problem = repr(exc)
            if problem:
                log.error("event log damaged (%s): health NOT_SERVING; writes fail with "
                          "UNAVAILABLE", problem)
                for n in names + [""]:
                    servicer.set(n, _NOT_SERVING)
                return

    def close(self) -> None:
        self._closing.set()
        if self.server is not None:
            self.server.stop(grace=5).wait()
        for c in self.consumers.values():
            c.stop(timeout=30)
        if self.root is not None:
            self.root.close()


def bootstrap(settings: Settings | None = None) -> Embedded:
    """The embedded topology: open every adapter named by ``settings`` and wire ingest,
    extraction, search and reflect into one process (nothing runs yet). Raises
    DataDirLocked when another process uses the data directory."""
    root = Root(settings)
    try:
        ingest = build_ingest(root)
        exists = lambda bank_id: root.catalog.get_bank(bank_id) is not None  # noqa: E731
        search = build_search(root, bank_exists=exists)
        reflect = build_reflect(root, recall=search.api["recall"], bank_exists=exists)
        parts = [ingest, build_extraction(root), search, reflect, build_consolidation(root)]
    except BaseException:
        root.close()
        raise
    consumers = {g: c for p in parts for g, c in p.consumers.items()}
    ingest.api["ingest"].stores = root.stores  # GetBankStats counts facts and entities
    from services.ingest.stats import GROUPS  # …and the lag of the groups that run here
    ingest.api["ingest"].groups = {g: GROUPS[g] for g in consumers if g in GROUPS}
    return Embedded(settings=root.settings, log=root.log, catalog=root.catalog,
                    stores=root.stores, ingest=ingest.api["ingest"], recall=search.api["recall"],
                    reflect=reflect.api["reflect"], consumers=consumers, root=root, parts=parts)


# ---- replay ---------------------------------------------------------------------------------


def _drain(consumers: dict[str, Consumer], progress, total: int) -> int:
    """Run ``consumers`` in this thread, projecting only (their outputs are already on
    the log), until each has consumed its partitions to the end."""
    done = 0
    for c in consumers.values():
        handler = c.handler
        c.handler = lambda env, rec, h=handler: (h(env, rec), [])[1]  # project only
        c.produce = False  # not even a dead letter: a failed replay appends nothing
        try:
            while True:
                n = c.run_once()
                done += n
                if progress and n:
                    progress(done, max(total, done))
                if n == 0:
                    if c._caught_up():
                        break
                    c.member.wait(0.2, c.member.token())  # Kafka: the group join, fetches
        finally:
            c.leave()
    return done


def replay(settings: Settings | None = None, progress=None) -> dict[str, int]:
    """Rebuild projections from the log; no model is called (derived events carry the
    facts and embeddings) and nothing is appended (the progress events the projections
    would emit are already on the log). ``progress(done, total)`` is called as records
    are consumed. Returns {"records": n}.

    * Embedded (sqlite bus): the search stores (observations included), the catalog and
      consolidation's observation projection of the (stopped) server's data dir; groups
      ``search``, ``ingest`` and ``consolidation`` (projection only). Raises DataDirLocked while a server
      uses the data directory.
    * Distributed (kafka bus): the search service's projections (the stores its
      ``MNEME_*_URL``s name) and its bank catalog, groups ``search`` and
      ``search-catalog``, reset to offset 0. Stop the search processes first: Kafka
      refuses to reset a group with active members (StaleCommitError)."""
    root = Root(settings)
    try:
        if root.distributed:
            parts = build_search(root)
        else:
            parts = build_ingest(root)
            parts.consumers.update(build_search(root, bank_exists=lambda b: True).consumers)
            # consolidation's projection: recorded decisions only, no model
            cons = build_consolidation(root, decide=False)
            parts.consumers.update(cons.consumers)
            cons.api["observations"].reset()
        root.stores.reset()
        root.catalog.reset()
        groups = {g: c for g, c in parts.consumers.items()
                  if g in ("search", "ingest", "search-catalog", "consolidation")}
        total = 0
        for name, c in groups.items():
            root.log.reset_group(name, c.topics)
            total += sum(root.log.end_offset(t, p) for t in c.topics
                         for p in range(root.log.partitions(t)))
        done = _drain(groups, progress, total)
        if progress:
            progress(total, total)
        return {"records": done}
    finally:
        root.close()


# ---- distributed topology: one service per process ---------------------------------------


class _Pending:
    """Stands in for a service object until the process is ready: every use raises
    :class:`mneme.errors.Unavailable` (gRPC UNAVAILABLE), so early calls fail fast."""

    def __init__(self, what: str) -> None:
        self._what = what
        self._target = None

    def set(self, target) -> None:
        self._target = target

    def _get(self):
        if self._target is None:
            raise Unavailable(f"{self._what} is starting (broker or stores not reachable yet)")
        return self._target

    def __getattr__(self, name: str):
        if name.startswith("_"):
            raise AttributeError(name)
        return getattr(self._get(), name)

    def __call__(self, *args, **kwargs):
        return self._get()(*args, **kwargs)


class ServiceProcess:
    """One service in its own process (distributed topology).

    Lifecycle: :meth:`start` binds gRPC at once with health NOT_SERVING and the
    service's API answering UNAVAILABLE, connects to the broker and opens the stores
    (retrying until they answer or :meth:`stop` is called), starts the consumer groups
    and turns health SERVING. A monitor thread re-checks the broker (and, for reflect,
    search) every ``health_interval_s`` and flips health accordingly. :meth:`stop`
    (SIGTERM) turns health NOT_SERVING, stops accepting gRPC calls and lets in-flight
    ones finish for ``shutdown_grace_s``, then stops each consumer after the record in
    hand (committing what it handled, leaving the group) and closes the adapters.
    """

    def __init__(self, name: str, settings: Settings | None = None) -> None:
        if name not in BUILDERS:
            raise ValueError(f"unknown service {name!r} (one of {', '.join(SERVICES)})")
        self.name = name
        self.settings = settings or Settings()
        self.root: Root | None = None
        self.parts: ServiceParts | None = None
        self.server: grpc.Server | None = None
        self.port = 0
        self.ready = threading.Event()
        self._stop = threading.Event()
        self._health: health.HealthServicer | None = None
        self._names: list[str] = []

    def _set_health(self, status) -> None:
        if self._health is not None:
            for n in self._names + [""]:
                self._health.set(n, status)

    def bind(self) -> int:
        """Start the gRPC server (health NOT_SERVING, API UNAVAILABLE); returns the port."""
        self._pending = {k: _Pending(self.name) for k in ("ingest", "recall", "vectors",
                                                           "exists", "reflect", "reflect_stream",
                                                           )}
        self._guard = _guard(self.settings)
        server = _grpc_server(self.settings, self._guard)
        p = self._pending
        if self.name == "ingest":
            from services.ingest import grpc_api
            self._names = grpc_api.register(server, p["ingest"])
        elif self.name == "search":
            from services.search import grpc_api
            self._names = grpc_api.register(server, grpc_api.RecallServicer(
                p["recall"], p["vectors"], p["exists"]))
        elif self.name == "reflect":
            from services.reflect import grpc_api
            self._names = grpc_api.register(server, grpc_api.ReflectServicer(
                p["reflect"], lambda bank_id: True, stream=p["reflect_stream"]))
        self._health = _add_health(server, self._names, _NOT_SERVING)
        self.port = _bind(server, self.settings.grpc_address, self.settings)
        if self.port == 0:
            raise RuntimeError(f"cannot bind {self.settings.grpc_address}")
        server.start()
        self.server = server
        return self.port

    def start(self) -> None:
        """Bind, connect (retrying), build, start the consumers, report SERVING.
        Returns early (not ready) when :meth:`stop` is called meanwhile."""
        if self.server is None:
            self.bind()
        while not self._stop.is_set():
            root = Root(self.settings)  # DataDirLocked is fatal
            try:
                self.parts = BUILDERS[self.name](root)
                root.log  # connect now (the builders of API-only services may not)
                break
            except ValueError:  # configuration errors are fatal
                root.close()
                raise
            except Exception as exc:  # broker or store not reachable: retry
                root.close()
                log.warning("%s: dependencies not reachable yet (%r); retrying", self.name, exc)
                self._stop.wait(2.0)
        else:
            return
        self.root = root
        self._guard.audit = _audit_to(root.log)
        api, p = self.parts.api, self._pending
        if "ingest" in api:
            p["ingest"].set(api["ingest"])
        if "recall" in api:
            p["recall"].set(api["recall"])
            p["vectors"].set(root.stores.vectors)
            p["exists"].set(api["bank_exists"])
        if "reflect" in api:
            p["reflect"].set(api["reflect"])
            p["reflect_stream"].set(api["reflect_stream"])
        for c in self.parts.consumers.values():
            c.start()
        self._set_health(_SERVING)
        self.ready.set()
        threading.Thread(target=self._monitor, name="health", daemon=True).start()
        log.info("%s is ready on port %d (groups: %s)", self.name, self.port,
                 ", ".join(self.parts.consumers) or "none")

    def _healthy(self) -> bool:
        ping = getattr(self.root.log, "ping", None)
        ok = ping() if ping is not None else True
        return ok and all(check() for check in self.parts.checks)

    def _monitor(self) -> None:
        serving = True
        while not self._stop.wait(self.settings.health_interval_s):
            ok = self._healthy()
            if ok != serving and not self._stop.is_set():
                log.warning("%s: dependencies %s", self.name, "back" if ok else "unreachable")
                self._set_health(_SERVING if ok else _NOT_SERVING)
                serving = ok

    def stop(self) -> None:
        """Graceful shutdown (see the class docstring). Idempotent."""
        if self._stop.is_set() and self.server is None:
            return
        self._stop.set()
        self._set_health(_NOT_SERVING)
        if self.server is not None:
            self.server.stop(grace=self.settings.shutdown_grace_s).wait()
            self.server = None
        if self.parts is not None:
            for c in self.parts.consumers.values():
                c.stop(timeout=30)
        if self.root is not None:
            self.root.close()
            self.root = None


def run_service(name: str, settings: Settings | None = None) -> None:
    """Run service ``name`` until SIGTERM/SIGINT, then shut down gracefully."""
    proc = ServiceProcess(name, settings)
    setup_telemetry(f"mneme-{name}", proc.settings)
    stop = threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: stop.set())
    proc.bind()
    failed: list[BaseException] = []

    def start() -> None:
        try:
            proc.start()
        except BaseException as exc:  # fatal (configuration, data dir locked)
            log.exception("%s: cannot start", name)
            failed.append(exc)
            stop.set()

    starter = threading.Thread(target=start, name="start", daemon=True)
    starter.start()
    stop.wait()
    log.info("%s: stopping (drain, commit, close)", name)
    proc.stop()
    starter.join(5)
    if failed:
        raise SystemExit(1)


def main_service(name: str) -> None:
    """Entry point of ``python -m services.<name>``: logging, settings from MNEME_*."""
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    logging.basicConfig(level=os.environ.get("MNEME_LOG_LEVEL", "INFO"),
                        format=f"%(asctime)s %(levelname)s {name} %(name)s: %(message)s")
    run_service(name)
