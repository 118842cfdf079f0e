"""Opinions: formed by reflect after a reflection (scripted model), revised by consolidation
when new facts about their entities support, weaken or contradict them, deleted on request
or when their evidence is retracted -- and replayed from the recorded events alone."""

from __future__ import annotations

from datetime import datetime, timedelta, timezone

import pytest

from mneme.domain import (BankConfig, EventMeta, derive_id, initial_confidence,
                          revise_confidence)
from mneme.events.v1 import events_pb2 as ev
from mneme.llm.fake import FakeLlm, reply
from mneme.stores.memory import MemoryObservationStore
from services.consolidation.handlers import Consolidator
from services.reflect.opinions import OpinionFormer
from tests.fakes import FakeEmbedder

T0 = datetime(2024, 3, 1, 12, tzinfo=timezone.utc)
CAROLINE = ev.Entity(id="e-caroline", name="Caroline", label="PERSON")
SWEDEN = ev.Entity(id="e-sweden", name="Sweden", label="GPE")


def meta(n: int, at: datetime = T0) -> EventMeta:
    return EventMeta(derive_id("opinion-test", n), at)


def fact(fid: str, text: str, *entities: ev.Entity, at: datetime = T0) -> ev.Fact:
    f = ev.Fact(id=fid, text=text, fact_type="world", entities=list(entities),
                embedding=[1.0, 0.0, 0.0, 0.0])
    f.mentioned_at.FromDatetime(at)
    return f


def reflection(*evidence: tuple[str, datetime, list[ev.Entity]], extractive=False, tags=()):
    m = ev.ReflectionRecorded(bank_id="b", query="What drives Caroline?",
                              answer="Caroline is set on counseling [1][2].",
                              based_on=[e[0] for e in evidence], extractive=extractive,
                              tags=list(tags))
    for mid, at, ents in evidence:
        e = m.evidence.add(memory_id=mid, entities=ents)
        e.mentioned_at.FromDatetime(at)
    return m


# ---- confidence ----------------------------------------------------------------------------


def test_initial_confidence_grows_with_evidence_and_recency_and_falls_with_skepticism():
    assert initial_confidence([0.0]) == 0.42
    assert initial_confidence([0.0] * 5) == 0.9
    assert initial_confidence([0.0] * 9) == 0.9  # capped at five memories
    assert initial_confidence([365.0]) < initial_confidence([0.0])  # older: less sure
    assert initial_confidence([0.0, 0.0], skepticism=5) < initial_confidence([0.0, 0.0])
    assert initial_confidence([0.0, 0.0], skepticism=1) > initial_confidence([0.0, 0.0])
    assert initial_confidence([]) == 0.3


def test_a_contradiction_weighs_twice_a_weakening():
    c = 0.6
    assert revise_confidence(c, "support") == 0.64
    assert revise_confidence(c, "weaken") == 0.54
    assert revise_confidence(c, "contradict") == 0.48
    assert revise_confidence(0.95, "support") == 0.95 and revise_confidence(0.05, "contradict") == 0.05
    with pytest.raises(ValueError):
        revise_confidence(c, "agree")


# ---- formation -----------------------------------------------------------------------------


def _former(llm):
    return OpinionFormer(llm, FakeEmbedder(), lambda b: BankConfig(skepticism=3))


