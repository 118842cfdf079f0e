"""Waits for what the services do after a call returns: consumer groups catching up
(consolidation, stale marks), consumer spans ending."""

from __future__ import annotations

import time

from opentelemetry.trace import SpanKind


def hop_spans(exporter, trace_id: int, hops, timeout: float = 15.0):
    """``(spans of the trace, [consumer spans per hop])`` once every hop in ``hops``
    (``(group, topic, event type or None)`` tuples) has a finished CONSUMER span in the
    trace, or when ``timeout`` seconds have passed (a hop then has an empty list).

    A consumer span ends after its handler returns, and a retain returns as soon as
    ingest's handler has written the catalog, so the last spans may end just after the
    call: reading them at once would race."""
    def of(mine, group, topic, event_type):
        return [s for s in mine if s.kind == SpanKind.CONSUMER
                and s.attributes["messaging.consumer.group.name"] == group
                and s.attributes["messaging.destination.name"] == topic
                and (event_type is None or s.attributes["cloudevents.event_type"]
                     == f"mneme.events.v1.{event_type}")]

    deadline = time.monotonic() + timeout
    while True:
        mine = [s for s in exporter.get_finished_spans() if s.context.trace_id == trace_id]
        found = [of(mine, *hop) for hop in hops]
        if all(found) or time.monotonic() > deadline:
            return mine, found
        time.sleep(0.05)


def drained(m, bank: str, timeout: float = 120.0) -> None:
    """Until every consumer group (consolidation too) has consumed the bank's records,
    read from ``m.bank_stats(bank).pending_records`` (``m`` a MnemeClient); fails the
    test after ``timeout`` seconds."""
    end = time.monotonic() + timeout
    while m.bank_stats(bank).pending_records and time.monotonic() < end:
        time.sleep(0.05)
    assert not m.bank_stats(bank).pending_records, f"bank {bank!r} not drained in {timeout}s"
