"""The distributed topology for tests: each service as its own OS process
(``mneme serve <service>``) on a Kafka-protocol broker, each with its own data dir."""

from __future__ import annotations

import os
import signal
import subprocess
import time
from pathlib import Path

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from mneme.bootstrap import SERVICES
from tests.e2e.server import inherited
from tests.integration.conftest import KAFKA_TEST_ENV, free_port, mneme_bin


class Cluster:
    """Service processes on ``bus_url``: one replica of each of the five services, named
    after it, plus those :meth:`add` names (``search-2``, ...). ``address[name]`` is each
    replica's gRPC address; each has its own data dir (``root/<name>``) and
    ``MNEME_REPLICA_ID`` its name. ``extra_env`` goes into every process's environment."""

    def __init__(self, root: Path, bus_url: str, extra_env: dict[str, str] | None = None
                 ) -> None:
        self.root = root
        self.bus_url = bus_url
        self.extra_env = dict(extra_env or {})
        self.address = {s: f"127.0.0.1:{free_port()}" for s in SERVICES}
        self.service_of = {s: s for s in SERVICES}
        self.procs: dict[str, subprocess.Popen] = {}

    def add(self, service: str, name: str | None = None) -> str:
        """Declare another replica of ``service`` (not started); returns its name."""
        n = sum(1 for s in self.service_of.values() if s == service) + 1
        name = name or f"{service}-{n}"
        self.address[name] = f"127.0.0.1:{free_port()}"
        self.service_of[name] = service
        return name

    def replicas(self, service: str) -> list[str]:
        """Names of the running replicas of ``service``."""
        return [n for n in self.procs if self.service_of[n] == service]

    def env(self, name: str) -> dict[str, str]:
        return {**inherited(), **KAFKA_TEST_ENV, "HF_HUB_OFFLINE": "1",
                "MNEME_BUS_URL": self.bus_url, "MNEME_DATA_DIR": str(self.root / name),
                "MNEME_GRPC_ADDRESS": self.address[name], "MNEME_REPLICA_ID": name,
                "MNEME_SEARCH_ADDRESS": self.address["search"],
                "MNEME_SHUTDOWN_GRACE_S": "2", "MNEME_HEALTH_INTERVAL_S": "1",
                "MNEME_METRICS_PORT": "0", "PYTHONFAULTHANDLER": "1", **self.extra_env}

    def start(self, *names: str, timeout: float = 120) -> "Cluster":
        """Start the replicas ``names`` (default: one of each service) and wait until
        each serves."""
        names = names or SERVICES
        for n in names:
            out = open(self.root / f"{n}.log", "ab")
            self.procs[n] = subprocess.Popen([mneme_bin(), "serve", self.service_of[n]],
                                             env=self.env(n), stdout=out,
                                             stderr=subprocess.STDOUT)
        for n in names:
            self.wait_serving(n, timeout)
        return self

    def health(self, service: str) -> int:
        with grpc.insecure_channel(self.address[service]) as ch:
            try:
                return health_pb2_grpc.HealthStub(ch).Check(
                    health_pb2.HealthCheckRequest(service=""), timeout=1).status
            except grpc.RpcError:
                return -1

    def wait_serving(self, service: str, timeout: float = 120) -> None:
        deadline = time.monotonic() + timeout
        while self.health(service) != health_pb2.HealthCheckResponse.SERVING:
            proc = self.procs[service]
            if proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"{service} not serving:\n{self.log(service)[-3000:]}")
            time.sleep(0.2)

    def log(self, service: str) -> str:
        return (self.root / f"{service}.log").read_text(errors="replace")

    def kill(self, service: str) -> None:
        proc = self.procs.pop(service)
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait()

    def stop(self, *services: str, timeout: float = 60) -> None:
        """SIGTERM to each of ``services`` (default: every running replica) at once, then
        wait up to ``timeout`` s for them all (one after the other, each leaving its
        groups made the rest rebalance and wait: ~0.7 s a replica). A replica still
        running then gets SIGABRT (its threads' stacks go to its log) and fails the
        test."""
        procs = {s: p for s in (services or list(self.procs))
                 if (p := self.procs.pop(s, None)) is not None}
        for proc in procs.values():
            proc.send_signal(signal.SIGTERM)
        deadline = time.monotonic() + timeout
        hung = []
        for s, proc in procs.items():
            try:
                proc.wait(max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                hung.append(s)
        for s in hung:
            proc = procs[s]
            proc.send_signal(signal.SIGABRT)
            try:
                proc.wait(5)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        if hung:
            raise AssertionError(f"{', '.join(hung)} did not stop within {timeout}s of "
                                 f"SIGTERM; see " + ", ".join(
                                     str(self.root / f"{s}.log") for s in hung)) from None
