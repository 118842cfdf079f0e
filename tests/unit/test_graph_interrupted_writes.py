"""A graph write cut short between its queries (the process was killed: FalkorDB has no
multi-query transaction, each query is atomic on its own) and then done again (the
event is redelivered) ends as if it had run once: no entity is left without a mention
(its name, user content, would stay listed by ListEntities and GetEntity, and a replay
of the log would not have it) and no link stub is left that nothing links to.

Found by the crash torture test: a delete's first queries cleared the units' MENTIONS
edges, and the redelivered delete no longer saw which entities they had mentioned."""

from __future__ import annotations

from typing import Callable

import pytest

from mneme.domain import EntityRef, Fact, Link
from mneme.stores.graph_falkor import FalkorGraphStore

ALICE = EntityRef("e-alice", "Alice", "PERSON")
BOB = EntityRef("e-bob", "Bob", "PERSON")
LYON = EntityRef("e-lyon", "Lyon", "GPE")
PIANO = EntityRef("e-piano", "piano", "CONCEPT")


class Killed(Exception):
    """The process died here."""


def _unit(uid: str, entities=(), links=(), doc: str = "") -> Fact:
    return Fact(id=uid, bank_id="a", text=f"text of {uid}", entities=list(entities),
                links=[Link(t, "semantic", 0.5) for t in links], document_id=doc)


def _setup(store: FalkorGraphStore) -> None:
    # u1 and u3 (document d1) are the only mentions of Bob and the piano, u3 links to a
    # unit never stored (a stub) and to u2; "Keys" was split off the piano (no mention)
    store.upsert([_unit("u1", [ALICE, BOB], doc="d1"),
                  _unit("u2", [ALICE, LYON], doc="d2"),
                  _unit("u3", [PIANO, LYON], links=["u9", "u2"], doc="d1")])
    store.split_entity("a", PIANO.id, "e-keys", [], "Keys", [])


#: each write, as a redelivered event would do it again
WRITES: dict[str, Callable[[FalkorGraphStore], None]] = {
    "delete": lambda s: s.delete("a", ["u1", "u3"]),
    "delete_where": lambda s: s.delete_where("a", "d1"),
    "upsert": lambda s: s.upsert([_unit("u1", [ALICE]), _unit("u3", [LYON])]),
}


def _state(store: FalkorGraphStore) -> tuple:
    entities = [(e.id, e.name, e.aliases, e.mentions) for e in store.entities("a", 100)]
    units = store._read(lambda run: run(
        "MATCH (n:Unit {bank_id: 'a'}) RETURN n.id, n.stub ORDER BY n.id", {}))
    return entities, [tuple(r) for r in units]


def _queries(store: FalkorGraphStore, write) -> int:
    real, n = store._run, [0]

    def counting(query, params):
        n[0] += 1
        return real(query, params)
    store._run = counting
    try:
        write(store)
    finally:
        store._run = real
    return n[0]


@pytest.mark.parametrize("write", sorted(WRITES))
def test_a_write_killed_after_any_query_and_done_again_ends_as_if_done_once(tmp_path, write):
    ref = FalkorGraphStore(str(tmp_path / "ref.db"))
    try:
        _setup(ref)
        queries = _queries(ref, WRITES[write])
        expected = _state(ref)
    finally:
        ref.close()
    # (the reference itself: what only the rewritten units used is gone)
    assert [e[0] for e in expected[0]] == [ALICE.id, LYON.id], expected
    for cut in range(1, queries):
        path = str(tmp_path / f"g{cut}.db")
        store = FalkorGraphStore(path)
        try:
            _setup(store)
            real, n = store._run, [0]

            def dying(query, params):
                n[0] += 1
                if n[0] > cut:
                    raise Killed
                return real(query, params)
            store._run = dying
            with pytest.raises(Killed):
                WRITES[write](store)
            store.close()
            store = FalkorGraphStore(path)  # restarted
            WRITES[write](store)  # redelivered
            assert _state(store) == expected, (write, cut)
        finally:
            store.close()
