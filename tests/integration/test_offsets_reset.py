"""A Kafka operator resets every consumer group of the distributed topology to the
earliest offsets (``kafka-consumer-groups --reset-offsets --to-earliest --all-topics
--execute``, which Kafka allows only while a group has no members; deleting a group has the
same effect, its consumers start from ``auto.offset.reset=earliest``). Every service then
handles every record again into the state it already holds: the projections must come out
exactly as they were -- no fact, entity mention, observation, document revision or
operation counted twice."""

from __future__ import annotations

import time
from datetime import datetime, timezone

import pytest

from mneme.bootstrap import services
from mneme.bus import DLQ
from mneme.bus.logs import open_event_log
from mneme.client import MnemeClient
from mneme.router import group_ids
from tests.integration.cluster import Cluster
from tests.integration.conftest import KAFKA_TEST_OPTIONS
from tests.waits import drained

pytestmark = pytest.mark.slow

BANKS = ("reset-a", "reset-b")
AT = datetime(2024, 5, 2, 10, tzinfo=timezone.utc)


def _snapshot(address: str) -> dict:
    """What search serves of each bank: memories, observations, entities with their
    mention counts, documents with their revisions; and ingest's operations."""
    out = {}
    with MnemeClient(address, timeout=60) as m:
        for bank in BANKS:
            out[bank] = {
                "memories": sorted((x.id, x.text, tuple(sorted(e.id for e in x.entities)))
                                   for x in m.list_memories(bank)),
                "observations": sorted(
                    (o.text, tuple(sorted(e.memory_id for e in o.evidence)), o.proof_count)
                    for o in m.list_observations(bank)),
                "entities": sorted((e.id, e.display_name, e.mention_count,
                                    tuple(sorted(e.memories)))
                                   for e in m.list_entities(bank)),
                "documents": sorted(
                    (d.name, d.revision_count, d.memory_count,
                     tuple((h.revision, h.operation) for h in
                           m.get_document(bank, d.document_id).history))
                    for d in m.list_documents(bank)),
            }
    return out


def _operations(address: str) -> dict:
    with MnemeClient(address, timeout=60) as m:
        return {bank: sorted((o.name, o.state) for o in m.list_operations(bank))
                for bank in BANKS}


def _wait_lag_zero(log, timeout: float = 120) -> None:
    deadline = time.monotonic() + timeout
    while True:
        groups = group_ids(services().values(), distributed=True, known=log.groups())
        lag = {g: sum(log.lag(g, topics).values()) for g, topics in groups.items()}
        if not any(lag.values()):
            return
        assert time.monotonic() < deadline, f"consumer lag not drained: {lag}"
        time.sleep(0.5)


def _reset(bootstrap: str, group: str, topics) -> None:
    """Commit offset 0 on every partition of ``topics`` for ``group``, its consumers
    stopped: what ``kafka-consumer-groups --reset-offsets --to-earliest`` does. Done as the
    group's only member (tansu refuses a memberless commit for a group that had members,
    which Apache Kafka takes once the group is empty)."""
    import asyncio

    from aiokafka import AIOKafkaConsumer

    async def reset() -> None:
        c = AIOKafkaConsumer(*topics, bootstrap_servers=bootstrap, group_id=group,
                             enable_auto_commit=False, session_timeout_ms=2000,
                             heartbeat_interval_ms=300)
        await c.start()
        try:
            while not c.assignment():
                await c.getmany(timeout_ms=200, max_records=1)
            await c.commit({tp: 0 for tp in c.assignment()})
        finally:
            await c.stop()
    asyncio.run(asyncio.wait_for(reset(), 60))


def test_groups_reset_to_earliest_handle_everything_again_without_duplicates(
        fresh_tansu, tmp_path):
    root = tmp_path / "cluster"
    root.mkdir()
    cluster = Cluster(root, fresh_tansu.url, extra_env={"MNEME_PARTITIONS": "2"})
    cluster.start()
    log = open_event_log(fresh_tansu.url, **KAFKA_TEST_OPTIONS)
    try:
        with MnemeClient(cluster.address["ingest"], timeout=60) as m:
            for bank in BANKS:
                m.upsert_bank(bank, display_name=bank)
                for text in ("Alice moved to Lisbon with her dog Biscuit.",
                             "Alice works at Acme as a nurse. Bob visits Alice in Lisbon.",
                             "Bob adopted a cat named Miso."):
                    assert m.retain(bank, [{"content": text, "timestamp": AT}]
                                    ).operation.state == 3
                for n, text in enumerate(("Carol leads the Acme onboarding.",
                                          "Carol leads the Acme onboarding. Dan helps her.")):
                    assert m.retain(bank, [{"content": text, "timestamp": AT,
                                            "document_id": "onboarding"}],
                                    request_id=f"doc-{n}").operation.state == 3
                m.consolidate(bank)
            m.upsert_bank("reset-gone")  # deleted before the reset: its keys destroyed
            assert m.retain("reset-gone", [{"content": "Eve hid the key.", "timestamp": AT}]
                            ).operation.state == 3
            m.delete_bank("reset-gone")
        with MnemeClient(cluster.address["ingest"], timeout=60) as s:
            for bank in BANKS:
                drained(s, bank)
        _wait_lag_zero(log)
        before, ops_before = _snapshot(cluster.address["search"]), \
            _operations(cluster.address["ingest"])
        dead = sum(log.end_offset(DLQ, p) for p in range(log.partitions(DLQ)))
        assert all(b["memories"] and b["entities"] for b in before.values()), before

        cluster.stop()
        groups = group_ids(services().values(), distributed=True, known=log.groups())
        assert len(groups) >= 5, groups
        for g, topics in groups.items():
            _reset(fresh_tansu.bootstrap, g, topics)
        cluster.start()
        _wait_lag_zero(log)
        with MnemeClient(cluster.address["ingest"], timeout=60) as s:
            for bank in BANKS:
                drained(s, bank)
        after = _snapshot(cluster.address["search"])
        for bank in BANKS:
            for part in before[bank]:
                assert after[bank][part] == before[bank][part], (bank, part)
        assert _operations(cluster.address["ingest"]) == ops_before
        with MnemeClient(cluster.address["ingest"], timeout=60) as m:
            assert sorted(b.name for b in m.list_banks()) == [f"banks/{b}" for b in BANKS]
        # the deleted bank's records, unreadable now, are not dead letters
        assert sum(log.end_offset(DLQ, p) for p in range(log.partitions(DLQ))) == dead
    finally:
        log.close()
        cluster.stop()
