"""Many replicas of every service, as separate OS processes on a Kafka-protocol broker
(tansu): two of ingest and three each of extraction, search and consolidation, with banks
spread over every partition. A bulk retain stream runs while one replica of each service is
SIGKILLed and a fresh one (empty data dir) is started; the outcome must equal a
single-process run (``mneme up``) on the same input: no acknowledged retain lost, no fact
or observation duplicated, the same recall results through every search replica, the same
entity ids, every live consumer group's lag back to 0. Read-your-writes across replicas:
a write acknowledged by one ingest replica is seen by every other replica at once.

The tests share one fresh broker and one cluster and run in file order."""

from __future__ import annotations

import threading
import time
from datetime import datetime, timezone

import grpc
import pytest

from mneme import locomo
from mneme.bootstrap import services
from mneme.client import MnemeClient
from mneme.router import group_ids
from tests.e2e.server import Server, conversation_file
from tests.integration.cluster import Cluster
from tests.integration.conftest import (KAFKA_TEST_OPTIONS, banks_over_partitions,
                                        running_tansu)

pytestmark = pytest.mark.slow

PARTITIONS = 4  # MNEME_PARTITIONS here (Kafka's default is 12): a bank on each, 3 replicas
ITEMS_PER_BANK = 15  # five sync retains per bank: the kill lands mid-stream
BATCH = 3
NOW = datetime(2024, 1, 1, tzinfo=timezone.utc)  # recency boosts depend on "now"
QUERIES = ["What did Melanie paint?", "When did Caroline go to the support group?",
           "What does Caroline want to research?"]


#: One bank per partition, so every partition has an owner to lose.
BANKS = banks_over_partitions(PARTITIONS, PARTITIONS, "replica-bank-")


def _batches() -> dict[str, list[list[dict]]]:
    """Each bank's retains, in order: consecutive LoCoMo conv-26 turns."""
    conv = next(c for c in locomo.load(conversation_file()) if c["sample_id"] == "conv-26")
    items = [i for s in locomo.sessions(conv) for i in s.items]
    out = {}
    for n, bank in enumerate(BANKS):
        mine = items[n * ITEMS_PER_BANK:(n + 1) * ITEMS_PER_BANK]
        out[bank] = [mine[k:k + BATCH] for k in range(0, len(mine), BATCH)]
    return out


def _snapshot(address: str) -> dict[str, dict]:
    """Per bank, what a search replica serves: memory id → (text, entity ids), the
    observations as (text, evidence ids, proof count), and the recall results."""
    out = {}
    with MnemeClient(address, timeout=60) as m:
        for bank in BANKS:
            mems = list(m.list_memories(bank))
            obs = sorted((o.text, tuple(sorted(e.memory_id for e in o.evidence)), o.proof_count)
                         for o in m.list_observations(bank))
            out[bank] = {
                "memory_count": len(mems),
                "memories": {x.id: (x.text, tuple(e.id for e in x.entities)) for x in mems},
                "observations": obs,
                "recall": {q: [r.memory.id for r in m.recall(bank, q, max_tokens=2048,
                                                             query_timestamp=NOW).results]
                           for q in QUERIES},
            }
    return out


@pytest.fixture(scope="module")
def broker(tmp_path_factory):  # its own: these topics get MNEME_PARTITIONS=4
    with running_tansu(tmp_path_factory.mktemp("replicas-broker") / "tansu.log") as b:
        yield b


@pytest.fixture(scope="module")
def single_process(tmp_path_factory):
    """The reference: the same retains, bank by bank, through one `mneme up`."""
    server = Server(tmp_path_factory.mktemp("replicas-embedded") / "data").start()
    try:
        with server.client() as m:
            for bank, batches in _batches().items():
                m.upsert_bank(bank)
                for n, b in enumerate(batches):
                    assert m.retain(bank, b, request_id=f"{bank}-{n}").operation.state == 3
            deadline = time.monotonic() + 120  # consolidation follows on: wait for it
            while any(x.lag for b in BANKS for x in m.bank_stats(b).lag):
                assert time.monotonic() < deadline, "the single process never caught up"
                time.sleep(0.5)
        return _snapshot(server.address)
    finally:
        server.stop()


