"""Observations in search: their projection and read API.

Where observations live: consolidation decides and owns its working projection
(a :class:`mneme.ports.ObservationStore`); search projects every ``ObservationsChanged`` into
the **vector store only**, as units with ``fact_type="observation"``, ``tags`` = the
scope, and the rest of the state in ``metadata`` (string values):

* ``proof_count`` — decimal; ``stale`` — "true"/"false"; ``version`` — decimal;
* ``evidence`` — JSON ``[{"memory_id", "quote"}]``; ``history`` — JSON
  ``[{"text", "at" (RFC 3339), "reason"}]``; ``created_at`` / ``updated_at`` — RFC 3339.

Its ``occurred_start`` / ``occurred_end`` are the span of its evidence facts' times (set
by consolidation), stored like a fact's, so ``time_range`` filters and the temporal arm
find it by when its facts happened; ``mentioned_at`` is its ``updated_at``.

Not in the text or graph stores: BM25 statistics and entity links of the facts stay as
they were without observations, so fact recall is unchanged by consolidation (recall of
observations runs on the semantic and temporal arms). Recall and ListMemories leave
observations out unless ``types`` asks for them (:func:`with_default_types`).
"""

from __future__ import annotations

import json
from dataclasses import replace
from datetime import datetime, timezone
from typing import Callable

from mneme import paging
from mneme.bus import codec
from mneme.domain import EXPERIENCE, WORLD, EntityRef, Fact, Filters, Memory
from mneme.errors import InvalidArgument, NotFound
from mneme.events.v1 import events_pb2 as ev
from mneme.grpc_util import dt_to_ts
from mneme.ports import VectorStore
from mneme.timeparse import time_zone_name
from mneme.v1 import resources_pb2

OBSERVATION = "observation"
#: What recall and ListMemories return when ``types`` is empty.
DEFAULT_TYPES = (WORLD, EXPERIENCE)


def _iso(ts) -> str:
    return codec.format_time(ts.ToDatetime()) if ts.seconds or ts.nanos else ""


def _dt(o: ev.Observation, field: str):
    """A Timestamp field as an aware datetime, clamped to years 1..9999 (an out-of-range
    value on an old log must not fail the projection); None when unset."""
    if not o.HasField(field):
        return None
    t = getattr(o, field)
    lo, hi = -62135596800, 253402300799
    if t.seconds < lo:
        return datetime.min.replace(tzinfo=timezone.utc)
    if t.seconds > hi:
        return datetime.max.replace(tzinfo=timezone.utc)
    return t.ToDatetime(tzinfo=timezone.utc)


def observation_fact(bank_id: str, o: ev.Observation) -> Fact:
    """An observation state as the unit search stores (see the module docstring)."""
    return Fact(
        id=o.id, bank_id=bank_id, text=o.text, fact_type=OBSERVATION, tags=tuple(o.scope),
        mentioned_at=o.updated_at.ToDatetime(tzinfo=timezone.utc)
        if o.HasField("updated_at") else None,
        occurred_start=_dt(o, "occurred_start"), occurred_end=_dt(o, "occurred_end"),
        metadata={
            "proof_count": str(o.proof_count), "stale": "true" if o.stale else "false",
            "version": str(o.version), "created_at": _iso(o.created_at),
            "updated_at": _iso(o.updated_at),
            "evidence": json.dumps([{"memory_id": e.memory_id, "quote": e.quote}
                                    for e in o.evidence], ensure_ascii=False),
            "history": json.dumps([{"text": h.text, "at": _iso(h.at), "reason": h.reason}
                                   for h in o.history], ensure_ascii=False)},
        entities=[EntityRef(e.id, e.name, e.label) for e in o.entities],
        embedding=list(o.embedding))


def project_observations(m: ev.ObservationsChanged, vectors: VectorStore) -> None:
    """Apply one ObservationsChanged to the vector store (idempotent: upsert by id,
    delete of deleted ones)."""
    gone = [o.id for o in m.observations if o.deleted]
    live = [observation_fact(m.bank_id, o) for o in m.observations if not o.deleted]
    if gone:
        vectors.delete(m.bank_id, gone)
    if live:
        vectors.upsert(live)


def evidence_ids(f: Fact) -> tuple[str, ...]:
    """The memory ids an observation unit's evidence cites, in order ((): none, or
    metadata that does not parse)."""
    try:
        return tuple(dict.fromkeys(e.get("memory_id") for e in json.loads(
            f.metadata.get("evidence", "[]")) if e.get("memory_id")))
    except (ValueError, AttributeError):
        return ()


def retract_observations(vectors: VectorStore, bank_id: str, memory_ids) -> list[str]:
    """Delete the bank's observations whose evidence cites any of ``memory_ids`` (as
    consolidation's retraction does, which follows later; deleting them here too puts
    them out with the deletion's own purge, before its operation succeeds). Returns
    their ids. Reads every observation of the bank (a page at a time)."""
    wanted = set(memory_ids)
    if not wanted:
        return []
    gone, after = [], None
    while True:
        page, after = vectors.scroll(bank_id, 256, after, Filters(types=(OBSERVATION,)))
        for f in page:
            if wanted.intersection(evidence_ids(f)):
                gone.append(f.id)
        if after is None:
            break
    if gone:
        vectors.delete(bank_id, gone)
    return gone


def with_default_types(recall: Callable) -> Callable:
    """Wrap a recall function so an empty ``types`` filter means world + experience
    (observations are asked for explicitly)."""
    def wrapped(q):
        if not q.filters.types:
            q = replace(q, filters=replace(q.filters, types=DEFAULT_TYPES))
        return recall(q)
    return wrapped


