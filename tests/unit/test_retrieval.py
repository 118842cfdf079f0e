"""Retrieval math: RRF (Cormack et al. 2009), boosts, greedy token-budget fill."""

from __future__ import annotations

from datetime import datetime, timedelta, timezone

import pytest

from mneme.domain import EntityRef, Fact, Link, Scored, TimeWindow
from mneme.retrieval import (
    ANSWER_TYPE_WEIGHT, BUDGETS, ENTITY_WEIGHT, PROOF_WEIGHT, QUESTION_WEIGHT, RECENCY_WEIGHT,
    ADJACENT_WEIGHT, LENGTH_PIVOT, LENGTH_WEIGHT, LIST_LENGTH_WEIGHT, REPLY_WEIGHT, RRF_K,
    RRF_UNIT, SPEAKER_WEIGHT, TEMPORAL_WEIGHT, TIME_RANK_WEIGHT,
    answer_labels, asks_for_list, fill_budget, head_features, head_weights, is_question,
    proof_boost,
    question_factor, recency_boost, replies_to, reply_share, rerank_head, rrf,
    statement_words, temporal_proximity_boost, tie_key, window_overlap,
)

NOW = datetime(2024, 6, 15, 12, 0, tzinfo=timezone.utc)


# ---- rrf ----------------------------------------------------------------------------------


def test_rrf_hand_computed():
    fused = dict(rrf({"a": ["x", "y", "z"], "b": ["y", "w"]}, k=60))
    assert fused["x"] == pytest.approx(1 / 61)
    assert fused["y"] == pytest.approx(1 / 62 + 1 / 61)
    assert fused["z"] == pytest.approx(1 / 63)
    assert fused["w"] == pytest.approx(1 / 62)
    order = [d for d, _ in rrf({"a": ["x", "y", "z"], "b": ["y", "w"]})]
    assert order == ["y", "x", "w", "z"]


def test_two_arm_agreement_beats_single_first_place():
    # "b" is third in two arms; "a" first in one arm only: 2/(k+3) > 1/(k+1).
    fused = rrf({"s": ["a", "c", "b"], "k": ["d", "e", "b"]})
    assert fused[0][0] == "b"
    assert fused[0][1] == pytest.approx(2 / (RRF_K + 3))


def test_k_sets_agreement_versus_first_place():
    # "b" is 40th in two arms. At k=60 agreement wins: 2/100 = 0.02 > 1/61 ≈ 0.0164.
    # At k=0 a first place (1/1) beats two 40th places (2/40).
    s = ["s0"] + [f"s{i}" for i in range(1, 39)] + ["b"]
    k = ["a"] + [f"k{i}" for i in range(1, 39)] + ["b"]
    assert rrf({"s": s, "k": k}, k=60)[0][0] == "b"
    assert rrf({"s": s, "k": k}, k=0)[0][0] == "a"  # tie with s0 (both 1/1), id order


def test_k_matters():
    rankings = {"s": ["a", "b"], "k": ["c", "b"]}
    lo, hi = dict(rrf(rankings, k=0)), dict(rrf(rankings, k=60))
    assert lo["a"] == pytest.approx(1.0) and lo["b"] == pytest.approx(1.0)
    assert hi["b"] > hi["a"]
    with pytest.raises(ValueError, match="^k:"):
        rrf(rankings, k=-1)


def test_rrf_ties_are_deterministic():
    # a/b/c each first in one arm: equal score, broken by id; arm order is irrelevant.
    r1 = rrf({"x": ["b"], "y": ["c"], "z": ["a"]})
    r2 = rrf({"z": ["a"], "y": ["c"], "x": ["b"]})
    assert [d for d, _ in r1] == ["a", "b", "c"] == [d for d, _ in r2]
    assert r1 == r2
    # Equal sums, different best ranks: (1, 3) → 1/61 + 1/63 vs (2, 2) → 2/62 differ, but
    # ranks (1, 4) in arms x/y vs (4, 1) in y/x are the same multiset: bit-equal scores.
    r = rrf({"x": ["p", "q0", "q1", "q"], "y": ["q", "p0", "p1", "p"]})
    scores = dict(r)
    assert scores["p"] == scores["q"]
    assert [d for d, _ in r][:2] == ["p", "q"]


