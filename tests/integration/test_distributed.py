"""The distributed topology end to end: the five services as separate OS processes
(``mneme serve <service>``) on a Kafka-protocol broker (tansu), compared with the
embedded topology (``mneme up``) on the same input; SIGKILL of extraction and search
mid-stream; a poison event; an external consumer decoding every topic from offset 0;
replay of the search projections.

The tests share one broker and one cluster and run in file order (each builds on the
log the previous ones left)."""

from __future__ import annotations

import collections
import re
import subprocess
import threading
import time
from datetime import datetime, timezone

import pytest

from mneme import locomo
from mneme.bootstrap import services
from mneme.bus import ALL_TOPICS, DLQ, INTAKE, MEMORY, PROGRESS, codec
from mneme.client import MnemeClient
from mneme.events.v1 import events_pb2 as ev
from mneme.ports import OutRecord, Record
from mneme.router import group_ids
from tests.e2e.server import ROOT, Server, conversation_file
from tests.integration.cluster import Cluster
from tests.integration.conftest import KAFKA_TEST_OPTIONS, mneme_bin
from tests.llm.stub import OPINION_FORMATION, StubLLM, chat
from tests.waits import drained

pytestmark = pytest.mark.slow

BANK = "conv-26"
SESSIONS = 3
NOW = datetime(2024, 1, 1, tzinfo=timezone.utc)  # recency boosts depend on "now"
RECORD_LIMIT = 256 * 1024  # the cluster's MNEME_KAFKA_MAX_REQUEST_SIZE
QUERIES = ["When did Caroline go to the LGBTQ support group?", "What did Melanie paint?",
           "What is Caroline's identity?", "When did Melanie run a charity race?",
           "What does Caroline want to research?"]
def _groups(log) -> dict[str, tuple[str, ...]]:
    """Every consumer group on the log (per-replica ones under each replica's id)."""
    return group_ids(services().values(), distributed=True, known=log.groups())


def _sessions():
    conv = next(c for c in locomo.load(conversation_file()) if c["sample_id"] == "conv-26")
    return locomo.sessions(conv)[:SESSIONS]


def _retain_conversation(m: MnemeClient) -> None:
    m.upsert_bank(BANK, display_name="LoCoMo conv-26")
    for n, s in enumerate(_sessions()):
        r = m.retain(BANK, s.items, request_id=f"session-{n}")
        assert r.operation.state == 3, r.operation  # SUCCEEDED: read-your-writes


def _recall(address: str) -> dict[str, list[str]]:
    with MnemeClient(address) as m:
        return {q: [x.memory.id for x in m.recall(BANK, q, max_tokens=2048,
                                                   query_timestamp=NOW).results]
                for q in QUERIES}


def _lag(log, groups=None) -> dict[str, int]:
    groups = _groups(log) if groups is None else groups
    return {g: sum(log.lag(g, topics).values()) for g, topics in groups.items()}


def _wait_lag_zero(log, timeout: float = 90, gone: tuple[str, ...] = ()) -> dict[str, int]:
    """Each group's lag once every one is 0 (or after ``timeout`` s). Left out: the own
    groups of the replicas ``gone`` (replica ids of stopped processes: their copies stay
    behind) and the builder groups of finished replays (``…@g<n>…``: each stopped where
    its switch was)."""
    deadline = time.monotonic() + timeout
    while True:
        lag = {g: n for g, n in _lag(log).items()
               if "@g" not in g and not any(g.endswith(f".{r}") for r in gone)}
        if not any(lag.values()) or time.monotonic() > deadline:
            return lag
        time.sleep(0.5)


@pytest.fixture(scope="module")
def bus(tansu):
    from mneme.bus.logs import open_event_log
    log = open_event_log(tansu.url, **KAFKA_TEST_OPTIONS)
    yield log
    log.close()


@pytest.fixture(scope="module")
def stub():
    """The reflect model of the cluster (reflect only: extraction and consolidation stay
    offline, MNEME_LLM_MODEL is unset)."""
    with StubLLM() as s:
        yield s


