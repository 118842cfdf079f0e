"""The entity counts the embedded graph store keeps across its own writes (GetBankStats'
entities): always equal to a count in the graph, across upserts that create and reuse
entities, deletions that orphan them, merges, splits, document and bank deletions, a
failed write and a reopen; saved on the bank at close and trusted only while the bank
is at the version it was counted at."""

from __future__ import annotations

import random

import pytest

from mneme.domain import EntityRef, Fact
from mneme.stores.graph_falkor import FalkorGraphStore
from tests.contract.corpus import fid

BANKS = ("a", "b")


def _fact(bank: str, i: int, entities: list[int], doc: str = "") -> Fact:
    return Fact(id=fid("graph-counts", bank, i), bank_id=bank, text=f"unit {i}",
                document_id=doc,
                entities=[EntityRef(f"e{n}", f"Name{n}", "PERSON") for n in entities])


def _assert_counts_match(store: FalkorGraphStore) -> None:
    for bank in BANKS + ("never",):
        assert store.count_entities(bank) == store._count_entities(bank), bank


@pytest.fixture
def path(tmp_path):
    return str(tmp_path / "g.db")


def test_counts_follow_random_writes_and_a_reopen(path):
    rng = random.Random(3)
    store = FalkorGraphStore(path)
    try:
        for step in range(70):
            bank = rng.choice(BANKS)
            action = rng.random()
            if action < 0.5:
                store.upsert([_fact(bank, rng.randrange(40),
                                    rng.sample(range(25), rng.randrange(0, 4)),
                                    rng.choice(("d1", "d2")))
                              for _ in range(rng.randrange(1, 6))])
            elif action < 0.65:
                store.delete(bank, [fid("graph-counts", bank, rng.randrange(40))
                                    for _ in range(rng.randrange(1, 4))])
            elif action < 0.75:
                store.delete_where(bank, rng.choice(("d1", "d2")))
            elif action < 0.85:
                store.merge_entities(bank, f"e{rng.randrange(25)}",
                                     [f"e{rng.randrange(25)}" for _ in range(2)])
            elif action < 0.95:
                store.split_entity(bank, f"e{rng.randrange(25)}", f"e{rng.randrange(25, 30)}",
                                   ["name3"], "New Name", [])
            else:
                store.delete_where(bank, None)
            if step % 5 == 0:
                _assert_counts_match(store)
            if step % 31 == 30:
                store.close()
                store = FalkorGraphStore(path)
        _assert_counts_match(store)
    finally:
        store.close()


def test_a_count_kept_across_writes_needs_no_count_in_the_graph(path, monkeypatch):
    store = FalkorGraphStore(path)
    try:
        store.upsert([_fact("a", 1, [1, 2])])
        assert store.count_entities("a") == 2  # counted once
        monkeypatch.setattr(store, "_count_entities",
                            lambda bank: pytest.fail("counted in the graph again"))
        store.upsert([_fact("a", 2, [2, 3, 4])])
        store.delete("a", [fid("graph-counts", "a", 1)])  # e1 left without mentions
        assert store.count_entities("a") == 3
    finally:
        store.close()


def test_a_reopened_store_uses_the_saved_count_until_the_bank_changes(path, monkeypatch):
    store = FalkorGraphStore(path)
    store.upsert([_fact("a", i, [i, i + 1]) for i in range(5)])
    assert store.count_entities("a") == 6
    store.close()

    store = FalkorGraphStore(path)
    try:
        calls = []
        real = store._count_entities
        monkeypatch.setattr(store, "_count_entities",
                            lambda bank: calls.append(bank) or real(bank))
        assert store.count_entities("a") == 6 and calls == []  # the saved count
        # a write by someone who does not keep the count (it renews the version only)
        store.exclusive = False
        store.upsert([_fact("a", 9, [50])])
        store.exclusive = True
        assert store.count_entities("a") == 7 and calls == ["a"]  # stale: counted
    finally:
        store.close()


def test_a_write_that_fails_leaves_the_bank_to_be_counted_again(path, monkeypatch):
    store = FalkorGraphStore(path)
    try:
        store.upsert([_fact("a", 1, [1])])
        assert store.count_entities("a") == 1
        real = store._run

        def failing(query, params):  # the entities are written, then the write fails
            out = real(query, params)
            if "MERGE (e:Entity" in query:
                raise RuntimeError("connection lost")
            return out
        monkeypatch.setattr(store, "_run", failing)
        with pytest.raises(RuntimeError):
            store.upsert([_fact("a", 2, [2, 3])])
        monkeypatch.setattr(store, "_run", real)
        assert store.count_entities("a") == store._count_entities("a") == 3
    finally:
        store.close()


def test_a_closed_store_answers_no_count(path):
    store = FalkorGraphStore(path)
    store.upsert([_fact("a", 1, [1])])
    assert store.count_entities("a") == 1
    store.close()
    with pytest.raises(RuntimeError):
        store.count_entities("a")