def test_rrf_tie_broken_by_best_single_rank_before_id():
    # "z" at ranks (1, -) and "a" at rank (2, -)+(…) with exactly equal score is rare;
    # construct equality with k=0: a at ranks 2 and 2 (0.5+0.5=1.0), z at rank 1 (1.0).
    r = rrf({"x": ["z", "a"], "y": ["q", "a"]}, k=0)
    scores = dict(r)
    assert scores["a"] == scores["z"] == 1.0
    order = [d for d, _ in r]
    assert order.index("z") < order.index("a")  # best single rank 1 beats 2, despite id


def test_rrf_duplicates_and_empty():
    assert rrf({}) == []
    assert rrf({"s": [], "k": []}) == []
    fused = dict(rrf({"s": ["a", "a", "b"]}))
    assert fused["a"] == pytest.approx(1 / (RRF_K + 1))
    assert fused["b"] == pytest.approx(1 / (RRF_K + 3))  # positions are kept, duplicates skipped


def test_budgets_grow():
    assert set(BUDGETS) == {"low", "mid", "high"}
    assert BUDGETS["low"].candidates < BUDGETS["mid"].candidates < BUDGETS["high"].candidates
    assert BUDGETS["low"].hops <= BUDGETS["mid"].hops <= BUDGETS["high"].hops


# ---- boosts -------------------------------------------------------------------------------


def _fact(start=None, end=None, mentioned=None, **kw) -> Fact:
    return Fact(id=kw.pop("id", "f"), bank_id="b", text=kw.pop("text", "x"),
                occurred_start=start, occurred_end=end, mentioned_at=mentioned, **kw)


def test_boosts_are_bounded_by_a_fraction_of_one_rrf_vote():
    assert RECENCY_WEIGHT + TEMPORAL_WEIGHT + PROOF_WEIGHT <= 0.3 + 1e-12
    # All boosts maxed stay below one more arm's vote anywhere in a mid-budget list.
    assert (RECENCY_WEIGHT + TEMPORAL_WEIGHT + PROOF_WEIGHT) * RRF_UNIT < 1 / (RRF_K + 60)
    f = _fact(NOW, NOW)
    assert 0 < recency_boost(f, NOW) <= RECENCY_WEIGHT * RRF_UNIT
    w = TimeWindow(NOW - timedelta(days=1), NOW + timedelta(days=1))
    assert 0 < temporal_proximity_boost(f, w) <= TEMPORAL_WEIGHT * RRF_UNIT
    assert temporal_proximity_boost(f, w) == pytest.approx(TEMPORAL_WEIGHT * RRF_UNIT)
    for n in (1, 3, 10, 10_000):
        assert 0 < proof_boost(n) < PROOF_WEIGHT * RRF_UNIT


def test_recency_is_monotonic_and_long_lived():
    ages = [0, 1, 30, 365, 3650]
    boosts = [recency_boost(_fact(NOW - timedelta(days=d)), NOW) for d in ages]
    assert boosts == sorted(boosts, reverse=True) and len(set(boosts)) == len(boosts)
    # Half-life of a year: a year-old fact keeps half its boost.
    assert boosts[3] == pytest.approx(boosts[0] / 2)
    assert recency_boost(_fact(), NOW) == 0.0  # no time at all
    # Falls back to mentioned_at; uses the end of an occurred range.
    assert recency_boost(_fact(mentioned=NOW), NOW) == pytest.approx(boosts[0])
    ranged = _fact(NOW - timedelta(days=3650), NOW)
    assert recency_boost(ranged, NOW) == pytest.approx(boosts[0])


