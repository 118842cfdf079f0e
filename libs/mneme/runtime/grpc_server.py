"""The gRPC server every topology runs: interceptors (tracing, auth, limits), TLS and
mTLS (certificate files re-read on change), health and reflection, and the process's
telemetry."""

from __future__ import annotations

import logging
import ssl
from concurrent import futures
from typing import Callable

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from mneme.config import Settings

SERVING = health_pb2.HealthCheckResponse.SERVING
NOT_SERVING = health_pb2.HealthCheckResponse.NOT_SERVING
#: Health service name that is SERVING while the process answers gRPC at all, whatever its
#: dependencies or catch-up: what a liveness probe asks (restarting a replica that waits
#: for a broker, or is still rebuilding its copies, would not help). The overall status
#: ("") is readiness.
LIVENESS = "liveness"
log = logging.getLogger(__name__)


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
    inside it the request's parsing (:class:`mneme.grpc_util.DecodeInterceptor`), then
    ``guard`` (authentication, authorisation, audit), and innermost the
    request limits (:class:`mneme.grpc_util.ValidationInterceptor`). Requests larger
    than ``MNEME_LIMIT_REQUEST_BYTES`` are refused by gRPC itself (RESOURCE_EXHAUSTED).
    The listening port is exclusive: :func:`bind` of a port another server holds fails."""
    from mneme import telemetry
    from mneme.grpc_util import DecodeInterceptor, ValidationInterceptor
    from mneme.limits import limits
    # the request is parsed (undecodable: INVALID_ARGUMENT) before the guard reads it
    interceptors = ([telemetry.TracingInterceptor(), DecodeInterceptor()]
                    + ([guard] if guard is not None else []) + [ValidationInterceptor()])
    return grpc.server(futures.ThreadPoolExecutor(max_workers=settings.grpc_workers),
                       interceptors=interceptors,
                       options=[("grpc.max_receive_message_length", limits().request_bytes),
                                ("grpc.max_send_message_length", 64 << 20),
                                # gRPC's default SO_REUSEPORT lets a second server bind a
                                # port already served and the kernel split connections
                                # between them (a client then sees UNIMPLEMENTED from the
                                # wrong service): a taken port must fail the start instead.
                                ("grpc.so_reuseport", 0)])


def bind(server: grpc.Server, address: str, settings: Settings) -> int:
    """Listen on ``address``: TLS when ``MNEME_TLS_CERT``/``MNEME_TLS_KEY`` are set
    (any auth mode), requiring a client certificate signed by ``MNEME_TLS_CLIENT_CA`` for
    ``mtls``; plaintext otherwise. The files are re-read when they change (every new
    connection's handshake sees the current ones; see :func:`reloading_credentials`).
    Returns the port (0 when it cannot bind). Raises ConfigurationError naming the
    variable for mtls without the three files, a key without a certificate, a file that
    cannot be read, or a certificate and key that are not a matching PEM pair."""
    from mneme.errors import ConfigurationError
    mtls = settings.auth_mode == "mtls"
    if mtls and not (settings.tls_cert and settings.tls_key and settings.tls_client_ca):
        raise ConfigurationError("MNEME_AUTH_MODE=mtls needs MNEME_TLS_CERT, MNEME_TLS_KEY "
                                 "and MNEME_TLS_CLIENT_CA")
    if bool(settings.tls_cert) != bool(settings.tls_key):
        raise ConfigurationError("TLS needs both MNEME_TLS_CERT and MNEME_TLS_KEY")
    files = {"MNEME_TLS_CERT": settings.tls_cert, "MNEME_TLS_KEY": settings.tls_key,
             "MNEME_TLS_CLIENT_CA": settings.tls_client_ca if mtls else ""}
    for variable, path in files.items():
        if path:
            try:
                with open(path, "rb"):
                    pass
            except OSError as e:
                raise ConfigurationError(f"{variable}: cannot read {path}: "
                                         f"{e.strerror or e}") from None
    try:
        if not settings.tls_cert:
            return server.add_insecure_port(address)
        try:
            creds = reloading_credentials(settings.tls_cert, settings.tls_key,
                                          settings.tls_client_ca if mtls else "",
                                          require_client=mtls)
        except (OSError, grpc.RpcError, ValueError) as e:  # ssl.SSLError is an OSError
            raise ConfigurationError(
                f"MNEME_TLS_CERT ({settings.tls_cert}) and MNEME_TLS_KEY "
                f"({settings.tls_key}) are not a PEM certificate and its private key: "
                f"{e}") from None
        return server.add_secure_port(address, creds)
    except RuntimeError:  # grpcio's "Failed to bind": taken, or not an address of ours
        return 0


def reloading_credentials(cert: str, key: str, client_ca: str = "",
                          require_client: bool = False) -> grpc.ServerCredentials:
    """Server credentials from PEM files (``client_ca`` empty: no client CA) that follow
    the files: gRPC asks for the configuration at each new TLS handshake, and the files
    are read again only when one's mtime, size or inode changed. A rotation in progress
    (a file missing or unreadable, a key that does not match its certificate) keeps the
    last good configuration; the next handshake tries again. Raises OSError when a file
    cannot be read at start."""
    from mneme.grpc_util import file_signature, read_pem
    files = tuple(p for p in (cert, key, client_ca) if p)

    def load():
        # A key that does not match the certificate (half a rotation) raises here
        # (ssl.SSLError is an OSError) instead of failing every handshake.
        ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER).load_cert_chain(cert, key)
        return grpc.ssl_server_certificate_configuration(
            [(read_pem(key), read_pem(cert))], root_certificates=read_pem(client_ca))

    state = {"sig": file_signature(files)}
    initial = load()

    def fetch():
        # Called by gRPC core on each handshake: must not raise; None = unchanged.
        sig = file_signature(files)
        if sig == state["sig"] or None in sig:
            return None
        try:
            config = load()
        except OSError as e:
            log.warning("TLS files %s unusable, keeping the old ones: %s", files, e)
            return None
        state["sig"] = sig
        log.info("TLS files changed (%s): new server certificate", ", ".join(files))
        return config

    return grpc.dynamic_ssl_server_credentials(initial, fetch,
                                               require_client_authentication=require_client)


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