@pytest.fixture(scope="module")
def cluster(tansu, tmp_path_factory, stub):
    c = Cluster(tmp_path_factory.mktemp("cluster"), tansu.url, extra_env={
        "MNEME_REFLECT_LLM_MODEL": "openai/stub-model", "MNEME_REFLECT_LLM_BASE_URL": stub.base_url,
        "MNEME_REFLECT_LLM_API_KEY": "sk-test", "MNEME_LLM_MAX_RETRIES": "1",
        "MNEME_LLM_BACKOFF_S": "0.05",
        # a record limit of 256 KiB (Kafka's default is 1 MiB), so that a document of a
        # few pages already goes out in parts
        "MNEME_KAFKA_MAX_REQUEST_SIZE": str(RECORD_LIMIT),
        # a retired generation stays until dropped by command (the consolidation replay
        # test compares it, then drops it)
        "MNEME_RETIRE_GRACE_S": "3600"}).start()
    yield c
    c.stop()


def _recall_then(stub, question: str, answer: str) -> None:
    stub.on("chat", chat(None, tool_calls=[{"name": "recall", "arguments": {"query": question}}]),
            chat(answer), match=question)


@pytest.fixture(scope="module")
def embedded_results(tmp_path_factory):
    server = Server(tmp_path_factory.mktemp("embedded") / "data").start()
    try:
        with server.client() as m:
            _retain_conversation(m)
        return _recall(server.address)
    finally:
        server.stop()


def test_separate_processes_recall_like_the_embedded_topology(cluster, embedded_results, bus,
                                                              stub):
    with MnemeClient(cluster.address["ingest"]) as m:
        _retain_conversation(m)
        # sync retain returned only after search indexed the facts (other process)
        assert m.get_bank(BANK).display_name == "LoCoMo conv-26"
    distributed = _recall(cluster.address["search"])
    assert all(distributed.values())
    assert distributed == embedded_results
    with MnemeClient(cluster.address["search"]) as s:
        turns = {i["metadata"]["dia_id"] for sess in _sessions() for i in sess.items}
        got = {d for mem in s.list_memories(BANK) for d in mem.metadata["dia_id"].split(",")}
        assert got == turns
    with MnemeClient(cluster.address["reflect"]) as r:  # reflect → search over gRPC
        _recall_then(stub, "What did Melanie paint?", "A sunset [m1].")
        a = r.reflect(BANK, "What did Melanie paint?")
        assert not a.extractive and len(a.based_on) == 1
        assert list(a.sources.facts) == list(a.based_on)
    assert not any(_wait_lag_zero(bus).values())


def test_distributed_reflect_follows_the_banks_directives_and_traits(cluster, stub):
    """Reflect's own catalog (group reflect-catalog) has what ingest acknowledged: the
    directive and the bank's skepticism reach the model's prompt at once."""
    with MnemeClient(cluster.address["ingest"]) as m:
        d = m.create_directive(BANK, "Answer in German.", tags=["art"])
        m.update_bank(BANK, skepticism=5)
    with MnemeClient(cluster.address["reflect"]) as r:
        _recall_then(stub, "What did Melanie paint", "Einen Sonnenuntergang [m1].")
        a = r.reflect(BANK, "What did Melanie paint, in art terms?", tags=["art"])
    prompt = stub.chat_requests(without=OPINION_FORMATION)[-1].messages[0]["content"]
    assert "Answer in German." in prompt and "skepticism 5/5" in prompt
    assert list(a.sources.directives) == [d.id]
    with MnemeClient(cluster.address["ingest"]) as m:
        m.delete_directive(BANK, d.id)
        m.update_bank(BANK, skepticism=3)


def test_distributed_reflect_serves_mental_models(cluster, stub):
    """MentalModelService on a reflect replica: its writes go through the intake topic into
    its own catalog (read-your-writes), a refresh runs the reflect model over search."""
    with MnemeClient(cluster.address["reflect"]) as r:
        made = r.create_mental_model(BANK, "Melanie's art", "What does Melanie paint?")
        assert [x.id for x in r.list_mental_models(BANK)] == [made.id]
        _recall_then(stub, "What does Melanie paint?", "Sunsets and lakes [m1].")
        got = r.refresh_mental_model(BANK, made.id)
        assert got.content == "Sunsets and lakes [1]." and len(got.based_on) == 1
        assert got.revision == 1 and not got.is_stale
        r.delete_mental_model(BANK, made.id)
        assert list(r.list_mental_models(BANK)) == []