@pytest.fixture(scope="module")
def cluster(broker, tmp_path_factory):
    c = Cluster(tmp_path_factory.mktemp("replicas"), broker.url,
                extra_env={"MNEME_PARTITIONS": str(PARTITIONS)})
    names = ["ingest", c.add("ingest"), "reflect"]
    for s in ("extraction", "search", "consolidation"):
        names += [s, c.add(s), c.add(s)]
    c.start(*names, timeout=240)
    yield c
    c.stop()


def _live_groups(c: Cluster, log) -> dict[str, tuple[str, ...]]:
    """The consumer groups of the running replicas (a killed replica's own copies stay on
    the log, at the offsets it reached)."""
    files = [c.root / n / "replica-id" for n in c.procs]  # reflect keeps none: no groups
    rids = {f.read_text().strip() for f in files if f.exists()}
    known = [k for k in log.groups() if k.rsplit(".", 1)[-1] in rids]
    return group_ids(services().values(), distributed=True, known=known)


def _wait_lag_zero(c: Cluster, log, timeout: float = 180) -> dict[str, int]:
    deadline = time.monotonic() + timeout
    while True:
        lag = {g: sum(log.lag(g, t).values()) for g, t in _live_groups(c, log).items()}
        if not any(lag.values()) or time.monotonic() > deadline:
            return lag
        time.sleep(0.5)


def test_replicas_lose_and_duplicate_nothing_when_one_of_each_is_killed(cluster, broker,
                                                                        single_process):
    from mneme.bus.logs import open_event_log

    batches = _batches()
    ingest = ["ingest", "ingest-2"]  # writers spread over the live ingest replicas
    acked: dict[str, int] = {b: 0 for b in BANKS}
    errors: list[BaseException] = []

    with MnemeClient(cluster.address["ingest"]) as m:
        for bank in BANKS:
            m.upsert_bank(bank)

    def writer(bank: str) -> None:
        try:
            for n, b in enumerate(batches[bank]):
                for attempt in range(40):  # a killed replica's calls fail: the next one retries
                    target = ingest[(n + attempt) % len(ingest)]
                    try:
                        with MnemeClient(cluster.address[target], timeout=60) as m:
                            r = m.retain(bank, b, request_id=f"{bank}-{n}")
                        assert r.operation.state == 3, r.operation
                        acked[bank] += 1
                        break
                    except grpc.RpcError as exc:
                        if exc.code() not in (grpc.StatusCode.UNAVAILABLE,
                                              grpc.StatusCode.DEADLINE_EXCEEDED):
                            raise
                        time.sleep(0.5)
                else:
                    raise AssertionError(f"{bank} batch {n} never acknowledged")
        except BaseException as exc:  # noqa: BLE001 - reported by the test
            errors.append(exc)

    threads = [threading.Thread(target=writer, args=(b,), daemon=True) for b in BANKS]
    for t in threads:
        t.start()
    total = sum(len(v) for v in batches.values())
    deadline = time.monotonic() + 240
    while sum(acked.values()) < total // 3 and time.monotonic() < deadline and not errors:
        time.sleep(0.1)
    # one replica of each service dies mid-stream; a fresh one takes its place
    for name in ("ingest-2", "extraction", "search-2", "consolidation-3"):
        cluster.kill(name)
    ingest.remove("ingest-2")
    fresh = [cluster.add(s) for s in ("ingest", "extraction", "search", "consolidation")]
    cluster.start(*fresh, timeout=240)
    ingest.append(fresh[0])
    for t in threads:
        t.join(600)
    assert not errors, errors
    assert acked == {b: len(batches[b]) for b in BANKS}

    log = open_event_log(broker.url, **KAFKA_TEST_OPTIONS)
    try:
        lag = _wait_lag_zero(cluster, log)
    finally:
        log.close()
    assert not any(lag.values()), lag
    for name in cluster.replicas("search"):  # every replica serves the same, and the same
        got = _snapshot(cluster.address[name])  # as one process on the same input
        for bank in BANKS:
            want = single_process[bank]
            assert got[bank]["memory_count"] == len(got[bank]["memories"])  # no duplicate
            assert got[bank]["memories"] == want["memories"], (name, bank)  # ids, entities
            assert got[bank]["observations"] == want["observations"], (name, bank)
            assert got[bank]["recall"] == want["recall"], (name, bank)


