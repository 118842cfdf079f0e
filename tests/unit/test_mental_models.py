"""Mental models over in-memory ports: the search fusing keyword and embedder rankings
(within tags), the offline answer for a paraphrase, and the delta merge of a content with
the changes read from a (fake) memory partition."""

from __future__ import annotations

import math
from dataclasses import replace
from datetime import datetime, timezone

from mneme.domain import BankConfig, MentalModel, MentalModelRevision
from mneme.events.v1 import events_pb2 as ev
from mneme.stores.memory import MemoryCatalog
from services.reflect.handlers import NO_MEMORIES, Reflection, record_reflection
from services.reflect.mental_models import MentalModels, _prune

NOW = datetime(2024, 1, 1, tzinfo=timezone.utc)
#: The fake embedder's meaning: words → concept axes (words of no concept: a noise axis).
CONCEPTS = {"work": 0, "job": 0, "career": 0, "living": 0, "counsels": 0, "employer": 0,
            "pet": 1, "pets": 1, "dog": 1, "cat": 1, "animals": 1,
            "travel": 2, "trip": 2, "holiday": 2, "journey": 2}


class ConceptEmbedder:
    """Vectors over :data:`CONCEPTS` (L2-normalised); counts the texts it embedded."""

    model_name, dim = "concepts", 4

    def __init__(self):
        self.embedded = 0

    def embed(self, texts):
        self.embedded += len(texts)
        out = []
        for t in texts:
            v = [0.0] * self.dim
            for w in t.lower().replace("?", " ").replace(".", " ").split():
                v[CONCEPTS.get(w, 3)] += 1.0 if w in CONCEPTS else 0.05
            n = math.sqrt(sum(x * x for x in v)) or 1.0
            out.append([x / n for x in v])
        return out


def models(embedder=None, read=(), end: int = 0) -> tuple[MentalModels, MemoryCatalog]:
    cat = MemoryCatalog()
    cat.upsert_bank("b", "b", BankConfig(), 1.0)
    mm = MentalModels(cat, append=None, projected=None, caught_up=lambda b: True,
                      reflect=None, memory_end=lambda b: end,
                      memory_read=lambda b, start, limit, opened=False: list(read),
                      embedder=embedder)
    return mm, cat


def add(cat, mid, name, query, content, tags=(), based_on=(), offset=0):
    m = MentalModel(mid, "b", name, query, content, tags=tuple(tags), memory_offset=offset,
                    updated_at=2.0)
    rev = MentalModelRevision(0, content, tuple(based_on), "refresh_offline", mode="full")
    cat.upsert_mental_model(m, refresh=rev if based_on else None)
    return cat.get_mental_model("b", mid)


def test_search_finds_a_model_by_meaning_and_fuses_it_with_word_matches():
    emb = ConceptEmbedder()
    mm, cat = models(emb)
    add(cat, "m-work", "Work", "What does Caroline do for a living?", "She counsels teens.")
    add(cat, "m-pets", "Pets", "Which pets does Caroline have?", "A dog.")
    add(cat, "m-trip", "Caroline's trip", "Where did Caroline travel?", "To Spain.")
    add(cat, "m-empty", "Empty", "What career?", "")  # no content yet: never found
    # no word in common with the work model: found by meaning only
    assert [m.id for m in mm.search("b", "her career and employer", NOW, 5)] == ["m-work"]
    words_only, cat2 = models(None)
    add(cat2, "m-work", "Work", "What does Caroline do for a living?", "She counsels teens.")
    assert words_only.search("b", "her career and employer", NOW, 5) == []
    # "Caroline" matches every model by words; the one that also means "journey" comes first
    hits = [m.id for m in mm.search("b", "Caroline journey", NOW, 5)]
    assert hits[0] == "m-trip" and set(hits) == {"m-trip", "m-work", "m-pets"}
    embedded = emb.embedded
    mm.search("b", "Caroline journey", NOW, 5)
    assert emb.embedded == embedded + 1  # models' vectors are cached: only the question


def test_search_keeps_to_the_requests_tags():
    mm, cat = models(ConceptEmbedder())
    add(cat, "m-home", "Pets at home", "Which pets?", "A cat.", tags=["home"])
    add(cat, "m-work", "Pets at work", "Which pets at work?", "A dog.", tags=["work"])
    add(cat, "m-all", "Pets anywhere", "Which animals?", "Dogs and cats.")
    assert {m.id for m in mm.search("b", "pets", NOW, 5, tags=["home"])} == {"m-home", "m-all"}
    assert {m.id for m in mm.search("b", "pets", NOW, 5)} == {"m-home", "m-work", "m-all"}


