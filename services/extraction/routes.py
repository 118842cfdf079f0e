"""extraction's routes: intake → facts and retractions on ``mneme.memory.v1`` (group
``extraction``). Bank upserts come through the same group (one partition, one order), so
a bank's extraction mode is known before its retains when extraction runs alone. The
entity resolver is replica-local state: its decisions go out as ``EntitiesResolved``, and
a replica assigned a partition restores both from the log (``restore``)."""

from mneme import bank_catalog
from mneme.bus import INTAKE, MEMORY
from mneme.events.v1 import events_pb2 as ev
from mneme.router import Group, Service
from services.extraction import handlers

SERVICE = Service(
    "extraction",
    groups=(Group("extraction", {INTAKE: {
        ev.BankUpserted: bank_catalog.on_bank_upserted,
        ev.BankDeleted: handlers.on_bank_deleted,
        ev.RetainRequested: handlers.on_retain_requested,
        ev.DocumentDeleteRequested: handlers.on_document_delete_requested,
        ev.MemoryDeleteRequested: handlers.on_memory_delete_requested,
        ev.ConsolidationRequested: handlers.on_consolidation_requested,
        ev.EntityMergeRequested: handlers.on_entity_merge_requested,
        ev.EntitySplitRequested: handlers.on_entity_split_requested,
    }}, restore={
        # A replica taking over a partition: the banks' configs, and the resolver's
        # decisions as the partition's previous owners published them.
        INTAKE: bank_catalog.ROUTES,
        # (the facts: which content names which entity, so the retractions after them
        # forget the entities that only deleted content named, as on the previous owner)
        MEMORY: {ev.EntitiesResolved: handlers.on_entities_resolved,
                 ev.FactsExtracted: handlers.on_facts_restored,
                 ev.EntitiesMerged: handlers.on_entities_merged,
                 ev.EntitySplit: handlers.on_entity_split,
                 ev.FactsRetracted: handlers.on_facts_retracted},
    }),),
    # VectorsReplaced: `mneme reembed` runs extraction's re-embedding policy
    # (services/extraction/reembed.py) offline, under extraction's source
    produces={MEMORY: (ev.EntitiesResolved, ev.FactsExtracted, ev.FactsRetracted,
                       ev.ConsolidationScheduled, ev.EntitiesMerged, ev.EntitySplit,
                       ev.VectorsReplaced)},
)
