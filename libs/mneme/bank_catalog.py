"""The bank catalog projection every service keeps of ``mneme.intake.v1``.

ingest (banks and operations), and in the distributed topology search, extraction and
consolidation (each its own copy, so it knows a bank's config and existence without
asking ingest) apply the same two events the same way: :func:`project_banks`.
"""

from __future__ import annotations

from mneme.bus import codec
from mneme.events.v1 import events_pb2 as ev
from mneme.ports import OutRecord, Record


def project_banks(env, record: Record, *, catalog) -> list[OutRecord]:
    """BankUpserted (a create, a replace, or the masked fields of an update) and
    BankDeleted into ``catalog`` (a :class:`mneme.stores.catalog_sqlite.SqliteCatalog`);
    other events are ignored. Idempotent; returns no events. The time is the event's
    (``ce_time``), else the record's, so replay reproduces it."""
    m = env.message
    if isinstance(m, ev.BankUpserted):
        at = env.time.timestamp() if env.time else record.timestamp
        catalog.upsert_bank(m.bank_id, m.display_name, codec.bank_config_from_pb(
            m.config if m.HasField("config") else None), at, mask=tuple(m.update_mask))
    elif isinstance(m, ev.BankDeleted):
        catalog.delete_bank(m.bank_id)
    return []
