"""The main job on the embedded defaults (``make run``).

Starts ``mneme up`` on a fresh data directory, retains the shipped LoCoMo conversation
(every turn, the session date as timestamp, ``dia_id`` in metadata) and prints, for a
handful of its questions, the recalled memories and a reflect answer.

Usage: python examples/run_locomo.py [--data-dir DIR] [--keep] [--questions N]
"""

from __future__ import annotations

import argparse
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from mneme import locomo
from mneme.cli import print_recall
from mneme.client import MnemeClient

HERE = Path(__file__).resolve().parent
CONVERSATION = HERE / "locomo" / "conv-26.json"
CATEGORY = {1: "multi-hop", 2: "temporal", 3: "open-domain", 4: "single-hop"}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--data-dir", help="default: a fresh temporary directory")
    ap.add_argument("--keep", action="store_true", help="keep the data directory")
    ap.add_argument("--questions", type=int, default=8, help="questions to show (a quarter per category)")
    args = ap.parse_args()
    data_dir = Path(args.data_dir or tempfile.mkdtemp(prefix="mneme-run-"))
    port = free_port()
    address = f"127.0.0.1:{port}"
    mneme = Path(sys.executable).with_name("mneme")
    print(f"starting `mneme up` on {address}, data in {data_dir}", flush=True)
    server = subprocess.Popen([str(mneme), "up", "--data-dir", str(data_dir), "--address", address],
                              env={**os.environ, "PYTHONUNBUFFERED": "1"})
    try:
        with MnemeClient(address) as m:
            m.wait_ready(timeout=180)
            conv = locomo.load(CONVERSATION)[0]
            t0 = time.monotonic()
            subprocess.run([str(mneme), "import-locomo", str(CONVERSATION), "--address", address],
                           check=True)
            turns = sum(len(s.items) for s in locomo.sessions(conv))
            print(f"retained {turns} turns in {time.monotonic() - t0:.1f}s "
                  f"({sum(1 for _ in m.list_memories(conv['sample_id']))} memories)\n")
            picked, seen = [], set()
            for q in locomo.questions(conv):  # a few of each category, in file order
                if sum(1 for p in picked if p["category"] == q["category"]) < max(1, args.questions // 4) \
                        and q["question"] not in seen and len(picked) < args.questions:
                    picked.append(q)
                    seen.add(q["question"])
            for q in picked:
                print("=" * 100)
                print(f"Q ({CATEGORY[q['category']]}): {q['question']}")
                print(f"expected: {q['answer']}   evidence: {', '.join(q['evidence'])}")
                r = m.recall(conv["sample_id"], q["question"], max_tokens=512)
                print_recall(r, limit=5)
                cited = [res.memory.metadata.get("dia_id") for res in r.results[:10]]
                hit = sorted(set(q["evidence"]) & set(cited))
                print(f"evidence in top 10: {', '.join(hit) if hit else 'none'}")
                a = m.reflect(conv["sample_id"], q["question"])
                print("reflect:", a.text)
                print()
    finally:
        server.terminate()
        server.wait(timeout=60)
        if not args.keep and not args.data_dir:
            shutil.rmtree(data_dir, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
