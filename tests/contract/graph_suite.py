"""Contract of :class:`mneme.ports.GraphStore`, written once; subclass per adapter and
implement ``make_store(path)`` (same path → same data, for reopen tests)."""

from __future__ import annotations

import dataclasses
import random
from datetime import datetime, timedelta, timezone

import pytest

from mneme.domain import (TAGS_MATCH_MODES, EntityRef, Fact, Link, entity_key, tags_filter_set,
                          tags_match)
from mneme.stores import cypher

ALICE = EntityRef("e-alice", "Alice", "PERSON")
BOB = EntityRef("e-bob", "the Bob's", "PERSON")
LYON = EntityRef("e-lyon", "Lyon", "GPE")
PIANO = EntityRef("e-piano", "piano", "CONCEPT")


def unit(uid, bank_id="a", entities=(), links=(), document_id="") -> Fact:
    return Fact(id=uid, bank_id=bank_id, text=f"text of {uid}", entities=list(entities),
                links=list(links), document_id=document_id)


def chain(bank_id="a") -> list[Fact]:
    """u1 -Alice- u2 -Bob- u3 -Lyon- u4, and u5 alone."""
    return [unit("u1", bank_id, [ALICE]), unit("u2", bank_id, [ALICE, BOB]),
            unit("u3", bank_id, [BOB, LYON]), unit("u4", bank_id, [LYON]),
            unit("u5", bank_id)]


def ids(hits):
    return [h.id for h in hits]