def test_distributed_entity_corrections(cluster):
    """EntityService's merge and split on the search process: the correction goes through
    the intake topic, extraction's resolver (another process) and the memory topic into
    search's graph before the call returns; the next retain resolves accordingly."""
    bank, at = "fam", datetime(2024, 3, 2, tzinfo=timezone.utc)
    with MnemeClient(cluster.address["ingest"]) as m, \
            MnemeClient(cluster.address["search"]) as s:
        m.upsert_bank(bank)
        r = m.retain(bank, [{"content": t, "timestamp": at} for t in (
            "Liz adopted a puppy named Biscuit.", "Elizabeth started a pottery class.")])
        assert r.operation.state == 3
        ids = {e.display_name: e.id for e in s.list_entities(bank)}
        merged = s.merge_entities(bank, [ids["Elizabeth"], ids["Liz"]])
        assert sorted(merged.aliases) == ["elizabeth", "liz"] and merged.mention_count == 2
        r = m.retain(bank, [{"content": "Liz took Biscuit to the vet.", "timestamp": at}])
        assert f"banks/{bank}/memories/{r.memory_ids[0]}" in s.get_entity(
            bank, ids["Elizabeth"]).memories
        split = s.split_entity(bank, ids["Elizabeth"], "Liz", aliases=["liz"])
        assert split.entity.mention_count == 1 and split.new_entity.mention_count == 2
        r = m.retain(bank, [{"content": "Liz went swimming.", "timestamp": at}])
        assert f"banks/{bank}/memories/{r.memory_ids[0]}" in s.get_entity(
            bank, split.new_entity.id).memories
        kinds = collections.Counter(o.kind for o in m.list_operations(bank))
        assert kinds["merge_entities"] == kinds["split_entity"] == 1


def test_a_retain_larger_than_kafka_takes_is_refused_as_too_large(cluster):
    """A retain within the API's limits (32 MiB requests, 200,000 characters an item) may
    still not fit one Kafka record (1 MiB by default, 256 KiB here): RESOURCE_EXHAUSTED saying so, as a
    request over a size limit -- not UNKNOWN with the producer's traceback -- and no
    operation is left behind."""
    import grpc

    items = [{"content": f"Item {n}: " + "Alice likes sardines. " * 5_000, "document_id": f"d{n}"}
             for n in range(12)]  # 1.3 MB
    with MnemeClient(cluster.address["ingest"], timeout=60) as m:
        m.upsert_bank("too-large")
        for async_ in (True, False):
            with pytest.raises(grpc.RpcError) as refused:
                m.retain("too-large", items, async_=async_)
            assert refused.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
            assert "RetainRequested of bank 'too-large' is " in refused.value.details()
        assert list(m.list_operations("too-large")) == []
        ok = m.retain("too-large", [{"content": "Alice likes sardines."}])  # works on
        assert ok.operation.state == 3, ok.operation