def test_temporal_proximity_monotonic():
    w = TimeWindow(NOW - timedelta(days=7), NOW)
    inside = temporal_proximity_boost(_fact(NOW - timedelta(days=3)), w)
    near = temporal_proximity_boost(_fact(NOW - timedelta(days=8)), w)
    far = temporal_proximity_boost(_fact(NOW - timedelta(days=60)), w)
    assert inside > near > far > 0
    # A broad fact that only partly overlaps the window is less specific.
    broad = _fact(NOW - timedelta(days=365), NOW)
    assert near < temporal_proximity_boost(broad, w) < inside
    assert temporal_proximity_boost(_fact(NOW), None) == 0.0
    assert temporal_proximity_boost(_fact(), w) == 0.0
    # Open-ended windows work.
    assert temporal_proximity_boost(_fact(NOW), TimeWindow(start=NOW - timedelta(days=1))) > 0


def test_window_overlap_fraction():
    w = TimeWindow(NOW - timedelta(days=10), NOW)
    assert window_overlap(NOW - timedelta(days=5), NOW - timedelta(days=5), w) == 1.0
    assert window_overlap(NOW - timedelta(days=20), NOW, w) == pytest.approx(0.5)
    assert window_overlap(NOW + timedelta(days=1), NOW + timedelta(days=2), w) == 0.0


def test_proof_boost_monotonic_saturating():
    vals = [proof_boost(n) for n in (0, 1, 2, 3, 10, 100)]
    assert vals[0] == 0.0 and proof_boost(-5) == 0.0
    assert vals == sorted(vals) and len(set(vals)) == len(vals)
    assert proof_boost(3) == pytest.approx(PROOF_WEIGHT * RRF_UNIT / 2)


# ---- fill_budget --------------------------------------------------------------------------


class WordCounter:
    def count(self, text: str) -> int:
        return len(text.split())


def _items(*sizes: int) -> list[Scored]:
    return [Scored(fact=_fact(id=f"f{i}", text=" ".join(["w"] * n)))
            for i, n in enumerate(sizes)]


def test_fill_exact_sums():
    kept, total = fill_budget(_items(3, 4, 5), 12, WordCounter())
    assert [s.fact.id for s in kept] == ["f0", "f1", "f2"]
    assert total == 12 and [s.tokens for s in kept] == [3, 4, 5]


def test_fill_skips_too_big_and_continues():
    kept, total = fill_budget(_items(5, 10, 2, 4, 1), 8, WordCounter())
    assert [s.fact.id for s in kept] == ["f0", "f2", "f4"]
    assert total == 8


def test_fill_stops_when_exhausted():
    items = _items(4, 4, 0)
    kept, total = fill_budget(items, 8, WordCounter())
    assert [s.fact.id for s in kept] == ["f0", "f1"] and total == 8


def test_fill_zero_budget_and_oversized():
    assert fill_budget(_items(1, 2), 0, WordCounter()) == ([], 0)
    assert fill_budget(_items(1), -3, WordCounter()) == ([], 0)
    kept, total = fill_budget(_items(50), 10, WordCounter())
    assert kept == [] and total == 0
    assert fill_budget([], 100, WordCounter()) == ([], 0)


# ---- questions ----------------------------------------------------------------------------


@pytest.mark.parametrize("text, asks", [
    ("Melanie: What inspired it?", True),
    ("What kind of books do you have? Any favourites?", True),
    ('Caroline: Did you read "Becoming"?', True),
    ("Mia: Where was this taken? [shares a photo: a beach at sunset]", True),
    ("Melanie: I painted a lake sunrise. Do you like it?", False),
    ("Caroline: I went to a support group yesterday.", False),
    ("Leo: Wow!", False),
    ("", False),
    ("Note: what a day.", False),
])
def test_is_question(text, asks):
    assert is_question(text) is asks


def test_question_factor():
    assert question_factor(_fact(text="Mia: What did you paint?")) == QUESTION_WEIGHT < 1
    assert question_factor(_fact(text="Mia: I painted a horse.")) == 1.0


# ---- replies and the head -----------------------------------------------------------------


