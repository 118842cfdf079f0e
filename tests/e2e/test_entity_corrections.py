"""MergeEntities and SplitEntity through a real ``mneme up`` and the CLI (``mneme entities
merge`` / ``split``): the graph's answer after each correction, the resolver's answer to
the next retain, validation, and ``mneme replay`` rebuilding the same entities from the log."""

from __future__ import annotations

import json
from datetime import datetime, timezone

import grpc
import pytest
from typer.testing import CliRunner

from mneme.cli import app
from mneme.client import field_violations
from mneme.v1 import entities_pb2
from tests.e2e.server import Server

BANK = "fam"
AT = datetime(2024, 3, 2, tzinfo=timezone.utc)
# One person under two names the resolver cannot join ("Liz" is no prefix of "Elizabeth");
# no memory names both, so the merged mention count is the sum.
ITEMS = ["Liz adopted a puppy named Biscuit in March.",
         "Liz bought a red kayak in Lisbon.",
         "Elizabeth started a pottery class in Porto."]


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    s = Server(tmp_path_factory.mktemp("entity-corrections") / "data").start()
    with s.client() as m:
        m.upsert_bank(BANK)
        r = m.retain(BANK, [{"content": t, "timestamp": AT} for t in ITEMS])
        assert r.operation.state == 3, r.operation  # SUCCEEDED
    yield s
    s.stop()


def cli(server, *args) -> dict:
    out = CliRunner().invoke(app, [*args, "--json", "-a", server.address])
    assert out.exit_code == 0, out.output
    return json.loads(out.stdout)


def refused(call) -> grpc.RpcError:
    with pytest.raises(grpc.RpcError) as e:
        call()
    return e.value


def by_name(m, name: str) -> list[entities_pb2.Entity]:
    return [e for e in m.list_entities(BANK) if e.display_name == name]


def retain_one(m, text: str) -> str:
    r = m.retain(BANK, [{"content": text, "timestamp": AT}])
    assert r.operation.state == 3 and len(r.memory_ids) == 1, r
    return r.memory_ids[0]


def snapshot(m) -> dict:
    """Every entity of the bank with its memories (the neighbours follow from them)."""
    return {e.id: (e.display_name, e.kind, tuple(sorted(e.aliases)), e.mention_count,
                   tuple(sorted(m.get_entity(BANK, e.id).memories)))
            for e in m.list_entities(BANK)}


def test_merge_split_next_retains_and_replay(server):
    with server.client() as m:
        [liz], [eli] = by_name(m, "Liz"), by_name(m, "Elizabeth")
        liz_full, eli_full = m.get_entity(BANK, liz.id), m.get_entity(BANK, eli.id)
        assert (liz.mention_count, eli.mention_count) == (2, 1)

    merged = cli(server, "entities", "merge", BANK, eli.id, liz.id, "--name", "Elizabeth")
    assert merged["id"] == eli.id and merged["display_name"] == "Elizabeth"
    assert sorted(merged["aliases"]) == ["elizabeth", "liz"]
    assert merged["mention_count"] == liz.mention_count + eli.mention_count
    assert set(merged["memories"]) == set(liz_full.memories) | set(eli_full.memories)
    with server.client() as m:
        assert refused(lambda: m.get_entity(BANK, liz.id)).code() == grpc.StatusCode.NOT_FOUND
        got = m.get_entity(BANK, eli.id)
        assert set(got.memories) == set(merged["memories"]) and got.mention_count == 3
        # the resolver follows the merge: a later "Liz" is Elizabeth
        vet = retain_one(m, "Liz took Biscuit to the vet on Friday.")
        got = m.get_entity(BANK, eli.id)
        assert got.mention_count == 4 and f"banks/{BANK}/memories/{vet}" in got.memories
        assert by_name(m, "Liz") == []
        assert {e.entity.rsplit("/", 1)[-1] for e in got.neighbours} >= {
            e.id for e in by_name(m, "Biscuit")}
        ops = [o for o in m.list_operations(BANK) if o.kind == "merge_entities"]
        assert len(ops) == 1 and ops[0].state == 3

    # split "liz" back out: the memories naming Liz go with it, pottery stays
    split = cli(server, "entities", "split", BANK, eli.id, "--alias", "Liz", "--name", "Liz")
    old, new = split["entity"], split["new_entity"]
    assert (old["id"], old["aliases"], old["mention_count"]) == (eli.id, ["elizabeth"], 1)
    assert old["memories"] == list(eli_full.memories)
    assert (new["display_name"], new["kind"], new["aliases"]) == ("Liz", "PERSON", ["liz"])
    assert set(new["memories"]) == set(liz_full.memories) | {f"banks/{BANK}/memories/{vet}"}
    with server.client() as m:
        swim = retain_one(m, "Liz went swimming with Biscuit.")
        pots = retain_one(m, "Elizabeth sold her first vase.")
        assert f"banks/{BANK}/memories/{swim}" in m.get_entity(BANK, new["id"]).memories
        assert f"banks/{BANK}/memories/{pots}" in m.get_entity(BANK, eli.id).memories
        assert m.get_entity(BANK, new["id"]).mention_count == 4
        # a split by memory: the vase memory moves to a new entity, nothing else does
        r = m.split_entity(BANK, eli.id, "Elizabeth the potter", memory_ids=[pots])
        assert list(r.new_entity.memories) == [f"banks/{BANK}/memories/{pots}"]
        assert r.new_entity.aliases == ["elizabeth the potter"] and r.entity.mention_count == 1
        before = snapshot(m)

    server.replay()  # the log alone gives back the corrected entities
    with server.client() as m:
        assert snapshot(m) == before
        again = retain_one(m, "Liz and her puppy visited Elizabeth.")
        got = m.get_memory(BANK, again)
        assert got.id == again
        assert f"banks/{BANK}/memories/{again}" in m.get_entity(BANK, new["id"]).memories
        assert f"banks/{BANK}/memories/{again}" in m.get_entity(BANK, eli.id).memories