def test_a_document_whose_facts_exceed_a_kafka_record_is_retained_whole(cluster, bus):
    """A 36,000-character document (conv-26's first turns) fits one RetainRequested
    under the cluster's 256 KiB record limit, but its facts with their embeddings encode
    to several times that, and reconsolidating the bank rewrites every observation in one
    change: both go out in parts of at most half the limit on mneme.memory.v1, and the
    retain and the reconsolidation succeed with everything stored (both ended FAILED
    with RecordTooLarge before the parts, at Kafka's default 1 MiB limit with a
    124,000-character document)."""
    conv = locomo.load(ROOT / "examples" / "locomo" / "conv-26.json")[0]
    turns = [i["content"] for s in locomo.sessions(conv) for i in s.items]
    text = " ".join(turns)[:36_000].rsplit(" ", 1)[0]
    probe = next(t for t in reversed(turns) if len(t) > 80 and t in text)
    with MnemeClient(cluster.address["ingest"], timeout=600) as m, \
            MnemeClient(cluster.address["search"], timeout=60) as s:
        m.upsert_bank("big-doc")
        r = m.retain("big-doc", [{"content": text, "document_id": "talk"}])
        assert r.operation.state == 3, r.operation  # SUCCEEDED
        stored = {x.id: x.text for x in s.list_memories("big-doc", document_id="talk")}
        assert sorted(stored) == sorted(r.memory_ids) and len(stored) > 200
        drained(m, "big-doc")
        assert list(s.list_observations("big-doc"))
        op = m.consolidate("big-doc", reconsolidate=True)
        assert op.state == 3, op
        drained(m, "big-doc")
        assert list(s.list_observations("big-doc"))
        sentence = max(re.split(r"(?<=[.!?]) ", probe), key=len)
        holders = {i for i, t in stored.items() if sentence in t}
        assert holders, sentence
        hits = s.recall("big-doc", sentence).results
        assert holders & {h.memory.id for h in hits[:10]}, (sentence, hits[:5])
    # what went over the log: several parts of each, none over the limit, together past it
    sizes: dict[str, list[int]] = collections.defaultdict(list)
    for p in range(bus.partitions(MEMORY)):
        off = 0
        while got := bus.read(MEMORY, p, off, 500):
            for rec in got:
                env = codec.decode(rec)
                if rec.key == "big-doc" and getattr(env.message, "parts", 0):
                    sizes[env.message.DESCRIPTOR.name].append(len(rec.value))
            off = got[-1].offset + 1
    assert len(sizes["FactsExtracted"]) > 2 and sum(sizes["FactsExtracted"]) > RECORD_LIMIT, sizes
    assert len(sizes["ObservationsChanged"]) > 1, sizes
    assert max(n for v in sizes.values() for n in v) < RECORD_LIMIT, sizes


def test_sigkill_extraction_and_search_mid_stream(cluster, bus):
    items = [i for s in locomo.sessions(next(
        c for c in locomo.load(conversation_file()) if c["sample_id"] == "conv-26"))
        for i in s.items][:120]
    batches = [items[n:n + 2] for n in range(0, len(items), 2)]
    for n, b in enumerate(batches):  # a document per batch: re-retaining a document replaces it
        for item in b:
            item["document_id"] = f"batch-{n}"
    acked: list[str] = []
    errors: list[Exception] = []

    def writer():
        with MnemeClient(cluster.address["ingest"], timeout=60) as m:
            m.upsert_bank("crash")
            for n, b in enumerate(batches):  # async: acknowledged once durable on the log
                try:
                    r = m.retain("crash", b, request_id=f"b{n}", async_=True)
                except Exception as e:  # pragma: no cover - ingest is never killed
                    errors.append(e)
                    return
                acked.append(r.operation.name.split("/", 1)[1])
                time.sleep(0.02)

    t = threading.Thread(target=writer)
    t.start()
    while len(acked) < 15 and t.is_alive():
        time.sleep(0.05)
    cluster.kill("extraction")
    cluster.kill("search")
    t.join(120)
    assert not errors and len(acked) == len(batches)
    cluster.start("extraction", "search")
    lag = _wait_lag_zero(bus, 150)
    assert not any(lag.values()), lag
    with MnemeClient(cluster.address["ingest"]) as m:
        states = collections.Counter(m.get_operation(op).state for op in acked)
    assert states == {3: len(acked)}  # every acknowledged retain succeeded
    with MnemeClient(cluster.address["search"]) as s:
        mems = list(s.list_memories("crash"))
    per_turn = collections.Counter(x.metadata["dia_id"] for x in mems)
    texts = collections.Counter((x.metadata["dia_id"], x.text) for x in mems)
    assert {i["metadata"]["dia_id"] for i in items} <= set(per_turn)
    assert not [k for k, n in texts.items() if n > 1]  # no fact indexed twice
    assert len({x.id for x in mems}) == len(mems)