def test_a_reflection_forms_opinions_on_what_it_cited():
    llm = FakeLlm(("reflect",)).on("reflect", reply({"opinions": [
        {"text": "Caroline  is committed to counseling.", "citations": [1, 2, 7],
         "entities": ["caroline"]},
        {"text": "Unfounded.", "citations": [], "entities": []}]}))
    m = reflection(("f1", T0 - timedelta(days=10), [CAROLINE, SWEDEN]),
                   ("f2", T0, [CAROLINE]), tags=["work"])
    (change,) = _former(llm).form(m, meta(1))
    assert change.trigger == "formed" and change.decided_by == "llm"
    (o,) = change.opinions  # one without citations rests on nothing: dropped
    assert o.id == derive_id(meta(1).id, "opinion", 0) and o.reflection_id == meta(1).id
    assert o.text == "Caroline is committed to counseling."
    assert list(o.evidence_ids) == ["f1", "f2"]  # citation 7 was never shown
    assert [e.id for e in o.entities] == ["e-caroline"]  # the one named
    assert o.confidence == pytest.approx(initial_confidence([10.0, 0.0]), abs=1e-6)
    assert list(o.tags) == ["work"] and o.version == 1 and len(o.embedding) == 4
    assert [(h.change, h.text) for h in o.history] == [("formed", o.text)]
    assert "Cited memories" in llm.requests("reflect")[0].messages[1]["content"]
    # the same reflection again (a redelivery) forms the same opinion
    llm.on("reflect", reply({"opinions": [{"text": "Caroline is committed to counseling.",
                                           "citations": [1, 2], "entities": ["Caroline"]}]}))
    assert _former(llm).form(m, meta(1))[0].opinions[0].id == o.id


def test_no_opinion_without_a_model_or_from_an_extractive_answer():
    m = reflection(("f1", T0, [CAROLINE]))
    assert _former(None).form(m, meta(1)) == []
    llm = FakeLlm(("reflect",))
    assert _former(llm).form(reflection(("f1", T0, [CAROLINE]), extractive=True), meta(1)) == []
    assert llm.calls == []
    # a failing model forms nothing and raises nothing (the reflection stands)
    assert _former(llm).form(m, meta(1)) == []


# ---- revision, deletion, retraction, replay ---------------------------------------------


def _formed(confidence=0.6) -> ev.OpinionsChanged:
    o = ev.Opinion(id="p1", text="Caroline will become a counselor.", confidence=confidence,
                   entities=[CAROLINE], evidence_ids=["f1"], version=1, reflection_id="r1",
                   embedding=[0.0, 1.0, 0.0, 0.0])
    o.created_at.FromDatetime(T0)
    o.updated_at.FromDatetime(T0)
    o.history.add(change="formed", text=o.text, confidence=confidence, at=o.created_at)
    return ev.OpinionsChanged(bank_id="b", trigger="formed", decided_by="llm", opinions=[o])


def _update(fid: str, relation: str, revised: str = "") -> dict:
    return {"updates": [{"opinion_id": "p1", "memory_id": fid, "relation": relation,
                         "revised_text": revised, "reason": f"{relation} by {fid}"}]}


def _consolidator(store, llm):
    return Consolidator(store, lambda b: BankConfig(auto_consolidate=False), FakeEmbedder(), llm)


def _extracted(*facts: ev.Fact) -> ev.FactsExtracted:
    return ev.FactsExtracted(bank_id="b", operation_id="op", facts=list(facts),
                             items_total=len(facts))


