"""Kafka over TLS, for real: tansu 0.6.0 cannot listen with TLS itself (its ``--cert``
and ``--key`` flags refuse to be given together, and ``--cert`` alone leaves the listener
plaintext) and its SASL (``--authentication``) has no way to create a user on the
in-memory store, so the broker runs plaintext behind a TLS-terminating TCP proxy on
loopback, and advertises the proxy's address: every connection mneme's clients open
(bootstrap, metadata, the partition leader, the group coordinator) is TLS, checked
against the test CA and the name ``localhost``. SASL's argument mapping is unit-tested
(tests/unit/test_kafka_security.py)."""

from __future__ import annotations

import asyncio
import socket
import ssl
import subprocess
import threading
import time

import pytest

from mneme.bus.logs import open_event_log
from mneme.bus.security import KafkaSecurity
from mneme.ports import OutRecord
from tests.e2e.certs import HAVE_OPENSSL, issue, make_ca
from tests.integration.conftest import KAFKA_TEST_OPTIONS, TANSU, _require_tansu, free_port

pytestmark = pytest.mark.skipif(not HAVE_OPENSSL, reason="no openssl")


class TlsProxy:
    """TLS on ``port`` (certificate ``cert``/``key``), plain TCP to ``upstream``;
    ``handshakes`` counts the TLS connections it accepted."""

    def __init__(self, port: int, upstream: int, cert, key) -> None:
        self.port, self.upstream, self.handshakes = port, upstream, 0
        self.ctx = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
        self.ctx.load_cert_chain(cert, key)
        self.loop = asyncio.new_event_loop()
        ready = threading.Event()
        self.thread = threading.Thread(target=self._run, args=(ready,), daemon=True)
        self.thread.start()
        ready.wait(10)

    def _run(self, ready: threading.Event) -> None:
        asyncio.set_event_loop(self.loop)
        self.server = self.loop.run_until_complete(asyncio.start_server(
            self._serve, "127.0.0.1", self.port, ssl=self.ctx))
        ready.set()
        self.loop.run_forever()

    async def _serve(self, reader, writer) -> None:
        self.handshakes += 1
        try:
            up_r, up_w = await asyncio.open_connection("127.0.0.1", self.upstream)
        except OSError:
            writer.close()
            return

        async def pipe(r, w) -> None:
            try:
                while data := await r.read(65536):
                    w.write(data)
                    await w.drain()
            except (ConnectionError, ssl.SSLError, asyncio.CancelledError):
                pass
            finally:
                w.close()

        await asyncio.gather(pipe(reader, up_w), pipe(up_r, writer))

    def stop(self) -> None:
        self.loop.call_soon_threadsafe(self.server.close)
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(5)


@pytest.fixture(scope="module")
def tls_kafka(tmp_path_factory):
    """(bootstrap "127.0.0.1:PROXY", CA file): tansu on a private port, advertising the
    TLS proxy in front of it."""
    _require_tansu()
    d = tmp_path_factory.mktemp("kafka-tls")
    ca = make_ca(d)
    cert, key = issue(d, "broker", "localhost", server=True)
    inner, outer = free_port(), free_port()
    proc = subprocess.Popen(
        [str(TANSU), "broker", "--listener-url", f"tcp://127.0.0.1:{inner}",
         "--advertised-listener-url", f"tcp://127.0.0.1:{outer}",
         "--storage-engine", "memory://tansu/"],
        stdout=open(d / "tansu.log", "ab"), stderr=subprocess.STDOUT)
    deadline = time.monotonic() + 20
    while True:
        try:
            socket.create_connection(("127.0.0.1", inner), timeout=0.5).close()
            break
        except OSError:
            if proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError((d / "tansu.log").read_text()[-2000:])
            time.sleep(0.05)
    proxy = TlsProxy(outer, inner, cert, key)
    yield proxy, f"127.0.0.1:{outer}", str(ca)
    proxy.stop()
    proc.terminate()
    proc.wait(10)


def test_event_log_over_tls(tls_kafka):
    """Topics, append, read, end offsets and group commits of the KafkaEventLog (admin,
    producer, reader and group clients) through TLS only."""
    proxy, bootstrap, ca = tls_kafka
    before = proxy.handshakes
    log = open_event_log(f"kafka://{bootstrap}", **KAFKA_TEST_OPTIONS,
                         security=KafkaSecurity(protocol="SSL", ssl_cafile=ca))
    try:
        log.ensure_topic("tls.test", 1)
        out = log.append([OutRecord("tls.test", "bank-a", b"over tls", {"ce_type": "t"})])
        got = log.read("tls.test", 0, out[0].offset, 10)
        assert [(r.key, r.value) for r in got] == [("bank-a", b"over tls")]
        assert log.end_offset("tls.test", 0) == out[0].offset + 1
        log.commit("tls-group", {("tls.test", 0): out[0].offset + 1})
        assert log.committed("tls-group", "tls.test", 0) == out[0].offset + 1
    finally:
        log.close()
    assert proxy.handshakes > before  # it went through the TLS listener


def test_broker_certificate_from_another_ca_is_refused(tls_kafka, tmp_path):
    """A client trusting another CA never gets through (ConnectionError at start)."""
    _, bootstrap, _ = tls_kafka
    other = make_ca(tmp_path, "other")
    with pytest.raises(ConnectionError):
        open_event_log(f"kafka://{bootstrap}", **{**KAFKA_TEST_OPTIONS, "connect_timeout_s": 2},
                       security=KafkaSecurity(protocol="SSL", ssl_cafile=str(other)))


def test_services_broker_publishes_over_tls(tls_kafka):
    """The services' FastStream broker (build_broker, with the log's options) connects
    and publishes through TLS; the record is read back by a TLS event log."""
    from mneme.bus.kafka_log import KafkaOptions
    from mneme.runtime.kafka import build_broker
    proxy, bootstrap, ca = tls_kafka
    sec = KafkaSecurity(protocol="SSL", ssl_cafile=ca)
    log = open_event_log(f"kafka://{bootstrap}", **KAFKA_TEST_OPTIONS, security=sec)
    try:
        log.ensure_topic("tls.broker", 1)
        end = log.end_offset("tls.broker", 0)
        broker = build_broker([], routers={}, bootstrap_servers=bootstrap,
                              options=KafkaOptions(security=sec, enable_idempotence=False))

        async def publish() -> None:
            await broker.start()
            try:
                await broker.publish(b"from the broker", topic="tls.broker", key=b"bank-b")
            finally:
                await broker.stop()

        before = proxy.handshakes
        asyncio.run(asyncio.wait_for(publish(), 60))
        assert proxy.handshakes > before
        got = log.read("tls.broker", 0, end, 10)
        assert [(r.key, r.value) for r in got] == [("bank-b", b"from the broker")]
    finally:
        log.close()
