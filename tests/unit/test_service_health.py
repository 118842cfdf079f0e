"""gRPC health of `mneme serve` (the chart's probes): the overall status ("", readiness)
is SERVING only once the process's readiness checks pass -- never, even briefly, before
a fresh replica has caught up -- and "liveness" is SERVING from the moment the port is
bound, whatever the dependencies, so a replica catching up for a long time (or waiting
for a broker) is taken out of the Services but not restarted."""

from __future__ import annotations

import threading
import time

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from mneme.config import Settings
from mneme.runtime import grpc_server, process
from tests.ports import free_port

SERVING = health_pb2.HealthCheckResponse.SERVING
NOT_SERVING = health_pb2.HealthCheckResponse.NOT_SERVING


def _status(address: str, service: str) -> int:
    with grpc.insecure_channel(address) as ch:
        return health_pb2_grpc.HealthStub(ch).Check(
            health_pb2.HealthCheckRequest(service=service), timeout=5).status


def _until(predicate, timeout: float = 30.0) -> bool:
    end = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > end:
            return False
        time.sleep(0.02)
    return True


def test_not_ready_until_the_checks_pass_and_alive_all_along(tmp_path, monkeypatch):
    caught_up = threading.Event()   # stands in for a replica still rebuilding its copies
    real = process.BUILDERS["consolidation"]

    def builder(root):
        parts = real(root)
        parts.checks.append(caught_up.is_set)
        return parts
    monkeypatch.setitem(process.BUILDERS, "consolidation", builder)
    address = f"127.0.0.1:{free_port()}"
    proc = process.ServiceProcess("consolidation", Settings(
        data_dir=tmp_path, grpc_address=address, health_interval_s=0.05, shutdown_grace_s=0.1,
        metrics_port=0))
    proc.bind()
    try:
        assert _status(address, grpc_server.LIVENESS) == SERVING   # bound: alive
        assert _status(address, "") == NOT_SERVING
        proc.start()
        assert proc.ready.is_set()
        # started, but its checks do not pass: not ready, still alive
        assert _status(address, "") == NOT_SERVING
        assert _status(address, grpc_server.LIVENESS) == SERVING
        caught_up.set()
        assert _until(lambda: _status(address, "") == SERVING)
        assert _status(address, grpc_server.LIVENESS) == SERVING
    finally:
        proc.stop()
