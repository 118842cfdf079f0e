"""The embedded graph server's health probe (``FalkorGraphStore.ping``) asks once: a
server that accepts but does not answer (stopped) is reported after one timeout, not
after redis-py's default retries (~25 s with a 2 s timeout)."""

from __future__ import annotations

import socket
import threading
from types import SimpleNamespace

import pytest
import redis.exceptions

from mneme.stores.graph_falkor import FalkorGraphStore


def test_a_server_that_does_not_answer_is_asked_once(tmp_path):
    path = str(tmp_path / "redis.socket")
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(path)
    listener.listen(8)
    accepted, held, done = [], [], threading.Event()

    def accept() -> None:
        listener.settimeout(0.1)
        while not done.is_set():
            try:
                conn, _ = listener.accept()
            except OSError:
                continue
            accepted.append(1)
            held.append(conn)  # read nothing, answer nothing: a stopped server

    t = threading.Thread(target=accept, daemon=True)
    t.start()
    store = object.__new__(FalkorGraphStore)
    store._db = SimpleNamespace(client=SimpleNamespace(connection_pool=SimpleNamespace(
        connection_kwargs={"path": path})))
    try:
        with pytest.raises((redis.exceptions.TimeoutError, redis.exceptions.ConnectionError)):
            store.ping(timeout=0.2)
    finally:
        done.set()
        t.join(5)
        for c in held:
            c.close()
        listener.close()
    assert len(accepted) == 1, accepted  # (redis-py's default retry connected 4 times)
