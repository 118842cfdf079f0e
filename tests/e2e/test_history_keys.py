"""Reading the history from outside, on a real ``mneme up`` (MNEME_AUTH_MODE=api_key): the
embedded log file holds no user content in the clear; the SDK opener, with a key of the
``history`` scope, decrypts every document's RetainRequested and FactsExtracted through
KeyService.BatchGetDataKeys (read and write keys are refused); after DeleteDocument the
deleted document's records stay erased for any opener, the other document's still open."""

from __future__ import annotations

import grpc
import pytest
from typer.testing import CliRunner

from mneme.bus import ALL_TOPICS, INTAKE, MEMORY, REFLECT
from mneme.bus.sqlite_log import SqliteEventLog
from mneme.cli import app
from mneme.client import MnemeClient
from mneme.events.v1 import events_pb2 as ev
from mneme.ports import Record
from tests.e2e.server import Server

MARKER = "415-555-0171"
DOCS = {"phone": f"Alice said her new phone number is {MARKER} since she moved to Lisbon.",
        "tea": "Bob drinks green tea every morning before he goes running in the park."}


def _create_key(data_dir, bank: str, scope: str) -> str:
    out = CliRunner().invoke(app, ["keys", "create", "--bank", bank, "--scope", scope,
                                   "--data-dir", str(data_dir)])
    assert out.exit_code == 0, out.output
    return out.stdout.strip().splitlines()[-1]


def _records(data_dir) -> list[Record]:
    """Every record of the embedded log, as stored (raw adapter: nothing opened)."""
    log = SqliteEventLog(data_dir / "log.db")
    out = []
    try:
        for topic in ALL_TOPICS:
            for p in range(log.partitions(topic)):
                offset = 0
                while batch := log.read(topic, p, offset, 500):
                    out += batch
                    offset = batch[-1].offset + 1
    finally:
        log.close()
    return out


def _raw(r: Record) -> bytes:
    return r.value + "".join(f"{k}={v}" for k, v in r.headers.items()).encode()


def _content(events) -> dict[str, dict[str, list[str]]]:
    """document id → {"items": retained contents, "facts": fact texts} of opened events."""
    out: dict[str, dict[str, list[str]]] = {d: {"items": [], "facts": []} for d in DOCS}
    for e in events:
        if isinstance(e.message, ev.RetainRequested):
            for item in e.message.items:
                if item.document_id in out and item.content:
                    out[item.document_id]["items"].append(item.content)
        elif isinstance(e.message, ev.FactsExtracted):
            for f in e.message.facts:
                if f.document_id in out and f.text:
                    out[f.document_id]["facts"].append(f.text)
    return out


@pytest.fixture(scope="module")
def node(tmp_path_factory):
    data = tmp_path_factory.mktemp("history") / "data"
    keys = {name: _create_key(data, bank, scope) for name, bank, scope in (
        ("admin", "*", "write"), ("reader", "alice", "read"), ("writer", "alice", "write"),
        ("history", "alice", "history"), ("bob_history", "bob", "history"),
        ("models_history", "models", "history"))}
    srv = Server(data, env={"MNEME_AUTH_MODE": "api_key"}).start()
    yield srv, keys
    srv.stop()


def test_history_is_sealed_opens_with_the_history_scope_and_stays_erased(node):
    srv, keys = node
    with MnemeClient(srv.address, timeout=300, api_key=keys["admin"]) as admin:
        admin.upsert_bank("alice")
        for doc, text in DOCS.items():
            op = admin.retain("alice", [{"content": text, "document_id": doc}]).operation
            assert op.state == 3, op  # SUCCEEDED: its facts are on the log

    stored = _records(srv.data_dir)
    kinds = {r.headers["ce_type"].rsplit(".", 1)[1] for r in stored}
    assert {"RetainRequested", "FactsExtracted"} <= kinds
    assert not [r for r in stored if MARKER.encode() in _raw(r)]
    assert not [r for r in stored if b"green tea" in _raw(r)]
    for name in ("log.db", "log.db-wal"):  # nor anywhere in the file's pages
        path = srv.data_dir / name
        assert not path.exists() or MARKER.encode() not in path.read_bytes(), name

    history = [r for r in stored if r.topic in (INTAKE, MEMORY) and r.key == "alice"]
    for name in ("reader", "writer", "bob_history"):
        with MnemeClient(srv.address, timeout=60, api_key=keys[name]) as m:
            with pytest.raises(grpc.RpcError) as e:
                m.history_opener().open_all(history)
            assert e.value.code() == grpc.StatusCode.PERMISSION_DENIED, name

    with MnemeClient(srv.address, timeout=60, api_key=keys["history"]) as m:
        opener = m.history_opener()
        opened = opener.open_all(history)
        got = _content(opened)
        for doc, text in DOCS.items():
            assert got[doc]["items"] == [text], doc
            assert got[doc]["facts"], doc
        assert any(MARKER in t for t in got["phone"]["items"] + got["phone"]["facts"])
        assert not any(e.erased for e in opened)
        calls = opener.keys.calls
        assert calls <= 2  # a batch per bank and 1000 ids (and the BankUpserted needs none)

        with MnemeClient(srv.address, timeout=300, api_key=keys["admin"]) as admin:
            assert admin.delete_document("alice", "phone").state == 3

        # The keys were destroyed before DeleteDocument was appended: a fresh opener (and
        # the first one once its cache is dropped) finds the document erased.
        after = _records(srv.data_dir)
        history = [r for r in after if r.topic in (INTAKE, MEMORY) and r.key == "alice"]
        opener.keys.forget()
        for o in (m.history_opener(), opener):
            events = o.open_all(history)
            got = _content(events)
            assert got["phone"] == {"items": [], "facts": []}
            assert got["tea"]["items"] == [DOCS["tea"]] and got["tea"]["facts"]
            assert not [e for e in events if MARKER.encode() in e.record.value]
            retains = [e.message for e in events if isinstance(e.message, ev.RetainRequested)
                       and e.message.items and e.message.items[0].document_id == "phone"]
            assert retains and all([x.reason for x in r.rejected_items] == ["erased"]
                                   for r in retains)
            assert sum(e.erased for e in events) >= 2  # the item and its facts
        # the server's own projections no longer hold the document either
        assert all(x.document_id != "phone" for x in m.list_memories("alice"))


