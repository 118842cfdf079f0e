"""Crypto-shredding in the distributed topology: the five services as OS processes on a
Kafka-protocol broker (tansu), their keys on the compacted key topic. User content is
sealed on every topic (a raw consumer reading everything from offset 0 finds none of
it); a key store of its own, over the same topic and master key, opens what is live;
DeleteDocument makes that document's records unreadable while the other document's
still open, and DeleteBank makes nothing of the bank open any more."""

from __future__ import annotations

import asyncio
import base64
import time

import pytest

from mneme.bus import DLQ, KEYS, MANAGED_TOPICS, codec
from mneme.bus.sealing import ERASED_HEADER, SEALING_TYPES, Sealer
from mneme.client import MnemeClient
from mneme.keys import Keyring, LocalKms
from mneme.ports import Record
from tests.integration.cluster import Cluster
from tests.integration.conftest import KAFKA_TEST_ENV, KAFKA_TEST_OPTIONS

pytestmark = pytest.mark.slow

BANK = "erasure-a"
PHONE = "415-555-0142"           # in document d1 only
CITY = "Walla Walla"             # in document d2 only
MISSION = "Wexmoor"              # in the bank's name and missions only
D1 = [{"content": f"Dana: my new phone number is {PHONE}, call me after six.",
       "document_id": "d1"}]
D2 = [{"content": f"Dana: I moved to {CITY} in March and I love the vineyards there.",
       "document_id": "d2"}]


@pytest.fixture(scope="module")
def cluster(tansu, tmp_path_factory):
    c = Cluster(tmp_path_factory.mktemp("erasure"), tansu.url).start()
    yield c
    c.stop()


#: The key stores of the fresh sealers, closed with the module's logs: a leftover
#: background catch-up slowed every later Kafka test of the session (~10x).
_KEY_STORES: list = []


@pytest.fixture(scope="module")
def logs(tansu):
    from mneme.bus.logs import open_event_log
    opened = []

    def make():
        opened.append(open_event_log(tansu.url, **KAFKA_TEST_OPTIONS))
        return opened[-1]
    yield make
    for store in _KEY_STORES:  # their background catch-up first, then the logs it reads
        store.close()
    _KEY_STORES.clear()
    for log in reversed(opened):
        log.close()


def _raw_records(bootstrap: str, topics) -> list:
    """Every record of ``topics`` from offset 0, with a plain aiokafka consumer."""
    from aiokafka import AIOKafkaConsumer, TopicPartition

    async def read() -> list:
        c = AIOKafkaConsumer(bootstrap_servers=bootstrap, enable_auto_commit=False)
        await c.start()
        try:
            tps = [TopicPartition(t, p) for t in topics
                   for p in sorted(c.partitions_for_topic(t) or ())]
            c.assign(tps)
            await c.seek_to_beginning(*tps)
            out, idle = [], 0
            while idle < 3:
                batch = await c.getmany(timeout_ms=500)
                idle = 0 if batch else idle + 1
                for msgs in batch.values():
                    out.extend(msgs)
            return out
        finally:
            await c.stop()
    return asyncio.run(read())


def _opened(sealer: Sealer, raw) -> list[Record]:
    """The bank's sealed records (intake, memory), opened by ``sealer``."""
    out = []
    for m in raw:
        headers = {k: (v or b"").decode() for k, v in m.headers or ()}
        if headers.get("ce_type") not in SEALING_TYPES or headers.get("ce_subject") != BANK:
            continue
        rec = Record(m.topic, m.partition, m.offset, m.key.decode(), m.value, headers)
        out.append(sealer.open(rec))
    return out


def _texts(records: list[Record]) -> str:
    """Everything the opened records say, as text (the events decoded)."""
    return "\n".join(str(codec.decode(r).message) for r in records)


def _fresh_sealer(make_log) -> Sealer:
    from mneme.stores.keys_kafka import KafkaKeyStore
    master = base64.b64decode(KAFKA_TEST_ENV["MNEME_MASTER_KEY"])
    _KEY_STORES.append(KafkaKeyStore(make_log(), poll_s=0.2))
    return Sealer(Keyring(_KEY_STORES[-1], LocalKms(master)))


def _wait(predicate, timeout: float = 60.0):
    deadline = time.monotonic() + timeout
    while not (got := predicate()):
        if time.monotonic() > deadline:
            return got
        time.sleep(0.5)
    return got


