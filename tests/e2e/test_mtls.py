"""MNEME_AUTH_MODE=mtls on the embedded server in this process: a client certificate
signed by MNEME_TLS_CLIENT_CA whose CN is a key entry's subject gets that entry's
scopes; without a certificate the TLS handshake fails. Certificates come from the
``openssl`` command (skipped without it)."""

from __future__ import annotations

import shutil
import subprocess

import grpc
import pytest

from mneme.auth import KeyStore
from mneme.runtime.embedded import bootstrap
from mneme.config import Settings
from mneme.v1 import banks_pb2, banks_pb2_grpc, resources_pb2

pytestmark = pytest.mark.skipif(shutil.which("openssl") is None, reason="no openssl")


def _openssl(*args, cwd):
    subprocess.run(["openssl", *args], cwd=cwd, check=True, capture_output=True)


def _certs(d):
    _openssl("req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "2", "-subj", "/CN=test-ca",
             "-keyout", "ca.key", "-out", "ca.pem", cwd=d)
    for name, cn, ext in (("server", "localhost", "subjectAltName=DNS:localhost,IP:127.0.0.1"),
                          ("client", "svc-alice", None)):
        _openssl("req", "-newkey", "rsa:2048", "-nodes", "-subj", f"/CN={cn}",
                 "-keyout", f"{name}.key", "-out", f"{name}.csr", cwd=d)
        extra = []
        if ext:
            (d / f"{name}.ext").write_text(ext + "\n")
            extra = ["-extfile", f"{name}.ext"]
        _openssl("x509", "-req", "-in", f"{name}.csr", "-CA", "ca.pem", "-CAkey", "ca.key",
                 "-CAcreateserial", "-days", "2", "-out", f"{name}.pem", *extra, cwd=d)


def test_client_certificate_maps_to_scopes(tmp_path):
    certs = tmp_path / "certs"
    certs.mkdir()
    _certs(certs)
    data = tmp_path / "data"
    KeyStore(data / "api_keys.json").add(["alice"], "write", subject="svc-alice")
    st = Settings(data_dir=data, auth_mode="mtls", tls_cert=str(certs / "server.pem"),
                  tls_key=str(certs / "server.key"), tls_client_ca=str(certs / "ca.pem"))
    node = bootstrap(st)
    node.start()
    port = node.serve("127.0.0.1:0")
    try:
        creds = grpc.ssl_channel_credentials(
            root_certificates=(certs / "ca.pem").read_bytes(),
            private_key=(certs / "client.key").read_bytes(),
            certificate_chain=(certs / "client.pem").read_bytes())
        opts = [("grpc.ssl_target_name_override", "localhost")]
        with grpc.secure_channel(f"127.0.0.1:{port}", creds, options=opts) as ch:
            banks = banks_pb2_grpc.BankServiceStub(ch)
            b = banks.UpsertBank(banks_pb2.UpsertBankRequest(
                bank=resources_pb2.Bank(name="banks/alice")), timeout=60)
            assert b.name == "banks/alice"
            with pytest.raises(grpc.RpcError) as e:
                banks.UpsertBank(banks_pb2.UpsertBankRequest(
                    bank=resources_pb2.Bank(name="banks/bob")), timeout=60)
            assert e.value.code() == grpc.StatusCode.PERMISSION_DENIED
        no_cert = grpc.ssl_channel_credentials(root_certificates=(certs / "ca.pem").read_bytes())
        with grpc.secure_channel(f"127.0.0.1:{port}", no_cert, options=opts) as ch:
            with pytest.raises(grpc.RpcError) as e:
                banks_pb2_grpc.BankServiceStub(ch).GetBank(
                    banks_pb2.GetBankRequest(name="banks/alice"), timeout=10)
            assert e.value.code() == grpc.StatusCode.UNAVAILABLE  # handshake refused
    finally:
        node.close()
