"""consolidation's routes: facts, retractions and consolidation commands from
``mneme.memory.v1`` (where its own decisions come back, rebuilding its projection on
replay) and bank configs from ``mneme.intake.v1`` (its own catalog when it runs alone)."""

from mneme import bank_catalog
from mneme.bus import INTAKE, MEMORY
from mneme.events.v1 import events_pb2 as ev
from mneme.router import Group, Service
from services.consolidation import handlers

SERVICE = Service(
    "consolidation",
    groups=(Group("consolidation", {
        MEMORY: {ev.FactsExtracted: handlers.on_memory_event,
                 ev.FactsRetracted: handlers.on_memory_event,
                 ev.ConsolidationScheduled: handlers.on_memory_event,
                 ev.ObservationsChanged: handlers.on_memory_event},
        INTAKE: bank_catalog.ROUTES,
        # A retain succeeds once search has projected its facts and a deletion once they
        # are gone; consolidating them follows on, so its failure fails neither.
    }, replay=True, secondary=(ev.FactsExtracted, ev.FactsRetracted)),),
    produces={MEMORY: (ev.ObservationsChanged,)},
)
