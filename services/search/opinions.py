"""Opinions in search: their projection and read API.

Opinions are formed by reflect and revised by consolidation (which keeps the working
state); search projects every ``OpinionsChanged`` into the **vector store only**, as units
with ``fact_type="opinion"``, ``tags`` = the tags of the reflect that formed it, and the
rest of the state in ``metadata`` (string values):

* ``confidence`` — decimal in [0, 1]; ``version`` — decimal;
* ``evidence`` — JSON list of memory ids; ``reflection_id``;
* ``history`` — JSON ``[{"change", "text", "confidence", "memory_id", "at" (RFC 3339),
  "reason"}]``; ``created_at`` / ``updated_at`` — RFC 3339.

Recall finds them (semantic and temporal arms, like observations) only when ``types``
lists OPINION; ListOpinions / GetOpinion read them here.
"""

from __future__ import annotations

import json
from datetime import timezone

from mneme.domain import OPINION, EntityRef, Fact, Filters
from mneme.errors import NotFound
from mneme.events.v1 import events_pb2 as ev
from mneme.ports import VectorStore
from mneme.v1 import resources_pb2
from services.search.observations import _all, _iso, _ts, page_by_id


def opinion_fact(bank_id: str, o: ev.Opinion) -> Fact:
    """An opinion state as the unit search stores (see the module docstring)."""
    return Fact(
        id=o.id, bank_id=bank_id, text=o.text, fact_type=OPINION, tags=tuple(o.tags),
        mentioned_at=o.updated_at.ToDatetime(tzinfo=timezone.utc)
        if o.HasField("updated_at") else None,
        metadata={
            "confidence": f"{o.confidence:.4f}", "version": str(o.version),
            "reflection_id": o.reflection_id, "created_at": _iso(o.created_at),
            "updated_at": _iso(o.updated_at),
            "evidence": json.dumps(list(o.evidence_ids)),
            "history": json.dumps([{"change": h.change, "text": h.text,
                                    "confidence": round(h.confidence, 4),
                                    "memory_id": h.memory_id, "at": _iso(h.at),
                                    "reason": h.reason} for h in o.history],
                                  ensure_ascii=False)},
        entities=[EntityRef(e.id, e.name, e.label) for e in o.entities],
        embedding=list(o.embedding))


def project_opinions(m: ev.OpinionsChanged, vectors: VectorStore) -> None:
    """Apply one OpinionsChanged to the vector store (idempotent, as
    :func:`~services.search.observations.project_observations`: upsert by id, delete the
    deleted; the partition's order delivers the newest state last)."""
    gone = [o.id for o in m.opinions if o.deleted]
    live = [opinion_fact(m.bank_id, o) for o in m.opinions if not o.deleted]
    if gone:
        vectors.delete(m.bank_id, gone)
    if live:
        vectors.upsert(live)


def retract_opinions(vectors: VectorStore, bank_id: str, memory_ids) -> list[str]:
    """Delete the bank's opinions whose evidence cites any of ``memory_ids`` (as
    consolidation does next; doing it here too purges them with the deletion itself).
    Returns their ids."""
    wanted = set(memory_ids)
    if not wanted:
        return []
    gone = [f.id for f in _all(vectors, bank_id, Filters(types=(OPINION,)))
            if wanted & set(_evidence(f))]
    if gone:
        vectors.delete(bank_id, gone)
    return gone


def _evidence(f: Fact) -> list[str]:
    try:
        return [str(i) for i in json.loads(f.metadata.get("evidence") or "[]")]
    except ValueError:
        return []


def to_api(f: Fact) -> resources_pb2.Opinion:
    """A stored opinion unit → the API resource."""
    md, bank = f.metadata, f.bank_id

    def memory(i: str) -> str:
        return f"banks/{bank}/memories/{i}" if i else ""
    return resources_pb2.Opinion(
        name=f"banks/{bank}/opinions/{f.id}", id=f.id, text=f.text,
        confidence=float(md.get("confidence") or 0.0),
        entities=[resources_pb2.EntityRef(id=e.id, name=e.name, label=e.label)
                  for e in f.entities],
        evidence=[memory(i) for i in _evidence(f)], tags=list(f.tags),
        history=[resources_pb2.OpinionRevision(
            change=h["change"], text=h["text"], confidence=h["confidence"],
            memory=memory(h["memory_id"]), time=_ts(h["at"]), reason=h["reason"])
            for h in json.loads(md.get("history") or "[]")],
        create_time=_ts(md.get("created_at", "")), update_time=_ts(md.get("updated_at", "")))


def list_opinions(vectors: VectorStore, bank_id: str, page_size: int, page_token: str,
                  entity_id: str = "") -> tuple[list[Fact], str]:
    """One page of the bank's opinions ordered by id (only those about ``entity_id`` when
    set) and the next page token ('' at the end). Raises InvalidArgument for a bad token."""
    ops = [f for f in _all(vectors, bank_id, Filters(types=(OPINION,)))
           if not entity_id or any(e.id == entity_id for e in f.entities)]
    return page_by_id(ops, page_size, page_token, ("opinions", bank_id, entity_id))


def get_opinion(vectors: VectorStore, bank_id: str, opinion_id: str) -> Fact:
    """The opinion unit ``opinion_id``. Raises NotFound."""
    got = vectors.get(bank_id, [opinion_id])
    if not got or got[0].fact_type != OPINION:
        raise NotFound(f"opinion {opinion_id!r} not found in bank {bank_id!r}")
    return got[0]


__all__ = ["get_opinion", "list_opinions", "opinion_fact", "project_opinions",
           "retract_opinions", "to_api"]