def observation_search(recall: Callable) -> Callable:
    """reflect's ``search_observations`` port over search's recall: up to ``limit``
    observations for a query, best first, as ``mneme.domain.Memory`` (kind
    "observation", ``when`` the end of its evidence's occurred span); a stale one says so in its text, so the model weighs newer facts.
    ``tags`` (the reflect's scope) keep it to the observations whose scope matches them
    in ``tags_match`` mode, as the reflect's recall of facts is kept (Recall's filter:
    "any", the default, is the scopes sharing one of them and the global ones; with no
    tags, no filter, except "exact": the global ones)."""
    from mneme.domain import RecallQuery

    def search(bank_id, query, now, limit, tags=(), tags_match="any"):
        scope = (dict(tags=tuple(tags), tags_match=tags_match)
                 if tags or tags_match == "exact" else {})
        out = recall(RecallQuery(bank_id=bank_id, query=query, query_timestamp=now,
                                 filters=Filters(types=(OBSERVATION,), **scope), max_tokens=2048,
                                 time_zone=time_zone_name(now)))
        return [Memory(s.fact.id, s.fact.text + (" (stale: newer facts are not consolidated yet)"
                                                 if s.fact.metadata.get("stale") == "true" else ""),
                       "observation", when=s.fact.occurred_end or s.fact.mentioned_at,
                       sources=evidence_ids(s.fact))
                for s in out.results[:limit]]
    return search


# ---- API ---------------------------------------------------------------------------------


def _ts(s: str):
    return dt_to_ts(datetime.fromisoformat(s.replace("Z", "+00:00"))) if s else None


def to_api(f: Fact) -> resources_pb2.Observation:
    """A stored observation unit → the API resource."""
    md = f.metadata
    return resources_pb2.Observation(
        name=f"banks/{f.bank_id}/observations/{f.id}", id=f.id, text=f.text, scope=list(f.tags),
        evidence=[resources_pb2.Evidence(memory=f"banks/{f.bank_id}/memories/{e['memory_id']}",
                                         memory_id=e["memory_id"], quote=e["quote"])
                  for e in json.loads(md.get("evidence") or "[]")],
        proof_count=int(md.get("proof_count") or 0),
        history=[resources_pb2.ObservationRevision(text=h["text"], time=_ts(h["at"]),
                                                   reason=h["reason"])
                 for h in json.loads(md.get("history") or "[]")],
        create_time=_ts(md.get("created_at", "")), update_time=_ts(md.get("updated_at", "")),
        stale=md.get("stale") == "true",
        occurred_start=dt_to_ts(f.occurred_start) if f.occurred_start else None,
        occurred_end=dt_to_ts(f.occurred_end) if f.occurred_end else None)


def _all(vectors: VectorStore, bank_id: str, filters: Filters) -> list[Fact]:
    out, after = [], None
    while True:
        page, after = vectors.scroll(bank_id, 1000, after, filters)
        out += page
        if not after:
            return out


def _size(page_size: int) -> int:
    return paging.page_size(page_size)


def page_by_id(units: list[Fact], page_size: int, page_token: str, kind
               ) -> tuple[list[Fact], str]:
    """One page of ``units`` in id order after the token's id (keyset: units added or
    removed between calls shift nothing), and the next page token ('' at the end).
    InvalidArgument naming ``page_token`` for a token not of list ``kind``."""
    size = _size(page_size)
    after = paging.decode_token(page_token, kind)
    rest = sorted((u for u in units if after is None or u.id > after), key=lambda u: u.id)
    page = rest[:size]
    return page, paging.encode_token(kind, page[-1].id) if len(rest) > size else ""


def _scope_key(tags) -> str:
    return json.dumps(sorted(tags))


def list_scopes(vectors: VectorStore, bank_id: str, page_size: int, page_token: str
                ) -> tuple[list[tuple[list[str], int]], str]:
    """[(scope tags, observation count)] ordered by scope (JSON of the sorted tags), one
    page, and the next page token ('' at the end; it holds the last scope's tags, so
    scopes that appear or go between calls shift nothing). InvalidArgument naming
    ``page_token`` for a token of another list."""
    kind = ("scopes", bank_id)
    size = _size(page_size)
    after = paging.decode_token(page_token, kind, [str])
    counts: dict[str, int] = {}
    for f in _all(vectors, bank_id, Filters(types=(OBSERVATION,))):
        k = _scope_key(f.tags)
        counts[k] = counts.get(k, 0) + 1
    keys = sorted(k for k in counts if after is None or k > _scope_key(after))
    page = keys[:size]
    nxt = paging.encode_token(kind, json.loads(page[-1])) if len(keys) > size else ""
    return [(json.loads(k), counts[k]) for k in page], nxt


def list_observations(vectors: VectorStore, bank_id: str, page_size: int, page_token: str,
                      scope: list[str] | None = None) -> tuple[list[Fact], str]:
    """One page of observations ordered by id (of one exact scope when ``scope`` is not
    None; [] is the global scope) and the next page token, bound to ``scope``
    (:func:`page_by_id`)."""
    kind = ("observations", bank_id, scope)  # bound to the scope asked for (AIP-158)
    f = Filters(types=(OBSERVATION,), tags=tuple(scope or ()), tags_match="exact") \
        if scope is not None else Filters(types=(OBSERVATION,))
    return page_by_id(_all(vectors, bank_id, f), page_size, page_token, kind)


def get_observation(vectors: VectorStore, bank_id: str, observation_id: str) -> Fact:
    got = vectors.get(bank_id, [observation_id])
    if not got or got[0].fact_type != OBSERVATION:
        raise NotFound(f"observation {observation_id!r} not found in bank {bank_id!r}")
    return got[0]