def _scored(fid, text, rrf_score, links=(), doc="d", index=0, entities=()) -> Scored:
    f = Fact(id=fid, bank_id="b", text=text, links=list(links), document_id=doc,
             item_index=index, entities=[EntityRef(e, e, "PERSON") for e in entities])
    return Scored(fact=f, rrf=rrf_score * question_factor(f), final=rrf_score * question_factor(f))


def test_reply_inherits_a_share_of_the_turn_it_answers():
    # The query matched the question turn best; its answer (next turn) matched weakly.
    q = _scored("q", "Caroline: What got you into running?", 0.09, index=6)
    a = _scored("a", "Melanie: I've been running farther to de-stress.", 0.03, index=7,
                links=[Link("q", "temporal", 0.5)])
    other = _scored("o", "Melanie: I ran a charity race.", 0.05, index=2)
    assert replies_to(a.fact) == "q" and replies_to(q.fact) is None
    results = [q, other, a]
    reply_share(results)
    # the question's score before its question factor, times the share
    assert a.boost == pytest.approx(REPLY_WEIGHT * 0.09)
    assert a.final == pytest.approx(0.03 + REPLY_WEIGHT * 0.09)
    assert q.boost == other.boost == 0.0
    assert [s.fact.id for s in sorted(results, key=lambda s: -s.final)] == ["a", "o", "q"]


def test_a_reply_to_a_statement_comes_close_to_it_but_stays_below():
    # the statement is the evidence ("went on 7 May"); the reply only comments on it
    st = _scored("s", "Caroline: I went to the pride parade on 7 May.", 0.09, index=3)
    re_ = _scored("r", "Melanie: Wow, that sounds amazing!", 0.07, index=4,
                  links=[Link("s", "temporal", 0.5)])
    low = _scored("l", "Melanie: Nice!", 0.01, index=8, links=[Link("s", "temporal", 0.5)])
    reply_share([st, re_, low])
    assert re_.final < st.final and re_.final == pytest.approx(0.09, rel=1e-2)
    assert low.boost == pytest.approx(REPLY_WEIGHT * 0.09)  # far below: the full share
    ahead = _scored("a", "Melanie: The parade was on 7 May, I was there too.", 0.12, index=4,
                    links=[Link("s", "temporal", 0.5)])
    reply_share([st, ahead])  # already above the statement: nothing added
    assert ahead.boost == 0.0


def test_reply_share_needs_the_turn_among_the_results_and_a_reply_link():
    a = _scored("a", "Mia: Yes, twice.", 0.03, links=[Link("gone", "temporal", 0.5)])
    b = _scored("b", "Mia: And then a swim.", 0.02, links=[Link("a", "temporal", 1.0)])
    reply_share([a, b])  # "gone" is not a result; a same-turn link (weight 1) is no reply
    assert a.boost == b.boost == 0.0


def _length(text: str, weight: float = LENGTH_WEIGHT) -> float:
    """The length feature's share of a boost, in RRF units."""
    return weight * min(1.0, statement_words(text) / LENGTH_PIVOT)


def test_rerank_head_prefers_entity_overlap_and_neighbours():
    # three equal candidates: one mentions the asked-about person, one sits next to a
    # strong hit of the same conversation, one has neither
    strong = _scored("s", "Nate: I adopted a turtle.", 0.10, doc="c/1", index=4, entities=["nate"])
    plain = _scored("p", "Joanna: I wrote a script.", 0.05, doc="c/2", index=1, entities=["joanna"])
    named = _scored("n", "Nate: Gaming is my job.", 0.05, doc="c/3", index=9, entities=["nate"])
    near = _scored("x", "Joanna: So cute!", 0.05, doc="c/1", index=5, entities=["joanna"])
    out = rerank_head([strong, plain, named, near], ["nate"])
    assert [s.fact.id for s in out] == ["s", "n", "x", "p"]
    assert named.boost == pytest.approx(
        (ENTITY_WEIGHT + SPEAKER_WEIGHT + _length(named.fact.text)) * RRF_UNIT)
    assert plain.boost == pytest.approx(_length(plain.fact.text) * RRF_UNIT)
    # next to the best hit: the whole adjacency weight
    assert near.boost == pytest.approx((ADJACENT_WEIGHT + _length(near.fact.text)) * RRF_UNIT)
    # only the head is reordered; the tail keeps its order after it
    out = rerank_head([plain, named, strong], ["nate"], head=2)
    assert [s.fact.id for s in out] == ["n", "p", "s"]


