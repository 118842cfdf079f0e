"""TLS clients against a real ``mneme up`` with ``MNEME_AUTH_MODE=mtls``: the SDK (its
``tls=`` argument and ``MNEME_CLIENT_TLS_*``), the CLI (``--tls-*`` flags), reflect's
RemoteRecall (reflect → search) each retain or recall over mTLS; a client without a
certificate, or with one from another CA, is refused; the server's certificate files
are rotated under the running server (new connections get the new chain) and a client
follows a rotated CA file without being rebuilt."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
from datetime import datetime, timezone
from pathlib import Path

import grpc
import pytest

from mneme.auth import KeyStore
from mneme.client import MnemeClient
from mneme.domain import RecallQuery
from mneme.grpc_util import ClientTLS
from tests.e2e.certs import HAVE_OPENSSL, issue, make_ca
from tests.e2e.server import Server

pytestmark = pytest.mark.skipif(not HAVE_OPENSSL, reason="no openssl")

MNEME = str(Path(sys.executable).with_name("mneme"))


@pytest.fixture(scope="module")
def pki(tmp_path_factory) -> Path:
    d = tmp_path_factory.mktemp("pki")
    make_ca(d)
    issue(d, "server", "localhost", server=True)
    issue(d, "alice", "svc-alice")      # write on bank alice
    issue(d, "reflect", "svc-reflect")  # read on bank alice: reflect's own identity
    make_ca(d, "rogue")
    issue(d, "mallory", "svc-alice", ca="rogue")  # the right CN, the wrong CA
    return d


@pytest.fixture(scope="module")
def up(pki, tmp_path_factory):
    data = tmp_path_factory.mktemp("mtls-up") / "data"
    keys = KeyStore(data / "api_keys.json")
    keys.add(["alice"], "write", subject="svc-alice")
    keys.add(["alice"], "read", subject="svc-reflect")
    env = {"MNEME_AUTH_MODE": "mtls", "MNEME_TLS_CERT": str(pki / "server.pem"),
           "MNEME_TLS_KEY": str(pki / "server.key"), "MNEME_TLS_CLIENT_CA": str(pki / "ca.pem")}
    with pytest.MonkeyPatch.context() as mp:
        # The harness's own readiness client (MnemeClient's default) reads these.
        for var, name in (("CA", "ca.pem"), ("CERT", "alice.pem"), ("KEY", "alice.key")):
            mp.setenv(f"MNEME_CLIENT_TLS_{var}", str(pki / name))
        server = Server(data, env=env).start()
    yield server
    server.stop()


def _tls(pki: Path, who: str | None = "alice", ca: str = "ca.pem") -> ClientTLS:
    return ClientTLS(ca=str(pki / ca), cert=str(pki / f"{who}.pem") if who else "",
                     key=str(pki / f"{who}.key") if who else "")


def test_sdk_retain_and_recall_over_mtls(up, pki):
    with MnemeClient(up.address, timeout=120, tls=_tls(pki)) as m:
        m.upsert_bank("alice")
        r = m.retain("alice", [{"content": "Alice: I moved to Lisbon last May."}])
        assert r.memory_ids
        hits = m.recall("alice", "Where does Alice live?").results
        assert any("Lisbon" in h.memory.text for h in hits)


def test_cli_retain_and_recall_over_mtls(up, pki):
    flags = ["--tls-ca", str(pki / "ca.pem"), "--tls-cert", str(pki / "alice.pem"),
             "--tls-key", str(pki / "alice.key")]
    env = {k: v for k, v in os.environ.items() if not k.startswith("MNEME_CLIENT_TLS_")}
    run = lambda *a: subprocess.run([MNEME, *flags, *a], capture_output=True, text=True,  # noqa: E731
                                    env=env, timeout=180)
    out = run("retain", "alice", "Alice: my sister Ana is a violinist.", "-a", up.address)
    assert out.returncode == 0, out.stderr
    assert "facts" in out.stdout
    out = run("recall", "alice", "Who plays the violin?", "--json", "-a", up.address)
    assert out.returncode == 0, out.stderr
    results = json.loads(out.stdout).get("results", [])
    texts = [r["memory"]["text"] for r in results]
    assert any("violin" in t for t in texts)
    assert "fact_type" in results[0]["memory"]  # the proto's names, as every --json prints
    # The same command without the client certificate: the handshake is refused.
    out = subprocess.run([MNEME, "--tls-ca", str(pki / "ca.pem"), "recall", "alice", "x",
                          "-a", up.address], capture_output=True, text=True, env=env,
                         timeout=180)
    assert out.returncode != 0 and "UNAVAILABLE" in out.stdout + out.stderr


def test_reflect_recalls_from_search_over_mtls(up, pki):
    """reflect → search: RemoteRecall (what ``mneme serve reflect`` builds from
    MNEME_SEARCH_ADDRESS and MNEME_CLIENT_TLS_*) against the mtls server's search."""
    from services.reflect.remote import RemoteRecall
    with MnemeClient(up.address, timeout=120, tls=_tls(pki)) as m:
        m.upsert_bank("alice")
        m.retain("alice", [{"content": "Alice: I adopted a cat called Miso."}])
    remote = RemoteRecall(up.address, tls=_tls(pki, "reflect"))
    try:
        assert remote.ping()
        out = remote(RecallQuery("alice", "What is the cat called?", datetime.now(timezone.utc)))
        assert any("Miso" in s.fact.text for s in out.results)
    finally:
        remote.close()
    # Without a client certificate search is unreachable for reflect.
    from mneme.errors import Unavailable
    bare = RemoteRecall(up.address, tls=_tls(pki, None), timeout=10)
    try:
        with pytest.raises(Unavailable):
            bare(RecallQuery("alice", "cat", datetime.now(timezone.utc)))
    finally:
        bare.close()


