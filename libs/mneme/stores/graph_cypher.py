"""The graph store's logic over any Cypher backend: :class:`CypherGraphStore` runs the one
query set of :mod:`mneme.stores.cypher`; subclasses only say how a unit of work reaches
their database (FalkorDB embedded or server in :mod:`mneme.stores.graph_falkor`, Neo4j in
:mod:`mneme.stores.graph_neo4j`).

Spreading activation computes activation in Python (:func:`spread_activation`), so it is
the same on every backend. Its neighbours come from one of two places with the same answer:

- an in-memory copy of the bank's adjacency (:class:`Adjacency`: live units, mentions,
  links, entities), read whole and used while the bank's version token
  (``cypher.TOUCH_BANK``, renewed by every write) is unchanged; a read then costs one
  round trip for the token instead of one per hop. A copy is made only once
  :data:`SNAPSHOT_AFTER` reads in a row have seen the same token, so a bank written
  between most reads keeps the second way and does not pay for copies it would throw
  away; banks above :data:`SNAPSHOT_MAX_UNITS` live units are never copied;
- Cypher, hop by hop.
"""

from __future__ import annotations

import heapq
import math
import threading
import uuid
from collections import OrderedDict, defaultdict
from dataclasses import dataclass, field
from typing import Any, Callable, Iterable, Sequence, TypeVar

from mneme.domain import EntityInfo, EntityRef, Fact, Hit, entity_key, to_epoch
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
#: Banks whose adjacency one store keeps in memory (the least recently read is dropped).
SNAPSHOT_BANKS = 8
#: Largest bank (live units) whose adjacency is kept in memory (~0.5 KB per unit): above
#: it every hop is a round trip with results that grow with the bank (recall p50 ~310 ms
#: at 20k units in one bank, measured, against ~30 ms from memory).
SNAPSHOT_MAX_UNITS = 200_000
#: Live units of all the adjacencies one store keeps (~150 MB); the least recently read
#: go first when a new one would pass it.
SNAPSHOT_TOTAL_UNITS = 300_000
#: Reads of a bank that must see the same version token before its adjacency is copied
#: (a recall reads twice: its query entities, then the spread).
SNAPSHOT_AFTER = 3

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
    frontier_cap: int, keep: int | None = None, max_weight: float = math.inf,
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

    ``keep``: only the ``keep`` most activated units are wanted (ties by id), and
    ``max_weight`` bounds every ``w``. Then a group is skipped when what its best source
    could pass on, over this and every remaining hop (``× max(1, decay·max_weight)`` a
    hop), stays below the ``keep``-th best activation so far: no unit it reaches could
    enter those ``keep`` nor lead to one that does. Those units get exactly the
    activation the unpruned run gives them; units outside them may get less. Without
    ``keep`` (or with an unbounded ``max_weight``) nothing is skipped.
    """
    act = dict(starts)
    frontier = dict(starts)
    prune = keep is not None and keep > 0 and math.isfinite(max_weight)
    gain = max(1.0, decay * max_weight) if prune else 1.0
    for hop in range(max(hops, 0)):
        if not frontier:
            break
        floor = 0.0
        if prune and len(act) >= keep:
            # activations only grow, so this lower bound of the final keep-th best holds
            floor = heapq.nlargest(keep, act.values())[-1] / gain ** (hops - hop - 1)
        # the same as sorted(...)[:cap], in O(n log cap): a hop can activate thousands
        top = heapq.nsmallest(frontier_cap, frontier.items(), key=_by_activation)
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
            if best[0] * decay * w < floor:
                continue  # nothing it passes on can reach the units wanted (see keep)
            for unit in units:
                a = (second[0] if unit == best[1] else best[0]) * decay * w
                if a > act.get(unit, 0.0) + 1e-12:
                    act[unit] = a
                    risen[unit] = a
        frontier = risen
    return act


def _by_activation(kv: tuple[str, float]) -> tuple[float, str]:
    # most activated first, ties by id (replay must reproduce the same order)
    return (-kv[1], kv[0])


def deleted(rows: list[list[Any]]) -> int:
    """The ``deleted`` count of a batched delete's result (0 when it returned no row)."""
    return int(rows[0][0]) if rows else 0


