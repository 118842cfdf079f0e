"""The Kafka event log (:class:`mneme.bus.kafka_log.KafkaEventLog`) on a tansu broker
against the shared EventLog contract; a "place" is the broker, and every
``make_log`` is a new client (a new process's view, for the crash tests)."""

from __future__ import annotations

import pytest

from mneme.bus.logs import open_event_log
from tests.contract.event_log_suite import EventLogSuite
from tests.integration.conftest import KAFKA_TEST_OPTIONS


class TestKafkaEventLog(EventLogSuite):
    ATOMIC_COMMIT = False  # produce (acks=all) first, then OffsetCommit: no transactions
    KNOWS_MEMBERS = True

    @pytest.fixture
    def place(self, tansu):
        return tansu.url

    def make_log(self, place):
        return open_event_log(place, **KAFKA_TEST_OPTIONS)

    def crash_after_outputs(self, log, monkeypatch):
        # commit() produces, then sends OffsetCommit through _simple_commit (no member
        # of the group in this client); failing there is dying between the two
        async def crash(group, offsets):
            raise RuntimeError("simulated crash")

        monkeypatch.setattr(log, "_simple_commit", crash)


def test_a_group_is_live_while_a_member_runs(tansu):
    # (tansu keeps a departed member listed, so the departure itself cannot be seen
    # here; a group that only committed offsets, never joined, is the "not live" case)
    import asyncio
    import uuid

    from aiokafka import AIOKafkaConsumer

    log = open_event_log(tansu.url, **KAFKA_TEST_OPTIONS)
    topic, group = f"live.{uuid.uuid4().hex[:8]}", f"live-group.{uuid.uuid4().hex[:8]}"
    committed_only = f"committed-only.{uuid.uuid4().hex[:8]}"
    log.ensure_topic(topic, 1)
    log.commit(committed_only, {(topic, 0): 0})

    async def with_a_member() -> list[str]:
        c = AIOKafkaConsumer(topic, bootstrap_servers=log.bootstrap_servers, group_id=group,
                             session_timeout_ms=2000, heartbeat_interval_ms=300)
        await c.start()
        try:
            await c.getmany(timeout_ms=500)  # joined: the group has a member
            await c.commit({next(iter(c.assignment())): 0})
            return await asyncio.to_thread(log.groups, True)
        finally:
            await c.stop()

    try:
        live = asyncio.run(with_a_member())
        assert group in live and committed_only not in live
        assert {group, committed_only} <= set(log.groups())  # both known by their offsets
    finally:
        log.close()
