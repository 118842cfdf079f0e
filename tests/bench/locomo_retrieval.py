"""LoCoMo retrieval benchmark: evidence recall@k and nDCG@10 of mneme's recall.

Retains each conversation into its own bank (every turn, session date as timestamp,
``dia_id`` in metadata) through the gRPC API of an embedded server started in this
process, then recalls every question of categories 1–4 and scores the distinct dialog
ids of the results against the question's evidence. Prints a table per category and
overall (evidence recall@k, nDCG@10, and session recall@k: the fraction of the evidence's
sessions among the first k distinct sessions of the results, for comparison with systems
that retrieve whole sessions), recall latency p50/p95 and retain throughput; with
``--json`` the last line is one JSON object.

``--misses FILE`` writes one JSON object per line for every evidence id missing from the
top 10: the question, its category, the evidence turn's text, the evidence's fused rank
(0 = not returned) and best rank per arm (0 = that arm did not return it), and the top 3
results that beat it (text, dialog ids, per-arm ranks).

``--model sentences|empty`` retains through a retain *model*: a local OpenAI-compatible
stub (``tests/llm/stub.py``) over real HTTP and litellm, standing in for a weak model, so
the model path can be compared with offline extraction on the same data. ``sentences``
makes one fact per sentence of the turn with "I"/"my"/"me" replaced by the speaker's name
and drops the shared photo; ``empty`` finds nothing in any turn (the worst a model can do
without failing). ``--extraction-mode`` sets the banks' ``config.extraction_mode``
(default ``auto``: with a model, its facts with the offline facts beside them).

Usage: python tests/bench/locomo_retrieval.py --data FILE [--conversations ID ...]
       [--json] [--budget mid] [--max-tokens 8192] [--misses FILE]
       [--model sentences|empty] [--extraction-mode auto|offline|llm|llm_only]
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import re
import statistics
import sys
import tempfile
import time
from collections import defaultdict
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("LITELLM_LOCAL_MODEL_COST_MAP", "True")
ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))  # tests.llm.stub when run as a script

from rich.console import Console  # noqa: E402
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn  # noqa: E402
from rich.table import Table  # noqa: E402

from mneme import locomo  # noqa: E402
from mneme.runtime.embedded import bootstrap  # noqa: E402
from mneme.client import MnemeClient  # noqa: E402
from mneme.config import Settings  # noqa: E402
from mneme.domain import EXTRACTION_MODES  # noqa: E402

CATEGORIES = {1: "multi-hop", 2: "temporal", 3: "open-domain", 4: "single-hop"}
KS = (5, 10, 20)
SESSION_KS = (1, 3, 5)
ARMS = ("semantic", "keyword", "graph", "temporal")


def _turn_texts(conv: dict) -> dict[str, str]:
    """dia_id → "Speaker: text [photo: caption]" of every turn of a conversation."""
    out = {}
    for s in locomo.sessions(conv):
        for it in s.items:
            cap = it["metadata"].get("blip_caption")
            out[it["metadata"]["dia_id"]] = it["content"] + (f" [photo: {cap}]" if cap else "")
    return out


def _arm_ranks(result) -> dict[str, int]:
    return {a: getattr(result.scores, f"{a}_rank") for a in ARMS}


def _misses(q: dict, results, ranked: list[str], turns: dict[str, str], k: int = 10) -> list[dict]:
    """One record per evidence id of ``q`` not among the first ``k`` ranked dialog ids."""
    out = []
    ids = [{x.strip() for x in (r.memory.metadata.get("dia_id") or "").split(",") if x.strip()}
           for r in results]
    for ev in q["evidence"]:
        if ev in ranked[:k]:
            continue
        best = {a: 0 for a in ARMS}
        for r, dias in zip(results, ids):
            if ev in dias:
                for a, rank in _arm_ranks(r).items():
                    if rank and (not best[a] or rank < best[a]):
                        best[a] = rank
        out.append({
            "question": q["question"], "category": CATEGORIES[q["category"]],
            "answer": str(q.get("answer", "")), "evidence": ev, "evidence_text": turns.get(ev, ""),
            "rank": ranked.index(ev) + 1 if ev in ranked else 0, "arm_ranks": best,
            "beaten_by": [{"text": r.memory.text, "dia_id": r.memory.metadata.get("dia_id", ""),
                           "ranks": _arm_ranks(r)} for r in results[:3]],
        })
    return out


_SENT = re.compile(r"(?<=[.!?])\s+")
_FIRST_PERSON = [(re.compile(r"\bI(?:'m| am)\b"), "{} is"), (re.compile(r"\bI've\b"), "{} has"),
                 (re.compile(r"\bI'll\b"), "{} will"), (re.compile(r"\bI'd\b"), "{} would"),
                 (re.compile(r"\bI\b"), "{}"), (re.compile(r"\b[Mm]y\b"), "{}'s"),
                 (re.compile(r"\b(?:me|myself)\b"), "{}")]


def sentence_facts(request) -> dict:
    """The ``sentences`` stand-in model's reply to one retain request: a fact per sentence
    of the text (of at least 3 words), first person replaced by the speaker's name."""
    user = request.messages[-1]["content"]
    speaker = re.search(r"^Speaker: ([^\n(]+)", user, re.M)
    name = speaker.group(1).strip() if speaker else "Someone"
    text = user.split('Text:\n"""\n', 1)[-1].rsplit('\n"""', 1)[0]
    text = re.sub(r"^[^:\n]{1,40}:\s+", "", text)  # the "Speaker:" prefix of a chat turn
    facts = []
    for sent in _SENT.split(text):
        for rx, repl in _FIRST_PERSON:
            sent = rx.sub(repl.format(name), sent)
        if len(sent.split()) >= 3:
            facts.append({"text": sent, "fact_type": "world", "occurred_start": None,
                          "occurred_end": None, "entities": [{"name": name, "type": "person"}],
                          "caused_by": []})
    return {"facts": facts}