def _column(run: Run, query: str, **params: Any) -> list[Any]:
    return [row[0] for row in run(query, params)]


def _recent_first(occurred_start: Any, unit_id: str) -> tuple[float, str]:
    # ENTITY_UNITS' order: coalesce(occurred_start, 0) DESC, id
    return (-float(occurred_start or 0), unit_id)


@dataclass(frozen=True)
class Adjacency:
    """One bank's graph in memory, as of version ``token``; answers what the hop-by-hop
    queries of :mod:`mneme.stores.cypher` answer, from the same edges.

    ``live``: the bank's live units. ``entities_of``: unit → the entities it mentions.
    ``mentions``: entity → (degree, its ``fanout`` most recent mentioning units).
    ``links``: unit → its ``fanout`` heaviest LINK edges in either direction to other live
    units, as (weight, unit), heaviest first. ``entities``: entity id → (name, label,
    key); ``keys``: a key or former key → the entity ids that had it. ``max_weight``:
    the largest weight a hop can have (hub damping is at most 1; links as stored).
    ``starts``: live unit → its ``occurred_start`` in epoch seconds (0 when unknown), the
    order of ``mentions``."""

    token: str
    live: frozenset[str]
    entities_of: dict[str, tuple[str, ...]]
    mentions: dict[str, tuple[int, tuple[str, ...]]]
    links: dict[str, tuple[tuple[float, str], ...]]
    entities: dict[str, tuple[str, str, str]]
    keys: dict[str, tuple[str, ...]]
    max_weight: float = 1.0
    starts: dict[str, float] = field(default_factory=dict)

    @classmethod
    def read(cls, run: Run, bank_id: str, token: str, fanout: int) -> "Adjacency":
        """The bank's adjacency read with four queries (``cypher.ADJACENCY_*``)."""
        params = {"bank_id": bank_id}
        # Every row brings its own copy of each id and weight; one shared object per
        # value keeps a 100k-unit bank's copy several times smaller.
        canon: dict[Any, Any] = {}
        one = canon.setdefault
        starts = {one(r[0], r[0]): float(r[1] or 0) for r in run(cypher.ADJACENCY_UNITS, params)}
        live = frozenset(starts)
        entities_of: dict[str, list[str]] = defaultdict(list)
        mentioning: dict[str, list[tuple[float, str]]] = defaultdict(list)
        for uid, eid in run(cypher.ADJACENCY_MENTIONS, params):
            uid, eid = one(uid, uid), one(eid, eid)
            entities_of[uid].append(eid)
            mentioning[eid].append(_recent_first(starts.get(uid), uid))
        mentions = {eid: (len(units), tuple(u for _, u in sorted(units)[:fanout]))
                    for eid, units in mentioning.items()}
        edges: dict[str, list[tuple[float, str]]] = defaultdict(list)
        for src, dst, weight in run(cypher.ADJACENCY_LINKS, params):
            if src == dst:
                continue
            src, dst = one(src, src), one(dst, dst)
            w = float(weight if weight is not None else 1.0)
            w = one(w, w)
            if dst in live:
                edges[src].append((w, dst))
            if src in live:
                edges[dst].append((w, src))
        links = {u: tuple(sorted(es, reverse=True)[:fanout]) for u, es in edges.items()}
        entities: dict[str, tuple[str, str, str]] = {}
        keys: dict[str, list[str]] = defaultdict(list)
        for eid, name, label, key, aliases in run(cypher.ADJACENCY_ENTITIES, params):
            eid = one(eid, eid)
            entities[eid] = (name or "", label or "", key or "")
            for k in dict.fromkeys([key, *(aliases or [])]):
                if k:
                    keys[k].append(eid)
        max_weight = max([1.0, *(w for es in links.values() for w, _ in es[:1])])
        return cls(token, live, {u: tuple(es) for u, es in entities_of.items()}, mentions,
                   links, entities, {k: tuple(v) for k, v in keys.items()}, max_weight,
                   starts)

    def with_new_units(self, facts: Sequence[Fact], token: str,
                       fanout: int) -> "Adjacency | None":
        """This adjacency after ``facts`` were upserted (as ``_upsert_units`` writes them),
        as version ``token``: what :meth:`read` would give, without reading the graph.
        None when the facts are not all new to the bank's live units, one revives a stub
        with ``fanout`` or more incoming links (the copy keeps at most that many, so it
        cannot know the rest), or the batch names one entity in two ways: then the graph
        must be read. Copy on write: readers of
        this adjacency are not disturbed."""
        ids = [f.id for f in facts]
        if (len(set(ids)) != len(ids) or any(i in self.live for i in ids)
                or any(len(self.links.get(i, ())) >= fanout for i in ids)
                or len(self.live) + len(ids) > SNAPSHOT_MAX_UNITS):
            return None
        named: dict[str, set[tuple[str, str]]] = defaultdict(set)
        for f in facts:
            for e in f.entities:
                named[e.id].add((e.name or "", e.label or ""))
        if any(len(v) > 1 for v in named.values()):
            # one entity under two names in one batch: which the graph keeps is the
            # backend's (FalkorDB keeps the first for an entity the batch creates)
            return None
        live = self.live | frozenset(ids)
        starts = dict(self.starts)
        entities_of = dict(self.entities_of)
        entities = dict(self.entities)
        keys = {k: list(v) for k, v in self.keys.items()}
        mentioning: dict[str, list[str]] = defaultdict(list)
        for f in facts:
            starts[f.id] = to_epoch(f.occurred_start) or 0.0
            unique = list({e.id: e for e in f.entities}.values())
            if unique:
                entities_of[f.id] = tuple(e.id for e in unique)
            for e in unique:
                mentioning[e.id].append(f.id)
                key = entity_key(e.name)
                entities[e.id] = (e.name or "", e.label or "", key or "")
                if key and e.id not in keys.setdefault(key, []):
                    keys[key].append(e.id)
        mentions = dict(self.mentions)
        for eid, new in mentioning.items():
            degree, units = mentions.get(eid, (0, ()))
            if any(u not in starts for u in units):
                return None  # (a mention of a unit not live: read it as it is)
            merged = sorted((_recent_first(starts[u], u) for u in (*units, *new)))
            mentions[eid] = (degree + len(new), tuple(u for _, u in merged[:fanout]))
        added: dict[str, list[tuple[float, str]]] = defaultdict(list)
        for i in ids:  # a revived stub's incoming links join their sources' lists
            for w, src in self.links.get(i, ()):
                if src in live:
                    added[src].append((w, i))
        # MERGE keeps one edge per (source, target, kind), with the last weight written
        edges: dict[tuple[str, str, str], float] = {}
        for f in facts:
            for lk in f.links:
                if lk.target_id != f.id:
                    edges[(f.id, lk.target_id, lk.kind)] = float(lk.weight)
        for (src, dst, _), w in edges.items():
            if dst in live:
                added[src].append((w, dst))
            added[dst].append((w, src))  # the source is one of the new, live units
        links = dict(self.links)
        for u, es in added.items():
            links[u] = tuple(sorted([*links.get(u, ()), *es], reverse=True)[:fanout])
        max_weight = max([self.max_weight, *edges.values()])
        return Adjacency(token, live, entities_of, mentions, links, entities,
                         {k: tuple(v) for k, v in keys.items()}, max_weight, starts)

    def live_units(self, ids: Sequence[str]) -> list[str]:
        """Which of ``ids`` are live units of the bank (``cypher.EXISTING_UNITS``)."""
        return [u for u in ids if u in self.live]

    def entity_units(self, entity_ids: Sequence[str]) -> Iterable[tuple[int, tuple[str, ...]]]:
        """(degree, units) per entity of ``entity_ids`` that any unit mentions
        (``cypher.ENTITY_UNITS``)."""
        for eid in entity_ids:
            if eid in self.mentions:
                yield self.mentions[eid]

    def neighbours(self, ids: Sequence[str]
                   ) -> Iterable[tuple[Sequence[str], Sequence[str], float]]:
        """The edge groups of :meth:`_CypherView.neighbours`, from memory."""
        sources: dict[str, list[str]] = defaultdict(list)
        for uid in dict.fromkeys(ids):
            for eid in self.entities_of.get(uid, ()):
                sources[eid].append(uid)
        for eid, srcs in sources.items():
            degree, units = self.mentions[eid]
            yield srcs, units, hub_damping(degree)
        for uid in ids:
            for weight, other in self.links.get(uid, ()):
                yield (uid,), (other,), weight

    def find_entities(self, keys: Sequence[str]) -> list[list[str]]:
        """Rows (id, name, label, key) of ``cypher.FIND_ENTITIES``."""
        found = dict.fromkeys(eid for k in keys for eid in self.keys.get(k, ()))
        return [[eid, *self.entities[eid]] for eid in found]


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
    #: True when no other process writes this graph (an embedded server only this store
    #: talks to): a bank's version token is then known without a round trip until this
    #: store writes again.
    exclusive: bool = False

    def __init__(self, fanout: int = FANOUT, lock: Any = None) -> None:
        self.fanout = fanout
        self._lock = lock if lock is not None else threading.RLock()
        # bank → its Adjacency (LRU); bank → (the token reads last saw, how many did)
        self._snapshots: OrderedDict[str, Adjacency] = OrderedDict()
        self._seen: dict[str, tuple[str | None, int]] = {}
        self._snapshot_lock = threading.Lock()
        self.snapshot_stats = {"hits": 0, "builds": 0, "misses": 0, "advanced": 0}
        # exclusive stores: bank → version token as last read; _writes counts writes
        # begun or ended, so a read that overlapped one does not keep its token
        self._tokens: dict[str, str | None] = {}
        self._writes = 0

    def _wrote(self) -> None:
        """Forget the known version tokens (call before and after every write)."""
        with self._snapshot_lock:
            self._writes += 1
            self._tokens.clear()

    def _version(self, bank_id: str) -> str | None:
        """The bank's version token (``cypher.BANK_VERSION``; None for a bank with none):
        from memory on an :attr:`exclusive` store when no write happened since it was
        read, else one round trip."""
        with self._snapshot_lock:
            if self.exclusive and bank_id in self._tokens:
                return self._tokens[bank_id]
            writes = self._writes
        token = self._read(lambda run: _column(run, cypher.BANK_VERSION, bank_id=bank_id))
        token = token[0] if token else None
        if self.exclusive:
            with self._snapshot_lock:
                if self._writes == writes:
                    self._tokens[bank_id] = token
        return token

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
                    current = self._current_adjacency(bank_id)
                    self._write(lambda run, b=batch: _upsert_units(run, bank_id, b))
                    if current is not None:
                        self._advance(current, bank_id, batch)

    def _current_adjacency(self, bank_id: str) -> Adjacency | None:
        """On an :attr:`exclusive` store, the bank's in-memory adjacency if it is known to
        be current (its token is the one last read, and no write came since), else None."""
        if not self.exclusive:
            return None
        with self._snapshot_lock:
            snap = self._snapshots.get(bank_id)
            if snap is not None and self._tokens.get(bank_id, "") == snap.token:
                return snap
        return None

    def _advance(self, snap: Adjacency, bank_id: str, facts: list[Fact]) -> None:
        """After this store upserted ``facts`` into a bank whose adjacency ``snap`` was
        current, keep a copy updated in memory (:meth:`Adjacency.with_new_units`) as the
        bank's new version, so the next recall need not read the whole graph again (at
        10k facts that read takes seconds). Caller holds the store's lock, so no other
        write came between."""
        token = self._version(bank_id)
        new = snap.with_new_units(facts, token, self.fanout) if token is not None else None
        if new is None:
            return  # stale: read again once asked for (as after any other write)
        with self._snapshot_lock:
            if self._snapshots.get(bank_id) is snap:
                self._snapshots[bank_id] = new
                self._seen[bank_id] = (token, SNAPSHOT_AFTER)
                self.snapshot_stats["advanced"] += 1

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
                    while self._write(lambda run, q=query: _touch(run, bank_id, deleted(run(
                            q, {"bank_id": bank_id, "limit": DELETE_BATCH})))) >= DELETE_BATCH:
                        pass
                return
            ids = self._read(lambda run: _column(run, cypher.UNITS_OF_DOCUMENT,
                                                 bank_id=bank_id, document_id=document_id))
            for i in range(0, len(ids), BATCH):
                batch = ids[i:i + BATCH]
                self._write(lambda run, b=batch: _delete_units(run, bank_id, b))

    def merge_entities(self, bank_id: str, survivor_id: str, merged_ids: Sequence[str],
                       display_name: str = "") -> None:
        """A user's merge: every unit mentioning one of ``merged_ids`` mentions
        ``survivor_id`` instead, the survivor's aliases are the union of all of theirs
        (plus the key of ``display_name``, which renames it), and the merged entities are
        deleted. Idempotent; nothing happens when none of them exists."""
        merged = [m for m in dict.fromkeys(merged_ids) if m != survivor_id]
        with self._lock:
            self._write(lambda run: _merge_entities(run, bank_id, survivor_id, merged,
                                                    " ".join(display_name.split())))

    def split_entity(self, bank_id: str, entity_id: str, new_id: str, aliases: Sequence[str],
                     display_name: str, unit_ids: Sequence[str]) -> None:
        """A user's split: entity ``new_id`` (``display_name``, the label of
        ``entity_id``) takes the alias keys ``aliases`` of ``entity_id`` (when its own key
        moves, its first remaining alias becomes its key; it always keeps one) and the
        MENTIONS edges of the units ``unit_ids``. The new entity exists even when no unit
        mentions it yet. Idempotent; nothing happens when ``entity_id`` does not exist."""
        with self._lock:
            self._write(lambda run: _split_entity(run, bank_id, entity_id, new_id,
                                                  list(dict.fromkeys(aliases)),
                                                  " ".join(display_name.split()),
                                                  list(dict.fromkeys(unit_ids))))

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

    def entities(self, bank_id: str, limit: int, after: str = "") -> list[EntityInfo]:
        """At most ``limit`` of the bank's entities with ids after ``after``, in id order,
        each with its alias keys and live mention count (no units, no neighbours).
        ValueError for ``limit`` < 1."""
        if limit < 1:
            raise ValueError("limit must be positive")
        with self._lock:
            rows = self._read(lambda run: run(cypher.LIST_ENTITIES, {
                "bank_id": bank_id, "after": after or "", "limit": int(limit)}))
        return [EntityInfo(r[0], r[1] or "", r[2] or "", tuple(sorted(r[3] or ())), int(r[4]))
                for r in rows]

    def entity(self, bank_id: str, entity_id: str, units: int = 100,
               neighbours: int = 20) -> EntityInfo | None:
        """The bank's entity ``entity_id`` with at most ``units`` ids of live units
        mentioning it (most recent first) and its ``neighbours`` most co-mentioned
        entities, or None when the bank has no such entity."""
        def work(run: Run):
            found = run(cypher.GET_ENTITY, {"bank_id": bank_id, "entity_id": entity_id,
                                            "limit": int(max(units, 0))})
            if not found:
                return None, []
            return found[0], run(cypher.CO_MENTIONED, {
                "bank_id": bank_id, "entity_id": entity_id, "limit": int(max(neighbours, 0))})

        with self._lock:
            row, near = self._read(work)
        if row is None:
            return None
        return EntityInfo(row[0], row[1] or "", row[2] or "", tuple(sorted(row[3] or ())),
                          int(row[4]), tuple(u for u in (row[5] or ()) if u)[:units],
                          tuple((n[0], n[1] or "", n[2] or "", int(n[3])) for n in near))

    def find_entities(self, bank_id: str, keys: Sequence[str]) -> list[EntityRef]:
        """The bank's entities whose key (``mneme.domain.entity_key`` of a name they had)
        is in ``keys``, ordered by the first key they match, then id."""
        keys = list(dict.fromkeys(k for k in keys if k))
        if not keys:
            return []
        with self._lock:
            adjacency = self.adjacency(bank_id)
            rows = adjacency.find_entities(keys) if adjacency is not None else self._read(
                lambda run: run(cypher.FIND_ENTITIES, {"bank_id": bank_id, "keys": keys}))
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
        Reads the bank's :meth:`adjacency` from memory when it is current, else every hop
        with Cypher in one unit of work (the same result)."""
        if k <= 0:
            return []
        with self._lock:
            adjacency = self.adjacency(bank_id)
            if adjacency is None:
                act = self._read(lambda run: self._spread(run, bank_id, seeds, entity_ids,
                                                          k, hops, decay))
        if adjacency is not None:  # from memory: the store's lock is not needed
            act = _spread_from(adjacency, seeds, entity_ids, k, hops, decay)
        best = heapq.nsmallest(k, act.items(), key=_by_activation)
        return [Hit(uid, a) for uid, a in best]

    def adjacency(self, bank_id: str) -> Adjacency | None:
        """The bank's current :class:`Adjacency` (one round trip for its version token;
        read whole once :data:`SNAPSHOT_AFTER` calls saw the same token), or None: read
        the bank with Cypher (its token is too recent, it has none yet or the bank is
        larger than :data:`SNAPSHOT_MAX_UNITS`). ``snapshot_stats`` counts hits, builds
        and misses."""
        token = self._version(bank_id)
        with self._snapshot_lock:
            seen, n = self._seen.get(bank_id, (None, 0))
            n = n + 1 if seen == token else 1
            self._seen[bank_id] = (token, n)
            if len(self._seen) > 64 * SNAPSHOT_BANKS:  # bounded: forget the oldest
                self._seen.pop(next(iter(self._seen)))
            snap = self._snapshots.get(bank_id)
            if snap is not None and snap.token == token:
                self._snapshots.move_to_end(bank_id)
                self.snapshot_stats["hits"] += 1
                return snap
        if token is None or n < SNAPSHOT_AFTER:
            self.snapshot_stats["misses"] += 1
            return None
        snap = self._read(lambda run: self._read_adjacency(run, bank_id, token))
        if not isinstance(snap, Adjacency):
            self.snapshot_stats["misses"] += 1
            if snap == "too large":  # not again until the bank changes
                with self._snapshot_lock:
                    self._seen[bank_id] = (token, -math.inf)
            return None
        with self._snapshot_lock:
            self._snapshots[bank_id] = snap
            self._snapshots.move_to_end(bank_id)
            while len(self._snapshots) > 1 and (
                    len(self._snapshots) > SNAPSHOT_BANKS
                    or sum(len(s.live) for s in self._snapshots.values()) > SNAPSHOT_TOTAL_UNITS):
                self._snapshots.popitem(last=False)
        self.snapshot_stats["builds"] += 1
        return snap

    def _read_adjacency(self, run: Run, bank_id: str, token: str) -> Adjacency | str:
        if int(_column(run, cypher.COUNT_UNITS, bank_id=bank_id)[0]) > SNAPSHOT_MAX_UNITS:
            return "too large"
        snap = Adjacency.read(run, bank_id, token, self.fanout)
        # a write between the token and the last query (no multi-query transaction, or
        # a read-committed one) would leave a mixed copy: keep it only if none happened
        after = _column(run, cypher.BANK_VERSION, bank_id=bank_id)
        return snap if after and after[0] == token else "changed"

    def _spread(self, run: Run, bank_id: str, seeds: dict[str, float],
                entity_ids: Sequence[str], k: int, hops: int,
                decay: float) -> dict[str, float]:
        return _spread_from(_CypherView(run, bank_id, self.fanout), seeds, entity_ids,
                            k, hops, decay)


class _CypherView:
    """The questions spreading activation asks of a bank (as :class:`Adjacency` answers
    them from memory), answered with Cypher inside one unit of work ``run``."""

    #: Unknown without reading every link: spreading skips nothing (see spread_activation).
    max_weight = math.inf

    def __init__(self, run: Run, bank_id: str, fanout: int) -> None:
        self.run, self.bank_id, self.fanout = run, bank_id, fanout

    def live_units(self, ids: Sequence[str]) -> list[str]:
        """Which of ``ids`` are live units of the bank (``cypher.EXISTING_UNITS``)."""
        if not ids:
            return []
        return _column(self.run, cypher.EXISTING_UNITS, bank_id=self.bank_id, ids=list(ids))

    def entity_units(self, entity_ids: Sequence[str]) -> Iterable[tuple[int, Sequence[str]]]:
        """(degree, units) per entity of ``entity_ids`` that any unit mentions."""
        if not entity_ids:
            return []
        return [(degree, units) for _, degree, units in self.run(cypher.ENTITY_UNITS, {
            "bank_id": self.bank_id, "entity_ids": list(entity_ids), "fanout": self.fanout})]

    def neighbours(self, ids: list[str]
                   ) -> Iterable[tuple[Sequence[str], Sequence[str], float]]:
        """Edge groups one hop from ``ids`` (see :func:`spread_activation`): per entity
        the frontier units mentioning it × its units (at most ``fanout``), then each
        unit's LINK edges (its ``fanout`` heaviest)."""
        for _, sources, degree, units in self.run(cypher.ENTITY_NEIGHBOURS, {
                "bank_id": self.bank_id, "ids": ids, "fanout": self.fanout}):
            yield sources, units, hub_damping(degree)
        per_source: dict[str, list[tuple[float, str]]] = defaultdict(list)
        for src, uid, _kind, weight in self.run(cypher.LINK_NEIGHBOURS,
                                                {"bank_id": self.bank_id, "ids": ids}):
            per_source[src].append((float(weight if weight is not None else 1.0), uid))
        for src, edges in per_source.items():
            for weight, uid in sorted(edges, reverse=True)[:self.fanout]:
                yield (src,), (uid,), weight


