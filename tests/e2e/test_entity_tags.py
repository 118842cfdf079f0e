"""Tag-scoped entity reads through a real ``mneme up``: two end users (alice, bob) in one
bank, each retaining under their own tag. ListEntities and GetEntity with tags count only
the memories matching them (in every tags_match mode, checked against the reference
semantics :func:`mneme.domain.tags_match` over each memory's own tags), a scope never sees
an entity only the other's memories mention, page tokens are bound to the filter, bad
filters are INVALID_ARGUMENT naming the field, and a replay answers the same."""

from __future__ import annotations

from datetime import datetime, timedelta, timezone

import grpc
import pytest
from typer.testing import CliRunner

from mneme.cli import app
from mneme.client import field_violations
from mneme.domain import TAGS_MATCH_MODES, tags_filter_set, tags_match
from mneme.v1 import entities_pb2, generations_pb2, recall_pb2

BANK = "shared"
T0 = datetime(2024, 6, 3, 9, tzinfo=timezone.utc)
DAY = timedelta(days=1)
ALICE, BOB = "user:alice", "user:bob"
ITEMS = [  # (text, tags, day)
    ("Liz bought a red kayak in Porto.", [ALICE], 0),
    ("Liz and Tom hiked near Lisbon.", [ALICE, "work"], 2),
    ("Tom adopted a puppy named Biscuit.", [BOB], 1),
    ("Maya met Tom in Lisbon.", [BOB], 3),
    ("Tom paints on Sundays.", [], 4),
]
FILTERS = [(t, mode) for t in ([ALICE], [BOB], [ALICE, "work"], ["nobody"])
           for mode in TAGS_MATCH_MODES] + [([], "exact"), ([], "any")]


@pytest.fixture(scope="module")
def bank(m):
    m.upsert_bank(BANK)
    for text, tags, day in ITEMS:
        r = m.retain(BANK, [{"content": text, "tags": tags, "timestamp": T0 + day * DAY}])
        assert r.operation.state == 3 and r.memory_ids, r
    return BANK


def _truth(m, bank: str) -> dict:
    """Per entity id: [(memory name, tags, time told)] of every memory mentioning it, read
    unscoped (GetEntity's memories; GetMemory's tags and mentioned_at)."""
    out = {}
    for e in m.list_entities(bank):
        full = m.get_entity(bank, e.id)
        mems = []
        for name in full.memories:
            x = m.get_memory(bank, name.rsplit("/", 1)[-1])
            mems.append((name, tuple(x.tags), x.mentioned_at.ToDatetime(tzinfo=timezone.utc)))
        out[e.id] = (e.display_name, mems)
    return out


def _scoped_view(m, bank: str, tags, mode) -> dict:
    """What the scoped reads answer: per listed entity (mention count, first/last seen,
    GetEntity's memories as a set, neighbours)."""
    view = {}
    for e in m.list_entities(bank, page_size=1, tags=tags, tags_match=mode):
        got = m.get_entity(bank, e.id, tags=tags, tags_match=mode)
        assert got.mention_count == e.mention_count
        view[e.id] = (e.mention_count, e.first_seen.ToDatetime(tzinfo=timezone.utc),
                      e.last_seen.ToDatetime(tzinfo=timezone.utc), frozenset(got.memories),
                      {n.entity.rsplit("/", 1)[-1]: n.shared_memories for n in got.neighbours})
    return view


def _expected(truth: dict, tags, mode) -> dict:
    out = {}
    mems_of = {eid: {n for n, t, _ in mems if tags_match(t, tags, mode)}
               for eid, (_, mems) in truth.items()}
    for eid, (_, mems) in truth.items():
        match = [(n, when) for n, t, when in mems if tags_match(t, tags, mode)]
        if not match:
            continue
        names = frozenset(n for n, _ in match)
        neighbours = {o: len(names & ms) for o, ms in mems_of.items()
                      if o != eid and names & ms}
        out[eid] = (len(match), min(w for _, w in match), max(w for _, w in match), names,
                    neighbours)
    return out


