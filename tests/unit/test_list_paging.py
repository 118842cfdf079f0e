"""Keyset paging and token binding of search's lists over a vector store: observations,
opinions and observation scopes stay put when units come and go between page calls, a
token is refused by the same list with other filters (AIP-158), and the token of a scope
of the longest tags in any script passes the page_token limit and pages to the end."""

from __future__ import annotations

import pytest

from mneme.domain import OPINION, EntityRef, Fact, Filters
from mneme.errors import InvalidArgument
from mneme.limits import Limits, check
from mneme.v1 import memory_pb2, observations_pb2, opinions_pb2
from services.search import observations, opinions, reads
from tests.fakes import FakeStore

BANK = "b"


def unit(i: str, fact_type: str, tags=(), entity: str = "") -> Fact:
    return Fact(id=i, bank_id=BANK, text=f"unit {i}", fact_type=fact_type, tags=tuple(tags),
                entities=[EntityRef(entity, "E", "person")] if entity else [])


def page_through(call, churn=lambda n: None) -> list:
    """Every item of a list, page by page (``churn(n)`` runs before page n > 0)."""
    got, token, n = [], "", 0
    while True:
        if n:
            churn(n)
        page, token = call(token)
        got += page
        n += 1
        if not token:
            return got


@pytest.mark.parametrize("kind", ["observation", OPINION])
def test_units_stable_between_pages_are_listed_once_whatever_comes_and_goes(kind):
    vectors = FakeStore("vector")
    stable = [f"m{i}" for i in range(6)]
    gone = ["m0x", "m3x"]  # removed between pages: one already served, one not yet
    vectors.upsert([unit(i, kind) for i in stable + gone])
    added = iter(["a0", "m1x", "m4x", "z9"])

    def churn(n):
        vectors.upsert([unit(next(added), kind)])  # before and after the position
        if n == 1:
            vectors.delete(BANK, gone)

    if kind == OPINION:
        def call(token):
            return opinions.list_opinions(vectors, BANK, 2, token)
    else:
        def call(token):
            return observations.list_observations(vectors, BANK, 2, token)
    ids = [u.id for u in page_through(call, churn)]
    assert len(ids) == len(set(ids)), ids  # nothing twice
    assert set(stable) <= set(ids), ids  # nothing stable skipped
    assert ids == sorted(ids)


def test_scopes_page_by_scope_and_stay_put_when_scopes_come_and_go():
    vectors = FakeStore("vector")
    scopes = [[], ["a"], ["a", "b"], ["b"], ["c"], ["d"]]
    vectors.upsert([unit(f"o{i}", "observation", s) for i, s in enumerate(scopes)])
    extra = iter([("x0", ["0"]), ("x1", ["bb"]), ("x2", ["zz"])])

    def churn(n):
        i, tags = next(extra)
        vectors.upsert([unit(i, "observation", tags)])
        if n == 1:
            vectors.delete(BANK, ["o2", "o4"])  # ["a", "b"] (served first), ["c"] (not yet)

    got = page_through(lambda t: observations.list_scopes(vectors, BANK, 2, t), churn)
    keys = [tuple(t) for t, _ in got]
    assert len(keys) == len(set(keys)), keys
    assert {(), ("a",), ("b",), ("d",)} <= set(keys), keys


@pytest.mark.parametrize("ch", ["t", "\u6807", "\U0001f600", '"'])
def test_scope_tokens_of_the_longest_tags_pass_the_limits_and_page_to_the_end(ch):
    lim = Limits()
    vectors = FakeStore("vector")
    scopes = [[f"{ch * (lim.tag_chars - 2)}{n}{k}" for k in range(lim.tags)] for n in range(3)]
    vectors.upsert([unit(f"o{i}", "observation", s) for i, s in enumerate(scopes)])
    def call(token):
        assert check(observations_pb2.ListObservationScopesRequest(
            parent=f"banks/{BANK}", page_size=1, page_token=token), lim) == []
        return observations.list_scopes(vectors, BANK, 1, token)

    seen = page_through(call)
    assert [sorted(t) for t, _ in seen] == sorted(sorted(s) for s in scopes)