def _spread_from(view: "Adjacency | _CypherView", seeds: dict[str, float],
                 entity_ids: Sequence[str], k: int, hops: int, decay: float
                 ) -> dict[str, float]:
    """:func:`spread_activation` from ``seeds`` and the units mentioning ``entity_ids``
    over ``view`` (the bank in memory, or read with Cypher: the same answers)."""
    starts: dict[str, float] = {}
    for uid in view.live_units(list(seeds)):
        starts[uid] = max(starts.get(uid, 0.0), float(seeds[uid]))
    for degree, units in view.entity_units(list(entity_ids)):
        a = hub_damping(degree)
        for uid in units:
            starts[uid] = max(starts.get(uid, 0.0), a)
    starts = {u: a for u, a in starts.items() if a > 0}
    # with the largest weight known (in memory), work that cannot reach the top k is skipped
    return spread_activation(starts, hops, decay, view.neighbours,
                             frontier_cap=max(4 * k, MIN_FRONTIER), keep=k,
                             max_weight=view.max_weight)


# ---- units of work (plain functions of a Run, so a managed transaction may retry them) ----


def _touch(run: Run, bank_id: str, result: T = None) -> T:
    """Renew the bank's version token (the last query of a write); returns ``result``."""
    run(cypher.TOUCH_BANK, {"bank_id": bank_id, "version": uuid.uuid4().hex})
    return result


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
    _touch(run, bank_id)


