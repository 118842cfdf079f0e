"""Container health check: gRPC health checking protocol against this container's server.

Calls ``grpc.health.v1.Health/Check`` (service "" = the whole server, or the service named
by the first argument) on 127.0.0.1 at the port of ``MNEME_GRPC_ADDRESS`` (or
``MNEME_HEALTH_ADDRESS`` when set, a full ``host:port``). Exit status 0 when SERVING,
1 otherwise (Docker's HEALTHCHECK convention), including when the settings or the
certificate files cannot be used (one line on stderr). Used by deploy/Dockerfile,
docker-compose.yml and the Helm chart's probes when TLS is on; equivalent to
``grpc_health_probe -addr=127.0.0.1:50051`` (with ``-tls`` flags).

TLS, in every auth mode, through the one client helper (:func:`mneme.grpc_util.secure_channel`,
:class:`mneme.grpc_util.ClientTLS`) and the settings the SDK and CLI read
(``MNEME_CLIENT_TLS_CA``/``_CERT``/``_KEY``/``_SERVER_NAME``), see :func:`probe_tls`:

* probing this container's server (no ``MNEME_HEALTH_ADDRESS``), TLS follows the
  server: it serves TLS exactly when ``MNEME_TLS_CERT``/``MNEME_TLS_KEY`` are set, so
  the probe speaks TLS then (trusting ``MNEME_CLIENT_TLS_CA``, else the system's CAs) and
  plaintext otherwise, even when ``MNEME_CLIENT_TLS_*`` are set for this process's own
  calls (reflect → search). With ``MNEME_AUTH_MODE=mtls`` and no ``MNEME_CLIENT_TLS_CERT``
  the probe presents the server's own certificate and key: accepted when
  ``MNEME_TLS_CLIENT_CA`` signs it and it is not restricted to server use (no
  extendedKeyUsage, or clientAuth among them). Health needs no identity beyond that.
* ``MNEME_HEALTH_ADDRESS`` set (another server): ``MNEME_CLIENT_TLS_*`` as they are.

The probe dials 127.0.0.1, so the server's certificate must name it (IP SAN 127.0.0.1),
or ``MNEME_CLIENT_TLS_SERVER_NAME`` names a DNS name the certificate has.
"""

from __future__ import annotations

import os
import sys


def target() -> str:
    """The ``host:port`` probed: ``MNEME_HEALTH_ADDRESS``, else 127.0.0.1 at the port of
    ``MNEME_GRPC_ADDRESS`` (default 50051)."""
    explicit = os.environ.get("MNEME_HEALTH_ADDRESS")
    if explicit:
        return explicit
    listen = os.environ.get("MNEME_GRPC_ADDRESS", "127.0.0.1:50051")
    port = listen.rsplit(":", 1)[-1]
    return f"127.0.0.1:{port}"


def probe_tls(settings, local: bool):
    """The probe's :class:`mneme.grpc_util.ClientTLS`, or None for plaintext, from
    :class:`mneme.config.Settings` ``settings``; ``local``: the probe targets this
    container's own server (rules in the module docstring). Raises ValueError for a
    client certificate without its key (or the other way round)."""
    from mneme.grpc_util import ClientTLS
    tls = ClientTLS.from_settings(settings)
    if not local:
        return tls
    if not (settings.tls_cert and settings.tls_key):
        return None  # the server here is plaintext, whatever this process's clients use
    tls = tls or ClientTLS()
    if settings.auth_mode == "mtls" and not tls.cert:
        # The server's own pair as the client certificate: no extra files to mount.
        tls = ClientTLS(ca=tls.ca, cert=settings.tls_cert, key=settings.tls_key,
                        server_name=tls.server_name)
    return tls


def main(argv: list[str]) -> int:
    """Probe once; ``argv``: [service name] (default "" = the whole server). Returns the
    exit status: 0 when SERVING, else 1 (also for unusable settings or files)."""
    import grpc
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    from mneme.config import Settings
    from mneme.grpc_util import secure_channel

    service = argv[0] if argv else ""
    address = target()
    try:
        tls = probe_tls(Settings(), local=not os.environ.get("MNEME_HEALTH_ADDRESS"))
        channel = secure_channel(address, tls)
    except (ValueError, OSError) as e:  # pydantic's ValidationError is a ValueError
        print(f"{address}: cannot probe: {' '.join(str(e).split())}", file=sys.stderr)
        return 1
    try:
        with channel:
            reply = health_pb2_grpc.HealthStub(channel).Check(
                health_pb2.HealthCheckRequest(service=service), timeout=4)
    except grpc.RpcError as exc:
        mode = f"TLS ({tls!r})" if tls else "plaintext"
        print(f"{address} over {mode}: {exc.code().name}: {exc.details()}", file=sys.stderr)
        return 1
    status = health_pb2.HealthCheckResponse.ServingStatus.Name(reply.status)
    print(f"{address} {service or '(server)'}: {status}")
    return 0 if reply.status == health_pb2.HealthCheckResponse.SERVING else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