def test_support_support_contradiction_gives_the_confidence_path_and_a_revised_text():
    llm = FakeLlm(("consolidation",)).on(
        "consolidation", reply(_update("f2", "support")), reply(_update("f3", "support")),
        reply(_update("f4", "contradict", "Caroline gave up on counseling to paint.")),
        match="Opinion updates")
    store = MemoryObservationStore()
    c = _consolidator(store, llm)
    log = [_formed()]
    c.handle(log[0], meta(1))
    facts = [fact("f2", "Caroline enrolled in a counseling course.", CAROLINE),
             fact("f3", "Caroline met a counseling mentor.", CAROLINE),
             fact("f4", "Caroline quit counseling and took up painting.", CAROLINE),
             fact("f5", "Sweden is cold.", SWEDEN)]  # about no opinion's entity: not shown
    for n, f in enumerate(facts, 2):
        log += [m for m in c.handle(_extracted(f), meta(n, T0 + timedelta(days=n)))
                if isinstance(m, ev.OpinionsChanged)]
    assert len(llm.requests("consolidation")) == 3  # f5 shares no entity: no call
    (o,) = store.opinions("b").values()
    path = [0.6]
    for rel in ("support", "support", "contradict"):
        path.append(revise_confidence(path[-1], rel))
    assert path == [0.6, 0.64, 0.676, 0.5408]
    assert [round(h.confidence, 4) for h in o.history] == path
    assert [h.change for h in o.history] == ["formed", "reinforced", "reinforced", "contradicted"]
    assert [h.memory_id for h in o.history] == ["", "f2", "f3", "f4"]
    assert o.text == "Caroline gave up on counseling to paint."
    assert o.history[2].text == "Caroline will become a counselor."  # before the contradiction
    assert list(o.evidence_ids) == ["f1", "f2", "f3"] and o.version == 4
    assert round(o.confidence, 4) == 0.5408

    # replay: the recorded events alone, no model, give the same state byte for byte
    calls = len(llm.calls)
    again = MemoryObservationStore()
    r = _consolidator(again, None)
    r.handle(log[0], meta(1), decide=False)
    for n, f in enumerate(facts, 2):
        r.handle(_extracted(f), meta(n, T0 + timedelta(days=n)), decide=False)
    for m in log[1:]:
        r.handle(m, meta(99), decide=False)
    assert again.dump_opinions("b") == store.dump_opinions("b")
    assert len(llm.calls) == calls


def test_unshown_pairs_and_unknown_relations_change_nothing_and_a_failure_is_survived():
    llm = FakeLlm(("consolidation",)).on("consolidation", reply({"updates": [
        {"opinion_id": "p9", "memory_id": "f2", "relation": "support", "revised_text": "",
         "reason": ""},
        {"opinion_id": "p1", "memory_id": "f9", "relation": "support", "revised_text": "",
         "reason": ""},
        {"opinion_id": "p1", "memory_id": "f2", "relation": "agree", "revised_text": "",
         "reason": ""}]}), match="Opinion updates")
    store = MemoryObservationStore()
    c = _consolidator(store, llm)
    c.handle(_formed(), meta(1))
    out = c.handle(_extracted(fact("f2", "Caroline likes tea.", CAROLINE)), meta(2))
    assert not [m for m in out if isinstance(m, ev.OpinionsChanged)]
    # the model is unreachable: nothing revised, the facts handled as usual
    out = c.handle(_extracted(fact("f3", "Caroline likes coffee.", CAROLINE)), meta(3))
    assert not [m for m in out if isinstance(m, ev.OpinionsChanged)]
    assert store.opinions("b")["p1"].version == 1
    # offline (no model): no call at all
    assert not [m for m in _consolidator(store, None).handle(
        _extracted(fact("f4", "Caroline sings.", CAROLINE)), meta(4))
        if isinstance(m, ev.OpinionsChanged)]


def test_delete_request_and_retracted_evidence_delete_the_opinion():
    store = MemoryObservationStore()
    c = _consolidator(store, None)
    c.handle(_formed(), meta(1))
    (gone,) = c.handle(ev.ConsolidationScheduled(bank_id="b", operation_id="op-d",
                                                 action="delete_opinion", memory_id="p1"),
                       meta(2))
    assert gone.trigger == "delete_opinion" and gone.operation_id == "op-d"
    (t,) = gone.opinions
    assert t.deleted and t.version == 2 and not t.text and not t.history  # a tombstone
    assert store.opinions("b") == {}
    # deleting it again: nothing to delete (the operation fails as not found)
    (again,) = c.handle(ev.ConsolidationScheduled(bank_id="b", operation_id="op-e",
                                                  action="delete_opinion", memory_id="p1"),
                        meta(3))
    assert list(again.opinions) == []

    store = MemoryObservationStore()
    c = _consolidator(store, None)
    c.handle(_formed(), meta(1))
    out = c.handle(ev.FactsRetracted(bank_id="b", operation_id="op-m", memory_ids=["f1"]),
                   meta(2))
    (retracted,) = [m for m in out if isinstance(m, ev.OpinionsChanged)]
    assert retracted.trigger == "retract" and retracted.opinions[0].deleted
    assert store.opinions("b") == {}


