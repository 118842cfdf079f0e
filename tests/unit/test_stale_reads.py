"""A replica whose own copies are still behind the log after the read-your-writes wait
serves what they hold: the operator is told (a log line naming the service, the bank and
the groups behind, at most one per interval, and the ``mneme.reads.stale`` counter)."""

from __future__ import annotations

import logging
from types import SimpleNamespace

from mneme import bootstrap, telemetry


class _Runner:
    def __init__(self, caught_up: bool) -> None:
        self.caught_up = caught_up

    def catch_up(self, wanted, timeout):
        return self.caught_up


def _parts(caught_up: bool):
    group = SimpleNamespace(name="ingest")
    router = SimpleNamespace(group=group, group_id="ingest.pod-1-ab12", topics=["mneme.intake.v1"])
    return SimpleNamespace(name="ingest", routers={"ingest": router}, runner=_Runner(caught_up))


def _root():
    return SimpleNamespace(log=SimpleNamespace(partitions=lambda topic: 4))


def test_a_read_served_from_copies_behind_the_log_is_logged_and_counted(caplog, monkeypatch):
    """A lagging replica answered reads from a stale copy after its 5 s wait without a
    word: only the lag gauge hinted at it, nothing tied it to reads being stale."""
    counted = []
    monkeypatch.setattr(telemetry, "count_stale_read", lambda service: counted.append(service))
    monkeypatch.setattr(bootstrap, "_stale_logged", {})
    behind = bootstrap._read_your_writes(_root(), _parts(caught_up=False))
    with caplog.at_level(logging.WARNING):
        assert behind("b1") is False
        assert behind("b2") is False  # within the interval: counted, not logged again
    lines = [r.getMessage() for r in caplog.records]
    assert len(lines) == 1, lines
    assert "ingest" in lines[0] and "bank b1" in lines[0] and "behind" in lines[0], lines[0]
    assert counted == ["ingest", "ingest"]


def test_a_read_from_copies_caught_up_says_nothing(caplog, monkeypatch):
    counted = []
    monkeypatch.setattr(telemetry, "count_stale_read", lambda service: counted.append(service))
    with caplog.at_level(logging.WARNING):
        assert bootstrap._read_your_writes(_root(), _parts(caught_up=True))("b1") is True
    assert caplog.records == [] and counted == []
