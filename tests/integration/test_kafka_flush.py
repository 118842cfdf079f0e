"""The Kafka runner flushes a group's durable deps (:attr:`mneme.router.Group.durable`)
before it commits an offset: a flush that fails is never followed by a commit of those
offsets (the record is sought back and handled again), and once the flush works again
the offsets are committed. On a tansu broker, with the toy service of
``test_kafka_runner``."""

from __future__ import annotations

import threading
import time

import pytest

from mneme.bus import INTAKE, MEMORY
from mneme.bus.logs import open_event_log
from mneme.events.v1 import events_pb2 as ev
from mneme.router import Group, Router, Service
from mneme.runtime.kafka import KafkaRunner
from tests.integration.conftest import KAFKA_TEST_OPTIONS
from tests.integration.test_kafka_runner import Toy, _uid, delete, mine, on_delete


class DurableToy(Toy):
    """The toy dep, with a flush that fails while ``failing`` is set; ``flushes`` counts
    the calls (failed ones included), ``at_flush`` the group's committed offset of the
    partition at each call."""

    def __init__(self, committed) -> None:
        super().__init__()
        self.committed = committed
        self.failing = threading.Event()
        self.flushes = 0
        self.at_flush: list[int] = []

    def flush(self) -> None:
        self.at_flush.append(self.committed())
        self.flushes += 1
        if self.failing.is_set():
            raise OSError("disk full")


@pytest.fixture
def kafka_log(fresh_tansu):
    """A log on a broker of this test's own: the group reads its topic from the start,
    and a flush failing on another test's record would hold it there."""
    log = open_event_log(fresh_tansu.url, **KAFKA_TEST_OPTIONS)
    yield log
    log.close()


def test_a_failing_flush_is_never_followed_by_a_commit_and_the_offsets_follow_once_it_works(
        kafka_log):
    group, bank = f"toy-{_uid()}", f"bank-{_uid()}"
    kafka_log.ensure_topic(INTAKE, 4)
    inputs = kafka_log.append([delete(bank, i) for i in range(3)])
    p, start = inputs[0].partition, inputs[0].offset
    toy = DurableToy(lambda: kafka_log.committed(group, INTAKE, p))
    toy.failing.set()
    svc = Service("toy", groups=(Group(group, {INTAKE: {ev.MemoryDeleteRequested: on_delete}},
                                       durable=("toy",)),),
                  produces={MEMORY: (ev.FactsRetracted,)})
    r = KafkaRunner(kafka_log, {group: Router(svc, group, {"toy": toy, "name": "a"})},
                    backoff=0.01, backoff_max=0.05, dlq_topic=f"test.dlq.{_uid()}").start()
    try:
        deadline = time.monotonic() + 60
        while r.groups[group].stats["flush_failures"] < 2:  # failed, sought back, failed again
            assert time.monotonic() < deadline, r.groups[group].stats
            time.sleep(0.05)
        # The first record was handled (its output is produced) but never committed.
        assert kafka_log.committed(group, INTAKE, p) <= start
        assert toy.attempts[f"{bank}:0"] >= 2 and toy.attempts[f"{bank}:1"] == 0
        assert mine(kafka_log, MEMORY, {bank})  # outputs go before the flush
        assert not r.wait_idle(group, timeout=1)
        toy.failing.clear()
        assert r.wait_idle(group, timeout=60), r.lag(group)
        assert kafka_log.committed(group, INTAKE, p) == inputs[-1].offset + 1
        assert r.groups[group].stats["commit_failures"] == 0
        # Every flush came before the commit of the record it was for: while failing,
        # the committed offset never moved past the first record.
        failures = r.groups[group].stats["flush_failures"]
        assert all(c <= start for c in toy.at_flush[:failures])
        assert toy.flushes >= failures + 3  # then one per record
        assert [m for (_, b, m) in toy.seen if b == bank][-3:] == \
            [f"{bank}:{i}" for i in range(3)]
    finally:
        assert r.stop(30)