def test_rerank_head_counts_passages_not_facts():
    # a turn told in two facts (a model's beside the offline one) takes one place of the
    # head: with a head of two passages the third fact is still in it and is reordered
    told = _scored("t1", "Joanna: I wrote a script.", 0.06, doc="c/1", index=1,
                   entities=["joanna"])
    again = _scored("t2", "Joanna wrote a script.", 0.055, doc="c/1", index=1,
                    entities=["joanna"])
    named = _scored("n", "Nate: Gaming is my job.", 0.05, doc="c/3", index=9, entities=["nate"])
    tail = _scored("z", "Nate: I adopted a turtle.", 0.04, doc="c/4", index=2, entities=["nate"])
    out = rerank_head([told, again, named, tail], ["nate"], head=2)
    assert [s.fact.id for s in out] == ["n", "t1", "t2", "z"]
    assert tail.boost == 0.0  # the third passage is the tail
    # facts without a document are passages of their own
    loose = [_scored(i, "Nate: hi.", 0.05 - k * 0.01, doc="", entities=["nate"])
             for k, i in enumerate("abc")]
    rerank_head(loose, ["nate"], head=2)
    assert [s.boost > 0 for s in loose] == [True, True, False]


def test_statement_words_leave_out_the_speaker_and_keep_a_caption():
    assert statement_words("Melanie: Wow, that's great!") == 3
    assert statement_words("Nate: This is Max! [shares a photo: a dog on a couch]") == 11
    assert statement_words("The pump failed at 3 am.") == 6
    assert statement_words("") == 0


def test_a_list_question_prefers_the_longer_turn_up_to_the_pivot():
    short = "Joanna: That sounds like a good recipe!"  # 6 words
    told = "Joanna: " + " ".join(["cake"] * LENGTH_PIVOT)
    longer = "Joanna: " + " ".join(["cake"] * (2 * LENGTH_PIVOT))

    def head():
        return [_scored("s", short, 0.08, doc="c/1", index=1),
                _scored("t", told, 0.05, doc="c/2", index=8),
                _scored("l", longer, 0.049, doc="c/3", index=3)]

    out = rerank_head(head(), [], listing=True)
    assert [s.fact.id for s in out] == ["t", "l", "s"]  # t and l capped alike
    boost = {s.fact.id: s.boost for s in out}
    assert boost["s"] == pytest.approx(LIST_LENGTH_WEIGHT * RRF_UNIT * 6 / LENGTH_PIVOT)
    assert boost["t"] == boost["l"] == pytest.approx(LIST_LENGTH_WEIGHT * RRF_UNIT)
    # any other question: the weaker prior, which these match scores outweigh
    out = rerank_head(head(), [])
    assert [s.fact.id for s in out] == ["s", "t", "l"]
    assert {s.fact.id: s.boost for s in out} == pytest.approx(
        {"s": LENGTH_WEIGHT * RRF_UNIT * 6 / LENGTH_PIVOT, "t": LENGTH_WEIGHT * RRF_UNIT,
         "l": LENGTH_WEIGHT * RRF_UNIT})


@pytest.mark.parametrize("query, listing", [
    ("What activities does Melanie partake in?", True),
    ("What recipes has Joanna made?", True),
    ("Which countries has Tim visited?", True),
    ("What LGBTQ+ events has Caroline participated in?", True),
    ("How many games has John mentioned winning?", True),
    ("What are Joanna's hobbies?", True),
    ("What does Melanie do with her family on hikes?", False),
    ("What is Caroline's identity?", False),
    ("When did Jon lose his job?", False),
    ("Where did Maria make friends?", False),
    ("", False),
])
def test_asks_for_list(query, listing):
    assert asks_for_list(query) is listing


