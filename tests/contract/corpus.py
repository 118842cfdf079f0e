"""Hand-made facts and filters shared by the store contract suites (no embedding model:
vectors are small, deterministic and L2-normalised)."""

from __future__ import annotations

import itertools
import math
import random
import uuid
from datetime import datetime, timezone

from mneme.domain import EXPERIENCE, WORLD, EntityRef, Fact, Filters, Link, TimeWindow

DIM = 8


def year(y: int, m: int = 1, d: int = 1) -> datetime:
    return datetime(y, m, d, tzinfo=timezone.utc)


def fid(*parts: object) -> str:
    """A deterministic uuid fact id (stores use fact ids as point ids)."""
    return str(uuid.uuid5(uuid.NAMESPACE_OID, "/".join(map(str, parts))))


def unit(v: list[float]) -> list[float]:
    n = math.sqrt(sum(x * x for x in v))
    return [x / n for x in v]


def basis(i: int, dim: int = DIM) -> list[float]:
    """The i-th unit axis (orthogonal vectors for clear kNN orderings)."""
    v = [0.0] * dim
    v[i % dim] = 1.0
    return v


def rand_vec(seed: object, dim: int = DIM) -> list[float]:
    r = random.Random(str(seed))
    # a shared positive component keeps every corpus vector in one kNN neighbourhood
    return unit([1.0 + r.random() for _ in range(dim)])


TAGSETS = [(), ("work",), ("home",), ("work", "home"), ("work", "travel"), ("travel",)]
DOCS = ["d1", "d2", ""]


def _times(i: int) -> tuple[datetime | None, datetime | None]:
    y = 2005 + i % 16
    return [(None, None), (year(y), None), (None, year(y, 6)), (year(y), year(y + 2))][i % 4]


def corpus(bank_id: str = "a", n: int = 24) -> list[Fact]:
    """``n`` facts mixing types, tag sets (incl. none), documents and time shapes (none,
    start only, end only, both); every text holds the word "memory"."""
    facts = []
    for i in range(n):
        start, end = _times(i)
        facts.append(Fact(
            id=fid(bank_id, "corpus", i), bank_id=bank_id,
            text=f"memory number {i} about topic{i % 5}",
            fact_type=(WORLD, EXPERIENCE)[i % 2],
            tags=TAGSETS[i % len(TAGSETS)], document_id=DOCS[i % len(DOCS)],
            occurred_start=start, occurred_end=end,
            embedding=rand_vec((bank_id, i)),
        ))
    return facts


def filter_cases() -> list[Filters]:
    """Filters covering every field and every tags_match mode, alone and combined."""
    cases = [Filters(), Filters(types=(WORLD,)), Filters(types=(EXPERIENCE,)),
             Filters(types=(WORLD, EXPERIENCE)), Filters(document_id="d1"),
             Filters(document_id="nope")]
    for mode, tags in itertools.product(
            ("any", "all", "any_strict", "all_strict", "exact"),
            ((), ("work",), ("work", "home"), ("travel", "home"), ("missing",))):
        cases.append(Filters(tags=tags, tags_match=mode))
    for lo, hi in ((2010, 2013), (None, 2008), (2018, None), (None, None), (2030, 2040)):
        cases.append(Filters(time_range=TimeWindow(year(lo) if lo else None,
                                                   year(hi) if hi else None)))
    cases.append(Filters(types=(WORLD,), tags=("work",), tags_match="any",
                         document_id="d2", time_range=TimeWindow(year(2006), year(2016))))
    cases.append(Filters(types=(EXPERIENCE,), tags=("work", "travel"),
                         tags_match="all_strict", time_range=TimeWindow(start=year(2005))))
    return cases


def full_fact(bank_id: str = "a") -> Fact:
    """A fact with every field set (for round trips)."""
    return Fact(
        id=fid(bank_id, "full"), bank_id=bank_id, text="Alice paints landscapes in Lyon.",
        fact_type=EXPERIENCE, context="chat with Alice",
        occurred_start=year(2023, 3, 4), occurred_end=datetime(2023, 3, 5, 12, 30, 15, 250000,
                                                               tzinfo=timezone.utc),
        mentioned_at=year(2023, 4, 1), tags=("art", "friends"),
        metadata={"source": "chat", "lang": "en"}, document_id="doc-7", chunk_id="doc-7#2",
        entities=[EntityRef("ent-alice", "Alice", "PERSON"), EntityRef("ent-lyon", "Lyon", "GPE")],
        embedding=unit([0.5, 0.1, 0.2, 0.3, 0.0, 0.4, 0.1, 0.2]),
        links=[Link(fid(bank_id, "other"), "causal", 0.75), Link(fid(bank_id, "x"), "temporal")],
        item_index=3,
    )
