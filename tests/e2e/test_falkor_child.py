"""SIGKILL of ``mneme up`` takes its FalkorDB child (the embedded redis-server) with it,
at any moment: while it starts, once it serves, and with its supervisor (issue 9, item
13); a server an earlier run left behind is stopped by the next start on the data dir,
not joined by a second server on the same files; a restart works and keeps the graph."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.e2e.server import Server, inherited

pytestmark = pytest.mark.slow


def _redis_pid_file(data) -> str:
    return json.loads((data / "graph.db.settings").read_text())["pidfile"]


def _redis_pid(data) -> int:
    return int(open(_redis_pid_file(data)).read().strip())


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return b"redis" in f.read()  # a zombie has none
    except OSError:
        return False


def _servers(data: Path) -> list[int]:
    """The live redis-server processes working in ``data`` (Redis changes to the
    directory of its files)."""
    out = []
    for pid in map(int, filter(str.isdigit, os.listdir("/proc"))):
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                if b"redis-server" not in f.read():
                    continue
            if os.readlink(f"/proc/{pid}/cwd") == str(data):
                out.append(pid)
        except OSError:
            pass
    return out


def _gone(data: Path, within: float = 30.0) -> None:
    """Every graph server of ``data`` ends within ``within`` s (the supervisor's SIGTERM,
    SIGKILL after 10 s)."""
    deadline = time.monotonic() + within
    while _servers(data):
        assert time.monotonic() < deadline, f"redis-server {_servers(data)} outlived mneme up"
        time.sleep(0.1)


def _retain_cello(server: Server, bank: str = "k") -> None:
    """Bank ``bank`` with one fact that names entities (what :func:`_holds_the_graph`
    looks for), retained and projected."""
    with server.client(timeout=60) as m:
        m.upsert_bank(bank)
        assert m.retain(bank, [{"content": "Erin plays the cello in Porto."}]
                        ).operation.state == 3


def _holds_the_graph(server: Server, bank: str = "k") -> None:
    with server.client(timeout=60) as m:
        assert m.bank_stats(bank).entities > 0
        assert any("cello" in x.text for x in m.list_memories(bank))


def test_sigkill_of_mneme_up_stops_its_falkordb_child(tmp_path):
    data = tmp_path / "data"
    server = Server(data).start()
    _retain_cello(server)
    pid = _redis_pid(data)
    assert _alive(pid)
    server.kill()
    _gone(data)  # 10 s were the supervisor's own SIGTERM-to-SIGKILL grace: no margin

    server.start()  # a fresh child on the same files, the graph intact
    try:
        with server.client(timeout=60) as m:
            assert m.bank_stats("k").entities > 0
        pid2 = _redis_pid(data)
        assert pid2 != pid
    finally:
        server.stop()
    assert not _alive(pid2)  # a clean stop stops it too


def _up(server: Server) -> subprocess.Popen:
    mneme = Path(sys.executable).with_name("mneme")
    with open(server.log, "ab") as out:
        return subprocess.Popen([str(mneme), "up", "--data-dir", str(server.data_dir),
                                 "--address", server.address], stdout=out,
                                stderr=subprocess.STDOUT,
                                env={**inherited(), "HF_HUB_OFFLINE": "1", **server.env})


def _kill_as_its_server_starts(server: Server) -> None:
    """Start ``mneme up`` and SIGKILL it the moment its graph server exists: the server
    is frozen (SIGSTOP) as soon as it appears, so mneme is still waiting for it to
    answer when it dies; then the server runs on (SIGCONT) as an orphan would."""
    p = _up(server)
    try:
        deadline = time.monotonic() + 120
        while not (pids := _servers(server.data_dir)):
            assert p.poll() is None and time.monotonic() < deadline, server.log.read_text()
            time.sleep(0.001)
        for pid in pids:
            os.kill(pid, signal.SIGSTOP)
    finally:
        p.kill()
        p.wait()
    for pid in pids:
        os.kill(pid, signal.SIGCONT)


def test_sigkill_while_the_graph_server_starts_leaves_no_server(tmp_path):
    """Killed while its graph server was starting (spawned, not yet answering: before,
    no watchdog existed yet), on an empty data dir and on one with data, mneme left the
    server running for good, and the next start ran a second server on the same files."""
    data = tmp_path / "data"
    server = Server(data)
    _kill_as_its_server_starts(server)  # an empty data dir
    _gone(data)
    server.start()
    try:
        _retain_cello(server)
    finally:
        server.stop()
    _gone(data)
    _kill_as_its_server_starts(server)  # loading the graph of the last run
    _gone(data)
    server.start()
    try:
        _holds_the_graph(server)
        assert len(_servers(data)) == 1
    finally:
        server.stop()
    _gone(data)


def test_sigkill_of_mneme_and_its_supervisor_leaves_no_server(tmp_path):
    """Every process of mneme killed at once (an OOM kill, a cgroup's SIGKILL): the
    graph server dies with its supervisor (the kernel's parent-death signal)."""
    import psutil
    data = tmp_path / "data"
    server = Server(data).start()
    try:
        _retain_cello(server)
        (redis,) = _servers(data)
        supervisor = psutil.Process(redis).parent()
        assert supervisor.ppid() == server.proc.pid
        temp = Path(_redis_pid_file(data)).parent  # the server's config, socket, log
        supervisor.kill()
        server.kill()
        _gone(data)
        assert temp.exists()  # nobody was left to remove it
        server.start()
        _holds_the_graph(server)
        assert not temp.exists()  # the next start did
    finally:
        server.stop()
    _gone(data)


_STALE = r"""
import sys
from redislite.falkordb_client import FalkorDB
db = FalkorDB(sys.argv[1], serverconfig={"appendonly": "yes", "appendfsync": "always",
                                         "appenddirname": '"graph.db.aof"'})
print(db.client.pid, flush=True)
sys.stdin.read()
"""


@pytest.mark.parametrize("registered", [True, False])
def test_a_start_stops_a_graph_server_an_earlier_run_left(tmp_path, registered):
    """A graph server of this data dir left running by an earlier run (an earlier
    version's daemonised server, its opener killed; ``registered``: it had written
    graph.db.settings, else it was killed before) is stopped by the next start, which
    serves the stored graph from a server of its own, the only one on the files."""
    data = tmp_path / "data"
    server = Server(data).start()
    try:
        _retain_cello(server)
    finally:
        server.stop()
    _gone(data)
    opener = subprocess.Popen([sys.executable, "-c", _STALE, str(data / "graph.db")],
                              stdin=subprocess.PIPE, stdout=subprocess.PIPE)
    stale = int(opener.stdout.readline())
    opener.kill()  # no cleanup: the daemonised server runs on
    opener.wait()
    try:
        assert _alive(stale)
        if not registered:
            (data / "graph.db.settings").unlink()
        server.start()
        try:
            assert not _alive(stale)
            assert _servers(data) == [_redis_pid(data)]
            _holds_the_graph(server)
        finally:
            server.stop()
        _gone(data)
    finally:
        if _alive(stale):
            os.kill(stale, signal.SIGKILL)


def _health(address: str) -> int:
    import grpc
    from grpc_health.v1 import health_pb2, health_pb2_grpc
    with grpc.insecure_channel(address) as ch:
        return health_pb2_grpc.HealthStub(ch).Check(
            health_pb2.HealthCheckRequest(service=""), timeout=10).status


def test_health_is_not_serving_while_the_graph_server_does_not_answer(tmp_path):
    """The embedded graph server stopped (SIGSTOP) or died: gRPC health stayed SERVING,
    so nothing (a probe, a load balancer, the operator) saw that every Recall failed. It
    is NOT_SERVING while the graph server does not answer, SERVING again once it does,
    and Recall meanwhile answers UNAVAILABLE."""
    import grpc
    from grpc_health.v1 import health_pb2
    SERVING, NOT_SERVING = (health_pb2.HealthCheckResponse.SERVING,
                            health_pb2.HealthCheckResponse.NOT_SERVING)

    def until(status: int) -> int:
        deadline = time.monotonic() + 60  # the health round runs every second
        while (got := _health(server.address)) != status and time.monotonic() < deadline:
            time.sleep(0.2)
        return got

    data = tmp_path / "data"
    server = Server(data).start()
    try:
        with server.client(timeout=60) as m:
            m.upsert_bank("b")
            m.retain("b", [{"content": "Alice keeps bees in Porto."}])
            assert _health(server.address) == SERVING
            pid = _redis_pid(data)
            os.kill(pid, signal.SIGSTOP)
            try:
                assert until(NOT_SERVING) == NOT_SERVING
                with pytest.raises(grpc.RpcError) as err:
                    m.recall("b", "bees")
                assert err.value.code() == grpc.StatusCode.UNAVAILABLE, err.value
            finally:
                os.kill(pid, signal.SIGCONT)
            assert until(SERVING) == SERVING
            assert m.recall("b", "bees").results
    finally:
        server.stop()
