"""Contract of :class:`mneme.ports.EntityStore`, written once; subclass per adapter and
implement ``make_entities(path)``; a store whose data outlives ``close`` subclasses
:class:`PersistentEntityStoreSuite`."""

from __future__ import annotations

import pytest

from mneme.ports import StoredEntity
from services.extraction.resolver import EntityResolver

MEL = StoredEntity("e-mel", "melanie", "Melanie", "PERSON", "person")
ROOM = StoredEntity("e-room", "room 101", "Room 101", "FAC", "place")
PAINT = StoredEntity("e-paint", "painting", "painting", "CONCEPT", "")

#: The first, one-entity-per-key schema of entities.db (files of earlier versions).
ENTITIES_V1_SCHEMA = """
  CREATE TABLE entities (bank_id TEXT NOT NULL, key TEXT NOT NULL, id TEXT NOT NULL,
    name TEXT NOT NULL, label TEXT NOT NULL, seq INTEGER NOT NULL,
    PRIMARY KEY (bank_id, key));
  CREATE TABLE aliases (bank_id TEXT NOT NULL, alias TEXT NOT NULL, key TEXT NOT NULL,
    PRIMARY KEY (bank_id, alias));"""


class EntityStoreSuite:
    reopens = False

    def make_entities(self, path):  # pragma: no cover - abstract
        raise NotImplementedError

    @pytest.fixture
    def store(self, tmp_path):
        s = self.make_entities(tmp_path)
        yield s
        s.close()

    def test_empty_bank(self, store):
        assert store.load("a") == ([], [])

    def test_entities_and_aliases_in_creation_order(self, store):
        store.persist("a", entities=[ROOM, MEL], aliases=[("mel", MEL.id)])
        store.persist("a", entities=[PAINT], aliases=[("room", ROOM.id), ("mel", ROOM.id)])
        assert store.load("a") == ([ROOM, MEL, PAINT],
                                   [("mel", MEL.id), ("room", ROOM.id), ("mel", ROOM.id)])

    def test_persist_is_idempotent_and_first_record_wins(self, store):
        store.persist("a", entities=[MEL], aliases=[("mel", MEL.id)])
        store.persist("a", entities=[StoredEntity(MEL.id, "melanie", "MELANIE", "ORG", "org")],
                      aliases=[("mel", MEL.id)])
        assert store.load("a") == ([MEL], [("mel", MEL.id)])

    def test_claims_set_label_and_kind_of_known_entities(self, store):
        store.persist("a", entities=[PAINT])
        claimed = StoredEntity(PAINT.id, PAINT.key, "other name", "WORK_OF_ART", "thing")
        store.persist("a", claims=[claimed, StoredEntity("e-unknown", "x", "X", "ORG", "org")])
        ([got], _) = store.load("a")
        assert (got.name, got.label, got.kind) == ("painting", "WORK_OF_ART", "thing")

    def test_one_call_creates_and_claims(self, store):
        store.persist("a", entities=[PAINT], claims=[StoredEntity(PAINT.id, PAINT.key, PAINT.name,
                                                                  "PRODUCT", "thing")])
        assert store.load("a")[0][0].kind == "thing"

    def test_banks_are_isolated_and_forget_drops_one(self, store):
        store.persist("a", entities=[MEL], aliases=[("mel", MEL.id)])
        store.persist("b", entities=[MEL, ROOM])
        store.forget("a")
        assert store.load("a") == ([], [])
        assert store.load("b") == ([MEL, ROOM], [])
        store.persist("a", entities=[ROOM])  # the bank starts afresh
        assert store.load("a") == ([ROOM], [])

    def test_decisions_are_recorded_per_cause_in_order(self, store):
        store.persist("a", entities=[MEL, PAINT], aliases=[("mel", MEL.id)], cause="ev1")
        claimed = StoredEntity(PAINT.id, PAINT.key, PAINT.name, "PRODUCT", "thing")
        store.persist("a", entities=[ROOM], claims=[claimed], cause="ev2")
        store.persist("a", aliases=[("room", ROOM.id)], cause="ev1")  # the same event again
        store.persist("a", entities=[MEL], aliases=[("melly", MEL.id)])  # for no cause
        assert store.decisions("a", "ev1") == ([MEL, PAINT], [],
                                               [("mel", MEL.id), ("room", ROOM.id)])
        assert store.decisions("a", "ev2") == ([ROOM], [claimed], [])
        assert store.decisions("b", "ev1") == store.decisions("a", "ev9") == ([], [], [])
        # what it recorded of an entity goes with it (names are user content), the rest stays
        store.add_mentions("a", [(MEL.id, "d:x"), (ROOM.id, "d:y")])
        assert store.drop_scope("a", "d:x") == [MEL.id]
        assert store.decisions("a", "ev1") == ([PAINT], [], [("room", ROOM.id)])
        store.forget("a")
        assert store.decisions("a", "ev2") == ([], [], [])

    def test_a_merged_entitys_recorded_decisions_go_when_its_survivor_does(self, store):
        liz = StoredEntity("e-liz", "liz", "Liz", "PERSON", "person")
        store.persist("a", entities=[liz], aliases=[("lizzy", liz.id)], cause="ev1")
        store.persist("a", entities=[MEL, ROOM], cause="ev2")
        store.add_mentions("a", [(liz.id, "d:y"), (MEL.id, "d:x"), (ROOM.id, "d:x")])
        store.rewrite("a", entities=[MEL], removed=[liz.id], mentions_of=[(MEL.id, liz.id)],
                      aliases=[("liz", MEL.id), ("lizzy", MEL.id)])
        # still published again on a redelivery (a restore then merges it in order)
        assert store.decisions("a", "ev1") == ([liz], [], [("lizzy", liz.id)])
        assert store.drop_scope("a", "d:y") == []
        assert store.decisions("a", "ev1") == ([liz], [], [("lizzy", liz.id)])
        assert store.drop_scope("a", "d:x") == [MEL.id, ROOM.id]
        assert store.decisions("a", "ev1") == store.decisions("a", "ev2") == ([], [], [])

    def test_recorded_decisions_are_bounded(self, store, monkeypatch):
        from mneme.stores import entities_sqlite
        monkeypatch.setattr(entities_sqlite, "DECISIONS_KEPT", 2)
        for n in range(4):
            store.persist("a", entities=[StoredEntity(f"e{n}", f"k{n}", f"K{n}", "", "")],
                          cause=f"ev{n}")
        assert [store.decisions("a", f"ev{n}")[0] != [] for n in range(4)] == [
            False, False, True, True]

    def test_resolver_over_the_store_resolves_the_same_after_a_restart(self, tmp_path):
        """The resolver's decisions go through the port: a new resolver on the store's
        data (reopened, or the same object) resolves as the first one did."""
        s = self.make_entities(tmp_path)
        r = EntityResolver(s)
        mel = r.resolve("a", [("Melanie", "PERSON")])[0]
        assert r.resolve("a", [("Mel", "PERSON")])[0] == mel
        paint = r.resolve("a", [("painting", "CONCEPT")])[0]
        r.close()
        if self.reopens:
            s = self.make_entities(tmp_path)  # else the same store object, data kept
        r2 = EntityResolver(s)
        r2.resolve("a", [("Melissa", "PERSON")])  # would make "Mel" ambiguous if it were new
        assert r2.resolve("a", [("Mel", "PERSON")])[0] == mel
        assert r2.resolve("a", [("painting", "CONCEPT")])[0] == paint
        assert [e.name for e in r2.entities("a")] == ["Melanie", "painting", "Melissa"]
        r2.forget("a")
        assert s.load("a") == ([], [])
        r2.close()


    def test_dropping_a_scope_deletes_the_entities_only_it_mentioned(self, store):
        store.persist("a", entities=[MEL, ROOM, PAINT], aliases=[("mel", MEL.id),
                                                                ("room", ROOM.id)])
        store.add_mentions("a", [(MEL.id, "d:x"), (ROOM.id, "d:x"), (ROOM.id, "d:y"),
                                 (MEL.id, "d:x")])
        store.add_mentions("b", [(MEL.id, "d:x")])
        assert store.drop_scope("a", "d:x") == [MEL.id]
        assert store.load("a") == ([ROOM, PAINT], [("room", ROOM.id)])  # PAINT: no mention
        assert store.drop_scope("a", "d:x") == []
        assert store.drop_scope("a", "d:y") == [ROOM.id]
        assert store.load("a") == ([PAINT], [])
        store.forget("b")
        assert store.drop_scope("b", "d:x") == []

    def test_dropping_facts_deletes_the_entities_only_they_mentioned(self, store):
        store.persist("a", entities=[MEL, ROOM, PAINT], aliases=[("mel", MEL.id)])
        store.add_mentions("a", [(MEL.id, "r:op", "f1"), (ROOM.id, "r:op", "f1"),
                                 (ROOM.id, "r:op", "f2"), (PAINT.id, "r:op")])
        assert store.drop_facts("a", ["f1", "unknown"]) == [MEL.id]
        assert store.load("a") == ([ROOM, PAINT], [])
        assert store.drop_facts("a", ["f1"]) == []
        assert store.drop_facts("a", ["f2"]) == [ROOM.id]
        # a mention in no fact (a cancelled item's) goes with its scope only
        assert store.drop_facts("a", [""]) == [] and store.load("a") == ([PAINT], [])
        assert store.drop_scope("a", "r:op") == [PAINT.id]

    def test_dropping_entities_by_id_deletes_them_whatever_mentions_them(self, store):
        store.persist("a", entities=[MEL, ROOM, PAINT], aliases=[("mel", MEL.id)])
        store.add_mentions("a", [(MEL.id, "d:x", "f1"), (ROOM.id, "d:x", "f1")])
        assert store.drop_entities("a", [MEL.id, PAINT.id, "unknown", MEL.id]) == [
            MEL.id, PAINT.id]
        assert store.load("a") == ([ROOM], [])
        assert store.drop_entities("a", [MEL.id]) == []
        # its mentions went with it: the fact's deletion now takes only ROOM
        assert store.drop_facts("a", ["f1"]) == [ROOM.id]

    def test_rewrite_merges_entities(self, store):
        liz = StoredEntity("e-liz", "liz", "Liz", "PERSON", "person")
        store.persist("a", entities=[MEL, ROOM, liz], aliases=[("mel", MEL.id), ("lizzy", liz.id)])
        store.add_mentions("a", [(MEL.id, "d:x"), (liz.id, "d:y")])
        renamed = StoredEntity(MEL.id, MEL.key, "Mel L.", MEL.label, MEL.kind)
        # liz merged into MEL: MEL takes liz's key and aliases and its mentions' scopes
        store.rewrite("a", entities=[renamed], removed=[liz.id], mentions_of=[(MEL.id, liz.id)],
                      aliases=[("mel", MEL.id), ("liz", MEL.id), ("lizzy", MEL.id)])
        assert store.load("a") == ([renamed, ROOM],
                                   [("mel", MEL.id), ("liz", MEL.id), ("lizzy", MEL.id)])
        # MEL is mentioned by both scopes now: it outlives the deletion of either
        assert store.drop_scope("a", "d:y") == []
        assert store.drop_scope("a", "d:x") == [MEL.id]
        # a second, identical rewrite changes nothing (redelivery)
        store.rewrite("a", entities=[ROOM], aliases=[("room", ROOM.id)])
        store.rewrite("a", entities=[ROOM], aliases=[("room", ROOM.id)])
        assert store.load("a") == ([ROOM], [("room", ROOM.id)])

    def test_rewrite_splits_an_entity(self, store):
        store.persist("a", entities=[MEL], aliases=[("mel", MEL.id), ("melly", MEL.id)])
        store.add_mentions("a", [(MEL.id, "d:x")])
        new = StoredEntity("e-melly", "melly", "Melly", MEL.label, MEL.kind)
        store.rewrite("a", entities=[MEL, new], mentions_of=[(new.id, MEL.id)],
                      aliases=[("mel", MEL.id)])
        assert store.load("a") == ([MEL, new], [("mel", MEL.id)])
        assert sorted(store.drop_scope("a", "d:x")) == sorted([MEL.id, new.id])
        store.rewrite("b")  # nothing to do
        assert store.load("b") == ([], [])


class PersistentEntityStoreSuite(EntityStoreSuite):
    """The contract of an EntityStore whose data outlives ``close`` (same path, same
    data)."""

    reopens = True

    def test_survives_reopen(self, tmp_path):
        s = self.make_entities(tmp_path)
        s.persist("a", entities=[MEL, ROOM], aliases=[("mel", MEL.id)])
        s.persist("b", entities=[PAINT])
        s.forget("b")
        s.close()
        s = self.make_entities(tmp_path)
        try:
            assert s.load("a") == ([MEL, ROOM], [("mel", MEL.id)]) and s.load("b") == ([], [])
            s.persist("a", entities=[PAINT])  # order continues after the reopen
            assert [e.id for e in s.load("a")[0]] == [MEL.id, ROOM.id, PAINT.id]
        finally:
            s.close()
