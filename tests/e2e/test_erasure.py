"""Erasure you can prove, embedded: after DeleteDocument nothing of the document can be
read back from the event log (every record, raw or opened with every key there is), the
key file, the SQLite stores, the APIs, or a replay; DeleteBank likewise for a bank."""

from __future__ import annotations

import json
import sqlite3
import time
from array import array
from pathlib import Path

import pytest

from mneme.bus import DLQ
from mneme.bus.sealing import Sealer
from mneme.events.v1 import events_pb2 as ev
from mneme.bus.codec import decode
from mneme.keys import Keyring, local_kms
from mneme.ports import Record
from mneme.stores.keys_sqlite import SqliteKeyStore
from tests.e2e.server import Server

MARKER = "415-555-0187"
SECRET = [f"Alice said her new phone number is {MARKER}; she wants a call on Friday.",
          f"Alice repeated it: {MARKER}, and said to text before calling."]
KEEP = ["Bob bought a red bicycle in Paris last summer.",
        "Bob rides his red bicycle to work every morning."]


def _records(data: Path) -> list[Record]:
    db = sqlite3.connect(f"file:{data / 'log.db'}?mode=ro", uri=True)
    try:
        return [Record(topic=t, partition=p, offset=o, key=k, value=bytes(v),
                       headers=json.loads(h))
                for t, p, o, k, v, h in db.execute(
                    "SELECT topic, partition, offset, key, value, headers FROM records "
                    "ORDER BY topic, partition, offset")]
    finally:
        db.close()


class Everything:
    """An external consumer holding every key there is (the data dir's key file and
    master key): what it can open of the log."""

    def __init__(self, data: Path):
        self.store = SqliteKeyStore(str(data / "keys.db"))
        self.sealer = Sealer(Keyring(self.store, local_kms(data)))
        self.data = data

    def opened(self) -> list:
        out = []
        for rec in _records(self.data):
            rec = self.sealer.open(rec)
            out.append((rec, decode(rec).message))
        return out

    def close(self) -> None:
        self.store.close()


def _files(data: Path) -> dict[Path, bytes]:
    return {p: p.read_bytes() for p in data.rglob("*") if p.is_file()}


def _texts(m, bank: str) -> str:
    out = [x.text for x in m.list_memories(bank)]
    out += [o.text for o in m.list_observations(bank)]
    for q in ("What is Alice's phone number?", "Alice call Friday", MARKER):
        for budget in ("low", "high"):
            r = m.recall(bank, q, budget=budget, max_tokens=8192,
                         types=["world", "experience", "observation"])
            out += [x.memory.text for x in r.results]
            out += [e.name for x in r.results for e in x.memory.entities]
    return "\n".join(out)


def _secret_and_kept(m, bank: str) -> None:
    """A bank with the secret document and the kept one, retained and consolidated."""
    m.upsert_bank(bank)
    m.retain(bank, [{"content": c, "document_id": "secret"} for c in SECRET]
             + [{"content": c, "document_id": "keep"} for c in KEEP])
    assert m.consolidate(bank).state == 3


@pytest.fixture(scope="module")
def erased(tmp_path_factory):
    """A bank with a secret and a kept document, extracted, consolidated and recalled;
    the secret document then deleted. Yields (server, facts before, embeddings of the
    secret facts)."""
    data = tmp_path_factory.mktemp("erasure") / "data"
    server = Server(data).start()
    try:
        with server.client() as m:
            _secret_and_kept(m, "er")
            assert MARKER in _texts(m, "er")  # recalled, and in an observation
            assert any(MARKER in o.text for o in m.list_observations("er"))
            ext = Everything(data)
            try:
                facts = [f for _, msg in ext.opened() if isinstance(msg, ev.FactsExtracted)
                         for f in msg.facts]
            finally:
                ext.close()
            vectors = [array("f", f.embedding).tobytes() for f in facts
                       if f.document_id == "secret"]
            assert vectors and any(MARKER in f.text for f in facts)
            # a mental model refreshed from it (twice: two revisions quote it) and one a
            # user wrote
            phone = m.create_mental_model("er", "The phone", "What phone number was given?")
            for _ in range(2):
                assert MARKER in m.refresh_mental_model("er", phone.id).content
            m.create_mental_model("er", "Bob", "What does Bob ride?", content=KEEP[1])
            op = m.delete_document("er", "secret")
            assert op.state == 3, op
        yield server, facts, vectors
    finally:
        server.stop()


def test_nothing_of_the_deleted_document_is_in_any_file_of_the_data_dir(erased):
    server, _, vectors = erased
    files = _files(server.data_dir)
    assert server.data_dir / "log.db" in files and server.data_dir / "keys.db" in files
    for path, data in files.items():
        assert MARKER.encode() not in data, path
        assert b"Alice" not in data, path  # an entity only the deleted document named
        for v in vectors:  # the float32 bytes of every secret fact's embedding
            assert v not in data and v[:32] not in data, path


