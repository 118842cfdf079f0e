"""The container health check (deploy/healthcheck.py, Docker's HEALTHCHECK and the Helm
probes under TLS) run as a subprocess, as the orchestrator runs it, with the environment
the server's container has: against a real ``mneme up`` over mTLS it exits 0 (the
server's own certificate doubles as the client certificate, or the one named by
``MNEME_CLIENT_TLS_*``); it exits non-zero without a client certificate, over
plaintext, and when no server listens; against a TLS server in open mode and a plaintext
server it follows the server. Certificates come from ``openssl`` (skipped without it)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from mneme.auth import KeyStore
from tests.e2e.certs import HAVE_OPENSSL, issue, make_ca
from tests.e2e.server import ROOT, Server, free_port

pytestmark = pytest.mark.skipif(not HAVE_OPENSSL, reason="no openssl")

PROBE = str(ROOT / "deploy" / "healthcheck.py")


@pytest.fixture(scope="module")
def pki(tmp_path_factory) -> Path:
    d = tmp_path_factory.mktemp("pki")
    make_ca(d)
    issue(d, "server", "localhost", server=True)
    issue(d, "alice", "svc-alice")
    return d


def _server_env(pki: Path, mode: str) -> dict[str, str]:
    return {"MNEME_AUTH_MODE": mode, "MNEME_TLS_CERT": str(pki / "server.pem"),
            "MNEME_TLS_KEY": str(pki / "server.key"), "MNEME_TLS_CLIENT_CA": str(pki / "ca.pem")}


def _start(tmp_path_factory, name: str, env: dict, client_env: dict) -> Server:
    data = tmp_path_factory.mktemp(name) / "data"
    KeyStore(data / "api_keys.json").add(["alice"], "write", subject="svc-alice")
    with pytest.MonkeyPatch.context() as mp:
        for k, v in client_env.items():  # the harness's readiness client reads these
            mp.setenv(k, v)
        return Server(data, env=env).start()


@pytest.fixture(scope="module")
def mtls_up(pki, tmp_path_factory):
    server = _start(tmp_path_factory, "hc-mtls", _server_env(pki, "mtls"),
                    {"MNEME_CLIENT_TLS_CA": str(pki / "ca.pem"),
                     "MNEME_CLIENT_TLS_CERT": str(pki / "alice.pem"),
                     "MNEME_CLIENT_TLS_KEY": str(pki / "alice.key")})
    yield server
    server.stop()


def probe(env: dict[str, str], *args: str) -> subprocess.CompletedProcess:
    """Run the health check with only ``env``'s MNEME_* variables (none of this process's)."""
    base = {k: v for k, v in os.environ.items() if not k.startswith("MNEME_")}
    return subprocess.run([sys.executable, PROBE, *args], env={**base, **env},
                          capture_output=True, text=True, timeout=60, cwd=ROOT.parent)


def _container_env(server: Server, extra: dict[str, str]) -> dict[str, str]:
    """What the server's container has: its settings (MNEME_GRPC_ADDRESS: the probe
    dials 127.0.0.1 at that port) and ``extra``."""
    return {**server.env, "MNEME_GRPC_ADDRESS": f"0.0.0.0:{server.port}", **extra}


def test_mtls_probe_with_the_servers_own_certificate(mtls_up, pki):
    env = _container_env(mtls_up, {"MNEME_CLIENT_TLS_CA": str(pki / "ca.pem")})
    out = probe(env)
    assert out.returncode == 0, out.stderr
    assert "SERVING" in out.stdout
    named = probe(env, "mneme.v1.RecallService")
    assert named.returncode == 0, named.stderr


def test_mtls_probe_with_the_client_settings_certificate(mtls_up, pki):
    env = _container_env(mtls_up, {"MNEME_CLIENT_TLS_CA": str(pki / "ca.pem"),
                                   "MNEME_CLIENT_TLS_CERT": str(pki / "alice.pem"),
                                   "MNEME_CLIENT_TLS_KEY": str(pki / "alice.key")})
    out = probe(env)
    assert out.returncode == 0, out.stderr


def test_mtls_probe_without_a_certificate_fails(mtls_up, pki):
    # Another server's address: only the client settings count, and they have no cert.
    out = probe({"MNEME_HEALTH_ADDRESS": mtls_up.address,
                 "MNEME_CLIENT_TLS_CA": str(pki / "ca.pem")})
    assert out.returncode != 0
    assert "UNAVAILABLE" in out.stderr and "Traceback" not in out.stderr


def test_plaintext_probe_of_a_tls_server_fails(mtls_up):
    out = probe({"MNEME_HEALTH_ADDRESS": mtls_up.address})
    assert out.returncode != 0
    assert "plaintext" in out.stderr and "Traceback" not in out.stderr


def test_probe_fails_when_no_server_listens(pki):
    env = {**_server_env(pki, "mtls"), "MNEME_GRPC_ADDRESS": f"0.0.0.0:{free_port()}",
           "MNEME_CLIENT_TLS_CA": str(pki / "ca.pem")}
    out = probe(env)
    assert out.returncode != 0
    assert "UNAVAILABLE" in out.stderr


def test_probe_fails_cleanly_on_a_missing_certificate_file(mtls_up, pki):
    env = _container_env(mtls_up, {"MNEME_CLIENT_TLS_CA": str(pki / "missing.pem")})
    out = probe(env)
    assert out.returncode != 0
    assert "missing.pem" in out.stderr and "Traceback" not in out.stderr


def test_probe_follows_a_tls_server_in_open_mode_and_a_plaintext_one(pki, tmp_path_factory):
    """TLS without client certificates (auth open), and a plaintext server whose
    container sets MNEME_CLIENT_TLS_* for its own calls: both probes pass."""
    ca = {"MNEME_CLIENT_TLS_CA": str(pki / "ca.pem")}
    tls_env = {k: v for k, v in _server_env(pki, "open").items() if k != "MNEME_TLS_CLIENT_CA"}
    server = _start(tmp_path_factory, "hc-tls", tls_env, ca)
    try:
        out = probe(_container_env(server, ca))
        assert out.returncode == 0, out.stderr
    finally:
        server.stop()
    server = _start(tmp_path_factory, "hc-plain", {}, {})
    try:
        out = probe(_container_env(server, ca))  # the container's clients use TLS elsewhere
        assert out.returncode == 0, out.stderr
        server.stop()
        down = probe(_container_env(server, {}))  # the same server, stopped
        assert down.returncode != 0
    finally:
        server.stop()


def test_the_helm_charts_tls_settings_make_its_exec_probe_pass(pki, tmp_path_factory):
    """`helm template` with tls.secretName and auth.mode mtls: the ConfigMap's MNEME_TLS_* /
    MNEME_CLIENT_TLS_* (the Secret's files, laid out as cert-manager writes them) run a
    real server over mTLS, and the rendered exec probe, run with that environment, exits 0."""
    import importlib.util
    import shutil

    import yaml
    spec = importlib.util.spec_from_file_location("helm_check", ROOT / "scripts" / "helm_check.py")
    hc = importlib.util.module_from_spec(spec)
    sys.modules["helm_check"] = hc  # as tests/deploy/test_helm.py loads it
    spec.loader.exec_module(hc)
    if not hc.HELM.is_file():
        pytest.skip("no helm binary (make helm)")
    rendered = hc.template(sets=["tls.secretName=mneme-tls", "auth.mode=mtls"])
    objs = {(o["kind"], o["metadata"]["name"]): o for o in yaml.safe_load_all(rendered) if o}
    secret = tmp_path_factory.mktemp("mneme-tls")  # the Secret as mounted
    for src, dst in (("server.pem", "tls.crt"), ("server.key", "tls.key"), ("ca.pem", "ca.crt")):
        shutil.copy(pki / src, secret / dst)
    mount = "/etc/mneme/tls/"
    config = objs[("ConfigMap", "mneme")]["data"]
    env = {k: v.replace(mount, f"{secret}/") for k, v in config.items()
           if k.startswith(("MNEME_TLS_", "MNEME_CLIENT_TLS_", "MNEME_AUTH_MODE"))}
    assert env["MNEME_AUTH_MODE"] == "mtls" and env["MNEME_TLS_CERT"] == f"{secret}/tls.crt"
    container = objs[("Deployment", "mneme-search")]["spec"]["template"]["spec"]["containers"][0]
    command = container["readinessProbe"]["exec"]["command"]
    assert command == ["python", "/usr/local/lib/mneme/healthcheck.py"]
    tls_mount = {"name": "tls", "mountPath": mount.rstrip("/"), "readOnly": True}
    assert tls_mount in container["volumeMounts"]
    server = _start(tmp_path_factory, "hc-helm", env, env)
    try:
        out = probe({**env, "MNEME_GRPC_ADDRESS": f"0.0.0.0:{server.port}"})  # runs PROBE
        assert out.returncode == 0, out.stderr
    finally:
        server.stop()