def test_a_replaced_document_deletes_the_opinion_it_supported_and_no_revision_revives_it():
    """A retain that replaces a document retracts its old facts and brings new ones in
    one event: the opinion resting on an old fact is deleted, and the new facts' revision
    must not write it back (it did: the revision read the opinion before the deletion was
    applied and published a live state after the tombstone, still citing the deleted
    fact, so the live server kept an opinion a replay, which cannot open its states,
    does not have)."""
    llm = FakeLlm(("consolidation",)).on("consolidation", reply(_update("f2", "support")),
                                         match="Opinion updates")
    store = MemoryObservationStore()
    c = _consolidator(store, llm)
    old = fact("f1", "Caroline studies psychology.", CAROLINE)
    old.document_id = "d"
    c.handle(_extracted(old), meta(1))
    c.handle(_formed(), meta(2))
    new = fact("f2", "Caroline enrolled in a counseling course.", CAROLINE)
    new.document_id = "d"
    replacing = _extracted(new)
    replacing.replaced_document_ids.append("d")
    out = [m for m in c.handle(replacing, meta(3)) if isinstance(m, ev.OpinionsChanged)]
    assert store.opinions("b") == {}
    assert [[(o.id, o.deleted) for o in m.opinions] for m in out] == [[("p1", True)]]


def test_an_entity_merge_carries_opinions_over_to_the_survivor():
    llm = FakeLlm(("consolidation",)).on("consolidation", reply(_update("f2", "support")),
                                         match="Opinion updates")
    store = MemoryObservationStore()
    c = _consolidator(store, llm)
    c.handle(_formed(), meta(1))
    (moved,) = c.handle(ev.EntitiesMerged(bank_id="b", operation_id="op-m",
                                          survivor_id="e-carol", merged_ids=["e-caroline"],
                                          display_name="Carol"), meta(2))
    assert moved.trigger == "entities_merged"
    (o,) = store.opinions("b").values()
    assert [(e.id, e.name) for e in o.entities] == [("e-carol", "Carol")]
    assert o.version == 2 and len(o.history) == 1 and o.confidence == pytest.approx(0.6)
    # a new fact naming the survivor now revises it
    carol = ev.Entity(id="e-carol", name="Carol", label="PERSON")
    out = c.handle(_extracted(fact("f2", "Carol enrolled in a counseling course.", carol)),
                   meta(3))
    assert [m.trigger for m in out if isinstance(m, ev.OpinionsChanged)] == ["revised"]
    # replay applies the recorded states and decides nothing
    assert _consolidator(store, None).handle(ev.EntitiesMerged(
        bank_id="b", survivor_id="e-x", merged_ids=["e-carol"]), meta(4), decide=False) == []
    # a merge about no opinion's entities changes nothing
    assert c.handle(ev.EntitiesMerged(bank_id="b", survivor_id="e-y", merged_ids=["e-z"]),
                    meta(5)) == []


def test_wrong_typed_fields_in_a_formation_reply_form_what_is_usable():
    """A number where a list belongs (citations, entities) was a TypeError out of form():
    the reflect consumer failed on the event. Such an opinion rests on nothing now; the
    reply's well-formed ones are still formed."""
    llm = FakeLlm(("reflect",)).on("reflect", reply({"opinions": [
        {"text": "Caroline wants to help people.", "citations": 1, "entities": 5},
        {"text": "Caroline is set on counseling.", "citations": [1], "entities": 7}]}))
    (change,) = _former(llm).form(reflection(("f1", T0, [CAROLINE])), meta(1))
    assert [o.text for o in change.opinions] == ["Caroline is set on counseling."]
    assert [e.id for e in change.opinions[0].entities] == ["e-caroline"]
