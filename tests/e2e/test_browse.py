"""Entities, documents and tags (EntityService, DocumentService) through a real ``mneme up``
and the CLI groups ``mneme entities``, ``mneme documents`` and ``mneme tags``. Every count
and list is checked against what ListMemories / GetMemory say of the same bank."""

from __future__ import annotations

import json
from collections import Counter
from datetime import datetime, timezone

import grpc
import pytest
from typer.testing import CliRunner

from mneme import locomo
from mneme.cli import app
from mneme.client import field_violations
from tests.e2e.server import Server, conversation_file
from tests.waits import drained

BANK = "browse"
# a fixed set of items: documents with several items, tags on some, one item without a
# document id (its memories belong to no document)
ITEMS = [
    {"content": "Alice moved to Lisbon in May 2023. She works at Acme as a designer.",
     "document_id": "notes/alice", "tags": ["people", "work"]},
    {"content": "Alice and Bob hiked in Sintra with their dog Rex last weekend.",
     "document_id": "notes/alice", "tags": ["people", "trips"]},
    {"content": "Bob plays the cello in the Lisbon city orchestra.",
     "document_id": "notes/bob", "tags": ["people"]},
    {"content": "The quarterly report for Acme is due on 3 June 2024.",
     "document_id": "report-q2", "tags": ["work"]},
    {"content": "Carol visited Porto and met Bob at a jazz concert.", "tags": []},
]


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    s = Server(tmp_path_factory.mktemp("browse") / "data").start()
    with s.client() as m:
        m.upsert_bank(BANK)
        at = datetime(2024, 5, 1, tzinfo=timezone.utc)
        r = m.retain(BANK, [{**i, "timestamp": at} for i in ITEMS])
        assert r.operation.state == 3, r.operation  # SUCCEEDED
        conv = next(c for c in locomo.load(conversation_file()) if c["sample_id"] == "conv-26")
        m.upsert_bank("conv")
        r = m.retain("conv", locomo.sessions(conv)[0].items)
        assert r.operation.state == 3, r.operation
    yield s
    s.stop()


def cli(server, *args) -> str:
    out = CliRunner().invoke(app, [*args, "-a", server.address])
    assert out.exit_code == 0, out.output
    return out.stdout


def refused(call) -> grpc.RpcError:
    with pytest.raises(grpc.RpcError) as e:
        call()
    return e.value


def test_tags_count_the_memories_carrying_them(server):
    with server.client() as m:
        memories = list(m.list_memories(BANK))
        want = Counter(t for mem in memories for t in mem.tags)
        got = {t.tag: t.memory_count for t in m.list_tags(BANK)}
        assert got == dict(want) and set(got) == {"people", "work", "trips"}
        assert [t.tag for t in m.list_tags(BANK, page_size=1)] == sorted(want)  # paged
        err = refused(lambda: m.documents.ListTags(
            __import__("mneme.v1.documents_pb2", fromlist=["x"]).ListTagsRequest(
                parent=f"banks/{BANK}", page_token="bogus")))
        assert err.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert [f for f, _ in field_violations(err)] == ["page_token"]
        assert refused(lambda: list(m.list_tags("nope"))).code() == grpc.StatusCode.NOT_FOUND
    listed = json.loads(cli(server, "tags", "list", BANK, "--json"))
    assert {t["tag"]: t["memory_count"] for t in listed} == dict(want)
    assert "people" in cli(server, "tags", "list", BANK)