@pytest.mark.parametrize("query, labels", [
    ("Where did Maria make friends?", {"GPE", "LOC", "FAC"}),
    ("Which countries has Tim visited?", {"GPE", "LOC", "FAC"}),
    ("What books has John read?", {"WORK_OF_ART", "PRODUCT"}),
    ("What is Gina's favourite movie?", {"WORK_OF_ART", "PRODUCT"}),
    ("Which company does Dave work for?", {"ORG"}),
    ("Who did Caroline meet at the parade?", set()),
    ("What is Calvin's religion?", {"NORP"}),
    ("What activities does Melanie partake in?", set()),
    ("When did Jon lose his job?", set()),
])
def test_answer_labels(query, labels):
    assert answer_labels(query) == labels


def test_rerank_head_prefers_a_fact_naming_what_the_question_asks_for():
    def fact(fid, text, rrf_score, ents):
        f = Fact(id=fid, bank_id="b", text=text, document_id=f"d{fid}",
                 entities=[EntityRef(e, e, label) for e, label in ents])
        return Scored(fact=f, rrf=rrf_score, final=rrf_score)

    def candidates():
        return [
            fact("w", "Tim: I love to travel, I'm planning my travels now.", 0.06,
                 [("tim", "PERSON"), ("travels", "CONCEPT")]),
            # the speaker and the query's own entities do not count as the answer
            fact("s", "Paris: I went out.", 0.05, [("paris", "GPE")]),
            fact("a", "Tim: I met Tim's brother in a cafe.", 0.05, [("tim", "PERSON")]),
            fact("p", "Tim: I had a nice chat with a fan in California.", 0.04,
                 [("tim", "PERSON"), ("california", "GPE")]),
        ]

    labels = answer_labels("Which places has Tim been to?")
    out = rerank_head(candidates(), ["tim"], labels=labels)
    by = {s.fact.id: s for s in out}
    assert [s.fact.id for s in out][:2] == ["p", "w"]
    assert by["p"].boost - by["w"].boost == pytest.approx(
        (ANSWER_TYPE_WEIGHT + _length(by["p"].fact.text) - _length(by["w"].fact.text))
        * RRF_UNIT)
    # a GPE, but the speaker
    assert by["s"].boost == pytest.approx(_length(by["s"].fact.text) * RRF_UNIT)
    # said by Tim: entity overlap and speaker, no answer type
    assert by["a"].boost == pytest.approx(
        (ENTITY_WEIGHT + SPEAKER_WEIGHT + _length(by["a"].fact.text)) * RRF_UNIT)
    out = rerank_head(candidates(), ["tim"])  # no labels: no answer type
    assert out[0].fact.id == "w"


def test_rerank_head_prefers_what_the_asked_about_person_says():
    # both name Melanie; only one is said by her
    said = _scored("s", "Melanie: I went camping with the kids.", 0.05, doc="c/1", index=3,
                   entities=["melanie", "kids"])
    named = _scored("n", "Caroline: Melanie, the camping pics are great!", 0.05, doc="c/2",
                    index=7, entities=["caroline", "melanie"])
    out = rerank_head([named, said], ["melanie"])
    assert [x.fact.id for x in out] == ["s", "n"]
    assert said.boost - named.boost == pytest.approx(
        (SPEAKER_WEIGHT + _length(said.fact.text) - _length(named.fact.text)) * RRF_UNIT)
    # a fact without a "Speaker:" prefix has no speaker, whatever its first entity
    plain = _scored("p", "Melanie went camping.", 0.05, entities=["melanie"])
    rerank_head([plain], ["melanie"])
    assert plain.boost == pytest.approx((ENTITY_WEIGHT + _length(plain.fact.text)) * RRF_UNIT)


