"""consolidation's handler. Observation logic (deduplicated beliefs with evidence) is
not built yet (a later issue): the consolidation process runs its consumer group over
``mneme.memory.v1`` and ``mneme.intake.v1`` so its offsets, lag and scaling are real,
but this handler produces nothing."""

from __future__ import annotations

from mneme.ports import OutRecord, Record

GROUP = "consolidation"
SOURCE = "mneme/consolidation"


def handle(env, record: Record) -> list[OutRecord]:
    """Consume one memory or intake event; no observations yet, so no events."""
    return []