def test_documents_list_their_memories_and_go_with_delete_document(server):
    with server.client() as m:
        memories = list(m.list_memories(BANK))
        want = Counter(mem.document_id for mem in memories if mem.document_id)
        docs = list(m.list_documents(BANK))
        assert {d.document_id: d.memory_count for d in docs} == dict(want)
        assert [d.document_id for d in docs] == sorted(want) == ["notes/alice", "notes/bob",
                                                               "report-q2"]
        assert docs[0].name == f"banks/{BANK}/documents/notes/alice"
        doc = m.get_document(BANK, "notes/alice")
        assert sorted(x.id for x in doc.memories) == sorted(
            x.id for x in m.list_memories(BANK, document_id="notes/alice"))
        assert doc.memory_count == len(doc.memories) == want["notes/alice"]
        # retained once: created and updated by that retain (its time, not the items')
        [rev] = doc.history
        op = m.get_operation(rev.operation.split("/", 1)[1])
        assert doc.update_time == doc.create_time == rev.retain_time == op.create_time
        assert doc.revision_count == 1 and rev.item_count == 2 and doc.text_stored
        assert doc.original_text == "\n\n".join(i["content"] for i in ITEMS
                                                 if i.get("document_id") == "notes/alice")
        err = refused(lambda: m.get_document(BANK, "no-such-doc"))
        assert err.code() == grpc.StatusCode.NOT_FOUND
        err = refused(lambda: m.get_document(BANK, ""))
        assert err.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert [f for f, _ in field_violations(err)] == ["document_id"]

    got = json.loads(cli(server, "documents", "get", BANK, "notes/bob", "--json"))
    assert got["document_id"] == "notes/bob" and got["memory_count"] == want["notes/bob"]
    assert got["update_time"].endswith("Z") and "T" in got["update_time"]  # ISO, not epoch
    assert {mem["id"] for mem in got["memories"]} == {
        mem.id for mem in memories if mem.document_id == "notes/bob"}
    assert "report-q2" in cli(server, "documents", "list", BANK)
    out = CliRunner().invoke(app, ["documents", "get", BANK, "nope", "-a", server.address])
    assert out.exit_code == 2 and "NOT_FOUND" in out.output

    with server.client() as m:
        op = m.delete_document(BANK, "report-q2")
        assert op.state == 3, op
        assert [d.document_id for d in m.list_documents(BANK)] == ["notes/alice", "notes/bob"]
        assert refused(lambda: m.get_document(BANK, "report-q2")).code() == grpc.StatusCode.NOT_FOUND


def test_entities_agree_with_the_memories_that_mention_them(server):
    with server.client() as m:
        memories = list(m.list_memories("conv"))
        mentioned = Counter(e.id for mem in memories for e in mem.entities)
        entities = list(m.list_entities("conv"))
        assert [e.id for e in entities] == sorted(e.id for e in entities)
        assert [e.id for e in m.list_entities("conv", page_size=3)] == [e.id for e in entities]
        assert {e.id: e.mention_count for e in entities} == dict(mentioned)
        caroline = next(e for e in entities if e.display_name == "Caroline")
        assert caroline.kind == "PERSON" and "caroline" in caroline.aliases

        got = m.get_entity("conv", caroline.id)
        assert got.mention_count == mentioned[caroline.id] == len(got.memories)
        with_her = {mem.id: mem for mem in memories if caroline.id in {e.id for e in mem.entities}}
        assert {n.rsplit("/", 1)[-1] for n in got.memories} == set(with_her)
        shared = Counter(e.id for mem in with_her.values() for e in mem.entities
                         if e.id != caroline.id)
        assert got.neighbours and all(
            n.shared_memories == shared[n.entity.rsplit("/", 1)[-1]] for n in got.neighbours)
        assert [n.shared_memories for n in got.neighbours] == sorted(
            (n.shared_memories for n in got.neighbours), reverse=True)

        err = refused(lambda: m.get_entity("conv", "not-a-uuid"))
        assert err.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert [f for f, _ in field_violations(err)] == ["name"]
        err = refused(lambda: m.get_entity("conv", "00000000-0000-0000-0000-000000000000"))
        assert err.code() == grpc.StatusCode.NOT_FOUND

    listed = json.loads(cli(server, "entities", "list", "conv", "--json"))
    assert {e["id"]: e.get("mention_count", 0) for e in listed} == dict(mentioned)
    one = json.loads(cli(server, "entities", "get", "conv", caroline.id, "--json"))
    assert one["display_name"] == "Caroline" and len(one["memories"]) == len(with_her)
    assert caroline.id in cli(server, "entities", "list", "conv", "--limit", "1000")  # full ids
    two = cli(server, "entities", "list", "conv", "--limit", "2")
    assert entities[0].id in two and entities[1].id in two and entities[2].id not in two


def test_memories_cli_round_trip(server):
    with server.client() as m:
        want = [x.id for x in m.list_memories(BANK, document_id="notes/bob")]
    listed = json.loads(cli(server, "memories", "list", BANK, "--document-id", "notes/bob",
                            "--json"))
    assert [x["id"] for x in listed] == want and want
    assert want[0] in cli(server, "memories", "list", BANK)  # full ids in the table
    one = json.loads(cli(server, "memories", "get", BANK, want[0], "--json"))
    assert one["id"] == want[0] and one["document_id"] == "notes/bob"
    assert one["mentioned_at"] == "2024-05-01T00:00:00Z"  # ISO time
    # the result on stdout, so a script's $(mneme memories delete …) has it
    assert "deleted memory" in CliRunner().invoke(
        app, ["memories", "delete", BANK, want[0], "-a", server.address]).stdout
    out = CliRunner().invoke(app, ["memories", "get", BANK, want[0], "-a", server.address])
    assert out.exit_code == 2 and "NOT_FOUND" in out.output
    again = CliRunner().invoke(app, ["memories", "delete", BANK, want[0], "-a", server.address])
    assert again.exit_code == 1 and "memory not found" in again.output