def _delete_units(run: Run, bank_id: str, ids: list[str]) -> None:
    old_entities = _column(run, cypher.UNIT_ENTITIES, bank_id=bank_id, ids=ids)
    old_targets = _column(run, cypher.UNIT_LINK_TARGETS, bank_id=bank_id, ids=ids)
    run(cypher.CLEAR_UNIT_EDGES, {"bank_id": bank_id, "ids": ids})
    run(cypher.MARK_STUBS, {"bank_id": bank_id, "ids": ids})
    _cleanup(run, bank_id, ids + old_targets, old_entities)
    _touch(run, bank_id)


def _entities_by_id(run: Run, bank_id: str, ids: list[str]) -> dict[str, list[Any]]:
    return {r[0]: r for r in run(cypher.ENTITIES_BY_ID, {"bank_id": bank_id, "ids": ids})}


def _keys_of(row: list[Any]) -> list[str]:
    """An entity row's key and alias keys, key first, each once."""
    return [k for k in dict.fromkeys([row[3], *(row[4] or [])]) if k]


def _move_mentions(run: Run, bank_id: str, from_id: str, to_id: str,
                   unit_ids: list[str] | None) -> None:
    params = {"bank_id": bank_id, "from_id": from_id, "to_id": to_id,
              "all": unit_ids is None, "unit_ids": unit_ids or []}
    run(cypher.ADD_MENTIONS_OF, params)
    run(cypher.DROP_MENTIONS, params)