def test_content_is_sealed_on_every_topic_and_deletions_shred_it(cluster, tansu, logs):
    with MnemeClient(cluster.address["ingest"], timeout=60) as m:
        m.upsert_bank(BANK, f"Dana of {MISSION}", retain_mission=f"Note {MISSION} trips",
                      reflect_mission=f"Answer as the {MISSION} guide")
        m.update_bank(BANK, observations_mission=f"Track {MISSION} visits")
        for n, items in enumerate((D1, D2)):
            r = m.retain(BANK, items, request_id=f"erasure-{n}")
            assert r.operation.state == 3, r.operation  # SUCCEEDED: searchable
    with MnemeClient(cluster.address["search"]) as s:
        found = " ".join(x.memory.text for x in s.recall(BANK, "Dana phone number").results)
        assert PHONE in found
        assert any(CITY in x.text for x in s.list_memories(BANK, document_id="d2"))

    # ingest's bank catalog opened the sealed name and missions (every service's catalog
    # reads the same records: one that could not open them would dead-letter them)
    with MnemeClient(cluster.address["ingest"]) as m:
        bank = m.get_bank(BANK)
        assert (bank.display_name, bank.config.observations_mission) == (
            f"Dana of {MISSION}", f"Track {MISSION} visits")

    # nowhere on the log in the clear: not on any topic, not in keys or headers
    raw = _raw_records(tansu.bootstrap, MANAGED_TOPICS)
    assert {m.topic for m in raw} >= {"mneme.intake.v1", "mneme.memory.v1", KEYS}
    for secret in (PHONE.encode(), CITY.encode(), MISSION.encode()):
        leaks = [(m.topic, m.offset) for m in raw
                 if secret in (m.value or b"") or secret in (m.key or b"")
                 or any(secret in (v or b"") for _, v in m.headers or ())]
        assert not leaks, (secret, leaks)

    # a process of its own (key store over the same topic, same master key) opens both
    before = _fresh_sealer(logs)
    opened = _opened(before, raw)
    assert opened and PHONE in _texts(opened) and CITY in _texts(opened)
    assert f"Note {MISSION} trips" in _texts(opened)

    with MnemeClient(cluster.address["ingest"], timeout=60) as m:
        m.delete_document(BANK, "d1")
    with MnemeClient(cluster.address["search"]) as s:
        assert _wait(lambda: not list(s.list_memories(BANK, document_id="d1")))
        found = " ".join(x.memory.text for x in s.recall(BANK, "Dana phone number").results)
        assert PHONE not in found
        assert any(CITY in x.text for x in s.list_memories(BANK, document_id="d2"))

    raw = _raw_records(tansu.bootstrap, MANAGED_TOPICS)
    after = _opened(_fresh_sealer(logs), raw)
    assert PHONE not in _texts(after) and CITY in _texts(after)
    assert any(r.headers.get(ERASED_HEADER) for r in after)
    # the process that had d1's keys cached learns of the destruction and drops them
    assert _wait(lambda: PHONE not in _texts(_opened(before, raw)), 10)
    assert CITY in _texts(_opened(before, raw))

    with MnemeClient(cluster.address["ingest"], timeout=60) as m:
        m.delete_bank(BANK)
    raw = _raw_records(tansu.bootstrap, MANAGED_TOPICS)
    gone = _opened(_fresh_sealer(logs), raw)
    assert gone and CITY not in _texts(gone) and PHONE not in _texts(gone)
    assert MISSION not in _texts(gone)
    assert _wait(lambda: CITY not in _texts(_opened(before, raw)), 10)
    for secret in (PHONE.encode(), CITY.encode(), MISSION.encode()):
        assert not [m for m in raw if secret in (m.value or b"")]
    assert not [m for m in raw if m.topic == DLQ and m.key == BANK.encode()]


def test_the_readmes_history_snippet_runs_against_the_topics(cluster, tansu):
    """README "Reading the history": its consumer, as written (only the addresses and its
    bank put in), prints the facts of its bank from offset 0 and skips other banks."""
    import re
    import subprocess
    import sys
    from pathlib import Path

    readme = (Path(__file__).resolve().parents[2] / "README.md").read_text()
    section = readme[readme.index("## Reading the history (external consumers)"):]
    code = re.search(r"```python\n(.*?)```", section, re.S).group(1)
    code = (code.replace('"kafka:9092"', repr(tansu.bootstrap))
            .replace('"mneme:50051"', repr(cluster.address["ingest"]))
            .replace('BANKS = {"alice"}', 'BANKS = {"readme-a"}'))
    with MnemeClient(cluster.address["ingest"], timeout=60) as m:
        for bank, text in (("readme-a", "Dana: my locker code is 4411."),
                           ("readme-b", "Dana: my bike is red.")):
            m.upsert_bank(bank)
            assert m.retain(bank, [{"content": text, "document_id": "d"}]).operation.state == 3
    proc = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True,
                            env={**__import__("os").environ, "HISTORY_KEY": "open-mode"})
    try:  # the consumer runs until stopped: its first line (bounded: never a hang)
        import select
        ready, _, _ = select.select([proc.stdout], [], [], 120)
        line = proc.stdout.readline() if ready else "(no output in 120 s)\n"
    finally:
        proc.kill()
        rest = proc.communicate(timeout=30)[0]
    assert line.strip() == "d Dana: my locker code is 4411.", line + rest
    assert "bike" not in rest and "Traceback" not in rest, rest
