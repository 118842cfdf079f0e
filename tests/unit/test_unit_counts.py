"""The unit counts the Qdrant Edge vector store keeps as it writes (GetBankStats' facts
and observations): always equal to an exact count in the shard, across replacements,
type changes, deletions, reopen and failed writes; saved at a flush and trusted on open
only when nothing changed after the save."""

from __future__ import annotations

import dataclasses
import json
import random

import pytest
from qdrant_edge import CountRequest

from mneme.domain import EXPERIENCE, FACT_TYPES, WORLD, Fact, Filters
from mneme.stores.unit_counts import COUNTS_FILE
from mneme.stores.vector_edge import EdgeVectorStore, qdrant_filter
from tests.contract.corpus import DIM, fid, rand_vec

OBSERVATION = "observation"  # (services.search.observations)
TYPES = (WORLD, EXPERIENCE, OBSERVATION)
BANKS = ("a", "b", "c")


def _fact(bank: str, i: int, fact_type: str, doc: str = "") -> Fact:
    return Fact(id=fid("counts", i), bank_id=bank, text=f"unit {i}", fact_type=fact_type,
                document_id=doc, embedding=rand_vec(i, DIM))


def _exact(store: EdgeVectorStore, bank: str, types=()) -> int:
    """The shard's own exact count, bypassing the kept counts."""
    return int(store.shard.count(CountRequest(
        filter=qdrant_filter(bank, Filters(types=tuple(types))), exact=True)))


def _assert_counts_match(store: EdgeVectorStore) -> None:
    for bank in BANKS + ("never",):
        for types in ((), FACT_TYPES, (OBSERVATION,), (WORLD,), ("opinion",)):
            assert store.count(bank, Filters(types=types)) == _exact(store, bank, types), \
                (bank, types)
        assert store.count(bank) == _exact(store, bank)


def test_counts_follow_random_writes_across_flushes_and_reopen(tmp_path):
    rng = random.Random(7)
    store = EdgeVectorStore(str(tmp_path), DIM)
    try:
        # ids are reused across banks, types and documents: replacements of every kind
        for step in range(60):
            action = rng.random()
            if action < 0.6:
                batch = [_fact(rng.choice(BANKS), rng.randrange(80), rng.choice(TYPES),
                               rng.choice(("d1", "d2", ""))) for _ in range(rng.randrange(1, 12))]
                store.upsert(batch)  # repeats within a batch too: the last one stays
            elif action < 0.8:
                store.delete(rng.choice(BANKS), [fid("counts", rng.randrange(80))
                                                 for _ in range(rng.randrange(1, 6))])
            elif action < 0.93:
                store.delete_where(rng.choice(BANKS), rng.choice(("d1", "d2")))
            else:
                store.delete_where(rng.choice(BANKS), None)
            if step % 7 == 0:
                _assert_counts_match(store)
            if step % 11 == 0:
                store.flush()
            if step % 23 == 0:
                store.close()
                store = EdgeVectorStore(str(tmp_path), DIM)
        _assert_counts_match(store)
    finally:
        store.close()


def test_a_reopened_store_answers_from_the_saved_counts(tmp_path, monkeypatch):
    store = EdgeVectorStore(str(tmp_path), DIM)
    store.upsert([_fact("a", i, TYPES[i % 3]) for i in range(30)])
    assert store.count("a", Filters(types=FACT_TYPES)) == 20
    store.close()
    saved = json.loads((tmp_path / COUNTS_FILE).read_text())
    assert saved["banks"]["a"] == {WORLD: 10, EXPERIENCE: 10, OBSERVATION: 10}

    store = EdgeVectorStore(str(tmp_path), DIM)
    try:
        monkeypatch.setattr(store, "_count_bank", lambda bank: pytest.fail("recounted"))
        assert store.count("a", Filters(types=(OBSERVATION,))) == 10
        assert store.count("a") == 30
    finally:
        store.close()


def test_counts_are_on_disk_only_while_the_store_is_closed(tmp_path):
    store = EdgeVectorStore(str(tmp_path), DIM)
    store.upsert([_fact("a", i, WORLD) for i in range(5)])
    store.close()
    assert (tmp_path / COUNTS_FILE).exists()
    store = EdgeVectorStore(str(tmp_path), DIM)
    try:
        # read at open and removed: a process that dies from now on leaves nothing that
        # could miss its writes, flushed or not
        assert not (tmp_path / COUNTS_FILE).exists()
        store.upsert([_fact("a", 99, WORLD)])
        store.flush()
        assert not (tmp_path / COUNTS_FILE).exists()
    finally:
        store.close()
    assert json.loads((tmp_path / COUNTS_FILE).read_text())["banks"]["a"] == {WORLD: 6}