@pytest.mark.parametrize("who", [None, "mallory"])
def test_missing_or_foreign_client_certificate_is_refused(up, pki, who):
    with MnemeClient(up.address, timeout=10, tls=_tls(pki, who)) as m:
        with pytest.raises(grpc.RpcError) as e:
            m.get_bank("alice")
        assert e.value.code() == grpc.StatusCode.UNAVAILABLE  # handshake refused


def test_server_certificate_rotation(up, pki, tmp_path):
    """Rewrite the server's certificate files with a chain from a new CA: the running
    server presents it on new connections; a client follows a rewritten CA file without
    being rebuilt. (Last in the module: it changes the shared files.)"""
    with MnemeClient(up.address, timeout=30, tls=_tls(pki)) as before:
        assert before.get_bank("alice").name == "banks/alice"
    new = tmp_path / "new"
    new.mkdir()
    shutil.copy(pki / "ca.pem", new / "ca.pem")
    shutil.copy(pki / "ca.key", new / "ca.key")
    make_ca(new, "ca2")
    issue(new, "server2", "localhost", ca="ca2", server=True)
    # Key first, then certificate: a handshake in between finds a key that does not
    # match the certificate, and the server keeps the old pair until both are written.
    shutil.copy(new / "server2.key", pki / "server.key")
    shutil.copy(new / "server2.pem", pki / "server.pem")
    # A long-lived client trusting (through its own CA file) only the old CA is refused
    # by the new chain …
    trust = tmp_path / "trust.pem"
    shutil.copy(pki / "ca.pem", trust)
    m = MnemeClient(up.address, timeout=5, tls=ClientTLS(
        ca=str(trust), cert=str(pki / "alice.pem"), key=str(pki / "alice.key"),
        check_every_s=0.2))
    try:
        with pytest.raises(grpc.RpcError) as e:
            m.get_bank("alice")
        assert e.value.code() == grpc.StatusCode.UNAVAILABLE
        # … and gets in once its CA file names the new CA: the same client object.
        trust.write_bytes((new / "ca2.pem").read_bytes())
        time.sleep(0.3)
        assert m.get_bank("alice").name == "banks/alice"
    finally:
        m.close()
    # Any new client trusting the new CA is served with the new chain.
    with MnemeClient(up.address, timeout=30, tls=ClientTLS(
            ca=str(new / "ca2.pem"), cert=str(pki / "alice.pem"),
            key=str(pki / "alice.key"))) as fresh:
        assert fresh.get_bank("alice").name == "banks/alice"
