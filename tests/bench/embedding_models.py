"""Packaged embedding models compared on LoCoMo, without the rest of mneme: dense-only
evidence recall@10 over raw dialog turns, and embedding throughput.

For every model of :data:`mneme.embedding.MODELS` (or those named): each conversation's
turns (``speaker: text``, a shared image's caption appended) are embedded, every question
of categories 1–4 with evidence is embedded and the 10 nearest turns by cosine are scored
against its evidence dialog ids (the fraction found, averaged; the reference of
``shared/data/locomo/README.md``: dense all-MiniLM-L6-v2 0.473 without captions). Then
throughput: questions one at a time (recall's query embedding) and turns 32 at a time
(retain's), wall texts/s and process CPU ms per text (the CPU figure is steadier on a
shared machine). Run models back to back in one invocation to compare them.

Usage: python tests/bench/embedding_models.py --data FILE [--models NAME ...]
       [--conversations ID ...] [--threads N] [--json]
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "libs"))

from mneme.embedding import MODELS, OnnxEmbedder  # noqa: E402

CATEGORIES = {1: "multi-hop", 2: "temporal", 3: "open-domain", 4: "single-hop"}


def turns(conv: dict) -> tuple[list[str], list[str]]:
    """(dia ids, texts) of a conversation's turns, in order."""
    ids, texts = [], []
    for key, value in conv.items():
        if key.startswith("session_") and isinstance(value, list):
            for t in value:
                text = f'{t["speaker"]}: {t["text"]}'
                if t.get("blip_caption"):
                    text += f' [shares {t["blip_caption"]}]'
                ids.append(t["dia_id"])
                texts.append(text)
    return ids, texts


def quality(emb: OnnxEmbedder, data: list[dict]) -> dict:
    """Dense evidence recall@10 over raw turns: overall and per category."""
    scores: dict[int, list[float]] = {}
    for c in data:
        ids, texts = turns(c["conversation"])
        passages = emb.embed_array(texts)
        qs = [q for q in c["qa"] if q["category"] in CATEGORIES and q.get("evidence")]
        sims = emb.embed_array([q["question"] for q in qs]) @ passages.T
        for q, row in zip(qs, sims):
            top = {ids[j] for j in np.argsort(-row)[:10]}
            ev = set(q["evidence"])
            scores.setdefault(q["category"], []).append(len(ev & top) / len(ev))
    every = [s for v in scores.values() for s in v]
    return {"recall@10": float(np.mean(every)), "questions": len(every),
            **{CATEGORIES[k]: float(np.mean(v)) for k, v in sorted(scores.items())}}


def throughput(emb: OnnxEmbedder, data: list[dict], rounds: int = 2) -> dict:
    """Best of ``rounds``: (wall texts/s, CPU ms per text) embedding 64 questions one at a
    time and 256 turns 32 at a time."""
    _, texts = turns(data[0]["conversation"])
    texts = texts[:256]
    qs = [q["question"] for q in data[0]["qa"]][:64]
    emb.embed_array(texts[:4])  # load the session

    def run(batch: int, items: list[str]) -> tuple[float, float]:
        w, c = time.perf_counter(), time.process_time()
        for i in range(0, len(items), batch):
            emb.embed_array(items[i:i + batch])
        return len(items) / (time.perf_counter() - w), (time.process_time() - c) / len(items) * 1e3

    best: dict[str, tuple[float, float]] = {}
    for _ in range(rounds):
        for key, (batch, items) in {"batch1": (1, qs), "batch32": (32, texts)}.items():
            rate, cpu = run(batch, items)
            old = best.get(key)
            best[key] = (max(rate, old[0]), min(cpu, old[1])) if old else (rate, cpu)
    return {f"{k}_texts_per_s": round(v[0], 1) for k, v in best.items()} | {
        f"{k}_cpu_ms_per_text": round(v[1], 2) for k, v in best.items()}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--data", required=True)
    ap.add_argument("--models", nargs="*", default=list(MODELS))
    ap.add_argument("--conversations", nargs="*")
    ap.add_argument("--threads", type=int, default=None, help="onnxruntime threads")
    ap.add_argument("--json", action="store_true")
    a = ap.parse_args()
    data = json.loads(Path(a.data).read_text())
    if a.conversations:
        data = [c for c in data if c["sample_id"] in set(a.conversations)]
    out = {}
    for name in a.models:
        emb = OnnxEmbedder(model=name, threads=a.threads)
        out[name] = quality(emb, data) | throughput(emb, data)
        r = out[name]
        print(f"{name}: recall@10 {r['recall@10']:.3f} (" + ", ".join(
            f"{c} {r[c]:.3f}" for c in CATEGORIES.values() if c in r) + f"; {r['questions']} q)"
              f" | batch 1: {r['batch1_texts_per_s']}/s, {r['batch1_cpu_ms_per_text']} cpu-ms"
              f" | batch 32: {r['batch32_texts_per_s']}/s, {r['batch32_cpu_ms_per_text']} cpu-ms",
              flush=True)
    if a.json:
        print(json.dumps(out))


if __name__ == "__main__":
    main()
