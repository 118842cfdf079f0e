"""consolidation: observation decisions (consumes ``mneme.memory.v1`` and
``mneme.intake.v1``, produces ``ObservationsChanged``). Not wired yet: observations are
the subject of their own issue; no consumer group runs for this service today."""