def test_an_answer_quoting_a_mental_model_is_erased_with_the_models_document(node):
    """A reflect answered from a mental model cites the model, not its facts, yet quotes
    them: after DeleteDocument of those facts' document, the ReflectionRecorded on the
    history opens erased like the refresh it quoted."""
    srv, keys = node
    secret = "Zorblax-7731"
    with MnemeClient(srv.address, timeout=300, api_key=keys["admin"]) as m:
        m.upsert_bank("models")
        m.retain("models", [{"content": f"Zoe adopted a cat named {secret} in May.",
                             "document_id": "pets"}])
        made = m.create_mental_model("models", "Zoe's pets", "Which pets does Zoe have?")
        assert secret in m.refresh_mental_model("models", made.id).content
        answer = m.reflect("models", "Which pets does Zoe have?")
        assert secret in answer.text and list(answer.sources.mental_models) == [made.id]
        assert m.delete_document("models", "pets").state == 3

    recs = [r for r in _records(srv.data_dir) if r.topic == REFLECT and r.key == "models"]
    with MnemeClient(srv.address, timeout=60, api_key=keys["models_history"]) as m:
        events = m.history_opener().open_all(recs)
    assert [e.ce_type.rsplit(".", 1)[1] for e in events] == ["ReflectionRecorded"] * 2
    assert all(e.record_erased for e in events), [e.message for e in events]
    assert not [e for e in events if secret.encode() in e.record.value]


def test_a_banks_name_and_missions_open_with_the_history_scope_and_stay_erased(node):
    """BankUpserted's display name and missions are sealed under the bank's key
    (``bank#<gen>``): the log holds none of them, the recipe's opener restores them with
    the bank's history key, and after DeleteBank they stay erased (the settings readable)."""
    srv, keys = node
    mission = "MISSION-BOB-MARKER about Wexmoor"
    with MnemeClient(srv.address, timeout=300, api_key=keys["admin"]) as admin:
        admin.upsert_bank("bob", "Bob of Wexmoor", retain_mission=mission, skepticism=5)
        admin.update_bank("bob", reflect_mission=f"Reflect: {mission}")
    stored = [r for r in _records(srv.data_dir) if r.key == "bob" and r.topic == INTAKE
              and r.headers["ce_type"].endswith(".BankUpserted")]
    assert len(stored) == 2 and not [r for r in stored if b"Wexmoor" in _raw(r)]
    assert all(ev.BankUpserted.FromString(r.value).seal.keys[0].startswith("bank#")
               for r in stored)
    with MnemeClient(srv.address, timeout=60, api_key=keys["bob_history"]) as m:
        opened = m.history_opener().open_all(stored)
        assert [(e.message.display_name, e.message.config.retain_mission,
                 e.message.config.reflect_mission, e.message.config.skepticism, e.erased)
                for e in opened] == [("Bob of Wexmoor", mission, "", 5, 0),
                                     ("", mission, f"Reflect: {mission}", 5, 0)]  # masked
        with MnemeClient(srv.address, timeout=300, api_key=keys["admin"]) as admin:
            admin.delete_bank("bob")
        again = m.history_opener().open_all(stored)
        assert [(e.message.display_name, e.message.config.retain_mission,
                 e.message.config.skepticism, e.erased, e.record_erased) for e in again] == \
            [("", "", 5, 1, False)] * 2
