"""Recall latency with retains in between (issue 13: recall stays fast while a bank grows).

Opens a copy of a kept data dir (``recall_load.py --keep DIR`` makes one: ``DIR/data``)
in an embedded node in this process and, ``--n`` times, retains one turn of the
conversation synchronously (under a new document id) and then recalls one of its
questions (budget mid, max_tokens 4096), timing only the recall. Every retain changes
the bank, so this shows what a recall costs right after a write (the graph arm's
in-memory adjacency, the caches). Prints p50/p95/max in ms as one JSON line. Not part
of ``make test``: no assertion on any figure.

Usage: python tests/bench/recall_interleaved.py --data-dir DIR/data --conversation conv-26
       [--data ../shared/data/locomo/locomo_dev.json] [--n 40]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("LITELLM_LOCAL_MODEL_COST_MAP", "True")

from mneme import locomo  # noqa: E402
from mneme.client import MnemeClient  # noqa: E402
from mneme.config import Settings  # noqa: E402
from mneme.runtime.embedded import bootstrap  # noqa: E402


def main() -> int:
    ap = argparse.ArgumentParser(description="recall latency with a sync retain before each")
    ap.add_argument("--data-dir", required=True, type=Path, help="a stopped server's data dir")
    ap.add_argument("--conversation", required=True, help="its bank (a LoCoMo sample id)")
    ap.add_argument("--data", type=Path, default=ROOT.parent / "shared/data/locomo/locomo_dev.json")
    ap.add_argument("--n", type=int, default=40)
    args = ap.parse_args()
    conv = next((c for c in locomo.load(args.data) if c["sample_id"] == args.conversation), None)
    if conv is None:
        raise SystemExit(f"no conversation {args.conversation} in {args.data}")
    questions = [q["question"] for q in locomo.questions(conv) if q.get("evidence")]
    turns = [it for s in locomo.sessions(conv) for it in s.items]
    latencies: list[float] = []
    with tempfile.TemporaryDirectory(prefix="mneme-interleaved-") as tmp:
        shutil.copytree(args.data_dir, Path(tmp) / "data")  # the kept dir stays as it was
        node = bootstrap(Settings(data_dir=Path(tmp) / "data"))
        node.start()
        port = node.serve("127.0.0.1:0")
        try:
            with MnemeClient(f"127.0.0.1:{port}") as m:
                for q in questions[:5]:  # warm-up: caches, the adjacency, the models
                    m.recall(args.conversation, q, budget="mid", max_tokens=4096)
                for i in range(args.n):
                    item = dict(turns[i % len(turns)], document_id=f"interleaved/{i}")
                    m.retain(args.conversation, [item])
                    t0 = time.perf_counter()
                    m.recall(args.conversation, questions[i % len(questions)], budget="mid",
                             max_tokens=4096)
                    latencies.append((time.perf_counter() - t0) * 1000)
        finally:
            node.close()
    s = sorted(latencies)
    print(json.dumps({"n": len(s), "p50_ms": round(s[len(s) // 2], 1),
                      "p95_ms": round(s[min(len(s) - 1, int(len(s) * 0.95))], 1),
                      "max_ms": round(s[-1], 1)}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
