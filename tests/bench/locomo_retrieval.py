"""LoCoMo retrieval benchmark: evidence recall@k and nDCG@10 of mneme's recall.

Retains each conversation into its own bank (every turn, session date as timestamp,
``dia_id`` in metadata) through the gRPC API of an embedded server started in this
process, then recalls every question of categories 1–4 and scores the distinct dialog
ids of the results against the question's evidence. Prints a table per category and
overall, recall latency p50/p95 and retain throughput; with ``--json`` the last line
is one JSON object.

Usage: python tests/bench/locomo_retrieval.py --data FILE [--conversations ID ...]
       [--json] [--budget mid] [--max-tokens 8192]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from collections import defaultdict
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")

from rich.console import Console  # noqa: E402
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn  # noqa: E402
from rich.table import Table  # noqa: E402

from mneme import locomo  # noqa: E402
from mneme.runtime.embedded import bootstrap  # noqa: E402
from mneme.client import MnemeClient  # noqa: E402
from mneme.config import Settings  # noqa: E402

CATEGORIES = {1: "multi-hop", 2: "temporal", 3: "open-domain", 4: "single-hop"}
KS = (5, 10, 20)


def run(data: Path, conversations: list[str], budget: str, max_tokens: int, console: Console) -> dict:
    convs = [c for c in locomo.load(data) if not conversations or c["sample_id"] in conversations]
    if not convs:
        raise SystemExit(f"no conversations {conversations} in {data}")
    per_cat: dict[int, list[dict]] = defaultdict(list)
    latencies: list[float] = []
    turns = 0
    retain_s = 0.0
    with tempfile.TemporaryDirectory(prefix="mneme-bench-") as tmp:
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
                    m.upsert_bank(sid)
                    t0 = time.perf_counter()
                    for s in sessions:
                        m.retain(sid, s.items)
                        prog.advance(task, len(s.items))
                    retain_s += time.perf_counter() - t0
                    turns += n
                    qs = [q for q in locomo.questions(c) if q.get("evidence")]
                    task = prog.add_task(f"recall {sid}", total=len(qs))
                    for q in qs:
                        t0 = time.perf_counter()
                        r = m.recall(sid, q["question"], budget=budget, max_tokens=max_tokens)
                        latencies.append((time.perf_counter() - t0) * 1000)
                        ranked = locomo.dia_ids(r.results)
                        ev = [e for e in q["evidence"]]
                        row = {f"recall@{k}": locomo.recall_at(ranked, ev, k) for k in KS}
                        row["ndcg@10"] = locomo.ndcg_at(ranked, ev, 10)
                        per_cat[q["category"]].append(row)
                        prog.advance(task)
        finally:
            node.close()

    def mean(rows: list[dict]) -> dict:
        keys = [f"recall@{k}" for k in KS] + ["ndcg@10"]
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
        "budget": budget, "max_tokens": max_tokens,
    }


def main() -> int:
    ap = argparse.ArgumentParser(description="LoCoMo evidence-retrieval benchmark for mneme")
    ap.add_argument("--data", required=True, type=Path)
    ap.add_argument("--conversations", nargs="*", default=[])
    ap.add_argument("--json", action="store_true", help="print the figures as JSON on the last line")
    ap.add_argument("--budget", default="mid", choices=("low", "mid", "high"))
    ap.add_argument("--max-tokens", type=int, default=8192)
    args = ap.parse_args()
    console = Console(stderr=True)
    res = run(args.data, args.conversations, args.budget, args.max_tokens, console)
    t = Table("category", "n", "recall@5", "recall@10", "recall@20", "nDCG@10",
              title=f"LoCoMo evidence retrieval ({', '.join(res['conversations'])})")
    for name, row in list(res["categories"].items()) + [("overall", res["overall"])]:
        t.add_row(name, str(row["n"]), *(f"{row[k]:.3f}" for k in
                                         ("recall@5", "recall@10", "recall@20", "ndcg@10")))
    Console().print(t)
    print(f"recall latency p50 {res['latency_ms']['p50']} ms, p95 {res['latency_ms']['p95']} ms; "
          f"retain {res['retain_turns_per_s']} turns/s")
    if args.json:
        print(json.dumps(res))
    return 0


if __name__ == "__main__":
    sys.exit(main())