def test_a_consumer_with_every_key_opens_the_other_document_but_nothing_of_the_deleted(erased):
    server, facts, _ = erased
    ext = Everything(server.data_dir)
    try:
        opened = ext.opened()
    finally:
        ext.close()
    assert MARKER not in "\n".join(str(msg) for _, msg in opened)
    kept = {f.text for _, msg in opened if isinstance(msg, ev.FactsExtracted)
            for f in msg.facts}
    assert kept == {f.text for f in facts if f.document_id == "keep"}
    retained = [i.content for _, msg in opened if isinstance(msg, ev.RetainRequested)
                for i in msg.items if i.content]
    assert sorted(retained) == sorted(KEEP)
    erased_records = [r for r, _ in opened if r.headers.get("mneme-erased")]
    assert erased_records  # the deleted document's records are there, undecryptable


def test_recall_memories_and_observations_return_nothing_of_it(erased):
    server, _, _ = erased
    with server.client() as m:
        texts = _texts(m, "er")
        assert MARKER not in texts
        assert "red bicycle" in texts  # the other document is untouched
        assert not list(m.list_memories("er", document_id="secret"))


def _models(m, bank: str) -> list:
    return [(x.display_name, x.content, list(x.based_on), x.revision,
             [(r.revision, r.content, list(r.based_on)) for r in m.mental_model_revisions(bank, x.id)])
            for x in m.list_mental_models(bank)]


def test_mental_models_keep_nothing_of_it(erased):
    server, _, _ = erased
    with server.client() as m:
        models = {x.display_name: x for x in m.list_mental_models("er")}
        phone, bob = models["The phone"], models["Bob"]
        # both refreshes quoted the document: nothing is left of them
        assert (phone.content, list(phone.based_on), phone.revision) == ("", [], 0)
        assert phone.is_stale and not m.mental_model_revisions("er", phone.id)
        assert bob.content == KEEP[1] and bob.revision == 1  # a user's content stays
        r = m.reflect("er", "What phone number was given?")
        assert MARKER not in r.text
        again = m.refresh_mental_model("er", phone.id)
        assert MARKER not in again.content and again.revision == 1


def test_a_replay_brings_nothing_of_it_back(erased):
    server, facts, _ = erased
    with server.client() as m:
        models = _models(m, "er")
    server.replay()
    with server.client() as m:
        texts = _texts(m, "er")
        assert MARKER not in texts
        assert {x.text for x in m.list_memories("er")} == \
            {f.text for f in facts if f.document_id == "keep"}
        assert _models(m, "er") == models  # the sealed refreshes are skipped, as erased
    for path, data in _files(server.data_dir).items():
        assert MARKER.encode() not in data, path


def test_deleting_the_bank_leaves_nothing_of_it_decryptable(erased):
    server, _, _ = erased
    with server.client() as m:
        m.upsert_bank("gone")
        m.retain("gone", [{"content": f"Carol's locker code is 9931-{i}", "document_id": f"d{i}"}
                          for i in range(3)])
        m.delete_bank("gone")
    ext = Everything(server.data_dir)
    try:
        opened = ext.opened()
        assert ext.store.bank_key("gone") is None
    finally:
        ext.close()
    of_bank = [(r, msg) for r, msg in opened if r.key == "gone"]
    assert of_bank
    # looked for by words: digits alone turn up in the records' random hex trace ids
    # (a traceparent "…f3109931…" once failed this check in CI)
    assert "locker code" not in "\n".join(str(msg) for _, msg in of_bank)
    for path, data in _files(server.data_dir).items():
        assert b"locker code" not in data, path


def test_a_bank_with_erasure_none_writes_plaintext_until_it_changes(erased):
    server, _, _ = erased
    with server.client() as m:
        m.upsert_bank("plain", erasure="none")
        assert m.get_bank("plain").config.erasure == "none"
        m.retain("plain", [{"content": "Dave's gate code is 7741-plain.", "document_id": "d1"}])
        m.update_bank("plain", erasure="crypto_shred")
        m.retain("plain", [{"content": "Dave's new gate code is 5530-sealed.",
                            "document_id": "d2"}])
        assert {"7741-plain", "5530-sealed"} <= {w.strip(".") for x in m.list_memories("plain")
                                                  for w in x.text.split()}
    log = (server.data_dir / "log.db").read_bytes() + (
        (server.data_dir / "log.db-wal").read_bytes()
        if (server.data_dir / "log.db-wal").exists() else b"")
    assert b"7741-plain" in log and b"5530-sealed" not in log


def test_nothing_went_to_the_dead_letter_topic(erased):
    server, _, _ = erased
    assert [r for r in _records(server.data_dir) if r.topic == DLQ] == []


def _generations(m) -> dict[int, int]:
    return {g.generation: g.state for g in m.list_generations()}


