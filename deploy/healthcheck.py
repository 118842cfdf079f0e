"""Container health check: gRPC health checking protocol against this container's server.

Calls ``grpc.health.v1.Health/Check`` (service "" = the whole server, or the service named
by the first argument) on 127.0.0.1 at the port of ``MNEME_GRPC_ADDRESS`` (or
``MNEME_HEALTH_ADDRESS`` when set, a full ``host:port``). Exit status 0 when SERVING,
1 otherwise (Docker's HEALTHCHECK convention). Used by deploy/Dockerfile and
docker-compose.yml; equivalent to ``grpc_health_probe -addr=127.0.0.1:50051``.
"""

from __future__ import annotations

import os
import sys


def target() -> str:
    explicit = os.environ.get("MNEME_HEALTH_ADDRESS")
    if explicit:
        return explicit
    listen = os.environ.get("MNEME_GRPC_ADDRESS", "127.0.0.1:50051")
    port = listen.rsplit(":", 1)[-1]
    return f"127.0.0.1:{port}"


def main(argv: list[str]) -> int:
    import grpc
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    service = argv[0] if argv else ""
    address = target()
    try:
        with grpc.insecure_channel(address) as channel:
            reply = health_pb2_grpc.HealthStub(channel).Check(
                health_pb2.HealthCheckRequest(service=service), timeout=4)
    except grpc.RpcError as exc:
        print(f"{address}: {exc.code().name}: {exc.details()}", file=sys.stderr)
        return 1
    status = health_pb2.HealthCheckResponse.ServingStatus.Name(reply.status)
    print(f"{address} {service or '(server)'}: {status}")
    return 0 if reply.status == health_pb2.HealthCheckResponse.SERVING else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
