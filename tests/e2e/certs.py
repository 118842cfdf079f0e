"""Test certificates made with the ``openssl`` command in a directory: a CA, and leaf
certificates it signs (server ones with subjectAltName localhost/127.0.0.1)."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

HAVE_OPENSSL = shutil.which("openssl") is not None


def _openssl(*args, cwd: Path) -> None:
    subprocess.run(["openssl", *args], cwd=cwd, check=True, capture_output=True)


def make_ca(d: Path, name: str = "ca") -> Path:
    """``<name>.pem``/``<name>.key`` in ``d``: a self-signed CA (CN ``test-<name>``)."""
    d.mkdir(parents=True, exist_ok=True)
    _openssl("req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "2",
             "-subj", f"/CN=test-{name}", "-keyout", f"{name}.key", "-out", f"{name}.pem",
             cwd=d)
    return d / f"{name}.pem"


def issue(d: Path, name: str, cn: str, ca: str = "ca", server: bool = False
          ) -> tuple[Path, Path]:
    """``<name>.pem``/``<name>.key`` in ``d``, CN ``cn``, signed by ``ca`` (in ``d``);
    ``server``: with subjectAltName DNS:localhost, IP:127.0.0.1. Returns (cert, key)."""
    _openssl("req", "-newkey", "rsa:2048", "-nodes", "-subj", f"/CN={cn}",
             "-keyout", f"{name}.key", "-out", f"{name}.csr", cwd=d)
    extra = []
    if server:
        (d / f"{name}.ext").write_text("subjectAltName=DNS:localhost,IP:127.0.0.1\n")
        extra = ["-extfile", f"{name}.ext"]
    _openssl("x509", "-req", "-in", f"{name}.csr", "-CA", f"{ca}.pem", "-CAkey", f"{ca}.key",
             "-CAcreateserial", "-days", "2", "-out", f"{name}.pem", *extra, cwd=d)
    return d / f"{name}.pem", d / f"{name}.key"