def test_scoped_entity_reads_count_only_matching_memories_and_survive_replay(server, m, bank):
    truth = _truth(m, bank)
    by_name = {name: eid for eid, (name, _) in truth.items()}
    # the extractor found the people: Liz only in alice's, Maya only in bob's, Tom in both
    assert {"Liz", "Maya", "Tom"} <= set(by_name), by_name
    views = {}
    for tags, mode in FILTERS:
        want = _expected(truth, tags, mode)
        views[(tuple(tags), mode)] = got = _scoped_view(m, bank, tags, mode)
        assert got == want, (tags, mode)
    alice = views[((ALICE,), "any_strict")]
    assert by_name["Liz"] in alice and by_name["Maya"] not in alice
    assert alice[by_name["Tom"]][0] == 1  # bob's and the untagged memories not counted
    assert views[((ALICE,), "any")][by_name["Tom"]][0] == 2  # untagged is shared in ANY
    with pytest.raises(grpc.RpcError) as e:  # bob's entity does not exist for alice
        m.get_entity(bank, by_name["Maya"], tags=[ALICE], tags_match="any_strict")
    assert e.value.code() == grpc.StatusCode.NOT_FOUND
    unscoped = {e.id: e.mention_count for e in m.list_entities(bank)}
    assert unscoped[by_name["Tom"]] == 4

    out = CliRunner().invoke(app, ["entities", "list", bank, "--tag", ALICE, "--tags-match",
                                   "any_strict", "--json", "-a", server.address])
    assert out.exit_code == 0, out.output
    assert "Liz" in out.stdout and "Maya" not in out.stdout
    out = CliRunner().invoke(app, ["entities", "get", bank, by_name["Tom"], "--tag", BOB,
                                   "--tags-match", "any_strict", "-a", server.address])
    assert out.exit_code == 0, out.output
    assert f"{by_name['Tom']}: 2 mentions" in out.stdout

    g = m.replay(poll_s=0.2)
    assert g.state == generations_pb2.Generation.LIVE, g
    for (tags, mode), before in views.items():
        assert _scoped_view(m, bank, list(tags), mode) == before, (tags, mode)
    assert {e.id: e.mention_count for e in m.list_entities(bank)} == unscoped


def _refused(call) -> list[str]:
    with pytest.raises(grpc.RpcError) as e:
        call()
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT, e.value.details()
    return [f for f, _ in field_violations(e.value)]


def test_page_tokens_are_bound_to_the_tag_filter(m, bank):
    parent = f"banks/{bank}"
    first = m.entities.ListEntities(entities_pb2.ListEntitiesRequest(
        parent=parent, page_size=1, tags=[ALICE], tags_match=recall_pb2.ANY_STRICT))
    assert first.next_page_token and len(first.entities) == 1
    # the same filter, tags in another order or repeated: the token is taken
    again = m.entities.ListEntities(entities_pb2.ListEntitiesRequest(
        parent=parent, page_size=1, tags=[ALICE, ALICE], tags_match=recall_pb2.ANY_STRICT,
        page_token=first.next_page_token))
    assert [e.id for e in again.entities] != [e.id for e in first.entities]
    for other in (dict(tags=[BOB], tags_match=recall_pb2.ANY_STRICT),
                  dict(tags=[ALICE], tags_match=recall_pb2.ANY),
                  dict()):
        refused = _refused(lambda: m.entities.ListEntities(entities_pb2.ListEntitiesRequest(
            parent=parent, page_size=1, page_token=first.next_page_token, **other)))
        assert refused == ["page_token"], other
    unscoped = m.entities.ListEntities(entities_pb2.ListEntitiesRequest(parent=parent,
                                                                        page_size=1))
    assert _refused(lambda: m.entities.ListEntities(entities_pb2.ListEntitiesRequest(
        parent=parent, page_size=1, page_token=unscoped.next_page_token, tags=[ALICE]))) == [
        "page_token"]
    # no filter (empty tags, not EXACT) is the unscoped list: its tokens are interchangeable
    assert not tags_filter_set([], "all")
    m.entities.ListEntities(entities_pb2.ListEntitiesRequest(
        parent=parent, page_size=1, page_token=unscoped.next_page_token,
        tags_match=recall_pb2.ALL))


def test_bad_tag_filters_name_their_field(m, bank):
    tom = next(e.id for e in m.list_entities(bank) if e.display_name == "Tom")
    name = f"banks/{bank}/entities/{tom}"
    for call in (lambda **kw: m.entities.ListEntities(entities_pb2.ListEntitiesRequest(
                     parent=f"banks/{bank}", **kw)),
                 lambda **kw: m.entities.GetEntity(entities_pb2.GetEntityRequest(
                     name=name, **kw))):
        assert _refused(lambda: call(tags=[ALICE], tags_match=42)) == ["tags_match"]
        assert _refused(lambda: call(tags=[ALICE, " "])) == ["tags[1]"]
        assert _refused(lambda: call(tags=["x" * 10_000])) == ["tags[0]"]
