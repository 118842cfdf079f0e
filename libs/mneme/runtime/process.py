"""The distributed topology: one service per process (``mneme serve <service>``, or
``python -m services.<service>``) over Kafka (``MNEME_BUS_URL=kafka://…``), each with its own data directory for local state,
gRPC health and readiness."""

from __future__ import annotations

import logging
import os
import sys
import threading

import grpc
import tenacity
from grpc_health.v1 import health

from mneme.bootstrap import BUILDERS, SERVICES, Root, ServiceParts
from mneme.datadir import DataDirLocked
from mneme.config import Settings
from mneme.errors import ConfigurationError, FailedPrecondition, Unavailable
from mneme.runtime import allocator, generations_api, grpc_server, signals
from mneme.runtime.log_runner import LogRunner

log = logging.getLogger("mneme")


class _Stopped(Exception):
    """stop() was called while the process was still connecting."""


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


class _SharedStores:
    """GenerationService of a search replica on store servers: the replicas share the
    stores, so one of them cannot switch them alone (README "Replay generations")."""

    def __getattr__(self, name: str):
        raise FailedPrecondition(
            "this search replica's stores are servers its replicas share: stop the search "
            "replicas and run `mneme replay`, or see README 'Replay generations'")


class ServiceProcess:
    """One service in its own process (distributed topology).

    Lifecycle: :meth:`start` binds gRPC at once with health NOT_SERVING (the
    ``liveness`` name SERVING: the process answers) and the service's API answering
    UNAVAILABLE, connects to the broker and opens the stores (retrying until they answer
    or :meth:`stop` is called), starts the consumer groups and turns health SERVING once
    the readiness checks pass (the broker, a replica's own copies caught up once, for
    reflect search). A monitor thread re-checks them every ``health_interval_s`` and flips
    health accordingly. :meth:`stop`
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
        self.runner = None  # runs the service's consumer groups once started
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
        self._pending = {k: _Pending(self.name) for k in ("ingest", "recall", "vectors", "graph",
                                                           "exists", "reflect", "reflect_stream",
                                                           "mental_models", "corrections",
                                                           "documents",
                                                           "replay")}
        self._guard = grpc_server.guard(self.settings)
        server = grpc_server.server(self.settings, self._guard)
        p = self._pending
        if self.name == "ingest":
            from services.ingest import grpc_api
            self._names = grpc_api.register(server, p["ingest"])
        elif self.name == "search":
            from services.search import grpc_api
            self._names = grpc_api.register(server, grpc_api.RecallServicer(
                p["recall"], p["vectors"], p["exists"], p["graph"], p["corrections"],
                documents=p["documents"])) + generations_api.register(
                server, generations_api.GenerationServicer(p["replay"]))
        elif self.name == "consolidation":  # replays of its observation projection
            self._names = generations_api.register(
                server, generations_api.GenerationServicer(p["replay"]))
        elif self.name == "reflect":
            from services.reflect import grpc_api
            self._names = grpc_api.register(server, grpc_api.ReflectServicer(
                p["reflect"], lambda bank_id: True, stream=p["reflect_stream"]), p["mental_models"])
        self._health = grpc_server.add_health(server, self._names, grpc_server.NOT_SERVING)
        self._health.set(grpc_server.LIVENESS, grpc_server.SERVING)  # up, whatever else
        self.port = grpc_server.bind(server, self.settings.grpc_address, self.settings)
        if self.port == 0:
            raise RuntimeError(f"cannot listen on {self.settings.grpc_address}: the port is "
                               f"taken (another server?) or not an address of this host")
        server.start()
        self.server = server
        return self.port

    def start(self) -> None:
        """Bind, connect (retrying), build, start the consumers, report SERVING.
        Returns early (not ready) when :meth:`stop` is called meanwhile."""
        if self.server is None:
            self.bind()
        def connect() -> Root:
            if self._stop.is_set():
                raise _Stopped()
            root = Root(self.settings)  # DataDirLocked is fatal
            try:
                self.parts = BUILDERS[self.name](root)
                root.log  # connect now (the builders of API-only services may not)
                if "replay" in self.parts.api:  # a retired generation's files left at a stop
                    self.parts.api["replay"].drop_retired()
                return root
            except BaseException:
                root.close()
                raise

        def warn(state: tenacity.RetryCallState) -> None:
            log.warning("%s: dependencies not reachable yet (%r); retrying", self.name,
                        state.outcome.exception())
        # Configuration errors and a locked data dir are fatal; an unreachable broker or
        # store is retried every 2 s until it answers or stop() is called.
        try:
            root = tenacity.Retrying(
                retry=tenacity.retry_if_not_exception_type((ValueError, DataDirLocked, _Stopped)),
                wait=tenacity.wait_fixed(2.0), sleep=tenacity.sleep_using_event(self._stop),
                before_sleep=warn, reraise=True)(connect)
        except _Stopped:
            return
        self.root = root
        self._guard.audit = grpc_server.audit_to(root.log)
        api, p = self.parts.api, self._pending
        if "ingest" in api:
            p["ingest"].set(api["ingest"])
        if "recall" in api:
            p["recall"].set(api["recall"])
            p["vectors"].set(root.stores.vectors)
            p["graph"].set(root.stores.graph)
            p["exists"].set(api["bank_exists"])
            p["corrections"].set(api["corrections"])
            p["documents"].set(api["documents"])  # caught up by the bank check (own copy)
            p["replay"].set(api["replay"] if root.local_stores else _SharedStores())
        elif "replay" in api:  # consolidation: its own projection's generations
            p["replay"].set(api["replay"])
        if "reflect" in api:
            p["reflect"].set(api["reflect"])
            p["reflect_stream"].set(api["reflect_stream"])
            p["mental_models"].set(api["mental_models"])
        self.parts.runner = self.runner = _runner(root, self.parts)
        self.runner.start()
        # SERVING only when the checks pass now: a fresh replica rebuilding its own copies
        # must not look ready, even until the monitor's first round (the rolling update
        # would take it for ready and stop an old replica).
        serving = self._healthy()
        self._set_health(grpc_server.SERVING if serving else grpc_server.NOT_SERVING)
        self.ready.set()
        threading.Thread(target=self._monitor, args=(serving,), name="health",
                         daemon=True).start()
        log.info("%s is %s on port %d (groups: %s)", self.name,
                 "ready" if serving else "started (not ready until caught up)", self.port,
                 ", ".join(self.parts.routers) or "none")

    def _healthy(self) -> bool:
        """True when the broker answers and every readiness check passes; a check that
        raises (a broker read failing or cancelled) counts as not healthy, so the monitor
        keeps running."""
        try:
            ping = getattr(self.root.log, "ping", None)
            ok = ping() if ping is not None else True
            return ok and all(check() for check in self.parts.checks)
        except Exception as exc:  # noqa: BLE001 - any failure means "not ready now"
            if not self._stop.is_set():
                log.warning("%s: health check failed: %r", self.name, exc)
            return False

    def _monitor(self, serving: bool) -> None:
        """Every ``health_interval_s``: flip health when :meth:`_healthy` changes;
        ``serving``: the status :meth:`start` set."""
        while not self._stop.wait(self.settings.health_interval_s):
            ok = self._healthy()
            if ok != serving and not self._stop.is_set():
                log.warning("%s: dependencies %s", self.name, "back" if ok else "unreachable")
                self._set_health(grpc_server.SERVING if ok else grpc_server.NOT_SERVING)
                serving = ok

    def stop(self) -> None:
        """Graceful shutdown (see the class docstring). Idempotent."""
        if self._stop.is_set() and self.server is None:
            return
        self._stop.set()
        self._set_health(grpc_server.NOT_SERVING)
        if self.server is not None:
            self.server.stop(grace=self.settings.shutdown_grace_s).wait()
            self.server = None
        if self.runner is not None:
            self.runner.stop(timeout=30)
            self.runner = None
        if self.root is not None:
            self.root.close()
            self.root = None


def run_service(name: str, settings: Settings | None = None) -> None:
    """Run service ``name`` until SIGTERM/SIGINT, then shut down gracefully."""
    allocator.tune()
    proc = ServiceProcess(name, settings)
    allocator.trim_every(proc.settings.malloc_trim_interval_s)
    grpc_server.setup_telemetry(f"mneme-{name}", proc.settings)
    stop = signals.stop_on_signals()
    try:
        proc.bind()
    except ConfigurationError as exc:  # the TLS files, the auth mode: the operator's to fix
        log.error("%s: cannot start: %s", name, " ".join(str(exc).split()))
        raise SystemExit(1)
    failed: list[BaseException] = []

    def start() -> None:
        try:
            proc.start()
        except (ConfigurationError, DataDirLocked) as exc:  # the operator's to fix: one line
            log.error("%s: cannot start: %s", name, " ".join(str(exc).split()))
            failed.append(exc)
            stop.set()
        except BaseException as exc:  # fatal, unexpected
            log.exception("%s: cannot start", name)
            failed.append(exc)
            stop.set()

    starter = threading.Thread(target=start, name="start", daemon=True)
    starter.start()
    signals.wait(stop)
    log.info("%s: stopping (drain, commit, close)", name)
    proc.stop()
    starter.join(5)
    if failed:
        raise SystemExit(1)


def main_service(name: str) -> None:
    """Entry point of ``python -m services.<name>`` (same as ``mneme serve <name>``):
    logging, settings from MNEME_*."""
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    from mneme.config import check_environment, configuration_message
    try:
        check_environment()
        settings = Settings()
    except ValueError as e:  # ConfigurationError, pydantic's ValidationError
        print(f"{name}: configuration error: {configuration_message(e)}", file=sys.stderr)
        raise SystemExit(1)
    logging.basicConfig(level=os.environ.get("MNEME_LOG_LEVEL", "INFO"),
                        format=f"%(asctime)s %(levelname)s {name} %(name)s: %(message)s")
    from mneme.logrepeat import limit_repeats
    limit_repeats()  # a broker away: aiokafka logs every reconnect of every client
    run_service(name, settings)


def _runner(root: Root, parts: ServiceParts):
    """What runs the service's consumer groups: on Kafka the FastStream subscribers of
    :mod:`mneme.runtime.kafka`; on another log a :class:`LogRunner`."""
    from mneme.bus.kafka_log import KafkaEventLog  # lazy: aiokafka only on Kafka

    if isinstance(root.raw_log, KafkaEventLog) and parts.routers:
        from mneme.runtime.kafka import KafkaRunner

        return KafkaRunner(root.log, parts.routers, restorers=parts.restorers,
                           checkpoints=root.data_dir / "restored.json")
    return LogRunner(root.log, parts.routers)