def test_rrf_facts_of_one_passage_share_a_rank():
    # a1 and a2 come from one passage (a model's fact beside the offline one): together
    # they take rank 1, and b, the next passage, keeps rank 2 instead of falling to 3
    rankings = {"s": ["a1", "a2", "b"], "k": ["b", "a2"]}
    fused = dict(rrf(rankings, k=60, passage={"a1": "A", "a2": "A"}))
    assert fused["a1"] == pytest.approx(1 / 61)
    assert fused["a2"] == pytest.approx(1 / 61 + 1 / 62)
    assert fused["b"] == pytest.approx(1 / 62 + 1 / 61)
    plain = dict(rrf(rankings, k=60))
    assert plain["b"] == pytest.approx(1 / 63 + 1 / 61)
    # ids without a passage are passages of their own; a repeated id keeps its place
    assert dict(rrf({"s": ["x", "x", "y"]}, k=60, passage={"z": "Z"}))["y"] == pytest.approx(1 / 63)


def test_the_temporal_arms_rank_counts_again_in_the_head():
    # the query named a time: the temporal arm ranked "a" first and "b" fifth
    a = _scored("a", "Tim: ok.", 0.05, doc="c/1", index=1)
    b = _scored("b", "Tim: ok.", 0.05, doc="c/2", index=5)
    c = _scored("c", "Tim: ok.", 0.05, doc="c/3", index=9)
    a.ranks["temporal"], b.ranks["temporal"] = 1, 5
    feats = head_features([a, b, c], [])
    assert [f["time_rank"] for f in feats] == pytest.approx([1.0, (RRF_K + 1) / (RRF_K + 5), 0.0])
    out = rerank_head([c, b, a], [])
    assert [s.fact.id for s in out] == ["a", "b", "c"]
    assert a.boost - c.boost == pytest.approx(TIME_RANK_WEIGHT * RRF_UNIT)


def test_head_features_are_the_weighted_ones_and_bounded():
    a = _scored("a", "Nate: I adopted a turtle named Tilly last week.", 0.06, doc="c/1",
                index=4, entities=["nate", "tilly"])
    b = _scored("b", "Joanna: So cute!", 0.03, doc="c/1", index=5, entities=["joanna"])
    b.ranks["temporal"] = 2
    for listing in (False, True):
        feats = head_features([a, b], ["nate"], frozenset({"PERSON"}), listing)
        assert all(set(f) == set(head_weights()) for f in feats)
        assert all(0.0 <= v <= 1.0 for f in feats for v in f.values())
        assert (feats[0]["list_length"] > 0) is listing and (feats[0]["length"] > 0) is not listing
    # a: entity and speaker; the answer type names Tilly, not the speaker; b next to a
    assert feats[0]["entity"] == feats[0]["speaker"] == feats[0]["answer_type"] == 1.0
    assert feats[1]["adjacent"] == 1.0 and feats[0]["adjacent"] == pytest.approx(0.5)


def test_rrf_breaks_ties_by_the_order_key_before_the_id():
    rankings = {"s": ["b"], "k": ["a"]}  # a and b tie: one rank 1 each
    assert [d for d, _ in rrf(rankings)] == ["a", "b"]  # by id
    assert [d for d, _ in rrf(rankings, order={"a": ("doc", 2), "b": ("doc", 1)})] == ["b", "a"]
    # an id without a key comes after those with one
    assert [d for d, _ in rrf(rankings, order={"b": ("doc", 9)})] == ["b", "a"]


def test_tie_key_is_where_the_fact_was_told():
    told = Fact(id="z", bank_id="b", text="Nate: hi", document_id="conv", item_index=3)
    later = Fact(id="a", bank_id="b", text="Nate: hi", document_id="conv", item_index=4)
    loose = Fact(id="q", bank_id="b", text="A pump failed.")
    assert sorted([later, told], key=tie_key) == [told, later]
    assert tie_key(loose) == ("", 0, "A pump failed.", "q")