def test_tokens_are_bound_to_the_filters_they_were_issued_for():
    vectors = FakeStore("vector")
    vectors.upsert([unit(f"o{i}", "observation", ["s"]) for i in range(3)]
                   + [unit(f"p{i}", OPINION, entity="e1") for i in range(3)]
                   + [Fact(id=f"f{i}", bank_id=BANK, text="x", fact_type="world",
                           document_id="d1") for i in range(3)])
    _, obs = observations.list_observations(vectors, BANK, 1, "", ["s"])
    for other in (["t"], [], None):
        with pytest.raises(InvalidArgument) as e:
            observations.list_observations(vectors, BANK, 1, obs, other)
        assert e.value.violations[0][0] == "page_token"
    assert observations.list_observations(vectors, BANK, 1, obs, ["s"])[0]
    _, ops = opinions.list_opinions(vectors, BANK, 1, "", "e1")
    with pytest.raises(InvalidArgument):
        opinions.list_opinions(vectors, BANK, 1, ops, "e2")
    world = Filters(types=("world",), document_id="d1")
    _, mems = reads.list_memories(vectors, BANK, 1, "", world)
    for other in (Filters(types=("world",), document_id="d2"),
                  Filters(types=("world", "experience"), document_id="d1")):
        with pytest.raises(InvalidArgument) as e:
            reads.list_memories(vectors, BANK, 1, mems, other)
        assert e.value.violations[0][0] == "page_token"
    assert reads.list_memories(vectors, BANK, 1, mems, world)[0]


class _Spy:
    """A graph store recording the ``limit`` of each ``entities`` call."""

    def __init__(self, graph):
        self.graph, self.limits = graph, []

    def entities(self, bank_id, limit, after="", tags=(), tags_match="any"):
        self.limits.append(limit)
        return self.graph.entities(bank_id, limit, after, tags, tags_match)


def test_a_tag_scoped_entity_list_examines_a_bounded_window_per_call(tmp_path, monkeypatch):
    """Alice's three entities among twenty of bob's: every call examines at most
    max(size + 1, ENTITY_SCAN) entities (short or empty pages carry a token on), the
    pages together list alice's entities once each, counted over her memories, and a
    token of the scoped list is refused by the unscoped one and by another scope."""
    from mneme.stores.graph_falkor import FalkorGraphStore
    monkeypatch.setattr(reads, "ENTITY_SCAN", 4)
    graph = FalkorGraphStore(str(tmp_path / "g.db"))
    try:
        mine = {2, 11, 17}
        graph.upsert([Fact(id=f"u{i}", bank_id=BANK, text="t",
                           entities=[EntityRef(f"e{i:02d}", f"N{i}", "PERSON")],
                           tags=("user:alice",) if i in mine else ("user:bob",))
                      for i in range(20)] +
                     [Fact(id="u99", bank_id=BANK, text="t", tags=("user:alice",),
                           entities=[EntityRef("e11", "N11", "PERSON")])])
        for size in (1, 2, 5):
            spy = _Spy(graph)
            tokens = []

            def call(token):
                page, nxt = reads.list_entities(spy, BANK, size, token, ("user:alice",),
                                                "any_strict")
                tokens.append(nxt)
                return page, nxt

            got = page_through(call)
            assert [(e.id, e.mentions) for e in got] == [("e02", 1), ("e11", 2), ("e17", 1)]
            assert spy.limits and max(spy.limits) == max(size + 1, 4), size
            for other in [(), (("user:alice",), "any"), (("user:bob",), "any_strict")]:
                with pytest.raises(InvalidArgument) as e:
                    reads.list_entities(spy, BANK, size, tokens[0], *other)
                assert e.value.violations[0][0] == "page_token"
    finally:
        graph.close()