def _merge_entities(run: Run, bank_id: str, survivor_id: str, merged: list[str],
                    display_name: str) -> None:
    found = _entities_by_id(run, bank_id, [survivor_id, *merged])
    gone = [m for m in merged if m in found]
    s = found.get(survivor_id) or (found[gone[0]] if gone else None)
    if s is None:
        return
    keys = _keys_of(s) if survivor_id in found else []
    for m in gone:
        keys += [k for k in _keys_of(found[m]) if k not in keys]
    name, key = s[1] or "", s[3] or ""
    if display_name:
        name, key = display_name, entity_key(display_name) or key
        if key and key not in keys:
            keys.append(key)
    run(cypher.SET_ENTITY, {"bank_id": bank_id, "id": survivor_id, "name": name, "key": key,
                            "label": s[2] or "", "aliases": keys})
    for m in gone:
        _move_mentions(run, bank_id, m, survivor_id, None)
    if gone:
        run(cypher.DELETE_ENTITIES, {"bank_id": bank_id, "ids": gone})
    _touch(run, bank_id)


def _split_entity(run: Run, bank_id: str, entity_id: str, new_id: str, aliases: list[str],
                  display_name: str, unit_ids: list[str]) -> None:
    found = _entities_by_id(run, bank_id, [entity_id, new_id])
    e = found.get(entity_id)
    if e is None:
        return
    own = _keys_of(e)
    moved = [a for a in aliases if a in own]
    kept = [k for k in own if k not in moved]
    if not kept:  # an entity keeps a name to be found by
        kept, moved = own[:1], [a for a in moved if a != own[0]]
    new = found.get(new_id)
    name = (new[1] if new is not None else display_name) or new_id
    new_key = (new[3] if new is not None else entity_key(name)) or (moved[0] if moved else "")
    new_keys = _keys_of(new) if new is not None else [new_key] if new_key else []
    new_keys += [a for a in moved if a not in new_keys]
    run(cypher.SET_ENTITY, {"bank_id": bank_id, "id": new_id, "name": name, "key": new_key,
                            "label": e[2] or "", "aliases": new_keys})
    run(cypher.SET_ENTITY, {"bank_id": bank_id, "id": entity_id, "name": e[1] or "",
                            "key": e[3] if e[3] in kept else kept[0], "label": e[2] or "",
                            "aliases": kept})
    if unit_ids:
        _move_mentions(run, bank_id, entity_id, new_id, unit_ids)
    _touch(run, bank_id)


def _cleanup(run: Run, bank_id: str, stub_ids: list[str], entity_ids: list[str]) -> None:
    # distinct ids: one row per node, so no backend is asked to delete a node twice
    stub_ids = list(dict.fromkeys(stub_ids))
    entity_ids = list(dict.fromkeys(entity_ids))
    if stub_ids:
        run(cypher.DELETE_ORPHAN_STUBS, {"bank_id": bank_id, "ids": stub_ids})
    if entity_ids:
        run(cypher.DELETE_ORPHAN_ENTITIES, {"bank_id": bank_id, "entity_ids": entity_ids})
