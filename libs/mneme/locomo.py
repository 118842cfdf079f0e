"""Reading LoCoMo conversations (Maharana et al., "Evaluating Very Long-Term
Conversational Memory of LLM Agents", ACL 2024; data/locomo10.json of
snap-research/LoCoMo) as retain items.

Each turn becomes one item: content "Speaker: text", the session's date as timestamp,
metadata {dia_id, speaker, session, conversation, blip_caption?}, document id
"<sample_id>/session_<n>" so a session can be deleted or re-retained as a whole.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from datetime import datetime, timezone
from pathlib import Path


@dataclass
class Session:
    """One session: its number, reference time (UTC) and retain items (dicts)."""

    number: int
    when: datetime
    items: list[dict]


def parse_session_time(s: str) -> datetime:
    """"1:56 pm on 8 May, 2023" → aware UTC datetime. Raises ValueError otherwise."""
    s = " ".join(s.replace(",", ", ").split()).replace(" ,", ",")
    return datetime.strptime(s.upper(), "%I:%M %p ON %d %B, %Y").replace(tzinfo=timezone.utc)


def load(path: str | Path) -> list[dict]:
    """The list of conversations in a LoCoMo JSON file."""
    data = json.loads(Path(path).read_text())
    return data if isinstance(data, list) else [data]


def sessions(conv: dict) -> list[Session]:
    """The conversation's sessions in order, each with its turns as retain items."""
    c = conv["conversation"]
    sid = conv.get("sample_id", "conv")
    out = []
    nums = sorted(int(m.group(1)) for k in c if (m := re.fullmatch(r"session_(\d+)", k)))
    for n in nums:
        turns = c[f"session_{n}"]
        if not turns:
            continue
        when = parse_session_time(c[f"session_{n}_date_time"])
        items = []
        for t in turns:
            meta = {"dia_id": t["dia_id"], "speaker": t["speaker"], "session": str(n),
                    "conversation": sid}
            if t.get("blip_caption"):
                meta["blip_caption"] = t["blip_caption"]
            items.append({"content": f"{t['speaker']}: {t['text']}", "timestamp": when,
                          "document_id": f"{sid}/session_{n}", "metadata": meta})
        out.append(Session(n, when, items))
    return out


def questions(conv: dict, categories=(1, 2, 3, 4)) -> list[dict]:
    """QA items of the given categories (1 multi-hop, 2 temporal, 3 open-domain,
    4 single-hop; 5 adversarial is excluded by default)."""
    return [q for q in conv.get("qa", []) if q.get("category") in categories]


def dia_ids(results) -> list[str]:
    """Distinct ``dia_id``s of recall results (API messages or domain Scored), in rank order."""
    out, seen = [], set()
    for r in results:
        md = r.memory.metadata if hasattr(r, "memory") else r.fact.metadata
        d = md.get("dia_id")
        for one in (d or "").split(","):
            one = one.strip()
            if one and one not in seen:
                seen.add(one)
                out.append(one)
    return out


def session_of(dia_id: str) -> str:
    """The session part of a LoCoMo dialog id: "D3:5" → "3" (the id itself if it has no
    "D<n>:" form)."""
    m = re.fullmatch(r"D(\d+):\d+", dia_id.strip())
    return m.group(1) if m else dia_id.strip()


def session_ids(ranked: list[str]) -> list[str]:
    """Distinct sessions of ranked dialog ids, in rank order (see :func:`session_of`)."""
    return list(dict.fromkeys(session_of(d) for d in ranked))


def recall_at(ranked: list[str], evidence: list[str], k: int) -> float:
    """Fraction of the evidence dialog ids among the first ``k`` ranked ids."""
    ev = set(evidence)
    return len(ev & set(ranked[:k])) / len(ev) if ev else 0.0


def ndcg_at(ranked: list[str], evidence: list[str], k: int) -> float:
    """nDCG@k with binary relevance (Järvelin & Kekäläinen 2002): DCG = Σ rel_i/log2(i+1)."""
    import math
    ev = set(evidence)
    dcg = sum(1.0 / math.log2(i + 2) for i, d in enumerate(ranked[:k]) if d in ev)
    ideal = sum(1.0 / math.log2(i + 2) for i in range(min(len(ev), k)))
    return dcg / ideal if ideal else 0.0
