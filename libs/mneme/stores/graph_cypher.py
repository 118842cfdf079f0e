"""The graph store's logic over any Cypher backend: :class:`CypherGraphStore` runs the one
query set of :mod:`mneme.stores.cypher`; subclasses only say how a unit of work reaches
their database (FalkorDB embedded or server in :mod:`mneme.stores.graph_falkor`, Neo4j in
:mod:`mneme.stores.graph_neo4j`).

Spreading activation fetches neighbours hop by hop with Cypher and computes activation in
Python (:func:`spread_activation`), so it is the same on every backend.
"""

from __future__ import annotations

import math
import threading
from collections import defaultdict
from typing import Any, Callable, Iterable, Sequence, TypeVar

from mneme.domain import EntityRef, Fact, Hit, entity_key, to_epoch
from mneme.stores import cypher
from mneme.stores.filters import check_document_id

#: Most units taken from one entity (or one unit's links) per hop.
FANOUT = 50
#: Most facts (or ids) written per Cypher query.
BATCH = 256
#: Most units propagated from per hop (the most activated), at least 4·k.
MIN_FRONTIER = 64
#: Nodes deleted per query by a bank-wide delete (bounds one transaction's size).
DELETE_BATCH = 10_000

#: ``run(query, params)`` → result rows (lists of column values), inside one unit of work.
Run = Callable[[str, dict[str, Any]], list[list[Any]]]
T = TypeVar("T")


def hub_damping(degree: int) -> float:
    """Weight of an entity hop through an entity mentioned by ``degree`` units: 1 for
    an entity shared by two units, falling like 1/log(2+degree) for hubs
    (≈0.56 at 10 mentions, ≈0.30 at 100)."""
    return min(1.0, math.log(4.0) / math.log(2.0 + max(degree, 0)))


def spread_activation(
    starts: dict[str, float], hops: int, decay: float,
    neighbours: Callable[[list[str]], Iterable[tuple[Sequence[str], Sequence[str], float]]],
    frontier_cap: int,
) -> dict[str, float]:
    """Backend-independent spreading activation.

    ``starts``: unit id → initial activation. Each hop, every unit whose activation rose
    in the previous hop (at most ``frontier_cap`` of the most activated) passes
    ``activation × decay × w`` to each neighbour, where ``neighbours(ids)`` yields edge
    groups ``(sources, units, w)``: every source is joined to every unit with weight w
    (an entity's mentions, w = hub damping; or one LINK edge, w = its weight). A unit
    keeps the maximum it receives (not the sum), so activation never grows along a path
    and a unit ``n`` hops away gets at most ``decay**n`` of its source; no unit
    activates itself. Returns unit → activation.

    Since only the maximum counts, a group passes each unit the best of its sources
    (the second best to that source itself): O(sources + units) per group, not their
    product -- a hub entity joins hundreds of frontier units to its ``fanout`` mentions.
    """
    act = dict(starts)
    frontier = dict(starts)
    for _ in range(max(hops, 0)):
        if not frontier:
            break
        top = sorted(frontier.items(), key=lambda kv: (-kv[1], kv[0]))[:frontier_cap]
        source_act = dict(top)
        risen: dict[str, float] = {}
        for sources, units, w in neighbours(list(source_act)):
            if w <= 0 or not sources:
                continue
            best = second = (0.0, "")
            for src in sources:
                cand = (source_act[src], src)
                if cand[0] > best[0]:
                    best, second = cand, best
                elif cand[0] > second[0] and src != best[1]:
                    second = cand
            for unit in units:
                a = (second[0] if unit == best[1] else best[0]) * decay * w
                if a > act.get(unit, 0.0) + 1e-12:
                    act[unit] = a
                    risen[unit] = a
        frontier = risen
    return act


def deleted(rows: list[list[Any]]) -> int:
    """The ``deleted`` count of a batched delete's result (0 when it returned no row)."""
    return int(rows[0][0]) if rows else 0


def _column(run: Run, query: str, **params: Any) -> list[Any]:
    return [row[0] for row in run(query, params)]


