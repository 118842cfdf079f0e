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
from tests.integration.conftest import KAFKA_TEST_ENV, free_port, mneme_bin


class Cluster:
    """Five service processes on ``bus_url``; ``address[name]`` is each one's gRPC."""

    def __init__(self, root: Path, bus_url: str) -> None:
        self.root = root
        self.bus_url = bus_url
        self.address = {s: f"127.0.0.1:{free_port()}" for s in SERVICES}
        self.procs: dict[str, subprocess.Popen] = {}

    def env(self, service: str) -> dict[str, str]:
        return {**os.environ, **KAFKA_TEST_ENV, "HF_HUB_OFFLINE": "1",
                "MNEME_BUS_URL": self.bus_url, "MNEME_DATA_DIR": str(self.root / service),
                "MNEME_GRPC_ADDRESS": self.address[service],
                "MNEME_SEARCH_ADDRESS": self.address["search"],
                "MNEME_SHUTDOWN_GRACE_S": "2", "MNEME_HEALTH_INTERVAL_S": "1",
                "MNEME_METRICS_PORT": "0", "PYTHONFAULTHANDLER": "1"}

    def start(self, *services: str, timeout: float = 120) -> "Cluster":
        services = services or SERVICES
        for s in services:
            out = open(self.root / f"{s}.log", "ab")
            self.procs[s] = subprocess.Popen([mneme_bin(), "serve", s], env=self.env(s),
                                             stdout=out, stderr=subprocess.STDOUT)
        for s in services:
            self.wait_serving(s, timeout)
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
        for s in services or list(self.procs):
            proc = self.procs.pop(s, None)
            if proc is None:
                continue
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(timeout)
            except subprocess.TimeoutExpired:  # hung: its threads' stacks go to its log
                proc.send_signal(signal.SIGABRT)
                try:
                    proc.wait(5)
                except subprocess.TimeoutExpired:
                    proc.kill()
                    proc.wait()
                raise AssertionError(f"{s} did not stop within {timeout}s of SIGTERM; "
                                     f"see {self.root / f'{s}.log'}") from None