def test_a_generation_retired_by_a_replay_keeps_nothing_a_later_deletion_removes(tmp_path):
    """A replay retires the previous generation's files; they must not outlive a deletion
    made after the switch (it reaches only the live generation's stores). Embedded, the
    retired files are deleted once the grace ends, and at the next start when the process
    died within it."""
    from mneme.v1 import generations_pb2
    G = generations_pb2.Generation
    data = tmp_path / "data"
    server = Server(data, env={"MNEME_RETIRE_GRACE_S": "0.5"}).start()
    try:
        with server.client() as m:
            _secret_and_kept(m, "rg")
            assert any(MARKER in o.text for o in m.list_observations("rg"))
            assert m.replay().state == G.LIVE
            deadline = time.monotonic() + 60
            while _generations(m) != {2: G.LIVE} and time.monotonic() < deadline:
                time.sleep(0.2)
            assert _generations(m) == {2: G.LIVE}
            assert not (data / "vectors").exists() and not (data / "text").exists()
            assert not any(data.glob("graph.db*")) and not any(data.glob("observations.db*"))
            assert m.delete_document("rg", "secret").state == 3
            assert MARKER not in _texts(m, "rg")
        for path, raw in _files(data).items():
            assert MARKER.encode() not in raw, path

        # A process that dies within the grace leaves the retired files; the next start
        # deletes them before it serves.
        server.stop()
        server.env["MNEME_RETIRE_GRACE_S"] = "3600"
        server.start()
        with server.client() as m:
            assert m.replay().state == G.LIVE
            assert _generations(m) == {2: G.RETIRED, 3: G.LIVE}
            assert (data / "vectors.g2").is_dir() and (data / "observations.g2.db").exists()
        server.kill()
        server.start()
        with server.client() as m:
            assert _generations(m) == {3: G.LIVE}
            texts = [x.text for x in m.list_memories("rg")]
            assert any("bicycle" in t for t in texts) and not any(MARKER in t for t in texts)
        assert not (data / "vectors.g2").exists() and not any(data.glob("observations.g2.db*"))
    finally:
        server.stop()


MISSION = "MISSION-BOB-MARKER"


def test_a_deleted_banks_name_and_missions_leave_no_trace_and_replay(tmp_path):
    """A bank's display name and missions (user text on BankUpserted) were in the clear
    on the log for ever, also after DeleteBank: they are sealed under the bank's key, so
    after the deletion no record or file holds them; UpdateBank's upserts too; a replay
    after the deletion goes LIVE and the projections (every bank catalog, search's
    documents) still get the other banks' names and missions, and the bank created again
    reads its new ones."""
    from mneme.v1 import generations_pb2
    data = tmp_path / "data"
    server = Server(data).start()
    try:
        with server.client() as m:
            m.upsert_bank("bob", f"Bob {MISSION} Wexmoor",
                          retain_mission=f"{MISSION} about Wexmoor",
                          observations_mission=f"Track {MISSION} Wexmoor trips",
                          reflect_mission=f"Answer as {MISSION} of Wexmoor", skepticism=4)
            m.update_bank("bob", reflect_mission=f"Answer again as {MISSION} of Wexmoor")
            m.update_bank("bob", display_name=f"Bobby {MISSION}")
            m.retain("bob", [{"content": KEEP[0], "document_id": "d1"}])
            bob = m.get_bank("bob")
            assert (bob.display_name, bob.config.reflect_mission, bob.config.skepticism) == (
                f"Bobby {MISSION}", f"Answer again as {MISSION} of Wexmoor", 4)
            m.upsert_bank("kept", "Kept bank", retain_mission="Keep the Lisbon trips",
                          store_documents=False)
            m.delete_bank("bob")
        raw = [r for r in _records(data) if r.key == "bob"]
        upserts = [r for r in raw if r.headers["ce_type"].endswith(".BankUpserted")]
        assert len(upserts) == 3
        for r in raw:
            assert MISSION.encode() not in r.value and b"Wexmoor" not in r.value, r.headers
        for path, content in _files(data).items():
            assert MISSION.encode() not in content and b"Wexmoor" not in content, path

        ext = Everything(data)  # every key there is opens the kept bank, not bob's
        try:
            opened = [(r, msg) for r, msg in ext.opened() if isinstance(msg, ev.BankUpserted)]
        finally:
            ext.close()
        assert [msg.display_name for r, msg in opened if r.key == "kept"] == ["Kept bank"]
        bobs = [(r, msg) for r, msg in opened if r.key == "bob"]
        assert [r.headers.get("mneme-erased") for r, _ in bobs] == ["1"] * 3
        assert all(m.config.skepticism == 4 and not m.display_name for _, m in bobs)

        server.replay()
        with server.client() as m:
            G = generations_pb2.Generation
            assert G.LIVE in _generations(m).values()
            assert [b.name for b in m.list_banks()] == ["banks/kept"]
            kept = m.get_bank("kept")
            assert (kept.display_name, kept.config.retain_mission,
                    kept.config.store_documents) == ("Kept bank", "Keep the Lisbon trips", False)
            m.upsert_bank("bob", "Bob again", retain_mission="New Wexmoor-free mission")
            assert m.get_bank("bob").config.retain_mission == "New Wexmoor-free mission"
        assert [r for r in _records(data) if r.topic == DLQ] == []
    finally:
        server.stop()
