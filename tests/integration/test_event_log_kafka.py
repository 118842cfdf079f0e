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