def test_external_consumer_decodes_every_topic_from_offset_zero(tansu):
    import asyncio

    from aiokafka import AIOKafkaConsumer, TopicPartition

    async def read_all() -> dict[str, int]:
        c = AIOKafkaConsumer(bootstrap_servers=tansu.bootstrap, enable_auto_commit=False)
        await c.start()
        try:
            tps = [TopicPartition(t, p) for t in ALL_TOPICS
                   for p in sorted(c.partitions_for_topic(t) or ())]
            c.assign(tps)
            await c.seek_to_beginning(*tps)
            counts: dict[str, int] = collections.Counter()
            idle = 0
            while idle < 3:
                batch = await c.getmany(timeout_ms=500)
                idle = 0 if batch else idle + 1
                for msgs in batch.values():
                    for msg in msgs:
                        rec = Record(msg.topic, msg.partition, msg.offset, msg.key.decode(),
                                     msg.value, {k: v.decode() for k, v in msg.headers})
                        env = codec.decode(rec)  # raises on anything undecodable
                        assert env.message is not None, env.type
                        assert rec.headers["ce_specversion"] == "1.0" and env.id
                        counts[msg.topic] += 1
            return counts
        finally:
            await c.stop()

    counts = asyncio.run(read_all())
    assert counts[INTAKE] and counts[MEMORY] and counts[PROGRESS] and counts["mneme.reflect.v1"]


def test_poison_event_goes_to_the_dlq_and_the_partition_keeps_flowing(cluster, bus):
    good = codec.encode(ev.RetainRequested(bank_id="crash"), bank_id="crash", source="test")
    garbage = b"\xff\xfe\x00 not a protobuf"
    [poison] = bus.append([OutRecord(INTAKE, "crash", garbage, good.headers)])
    with MnemeClient(cluster.address["ingest"], timeout=60) as m:
        r = m.retain("crash", [{"content": "Caroline: the poison did not stop me."}],
                     request_id="after-poison")
        assert r.operation.state == 3 and r.memory_ids
    deadline = time.monotonic() + 30
    while True:
        dead = [d for d in bus.read(DLQ, 0, 0, 1000)
                if d.headers.get("dlq_offset") == str(poison.offset)
                and d.headers.get("dlq_partition") == str(poison.partition)]
        groups = {d.headers["dlq_group"] for d in dead}
        if {"extraction", "ingest"} <= groups or time.monotonic() > deadline:
            break
        time.sleep(0.5)
    assert {"extraction", "ingest"} <= groups
    d = next(d for d in dead if d.headers["dlq_group"] == "extraction")
    assert d.value == garbage and d.headers["dlq_topic"] == INTAKE
    assert "DecodeError" in d.headers["dlq_error"]
    assert not any(_wait_lag_zero(bus).values())


