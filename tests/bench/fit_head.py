"""Fit the head reranker's feature weights on LoCoMo by coordinate ascent on recall@10.

Retains each conversation into its own bank of an embedded server started in this
process (as ``locomo_retrieval.py`` does), recalls every question of categories 1–4 and
keeps, for each, the head that ``mneme.retrieval.rerank_head`` receives: every head
result's ``final`` score before the reranker, its ``head_features`` and its dialog ids,
and the dialog ids of the tail. A head is then re-scored offline for any weights as
final / RRF_UNIT + Σ weight × feature (what ``rerank_head`` adds), so thousands of weight
vectors are scored in seconds without recalling again.

The weights are fitted by coordinate ascent (D. Metzler, W. B. Croft, "Linear
feature-based models for information retrieval", Information Retrieval 10(3), 2007):
starting from the current weights (``mneme.retrieval.head_weights``), each weight in
turn is moved by the step that most raises mean evidence recall@10 over the questions,
for ``--rounds`` rounds or until no step helps. Prints, for each conversation, the
weights fitted on the others and the recall@10 of both weight vectors on it (leave one
conversation out: an estimate of what the fit is worth on conversations it did not
see), then the fit on all conversations. recall@10 and nDCG@10 per category for the
current weights, the cross-validated fits and the fit on all. ``--json``: the last line
is one JSON object with those figures.

``--heads FILE`` writes the heads (JSON lines) after recalling, or reads them instead of
retaining and recalling when FILE exists, so fits can be repeated on the same heads.

Usage: python tests/bench/fit_head.py --data FILE [--conversations ID ...]
       [--heads FILE] [--rounds 3] [--json]
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import tempfile
from collections import defaultdict
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("LITELLM_LOCAL_MODEL_COST_MAP", "True")
ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

import numpy as np  # noqa: E402

import services.search.recall as recall_module  # noqa: E402
from mneme import locomo, retrieval  # noqa: E402
from mneme.client import MnemeClient  # noqa: E402
from mneme.config import Settings  # noqa: E402
from mneme.runtime.embedded import bootstrap  # noqa: E402

CATEGORIES = {1: "multi-hop", 2: "temporal", 3: "open-domain", 4: "single-hop"}
#: Steps tried for one weight per pass, in RRF units.
STEPS = (-1.0, -0.5, -0.25, -0.1, 0.1, 0.25, 0.5, 1.0)


def head_row(results, query_entities, head: int = retrieval.RERANK_HEAD,
             labels: frozenset[str] = frozenset(), listing: bool = False) -> dict:
    """What the fit keeps of one recall, from the arguments ``rerank_head`` receives:
    ``head`` (per head result: ``final`` / RRF_UNIT before the reranker adds its features,
    the ``features``, the ``dia`` ids) and ``tail`` (dialog ids per result after it)."""
    top = results[:retrieval.head_end(results, head)]
    feats = retrieval.head_features(top, query_entities, labels, listing)
    return {"head": [{"final": s.final / retrieval.RRF_UNIT, "features": f,
                      "dia": locomo.dia_ids([s])} for s, f in zip(top, feats)],
            "tail": [locomo.dia_ids([s]) for s in results[len(top):]]}


def collect(data: Path, conversations: list[str]) -> list[dict]:
    """Retain and recall; one dict per question: conversation, category, evidence,
    ``head`` (per result: ``final`` / RRF_UNIT before the reranker adds its features,
    the ``features``, the ``dia`` ids) and ``tail`` (dialog ids per result after the
    head)."""
    heads: list[dict] = []
    current: dict = {}
    original = recall_module.rerank_head

    def spy(results, query_entities, head=retrieval.RERANK_HEAD, labels=frozenset(),
            listing=False):
        heads.append(current | head_row(results, query_entities, head, labels, listing))
        return original(results, query_entities, head=head, labels=labels, listing=listing)

    convs = locomo.load(data)
    if conversations:
        convs = [c for c in convs if c["sample_id"] in set(conversations)]
    recall_module.rerank_head = spy
    try:
        with tempfile.TemporaryDirectory(prefix="fit-head-") as tmp:
            node = bootstrap(Settings(data_dir=Path(tmp)))
            node.start()
            port = node.serve("127.0.0.1:0")
            try:
                with MnemeClient(f"127.0.0.1:{port}") as m:
                    for c in convs:
                        sid = c["sample_id"]
                        m.upsert_bank(sid)
                        for s in locomo.sessions(c):
                            m.retain(sid, s.items)
                        for q in locomo.questions(c):
                            if not q.get("evidence"):
                                continue
                            current.clear()
                            current.update(conversation=sid, category=q["category"],
                                           evidence=q["evidence"])
                            m.recall(sid, q["question"], budget="mid", max_tokens=8192)
                        print(f"{sid}: recalled", file=sys.stderr, flush=True)
            finally:
                node.close()
    finally:
        recall_module.rerank_head = original
    return heads


class Heads:
    """The heads as arrays: per question, its features (results × features), scores
    before the reranker, dialog ids, evidence."""

    def __init__(self, rows: list[dict], names: list[str]):
        self.names = names
        self.rows = rows
        self.x = [np.array([[r["features"][n] for n in names] for r in row["head"]])
                  .reshape(len(row["head"]), len(names)) for row in rows]
        self.base = [np.array([r["final"] for r in row["head"]]) for row in rows]

    def ranked(self, i: int, w: np.ndarray, k: int = 10) -> list[str]:
        """The first ``k`` distinct dialog ids of question ``i`` under weights ``w``."""
        row = self.rows[i]
        order = np.argsort(-(self.base[i] + self.x[i] @ w), kind="stable")
        out: list[str] = []
        for ids in [row["head"][j]["dia"] for j in order] + row["tail"]:
            for d in ids:
                if d not in out:
                    out.append(d)
            if len(out) >= k:
                break
        return out[:k]

    def recall(self, idx: list[int], w: np.ndarray) -> float:
        return sum(locomo.recall_at(self.ranked(i, w), self.rows[i]["evidence"], 10)
                   for i in idx) / max(1, len(idx))

    def report(self, idx: list[int], w: np.ndarray) -> dict:
        """recall@10 and nDCG@10 per category and overall over questions ``idx``."""
        per: dict[str, list[tuple[float, float]]] = defaultdict(list)
        for i in idx:
            ranked, ev = self.ranked(i, w), self.rows[i]["evidence"]
            pair = (locomo.recall_at(ranked, ev, 10), locomo.ndcg_at(ranked, ev, 10))
            per[CATEGORIES.get(self.rows[i]["category"], "other")].append(pair)
            per["overall"].append(pair)
        return {c: {"recall@10": round(sum(p[0] for p in v) / len(v), 4),
                    "ndcg@10": round(sum(p[1] for p in v) / len(v), 4)} for c, v in per.items()}


def fit(heads: Heads, idx: list[int], w0: np.ndarray, rounds: int) -> np.ndarray:
    """Coordinate ascent from ``w0`` on mean recall@10 over questions ``idx``; a step is
    kept only when it gains more than 1e-4."""
    w, best = w0.copy(), heads.recall(idx, w0)
    for _ in range(rounds):
        moved = False
        for j in range(len(w)):
            pick = None
            for step in STEPS:
                v = w.copy()
                v[j] += step
                score = heads.recall(idx, v)
                if score > best + 1e-4:
                    best, pick = score, v
            if pick is not None:
                w, moved = pick, True
        if not moved:
            break
    return w


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--data", type=Path, required=True)
    ap.add_argument("--conversations", nargs="*", default=[])
    ap.add_argument("--heads", type=Path, help="JSON lines of heads: read if it exists, else written")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--json", action="store_true")
    a = ap.parse_args()
    if a.heads and a.heads.exists():
        rows = [json.loads(line) for line in a.heads.read_text().splitlines() if line]
    else:
        rows = collect(a.data, a.conversations)
        if a.heads:
            a.heads.write_text("".join(json.dumps(r) + "\n" for r in rows))
    weights = retrieval.head_weights()
    names = list(weights)
    heads = Heads(rows, names)
    w0 = np.array([weights[n] for n in names])

    def named(w: np.ndarray) -> dict[str, float]:
        return {n: round(float(w[j]), 3) for j, n in enumerate(names)}

    convs = sorted({r["conversation"] for r in rows})
    cv = np.zeros(len(rows))
    folds = {}
    for c in convs:
        train = [i for i, r in enumerate(rows) if r["conversation"] != c]
        test = [i for i, r in enumerate(rows) if r["conversation"] == c]
        w = fit(heads, train, w0, a.rounds)
        for i in test:
            cv[i] = locomo.recall_at(heads.ranked(i, w), rows[i]["evidence"], 10)
        folds[c] = {"weights": named(w), "current": round(heads.recall(test, w0), 4),
                    "fitted": round(heads.recall(test, w), 4)}
        print(f"{c}: fitted on the others {folds[c]['weights']}; recall@10 here "
              f"{folds[c]['current']:.4f} → {folds[c]['fitted']:.4f}", flush=True)
    everyone = list(range(len(rows)))
    w_all = fit(heads, everyone, w0, a.rounds)
    by_cat: dict[str, list[float]] = defaultdict(list)
    for i, r in enumerate(rows):
        by_cat[CATEGORIES.get(r["category"], "other")].append(cv[i])
        by_cat["overall"].append(cv[i])
    result = {
        "questions": len(rows),
        "current": {"weights": named(w0), **heads.report(everyone, w0)},
        "cross_validated": {c: round(sum(v) / len(v), 4) for c, v in by_cat.items()},
        "fitted_on_all": {"weights": named(w_all), **heads.report(everyone, w_all)},
        "folds": folds,
    }
    for key in ("current", "fitted_on_all"):
        rep = result[key]
        print(f"{key}: {rep['weights']}")
        for c in ("multi-hop", "temporal", "open-domain", "single-hop", "overall"):
            if c in rep:
                print(f"  {c:12} recall@10 {rep[c]['recall@10']:.4f}  nDCG@10 {rep[c]['ndcg@10']:.4f}")
    print("cross-validated recall@10 (each conversation with the weights fitted on the "
          "others): " + ", ".join(f"{c} {v:.4f}" for c, v in result["cross_validated"].items()))
    if a.json:
        print(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
