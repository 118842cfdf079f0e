"""apiconv.MemoryMessages: the serialized-message cache recall's responses are built from
must give exactly what memory_to_api gives, and never a stale message."""

import copy
from datetime import datetime, timedelta, timezone

from mneme import apiconv
from mneme.domain import EntityRef, Fact
from mneme.v1 import recall_pb2, resources_pb2

T = datetime(2023, 5, 7, 13, 56, tzinfo=timezone.utc)


def _fact(i: int, text: str = "Caroline went to a LGBTQ support group.") -> Fact:
    return Fact(id=f"f{i}", bank_id="b", text=text, occurred_start=T, occurred_end=T + timedelta(days=1),
                mentioned_at=T, tags=("t1",), metadata={"dia_id": f"D1:{i}"}, document_id="d",
                chunk_id="c", context="chat",
                entities=[EntityRef(id="e1", name="Caroline", label="PERSON")])


def _filled(cache: apiconv.MemoryMessages, f: Fact) -> resources_pb2.Memory:
    r = recall_pb2.RecallResponse().results.add()
    cache.fill(r.memory, f)
    return r.memory


def test_same_message_as_memory_to_api_on_miss_and_on_hit():
    cache = apiconv.MemoryMessages()
    f = _fact(1)
    want = apiconv.memory_to_api(f)
    assert _filled(cache, f) == want          # miss: built
    assert _filled(cache, copy.copy(f)) == want  # hit: the hydration cache's shallow copy


def test_a_changed_or_reread_fact_is_never_served_stale():
    cache = apiconv.MemoryMessages()
    f = _fact(1)
    _filled(cache, f)
    changed = copy.copy(f)
    changed.text = "Caroline went to a pride parade."
    assert _filled(cache, changed).text == "Caroline went to a pride parade."
    # the same id read again from a store: equal values, new objects -> rebuilt, still equal
    reread = _fact(1, text="Caroline went to a support group.")
    assert _filled(cache, reread) == apiconv.memory_to_api(reread)
    moved = copy.copy(reread)
    moved.metadata = {"dia_id": "D9:9"}
    assert _filled(cache, moved).metadata["dia_id"] == "D9:9"
    other_bank = copy.copy(reread)
    other_bank.bank_id = "b2"
    assert _filled(cache, other_bank).name == apiconv.memory_name("b2", "f1")


def test_bounded():
    cache = apiconv.MemoryMessages(size=3)
    facts = [_fact(i) for i in range(10)]
    for f in facts:
        _filled(cache, f)
    assert len(cache._cache) == 3
    assert all(_filled(cache, f) == apiconv.memory_to_api(f) for f in facts)