def test_the_offline_answer_takes_a_paraphrase_of_a_fresh_models_question():
    mm, cat = models(ConceptEmbedder())
    add(cat, "m-work", "Work", "What job?", "She counsels teens [1].", based_on=["f1"])
    r = mm.answer_offline("b", "career", ())  # no shared word, same meaning
    assert r is not None and r.based_on == ["m-work"] and r.text.startswith("She counsels")
    assert mm.answer_offline("b", "holiday plans", ()) is None


def test_an_answer_from_a_model_records_the_facts_the_model_stands_on():
    """An answer quoting a mental model restates the model's facts (those it cites, and
    the facts behind the observations it cites): its ReflectionRecorded names them, so it
    is sealed under their keys and erased with any of them."""
    mm, cat = models(ConceptEmbedder())
    m = MentalModel("m-work", "b", "Work", "What job?", "She counsels teens [1][2].",
                    updated_at=2.0)
    cat.upsert_mental_model(m, refresh=MentalModelRevision(
        0, m.content, ("f1", "o1"), "refresh_offline", mode="full", evidence=("f2", "f3")))
    r = mm.answer_offline("b", "career", ())
    assert r.based_on == ["m-work"]
    msg = record_reflection("b", "career", r)
    assert list(msg.based_on) == ["m-work"]
    assert list(msg.evidence_memory_ids) == ["f1", "o1", "f2", "f3"]
    assert mm.search("b", "her career", NOW, 5)[0].sources == ("f1", "o1", "f2", "f3")


def test_prune_keeps_supported_statements_and_renumbers_citations():
    content = ("Extractive answer; the most relevant memories:\n"
               "- A went. Then B (01 May 2023) [1]\n- C did (02 May 2023) [2]\n- D [3]")
    text, kept = _prune(content, ["a", "b", "c"], {"b"})
    assert text == ("Extractive answer; the most relevant memories:\n"
                    "- A went. Then B (01 May 2023) [1]\n- D [2]")
    assert kept == ["a", "c"]
    text, kept = _prune("From Sweden [1, 2]. Paints [2]. Footnote [9] stays.", ["a", "b"], {"b"})
    assert (text, kept) == ("From Sweden [1]. Footnote [9] stays.", ["a"])
    assert _prune("Written by hand.", [], {"x"}) == ("Written by hand.", [])


def fact(fid, text, tags=()):
    return ev.Fact(id=fid, text=text, tags=list(tags))


def test_delta_merges_the_changes_in_scope_offline():
    changes = [
        (5, ev.FactsExtracted(bank_id="b", facts=[
            fact("f3", "Caroline adopted a dog."), fact("f4", "The sky is blue."),
            fact("f5", "Caroline got a cat.", tags=["work"]),   # another scope
            fact("f6", "Caroline walks the dog daily.", tags=["home"])])),
        (6, ev.FactsRetracted(bank_id="b", memory_ids=["f1"])),
        (7, ev.FactsExtracted(bank_id="other", facts=[fact("f7", "Caroline's other dog.")])),
    ]
    mm, cat = models(None, changes, end=8)
    m = add(cat, "m", "Caroline's pets", "Which pets does Caroline have?",
            "Pets so far:\n- Caroline had a hamster [1]\n- Caroline has a parrot [2]",
            tags=["home"], based_on=["f1", "f2"], offset=5)
    r = mm.delta(m, NOW)
    assert r.extractive and r.based_on == ["f2", "f3", "f6"]
    assert r.text == ("Pets so far:\n- Caroline has a parrot [1]\n- Caroline adopted a dog. [2]\n"
                      "- Caroline walks the dog daily. [3]")
    # the reflect model, when there is one, gets the pruned content and the new memories
    seen = {}

    def revise(bank_id, query, prior, cited, new, now, tags, evidence=()):
        seen.update(prior=prior, cited=cited, new=[x.id for x in new])
        return Reflection("Revised [1].", ["f2"], False)
    mm.revise = revise
    assert mm.delta(m, NOW).text == "Revised [1]."
    assert seen["prior"] == "Pets so far:\n- Caroline has a parrot [1]"
    assert seen["cited"] == ["f2"] and set(seen["new"]) == {"f3", "f4", "f6"}


def test_delta_quotes_a_statement_once():
    """An offline observation often quotes its fact word for word: the two (and a line
    the content already quotes) are appended once, the fact, which came first."""
    changes = [
        (5, ev.FactsExtracted(bank_id="b", facts=[
            fact("f3", "Caroline went to the support group again."),
            fact("f4", "Caroline has a parrot.")])),
        (6, ev.ObservationsChanged(bank_id="b", observations=[
            ev.Observation(id="o1", text="Caroline  went to the support group again.")])),
    ]
    mm, cat = models(None, changes, end=7)
    m = add(cat, "m", "Caroline's week", "What did Caroline do, and her parrot?",
            "So far:\n- Caroline has a parrot. (01 May 2023) [1]\n"
            "- Caroline went to the support group again. (cancelled)", based_on=["f2"],
            offset=5)
    r = mm.delta(m, NOW)
    assert r.based_on == ["f2", "f3"], r
    # a line that goes on past the text ("(cancelled)") says something else
    assert r.text == ("So far:\n- Caroline has a parrot. (01 May 2023) [1]\n"
                      "- Caroline went to the support group again. (cancelled)\n"
                      "- Caroline went to the support group again. [2]")


