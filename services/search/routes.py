"""search's routes: its three projections of ``mneme.memory.v1`` (group ``search``) and,
when it runs alone, its own bank catalog (group ``search-catalog``, for NOT_FOUND)."""

from mneme import bank_catalog
from mneme.bus import AUDIT, INTAKE, MEMORY, PROGRESS
from mneme.events.v1 import events_pb2 as ev
from mneme.router import Group, Service
from services.search import handlers

SERVICE = Service(
    "search",
    groups=(
        Group("search", {MEMORY: {ev.FactsExtracted: handlers.on_facts_extracted,
                                  ev.FactsRetracted: handlers.on_facts_retracted,
                                  ev.ObservationsChanged: handlers.on_observations_changed}},
              replay=True),
        Group("search-catalog", {INTAKE: bank_catalog.ROUTES}, distributed_only=True,
              replay=True),
    ),
    produces={PROGRESS: (ev.OperationProgress,), AUDIT: (ev.AuditRecorded,)},
)
