"""Contract of :class:`mneme.ports.ObservationStore`, written once; subclass per adapter
and implement ``make_observations(path)`` (same path → same data where it persists)."""

from __future__ import annotations

import pytest

from mneme.events.v1 import events_pb2 as ev


def fact(i: str, doc: str = "", text: str = "", tags=()) -> ev.Fact:
    return ev.Fact(id=i, text=text or f"fact {i}", document_id=doc, tags=list(tags),
                   metadata={"k": "v"}, embedding=[0.25, 0.5])


def obs(i: str, version: int, scope=(), text: str = "", deleted: bool = False) -> ev.Observation:
    return ev.Observation(id=i, version=version, scope=list(scope), text=text or f"obs {i} v{version}",
                          deleted=deleted, proof_count=version,
                          evidence=[ev.Evidence(memory_id="f1", quote="q")])


def changed(bank="a", observations=(), consolidated=(), reset=()) -> ev.ObservationsChanged:
    return ev.ObservationsChanged(bank_id=bank, observations=list(observations),
                                  consolidated_memory_ids=list(consolidated),
                                  reset_memory_ids=list(reset))


class ObservationStoreSuite:
    def make_observations(self, path):  # pragma: no cover - abstract
        raise NotImplementedError

    @pytest.fixture
    def store(self, tmp_path):
        s = self.make_observations(tmp_path)
        yield s
        s.close()

    def ids(self, pairs):
        return [f.id for f, _ in pairs]

    def test_flush_keeps_every_write(self, store):
        """flush() makes the writes so far durable and changes nothing they read as."""
        store.add_facts("a", [(fact("f1"), [[]])])
        store.apply(changed(observations=[obs("o1", 1)], consolidated=["f1"]))
        store.flush()
        store.flush()  # again: nothing to do
        store.add_facts("a", [(fact("f2"), [[]])])
        assert self.ids(store.facts("a")) == ["f1", "f2"]
        assert store.counts("a") == (2, 1, 1)

    # -- facts --

    def test_facts_in_arrival_order_with_scopes(self, store):
        store.add_facts("a", [(fact("f2", tags=["x"]), [["x"]]), (fact("f1"), [[]])])
        store.add_facts("a", [(fact("f3"), [["p", "q"], []])])
        got = store.facts("a")
        assert self.ids(got) == ["f2", "f1", "f3"]
        assert got[0] == (fact("f2", tags=["x"]), [["x"]]) and got[2][1] == [["p", "q"], []]
        assert self.ids(store.facts("a", ["f3", "f2", "missing"])) == ["f2", "f3"]
        assert store.facts("a", []) == [] and store.facts("other") == []

    def test_facts_by_many_ids_in_arrival_order_across_batches_and_banks(self, store):
        """More ids than one query can bind (500), asked in another order than they came,
        with another bank's facts of the same ids in between."""
        import random
        order = [f"f{i:04d}" for i in range(1200)]
        random.Random(7).shuffle(order)
        for i in range(0, 1200, 400):
            store.add_facts("a", [(fact(x), [[]]) for x in order[i:i + 400]])
            store.add_facts("b", [(fact(x), [[]]) for x in order[i:i + 10]])
        store.apply(changed(consolidated=order[::3]))
        asked = sorted(order[:1100], reverse=True) + ["missing", order[0]]
        assert self.ids(store.facts("a", asked)) == order[:1100]
        assert self.ids(store.facts("a", asked, pending=True)) == [
            x for n, x in enumerate(order[:1100]) if n % 3]
        assert self.ids(store.facts("a", pending=True)) == [x for n, x in enumerate(order) if n % 3]
        assert len(store.facts("b", asked)) == 30

    def test_known_fact_keeps_its_data_and_state(self, store):
        store.add_facts("a", [(fact("f1", text="first"), [["x"]])])
        store.apply(changed(consolidated=["f1"]))
        store.add_facts("a", [(fact("f1", text="second"), [["y"]])])  # redelivery
        ((f, scopes),) = store.facts("a")
        assert f.text == "first" and scopes == [["x"]]
        assert store.facts("a", pending=True) == []

    def test_banks_are_isolated(self, store):
        store.add_facts("a", [(fact("f1"), [[]])])
        store.add_facts("b", [(fact("f1", text="in b"), [[]])])
        store.apply(changed("b", [obs("o1", 1)]))
        assert store.facts("a")[0][0].text == "fact f1" and store.facts("b")[0][0].text == "in b"
        assert store.observations("a") == {} and list(store.observations("b")) == ["o1"]

    def test_facts_by_id_and_document(self, store):
        store.add_facts("a", [(fact("f1", "d1"), [[]]), (fact("f2", "d2"), [[]]),
                              (fact("f3", "d1"), [[]])])
        assert store.facts_by_id("a", ["f3", "f1", "nope"]) == {"f3": fact("f3", "d1"),
                                                                  "f1": fact("f1", "d1")}
        many = [f"m{i:04d}" for i in range(1200)]  # past SQLite's host-parameter bound
        store.add_facts("a", [(fact(i), [[]]) for i in many])
        assert len(store.facts_by_id("a", many + ["f2"])) == 1201
        assert store.fact_ids_of_document("a", "d1") == ["f1", "f3"]
        assert store.fact_ids_of_document("a", "none") == []

    def test_delete_facts(self, store):
        store.add_facts("a", [(fact("f1", "d"), [[]]), (fact("f2", "d"), [[]])])
        store.apply(changed(observations=[obs("o1", 1)]))
        store.delete_facts("a", ["f1", "unknown"])
        assert self.ids(store.facts("a")) == ["f2"] and store.fact_ids_of_document("a", "d") == ["f2"]
        assert list(store.observations("a")) == ["o1"]

    # -- observations --

    def test_apply_keeps_the_highest_version_and_is_idempotent(self, store):
        m1 = changed(observations=[obs("o1", 1, ["x"]), obs("o2", 1)])
        store.apply(m1)
        store.apply(changed(observations=[obs("o1", 3, ["x"], text="v3")]))
        before = store.dump("a")
        store.apply(m1)  # its own decision coming back from the log
        store.apply(changed(observations=[obs("o1", 3, ["x"], text="same version, other text")]))
        assert store.dump("a") == before
        assert store.observations("a")["o1"].text == "v3"

    def test_apply_marks_consolidated_then_reset(self, store):
        store.add_facts("a", [(fact(i), [[]]) for i in ("f1", "f2", "f3")])
        store.apply(changed(consolidated=["f1", "f2", "unknown"]))
        assert self.ids(store.facts("a", pending=True)) == ["f3"]
        store.apply(changed(consolidated=["f2"], reset=["f1", "f2"]))  # reset first, then mark
        assert self.ids(store.facts("a", pending=True)) == ["f1", "f3"]
        assert self.ids(store.facts("a", ["f1", "f2"], pending=True)) == ["f1"]

    def test_observations_by_scope_and_deleted(self, store):
        store.apply(changed(observations=[obs("o3", 1, ["b", "a"]), obs("o1", 1, []),
                                          obs("o2", 2, ["a", "b"], deleted=True),
                                          obs("o4", 1, ["a"])]))
        assert list(store.observations("a")) == ["o1", "o3", "o4"]
        assert list(store.observations("a", ["a", "b"])) == ["o3"]
        assert list(store.observations("a", ["b", "a", "a"], include_deleted=True)) == ["o2", "o3"]
        assert list(store.observations("a", [])) == ["o1"]
        assert store.observations("a")["o3"] == obs("o3", 1, ["b", "a"])

    def test_deleting_is_a_newer_version(self, store):
        store.apply(changed(observations=[obs("o1", 1)]))
        store.apply(changed(observations=[obs("o1", 2, deleted=True)]))
        assert store.observations("a") == {}
        assert store.observations("a", include_deleted=True)["o1"].deleted
        store.apply(changed(observations=[obs("o1", 1)]))  # an older version stays ignored
        assert store.observations("a") == {}

    def test_a_deleted_observation_keeps_none_of_its_content(self, store):
        gone = obs("o1", 2, ["t"], text="Alice's number is +44 7700 900123", deleted=True)
        gone.history.add(text="Alice's number was +44 7700 900000", reason="updated")
        gone.embedding.extend([0.5, 0.25])
        gone.created_at.FromSeconds(100)
        gone.updated_at.FromSeconds(200)
        store.apply(changed(observations=[obs("o1", 1, ["t"]), obs("o2", 1)]))
        store.apply(changed(observations=[gone]))
        kept = store.observations("a", include_deleted=True)["o1"]
        expected = ev.Observation(id="o1", scope=["t"], version=2, deleted=True)
        expected.created_at.FromSeconds(100)
        expected.updated_at.FromSeconds(200)
        assert kept == expected
        assert store.dump("a")[0] == expected.SerializeToString(deterministic=True)
        assert store.observations("a") == {"o2": obs("o2", 1)}

    def test_dump_is_deterministic_bytes_by_id(self, store):
        store.apply(changed(observations=[obs("o2", 1), obs("o1", 1, deleted=True)]))
        assert store.dump("a") == [  # a deleted one as its tombstone
            ev.Observation(id="o1", version=1, deleted=True).SerializeToString(deterministic=True),
            obs("o2", 1).SerializeToString(deterministic=True)]
        assert store.dump("other") == []

    def test_returned_messages_are_copies(self, store):
        store.add_facts("a", [(fact("f1"), [["x"]])])
        store.apply(changed(observations=[obs("o1", 1)]))
        f, scopes = store.facts("a")[0]
        f.text, scopes[0][:] = "mutated", ["y"]
        store.observations("a")["o1"].text = "mutated"
        assert store.facts("a")[0] == (fact("f1"), [["x"]])
        assert store.observations("a")["o1"].text == "obs o1 v1"

    def test_delete_bank_and_reset(self, store):
        for b in ("a", "b"):
            store.add_facts(b, [(fact("f1"), [[]])])
            store.apply(changed(b, [obs("o1", 1)]))
        store.delete_bank("a")
        assert store.facts("a") == [] and store.dump("a") == []
        assert len(store.facts("b")) == 1 and len(store.dump("b")) == 1
        store.apply(changed("a", [obs("o1", 1)]))  # the bank starts afresh
        assert len(store.dump("a")) == 1
        store.reset()
        assert store.facts("b") == [] and store.dump("a") == store.dump("b") == []

    def test_revision_changes_with_the_banks_observations_only(self, store, tmp_path):
        """A kept copy of a bank's observations is current while the revision is equal:
        every change of the bank's states moves it; facts, no-op applies and other banks
        do not; another store never shares a value."""
        seen = [store.revision("a")]

        def moved():
            now = store.revision("a")
            assert now not in seen
            seen.append(now)

        store.apply(changed(observations=[obs("o1", 1)]))
        moved()
        store.apply(changed(observations=[obs("o1", 1)]))  # the same state again: no change
        store.add_facts("a", [(fact("f1"), [[]])])
        store.apply(changed(consolidated=["f1"]))
        store.delete_facts("a", ["f1"])
        store.apply(changed("b", [obs("o9", 1)]))
        assert store.revision("a") == seen[-1]
        store.apply(changed(observations=[obs("o1", 2, deleted=True)]))
        moved()
        store.apply(changed(observations=[obs("o2", 1)]))
        store.replace_vectors("a", {"o2": [1.0, 0.0]}, "m")
        moved()
        store.delete_bank("a")
        moved()
        store.reset()
        moved()
        (tmp_path / "other").mkdir()
        other = self.make_observations(tmp_path / "other")
        try:
            assert other.revision("a") not in seen
        finally:
            other.close()

    def test_counts_facts_consolidated_and_observation_states_per_bank(self, store):
        assert store.counts("a") == (0, 0, 0)
        store.add_facts("a", [(fact("f1"), [[]]), (fact("f2"), [[]]), (fact("f3"), [[]])])
        store.add_facts("b", [(fact("f1"), [[]])])
        store.apply(changed(observations=[obs("o1", 1), obs("o2", 1, deleted=True)],
                            consolidated=["f1", "f3"]))
        assert store.counts("a") == (3, 2, 2)  # a deleted state is still a state
        assert store.counts("b") == (1, 0, 0)
        store.apply(changed(reset=["f3"]))
        store.delete_facts("a", ["f2"])
        assert store.counts("a") == (2, 1, 2)
        store.delete_bank("a")
        assert store.counts("a") == (0, 0, 0) and store.counts("b") == (1, 0, 0)

    def test_opinions_keep_the_newest_state_and_are_found_by_entity(self, store):
        def opinion(i, version, *entities, deleted=False):
            return ev.Opinion(id=i, version=version, text=f"op {i} v{version}", confidence=0.5,
                              entities=[ev.Entity(id=e, name=e) for e in entities],
                              evidence_ids=["f1"], deleted=deleted,
                              history=[ev.OpinionRevision(change="formed", text="t")])

        def put(bank, *ops):
            store.apply_opinions(ev.OpinionsChanged(bank_id=bank, opinions=list(ops)))
        put("a", opinion("p1", 1, "e1", "e2"), opinion("p2", 1, "e2"))
        put("b", opinion("p1", 1, "e1"))
        assert sorted(store.opinions("a")) == ["p1", "p2"]
        assert list(store.opinions("a", entity_ids=["e1"])) == ["p1"]
        assert sorted(store.opinions("a", entity_ids=["e2", "e9"])) == ["p1", "p2"]
        assert list(store.opinions("a", ids=["p2", "p9"])) == ["p2"]
        assert list(store.opinions("a", limit=1)) == ["p1"]
        put("a", opinion("p1", 3, "e3"))
        put("a", opinion("p1", 2, "e1"))  # older: ignored, even redelivered
        assert store.opinions("a")["p1"].text == "op p1 v3"
        assert list(store.opinions("a", entity_ids=["e1"])) == []  # it moved to e3
        assert list(store.opinions("a", entity_ids=["e3"])) == ["p1"]
        before = store.dump_opinions("a")
        put("a", opinion("p1", 3, "e3"))
        assert store.dump_opinions("a") == before  # idempotent
        put("a", opinion("p2", 2, "e2", deleted=True))
        assert list(store.opinions("a")) == ["p1"]
        tomb = ev.Opinion.FromString(store.dump_opinions("a")[1])
        assert tomb.deleted and tomb.version == 2 and not tomb.text and not tomb.history
        assert list(store.opinions("a", entity_ids=["e2"])) == []
        store.delete_bank("a")
        assert store.dump_opinions("a") == [] and list(store.opinions("b")) == ["p1"]
        store.reset()
        assert store.dump_opinions("b") == []

    def test_a_transaction_is_all_or_nothing_with_its_decision(self, store):
        """consolidation handles an event in one transaction with the outputs it decided:
        a block that raises leaves nothing of it (nor its decision); one that ends keeps
        both, and the decision is what was recorded."""
        store.add_facts("a", [(fact("f0"), [[]])])
        out = [changed(observations=[obs("o1", 1)], consolidated=["f0"])]
        with pytest.raises(RuntimeError):
            with store.transaction():
                store.add_facts("a", [(fact("f1"), [[]])])
                with store.transaction():  # nested: the outer block decides
                    store.apply(out[0])
                store.record_decision("a", "e1", out)
                raise RuntimeError("the process stops mid-event")
        assert self.ids(store.facts("a", pending=True)) == ["f0"]
        assert store.observations("a") == {} and store.decision("e1") is None
        with store.transaction():
            store.add_facts("a", [(fact("f1"), [[]])])
            store.apply(out[0])
            store.record_decision("a", "e1", out)
        assert self.ids(store.facts("a", pending=True)) == ["f1"]
        assert [m.SerializeToString(deterministic=True) for m in store.decision("e1")] == \
            [m.SerializeToString(deterministic=True) for m in out]
        store.record_decision("b", "e2", [])
        assert store.decision("e2") == []

    def test_forgetting_facts_forgets_the_banks_decisions(self, store):
        """Recorded decisions may quote facts: a bank that forgets facts keeps none of
        its decisions' outputs (another bank's stay), but that its events were decided
        (their outputs are on the log: a group reset must not decide them again against
        a later state); a deleted bank keeps nothing."""
        store.add_facts("a", [(fact("f1"), [[]])])
        store.record_decision("a", "e1", [changed(observations=[obs("o1", 1)])])
        store.record_decision("b", "e2", [changed(bank="b")])
        store.delete_facts("a", ["unknown"])
        assert store.decision("e1")
        store.delete_facts("a", ["f1"])
        assert store.decision("e1") == [] and store.decision("e2")
        store.delete_bank("b")
        assert store.decision("e2") is None

    def test_decisions_beyond_the_kept_ones_stay_decided(self, store, monkeypatch):
        """Only the latest DECISIONS_KEPT events keep their outputs; an older one is still
        known as decided (none again), however far a consumer group is reset."""
        from mneme.stores import observations_sqlite
        monkeypatch.setattr(observations_sqlite, "DECISIONS_KEPT", 2)
        for n in range(4):
            store.record_decision("a", f"e{n}", [changed(observations=[obs(f"o{n}", 1)])])
        assert [store.decision(f"e{n}") == [] for n in range(4)] == [True, True, False, False]
        assert store.decision("never") is None
