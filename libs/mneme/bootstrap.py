"""The composition root (``bootstrap``): wires adapters into the services' handlers once.

The embedded topology (``mneme up``) runs every service in one process over the
embedded event log and stores, and serves every gRPC API on one port.
"""

from __future__ import annotations

import fcntl
import functools
import logging
import os
from concurrent import futures
from dataclasses import dataclass, field
from pathlib import Path

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from mneme.bus import (DLQ, INTAKE, MEMORY, PROGRESS, REFLECT, default_partitions,
                       open_event_log)
from mneme.bus.consumer import Consumer, Dispatcher
from mneme.config import Settings
from mneme.stores import open_graph_store, open_text_store, open_vector_store
from mneme.stores.catalog_sqlite import SqliteCatalog

log = logging.getLogger("mneme")

TOPICS = (INTAKE, MEMORY, PROGRESS, REFLECT, DLQ)


def _path(url: str) -> str:
    return url.split("://", 1)[1] if "://" in url else url


class DataDirLocked(RuntimeError):
    """Another process holds the data directory (the embedded stores are single-process)."""


@dataclass
class Embedded:
    """Every service of mneme in one process. Build with :func:`bootstrap`; ``start()``
    runs the consumers, ``serve()`` the gRPC server; ``close()`` stops both."""

    settings: Settings
    log: object
    catalog: SqliteCatalog
    stores: object
    ingest: object
    recall: object
    reflect: object
    consumers: dict = field(default_factory=dict)
    server: grpc.Server | None = None
    _lock_fd: int | None = None

    def start(self, groups: tuple[str, ...] | None = None) -> None:
        for name, c in self.consumers.items():
            if groups is None or name in groups:
                c.start()

    def wait_idle(self, timeout: float = 600.0) -> bool:
        return all(c.wait_idle(timeout) for c in self.consumers.values())

    def serve(self, address: str | None = None) -> int:
        """Start the gRPC server (every API, health, reflection); returns the bound port."""
        from services.ingest import grpc_api as ingest_api
        from services.reflect import grpc_api as reflect_api
        from services.search import grpc_api as search_api

        server = grpc.server(futures.ThreadPoolExecutor(max_workers=self.settings.grpc_workers),
                             options=[("grpc.max_receive_message_length", 64 << 20),
                                      ("grpc.max_send_message_length", 64 << 20)])
        exists = lambda bank_id: self.catalog.get_bank(bank_id) is not None  # noqa: E731
        names = ingest_api.register(server, self.ingest)
        names += search_api.register(server, search_api.RecallServicer(
            self.recall, self.stores.vectors, exists))
        names += reflect_api.register(server, reflect_api.ReflectServicer(self.reflect, exists))
        health_servicer = health.HealthServicer()
        health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
        for n in names + [""]:
            health_servicer.set(n, health_pb2.HealthCheckResponse.SERVING)
        reflection.enable_server_reflection(names + [health.SERVICE_NAME, reflection.SERVICE_NAME], server)
        port = server.add_insecure_port(address or self.settings.grpc_address)
        if port == 0:
            raise RuntimeError(f"cannot bind {address or self.settings.grpc_address}")
        server.start()
        self.server = server
        return port

    def close(self) -> None:
        if self.server is not None:
            self.server.stop(grace=5).wait()
        for c in self.consumers.values():
            c.stop(timeout=30)
        for s in self.stores.all():
            s.close()
        self.catalog.close()
        self.log.close()
        if self._lock_fd is not None:
            os.close(self._lock_fd)


def _lock(data_dir: Path) -> int:
    fd = os.open(data_dir / "LOCK", os.O_RDWR | os.O_CREAT, 0o644)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        os.close(fd)
        raise DataDirLocked(f"{data_dir} is in use by another mneme process "
                            "(stop `mneme up` first)") from None
    return fd


