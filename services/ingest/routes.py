"""ingest's routes: the catalog projection (group ``ingest``; each replica keeps its own
copy, so any replica answers for any bank and operation) and what its API appends."""

from mneme import bank_catalog
from mneme.bus import AUDIT, INTAKE, PROGRESS
from mneme.events.v1 import events_pb2 as ev
from mneme.router import Group, Service
from services.ingest import handlers

SERVICE = Service(
    "ingest",
    groups=(Group("ingest", {
        INTAKE: {**bank_catalog.ROUTES, ev.BankDeleted: handlers.on_bank_deleted,
                 ev.RetainRequested: handlers.on_operation_requested,
                 ev.DocumentDeleteRequested: handlers.on_deletion_requested,
                 ev.MemoryDeleteRequested: handlers.on_deletion_requested,
                 ev.ConsolidationRequested: handlers.on_operation_requested,
                 ev.OperationCancelRequested: handlers.on_operation_cancel_requested,
                 # search's EntityService appends these: operations like the others
                 ev.EntityMergeRequested: handlers.on_operation_requested,
                 ev.EntitySplitRequested: handlers.on_operation_requested},
        PROGRESS: {ev.OperationProgress: handlers.on_operation_progress},
    }, replay=True, state="replica"),),  # every replica answers for every bank
    # the write API appends every intake event; the gRPC guard audits refused requests
    produces={INTAKE: (ev.BankUpserted, ev.BankDeleted, ev.DirectiveChanged, ev.RetainRequested,
                       ev.DocumentDeleteRequested, ev.MemoryDeleteRequested,
                       ev.ConsolidationRequested, ev.OperationCancelRequested),
              AUDIT: (ev.AuditRecorded,)},
)
