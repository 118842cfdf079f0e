"""A damaged embedded event log (issue 9, item 5), through the real ``mneme`` CLI and a
real ``mneme up``: a truncated or garbled log.db refuses to start with a message naming
the file and the remedy; ``mneme log recover`` keeps every intact record, after which the
server starts and what was acknowledged is recallable; damage while running turns health
NOT_SERVING and makes writes fail at once with UNAVAILABLE."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from mneme.runtime.grpc_server import LIVENESS

from tests.e2e.server import Server, inherited, up_refuses

pytestmark = pytest.mark.slow

MNEME = str(Path(sys.executable).with_name("mneme"))
ENV = {**inherited(), "HF_HUB_OFFLINE": "1", "MNEME_METRICS_PORT": "0"}
FACTS = ["Alice moved to Lisbon in 2019 to work as a marine biologist.",
         "Bob adopted a grey cat called Pixel last spring.",
         "Carol ran the Berlin marathon in three hours and ten minutes."]


def _filled(tmp_path: Path) -> Path:
    """A data dir whose log holds a bank with FACTS (the server stopped cleanly)."""
    data = tmp_path / "data"
    server = Server(data).start()
    try:
        with server.client(timeout=60) as m:
            m.upsert_bank("ops")
            for text in FACTS:
                assert m.retain("ops", [{"content": text}]).operation.state == 3  # SUCCEEDED
    finally:
        server.stop()
    wal = data / "log.db-wal"  # a clean stop folds the WAL into log.db (SqliteEventLog.close)
    assert not wal.exists() or wal.stat().st_size == 0, wal.stat().st_size
    return data


def _assert_names_file_and_remedy(out: str, data: Path) -> None:
    assert f"{data.resolve()}/log.db is damaged" in out, out
    assert "restore the file from a backup" in out and "mneme log recover" in out, out
    assert "Traceback" not in out, out


def test_truncated_log_refuses_to_start(tmp_path):
    data = _filled(tmp_path)
    log_db = data / "log.db"
    os.truncate(log_db, log_db.stat().st_size - 4096)  # the last page is gone
    out = up_refuses(data)
    _assert_names_file_and_remedy(out, data)
    assert "truncated" in out


def test_garbage_appended_refuses_then_recover_keeps_every_record(tmp_path):
    data = _filled(tmp_path)
    log_db = data / "log.db"
    before = log_db.stat().st_size
    with open(log_db, "ab") as f:
        f.write(os.urandom(10_000))
    out = up_refuses(data)
    _assert_names_file_and_remedy(out, data)

    rec = subprocess.run([MNEME, "log", "recover", "--data-dir", str(data)], env=ENV,
                         capture_output=True, text=True, timeout=180)
    assert rec.returncode == 0, rec.stdout + rec.stderr
    assert "bytes appended" in rec.stdout and "lost 0 records" in rec.stdout, rec.stdout
    damaged = [p for p in data.iterdir() if p.name.startswith("log.db.damaged-")
               and not p.name.endswith(("-wal", "-shm"))]
    assert len(damaged) == 1 and damaged[0].stat().st_size == before + 10_000
    # rebuild every projection from the recovered log alone: what it kept is the truth
    rp = subprocess.run([MNEME, "replay", "--data-dir", str(data)], env=ENV,
                        capture_output=True, text=True, timeout=300)
    assert rp.returncode == 0, rp.stdout + rp.stderr

    server = Server(data).start()
    try:
        with server.client(timeout=60) as m:
            texts = {mem.text for mem in m.list_memories("ops")}
            for needle in ("Lisbon", "Pixel", "Berlin marathon"):
                assert any(needle in t for t in texts), texts
                hits = m.recall("ops", needle).results
                assert any(needle in r.memory.text for r in hits), needle
            # the recovered log takes new writes
            assert m.retain("ops", [{"content": "Dan sold his bicycle."}]).operation.state == 3
    finally:
        server.stop()


def test_damage_while_running_turns_health_not_serving_and_writes_fail_fast(tmp_path):
    server = Server(tmp_path / "data").start()
    try:
        with server.client(timeout=60) as m:
            m.upsert_bank("ops")
            assert m.retain("ops", [{"content": FACTS[0]}]).operation.state == 3
        health = health_pb2_grpc.HealthStub(grpc.insecure_channel(server.address))
        check = lambda name="": health.Check(  # noqa: E731
            health_pb2.HealthCheckRequest(service=name), timeout=5).status
        assert check() == health_pb2.HealthCheckResponse.SERVING
        # the liveness probe `mneme serve` answers (the chart's), answered by `mneme up` too
        assert check(LIVENESS) == health_pb2.HealthCheckResponse.SERVING
        with open(tmp_path / "data" / "log.db", "ab") as f:
            f.write(os.urandom(3000))
        deadline = time.monotonic() + 10
        while check() != health_pb2.HealthCheckResponse.NOT_SERVING:
            assert time.monotonic() < deadline, "health still SERVING on a damaged log"
            time.sleep(0.2)
        # not ready, but alive: a restart would not repair the log
        assert check(LIVENESS) == health_pb2.HealthCheckResponse.SERVING
        with server.client(timeout=30) as m:
            t = time.monotonic()
            with pytest.raises(grpc.RpcError) as e:
                m.retain("ops", [{"content": FACTS[1]}])
            assert e.value.code() == grpc.StatusCode.UNAVAILABLE, e.value.details()
            assert time.monotonic() - t < 3
            assert "damaged" in e.value.details() and "mneme log recover" in e.value.details()
    finally:
        server.stop()
    assert server.log.read_text().count("pass failed") < 40  # backed off, not spinning


def test_a_wal_cut_at_rest_refuses_then_recover_and_replay_serve_what_the_log_kept(tmp_path):
    """mneme killed (its log's WAL holds the last commits), then the WAL cut while it is
    stopped: the start silently served a log without its tail, under projections that
    still held what the lost records made. Now it refuses, naming the WAL; `mneme log
    recover` and `mneme replay --force` rebuild every projection from what the log kept,
    and the server serves and takes writes again."""
    data = tmp_path / "data"
    server = Server(data).start()
    with server.client(timeout=60) as m:
        m.upsert_bank("ops")
        for text in FACTS:
            assert m.retain("ops", [{"content": text}]).operation.state == 3
    server.kill()
    wal, frame = data / "log.db-wal", 24 + 4096
    assert wal.stat().st_size > 32 + 4 * frame
    os.truncate(wal, wal.stat().st_size - 2 * frame)
    out = up_refuses(data)
    _assert_names_file_and_remedy(out, data)
    assert f"{data.resolve()}/log.db-wal was cut or damaged" in out, out

    rec = subprocess.run([MNEME, "log", "recover", "--data-dir", str(data)], env=ENV,
                         capture_output=True, text=True, timeout=180)
    assert rec.returncode == 0 and "was cut or damaged" in rec.stdout, rec.stdout + rec.stderr
    rp = subprocess.run([MNEME, "replay", "--force", "--data-dir", str(data)], env=ENV,
                        capture_output=True, text=True, timeout=300)
    assert rp.returncode == 0, rp.stdout + rp.stderr
    server.start()
    try:
        with server.client(timeout=60) as m:
            kept = {mem.id for mem in m.list_memories("ops")}
            assert m.retain("ops", [{"content": "Dan sold his bicycle."}]).operation.state == 3
            assert kept < {mem.id for mem in m.list_memories("ops")}
    finally:
        server.stop()
