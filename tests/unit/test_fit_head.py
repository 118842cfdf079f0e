"""The head-weight fit (tests/bench/fit_head.py) re-scores a recall's head as
``rerank_head`` orders it, so the weights it fits are the weights recall uses."""

from __future__ import annotations

import numpy as np

from mneme.domain import EntityRef, Fact, Scored
from mneme.retrieval import head_weights, rerank_head
from tests.bench.fit_head import Heads, fit, head_row


def _results() -> list[Scored]:
    # a spread of features: speakers named or not, neighbours, a temporal rank, lengths
    rows = [("D1:1", "Nate: I adopted a turtle.", 0.10, 1, ["nate"], None),
            ("D1:2", "Joanna: So cute! What is its name and how old is it now?", 0.06, 2,
             ["joanna"], 3),
            ("D2:7", "Joanna: I baked a dairy-free cake with strawberries for my family "
                     "last weekend and everyone loved it.", 0.055, 7, ["joanna"], None),
            ("D3:4", "Nate: Tilly the turtle loves strawberries.", 0.05, 4, ["nate", "tilly"], 1),
            ("D5:9", "Nate: ok.", 0.045, 9, ["nate"], None),
            ("D9:1", "Joanna: I wrote a screenplay.", 0.02, 1, ["joanna"], None)]
    out = []
    for dia, text, score, index, ents, temporal in rows:
        f = Fact(id=dia, bank_id="b", text=text, document_id=dia.split(":")[0],
                 item_index=index, metadata={"dia_id": dia},
                 entities=[EntityRef(e, e, "PERSON") for e in ents])
        s = Scored(fact=f, rrf=score, final=score)
        if temporal:
            s.ranks["temporal"] = temporal
        out.append(s)
    return out


def test_the_fit_rescored_head_is_the_order_rerank_head_gives():
    names = list(head_weights())
    w = np.array([head_weights()[n] for n in names])
    for listing in (False, True):
        results = _results()
        row = head_row(results, ["nate"], head=4, listing=listing) | {"evidence": ["D3:4"]}
        served = [s.fact.metadata["dia_id"]
                  for s in rerank_head(results, ["nate"], head=4, listing=listing)]
        assert Heads([row], names).ranked(0, w, k=len(served)) == served
        # weights of 0 leave the order before the reranker
        assert Heads([row], names).ranked(0, 0 * w, k=3) == ["D1:1", "D1:2", "D2:7"]


def test_coordinate_ascent_finds_the_weight_that_lifts_the_evidence():
    # eleven turns by Joanna outscore the one turn said by Nate, whom the query names;
    # only a heavier speaker (or entity) weight brings it into the first ten
    names = list(head_weights())
    w = np.array([head_weights()[n] for n in names])
    results = []
    for k in range(11):
        f = Fact(id=f"j{k}", bank_id="b", text="Joanna: I went out for a walk today.",
                 document_id=f"D{k}", item_index=1, metadata={"dia_id": f"D{k}:1"},
                 entities=[EntityRef("joanna", "joanna", "PERSON")])
        results.append(Scored(fact=f, rrf=0.10 - 0.001 * k, final=0.10 - 0.001 * k))
    f = Fact(id="n", bank_id="b", text="Nate: I went out for a walk today.", document_id="D20",
             item_index=1, metadata={"dia_id": "D20:1"},
             entities=[EntityRef("nate", "nate", "PERSON")])
    results.append(Scored(fact=f, rrf=0.001, final=0.001))
    heads = Heads([head_row(results, ["nate"]) | {"evidence": ["D20:1"]}], names)
    assert heads.recall([0], w) == 0.0
    fitted = fit(heads, [0], w, rounds=2)
    assert heads.recall([0], fitted) == 1.0
    moved = {n for n, a, b in zip(names, w, fitted) if a != b}
    assert moved and moved <= {"speaker", "entity"}