def test_replay_rebuilds_the_search_projections(cluster, bus):
    before = _recall(cluster.address["search"])
    # Each search replica keeps its own copy (local store files) under its own consumer
    # group: a replay from another data dir builds that dir's copy and leaves the live
    # replica alone; a replay of the live replica's dir is refused before it wipes it.
    elsewhere = subprocess.run([mneme_bin(), "replay"], timeout=300, capture_output=True,
                               text=True, env={**cluster.env("search"),
                                               "MNEME_DATA_DIR": str(cluster.root / "elsewhere")})
    assert elsewhere.returncode == 0, (elsewhere.stdout + elsewhere.stderr)[-3000:]
    refused = subprocess.run([mneme_bin(), "replay"], timeout=300, capture_output=True,
                             text=True, env=cluster.env("search"))
    said = " ".join((refused.stdout + refused.stderr).split())
    assert refused.returncode == 1 and "in use by another mneme process" in said, said[-3000:]
    assert _recall(cluster.address["search"]) == before
    # The running replica replays its own stores while it serves (the Helm Job's command:
    # every address of the host, one after the other), and switches to an equal generation.
    answers, errors, stop = [], [], threading.Event()

    def read() -> None:  # recall answers throughout, with the same results
        while not stop.is_set():
            try:
                now = _recall(cluster.address["search"])
                answers.append({q: (before[q], now[q]) for q in QUERIES
                                if now[q] != before[q]})
            except Exception as e:  # noqa: BLE001 - every failure is a finding
                errors.append(repr(e))
    reader = threading.Thread(target=read)
    reader.start()
    try:
        live = subprocess.run([mneme_bin(), "replay", "--address", cluster.address["search"],
                               "--each"], timeout=300, capture_output=True, text=True,
                              env=cluster.env("search"))
    finally:
        stop.set()
        reader.join(60)
    said = " ".join((live.stdout + live.stderr).split())
    assert live.returncode == 0 and "generation 2: LIVE" in said, said[-3000:]
    differ = [a for a in answers if a]
    assert errors == [] and answers and not differ, (errors[:3], len(differ), differ[:2])
    assert _recall(cluster.address["search"]) == before
    cluster.stop("search")
    out = subprocess.run([mneme_bin(), "replay"], env=cluster.env("search"),
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    replica = (cluster.root / "search" / "replica-id").read_text().strip()
    own = {f"search.{replica}": (MEMORY,), f"search-catalog.{replica}": (INTAKE,)}
    assert _lag(bus, own) == dict.fromkeys(own, 0)
    cluster.start("search")
    assert _recall(cluster.address["search"]) == before


def _observation_state(path) -> dict[str, tuple]:
    """The observation projection in ``path``: bank → (counts, every state's bytes)."""
    from mneme.stores.observations_sqlite import SqliteObservationStore
    store = SqliteObservationStore(str(path))
    try:
        return {BANK: (store.counts(BANK), store.dump(BANK))}
    finally:
        store.close()


def test_replay_rebuilds_a_consolidation_replicas_observations(cluster, bus):
    """Each consolidation replica rebuilds its observation projection from the log into a
    new generation while it serves (GenerationService on its own address; two replicas
    at once, each under a builder group of its own), switches to it, decides on into it,
    drops the old one on command and keeps it across a restart."""
    data = cluster.root / "consolidation"
    assert not any(_wait_lag_zero(bus).values())
    before = _observation_state(data / "observations.db")
    assert before[BANK][0][2] > 0, before[BANK][0]  # observations to rebuild
    other = cluster.add("consolidation")
    cluster.start(other)
    assert not any(_wait_lag_zero(bus).values())
    replays = [subprocess.Popen([mneme_bin(), "replay", "--address", cluster.address[n]],
                                stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                                env=cluster.env(n)) for n in ("consolidation", other)]
    for r in replays:
        said = " ".join(r.communicate(timeout=300)[0].split())
        assert r.returncode == 0 and "generation 2: LIVE" in said, said[-3000:]
    # byte for byte, on both: every partition is rebuilt, not only those a replica holds
    assert _observation_state(data / "observations.g2.db") == before
    assert _observation_state(cluster.root / other / "observations.g2.db") == before
    cluster.stop(other)  # the bank's partition is (back) with the first replica
    # copies of processes no longer running: the one stopped now, and the search copy an
    # offline replay built in another data dir earlier in this module
    gone = tuple((d / "replica-id").read_text().strip()
                 for d in (cluster.root / other, cluster.root / "elsewhere")
                 if (d / "replica-id").exists())
    # it decides on into generation 2; generation 1 stays as it was
    with MnemeClient(cluster.address["ingest"]) as m:
        conv = next(c for c in locomo.load(conversation_file()) if c["sample_id"] == BANK)
        more = locomo.sessions(conv)[SESSIONS]
        assert m.retain(BANK, more.items, request_id="more").operation.state == 3
    assert not any(_wait_lag_zero(bus, gone=gone).values())
    after = _observation_state(data / "observations.g2.db")
    assert after[BANK][0][0] > before[BANK][0][0], (after[BANK][0], before[BANK][0])
    assert _observation_state(data / "observations.db") == before
    dropped = subprocess.run([mneme_bin(), "generations", "drop", "1", "--address",
                              cluster.address["consolidation"]], timeout=60,
                             capture_output=True, text=True, env=cluster.env("consolidation"))
    assert dropped.returncode == 0, (dropped.stdout + dropped.stderr)[-3000:]
    assert not (data / "observations.db").exists()
    # a restart opens the live generation's file and decides on into it
    cluster.stop("consolidation")
    cluster.start("consolidation")
    with MnemeClient(cluster.address["ingest"]) as m:
        again = locomo.sessions(conv)[SESSIONS + 1]
        assert m.retain(BANK, again.items, request_id="again").operation.state == 3
    assert not any(_wait_lag_zero(bus, gone=gone).values())
    last = _observation_state(data / "observations.g2.db")
    assert last[BANK][0][0] > after[BANK][0][0], (last[BANK][0], after[BANK][0])
    assert not (data / "observations.db").exists()
