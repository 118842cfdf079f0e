"""Distributed (Kafka key topic on tansu): a DeleteDocument whose append failed after
its keys were destroyed is appended by the next ingest (another process, or the same
one restarted) from the request the key topic kept: the same record, once."""

from __future__ import annotations

import secrets
import uuid

import pytest

from mneme.bus import INTAKE, codec, partition_for
from mneme.domain import BankConfig
from mneme.errors import Unavailable
from mneme.keys import Keyring, LocalKms
from mneme.stores.memory import MemoryCatalog
from services.ingest.handlers import Ingest, _unpack
from tests.integration.conftest import KAFKA_TEST_OPTIONS


class Refusing:
    """The event log, refusing every append of a DocumentDeleteRequested."""

    def __init__(self, log) -> None:
        self.log = log

    def append(self, records):
        if any(codec.decode(r).type.endswith(".DocumentDeleteRequested") for r in records):
            raise Unavailable("injected: the event log did not take the record")
        return self.log.append(records)

    def __getattr__(self, name):
        return getattr(self.log, name)


def _deletions(log, bank_id: str) -> list[tuple[str, str]]:
    n = log.partitions(INTAKE)
    if not n:  # no record on the topic yet
        return []
    p = partition_for(bank_id, n)
    out, offset = [], 0
    while batch := log.read(INTAKE, p, offset, 500):
        for r in batch:
            env = codec.decode(r)
            if r.key == bank_id and env.type.endswith("DocumentDeleteRequested"):
                out.append((env.id, env.message.operation_id))
        offset = batch[-1].offset + 1
    return out


def test_a_deletion_whose_append_failed_is_appended_by_the_next_ingest(fresh_tansu):
    tansu = fresh_tansu  # its own broker: the shared one's topics belong to the cluster tests
    from mneme.bus.logs import open_event_log
    from mneme.stores.keys_kafka import KafkaKeyStore
    topic, bank = f"keys-{uuid.uuid4().hex[:8]}", f"bank-{uuid.uuid4().hex[:8]}"
    kms = LocalKms(secrets.token_bytes(32))
    conns = [open_event_log(tansu.url, **KAFKA_TEST_OPTIONS) for _ in range(3)]
    log, keys_a, keys_b = conns
    stores = [KafkaKeyStore(keys_a, topic, poll_s=0)]
    try:
        catalog = MemoryCatalog()
        catalog.upsert_bank(bank, "", BankConfig(), 0.0)
        first = Ingest(Refusing(log), catalog, source="mneme/ingest",
                       keys=Keyring(stores[0], kms))
        key = first.keys.current(bank, "d:d1")
        with pytest.raises(Unavailable):
            first.delete_document(bank, "d1", wait=False)
        assert first.keys.key(bank, key) is None  # destroyed, and nothing on the log
        assert _deletions(log, bank) == []
        (kept,) = first.keys.pending_deletions(bank)
        # the next ingest (a restart: it reads the key topic at open)
        stores.append(KafkaKeyStore(keys_b, topic, poll_s=0))
        second = Ingest(log, catalog, source="mneme/ingest", keys=Keyring(stores[1], kms))
        assert second.complete_deletions() == 1
        appended = _deletions(log, bank)
        assert [op for _, op in appended] == [kept.operation_id]
        # the record first written for it: its event id too
        assert appended[0][0] == codec.decode(_unpack(kept.request)).id
        assert second.complete_deletions() == 0 and _deletions(log, bank) == appended
        stores[0].catch_up()
        assert stores[0].pending_deletions() == []  # cleared for every process
    finally:
        for s in stores:
            s.close()
        for c in conns:
            c.close()
