"""The embedded topology (``mneme up``): ingest, extraction, search, consolidation and
reflect (calling search in process) in one process over the embedded log and stores,
every gRPC API on one port."""

from __future__ import annotations

import logging
import threading
from dataclasses import dataclass, field

import grpc
from grpc_health.v1 import health

from mneme.bootstrap import (Root, ServiceParts, build_consolidation, build_extraction,
                             build_ingest, build_reflect, build_search)
from mneme.config import Settings
from mneme.runtime import grpc_server
from mneme.runtime.log_runner import LogRunner

log = logging.getLogger("mneme")


@dataclass
class Embedded:
    """Every service of mneme in one process. Build with :func:`bootstrap`; ``start()``
    runs the consumer groups, ``serve()`` the gRPC server; ``close()`` stops both.
    ``consumers`` maps each group to its :class:`mneme.bus.consumer.Consumer`."""

    settings: Settings
    log: object
    catalog: object
    stores: object
    ingest: object
    recall: object
    reflect: object
    runner: LogRunner
    server: grpc.Server | None = None
    root: Root | None = None
    parts: list[ServiceParts] = field(default_factory=list)
    _closing: threading.Event = field(default_factory=threading.Event, repr=False)

    @property
    def consumers(self) -> dict:
        return self.runner.consumers

    def start(self, groups: tuple[str, ...] | None = None) -> None:
        """Start every consumer group (or only ``groups``)."""
        self.runner.start(groups)

    def wait_idle(self, timeout: float = 600.0) -> bool:
        """True once every group has caught up with the log (False after ``timeout`` s)."""
        return self.runner.wait_idle(None, timeout)

    def serve(self, address: str | None = None) -> int:
        """Start the gRPC server (every API, health, reflection); returns the bound port."""
        guard = grpc_server.guard(self.settings)
        guard.audit = grpc_server.audit_to(self.log)
        server = grpc_server.server(self.settings, guard)
        names = [n for p in self.parts if p.register for n in p.register(server)]
        health_servicer = grpc_server.add_health(server, names, grpc_server.SERVING)
        # as `mneme serve` answers it: one liveness probe for either command, SERVING while
        # the process answers, even once the log's damage has made readiness NOT_SERVING
        # (a restart does not repair the data on disk)
        health_servicer.set(grpc_server.LIVENESS, grpc_server.SERVING)
        port = grpc_server.bind(server, address or self.settings.grpc_address, self.settings)
        if port == 0:
            raise RuntimeError(f"cannot listen on {address or self.settings.grpc_address}: the "
                               f"port is taken (another server?) or not an address of this host")
        server.start()
        self.server = server
        threading.Thread(target=self._watch_log, args=(health_servicer, names),
                         name="log-health", daemon=True).start()
        return port

    def _watch_log(self, servicer: health.HealthServicer, names: list[str]) -> None:
        """Health NOT_SERVING for good once the event log reports damage (its
        ``check()``, a stat and a header read, at most every second): the data on disk
        can no longer be trusted, and only a restart after recovery clears it. Also
        NOT_SERVING while a store server of this process (the embedded graph server)
        does not answer its ``ping()``, SERVING again once it does."""
        check = getattr(self.log, "check", None)
        down: str | None = None
        while not self._closing.wait(min(self.settings.health_interval_s, 1.0)):
            try:
                problem = check() if check is not None else None
            except Exception as exc:  # a probe that fails says the same
                problem = repr(exc)
            if problem:
                log.error("event log damaged (%s): health NOT_SERVING; writes fail with "
                          "UNAVAILABLE", problem)
                for n in names + [""]:
                    servicer.set(n, grpc_server.NOT_SERVING)
                return
            # the live generation's store each round: a replay swaps it
            graph = getattr(getattr(self.stores, "graph", None), "target", None)
            ping = getattr(graph, "ping", None)
            if ping is None:
                continue
            try:
                ping()
                now = None
            except Exception as exc:  # noqa: BLE001 - any failure: it does not answer
                now = f"{type(exc).__name__}: {exc}"
            if (now is None) != (down is None) and not self._closing.is_set():
                if now is None:
                    log.warning("the embedded graph server answers again: health SERVING")
                else:
                    log.error("the embedded graph server does not answer (%s): health "
                              "NOT_SERVING; its calls answer UNAVAILABLE and its consumers "
                              "wait. If its process is gone (%s.settings names its pid "
                              "file), restart mneme up", now,
                              getattr(graph, "path", "DATA_DIR/graph.db"))
                for n in names + [""]:
                    servicer.set(n, grpc_server.SERVING if now is None
                                 else grpc_server.NOT_SERVING)
            down = now

    def close(self) -> None:
        """Stop the server (5 s grace), then the consumer groups, then close the adapters."""
        self._closing.set()
        if self.server is not None:
            self.server.stop(grace=5).wait()
        self.runner.stop(timeout=30)
        if self.root is not None:
            self.root.close()


def bootstrap(settings: Settings | None = None) -> Embedded:
    """The embedded topology: open every adapter named by ``settings`` and wire every
    service into one process (nothing runs yet). Raises
    :class:`mneme.datadir.DataDirLocked` when another process uses the data directory."""
    root = Root(settings)
    try:
        ingest = build_ingest(root)
        exists = lambda bank_id: root.catalog.get_bank(bank_id) is not None  # noqa: E731
        search = build_search(root, bank_exists=exists)
        reflect = build_reflect(root, recall=search.api["recall"], bank_exists=exists)
        consolidation = build_consolidation(root)
        parts = [ingest, build_extraction(root), search, reflect, consolidation]
        # one generation holds every projection: a replay rebuilds and switches
        # consolidation's with search's stores
        search.api["replay"].followers.append(consolidation.api["follower"])
        # the files of a generation retired by a process that stopped within its grace,
        # and of one whose replay a crash stopped
        search.api["replay"].drop_retired()
        search.api["replay"].drop_failed()
    except BaseException:
        root.close()
        raise
    runner = LogRunner(root.log, {g: r for p in parts for g, r in p.routers.items()})
    for p in parts:
        p.runner = runner
    return Embedded(settings=root.settings, log=root.log, catalog=root.catalog,
                    stores=root.stores, ingest=ingest.api["ingest"], recall=search.api["recall"],
                    reflect=reflect.api["reflect"], runner=runner, root=root, parts=parts)