def test_delta_of_an_empty_content_or_too_many_changes_is_a_full_refresh():
    mm, cat = models(None, [], end=20_000)
    m = add(cat, "m", "n", "q?", "Some content [1]", based_on=["f1"])
    assert mm.delta(m, NOW) is None  # more than STALE_SCAN records to read
    assert mm.delta(add(cat, "e", "n", "q?", ""), NOW) is None
    mm2, cat2 = models(None, [(0, ev.FactsRetracted(bank_id="b", memory_ids=["f1"]))], end=1)
    only = add(cat2, "m", "n", "q?", "- Gone [1]", based_on=["f1"])
    assert mm2.delta(only, NOW).text == NO_MEMORIES


def test_a_delta_revision_records_the_facts_behind_the_content_it_keeps():
    """A delta refresh by the reflect model rewrites the current content, which restates
    the observations it cites: the revision's ReflectionRecorded names the facts behind
    them (the model's whole earlier set, as its MentalModelChanged does), so deleting
    one of those facts erases the revision from the log too."""
    from services.reflect.handlers import Reflector

    class Agent:
        fallback_offline = False

        def revise(self, bank_id, query, prior, cited, new, now, directives=()):
            # keeps the observation's line and adds the new fact
            return Reflection("Caroline loves animals [1] and adopted a dog [2].",
                              [*cited, "f3"], False)

    recorded = []
    reflector = Reflector(Agent(), recall=None, record=recorded.append)
    changes = [(5, ev.FactsExtracted(bank_id="b", facts=[fact("f3", "Caroline adopted a dog.")]))]
    mm, cat = models(None, changes, end=6)
    content = "Pets so far:\n- Caroline loves animals [1]"
    cat.upsert_mental_model(
        MentalModel("m", "b", "Caroline's pets", "Which pets does Caroline have?", content,
                    memory_offset=5, updated_at=2.0),
        refresh=MentalModelRevision(0, content, ("o1",), "refresh", mode="full",
                                    evidence=("f1", "f2")))
    m = cat.get_mental_model("b", "m")
    assert m.based_on_evidence == ("f1", "f2")
    mm.revise = reflector.revise
    r = mm.delta(m, NOW)
    assert r.based_on == ["o1", "f3"]
    (msg,) = recorded
    assert list(msg.based_on) == ["o1", "f3"]
    assert list(msg.evidence_memory_ids) == ["f1", "f2"]


def test_erasing_refreshes_leaves_the_model_a_replay_would_rebuild():
    """A deletion erases the refreshes that cite the deleted memories; a replay cannot
    open those refreshes' events (sealed under the deleted facts' keys) and applies only
    the others. The model left behind is the replay's, its ``updated_at`` included (it
    kept the erased refresh's time, so GetMentalModel's update_time differed after a
    replay)."""
    def model(at, **kw):
        return MentalModel("mm", "b", kw.pop("name", "career"), "What is her job?",
                           updated_at=at, **kw)

    def refresh(at, cited):
        return (model(at, name="work", content=f"She counsels [{cited}].", memory_offset=int(at)),
                (), MentalModelRevision(0, "", (cited,), "refresh", mode="full"))
    events = {"create": (model(100.0, memory_offset=5), (), None),
              "rename": (model(150.0, name="work"), ("display_name",), None),
              "refresh m1": refresh(200.0, "m1"), "refresh m2": refresh(250.0, "m2")}

    def apply(names):
        cat = MemoryCatalog()
        cat.upsert_bank("b", "b", BankConfig(), 1.0)
        for n in names:
            m, mask, rev = events[n]
            cat.upsert_mental_model(m, mask=mask, refresh=rev)
        return cat

    def state(cat):
        return cat.get_mental_model("b", "mm"), cat.mental_model_revisions("b", "mm")

    live = apply(events)
    live.erase_mental_model_sources("b", ["m2"])
    assert state(live) == state(apply(["create", "rename", "refresh m1"]))
    live.erase_mental_model_sources("b", ["m1"])
    # no content left: offset 0, stale whatever the log holds (a replay's model, at its
    # creation's offset, is stale too: the retraction is after it), refreshed in full
    (got, revisions), (want, none) = state(live), state(apply(["create", "rename"]))
    assert got.updated_at == 150.0 and got.memory_offset == 0 and revisions == none == []
    assert replace(got, memory_offset=want.memory_offset) == want
