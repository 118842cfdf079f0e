"""SIGKILL the server during a bulk retain and restart it: every acknowledged retain
is present afterwards, and no turn is stored twice."""

from __future__ import annotations

import collections
import threading
import time

import grpc
import pytest

from mneme import locomo
from tests.e2e.server import Server, conversation_file
from tests.waits import drained

pytestmark = pytest.mark.slow


def test_sigkill_during_bulk_retain_loses_nothing_acknowledged(tmp_path):
    conv = next(c for c in locomo.load(conversation_file()) if c["sample_id"] == "conv-26")
    # small sync retains of a few turns each, so the kill lands between and inside them
    items = [i for s in locomo.sessions(conv) for i in s.items][:240]
    batches = [items[n:n + 4] for n in range(0, len(items), 4)]
    for n, b in enumerate(batches):  # a document per batch: re-retaining a document replaces it
        for item in b:
            item["document_id"] = f"batch-{n}"
    server = Server(tmp_path / "data").start()
    acked: list[list[dict]] = []
    errors: list[Exception] = []

    def writer():
        with server.client(timeout=120) as m:
            m.upsert_bank("crash")
            for n, b in enumerate(batches):
                try:
                    m.retain("crash", b, request_id=f"batch-{n}")
                except grpc.RpcError as e:  # the kill: stop writing
                    errors.append(e)
                    return
                acked.append(b)

    t = threading.Thread(target=writer)
    t.start()
    while len(acked) < 12 and t.is_alive():
        time.sleep(0.05)
    server.kill()
    t.join(timeout=120)
    assert errors, "the server was killed before the writer finished"
    assert 12 <= len(acked) < len(batches)

    server.start()
    try:
        with server.client() as m:
            # the client retries the interrupted retain with its request_id: stored once
            n = len(acked)
            m.retain("crash", batches[n], request_id=f"batch-{n}")
            acked.append(batches[n])
            # nothing else should still be in flight: every consumer group caught up
            drained(m, "crash")
            mems = list(m.list_memories("crash"))
    finally:
        server.stop()
    per_turn = collections.Counter()
    texts = collections.Counter()
    for mem in mems:
        per_turn[mem.metadata["dia_id"]] += 1
        texts[(mem.metadata["dia_id"], mem.text)] += 1
    for b in acked:
        for item in b:
            assert per_turn[item["metadata"]["dia_id"]] >= 1, item["metadata"]["dia_id"]
    dupes = [k for k, n in texts.items() if n > 1]
    assert not dupes, dupes[:5]
    assert len({x.id for x in mems}) == len(mems)
