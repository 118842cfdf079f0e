"""The gRPC server every topology runs: interceptors (tracing, auth, limits), TLS for
mTLS, health and reflection, and the process's telemetry."""

from __future__ import annotations

from concurrent import futures
from pathlib import Path
from typing import Callable

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from mneme.config import Settings

SERVING = health_pb2.HealthCheckResponse.SERVING
NOT_SERVING = health_pb2.HealthCheckResponse.NOT_SERVING


def guard(settings: Settings):
    """The gRPC auth interceptor of ``MNEME_AUTH_MODE`` (see :mod:`mneme.auth`); its
    ``audit`` is set once the event log is open (:func:`audit_to`)."""
    from mneme import auth
    keys = (auth.KeyStore(auth.default_keys_file(settings))
            if settings.auth_mode != "open" else None)
    return auth.AuthInterceptor(settings.auth_mode, keys)


def audit_to(event_log) -> Callable:
    """Append AuditRecorded messages to ``mneme.audit.v1`` (key: the bank, or "_")."""
    from mneme.bus import codec  # noqa: PLC0415 - only once a log is open

    def append(msg) -> None:
        event_log.append([codec.encode(msg, bank_id=msg.bank_id or "_", source="mneme/auth")])
    return append


def server(settings: Settings, guard=None) -> grpc.Server:
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


def bind(server: grpc.Server, address: str, settings: Settings) -> int:
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


def add_health(server: grpc.Server, names: list[str], status) -> health.HealthServicer:
    """Health (every name in ``names`` and "" at ``status``) and server reflection."""
    servicer = health.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(servicer, server)
    for n in names + [""]:
        servicer.set(n, status)
    reflection.enable_server_reflection(
        names + [health.SERVICE_NAME, reflection.SERVICE_NAME], server)
    return servicer
