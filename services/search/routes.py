"""search's routes: its three projections of ``mneme.memory.v1`` (group ``search``), its
document projection of ``mneme.intake.v1`` (group ``search-documents``: each document's
retains and original text, :mod:`services.search.documents`) and, when it runs alone, its
own bank catalog (group ``search-catalog``, for NOT_FOUND). Each replica keeps its own
catalog and document projection (full copies, like the catalog: any replica answers for
any bank), and its own search stores while they are local files; with store servers the
replicas share the ``search`` group's partitions."""

from mneme import bank_catalog
from mneme.bus import AUDIT, INTAKE, MEMORY, PROGRESS
from mneme.events.v1 import events_pb2 as ev
from mneme.router import Group, Service
from services.search import documents, handlers

SERVICE = Service(
    "search",
    groups=(
        Group("search", {MEMORY: {ev.FactsExtracted: handlers.on_facts_extracted,
                                  ev.FactsRetracted: handlers.on_facts_retracted,
                                  ev.ObservationsChanged: handlers.on_observations_changed,
                                  ev.OpinionsChanged: handlers.on_opinions_changed,
                                  ev.EntitiesMerged: handlers.on_entities_merged,
                                  ev.EntitySplit: handlers.on_entity_split,
                                  ev.VectorsReplaced: handlers.on_vectors_replaced}},
              replay=True, state="stores", durable=("stores",)),
        # a retain succeeds with its facts; the history of its documents follows on (a
        # deletion's erasure of their text does fail the deletion)
        Group("search-documents", {INTAKE: documents.ROUTES}, replay=True, state="replica",
              secondary=(ev.RetainRequested, ev.BankUpserted)),
        Group("search-catalog", {INTAKE: bank_catalog.ROUTES}, distributed_only=True,
              replay=True, state="replica"),
    ),
    # its EntityService appends users' entity corrections to the intake topic
    produces={PROGRESS: (ev.OperationProgress,), AUDIT: (ev.AuditRecorded,),
              INTAKE: (ev.EntityMergeRequested, ev.EntitySplitRequested)},
)
