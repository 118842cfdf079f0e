"""The catalog rebuilt by a new replica from the log: ingest's group reads
``mneme.intake.v1`` and ``mneme.progress.v1`` with a consumer each, so a bank's operation
progress may be projected before the BankUpserted (and BankDeleted) it came after. The
catalog's result must not depend on that order."""

from __future__ import annotations

import itertools
from datetime import datetime, timedelta, timezone

import pytest

from mneme import bank_catalog
from mneme.domain import EventMeta
from mneme.events.v1 import events_pb2 as ev
from mneme.stores.catalog_sqlite import SqliteCatalog
from mneme.stores.memory import MemoryCatalog
from services.ingest import handlers as ingest

T0 = datetime(2026, 12, 1, 12, tzinfo=timezone.utc)
SUCCEEDED = "succeeded"


@pytest.fixture(params=["memory", "sqlite"])
def catalog(request, tmp_path):
    c = MemoryCatalog() if request.param == "memory" else SqliteCatalog(str(tmp_path / "c.db"))
    yield c
    if hasattr(c, "close"):
        c.close()


def _events():
    """One bank's log: created, a retain (request, progress), deleted with its
    operation, created again, another retain. (time, topic, message) in time order."""
    t = (T0 + timedelta(seconds=s) for s in itertools.count())
    return [
        (next(t), "intake", ev.BankUpserted(bank_id="b", display_name="first")),
        (next(t), "intake", ev.RetainRequested(bank_id="b", operation_id="op1",
                                               items=[ev.RetainItem()])),
        (next(t), "progress", ev.OperationProgress(bank_id="b", operation_id="op1",
                                                   kind="retain", state=SUCCEEDED)),
        (next(t), "intake", ev.BankDeleted(bank_id="b", operation_id="del")),
        (next(t), "progress", ev.OperationProgress(bank_id="b", operation_id="del",
                                                   kind="delete_bank", state=SUCCEEDED)),
        (next(t), "intake", ev.BankUpserted(bank_id="b", display_name="second")),
        (next(t), "intake", ev.RetainRequested(bank_id="b", operation_id="op2",
                                               items=[ev.RetainItem()])),
        (next(t), "progress", ev.OperationProgress(bank_id="b", operation_id="op2",
                                                   kind="retain", state=SUCCEEDED)),
    ]


def _apply(catalog, at, m) -> None:
    meta = EventMeta(f"{m.DESCRIPTOR.name}-{getattr(m, 'operation_id', '')}", at)
    if isinstance(m, ev.BankUpserted):
        bank_catalog.on_bank_upserted(m, meta, catalog=catalog)
    elif isinstance(m, ev.BankDeleted):
        ingest.on_bank_deleted(m, meta, catalog=catalog)
    elif isinstance(m, ev.RetainRequested):
        ingest.on_operation_requested(m, meta, catalog=catalog)
    else:
        ingest.on_operation_progress(m, meta, catalog=catalog)


@pytest.mark.parametrize("order", ["log", "progress first", "intake first"])
def test_operations_survive_any_interleaving_of_intake_and_progress(catalog, order):
    """Each topic in its own order, the two interleaved as a rebuild's consumers read
    them: the re-created bank lists its own operation (op2), done; the first
    incarnation's operations (op1, and its deletion's) are gone with it. Before, a
    progress read before its bank's BankUpserted made the operation look like an earlier
    incarnation's: it was dropped, and its request then ignored (a new replica listed no
    operations of a bank at all)."""
    events = _events()
    if order != "log":
        first = "progress" if order == "progress first" else "intake"
        events = sorted(events, key=lambda e: e[1] != first)  # stable: each topic in order
    for at, _, m in events:
        _apply(catalog, at, m)
    ops = {o.operation_id: o.state for o in catalog.list_operations("b", 10)}
    assert ops == {"op2": SUCCEEDED}
    assert catalog.get_bank("b").display_name == "second"
