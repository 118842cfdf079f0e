"""What crypto-shredding costs (issue 11): retain, recall and delete with ``erasure:
crypto_shred`` (user content sealed on the log) against ``erasure: none`` (plaintext),
side by side in ONE ``mneme up`` so both see the same machine at the same moment.

Per LoCoMo conversation of ``--data`` (``--conversations``, default the first three) two
banks are made, ``<id>-shred`` and ``<id>-plain``. Then, alternating which mode goes
first at every step:

* **retain**: every session is one sync Retain (batches of ≤ 50 items, one document per
  session) into both banks; items/s per mode = items / summed call time;
* **recall**: every question of categories 1–4 with evidence is recalled in both banks
  (budget mid, max_tokens 4096, world + experience), ``--rounds`` times; p50/p95 ms per
  mode (nearest rank);
* **delete**: ``--deletes`` sessions per conversation are deleted with sync
  DeleteDocument in both banks (the erasure operation: keys destroyed, units purged);
  p50 ms per mode.

Prints a table with the ratios crypto_shred / none, and with ``--json`` one object on
the last stdout line: ``{"retain_items_per_s": {"crypto_shred", "none"}, "recall_ms":
{mode: {"p50", "p95"}}, "delete_ms": {mode: {"p50"}}, "items", "queries", "cpu_count"}``.
Not part of ``make test``: no assertion on any figure.

Usage: python tests/bench/erasure_overhead.py --data FILE [--conversations ID ...]
       [--rounds 1] [--deletes 3] [--json]          (``make bench-erasure``)
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))  # tests.e2e.server when run as a script
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("LITELLM_LOCAL_MODEL_COST_MAP", "True")

from rich.console import Console  # noqa: E402
from rich.table import Table  # noqa: E402

from mneme import locomo  # noqa: E402
from tests.e2e.server import Server  # noqa: E402

MODES = ("crypto_shred", "none")
BATCH = 50


def pct(values: list[float], q: float) -> float:
    """Nearest-rank percentile ``q`` (0..100) of ``values`` (ms, rounded to 0.1)."""
    s = sorted(values)
    return round(s[max(0, min(len(s) - 1, int(round(q / 100 * len(s) + 0.5)) - 1))], 1)


def main() -> int:
    ap = argparse.ArgumentParser(description="crypto-shredding overhead, side by side")
    ap.add_argument("--data", required=True, type=Path)
    ap.add_argument("--conversations", nargs="*", default=[])
    ap.add_argument("--rounds", type=int, default=1, help="recall passes over the questions")
    ap.add_argument("--deletes", type=int, default=3, help="sessions deleted per conversation")
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    console = Console(stderr=True)
    convs = locomo.load(args.data)
    convs = [c for c in convs if c["sample_id"] in args.conversations] if args.conversations \
        else convs[:3]
    if not convs:
        raise SystemExit(f"no conversations {args.conversations} in {args.data}")
    retain_s = dict.fromkeys(MODES, 0.0)
    recall_ms: dict[str, list[float]] = {m: [] for m in MODES}
    delete_ms: dict[str, list[float]] = {m: [] for m in MODES}
    items = queries = 0
    with tempfile.TemporaryDirectory(prefix="mneme-erasure-") as tmp:
        server = Server(Path(tmp) / "data").start()
        try:
            with server.client() as m:
                step = 0

                def both(call):  # alternate which mode goes first
                    nonlocal step
                    step += 1
                    for mode in (MODES if step % 2 else MODES[::-1]):
                        t = time.perf_counter()
                        call(mode)
                        yield mode, time.perf_counter() - t

                for c in convs:
                    sid = c["sample_id"]
                    for mode in MODES:
                        m.upsert_bank(f"{sid}-{mode}", erasure=mode)
                    sessions = locomo.sessions(c)
                    for s in sessions:
                        for i in range(0, len(s.items), BATCH):
                            batch = s.items[i:i + BATCH]
                            items += len(batch)
                            for mode, dt in both(lambda md: m.retain(f"{sid}-{md}", batch)):
                                retain_s[mode] += dt
                    console.print(f"[{sid}] retained {sum(len(s.items) for s in sessions)} "
                                  f"items into both banks")
                for _ in range(args.rounds):
                    for c in convs:
                        sid = c["sample_id"]
                        for q in locomo.questions(c):
                            if not q.get("evidence"):
                                continue
                            queries += 1
                            for mode, dt in both(lambda md: m.recall(
                                    f"{sid}-{md}", q["question"], budget="mid",
                                    max_tokens=4096, types=["world", "experience"])):
                                recall_ms[mode].append(dt * 1000)
                console.print(f"recalled {queries} questions in both modes")
                for c in convs:
                    sid = c["sample_id"]
                    docs = sorted({it["document_id"] for s in locomo.sessions(c)
                                   for it in s.items if it.get("document_id")})
                    for doc in docs[:args.deletes]:
                        for mode, dt in both(lambda md: m.delete_document(f"{sid}-{md}", doc)):
                            delete_ms[mode].append(dt * 1000)
        finally:
            server.stop()
    res = {
        "retain_items_per_s": {md: round(items / retain_s[md], 1) for md in MODES},
        "recall_ms": {md: {"p50": pct(recall_ms[md], 50), "p95": pct(recall_ms[md], 95)}
                      for md in MODES},
        "delete_ms": {md: {"p50": pct(delete_ms[md], 50) if delete_ms[md] else None}
                      for md in MODES},
        "items": items, "queries": queries, "cpu_count": os.cpu_count(),
    }
    t = Table("", "crypto_shred", "none", "crypto_shred / none",
              title=f"erasure overhead ({len(convs)} conversations, {items} items per mode, "
                    f"{queries} queries; one server, modes alternated; {os.cpu_count()} cores)")

    def row(label, a, b, higher_is_better=False):
        t.add_row(label, str(a), str(b), f"{a / b:.2f}×" if a and b else "–")

    row("sync retain items/s (batches ≤ 50)", res["retain_items_per_s"]["crypto_shred"],
        res["retain_items_per_s"]["none"])
    for k in ("p50", "p95"):
        row(f"recall {k} ms", res["recall_ms"]["crypto_shred"][k], res["recall_ms"]["none"][k])
    row("sync DeleteDocument p50 ms", res["delete_ms"]["crypto_shred"]["p50"],
        res["delete_ms"]["none"]["p50"])
    Console(width=140).print(t)
    if args.json:
        print(json.dumps(res), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
