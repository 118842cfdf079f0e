"""Topic configuration owned by mneme, on a Kafka-protocol broker (tansu), each test on a
fresh broker: topics are created with their configs (history never expires), `mneme
topics check` refuses a history topic that would expire records, and a service refuses
to start on one."""

from __future__ import annotations

import subprocess

import pytest
from aiokafka.admin import NewTopic

from mneme.bus import ALL_TOPICS, INTAKE, KEYS, MANAGED_TOPICS, MEMORY, PROGRESS
from mneme.bus.logs import open_event_log
from mneme.bus.topics import TopicConfigError, check, ensure, require_history
from tests.e2e.server import inherited
from tests.integration.conftest import KAFKA_TEST_ENV, KAFKA_TEST_OPTIONS, mneme_bin


@pytest.fixture
def broker(fresh_tansu):
    return fresh_tansu


def _env(broker, tmp_path) -> dict:
    import os
    return {**inherited(), **KAFKA_TEST_ENV, "MNEME_BUS_URL": broker.url,
            "MNEME_DATA_DIR": str(tmp_path / "d"), "MNEME_METRICS_PORT": "0"}


def test_topics_are_created_with_configs_that_keep_history(broker):
    log = open_event_log(broker.url, **KAFKA_TEST_OPTIONS)
    try:
        ensure(log)
        got = log.topic_configs(list(ALL_TOPICS))
        for t in (INTAKE, MEMORY):
            assert got[t]["retention.ms"] == "-1" and got[t]["retention.bytes"] == "-1"
            assert got[t]["cleanup.policy"] == "delete"
        assert got[PROGRESS]["retention.ms"] == str(7 * 86_400_000)
        assert all(got[t]["min.insync.replicas"] == "1" for t in ALL_TOPICS)
        keys = log.topic_configs([KEYS])[KEYS]  # the key topic: compacted, one partition
        assert keys["cleanup.policy"] == "compact" and log.partitions(KEYS) == 1
        report = check(log)
        assert report.errors == [] and report.warnings == []
        require_history(log)  # passes
    finally:
        log.close()


def _make_intake_expiring(broker) -> None:
    """An operator's topic from before: intake with Kafka's usual 7-day retention."""
    import asyncio

    from aiokafka.admin import AIOKafkaAdminClient

    async def create() -> None:
        admin = AIOKafkaAdminClient(bootstrap_servers=broker.bootstrap)
        await admin.start()
        try:
            await admin.create_topics([NewTopic(INTAKE, 4, 1,
                                                topic_configs={"retention.ms": "604800000"})])
            await admin.create_topics([NewTopic(MEMORY, 4, 1)])  # no retention set at all
        finally:
            await admin.close()
    asyncio.run(create())


