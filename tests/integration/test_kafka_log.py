"""KafkaEventLog against a real Kafka-protocol broker (tansu): CloudEvents headers through
the EventLog port, and a service's readiness. (The port's contract is
test_event_log_kafka.py; consumer groups that split partitions, test_kafka_runner.py.)"""

from __future__ import annotations

import threading
import time
import uuid

import pytest

from mneme.bus import codec, partition_for
from mneme.events.v1 import events_pb2 as ev
from mneme.ports import OutRecord
from tests.integration.conftest import KAFKA_TEST_OPTIONS


def _topic() -> str:
    return f"test.{uuid.uuid4().hex[:8]}"


def _event(topic: str, bank: str, n: int, traceparent: str | None = None) -> OutRecord:
    rec = codec.encode(ev.MemoryDeleteRequested(bank_id=bank, memory_id=str(n)), bank_id=bank,
                       source="test", traceparent=traceparent)
    return OutRecord(topic, rec.key, rec.value, rec.headers)


def test_a_record_larger_than_kafka_takes_is_refused_as_such(kafka_log):
    """Kafka takes records up to 1 MiB by default (far less than a retain the API
    accepts): append raises RecordTooLarge naming the event, not the client's error."""
    from mneme.errors import RecordTooLarge

    t = _topic()
    kafka_log.ensure_topic(t, 1)
    big = _event(t, "bank-big", 0)
    big = OutRecord(t, big.key, big.value + b"z" * 2_000_000, big.headers)
    with pytest.raises(RecordTooLarge, match="MemoryDeleteRequested of bank 'bank-big' is "):
        kafka_log.append([big])
    assert [r.offset for r in kafka_log.append([_event(t, "bank-big", 1)])] == [0]


def test_an_append_while_the_brokers_are_away_is_unavailable(fresh_tansu):
    """With the brokers gone, append raises Unavailable (a client may retry: gRPC
    UNAVAILABLE), not aiokafka's error (a write answered UNKNOWN with its traceback)."""
    from mneme.bus.logs import open_event_log
    from mneme.errors import Unavailable

    log = open_event_log(fresh_tansu.url, **{**KAFKA_TEST_OPTIONS, "request_timeout_ms": 3000})
    try:
        t = _topic()
        log.ensure_topic(t, 1)
        assert [r.offset for r in log.append([_event(t, "bank-a", 0)])] == [0]
        fresh_tansu.stop()
        with pytest.raises(Unavailable, match="did not take the records"):
            log.append([_event(t, "bank-a", 1)])
    finally:
        log.close()


def test_append_read_offsets_headers_and_groups(kafka_log):
    t = _topic()
    kafka_log.ensure_topic(t, 3)
    kafka_log.ensure_topic(t, 5)  # keeps its 3 partitions
    assert kafka_log.partitions(t) == 3 and kafka_log.partitions(_topic()) == 0
    tp = "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01"
    out = kafka_log.append([_event(t, "bank-a", i, tp) for i in range(5)])
    p = partition_for("bank-a", 3)
    assert [(r.partition, r.offset) for r in out] == [(p, i) for i in range(5)]
    assert kafka_log.end_offset(t, p) == 5
    assert all(kafka_log.end_offset(t, q) == 0 for q in range(3) if q != p)
    recs = kafka_log.read(t, p, 2, limit=2)
    assert [r.offset for r in recs] == [2, 3]
    env = codec.decode(recs[0])
    assert env.traceparent == tp and env.message.memory_id == "2"
    assert recs[0].headers["ce_specversion"] == "1.0" and recs[0].key == "bank-a"
    assert kafka_log.read(t, p, 5) == []
    # group offsets: simple commits while the group has no members
    g = f"g-{uuid.uuid4().hex[:6]}"
    assert kafka_log.committed(g, t, p) == 0
    produced = kafka_log.commit(g, {(t, p): 4}, produce=[_event(t, "bank-a", 99)])
    assert produced[0].offset == 5 and kafka_log.committed(g, t, p) == 4
    kafka_log.reset_group(g, [t])
    assert kafka_log.committed(g, t, p) == 0


def test_service_is_not_serving_until_the_broker_answers(tmp_path, tansu):
    """Readiness: gRPC health NOT_SERVING (and the API UNAVAILABLE) while the broker is
    unreachable; SERVING once it answers; NOT_SERVING again after SIGTERM-style stop."""
    import grpc
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    from mneme.runtime.process import ServiceProcess
    from mneme.client import MnemeClient
    from mneme.config import Settings
    from tests.integration.conftest import free_port

    def status(address: str) -> int:
        with grpc.insecure_channel(address) as ch:
            return health_pb2_grpc.HealthStub(ch).Check(
                health_pb2.HealthCheckRequest(service=""), timeout=2).status

    address = f"127.0.0.1:{free_port()}"
    settings = Settings(data_dir=tmp_path / "ingest", grpc_address=address,
                        bus_url=f"kafka://127.0.0.1:{free_port()}", kafka_connect_timeout_s=0.5,
                        kafka_enable_idempotence=False, shutdown_grace_s=0.5)
    down = ServiceProcess("ingest", settings)
    down.bind()
    t = threading.Thread(target=down.start, daemon=True)
    t.start()
    try:
        time.sleep(1.0)
        assert status(address) == health_pb2.HealthCheckResponse.NOT_SERVING
        with MnemeClient(address, timeout=5) as m, pytest.raises(grpc.RpcError) as e:
            m.get_bank("anything")
        assert e.value.code() == grpc.StatusCode.UNAVAILABLE
    finally:
        down.stop()
        t.join(10)
    up = ServiceProcess("ingest", settings.model_copy(update={
        "bus_url": tansu.url, "kafka_session_timeout_ms": 2000,
        "kafka_heartbeat_interval_ms": 300}))
    up.bind()
    try:
        up.start()
        # SERVING once its readiness checks pass (its catalog caught up once): the
        # monitor's next round at the latest
        deadline = time.monotonic() + 60
        while status(address) != health_pb2.HealthCheckResponse.SERVING:
            assert time.monotonic() < deadline, "not SERVING with the broker up"
            time.sleep(0.1)
    finally:
        up.stop()


def test_topics_lost_by_the_brokers_turn_the_log_unhealthy_and_writes_unavailable(tmp_path):
    """The brokers come back without mneme's topics (tansu's memory storage after a
    restart; on Kafka a topic deleted or recreated with fewer partitions under the running
    process): the ping that gRPC health asks is False, and a write fails as Unavailable
    naming the topic -- it answered gRPC UNKNOWN with aiokafka's bare "Unrecognized
    partition" assertion, while health said SERVING."""
    from mneme.bus import INTAKE
    from mneme.bus.logs import open_event_log
    from mneme.bus.topics import ensure
    from mneme.errors import Unavailable
    from mneme.ports import OutRecord
    from tests.integration.conftest import Tansu, _require_tansu
    _require_tansu()
    broker, log = Tansu(tmp_path / "tansu.log"), None
    try:
        log = open_event_log(broker.url, **{**KAFKA_TEST_OPTIONS, "request_timeout_ms": 3000})
        ensure(log, 12)
        log.append([OutRecord(INTAKE, f"bank-{k}", b"x", {}) for k in range(12)])
        assert log.ping()
        broker.stop()
        assert not log.ping()  # away
        broker = Tansu(tmp_path / "tansu.log", port=broker.port)  # back, empty
        assert not log.ping()
        with pytest.raises(Unavailable, match=INTAKE):
            log.append([OutRecord(INTAKE, f"bank-{k}", b"x", {}) for k in range(12)])
    finally:
        if log is not None:
            log.close()
        broker.stop()