@contextlib.contextmanager
def retain_model(kind: str | None):
    """Point the retain model (only: reflect and consolidation stay offline) at a stub
    serving ``kind``; nothing when ``kind`` is None."""
    if kind is None:
        yield
        return
    from tests.llm.stub import StubLLM, chat, computed
    with StubLLM() as stub:
        stub.on("chat", computed(lambda req: chat(
            sentence_facts(req) if kind == "sentences" else {"facts": []})), forever=True)
        env = {"MNEME_RETAIN_LLM_MODEL": "openai/stand-in", "MNEME_RETAIN_LLM_BASE_URL": stub.base_url,
               "MNEME_RETAIN_LLM_API_KEY": "sk-bench"}
        old = {k: os.environ.get(k) for k in env}
        os.environ.update(env)
        try:
            yield
        finally:
            for k, v in old.items():
                if v is None:
                    os.environ.pop(k, None)
                else:
                    os.environ[k] = v


def run(data: Path, conversations: list[str], budget: str, max_tokens: int, console: Console,
        misses: list[dict] | None = None, model: str | None = None,
        extraction_mode: str = "auto") -> dict:
    convs = [c for c in locomo.load(data) if not conversations or c["sample_id"] in conversations]
    if not convs:
        raise SystemExit(f"no conversations {conversations} in {data}")
    per_cat: dict[int, list[dict]] = defaultdict(list)
    latencies: list[float] = []
    turns = 0
    retain_s = 0.0
    with tempfile.TemporaryDirectory(prefix="mneme-bench-") as tmp, retain_model(model):
        node = bootstrap(Settings(data_dir=Path(tmp)))
        node.start()
        port = node.serve("127.0.0.1:0")
        try:
            with MnemeClient(f"127.0.0.1:{port}") as m, Progress(
                    TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(),
                    TimeElapsedColumn(), console=console, transient=True) as prog:
                for c in convs:
                    sid = c["sample_id"]
                    sessions = locomo.sessions(c)
                    n = sum(len(s.items) for s in sessions)
                    task = prog.add_task(f"retain {sid}", total=n)
                    m.upsert_bank(sid, extraction_mode=extraction_mode)
                    t0 = time.perf_counter()
                    for s in sessions:
                        m.retain(sid, s.items)
                        prog.advance(task, len(s.items))
                    retain_s += time.perf_counter() - t0
                    turns += n
                    qs = [q for q in locomo.questions(c) if q.get("evidence")]
                    turn_texts = _turn_texts(c) if misses is not None else {}
                    task = prog.add_task(f"recall {sid}", total=len(qs))
                    for q in qs:
                        t0 = time.perf_counter()
                        r = m.recall(sid, q["question"], budget=budget, max_tokens=max_tokens)
                        latencies.append((time.perf_counter() - t0) * 1000)
                        ranked = locomo.dia_ids(r.results)
                        ev = [e for e in q["evidence"]]
                        row = {f"recall@{k}": locomo.recall_at(ranked, ev, k) for k in KS}
                        row["ndcg@10"] = locomo.ndcg_at(ranked, ev, 10)
                        sessions_ranked = locomo.session_ids(ranked)
                        ev_sessions = locomo.session_ids(ev)
                        for k in SESSION_KS:
                            row[f"session@{k}"] = locomo.recall_at(sessions_ranked, ev_sessions, k)
                        if misses is not None:
                            for miss in _misses(q, list(r.results), ranked, turn_texts):
                                misses.append({"conversation": sid} | miss)
                        per_cat[q["category"]].append(row)
                        prog.advance(task)
        finally:
            node.close()

    def mean(rows: list[dict]) -> dict:
        keys = [f"recall@{k}" for k in KS] + ["ndcg@10"] + [f"session@{k}" for k in SESSION_KS]
        return {k: round(statistics.fmean(r[k] for r in rows), 4) for k in keys} | {"n": len(rows)}

    everything = [r for rows in per_cat.values() for r in rows]
    lat = sorted(latencies)
    return {
        "overall": mean(everything),
        "categories": {CATEGORIES[c]: mean(rows) for c, rows in sorted(per_cat.items())},
        "latency_ms": {"p50": round(lat[len(lat) // 2], 1),
                       "p95": round(lat[min(len(lat) - 1, int(len(lat) * 0.95))], 1)},
        "retain_turns_per_s": round(turns / retain_s, 1),
        "conversations": [c["sample_id"] for c in convs],
        "budget": budget, "max_tokens": max_tokens, "model": model,
        "extraction_mode": extraction_mode,
    }


def main() -> int:
    ap = argparse.ArgumentParser(description="LoCoMo evidence-retrieval benchmark for mneme")
    ap.add_argument("--data", required=True, type=Path)
    ap.add_argument("--conversations", nargs="*", default=[])
    ap.add_argument("--json", action="store_true", help="print the figures as JSON on the last line")
    ap.add_argument("--budget", default="mid", choices=("low", "mid", "high"))
    ap.add_argument("--max-tokens", type=int, default=8192)
    ap.add_argument("--misses", type=Path, help="write each evidence id missed at 10 (JSON lines)")
    ap.add_argument("--model", choices=("sentences", "empty"),
                    help="retain through a stand-in model over HTTP (see the module docs)")
    ap.add_argument("--extraction-mode", default="auto", choices=EXTRACTION_MODES)
    args = ap.parse_args()
    console = Console(stderr=True)
    misses: list[dict] | None = [] if args.misses else None
    res = run(args.data, args.conversations, args.budget, args.max_tokens, console, misses,
              args.model, args.extraction_mode)
    if args.misses:
        args.misses.write_text("".join(json.dumps(m) + "\n" for m in misses))
        console.print(f"{len(misses)} missed evidence ids written to {args.misses}")
    cols = [f"recall@{k}" for k in KS] + ["ndcg@10"] + [f"session@{k}" for k in SESSION_KS]
    t = Table("category", "n", *(c.replace("ndcg", "nDCG") for c in cols),
              title=f"LoCoMo evidence retrieval ({', '.join(res['conversations'])})")
    for name, row in list(res["categories"].items()) + [("overall", res["overall"])]:
        t.add_row(name, str(row["n"]), *(f"{row[k]:.3f}" for k in cols))
    Console(width=max(120, Console().width)).print(t)
    print(f"recall latency p50 {res['latency_ms']['p50']} ms, p95 {res['latency_ms']['p95']} ms; "
          f"retain {res['retain_turns_per_s']} turns/s")
    if args.json:
        print(json.dumps(res))
    return 0


if __name__ == "__main__":
    sys.exit(main())
