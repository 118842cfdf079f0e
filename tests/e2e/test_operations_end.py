"""Operations always end (issue 9, item 3), against a real ``mneme up``: an event that
dead-letters fails its operation (a sync retain returns FAILED at once with the error,
GetOperation shows it, also after a restart and a replay), the failed projection leaves
the fact in no store, and NUL text already on a log projects into all three stores."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
import uuid
from pathlib import Path

import pytest

from mneme.bus.codec import encode
from mneme.bus.sqlite_log import SqliteEventLog
from mneme.events.v1 import events_pb2 as ev
from mneme.v1 import operations_pb2
from tests.e2e.server import Server, inherited

pytestmark = pytest.mark.slow

MNEME = str(Path(sys.executable).with_name("mneme"))
ENV = {**inherited(), "HF_HUB_OFFLINE": "1", "MNEME_METRICS_PORT": "0"}
FAILED, SUCCEEDED = operations_pb2.FAILED, operations_pb2.SUCCEEDED


def _replay(data: Path) -> None:
    p = subprocess.run([MNEME, "replay", "--data-dir", str(data)], env=ENV,
                       capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, p.stdout + p.stderr


class _RefusingRedis:
    """A Redis-protocol server on unix socket ``path`` that answers every command with an
    error (``-ERR``): a store that is there but fails each write, as a bug would."""

    def __init__(self, path: str) -> None:
        import socket
        import threading
        if os.path.exists(path):
            os.unlink(path)
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.sock.bind(path)
        self.sock.listen(16)
        self.closed = threading.Event()
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        import threading
        while not self.closed.is_set():
            try:
                conn, _ = self.sock.accept()
            except OSError:
                return
            threading.Thread(target=self._serve, args=(conn,), daemon=True).start()

    @staticmethod
    def _commands(buf: bytes) -> tuple[int, bytes]:
        """(complete RESP commands at the start of ``buf``, the rest)."""
        n = 0
        while buf.startswith(b"*"):
            end = buf.find(b"\r\n")
            if end < 0:
                break
            pos, ok = end + 2, True
            for _ in range(int(buf[1:end])):
                head = buf.find(b"\r\n", pos)
                if head < 0:
                    ok = False
                    break
                pos = head + 2 + int(buf[pos + 1:head]) + 2
                if pos > len(buf):
                    ok = False
                    break
            if not ok:
                break
            n, buf = n + 1, buf[pos:]
        return n, buf

    def _serve(self, conn) -> None:
        buf = b""
        with conn:
            while True:
                try:
                    data = conn.recv(65536)
                except OSError:
                    return
                if not data:
                    return
                n, buf = self._commands(buf + data)
                conn.sendall(b"-ERR refused by the test\r\n" * n)

    def close(self) -> None:
        self.closed.set()
        self.sock.close()


def test_a_dead_lettered_projection_fails_the_sync_retain_at_once(tmp_path):
    data = tmp_path / "data"
    server = Server(data).start()
    try:
        with server.client(timeout=60) as m:
            m.upsert_bank("ops")
            assert m.retain("ops", [{"content": "Alice lives in Lisbon."}]).operation.state \
                == SUCCEEDED
            # a real store failure that retrying cannot mend: the graph store's server is
            # replaced by one that refuses every command (a server that merely went away is
            # waited for, not dead-lettered: test_event_log's held-back tests)
            settings = json.loads((data / "graph.db.settings").read_text())
            os.kill(int(open(settings["pidfile"]).read()), signal.SIGKILL)
            refusing = _RefusingRedis(settings["unixsocket"])
            t = time.monotonic()
            r = m.retain("ops", [{"content": "Bob keeps bees in Porto."}], timeout=60)
            took = time.monotonic() - t
            op = r.operation
            assert op.state == FAILED, op
            assert took < 15, f"sync retain took {took:.1f}s"
            assert "search could not process FactsExtracted" in op.error, op.error
            got = m.get_operation(op.name.split("/", 1)[1])
            assert got.state == FAILED and got.error == op.error
            # all or nothing: the vector store was undone, the fact is in no store
            assert not any("bees" in mem.text for mem in m.list_memories("ops"))
            op_id = op.name.split("/", 1)[1]
    finally:
        server.stop()
        if "refusing" in locals():
            refusing.close()

    _replay(data)  # the failure is on the log (mneme.progress.v1): replay keeps it
    server.start()
    try:
        with server.client(timeout=60) as m:
            got = m.get_operation(op_id)
            assert got.state == FAILED and "FactsExtracted" in got.error
    finally:
        server.stop()


def test_nul_text_already_on_the_log_projects_into_all_three_stores(tmp_path):
    data = tmp_path / "data"
    server = Server(data).start()
    with server.client(timeout=60) as m:
        m.upsert_bank("old")
    server.stop()
    # an event written before ingest refused control characters
    op_id = str(uuid.uuid4())
    text = "Alice\x00 moved to Lisbon in 2019 and opened a bakery there."
    log = SqliteEventLog(data / "log.db")
    item = ev.RetainItem(content=text, document_id="doc\x001")
    item.timestamp.FromSeconds(1_700_000_000)  # ingest always stamps items
    log.append([encode(ev.RetainRequested(bank_id="old", operation_id=op_id, items=[item]),
                       bank_id="old", source="mneme/ingest")])
    log.close()

    def check(m) -> None:
        deadline = time.monotonic() + 60
        while (op := m.get_operation(op_id)).state != SUCCEEDED:
            assert op.state != FAILED, op.error
            assert time.monotonic() < deadline, op
            time.sleep(0.2)
        mems = [mem for mem in m.list_memories("old") if "bakery" in mem.text]
        assert mems and "\x00" not in mems[0].text, mems  # vector store
        assert mems[0].document_id == "doc\ufffd1"
        hits = {h.memory.id: h.scores for h in m.recall("old", "Alice bakery Lisbon").results}
        scores = hits[mems[0].id]
        assert scores.keyword_rank > 0, scores  # BM25
        assert m.bank_stats("old").entities > 0  # graph

    for replayed in (False, True):  # as projected live, then rebuilt by replay
        if replayed:
            _replay(data)
        server.start()
        try:
            with server.client(timeout=60) as m:
                check(m)
        finally:
            server.stop()