class CypherGraphStore:
    """:class:`mneme.ports.GraphStore` over the shared Cypher query set.

    Subclasses implement :meth:`_read` and :meth:`_write` (run a function of a
    :data:`Run` callable as one unit of work: a transaction where the backend has them),
    :meth:`_ensure_schema`, :meth:`reset` and :meth:`close`, and set ``self._lock``
    (a lock serialising calls, or a no-op context where the backend isolates
    transactions itself). ``fanout`` caps the units taken per entity or per unit's links
    in one hop. Calls on a closed store raise RuntimeError.
    """

    fanout: int = FANOUT
    _lock: Any

    def __init__(self, fanout: int = FANOUT, lock: Any = None) -> None:
        self.fanout = fanout
        self._lock = lock if lock is not None else threading.RLock()

    # -- backend hooks --

    def _read(self, work: Callable[[Run], T]) -> T:  # pragma: no cover - abstract
        raise NotImplementedError

    def _write(self, work: Callable[[Run], T]) -> T:  # pragma: no cover - abstract
        raise NotImplementedError

    def _ensure_schema(self) -> None:  # pragma: no cover - abstract
        raise NotImplementedError

    def reset(self) -> None:  # pragma: no cover - abstract
        raise NotImplementedError

    def close(self) -> None:  # pragma: no cover - abstract
        raise NotImplementedError

    # -- writes --

    def upsert(self, facts: Sequence[Fact]) -> None:
        """Insert or replace units with their MENTIONS and LINK edges (idempotent). Link
        targets not yet stored become stubs, filled in when their fact arrives. Each batch
        of :data:`BATCH` units of a bank is one unit of work."""
        by_bank: dict[str, list[Fact]] = defaultdict(list)
        for f in facts:
            by_bank[f.bank_id].append(f)
        with self._lock:
            for bank_id, group in by_bank.items():
                unique = list({f.id: f for f in group}.values())
                # bounded batches keep each query's parameters (and transaction) small
                for i in range(0, len(unique), BATCH):
                    batch = unique[i:i + BATCH]
                    self._write(lambda run, b=batch: _upsert_units(run, bank_id, b))

    def delete(self, bank_id: str, ids: Sequence[str]) -> None:
        """Delete the bank's units ``ids``, the entities no unit mentions any more and
        link stubs nothing points to. A deleted unit other units still link to stays
        as a stub (never returned), so its links come back if the fact is re-upserted."""
        ids = list(dict.fromkeys(ids))
        if not ids:
            return
        with self._lock:
            for i in range(0, len(ids), BATCH):
                batch = ids[i:i + BATCH]
                self._write(lambda run, b=batch: _delete_units(run, bank_id, b))

    def delete_where(self, bank_id: str, document_id: str | None = None) -> None:
        """Delete the bank's units of ``document_id`` as :meth:`delete` does, or, when
        None, every unit, stub and entity of the bank (in batches of
        :data:`DELETE_BATCH` nodes). ValueError for ""."""
        check_document_id(document_id)
        with self._lock:
            if document_id is None:
                for query in (cypher.DELETE_BANK_UNITS, cypher.DELETE_BANK_ENTITIES):
                    while self._write(lambda run, q=query: deleted(run(
                            q, {"bank_id": bank_id, "limit": DELETE_BATCH}))) >= DELETE_BATCH:
                        pass
                return
            ids = self._read(lambda run: _column(run, cypher.UNITS_OF_DOCUMENT,
                                                 bank_id=bank_id, document_id=document_id))
            for i in range(0, len(ids), BATCH):
                batch = ids[i:i + BATCH]
                self._write(lambda run, b=batch: _delete_units(run, bank_id, b))

    # -- reads --

    def count(self, bank_id: str) -> int:
        """Number of the bank's units (stubs excluded)."""
        with self._lock:
            return int(self._read(lambda run: _column(run, cypher.COUNT_UNITS,
                                                      bank_id=bank_id))[0])

    def count_entities(self, bank_id: str) -> int:
        """Number of the bank's entities."""
        with self._lock:
            return int(self._read(lambda run: _column(run, cypher.COUNT_ENTITIES,
                                                      bank_id=bank_id))[0])

    def find_entities(self, bank_id: str, keys: Sequence[str]) -> list[EntityRef]:
        """The bank's entities whose key (``mneme.domain.entity_key`` of a name they had)
        is in ``keys``, ordered by the first key they match, then id."""
        keys = list(dict.fromkeys(k for k in keys if k))
        if not keys:
            return []
        with self._lock:
            rows = self._read(lambda run: run(cypher.FIND_ENTITIES,
                                              {"bank_id": bank_id, "keys": keys}))
        rank = {k: i for i, k in enumerate(keys)}
        rows.sort(key=lambda r: (rank.get(r[3], len(keys)), r[0]))
        return [EntityRef(r[0], r[1] or "", r[2] or "") for r in rows]

    def spread(self, bank_id: str, seeds: dict[str, float], entity_ids: Sequence[str],
               k: int, hops: int = 2, decay: float = 0.5) -> list[Hit]:
        """Spreading activation (see :func:`spread_activation`) from ``seeds`` (unit id →
        activation) and from the units mentioning ``entity_ids`` (activation
        :func:`hub_damping` of the entity's degree, at most ``fanout`` units per entity).
        Hops follow shared entities (weight = hub damping) and LINK edges in either
        direction (weight = link weight). Returns the ``k`` most activated live units of
        the bank, seeds included, best first (ties by id); ``Hit.score`` = activation.
        All hops read in one unit of work."""
        if k <= 0:
            return []
        with self._lock:
            act = self._read(lambda run: self._spread(run, bank_id, seeds, entity_ids,
                                                      k, hops, decay))
        best = sorted(act.items(), key=lambda kv: (-kv[1], kv[0]))[:k]
        return [Hit(uid, a) for uid, a in best]

    def _spread(self, run: Run, bank_id: str, seeds: dict[str, float],
                entity_ids: Sequence[str], k: int, hops: int,
                decay: float) -> dict[str, float]:
        starts: dict[str, float] = {}
        if seeds:
            for uid in _column(run, cypher.EXISTING_UNITS, bank_id=bank_id, ids=list(seeds)):
                starts[uid] = max(starts.get(uid, 0.0), float(seeds[uid]))
        if entity_ids:
            for _, degree, units in run(cypher.ENTITY_UNITS, {
                    "bank_id": bank_id, "entity_ids": list(entity_ids),
                    "fanout": self.fanout}):
                a = hub_damping(degree)
                for uid in units:
                    starts[uid] = max(starts.get(uid, 0.0), a)
        starts = {u: a for u, a in starts.items() if a > 0}
        return spread_activation(
            starts, hops, decay, lambda ids: self._neighbours(run, bank_id, ids),
            frontier_cap=max(4 * k, MIN_FRONTIER))

    def _neighbours(self, run: Run, bank_id: str, ids: list[str]
                    ) -> Iterable[tuple[Sequence[str], Sequence[str], float]]:
        """Edge groups one hop from ``ids`` (see :func:`spread_activation`): per entity
        the frontier units mentioning it × its units (at most ``fanout``), then each
        unit's LINK edges (its ``fanout`` heaviest)."""
        for _, sources, degree, units in run(cypher.ENTITY_NEIGHBOURS, {
                "bank_id": bank_id, "ids": ids, "fanout": self.fanout}):
            yield sources, units, hub_damping(degree)
        per_source: dict[str, list[tuple[float, str]]] = defaultdict(list)
        for src, uid, _kind, weight in run(cypher.LINK_NEIGHBOURS,
                                           {"bank_id": bank_id, "ids": ids}):
            per_source[src].append((float(weight if weight is not None else 1.0), uid))
        for src, edges in per_source.items():
            for weight, uid in sorted(edges, reverse=True)[:self.fanout]:
                yield (src,), (uid,), weight


