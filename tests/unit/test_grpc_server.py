"""The gRPC listening port is exclusive: a second mneme server on a port another one
serves fails to start instead of sharing it (gRPC's default SO_REUSEPORT would let the
kernel split connections between the two, and a client would reach the wrong service)."""

from __future__ import annotations

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from mneme.config import Settings
from mneme.runtime import grpc_server


def test_a_served_port_cannot_be_bound_by_a_second_server():
    settings = Settings()
    first = grpc_server.server(settings)
    grpc_server.add_health(first, ["mneme.first"], grpc_server.SERVING)
    port = grpc_server.bind(first, "127.0.0.1:0", settings)
    assert port > 0
    first.start()
    try:
        second = grpc_server.server(settings)
        assert grpc_server.bind(second, f"127.0.0.1:{port}", settings) == 0
        # Every connection still reaches the first server.
        for _ in range(20):
            with grpc.insecure_channel(f"127.0.0.1:{port}") as ch:
                status = health_pb2_grpc.HealthStub(ch).Check(
                    health_pb2.HealthCheckRequest(service="mneme.first"), timeout=5).status
            assert status == health_pb2.HealthCheckResponse.SERVING
    finally:
        first.stop(0)


def test_mneme_process_start_names_the_taken_address(tmp_path):
    from mneme.runtime.process import ServiceProcess  # noqa: PLC0415
    settings = Settings()
    holder = grpc_server.server(settings)
    port = grpc_server.bind(holder, "127.0.0.1:0", settings)
    holder.start()
    try:
        proc = ServiceProcess("reflect", Settings(data_dir=tmp_path,
                                                  grpc_address=f"127.0.0.1:{port}"))
        with pytest.raises(RuntimeError, match=f"cannot listen on 127.0.0.1:{port}"):
            proc.bind()
    finally:
        holder.stop(0)