def test_a_write_by_another_writer_makes_the_saved_counts_stale(tmp_path):
    from qdrant_edge import EdgeShard, Point, UpdateOperation
    from mneme.stores.vector_edge import fact_to_payload, point_id
    store = EdgeVectorStore(str(tmp_path), DIM)
    facts = [_fact("a", i, WORLD) for i in range(10)]
    store.upsert(facts)
    assert store.count("a", Filters(types=(WORLD,))) == 10
    store.close()
    # e.g. an older version after a rollback: four units change type, the total stays
    shard = EdgeShard.load(str(tmp_path), store._config())
    shard.update(UpdateOperation.upsert_points([
        Point(point_id(f.id), f.embedding,
              fact_to_payload(dataclasses.replace(f, fact_type=OBSERVATION)))
        for f in facts[:4]]))
    shard.flush()
    shard.close()
    store = EdgeVectorStore(str(tmp_path), DIM)
    try:
        assert store.count("a", Filters(types=(WORLD,))) == 6
        assert store.count("a", Filters(types=(OBSERVATION,))) == 4
    finally:
        store.close()


@pytest.mark.parametrize("content", [
    '{"version": 2, "stamp": [3, []], "banks": {"a": {"world": 1000}}}',
    '{"version": 1, "points": 6, "banks": {"a": {"world": 1000}}}',
    '{"version": 2, "stamp": null, "banks": {"a": {"world": "many"}}}',
    '{"version": 2, "banks": [1]}',
    'not json',
    '',
])
def test_a_stale_or_unreadable_counts_file_is_recounted(tmp_path, content):
    store = EdgeVectorStore(str(tmp_path), DIM)
    store.upsert([_fact("a", i, WORLD) for i in range(6)])
    store.close()
    (tmp_path / COUNTS_FILE).write_text(content)
    store = EdgeVectorStore(str(tmp_path), DIM)
    try:
        assert store.count("a", Filters(types=(WORLD,))) == 6
        assert store.count("a") == 6
    finally:
        store.close()


def test_counts_that_disagree_with_the_shard_are_made_again_not_doubled(tmp_path):
    store = EdgeVectorStore(str(tmp_path), DIM)
    try:
        store.upsert([_fact("a", i, WORLD) for i in range(3)])
        assert store.count("a") == 3
        store._counts._banks["a"] = {}  # (as if they had drifted)
        # the deletion would take world below zero: the bank is counted again, once
        store.upsert([_fact("a", 0, EXPERIENCE), _fact("a", 7, EXPERIENCE)])
        assert store.count("a", Filters(types=(WORLD,))) == 2 == _exact(store, "a", (WORLD,))
        assert store.count("a") == 4 == _exact(store, "a")
    finally:
        store.close()


def test_units_without_a_type_count_the_same_written_and_recounted(tmp_path):
    store = EdgeVectorStore(str(tmp_path), DIM)
    try:
        untyped = dataclasses.replace(_fact("a", 1, WORLD), fact_type=None)
        store.upsert([untyped, _fact("a", 2, WORLD)])
        assert store.count("a") == 2
        store.upsert([untyped, _fact("a", 3, WORLD)])  # replaced, and one more
        assert store.count("a") == 3 == _exact(store, "a")
        store._counts.forget("a")
        assert store.count("a") == 3 and store.count("a", Filters(types=(WORLD,))) == 2
    finally:
        store.close()


def test_a_write_that_fails_leaves_the_bank_to_be_recounted(tmp_path):
    store = EdgeVectorStore(str(tmp_path), DIM)
    try:
        store.upsert([_fact("a", i, WORLD) for i in range(4)])
        assert store.count("a") == 4
        real = store._shard

        class Failing:  # applies the update, then fails (as a write that failed midway)
            def __getattr__(self, name):
                return getattr(real, name)

            def update(self, op):
                real.update(op)
                raise RuntimeError("disk full")

        store._shard = Failing()
        with pytest.raises(RuntimeError):
            store.upsert([_fact("a", i, EXPERIENCE) for i in range(10, 13)])
        store._shard = real
        assert store.count("a") == 7 and store.count("a", Filters(types=(EXPERIENCE,))) == 3
    finally:
        store.close()


def test_counts_by_other_filters_are_exact_counts(tmp_path):
    store = EdgeVectorStore(str(tmp_path), DIM)
    try:
        facts = [_fact("a", i, WORLD, doc=("d1", "d2")[i % 2]) for i in range(8)]
        store.upsert(facts + [dataclasses.replace(_fact("a", 50, WORLD), tags=("x",))])
        assert store.count("a", Filters(document_id="d1")) == 4
        assert store.count("a", Filters(tags=("x",), tags_match="any_strict")) == 1
        assert store.count("a", Filters(tags_match="exact")) == 8  # the untagged ones
        with pytest.raises(ValueError):
            store.count("a", Filters(tags_match="nonsense"))
    finally:
        store.close()


def test_reset_and_close(tmp_path):
    store = EdgeVectorStore(str(tmp_path), DIM)
    store.upsert([_fact("a", i, WORLD) for i in range(3)])
    assert store.count("a") == 3
    store.reset()
    assert store.count("a") == 0
    store.close()
    with pytest.raises(RuntimeError):
        store.count("a")
