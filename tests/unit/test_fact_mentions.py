"""FactMentions: what an upgraded entities.db learns from the log about which memory
names which entity (services.extraction.handlers.FactMentions)."""

from __future__ import annotations

from mneme.events.v1 import events_pb2 as ev
from mneme.keys import document_scope
from services.extraction.handlers import FactMentions


def _facts(op: str, *facts: tuple[str, str, list[str]]) -> ev.FactsExtracted:
    return ev.FactsExtracted(bank_id="b", operation_id=op, facts=[
        ev.Fact(id=i, document_id=d, entities=[ev.Entity(id=e) for e in es])
        for i, d, es in facts])


def _rows(events) -> set[tuple[str, str, str]]:
    seen = FactMentions()
    for m in events:
        seen.add(m)
    return set(seen.rows().get("b", []))


def test_deleted_content_names_nothing():
    d = document_scope("d")
    assert _rows([_facts("o1", ("f1", "d", ["mel"]), ("f2", "d", ["tom"]),
                         ("f3", "e", ["ann"])),
                  ev.FactsRetracted(bank_id="b", memory_ids=["f2"]),
                  ev.FactsRetracted(bank_id="b", document_id="e")]) == {("mel", d, "f1")}
    assert _rows([_facts("o1", ("f1", "d", ["mel"])),
                  ev.FactsRetracted(bank_id="b", bank_deleted=True)]) == set()
    # a retain replacing the document: only its new facts
    again = _facts("o2", ("f9", "d", ["tom"]))
    again.replaced_document_ids.append("d")
    assert _rows([_facts("o1", ("f1", "d", ["mel"])), again]) == {("tom", d, "f9")}


def test_merges_and_splits_move_the_mentions_as_the_resolver_does():
    """A merge's survivor holds the merged entities' mentions, and a split's new entity
    those of its origin (EntityResolver.merge / split): an entities.db refined from the
    log after either knows which memories name them."""
    d = document_scope("d")
    rows = _rows([_facts("o1", ("f1", "d", ["mel"]), ("f2", "d", ["melanie"])),
                  ev.EntitiesMerged(bank_id="b", survivor_id="melanie", merged_ids=["mel"])])
    assert rows == {("melanie", d, "f1"), ("melanie", d, "f2")}
    rows = _rows([_facts("o1", ("f1", "d", ["mel"])),
                  ev.EntitySplit(bank_id="b", entity_id="mel", new_entity_id="mel2",
                                 memory_ids=["f1"])])
    assert rows == {("mel", d, "f1"), ("mel2", d, "f1")}