def test_a_write_acknowledged_by_one_replica_is_read_by_every_other_at_once(cluster):
    ingest, searches = cluster.replicas("ingest"), cluster.replicas("search")
    assert len(ingest) >= 2 and len(searches) >= 3
    for n, (writer, reader) in enumerate(zip(ingest, ingest[1:] + ingest[:1])):
        bank = f"ryw-{n}"
        with MnemeClient(cluster.address[writer]) as w, \
                MnemeClient(cluster.address[reader]) as r:
            w.upsert_bank(bank, display_name=f"written through {writer}")
            assert r.get_bank(bank).display_name == f"written through {writer}"
            text = f"Replica check {n}: the lighthouse keeper's cat is named Orion{n}."
            op = w.retain(bank, [{"content": text, "document_id": f"cats/{n}"}]).operation
            assert op.state == 3
            assert r.get_operation(op.name.rsplit("/", 1)[-1]).state == 3
            assert any(o.name == op.name for o in r.list_operations(bank))
        for s in searches:  # recallable through every search replica at once
            with MnemeClient(cluster.address[s]) as m:
                hits = m.recall(bank, f"What is the lighthouse keeper's cat named{n}?").results
                assert any(f"Orion{n}" in h.memory.text for h in hits), (s, n)
                # and its document's text, from every replica's own document projection
                assert m.get_document(bank, f"cats/{n}").original_text == text, (s, n)
    # pending work lists every live replica's own copies and the shared groups
    rids = {n: (cluster.root / n / "replica-id").read_text().strip()
            for n in [*ingest, *searches]}
    with MnemeClient(cluster.address[ingest[-1]]) as r:
        groups = {x.group for x in r.bank_stats("ryw-1").lag}
    assert {"extraction", "consolidation"} <= groups
    assert {f"search.{rids[s]}" for s in searches} <= groups
    assert {f"search-documents.{rids[s]}" for s in searches} <= groups
    assert {f"ingest.{rids[i]}" for i in ingest} <= groups
    assert "search" not in groups and "ingest" not in groups  # no such group: copies
    # a bank deleted through one replica is gone for the others
    with MnemeClient(cluster.address[ingest[0]]) as w, \
            MnemeClient(cluster.address[ingest[1]]) as r:
        w.delete_bank("ryw-0")
        with pytest.raises(grpc.RpcError) as gone:
            r.get_bank("ryw-0")
        assert gone.value.code() == grpc.StatusCode.NOT_FOUND
    with MnemeClient(cluster.address[searches[-1]]) as s, pytest.raises(grpc.RpcError) as gone:
        s.recall("ryw-0", "cat")
    assert gone.value.code() == grpc.StatusCode.NOT_FOUND
    with MnemeClient(cluster.address[ingest[0]]) as w:  # a document deleted through one
        w.delete_document("ryw-1", "cats/1")  # replica is gone from every search replica
    for s in searches:
        with MnemeClient(cluster.address[s]) as m, pytest.raises(grpc.RpcError) as gone:
            m.get_document("ryw-1", "cats/1")
        assert gone.value.code() == grpc.StatusCode.NOT_FOUND, s