# ---- units of work (plain functions of a Run, so a managed transaction may retry them) ----


def _upsert_units(run: Run, bank_id: str, facts: list[Fact]) -> None:
    ids = [f.id for f in facts]
    old_entities = _column(run, cypher.UNIT_ENTITIES, bank_id=bank_id, ids=ids)
    old_targets = _column(run, cypher.UNIT_LINK_TARGETS, bank_id=bank_id, ids=ids)
    run(cypher.CLEAR_UNIT_EDGES, {"bank_id": bank_id, "ids": ids})
    run(cypher.UPSERT_UNITS, {"bank_id": bank_id, "units": [{
        "id": f.id, "document_id": f.document_id, "fact_type": f.fact_type,
        "occurred_start": to_epoch(f.occurred_start),
        "occurred_end": to_epoch(f.occurred_end)} for f in facts]})
    mentions = [{"unit_id": f.id, "entity_id": e.id, "name": e.name,
                 "key": entity_key(e.name), "label": e.label}
                for f in facts for e in {e.id: e for e in f.entities}.values()]
    if mentions:
        run(cypher.MERGE_MENTIONS, {"bank_id": bank_id, "rows": mentions})
    links = [{"source_id": f.id, "target_id": lk.target_id, "kind": lk.kind,
              "weight": float(lk.weight)}
             for f in facts for lk in f.links if lk.target_id != f.id]
    if links:
        run(cypher.MERGE_LINKS, {"bank_id": bank_id, "rows": links})
    _cleanup(run, bank_id, old_targets, old_entities)


def _delete_units(run: Run, bank_id: str, ids: list[str]) -> None:
    old_entities = _column(run, cypher.UNIT_ENTITIES, bank_id=bank_id, ids=ids)
    old_targets = _column(run, cypher.UNIT_LINK_TARGETS, bank_id=bank_id, ids=ids)
    run(cypher.CLEAR_UNIT_EDGES, {"bank_id": bank_id, "ids": ids})
    run(cypher.MARK_STUBS, {"bank_id": bank_id, "ids": ids})
    _cleanup(run, bank_id, ids + old_targets, old_entities)


def _cleanup(run: Run, bank_id: str, stub_ids: list[str], entity_ids: list[str]) -> None:
    # distinct ids: one row per node, so no backend is asked to delete a node twice
    stub_ids = list(dict.fromkeys(stub_ids))
    entity_ids = list(dict.fromkeys(entity_ids))
    if stub_ids:
        run(cypher.DELETE_ORPHAN_STUBS, {"bank_id": bank_id, "ids": stub_ids})
    if entity_ids:
        run(cypher.DELETE_ORPHAN_ENTITIES, {"bank_id": bank_id, "entity_ids": entity_ids})