def test_check_and_a_service_refuse_history_topics_that_would_expire(broker, tmp_path):
    _make_intake_expiring(broker)
    log = open_event_log(broker.url, **KAFKA_TEST_OPTIONS)
    try:
        ensure(log)  # an existing topic is left as it is
        report = check(log)
        assert any(e.startswith(f"{INTAKE}: retention.ms=604800000") for e in report.errors)
        assert any(e.startswith(f"{MEMORY}: retention.ms is not set") for e in report.errors)
        with pytest.raises(TopicConfigError, match="history must never expire"):
            require_history(log)
    finally:
        log.close()
    out = subprocess.run([mneme_bin(), "topics", "check"], env=_env(broker, tmp_path),
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 1, out.stdout + out.stderr
    assert "retention.ms=604800000" in out.stdout + out.stderr
    # a service refuses to start, at once and with the reason (a configuration error)
    env = {**_env(broker, tmp_path), "MNEME_GRPC_ADDRESS": "127.0.0.1:0"}
    out = subprocess.run([mneme_bin(), "serve", "extraction"], env=env, capture_output=True,
                         text=True, timeout=120)
    assert out.returncode == 1 and "history must never expire" in out.stdout + out.stderr
    assert "Traceback" not in out.stdout + out.stderr  # a configuration error: one line


def test_topics_create_then_check_passes_on_a_new_broker(broker, tmp_path):
    env = _env(broker, tmp_path)
    out = subprocess.run([mneme_bin(), "topics", "create"], env=env, capture_output=True,
                         text=True, timeout=120)
    said = out.stdout + out.stderr  # the report goes to stderr, the listing to stdout
    # without MNEME_PARTITIONS, Kafka topics get enough for 12 replicas of a shared group
    assert out.returncode == 0 and "topics ok" in said and f"{INTAKE}\t12 partitions" in said
    assert f"{MEMORY}\t12 partitions" in said
    out = subprocess.run([mneme_bin(), "topics", "check"], env=env, capture_output=True,
                         text=True, timeout=120)
    assert out.returncode == 0 and "topics ok" in out.stdout + out.stderr, out.stderr


def test_check_on_a_broker_without_the_topics_says_to_create_them(broker, tmp_path):
    """Before `mneme topics create`, `mneme topics check` names each missing topic and the
    command that creates it, rather than a retention setting to alter on a topic that
    does not exist."""
    out = subprocess.run([mneme_bin(), "topics", "check"], env=_env(broker, tmp_path),
                         capture_output=True, text=True, timeout=120)
    said = out.stdout + out.stderr
    assert out.returncode == 1, said
    for t in MANAGED_TOPICS:
        (line,) = [x for x in said.splitlines() if x.startswith(f"error {t}")]
        assert "does not exist" in line and "mneme topics create" in line, line
    assert "retention.ms" not in said and "cleanup.policy" not in said, said


def test_intake_and_memory_with_different_partition_counts_are_refused(broker, tmp_path):
    # A replica restores a bank's state from intake and memory by partition number:
    # topics created by hand with other counts would restore the wrong banks.
    log = open_event_log(broker.url, **KAFKA_TEST_OPTIONS)
    try:
        log.ensure_topic(INTAKE, 4)
        log.ensure_topic(MEMORY, 6)
        ensure(log)
        (error,) = [e for e in check(log).errors if "partitions" in e]
        assert f"{INTAKE} has 4 partitions" in error and f"{MEMORY} has 6 partitions" in error
        with pytest.raises(TopicConfigError, match="same partition count"):
            require_history(log)
    finally:
        log.close()
    out = subprocess.run([mneme_bin(), "serve", "extraction"], env=_env(broker, tmp_path),
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 1 and "same partition count" in out.stdout + out.stderr


def test_a_key_topic_that_would_expire_keys_is_refused(broker):
    """Keys expiring would make every bank's content unreadable: a key topic that is not
    compacted (the broker default, delete) or has several partitions is an error."""
    import asyncio

    from aiokafka.admin import AIOKafkaAdminClient

    async def create() -> None:
        admin = AIOKafkaAdminClient(bootstrap_servers=broker.bootstrap)
        await admin.start()
        try:
            await admin.create_topics([NewTopic(KEYS, 3, 1)])  # no config: delete, 7 days
        finally:
            await admin.close()
    asyncio.run(create())
    log = open_event_log(broker.url, **KAFKA_TEST_OPTIONS)
    try:
        ensure(log)
        errors = [e for e in check(log).errors if e.startswith(KEYS)]
        assert any("would expire the wrapped keys" in e for e in errors), errors
        assert any("3 partitions" in e for e in errors), errors
        with pytest.raises(TopicConfigError):
            require_history(log)
        assert set(log.topic_configs(list(MANAGED_TOPICS))) == set(MANAGED_TOPICS)
    finally:
        log.close()


def test_a_broker_refusing_the_idempotent_producer_names_the_setting(broker, tmp_path):
    """tansu answers InitProducerId with an error, as a broker without the idempotent
    producer does: the command stops in one line naming MNEME_KAFKA_ENABLE_IDEMPOTENCE
    (it said "UnknownError: [Error -1] UnknownError"), without aiokafka's noise about an
    unclosed producer."""
    env = {**_env(broker, tmp_path), "MNEME_KAFKA_ENABLE_IDEMPOTENCE": "true"}
    out = subprocess.run([mneme_bin(), "topics", "check"], env=env, capture_output=True,
                         text=True, timeout=120)
    said = out.stdout + out.stderr
    assert out.returncode == 1 and "Traceback" not in said, said
    (line,) = [x for x in said.splitlines() if "configuration error" in x]
    assert "MNEME_KAFKA_ENABLE_IDEMPOTENCE=false" in line, said
    assert "Unclosed" not in said, said


def test_a_record_limit_above_kafkas_default_is_given_to_the_topics_and_checked(broker):
    """MNEME_KAFKA_MAX_REQUEST_SIZE above Kafka's default record size (1 MiB): `topics
    create` gives the topics a max.message.bytes that takes it, and `topics check`
    refuses a topic whose max.message.bytes would refuse records the producer sends."""
    import asyncio

    from aiokafka.admin import AIOKafkaAdminClient

    async def create_small() -> None:  # an operator's topic from before, at 1 MB
        admin = AIOKafkaAdminClient(bootstrap_servers=broker.bootstrap)
        await admin.start()
        try:
            await admin.create_topics([NewTopic(MEMORY, 4, 1, topic_configs={
                "retention.ms": "-1", "retention.bytes": "-1", "cleanup.policy": "delete",
                "max.message.bytes": "1000000"})])
        finally:
            await admin.close()
    asyncio.run(create_small())
    big = 4 * 1024 * 1024
    log = open_event_log(broker.url, **{**KAFKA_TEST_OPTIONS, "max_request_size": big})
    try:
        ensure(log)
        got = log.topic_configs([INTAKE, MEMORY])
        assert got[INTAKE]["max.message.bytes"] == str(big)
        errors = check(log).errors
        assert [e for e in errors if "max.message.bytes" in e] == [
            f"{MEMORY}: max.message.bytes=1000000 refuses records the producer may send "
            f"(MNEME_KAFKA_MAX_REQUEST_SIZE={big}): set max.message.bytes={big} or lower "
            "the setting"], errors
    finally:
        log.close()


def _banks_that_move(old: int, new: int, count: int) -> list[str]:
    """``count`` bank ids that ``new`` partitions route to another partition than
    ``old`` partitions do."""
    from mneme.bus import partition_for
    names = (f"moved-{k}" for k in range(1000))
    return [b for b in names if partition_for(b, old) != partition_for(b, new)][:count]


def _produce_as_routed_by(broker, partitions: int, banks: list[str]) -> None:
    """Records of ``banks`` on intake and memory, each on the partition ``partitions``
    route it to: what a process started before partitions were added wrote."""
    import asyncio

    from aiokafka import AIOKafkaProducer

    from mneme.bus import partition_for

    async def produce() -> None:
        producer = AIOKafkaProducer(bootstrap_servers=broker.bootstrap)
        await producer.start()
        try:
            for t in (INTAKE, MEMORY):
                for b in banks:
                    await producer.send_and_wait(t, b"x", key=b.encode(),
                                                 partition=partition_for(b, partitions))
        finally:
            await producer.stop()
    asyncio.run(produce())


def test_partitions_added_after_records_were_written_are_refused(broker, tmp_path):
    """`kafka-topics --alter --partitions` (4 → 6) with MNEME_PARTITIONS raised to match:
    Kafka's partitioner takes a key's hash modulo the count, so a bank's new records would
    go to another partition than its old ones. Every process refuses to start, naming the
    topic and both counts (tansu has no CreatePartitions: the topics are made as an
    altered one is, 6 partitions holding records routed by 4)."""
    log = open_event_log(broker.url, **KAFKA_TEST_OPTIONS)
    try:
        ensure(log, 6)
        _produce_as_routed_by(broker, 4, _banks_that_move(4, 6, 8))
        env = {**_env(broker, tmp_path), "MNEME_PARTITIONS": "6"}
        out = subprocess.run([mneme_bin(), "topics", "check"], env=env, capture_output=True,
                             text=True, timeout=120)
        said = out.stdout + out.stderr
        assert out.returncode == 1 and "records were written with another count" in said, said
        out = subprocess.run([mneme_bin(), "serve", "extraction"],
                             env={**env, "MNEME_GRPC_ADDRESS": "127.0.0.1:0"},
                             capture_output=True, text=True, timeout=120)
        said = out.stdout + out.stderr
        assert out.returncode == 1 and f"{MEMORY} has 6 partitions" in said, said
        assert "Traceback" not in said and "history must never expire" not in said, said
        errors = [e for e in check(log, 6).errors if "written with another count" in e]
        assert [e.split(" ", 1)[0] for e in errors] == [INTAKE, MEMORY], errors
        assert f"{INTAKE} has 6 partitions" in errors[0] and "fit 4" in errors[0], errors
        assert "Partitions changed" in errors[0]
    finally:
        log.close()


def test_a_partition_count_other_than_mneme_partitions_is_refused(broker, tmp_path):
    """MNEME_PARTITIONS changed between deploys (or topics made by hand with another
    count): `mneme topics create` keeps the existing topics, so the setting and the
    topics disagree; both commands and a service say so instead of going on."""
    env = {**_env(broker, tmp_path), "MNEME_PARTITIONS": "4"}
    out = subprocess.run([mneme_bin(), "topics", "create"], env=env, capture_output=True,
                         text=True, timeout=120)
    assert out.returncode == 0, out.stdout + out.stderr
    env["MNEME_PARTITIONS"] = "6"
    for cmd in (["topics", "create"], ["topics", "check"], ["serve", "ingest"]):
        out = subprocess.run([mneme_bin(), *cmd],
                             env={**env, "MNEME_GRPC_ADDRESS": "127.0.0.1:0"},
                             capture_output=True, text=True, timeout=120)
        said = out.stdout + out.stderr
        assert out.returncode == 1, (cmd, said)
        assert (f"{INTAKE} and {MEMORY} and {PROGRESS} and mneme.reflect.v1 have 4 "
                "partitions but MNEME_PARTITIONS=6") in said, (cmd, said)
        assert "set MNEME_PARTITIONS=4" in said, (cmd, said)
    log = open_event_log(broker.url, **KAFKA_TEST_OPTIONS)
    try:  # records routed by the topics' own count pass the check
        from mneme.ports import OutRecord
        log.append([OutRecord(t, f"bank-{k}", b"x", {}) for t in (INTAKE, MEMORY)
                    for k in range(12)])
        assert check(log, 4).errors == []
    finally:
        log.close()