class GraphStoreSuite:
    """Shared tests."""

    def make_store(self, path):  # pragma: no cover - abstract
        raise NotImplementedError

    @pytest.fixture
    def store(self, tmp_path):
        s = self.make_store(tmp_path)
        yield s
        s.close()

    # -- units and entities --

    def test_upsert_is_idempotent(self, store):
        store.upsert(chain())
        store.upsert(chain())
        assert store.count("a") == 5
        assert len(store.find_entities("a", ["alice", "bob", "lyon"])) == 3

    def test_find_entities_by_canonical_key(self, store):
        store.upsert(chain())
        assert entity_key(BOB.name) == "bob"
        assert store.find_entities("a", ["bob"]) == [BOB]
        assert store.find_entities("a", ["lyon", "alice", "nobody"]) == [LYON, ALICE]
        assert store.find_entities("a", []) == []

    def test_entity_keeps_former_names_as_aliases(self, store):
        store.upsert([unit("u1", entities=[BOB])])
        robert = dataclasses.replace(BOB, name="Robert")
        store.upsert([unit("u2", entities=[robert])])
        assert [e.id for e in store.find_entities("a", ["bob"])] == [BOB.id]
        assert store.find_entities("a", ["robert"]) == [robert]

    def test_mentions_of_one_entity_in_one_batch_leave_the_last_name_and_every_alias(
            self, store):
        robert, rob = (dataclasses.replace(BOB, name=n) for n in ("Robert", "Rob"))
        store.upsert([unit("u1", entities=[BOB]), unit("u2", entities=[robert]),
                      unit("u3", entities=[rob])])
        got = store.entity("a", BOB.id)
        assert (got.name, set(got.aliases), got.mentions) == ("Rob", {"bob", "robert", "rob"}, 3)
        store.upsert([unit("u4", entities=[BOB])])  # unchanged entity, a new mention
        got = store.entity("a", BOB.id)
        assert (got.name, set(got.aliases), got.mentions) == (BOB.name, {"bob", "robert", "rob"},
                                                             4)

    def test_reupsert_replaces_mentions_and_drops_orphans(self, store):
        store.upsert([unit("u1", entities=[ALICE, PIANO]), unit("u2", entities=[ALICE])])
        store.upsert([unit("u1", entities=[LYON])])
        assert store.find_entities("a", ["piano"]) == []
        assert store.find_entities("a", ["alice", "lyon"]) == [ALICE, LYON]
        assert ids(store.spread("a", {"u1": 1.0}, [], k=10)) == ["u1"]

    def test_delete_removes_unmentioned_entities_only(self, store):
        store.upsert(chain())
        store.delete("a", ["u2"])
        assert store.count("a") == 4
        assert store.find_entities("a", ["alice", "bob"]) == [ALICE, BOB]
        store.delete("a", ["u3", "unknown"])
        assert store.find_entities("a", ["alice", "bob", "lyon"]) == [ALICE, LYON]
        store.delete("a", [])
        assert store.count("a") == 3

    def test_delete_where_document_and_bank(self, store):
        store.upsert([unit("u1", entities=[ALICE], document_id="d1"),
                      unit("u2", entities=[ALICE, BOB], document_id="d2"),
                      unit("u3", entities=[PIANO], document_id="d1")] + chain("b"))
        store.delete_where("a", "d1")
        assert store.count("a") == 1
        assert store.find_entities("a", ["alice", "bob", "piano"]) == [ALICE, BOB]
        store.delete_where("a")
        assert store.count("a") == 0
        assert store.find_entities("a", ["alice", "bob"]) == []
        assert store.count("b") == 5 and len(store.find_entities("b", ["alice"])) == 1

    def test_count_entities_per_bank_follows_deletes(self, store):
        assert store.count_entities("a") == 0
        store.upsert([unit("u1", entities=[ALICE, LYON]), unit("u2", entities=[ALICE, BOB]),
                      unit("u9", bank_id="b", entities=[PIANO])])
        assert (store.count_entities("a"), store.count_entities("b")) == (3, 1)
        store.delete("a", ["u1"])  # LYON is mentioned by nothing else
        assert store.count_entities("a") == 2
        store.delete_where("a")
        assert (store.count_entities("a"), store.count_entities("b")) == (0, 1)

    def test_entities_page_in_id_order_with_live_mention_counts(self, store):
        store.upsert(chain() + [unit("u9", bank_id="b", entities=[PIANO])])
        got = store.entities("a", 10)
        assert [(e.id, e.name, e.label, e.mentions) for e in got] == [
            (ALICE.id, "Alice", "PERSON", 2), (BOB.id, BOB.name, "PERSON", 2),
            (LYON.id, "Lyon", "GPE", 2)]
        assert got[1].aliases == (entity_key(BOB.name),) and got[1].units == ()
        first = store.entities("a", 2)
        assert [e.id for e in first] == [ALICE.id, BOB.id]
        assert [e.id for e in store.entities("a", 2, after=first[-1].id)] == [LYON.id]
        assert store.entities("a", 2, after=LYON.id) == []
        assert [e.id for e in store.entities("b", 10)] == [PIANO.id]
        store.delete("a", ["u1"])
        assert [(e.id, e.mentions) for e in store.entities("a", 10)][0] == (ALICE.id, 1)
        with pytest.raises(ValueError):
            store.entities("a", 0)

    def test_entity_with_units_most_recent_first_and_co_mentioned_neighbours(self, store):
        t0 = datetime(2024, 1, 1, tzinfo=timezone.utc)
        units = [dataclasses.replace(unit(f"u{i}", entities=ents), occurred_start=t0 + timedelta(days=i))
                 for i, ents in enumerate([[ALICE, BOB], [ALICE, BOB, LYON], [ALICE, PIANO],
                                           [BOB]])]
        store.upsert(units)
        alice = store.entity("a", ALICE.id)
        assert (alice.name, alice.label, alice.mentions) == ("Alice", "PERSON", 3)
        assert alice.units == ("u2", "u1", "u0")
        assert alice.neighbours == ((BOB.id, BOB.name, "PERSON", 2), (LYON.id, "Lyon", "GPE", 1),
                                    (PIANO.id, "piano", "CONCEPT", 1))
        capped = store.entity("a", ALICE.id, units=1, neighbours=1)
        assert (capped.units, [n[0] for n in capped.neighbours], capped.mentions) == (
            ("u2",), [BOB.id], 3)
        robert = dataclasses.replace(BOB, name="Robert")
        store.upsert([unit("u7", entities=[robert])])
        bob = store.entity("a", BOB.id)
        assert bob.name == "Robert" and set(bob.aliases) == {"bob", "robert"}
        assert store.entity("a", "nobody") is None
        assert store.entity("b", ALICE.id) is None

    def test_entity_first_and_last_seen_over_live_mentions(self, store):
        t0 = datetime(2024, 1, 1, tzinfo=timezone.utc)
        day = timedelta(days=1)
        store.upsert([
            # told on day 3 about day 0: the time told counts
            dataclasses.replace(unit("u1", entities=[ALICE]), mentioned_at=t0 + 3 * day,
                                occurred_start=t0),
            dataclasses.replace(unit("u2", entities=[ALICE, BOB]), mentioned_at=t0 + day),
            # told at no known time: when it happened counts
            dataclasses.replace(unit("u3", entities=[ALICE]), occurred_start=t0 + 7 * day),
            unit("u4", entities=[LYON]),  # neither
        ])
        seen = lambda e: (e.first_seen, e.last_seen)  # noqa: E731
        assert seen(store.entity("a", ALICE.id)) == (t0 + day, t0 + 7 * day)
        assert seen(store.entity("a", BOB.id)) == (t0 + day, t0 + day)
        assert seen(store.entity("a", LYON.id)) == (None, None)
        assert {e.id: seen(e) for e in store.entities("a", 10)} == {
            ALICE.id: (t0 + day, t0 + 7 * day), BOB.id: (t0 + day, t0 + day),
            LYON.id: (None, None)}
        store.delete("a", ["u3", "u2"])
        assert seen(store.entity("a", ALICE.id)) == (t0 + 3 * day, t0 + 3 * day)
        assert seen(store.entities("a", 1)[0]) == (t0 + 3 * day, t0 + 3 * day)

    # -- tag-scoped entity reads --

    #: (unit id, tags, entities, day): alice's, bob's, one shared by both, an untagged one
    TAGGED = (("t1", ("user:alice",), (ALICE, LYON), 1),
              ("t2", ("user:alice", "work"), (ALICE, BOB), 2),
              ("t3", ("user:bob",), (BOB, LYON), 3),
              ("t4", ("user:bob",), (PIANO,), 4),
              ("t5", (), (LYON, BOB), 5),
              ("t6", ("user:alice", "user:bob"), (ALICE, PIANO), 6))
    FILTERS = [((), mode) for mode in TAGS_MATCH_MODES] + [
        (t, mode) for t in (("user:alice",), ("user:bob", "user:alice"), ("work", "user:alice"),
                            ("nobody",), ("user:alice", "user:alice"))
        for mode in TAGS_MATCH_MODES]

    def _tagged(self, store):
        t0 = datetime(2024, 1, 1, tzinfo=timezone.utc)
        store.upsert([dataclasses.replace(unit(uid, entities=ents), tags=tags,
                                          mentioned_at=t0 + timedelta(days=d),
                                          occurred_start=t0 + timedelta(days=d))
                      for uid, tags, ents, d in self.TAGGED])
        return t0

    def _expected(self, t0, tags, mode, ents=(ALICE, BOB, LYON, PIANO)):
        """Per entity id: (mentions, first seen, last seen, units most recent first), by
        the reference semantics (mneme.domain.tags_match), for those a match mentions."""
        out = {}
        for e in ents:
            days = sorted((d for uid, ut, es, d in self.TAGGED
                           if e in es and tags_match(ut, tags, mode)), reverse=True)
            if days:
                out[e.id] = (len(days), t0 + timedelta(days=days[-1]),
                             t0 + timedelta(days=days[0]), tuple(f"t{d}" for d in days))
        return out

    def test_entity_reads_scoped_by_tags_match_the_reference_semantics(self, store):
        t0 = self._tagged(store)
        store.upsert([dataclasses.replace(unit("x1", bank_id="b", entities=[ALICE]),
                                          tags=("user:alice",))])
        for tags, mode in self.FILTERS:
            want = self._expected(t0, tags, mode)
            listed = {e.id: (e.mentions, e.first_seen, e.last_seen)
                      for e in store.entities("a", 10, tags=tags, tags_match=mode)
                      if e.mentions}
            assert listed == {i: w[:3] for i, w in want.items()}, (tags, mode)
            for e in (ALICE, BOB, LYON, PIANO):
                got = store.entity("a", e.id, tags=tags, tags_match=mode)
                if e.id not in want:
                    assert got.mentions == 0 and got.units == () and got.neighbours == (), (
                        tags, mode, e)
                    continue
                assert (got.mentions, got.first_seen, got.last_seen, got.units) == want[e.id], (
                    tags, mode, e)
                # neighbours: the entities sharing a matching unit, counted over those
                shared = {}
                for uid, ut, es, _ in self.TAGGED:
                    if e in es and tags_match(ut, tags, mode):
                        for o in es:
                            if o != e:
                                shared[o.id] = shared.get(o.id, 0) + 1
                assert {n[0]: n[3] for n in got.neighbours} == shared, (tags, mode, e)
        # the page is the next entities in id order, those without a matching unit at 0
        page = store.entities("a", 2, tags=("user:bob",), tags_match="any_strict")
        assert [(e.id, e.mentions) for e in page] == [(ALICE.id, 1), (BOB.id, 1)]
        assert [e.id for e in store.entities("b", 10, tags=("user:alice",),
                                             tags_match="any_strict")] == [ALICE.id]
        with pytest.raises(ValueError):
            store.entities("a", 10, tags=("x",), tags_match="some")
        with pytest.raises(ValueError):
            store.entity("a", ALICE.id, tags=("x",), tags_match="some")

    def test_unit_tags_follow_reupserts_deletes_merges_and_splits(self, store):
        t0 = self._tagged(store)
        alice_only = dict(tags=("user:alice",), tags_match="any_strict")
        count = lambda eid: store.entity("a", eid, **alice_only).mentions  # noqa: E731
        assert (count(ALICE.id), count(BOB.id), count(LYON.id)) == (3, 1, 1)
        store.merge_entities("a", ALICE.id, [LYON.id])  # t3 (bob's) moves too
        assert store.entity("a", ALICE.id, **alice_only).units == ("t6", "t2", "t1")
        assert store.entity("a", ALICE.id).mentions == 5
        store.split_entity("a", ALICE.id, "e-lyon2", [], "Lyon", ["t1", "t3", "t5"])
        assert store.entity("a", "e-lyon2", **alice_only).units == ("t1",)
        assert store.entity("a", "e-lyon2").mentions == 3
        store.delete("a", ["t1"])
        assert store.entity("a", "e-lyon2", **alice_only).mentions == 0
        # a re-upsert with other tags (a replaced document) rewrites them
        store.upsert([dataclasses.replace(unit("t3", entities=[BOB]), tags=("user:alice",),
                                          mentioned_at=t0)])
        assert store.entity("a", BOB.id, **alice_only).units == ("t2", "t3")
        assert store.entity("a", BOB.id, tags=("user:bob",),
                            tags_match="any_strict").mentions == 0

    def test_units_without_tags_in_the_graph_match_no_tag_filter(self, store):
        """Units projected before the graph kept tags (no ``tags`` property) until a
        replay: their tags are unknown, so no scoped read counts them, not even in the
        modes where a unit with no tags passes (any, all, exact with no tags); unscoped
        reads count them as before."""
        self._tagged(store)
        store._write(lambda run: run(
            "MATCH (n:Unit {bank_id: $bank_id}) WHERE n.id IN $ids SET n.tags = null",
            {"bank_id": "a", "ids": ["t2", "t5"]}))
        for tags, mode in self.FILTERS:
            if not tags_filter_set(tags, mode):
                continue
            units = store.entity("a", BOB.id, tags=tags, tags_match=mode).units
            assert "t2" not in units and "t5" not in units, (tags, mode)
        assert store.entity("a", BOB.id, tags=("user:alice",), tags_match="any").mentions == 0
        assert store.entity("a", BOB.id).mentions == 3

    def test_opening_a_graph_with_units_without_tags_warns_to_replay(self, tmp_path, caplog):
        s = self.make_store(tmp_path)
        try:
            self._tagged(s)
            s._write(lambda run: run("MATCH (n:Unit {bank_id: $bank_id, id: 't3'}) "
                                     "SET n.tags = null", {"bank_id": "a"}))
        finally:
            s.close()
        with caplog.at_level("WARNING", logger="mneme.stores.graph_cypher"):
            s = self.make_store(tmp_path)
        try:
            assert "mneme replay" in caplog.text and "'a'" in caplog.text
            s.upsert([dataclasses.replace(unit("t3", entities=[BOB]), tags=("user:bob",))])
            assert s._check_unit_tags() is None  # the replay's upsert wrote them
        finally:
            s.close()

    def test_merge_entities_moves_mentions_and_unites_aliases(self, store):
        liz = EntityRef("e-liz", "Liz", "PERSON")
        store.upsert(chain() + [unit("u6", entities=[liz, LYON]), unit("u7", entities=[liz, ALICE]),
                                unit("u9", bank_id="b", entities=[liz])])
        store.merge_entities("a", ALICE.id, [liz.id, ALICE.id], display_name="Alice Liddell")
        alice = store.entity("a", ALICE.id)
        assert (alice.name, alice.label, alice.mentions) == ("Alice Liddell", "PERSON", 4)
        assert set(alice.units) == {"u1", "u2", "u6", "u7"}
        assert set(alice.aliases) == {"alice", "liz", "alice liddell"}
        assert store.entity("a", liz.id) is None
        assert store.entity("b", liz.id).mentions == 1  # another bank's is untouched
        assert [e.id for e in store.find_entities("a", ["liz"])] == [ALICE.id]
        assert (LYON.id, "Lyon", "GPE", 1) in alice.neighbours
        # spreading activation follows the moved edges: u6 reaches u1 through Alice
        assert "u1" in ids(store.spread("a", {"u6": 1.0}, [], k=10))
        before = store.entity("a", ALICE.id)
        store.merge_entities("a", ALICE.id, [liz.id], display_name="Alice Liddell")  # again
        assert store.entity("a", ALICE.id) == before
        store.merge_entities("a", "nobody", ["nothing"])  # nothing exists: no change
        assert store.count_entities("a") == 3

    def test_a_merge_into_a_survivor_gone_meanwhile_changes_nothing(self, store):
        """Two merges checked at once: Lyon into Alice applies first, then Bob into Lyon
        (checked while Lyon still existed). The second must not bring Lyon back and take
        Bob with it: entity resolution, which sees the same merges in the same order,
        ignores a merge whose survivor it no longer knows."""
        store.upsert(chain())
        store.merge_entities("a", ALICE.id, [LYON.id])
        before = sorted((e.id, tuple(sorted(e.aliases))) for e in store.entities("a", 100))
        store.merge_entities("a", LYON.id, [BOB.id], display_name="Lyon City")
        assert store.entity("a", LYON.id) is None
        assert store.entity("a", BOB.id).aliases == ("bob",)
        assert sorted((e.id, tuple(sorted(e.aliases)))
                      for e in store.entities("a", 100)) == before

    def test_merge_applies_again_after_a_redelivered_older_fact(self, store):
        liz = EntityRef("e-liz", "Liz", "PERSON")
        store.upsert([unit("u1", entities=[ALICE]), unit("u2", entities=[liz])])
        store.merge_entities("a", ALICE.id, [liz.id])
        store.upsert([unit("u2", entities=[liz])])  # redelivered before the merge is
        store.merge_entities("a", ALICE.id, [liz.id])
        alice = store.entity("a", ALICE.id)
        assert (alice.mentions, set(alice.aliases), alice.name) == (2, {"alice", "liz"}, "Alice")
        assert store.entity("a", liz.id) is None

    def test_split_entity_moves_aliases_and_the_listed_mentions(self, store):
        store.upsert(chain())
        robert = dataclasses.replace(BOB, name="Robert")
        store.upsert([unit("u6", entities=[robert]), unit("u7", entities=[robert, LYON])])
        assert set(store.entity("a", BOB.id).aliases) == {"bob", "robert"}
        store.split_entity("a", BOB.id, "e-rob", ["robert"], "Robert Smith", ["u6", "u7", "u1"])
        bob, rob = store.entity("a", BOB.id), store.entity("a", "e-rob")
        assert (bob.aliases, bob.mentions, set(bob.units)) == (("bob",), 2, {"u2", "u3"})
        assert (rob.name, rob.label, set(rob.aliases)) == ("Robert Smith", "PERSON",
                                                          {"robert", "robert smith"})
        assert (rob.mentions, set(rob.units)) == (2, {"u6", "u7"})  # u1 did not mention Bob
        assert [e.id for e in store.find_entities("a", ["robert"])] == ["e-rob"]
        assert store.entity("a", ALICE.id).mentions == 2
        store.split_entity("a", BOB.id, "e-rob", ["robert"], "Robert Smith", ["u6", "u7"])
        assert (store.entity("a", BOB.id), store.entity("a", "e-rob")) == (bob, rob)
        # asked to move every alias, the entity keeps its key
        store.split_entity("a", "e-rob", "e-rs", ["robert smith", "robert"], "R. S.", [])
        rob = store.entity("a", "e-rob")
        assert rob.aliases == ("robert smith",) and rob.mentions == 2
        rs = store.entity("a", "e-rs")
        assert (rs.name, rs.mentions, set(rs.aliases)) == ("R. S.", 0, {"r s", "robert"})
        # the entity's own key moving: its remaining alias becomes its key
        store.split_entity("a", BOB.id, "e-bo", ["bob"], "Bo", [])
        assert store.entity("a", BOB.id).aliases == ("bob",)  # its only one: kept
        store.upsert([unit("u8", entities=[dataclasses.replace(BOB, name="Bobby")])])
        store.split_entity("a", BOB.id, "e-bo", ["bob"], "Bo", ["u8"])
        bob = store.entity("a", BOB.id)
        assert (bob.aliases, bob.mentions) == (("bobby",), 2)
        assert store.find_entities("a", ["bob"])[0].id == "e-bo"
        store.split_entity("a", "nobody", "e-x", ["x"], "X", ["u1"])
        assert store.entity("a", "e-x") is None

    # -- the live graph after deletions is the graph a replay builds --
    # A replay of the log never sees deleted content (its keys were destroyed: the facts
    # are erased), so the graph it builds is the one these writes build with the facts
    # deleted by the end left out. The live graph must end the same: no entity kept
    # only by what was deleted (its names are user content, listed by ListEntities).

    def _live_and_replayed(self, tmp_path, steps) -> tuple[list, list]:
        """Run ``steps`` [(method, args)] on a store, and on another with the facts that
        some delete (by id or document) removes left out: both stores' entities."""
        gone = {i for m, a in steps if m == "delete" for i in a[1]}
        docs = {a[1] for m, a in steps if m == "delete_where"}
        gone |= {f.id for m, a in steps if m == "upsert" for f in a[0] if f.document_id in docs}
        out = []
        for name, erased in (("live", set()), ("replay", gone)):
            s = self.make_store(tmp_path / name)
            try:
                for method, args in steps:
                    if method == "upsert":
                        args = ([f for f in args[0] if f.id not in erased],)
                    getattr(s, method)(*args)
                out.append([(e.id, e.name, e.label, e.aliases, e.mentions)
                            for e in s.entities("a", 100)])
            finally:
                s.close()
        return out[0], out[1]

    def test_an_entity_split_off_by_name_goes_with_the_entity_it_was_split_off(self, tmp_path):
        liz = dataclasses.replace(ALICE, name="Liz")
        live, replayed = self._live_and_replayed(tmp_path, [
            ("upsert", ([unit("u1", entities=[ALICE, LYON], document_id="d1"),
                         unit("u2", entities=[liz], document_id="d1"),
                         unit("u3", entities=[LYON], document_id="d2")],)),
            ("split_entity", ("a", ALICE.id, "e-lizzy", ["liz"], "Lizzy", [])),
            ("delete_where", ("a", "d1"))])
        assert live == replayed, (live, replayed)
        assert live == [(LYON.id, "Lyon", "GPE", ("lyon",), 1)]

    def test_a_split_entity_whose_memories_were_deleted_stays_while_its_origin_does(
            self, tmp_path):
        live, replayed = self._live_and_replayed(tmp_path, [
            ("upsert", ([unit("u1", entities=[ALICE]), unit("u2", entities=[ALICE, LYON])],)),
            ("split_entity", ("a", ALICE.id, "e-al", [], "Al", ["u2"])),
            ("delete", ("a", ["u2"]))])
        assert live == replayed, (live, replayed)
        assert live == [("e-al", "Al", "PERSON", ("al",), 0),
                        (ALICE.id, "Alice", "PERSON", ("alice",), 1)]
        live, replayed = self._live_and_replayed(tmp_path / "2", [
            ("upsert", ([unit("u1", entities=[ALICE]), unit("u2", entities=[ALICE, LYON])],)),
            ("split_entity", ("a", ALICE.id, "e-al", [], "Al", ["u2"])),
            ("split_entity", ("a", "e-al", "e-al2", [], "Al Two", [])),
            ("delete", ("a", ["u1", "u2"]))])
        assert live == replayed, (live, replayed)
        assert live == []  # the origin went, and with it what was split off

    def test_an_entity_split_off_one_merged_away_goes_with_the_survivor(self, tmp_path):
        liz = EntityRef("e-liz", "Liz", "PERSON")
        live, replayed = self._live_and_replayed(tmp_path, [
            ("upsert", ([unit("u1", entities=[ALICE], document_id="d1"),
                         unit("u2", entities=[liz], document_id="d1"),
                         unit("u3", entities=[LYON])],)),
            ("split_entity", ("a", liz.id, "e-lizzy", [], "Lizzy", [])),
            ("merge_entities", ("a", ALICE.id, [liz.id])),
            ("delete_where", ("a", "d1"))])
        assert live == replayed, (live, replayed)
        assert live == [(LYON.id, "Lyon", "GPE", ("lyon",), 1)]

    def test_delete_where_rejects_empty_document_id(self, store):
        store.upsert(chain())
        with pytest.raises(ValueError):
            store.delete_where("a", "")
        assert store.count("a") == 5

    # -- spreading activation --

    def test_spread_follows_shared_entities_with_hop_decay(self, store):
        store.upsert(chain())
        hits = store.spread("a", {"u1": 1.0}, [], k=10, hops=2, decay=0.5)
        assert ids(hits) == ["u1", "u2", "u3"]
        assert [h.score for h in hits] == pytest.approx([1.0, 0.5, 0.25])
        assert ids(store.spread("a", {"u1": 1.0}, [], k=10, hops=3)) == ["u1", "u2", "u3", "u4"]
        assert ids(store.spread("a", {"u1": 1.0}, [], k=10, hops=0)) == ["u1"]

    def test_spread_returns_k_best_and_keeps_seed_activation(self, store):
        store.upsert(chain())
        hits = store.spread("a", {"u1": 0.8, "u4": 0.3}, [], k=2, hops=2)
        assert ids(hits) == ["u1", "u2"]
        assert hits[0].score == pytest.approx(0.8)
        assert store.spread("a", {"u1": 1.0}, [], k=0) == []

    def test_spread_from_query_entities(self, store):
        store.upsert(chain())
        hits = store.spread("a", {}, [LYON.id], k=10, hops=1)
        assert set(ids(hits[:2])) == {"u3", "u4"}
        assert ids(hits[2:]) == ["u2"]
        assert hits[2].score < hits[1].score
        assert store.spread("a", {}, ["no-such-entity"], k=10) == []

    def test_spread_follows_links_both_ways_by_weight(self, store):
        store.upsert([unit("u1", links=[Link("u2", "causal", 0.8), Link("u3", "temporal", 0.2)]),
                      unit("u2"), unit("u3")])
        hits = store.spread("a", {"u1": 1.0}, [], k=10, hops=1, decay=0.5)
        assert ids(hits) == ["u1", "u2", "u3"]
        assert [h.score for h in hits] == pytest.approx([1.0, 0.4, 0.1])
        back = store.spread("a", {"u2": 1.0}, [], k=10, hops=1)
        assert ids(back) == ["u2", "u1"]

    def test_link_to_a_missing_unit_is_filled_when_it_arrives(self, store):
        store.upsert([unit("u1", links=[Link("u9", "causal", 1.0)])])
        assert store.count("a") == 1
        assert ids(store.spread("a", {"u1": 1.0}, [], k=10)) == ["u1"]
        store.upsert([unit("u9")])
        assert store.count("a") == 2
        assert ids(store.spread("a", {"u1": 1.0}, [], k=10)) == ["u1", "u9"]
        store.delete("a", ["u9"])  # still linked from u1: never returned, not counted
        assert store.count("a") == 1
        assert ids(store.spread("a", {"u1": 1.0}, [], k=10)) == ["u1"]
        store.upsert([unit("u9")])  # and the link is back when it returns
        assert ids(store.spread("a", {"u1": 1.0}, [], k=10)) == ["u1", "u9"]

    def test_hub_entities_pass_less_activation(self, store):
        hub = EntityRef("e-hub", "Paris", "GPE")
        rare = EntityRef("e-rare", "Zanzibar", "GPE")
        store.upsert([unit("src", entities=[hub, rare]), unit("r", entities=[rare])]
                     + [unit(f"h{i:02d}", entities=[hub]) for i in range(30)])
        hits = store.spread("a", {"src": 1.0}, [], k=5, hops=1)
        assert ids(hits)[:2] == ["src", "r"]
        assert hits[1].score == pytest.approx(0.5)
        assert all(h.score < 0.5 for h in hits[2:])

    # -- the in-memory adjacency (mneme.stores.graph_cypher.Adjacency) --

    def _random_bank(self, store, rng: random.Random, bank_id: str = "a") -> list[str]:
        """120 units over 25 entities (some hubs), links to units that may never arrive
        (stubs), then deletes and re-upserts with renamed entities; returns the unit ids
        ever written."""
        ents = [EntityRef(f"e{i}", f"Name {i}", "PERSON") for i in range(25)]
        day = datetime(2024, 1, 1, tzinfo=timezone.utc)

        def fact(i: int, names: int = 0) -> Fact:
            picked = rng.sample(ents[:5], rng.randint(0, 2)) + rng.sample(ents, rng.randint(0, 3))
            picked = [dataclasses.replace(e, name=f"{e.name} v{names}") for e in picked]
            return Fact(id=f"u{i}", bank_id=bank_id, text=f"t{i}", entities=picked,
                        occurred_start=rng.choice([None, day + timedelta(days=rng.randrange(9))]),
                        links=[Link(f"u{rng.randrange(140)}", rng.choice(["causal", "temporal"]),
                                    rng.choice([0.2, 0.5, 1.0])) for _ in range(rng.randint(0, 3))])
        store.upsert([fact(i) for i in range(120)])
        store.delete(bank_id, [f"u{i}" for i in rng.sample(range(120), 15)])
        store.upsert([fact(i, names=1) for i in rng.sample(range(120), 20)])
        return [f"u{i}" for i in range(140)]

    def test_adjacency_in_memory_answers_as_cypher(self, store):
        """Spread and entity lookup from the in-memory copy equal the hop-by-hop Cypher
        answers on a random bank with hubs, stubs, deletes and renames."""
        from mneme.stores import graph_cypher as gc
        rng = random.Random(11)
        units = self._random_bank(store, rng)
        self._random_bank(store, random.Random(12), bank_id="b")  # same ids, other bank
        for _ in range(gc.SNAPSHOT_AFTER):
            adjacency = store.adjacency("a")
        assert isinstance(adjacency, gc.Adjacency)
        assert store.snapshot_stats["builds"] == 1
        entity_ids = [f"e{i}" for i in range(25)] + ["e-none"]
        for trial in range(40):
            seeds = {u: rng.choice([1.0, 0.6, 0.3]) for u in rng.sample(units, rng.randint(0, 4))}
            ents = rng.sample(entity_ids, rng.randint(0, 3))
            k, hops = rng.choice([1, 5, 20]), rng.choice([0, 1, 2, 3])
            by_cypher = store._read(lambda run: store._spread(run, "a", seeds, ents, k, hops, 0.5))
            in_memory = gc._spread_from(adjacency, seeds, ents, k, hops, 0.5)
            top = sorted(by_cypher.items(), key=lambda kv: (-kv[1], kv[0]))[:k]
            # in memory, work that cannot reach the top k is skipped: the top k agree
            top_in_memory = sorted(in_memory.items(), key=lambda kv: (-kv[1], kv[0]))[:k]
            assert [u for u, _ in top_in_memory] == [u for u, _ in top], (seeds, ents, hops)
            assert [a for _, a in top_in_memory] == pytest.approx([a for _, a in top])
            hits = store.spread("a", seeds, ents, k=k, hops=hops, decay=0.5)
            assert [(h.id, pytest.approx(h.score)) for h in hits] == top
        keys = [entity_key(f"Name {i} v{v}") for i in range(25) for v in (0, 1)] + ["nobody"]
        for _ in range(10):
            ks = rng.sample(keys, rng.randint(1, 6))
            by_cypher = store._read(lambda run: run(cypher.FIND_ENTITIES,
                                                    {"bank_id": "a", "keys": ks}))
            assert sorted(map(tuple, adjacency.find_entities(ks))) == sorted(
                (r[0], r[1] or "", r[2] or "", r[3] or "") for r in by_cypher)
        assert store.snapshot_stats["hits"] == 40 and store.snapshot_stats["builds"] == 1

    def test_a_hub_entity_gives_its_degree_and_most_recent_units(self, store):
        """With a fanout below the hubs' degrees, the hop-by-hop queries keep each entity's
        fanout most recent units (then by id) and its full degree, as the in-memory copy
        does; ``entity`` lists its live units in the same order."""
        from mneme.stores import graph_cypher as gc
        store.fanout = 3
        rng = random.Random(5)
        units = self._random_bank(store, rng)
        for _ in range(gc.SNAPSHOT_AFTER):
            adjacency = store.adjacency("a")
        assert isinstance(adjacency, gc.Adjacency)
        entity_ids = [f"e{i}" for i in range(25)] + ["e-none"]
        view = lambda run: gc._CypherView(run, "a", store.fanout)  # noqa: E731
        by_cypher = store._read(lambda run: list(view(run).entity_units(entity_ids)))
        in_memory = list(adjacency.entity_units(entity_ids))
        assert [(d, list(u)) for d, u in by_cypher] == [(d, list(u)) for d, u in in_memory]
        assert max(d for d, _ in by_cypher) > store.fanout  # hubs were cut to the fanout
        frontier = rng.sample(units, 30)
        hop = store._read(lambda run: [(sorted(s), list(u), w)
                                       for s, u, w in view(run).neighbours(frontier)])
        assert sorted(hop) == sorted((sorted(s), list(u), w)
                                     for s, u, w in adjacency.neighbours(frontier))
        mentioned = [e for e in entity_ids if e in adjacency.mentions]
        for eid, (degree, recent) in zip(mentioned, in_memory, strict=True):
            info = store.entity("a", eid, units=store.fanout)
            assert info.mentions == degree and list(info.units) == list(recent)

    def test_adjacency_is_replaced_after_every_write(self, store):
        """A write renews the bank's token: the next reads answer from the graph as it
        is now (by Cypher until a new copy is made), never from the old copy."""
        from mneme.stores import graph_cypher as gc
        store.upsert(chain())
        for _ in range(gc.SNAPSHOT_AFTER + 1):
            assert ids(store.spread("a", {"u1": 1.0}, [], k=10, hops=3)) == ["u1", "u2", "u3", "u4"]
        assert store.snapshot_stats["hits"] >= 1
        store.delete("a", ["u3"])
        assert ids(store.spread("a", {"u1": 1.0}, [], k=10, hops=3)) == ["u1", "u2"]
        store.upsert([unit("u5", entities=[ALICE])])
        for _ in range(gc.SNAPSHOT_AFTER + 1):
            assert ids(store.spread("a", {"u1": 1.0}, [], k=10, hops=1)) == ["u1", "u2", "u5"]
            assert [e.id for e in store.find_entities("a", [entity_key("Alice")])] == [ALICE.id]
        store.delete_where("a", None)
        assert store.spread("a", {"u1": 1.0}, [], k=10) == []
        assert store.find_entities("a", [entity_key("Alice")]) == []
        assert store.snapshot_stats["builds"] >= 2

    def test_bank_isolation(self, store):
        store.upsert(chain("a"))
        other = [unit("b1", "b", [ALICE, LYON]), unit("b2", "b", [LYON]),
                 unit("b3", "b", links=[Link("u1", "causal", 1.0)])]
        store.upsert(other)
        reached = store.spread("a", {"u1": 1.0, "b1": 1.0}, [ALICE.id, LYON.id], k=50, hops=3)
        assert set(ids(reached)) == {"u1", "u2", "u3", "u4"}
        assert ids(store.spread("b", {"b3": 1.0}, [], k=50, hops=3)) == ["b3"]
        assert store.count("a") == 5 and store.count("b") == 3
        assert store.find_entities("b", ["bob"]) == []
        store.delete("b", ["u1", "u2"])
        store.delete_where("b")
        assert store.count("a") == 5 and len(store.find_entities("a", ["alice"])) == 1

    # -- lifecycle --

    def test_persists_across_reopen(self, tmp_path):
        s = self.make_store(tmp_path)
        s.upsert(chain())
        s.delete("a", ["u5"])
        s.close()
        s2 = self.make_store(tmp_path)
        try:
            assert s2.count("a") == 4
            assert s2.find_entities("a", ["bob"]) == [BOB]
            assert ids(s2.spread("a", {"u1": 1.0}, [], k=10)) == ["u1", "u2", "u3"]
        finally:
            s2.close()

    def test_reset_drops_every_bank(self, store):
        store.upsert(chain("a") + chain("b"))
        store.reset()
        assert store.count("a") == store.count("b") == 0
        assert store.find_entities("a", ["alice"]) == []
        store.upsert(chain("a"))
        assert store.count("a") == 5