def bootstrap(settings: Settings | None = None) -> Embedded:
    """Open every adapter named by ``settings`` and wire the handlers (nothing runs yet).
    Raises DataDirLocked when another process uses the data directory."""
    from mneme.embedding import default_embedder, default_token_counter
    from mneme.nlp import QueryAnalyzer
    from services.extraction.handlers import GROUP as EXTRACTION, handle_intake
    from services.extraction.offline import OfflineExtractor
    from services.extraction.resolver import EntityResolver
    from services.ingest.handlers import GROUP as INGEST, Ingest, project_catalog
    from services.reflect.handlers import reflect_offline, record_reflection
    from services.search.handlers import GROUP as SEARCH, Projections, project_memory
    from services.search.recall import recall

    settings = settings or Settings()
    data_dir = settings.data_dir.resolve()
    data_dir.mkdir(parents=True, exist_ok=True)
    lock_fd = _lock(data_dir)

    event_log = open_event_log(settings.url("bus"))
    for t in TOPICS:
        event_log.ensure_topic(t, 1 if t == DLQ else settings.partitions or default_partitions(t))
    catalog = SqliteCatalog(_path(settings.url("catalog")))
    embedder = default_embedder()
    stores = Projections(open_vector_store(settings.url("vector"), dim=embedder.dim),
                         open_text_store(settings.url("text")),
                         open_graph_store(settings.url("graph")))
    resolver = EntityResolver(path=str(data_dir / "entities.db"))
    extractor = OfflineExtractor(resolver=resolver)
    ingest = Ingest(event_log, catalog, settings.retain_timeout_s)
    pool = futures.ThreadPoolExecutor(max_workers=4, thread_name_prefix="recall")
    recall_fn = functools.partial(recall, vectors=stores.vectors, text=stores.text,
                                  graph=stores.graph, embedder=embedder, analyzer=QueryAnalyzer(),
                                  tokens=default_token_counter(), executor=pool)

    def reflect_fn(bank_id, query, context, budget, now):
        r = reflect_offline(bank_id, query, context, budget, now, recall_fn)
        event_log.append([record_reflection(bank_id, query, r)])
        return r

    consumers = {
        INGEST: Consumer(event_log, INGEST, [INTAKE, PROGRESS],
                         functools.partial(project_catalog, catalog=catalog)),
        EXTRACTION: Consumer(event_log, EXTRACTION, [INTAKE],
                             functools.partial(handle_intake, extractor=extractor,
                                               embedder=embedder, resolver=resolver)),
        SEARCH: Consumer(event_log, SEARCH, [MEMORY],
                         functools.partial(project_memory, stores=stores)),
    }
    return Embedded(settings=settings, log=event_log, catalog=catalog, stores=stores,
                    ingest=ingest, recall=recall_fn, reflect=reflect_fn, consumers=consumers,
                    _lock_fd=lock_fd)


def replay(settings: Settings | None = None, progress=None) -> dict[str, int]:
    """Rebuild every projection from the log: reset the search stores and the catalog,
    rewind their consumer groups to offset 0 and consume to the end. No model is
    called (derived events carry the facts and embeddings) and nothing is appended:
    the progress events the projections would emit are already on the log.
    ``progress(done, total)`` is called as records are consumed. Returns
    {"records": n}. Raises DataDirLocked while a server uses the data directory."""
    app = bootstrap(settings)
    try:
        app.stores.reset()
        app.catalog.reset()
        groups = {name: c for name, c in app.consumers.items() if name in ("search", "ingest")}
        total = 0
        for name, c in groups.items():
            app.log.reset_group(name, c.topics)
            total += sum(app.log.end_offset(t, p) for t, p in c.assignments())
        done = 0
        for name, c in groups.items():
            handler = c.handler
            c.handler = lambda env, rec, h=handler: (h(env, rec), [])[1]  # project only
            while n := c.run_once():
                done += n
                if progress:
                    progress(done, total)
        if progress:
            progress(total, total)
        return {"records": done}
    finally:
        app.close()