def test_cli_prints_text_with_brackets_as_it_is(server):
    """Stored text, ids and server messages are data, not console markup: brackets that
    look like markup tags (valid or not) print as they are, in tables and errors, and a
    control character shows as its escape instead of acting on the terminal."""
    text = "Frank said [bold]hello[/bold] and closed [/x] the tag [red]x :100: \x1b[2J"
    with server.client() as m:
        m.upsert_bank("marks")
        m.retain("marks", [{"content": text, "document_id": "[/d]"}])
    wide = {"COLUMNS": "400"}
    for args in (["memories", "list", "marks"], ["recall", "marks", "Frank hello"],
                 ["documents", "list", "marks"]):
        out = CliRunner().invoke(app, [*args, "-a", server.address], env=wide)
        assert out.exit_code == 0, out.output
        assert ("[/d]" if args[0] == "documents" else "[red]x :100: \\x1b[2J") in out.output, args
        assert "\x1b" not in out.output  # an escape sequence stored is shown, not run
    out = CliRunner().invoke(app, ["documents", "get", "marks", "[/x]", "-a", server.address])
    assert out.exit_code == 2 and "NOT_FOUND" in out.output and "[/x]" in out.output
    out = CliRunner().invoke(app, ["banks", "create", "Not An Id", "-a", server.address])
    assert out.exit_code == 2 and "[a-z0-9]" in out.output


def test_observations_cli_round_trip(server):
    with server.client() as m:
        drained(m, "conv")  # consolidation has run over the bank's facts
        want = {o.id: o for o in m.list_observations("conv")}
    assert want
    listed = json.loads(cli(server, "observations", "list", "conv", "--json"))
    assert {o["id"] for o in listed} == set(want)
    scopes = json.loads(cli(server, "observations", "scopes", "conv", "--json"))
    assert sum(s["observations"] for s in scopes) == len(want)
    first = next(iter(want.values()))
    got = json.loads(cli(server, "observations", "get", "conv", first.id, "--json"))
    assert got["text"] == first.text and got["evidence"]
    assert first.id in cli(server, "observations", "list", "conv", "--global")
    assert "succeeded" in CliRunner().invoke(
        app, ["observations", "consolidate", "conv", "-a", server.address]).output
    assert "succeeded" in CliRunner().invoke(
        app, ["observations", "clear", "conv", "-a", server.address]).output
    assert json.loads(cli(server, "observations", "list", "conv", "--json")) == []


def test_bank_profile_counts_agree_with_the_lists(server):
    with server.client() as m:
        m.update_bank(BANK, reflect_mission="Help with notes.", skepticism=4)
        m.create_directive(BANK, "Be brief.")
        m.create_mental_model(BANK, "Bob", "What does Bob play?")
        p = m.bank_profile(BANK)
        stats = m.bank_stats(BANK)
        assert p.bank.name == f"banks/{BANK}" and p.bank.config.reflect_mission == "Help with notes."
        assert p.bank.config.skepticism == 4
        assert (p.stats.facts, p.stats.entities) == (stats.facts, stats.entities)
        assert p.documents == len(list(m.list_documents(BANK)))
        assert p.directives == len(list(m.list_directives(BANK))) == 1
        assert p.mental_models == len(list(m.list_mental_models(BANK))) == 1
        last = p.last_activity_time.ToDatetime(timezone.utc)
        assert last >= max(o.update_time.ToDatetime(timezone.utc) for o in m.list_operations(BANK))
        assert refused(lambda: m.bank_profile("nope")).code() == grpc.StatusCode.NOT_FOUND
    got = json.loads(cli(server, "banks", "profile", BANK, "--json"))
    assert got["directives"] == "1" and got["bank"]["config"]["reflect_mission"] == "Help with notes."
    assert got["last_activity_time"].endswith("Z")
    assert "mental models 1" in cli(server, "banks", "profile", BANK)
