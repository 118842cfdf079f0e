"""search's routes: its three projections of ``mneme.memory.v1`` (group ``search``) and,
when it runs alone, its own bank catalog (group ``search-catalog``, for NOT_FOUND). Each
replica keeps its own catalog, and its own projections while its stores are local files;
with store servers the replicas share the ``search`` group's partitions."""

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
                                  ev.ObservationsChanged: handlers.on_observations_changed,
                                  ev.OpinionsChanged: handlers.on_opinions_changed,
                                  ev.EntitiesMerged: handlers.on_entities_merged,
                                  ev.EntitySplit: handlers.on_entity_split}},
              replay=True, state="stores", durable=("stores",)),
        Group("search-catalog", {INTAKE: bank_catalog.ROUTES}, distributed_only=True,
              replay=True, state="replica"),
    ),
    # its EntityService appends users' entity corrections to the intake topic
    produces={PROGRESS: (ev.OperationProgress,), AUDIT: (ev.AuditRecorded,),
              INTAKE: (ev.EntityMergeRequested, ev.EntitySplitRequested)},
)
