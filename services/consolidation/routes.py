"""consolidation's routes: facts, retractions and consolidation commands from
``mneme.memory.v1`` (where its own decisions -- observations, and opinion revisions -- and
reflect's newly formed opinions come back, rebuilding its projection on replay), and bank configs from ``mneme.intake.v1`` into its own catalog when it runs
alone (group ``consolidation-catalog``: every replica keeps a copy of every bank).

The observation store is replica-local state, and ``mneme.memory.v1`` is its changelog:
a replica assigned a partition first applies that partition's memory events up to its
end without deciding (``restore``), so it decides on from its previous owner's state."""

from mneme import bank_catalog
from mneme.bus import INTAKE, MEMORY
from mneme.events.v1 import events_pb2 as ev
from mneme.router import Group, Service
from services.consolidation import handlers

_MEMORY = (ev.FactsExtracted, ev.FactsRetracted, ev.ConsolidationScheduled,
           ev.ObservationsChanged, ev.OpinionsChanged, ev.EntitiesMerged, ev.VectorsReplaced)

SERVICE = Service(
    "consolidation",
    groups=(
        Group("consolidation", {MEMORY: dict.fromkeys(_MEMORY, handlers.on_memory_event)},
              replay=True, secondary=(ev.FactsExtracted, ev.FactsRetracted),
              # A retain succeeds once search has projected its facts and a deletion
              # once they are gone; consolidating them follows on, so its failure fails
              # neither.
              restore={MEMORY: dict.fromkeys(_MEMORY, handlers.on_memory_restore)}),
        Group("consolidation-catalog", {INTAKE: bank_catalog.ROUTES}, distributed_only=True,
              replay=True, state="replica"),
    ),
    produces={MEMORY: (ev.ObservationsChanged, ev.OpinionsChanged)},
)
