"""services.extraction.resolver: per-bank entity resolution with person aliases."""

from __future__ import annotations

import threading

from mneme.domain import derive_id
from services.extraction.resolver import EntityResolver


def test_same_name_same_id_and_id_derivation():
    r = EntityResolver()
    a = r.resolve("b1", [("Caroline", "PERSON")])[0]
    b = r.resolve("b1", [("caroline", "CONCEPT")])[0]
    assert a == b
    assert a.id == derive_id("entity", "b1", "caroline")
    assert a.label == "PERSON"  # the canonical entity keeps its first label
    assert r.resolve("b1", [("the Caroline's", "PERSON")])[0].id == a.id  # entity_key normalises


def test_first_name_prefix_aliases_both_ways():
    r = EntityResolver()
    mel = r.resolve("b", [("Melanie", "PERSON")])[0]
    assert r.resolve("b", [("Mel", "PERSON")])[0] == mel
    car = r.resolve("b", [("Caroline Smith", "PERSON")])[0]
    assert r.resolve("b", [("Caroline", "PERSON")])[0] == car
    # the other direction: the short name came first
    r2 = EntityResolver()
    short = r2.resolve("b", [("Caroline", "PERSON")])[0]
    assert r2.resolve("b", [("Caroline Smith", "PERSON")])[0] == short
    # an alias keeps resolving the same way; lookup follows aliases without creating
    assert r.lookup("b", ["mel", "Nobody"]) == [mel]
    assert r.aliases("b")["mel"] == "melanie"


def test_ambiguous_or_short_prefix_makes_a_new_entity():
    r = EntityResolver()
    mel = r.resolve("b", [("Melanie", "PERSON"), ("Melissa", "PERSON")])
    m = r.resolve("b", [("Mel", "PERSON")])[0]
    assert m.id not in {e.id for e in mel}
    jo = r.resolve("b", [("Joanna", "PERSON"), ("Jo", "PERSON")])
    assert len(jo) == 2  # "Jo" is under 3 letters


def test_prefix_rule_is_for_people_only():
    r = EntityResolver()
    r.resolve("b", [("Melanie", "PERSON")])
    assert r.resolve("b", [("mel", "CONCEPT")])[0].name == "mel"  # lowercase concept: no alias
    car = r.resolve("b", [("Caroline Smith", "PERSON")])[0]
    assert r.resolve("b", [("Caroline", "ORG")])[0] == car  # mislabelled first name


def test_names_differing_by_a_number_stay_different():
    r = EntityResolver()
    a, b = r.resolve("b", [("Room 101", "FAC"), ("Room 102", "FAC")])
    assert a.id != b.id
    p1, p2 = r.resolve("b", [("Agent 007", "PERSON"), ("Agent 008", "PERSON")])
    assert p1.id != p2.id


def test_banks_are_isolated():
    r = EntityResolver()
    a = r.resolve("b1", [("Melanie", "PERSON")])[0]
    b = r.resolve("b2", [("Melanie", "PERSON")])[0]
    assert a.id != b.id
    assert r.resolve("b2", [("Mel", "PERSON")])[0] == b
    r.forget("b1")
    assert r.entities("b1") == []
    assert r.entities("b2") == [b]


def test_dedup_within_a_call_keeps_first_order():
    r = EntityResolver()
    out = r.resolve("b", [("Melanie", "PERSON"), ("painting", "CONCEPT"), ("Mel", "PERSON"),
                          ("Painting", "CONCEPT")])
    assert [e.name for e in out] == ["Melanie", "painting"]


def test_persistence_across_restarts(tmp_path):
    path = str(tmp_path / "entities.db")
    r = EntityResolver(path)
    mel = r.resolve("b", [("Melanie", "PERSON")])[0]
    alias = r.resolve("b", [("Mel", "PERSON")])[0]
    room = r.resolve("b", [("Room 101", "FAC")])[0]
    r.close()
    r2 = EntityResolver(path)
    assert r2.resolve("b", [("Mel", "PERSON")])[0] == alias == mel
    assert r2.resolve("b", [("Room 101", "FAC")])[0] == room
    # a new person that would make "Mel" ambiguous does not change the stored decision
    r2.resolve("b", [("Melissa", "PERSON")])
    assert r2.resolve("b", [("Mel", "PERSON")])[0] == mel
    assert [e.name for e in r2.entities("b")] == ["Melanie", "Room 101", "Melissa"]
    r2.forget("b")
    r2.close()
    assert EntityResolver(path).entities("b") == []


def test_deterministic_given_the_same_calls():
    calls = [[("Caroline", "PERSON"), ("LGBTQ support group", "CONCEPT")],
             [("Mel", "PERSON")], [("Melanie", "PERSON"), ("Caro", "PERSON")]]
    outs = []
    for _ in range(2):
        r = EntityResolver()
        outs.append([r.resolve("b", c) for c in calls])
    assert outs[0] == outs[1]
    many = EntityResolver().resolve_many("b", calls)
    assert many == outs[0]


def test_thread_safe():
    r = EntityResolver()
    results: list = []

    def run():
        results.append(tuple(e.id for e in r.resolve("b", [("Melanie", "PERSON"), ("Mel", "PERSON"),
                                                          ("Paris", "GPE")])))

    ts = [threading.Thread(target=run) for _ in range(8)]
    for t in ts:
        t.start()
    for t in ts:
        t.join()
    assert len(set(results)) == 1
    assert len(r.entities("b")) == 2