def test_corrections_are_validated(server):
    with server.client() as m:
        m.upsert_bank("fam-v")
        r = m.retain("fam-v", [{"content": "Tom met Anna in Oslo.", "timestamp": AT}])
        assert r.operation.state == 3
        tom, anna = by_name_in(m, "fam-v", "Tom"), by_name_in(m, "fam-v", "Anna")
        cases = [
            (lambda: m.merge_entities("fam-v", [tom]), "entities"),
            (lambda: m.merge_entities("fam-v", [tom, anna, tom]), "entities[2]"),
            (lambda: m.merge_entities("fam-v", [tom, "bad/id"]), "entities[1]"),
            (lambda: m.merge_entities("fam-v", [tom, anna], "x" * 201), "display_name"),
            (lambda: m.entities.MergeEntities(entities_pb2.MergeEntitiesRequest(
                parent="banks/fam-v", entities=[f"banks/fam-v/entities/{tom}",
                                                f"banks/other/entities/{anna}"])), "entities[1]"),
            (lambda: m.split_entity("fam-v", tom, "Tommy"), "aliases"),
            (lambda: m.split_entity("fam-v", tom, "", aliases=["tom"]), "display_name"),
            (lambda: m.split_entity("fam-v", tom, "Tommy", aliases=["anna"]), "aliases[0]"),
            (lambda: m.split_entity("fam-v", tom, "Tommy", aliases=["Tom"]), "aliases"),
            (lambda: m.split_entity("fam-v", tom, "Tommy", memory_ids=["x/y"]), "memories[0]"),
            (lambda: m.split_entity("fam-v", tom, "Tommy", aliases=[str(i) for i in range(101)]),
             "aliases"),
        ]
        for call, field in cases:
            err = refused(call)
            assert err.code() == grpc.StatusCode.INVALID_ARGUMENT, (field, err.details())
            assert [f for f, _ in field_violations(err)] == [field], err.details()
        some = f"{'0' * 8}-0000-4000-8000-{'0' * 12}"
        for call in (lambda: m.merge_entities("fam-v", [tom, some]),
                     lambda: m.merge_entities("nope", [tom, anna]),
                     lambda: m.split_entity("fam-v", some, "X", aliases=["x"]),
                     lambda: m.get_entity("fam-v", some)):
            assert refused(call).code() == grpc.StatusCode.NOT_FOUND
        # a memory that does not mention the entity
        extra = m.retain("fam-v", [{"content": "The weather was mild all week.",
                                    "timestamp": AT}]).memory_ids[0]
        err = refused(lambda: m.split_entity("fam-v", tom, "Tommy", memory_ids=[extra]))
        assert [f for f, _ in field_violations(err)] == ["memories[0]"]
        assert by_name_in(m, "fam-v", "Tom") == tom  # nothing refused changed anything


def by_name_in(m, bank: str, name: str) -> str:
    [e] = [e for e in m.list_entities(bank) if e.display_name == name]
    return e.id
