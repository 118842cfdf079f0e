"""Runs a process's consumer groups on an :class:`mneme.ports.EventLog` read directly
(the embedded SQLite log; replay on either log): one :class:`mneme.bus.consumer.Consumer`
thread per group, each calling its group's :class:`mneme.router.Router`."""

from __future__ import annotations

from typing import Mapping

from mneme.bus.consumer import Consumer
from mneme.ports import EventLog
from mneme.router import Router


class LogRunner:
    """The consumer groups of ``routers`` (group → Router) on ``log``, not started.
    ``consumers`` maps each group to its Consumer (counters, lag, ``run_once``)."""

    def __init__(self, log: EventLog, routers: Mapping[str, Router], **options) -> None:
        self.consumers = {g: Consumer(log, r.group_id, r.topics, r,
                                      fails_operation=r.fails_operation, **options)
                          for g, r in routers.items()}

    def start(self, groups: tuple[str, ...] | None = None) -> None:
        """Start the consumer thread of every group (or of ``groups`` only)."""
        for name, c in self.consumers.items():
            if groups is None or name in groups:
                c.start()

    def stop(self, timeout: float = 30.0) -> bool:
        """Stop every group after the record in hand (committing what it handled); True
        when all stopped within ``timeout`` seconds each."""
        return all([c.stop(timeout=timeout) for c in self.consumers.values()])

    def wait_idle(self, group: str | None = None, timeout: float = 10.0) -> bool:
        """True once ``group`` (every group when None) has committed up to the end of its
        partitions; False after ``timeout`` seconds."""
        cs = self.consumers.values() if group is None else [self.consumers[group]]
        return all(c.wait_idle(timeout) for c in cs)
