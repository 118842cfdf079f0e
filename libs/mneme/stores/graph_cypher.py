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
import logging
import math
import threading
import uuid
from array import array
from collections import OrderedDict, defaultdict
from typing import Any, Callable, Iterable, Sequence, TypeVar

import numpy as np

from mneme.domain import (EntityInfo, EntityRef, Fact, Hit, entity_key, from_epoch,
                          tags_filter_set, to_epoch)
from mneme.stores import cypher
from mneme.stores.filters import check_document_id

log = logging.getLogger(__name__)

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
#: Largest bank (live units) whose adjacency is kept in memory (~0.4 KB per unit): above
#: it every hop is a round trip with results that grow with the bank (recall p50 ~310 ms
#: at 20k units in one bank, measured, against ~30 ms from memory).
SNAPSHOT_MAX_UNITS = 200_000
#: Live units of all the adjacencies one store keeps (~120 MB); the least recently read
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


class _Rows:
    """Per-index rows of parallel columns, held flat (CSR: ``ptr``, ``cols``) with an
    ``over`` dict of rows replaced or added since (index → tuple of column lists): the
    long-lived part is a few NumPy buffers, not a tuple per row. Immutable in use: a
    change makes a new instance (:meth:`changed`) sharing the buffers."""

    __slots__ = ("ptr", "cols", "over")
    #: Replaced rows kept aside before the flat buffers are rebuilt (or an eighth of the
    #: rows, if more): a rebuild copies every buffer once.
    REBUILD_AFTER = 1024

    def __init__(self, ptr: Any, cols: tuple[Any, ...], over: dict[int, tuple[list, ...]]):
        self.ptr, self.cols, self.over = ptr, cols, over

    @classmethod
    def of(cls, rows: Any, cols: Sequence[Any], n: int) -> "_Rows":
        """From flat ``rows`` (an index per entry, grouped and in order) and matching
        column arrays, for indices 0..n-1."""
        ptr = np.zeros(n + 1, dtype=np.int64)
        np.cumsum(np.bincount(rows, minlength=n)[:n], out=ptr[1:])
        return cls(ptr, tuple(cols), {})

    def row(self, i: int) -> tuple[list, ...]:
        """Index ``i``'s row: one list per column (empty lists when it has none)."""
        r = self.over.get(i)
        if r is not None:
            return r
        if i + 1 >= len(self.ptr):
            return tuple([] for _ in self.cols)
        a, b = int(self.ptr[i]), int(self.ptr[i + 1])
        return tuple(c[a:b].tolist() for c in self.cols)

    def changed(self, rows: dict[int, tuple[list, ...]], n: int) -> "_Rows":
        """A copy with ``rows`` replaced or added (indices < ``n``); the flat buffers are
        rebuilt once the replaced rows pass :attr:`REBUILD_AFTER` and an eighth of ``n``,
        so the rows aside stay few."""
        over = {**self.over, **rows}
        if len(over) <= max(self.REBUILD_AFTER, n // 8):
            return _Rows(self.ptr, self.cols, over)
        base_n = len(self.ptr) - 1
        counts = np.diff(self.ptr)
        replaced = np.zeros(max(n, base_n), dtype=bool)
        replaced[np.fromiter(over, dtype=np.int64, count=len(over))] = True
        flat_row = np.repeat(np.arange(base_n, dtype=np.int64), counts)
        keep = ~replaced[flat_row]
        extra_rows = np.fromiter((i for i, r in over.items() for _ in r[0]), dtype=np.int64)
        all_rows = np.concatenate([flat_row[keep], extra_rows])
        order = np.argsort(all_rows, kind="stable")
        cols = tuple(np.concatenate([c[keep], np.array([v for r in over.values() for v in r[j]],
                                                        dtype=c.dtype)])[order]
                     for j, c in enumerate(self.cols))
        return _Rows.of(all_rows[order], cols, n)


def _grown(names: list[str], index: dict[str, int], n: int,
           new: list[str]) -> tuple[list[str], dict[str, int]]:
    """``names[:n] + new`` and its index (name → position): ``names`` and ``index``
    themselves, grown in place, when they hold exactly ``n`` (no later version grew them;
    the versions sharing them read only their own first entries), else new copies."""
    if len(names) == n:
        names.extend(new)
        index.update((x, j) for j, x in enumerate(new, n))
        return names, index
    names = names[:n] + new
    return names, {x: j for j, x in enumerate(names)}


class Adjacency:
    """One bank's graph in memory, as of version ``token``; answers what the hop-by-hop
    queries of :mod:`mneme.stores.cypher` answer, from the same edges.

    Held compactly (measured on a 100k-unit LoCoMo bank: 38 MB of RSS after the read,
    against 123 MB as per-unit tuples and dicts; ids are made afresh once the query rows
    are freed, or they pin those rows' pages: 65 MB). Each unit id is held once, as an
    index into ``_ids`` (live units and link stubs); per unit its ``occurred_start``
    (epoch seconds, 0 when unknown), a live flag, the entities it mentions and its
    ``fanout`` heaviest LINK edges in either direction to other live units ((weight,
    unit), heaviest first, then by id descending) in :class:`_Rows`. Per entity, as
    dicts (a bank has far fewer entities than units): ``mentions`` (entity → (degree, its
    ``fanout`` most recent mentioning units)), ``entities`` (entity id → (name, label,
    key)), ``keys`` (a key or former key → the entity ids that had it). ``max_weight``:
    the largest weight a hop can have (hub damping is at most 1; links as stored).

    Copy on write: :meth:`with_new_units` returns a new adjacency; this one keeps
    answering as before. ``_ids``/``_index`` and ``_ents``/``_ent_index`` only grow and
    are shared with later versions; each version reads only its first ``_n`` /
    ``_n_ents``."""

    __slots__ = ("token", "max_weight", "mentions", "entities", "keys", "live_count",
                 "_ids", "_index", "_n", "_live", "_starts", "_ents", "_ent_index",
                 "_n_ents", "_entities_of", "_links")

    def __init__(self, token: str, ids: list[str], index: dict[str, int], n: int,
                 live: Any, starts: Any, ents: list[str], ent_index: dict[str, int],
                 n_ents: int, entities_of: _Rows, links: _Rows,
                 mentions: dict[str, tuple[int, tuple[str, ...]]],
                 entities: dict[str, tuple[str, str, str]], keys: dict[str, tuple[str, ...]],
                 max_weight: float) -> None:
        self.token, self.max_weight = token, max_weight
        self.mentions, self.entities, self.keys = mentions, entities, keys
        self._ids, self._index, self._n = ids, index, n
        self._live, self._starts = live, starts
        self._ents, self._ent_index, self._n_ents = ents, ent_index, n_ents
        self._entities_of, self._links = entities_of, links
        #: how many live units (what the store's memory bound counts)
        self.live_count = int(live.sum())

    def _unit(self, uid: str) -> int | None:
        i = self._index.get(uid)
        return i if i is not None and i < self._n else None

    def _is_live(self, uid: str) -> bool:
        i = self._unit(uid)
        return i is not None and bool(self._live[i])

    @classmethod
    def read(cls, run: Run, bank_id: str, token: str, fanout: int) -> "Adjacency":
        """The bank's adjacency read with four queries (``cypher.ADJACENCY_*``)."""
        params = {"bank_id": bank_id}
        index: dict[str, int] = {}
        start_list: list[float] = []
        for uid, occurred in run(cypher.ADJACENCY_UNITS, params):
            if uid not in index:
                index[uid] = len(index)
                start_list.append(float(occurred or 0))
        n_live = len(index)

        def unit(uid: str) -> int:  # an index for any unit id (a stub's too)
            i = index.get(uid)
            if i is None:
                i = index[uid] = len(index)
            return i

        ent_index: dict[str, int] = {}
        eo_unit, eo_ent = array("q"), array("q")
        for uid, eid in run(cypher.ADJACENCY_MENTIONS, params):
            eo_unit.append(unit(uid))
            eo_ent.append(ent_index.setdefault(eid, len(ent_index)))
        src_l, dst_l, w_l = array("q"), array("q"), array("d")
        for src, dst, weight in run(cypher.ADJACENCY_LINKS, params):
            if src == dst:
                continue
            s, d, w = unit(src), unit(dst), float(weight if weight is not None else 1.0)
            for a, b, ok in ((s, d, d < n_live), (d, s, s < n_live)):
                if ok:  # a's row gets (w, b) when b is live
                    src_l.append(a)
                    dst_l.append(b)
                    w_l.append(w)
        entity_rows = run(cypher.ADJACENCY_ENTITIES, params)
        # each id once, made after the rows above are gone, so the few long-lived
        # strings do not pin the pages of the many short-lived ones
        ids = [u.encode("utf-8", "surrogatepass").decode("utf-8", "surrogatepass")
               for u in index]
        del index
        index = {u: i for i, u in enumerate(ids)}
        n = len(ids)
        starts = np.zeros(n, dtype=np.float64)
        starts[:n_live] = start_list
        live = np.zeros(n, dtype=bool)
        live[:n_live] = True
        ents = list(ent_index)

        eo_u = np.frombuffer(eo_unit, dtype=np.int64)
        eo_e = np.frombuffer(eo_ent, dtype=np.int64)
        order = np.argsort(eo_u, kind="stable")
        entities_of = _Rows.of(eo_u[order], (eo_e[order].astype(np.int32),), n)
        # mentions: per entity its degree and fanout most recent units (then by id)
        by_ent = np.argsort(eo_e, kind="stable")
        mentions: dict[str, tuple[int, tuple[str, ...]]] = {}
        bounds = np.searchsorted(eo_e[by_ent], np.arange(len(ents) + 1))
        for j, eid in enumerate(ents):
            us = eo_u[by_ent[bounds[j]:bounds[j + 1]]].tolist()
            best = sorted((_recent_first(starts[u], ids[u]) for u in us))[:fanout]
            mentions[eid] = (len(us), tuple(u for _, u in best))
        # links: heaviest first, then by id descending, at most fanout per unit
        src = np.frombuffer(src_l, dtype=np.int64)
        dst = np.frombuffer(dst_l, dtype=np.int64)
        w = np.frombuffer(w_l, dtype=np.float64)
        rank = np.empty(n, dtype=np.int64)
        rank[sorted(range(n), key=ids.__getitem__)] = np.arange(n)
        order = np.lexsort((-rank[dst], -w, src))
        src, dst, w = src[order], dst[order], w[order]
        first = np.searchsorted(src, src, side="left")
        keep = (np.arange(len(src)) - first) < fanout
        links = _Rows.of(src[keep], (w[keep], dst[keep].astype(np.int32)), n)
        max_weight = max(1.0, float(w[keep].max()) if keep.any() else 1.0)

        entities: dict[str, tuple[str, str, str]] = {}
        keys: dict[str, list[str]] = defaultdict(list)
        for eid, name, label, key, aliases in entity_rows:
            entities[eid] = (name or "", label or "", key or "")
            for k in dict.fromkeys([key, *(aliases or [])]):
                if k:
                    keys[k].append(eid)
        return cls(token, ids, index, n, live, starts, ents, ent_index,
                   len(ents), entities_of, links, mentions, entities,
                   {k: tuple(v) for k, v in keys.items()}, max_weight)

    def with_new_units(self, facts: Sequence[Fact], token: str,
                       fanout: int) -> "Adjacency | None":
        """This adjacency after ``facts`` were upserted (as ``_upsert_units`` writes them),
        as version ``token``: what :meth:`read` would give, without reading the graph.
        None when the facts are not all new to the bank's live units, one revives a stub
        with ``fanout`` or more incoming links (the copy keeps at most that many, so it
        cannot know the rest), or the batch names one entity in two ways: then the graph
        must be read. Copy on write: readers of this adjacency are not disturbed."""
        ids = [f.id for f in facts]
        if (len(set(ids)) != len(ids) or any(self._is_live(i) for i in ids)
                or any(len(self._links.row(j)[0]) >= fanout
                       for j in map(self._unit, ids) if j is not None)
                or self.live_count + len(ids) > SNAPSHOT_MAX_UNITS):
            return None
        named: dict[str, set[tuple[str, str]]] = defaultdict(set)
        for f in facts:
            for e in f.entities:
                named[e.id].add((e.name or "", e.label or ""))
        if any(len(v) > 1 for v in named.values()):
            # one entity under two names in one batch: which the graph keeps is the
            # backend's (FalkorDB keeps the first for an entity the batch creates)
            return None
        fresh: dict[str, int] = {}  # ids new to the bank (facts, link stubs) → index
        fresh_ents: dict[str, int] = {}

        def unit(uid: str) -> int:
            i = self._unit(uid)
            return i if i is not None else fresh.setdefault(uid, self._n + len(fresh))

        def entity(eid: str) -> int:
            i = self._ent_index.get(eid)
            if i is not None and i < self._n_ents:
                return i
            return fresh_ents.setdefault(eid, self._n_ents + len(fresh_ents))

        idx = [unit(i) for i in ids]
        targets = {lk.target_id: unit(lk.target_id) for f in facts for lk in f.links}
        n = self._n + len(fresh)
        live = np.zeros(n, dtype=bool)
        live[:self._n] = self._live
        live[idx] = True
        starts = np.zeros(n, dtype=np.float64)
        starts[:self._n] = self._starts
        entities = dict(self.entities)
        keys = {k: list(v) for k, v in self.keys.items()}
        eo_rows: dict[int, tuple[list, ...]] = {}
        mentioning: dict[str, list[str]] = defaultdict(list)
        for f, i in zip(facts, idx):
            starts[i] = to_epoch(f.occurred_start) or 0.0
            unique = list({e.id: e for e in f.entities}.values())
            if unique:
                eo_rows[i] = ([entity(e.id) for e in unique],)
            for e in unique:
                mentioning[e.id].append(f.id)
                key = entity_key(e.name)
                entities[e.id] = (e.name or "", e.label or "", key or "")
                if key and e.id not in keys.setdefault(key, []):
                    keys[key].append(e.id)
        mentions = dict(self.mentions)
        live_ids = set(ids)
        for eid, new in mentioning.items():
            degree, units = mentions.get(eid, (0, ()))
            if not all(u in live_ids or self._is_live(u) for u in units):
                return None  # (a mention of a unit not live: read it as it is)
            merged = sorted(_recent_first(starts[unit(u)], u) for u in (*units, *new))
            mentions[eid] = (degree + len(new), tuple(u for _, u in merged[:fanout]))
        new_ids = list(fresh)

        def name(j: int) -> str:
            return self._ids[j] if j < self._n else new_ids[j - self._n]

        added: dict[int, list[tuple[float, str, int]]] = defaultdict(list)
        for i in idx:  # a revived stub's incoming links join their sources' lists
            ws, js = self._links.row(i) if i < self._n else ([], [])
            for w, j in zip(ws, js):
                if live[j]:
                    added[j].append((w, name(i), i))
        # MERGE keeps one edge per (source, target, kind), with the last weight written
        edges: dict[tuple[int, int, str], float] = {}
        for f, i in zip(facts, idx):
            for lk in f.links:
                if lk.target_id != f.id:
                    edges[(i, targets[lk.target_id], lk.kind)] = float(lk.weight)
        for (s, d, _), w in edges.items():
            if live[d]:
                added[s].append((w, name(d), d))
            added[d].append((w, name(s), s))  # the source is one of the new, live units
        link_rows: dict[int, tuple[list, ...]] = {}
        for u, es in added.items():
            ws, js = self._links.row(u) if u < self._n else ([], [])
            merged = sorted([*((w, name(j), j) for w, j in zip(ws, js)), *es],
                            reverse=True)[:fanout]
            link_rows[u] = ([w for w, _, _ in merged], [j for _, _, j in merged])
        max_weight = max([self.max_weight, *edges.values()])
        unit_ids, index = _grown(self._ids, self._index, self._n, new_ids)
        ents, ent_index = _grown(self._ents, self._ent_index, self._n_ents, list(fresh_ents))
        return Adjacency(token, unit_ids, index, n, live, starts, ents, ent_index,
                         len(ents), self._entities_of.changed(eo_rows, n),
                         self._links.changed(link_rows, n), mentions, entities,
                         {k: tuple(v) for k, v in keys.items()}, max_weight)

    def live_units(self, ids: Sequence[str]) -> list[str]:
        """Which of ``ids`` are live units of the bank (``cypher.EXISTING_UNITS``)."""
        return [u for u in ids if self._is_live(u)]

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
            i = self._unit(uid)
            if i is not None:
                for e in self._entities_of.row(i)[0]:
                    sources[self._ents[e]].append(uid)
        for eid, srcs in sources.items():
            degree, units = self.mentions[eid]
            yield srcs, units, hub_damping(degree)
        for uid in ids:
            i = self._unit(uid)
            if i is not None:
                ws, js = self._links.row(i)
                for weight, j in zip(ws, js):
                    yield (uid,), (self._ids[j],), weight

    def find_entities(self, keys: Sequence[str]) -> list[list[str]]:
        """Rows (id, name, label, key) of ``cypher.FIND_ENTITIES``."""
        found = dict.fromkeys(eid for k in keys for eid in self.keys.get(k, ()))
        return [[eid, *self.entities[eid]] for eid in found]

    def as_dicts(self) -> dict[str, Any]:
        """The whole adjacency as plain dicts keyed by id (for tests and inspection):
        ``live`` (frozenset), ``starts`` (live unit → epoch seconds), ``entities_of``
        (unit → entity ids), ``links`` (unit → ((weight, unit), ...)), ``mentions``,
        ``entities``, ``keys``, ``max_weight``."""
        ids = self._ids[:self._n]
        live = [i for i in range(self._n) if self._live[i]]
        entities_of, links = {}, {}
        for i, u in enumerate(ids):
            es = self._entities_of.row(i)[0]
            if es:
                entities_of[u] = tuple(self._ents[e] for e in es)
            ws, js = self._links.row(i)
            if ws:
                links[u] = tuple((w, ids[j]) for w, j in zip(ws, js))
        return {"live": frozenset(ids[i] for i in live),
                "starts": {ids[i]: float(self._starts[i]) for i in live},
                "entities_of": entities_of, "links": links, "mentions": dict(self.mentions),
                "entities": dict(self.entities), "keys": dict(self.keys),
                "max_weight": self.max_weight}


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
        # exclusive stores: bank → (version token, entities) as of that version, kept
        # across this store's writes (see count_entities)
        self._entity_counts: dict[str, tuple[str | None, int]] = {}

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

    def _check_unit_tags(self) -> str | None:
        """When a store opens: a bank holding units projected before units kept their
        tags (which pass no tag filter of the entity reads until ``mneme replay``), with a
        warning saying so; None when every unit has them."""
        rows = self._read(lambda run: run(cypher.UNITS_WITHOUT_TAGS, {}))
        if not rows:
            return None
        log.warning("graph: memories projected before the graph kept their tags (bank %r and "
                    "maybe others) match no tag filter of ListEntities/GetEntity (scoped "
                    "reads show too little) until `mneme replay` rebuilds the graph",
                    rows[0][0])
        return rows[0][0]

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
                    self._write_counted(bank_id, lambda run, tally, b=batch:
                                        _upsert_units(run, bank_id, b, tally))
                    if current is not None:
                        self._advance(current, bank_id, batch)

    # -- entity counts (GetBankStats) --

    def _write_counted(self, bank_id: str, work: Callable[[Run, bool], int | None]) -> None:
        """One unit of work on the bank, ``work(run, tally)`` returning how many entities
        it added (it need only count them when ``tally``: the bank's count is known),
        which moves the kept count on; caller holds the lock."""
        known = self._take_entity_count(bank_id)
        self._put_entity_count(bank_id, known,
                               self._write(lambda run: work(run, known is not None)))

    def _take_entity_count(self, bank_id: str) -> int | None:
        """Before a write of the bank: its entity count if known and current (on an
        :attr:`exclusive` store; removed until :meth:`_put_entity_count` puts it back,
        so a write that fails leaves it to be counted again)."""
        if not self.exclusive:
            return None
        known = self._entity_counts.pop(bank_id, None)
        if known is None or known[0] != self._version(bank_id):
            return None
        return known[1]

    def _put_entity_count(self, bank_id: str, known: int | None, delta: int | None) -> None:
        """After a write of the bank that changed its entities by ``delta``: the count
        ``known`` before it, moved on to the bank's new version."""
        if known is not None and delta is not None:
            self._entity_counts[bank_id] = (self._version(bank_id), known + delta)

    def save_entity_counts(self) -> None:
        """Save the entity counts this store kept on their banks' nodes (one query), each
        only if its bank is still at the version it was counted at: a store opened later
        answers :meth:`count_entities` without counting. Exclusive stores call it when
        they close."""
        with self._lock:
            rows = [{"bank_id": b, "version": v, "entities": n}
                    for b, (v, n) in self._entity_counts.items() if v is not None]
            if rows:
                self._write(lambda run: run(cypher.SAVE_ENTITY_COUNTS, {"rows": rows}))

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
                self._write_counted(bank_id, lambda run, _, b=batch:
                                    _delete_units(run, bank_id, b))

    def delete_where(self, bank_id: str, document_id: str | None = None) -> None:
        """Delete the bank's units of ``document_id`` as :meth:`delete` does, or, when
        None, every unit, stub and entity of the bank (in batches of
        :data:`DELETE_BATCH` nodes). ValueError for ""."""
        check_document_id(document_id)
        with self._lock:
            if document_id is None:
                self._take_entity_count(bank_id)
                for query in (cypher.DELETE_BANK_UNITS, cypher.DELETE_BANK_ENTITIES):
                    while self._write(lambda run, q=query: _touch(run, bank_id, deleted(run(
                            q, {"bank_id": bank_id, "limit": DELETE_BATCH})))) >= DELETE_BATCH:
                        pass
                if self.exclusive:  # every entity of the bank is gone
                    self._put_entity_count(bank_id, 0, 0)
                return
            ids = self._read(lambda run: _column(run, cypher.UNITS_OF_DOCUMENT,
                                                 bank_id=bank_id, document_id=document_id))
            for i in range(0, len(ids), BATCH):
                batch = ids[i:i + BATCH]
                self._write_counted(bank_id, lambda run, _, b=batch:
                                    _delete_units(run, bank_id, b))

    def merge_entities(self, bank_id: str, survivor_id: str, merged_ids: Sequence[str],
                       display_name: str = "") -> None:
        """A user's merge: every unit mentioning one of ``merged_ids`` mentions
        ``survivor_id`` instead, the survivor's aliases are the union of all of theirs
        (plus the key of ``display_name``, which renames it), and the merged entities are
        deleted. Idempotent; nothing happens when the survivor does not exist (merged away
        or deleted after the merge was checked)."""
        merged = [m for m in dict.fromkeys(merged_ids) if m != survivor_id]
        with self._lock:
            self._write_counted(bank_id, lambda run, _: _merge_entities(
                run, bank_id, survivor_id, merged, " ".join(display_name.split())))

    def split_entity(self, bank_id: str, entity_id: str, new_id: str, aliases: Sequence[str],
                     display_name: str, unit_ids: Sequence[str]) -> None:
        """A user's split: entity ``new_id`` (``display_name``, the label of
        ``entity_id``) takes the alias keys ``aliases`` of ``entity_id`` (when its own key
        moves, its first remaining alias becomes its key; it always keeps one) and the
        MENTIONS edges of the units ``unit_ids``. The new entity exists even when no unit
        mentions it yet. Idempotent; nothing happens when ``entity_id`` does not exist."""
        with self._lock:
            self._write_counted(bank_id, lambda run, _: _split_entity(
                run, bank_id, entity_id, new_id, list(dict.fromkeys(aliases)),
                " ".join(display_name.split()), list(dict.fromkeys(unit_ids))))

    # -- reads --

    def count(self, bank_id: str) -> int:
        """Number of the bank's units (stubs excluded)."""
        with self._lock:
            return int(self._read(lambda run: _column(run, cypher.COUNT_UNITS,
                                                      bank_id=bank_id))[0])

    def count_entities(self, bank_id: str) -> int:
        """Number of the bank's entities. An :attr:`exclusive` store keeps each bank's
        count across its own writes (each write counts the entities it creates and
        deletes), saved on the bank's node at close (:meth:`save_entity_counts`), so the
        call costs a lookup at any bank size; it counts in the graph (linear in the
        bank's entities: 12-24 ms at 90k) only for a bank it has no current count of. A
        store other processes write too always counts."""
        with self._lock:
            if not self.exclusive:
                return self._count_entities(bank_id)
            token = self._version(bank_id)
            known = self._entity_counts.get(bank_id)
            if known is not None and known[0] == token:
                return known[1]
            rows = self._read(lambda run: run(cypher.BANK_ENTITY_COUNT, {"bank_id": bank_id}))
            version, saved, counted_at = rows[0] if rows else (None, None, None)
            if saved is not None and counted_at is not None and counted_at == version == token:
                n = int(saved)
            else:
                n = self._count_entities(bank_id)
            self._entity_counts[bank_id] = (token, n)
            return n

    def _count_entities(self, bank_id: str) -> int:
        return int(self._read(lambda run: _column(run, cypher.COUNT_ENTITIES,
                                                  bank_id=bank_id))[0])

    def entities(self, bank_id: str, limit: int, after: str = "", tags: Sequence[str] = (),
                 tags_match: str = "any") -> list[EntityInfo]:
        """At most ``limit`` of the bank's entities with ids after ``after``, in id order,
        each with its alias keys and live mention count (no units, no neighbours). With a
        tag filter (``tags`` in ``tags_match`` mode, :func:`mneme.domain.tags_match`),
        the count and first/last seen are over the matching live units only, and an
        entity no matching unit mentions is still in the page with 0 mentions (the page
        is the same ``limit`` entities; the caller drops those). A unit projected without
        tags (before units kept them, until a replay) matches no filter. ValueError for
        ``limit`` < 1 or an unknown ``tags_match``."""
        if limit < 1:
            raise ValueError("limit must be positive")
        query, scope = _scoped(cypher.LIST_ENTITIES_SCOPED, tags, tags_match)
        with self._lock:
            rows = self._read(lambda run: run(query, {
                "bank_id": bank_id, "after": after or "", "limit": int(limit), **scope}))
        return [EntityInfo(r[0], r[1] or "", r[2] or "", tuple(sorted(r[3] or ())), int(r[4]),
                           first_seen=from_epoch(r[5]), last_seen=from_epoch(r[6]))
                for r in rows]

    def entity(self, bank_id: str, entity_id: str, units: int = 100,
               neighbours: int = 20, tags: Sequence[str] = (),
               tags_match: str = "any") -> EntityInfo | None:
        """The bank's entity ``entity_id`` with at most ``units`` ids of live units
        mentioning it (most recent first) and its ``neighbours`` most co-mentioned
        entities, or None when the bank has no such entity. With a tag filter (as
        :meth:`entities`) the mentions, first/last seen, units and neighbours' shared
        counts are over the matching live units only (0 mentions: none matches).
        ValueError for an unknown ``tags_match``."""
        get, scope = _scoped(cypher.GET_ENTITY_SCOPED, tags, tags_match)
        near, _ = _scoped(cypher.CO_MENTIONED_SCOPED, tags, tags_match)

        def work(run: Run):
            found = run(get, {"bank_id": bank_id, "entity_id": entity_id,
                              "limit": int(max(units, 0)), **scope})
            if not found:
                return None, []
            return found[0], run(near, {
                "bank_id": bank_id, "entity_id": entity_id, "limit": int(max(neighbours, 0)),
                **scope})

        with self._lock:
            row, near = self._read(work)
        if row is None:
            return None
        return EntityInfo(row[0], row[1] or "", row[2] or "", tuple(sorted(row[3] or ())),
                          int(row[4]), tuple(u for u in (row[5] or ()) if u)[:units],
                          tuple((n[0], n[1] or "", n[2] or "", int(n[3])) for n in near),
                          first_seen=from_epoch(row[6]), last_seen=from_epoch(row[7]))

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
                    or sum(s.live_count for s in self._snapshots.values()) > SNAPSHOT_TOTAL_UNITS):
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


def _scoped(template: str, tags: Sequence[str], tags_match: str) -> tuple[str, dict[str, Any]]:
    """``template`` (a ``*_SCOPED`` query) for the tag filter ``tags`` / ``tags_match``,
    with its parameters: unscoped when the filter passes everything
    (:func:`mneme.domain.tags_filter_set`). ValueError for an unknown mode."""
    if not tags_filter_set(tags, tags_match):
        return cypher.tag_scoped(template, None), {}
    return cypher.tag_scoped(template, tags_match), {"tags": sorted(set(tags))}


# ---- units of work (plain functions of a Run, so a managed transaction may retry them) ----


def _touch(run: Run, bank_id: str, result: T = None) -> T:
    """Renew the bank's version token (the last query of a write); returns ``result``."""
    run(cypher.TOUCH_BANK, {"bank_id": bank_id, "version": uuid.uuid4().hex})
    return result


def _upsert_units(run: Run, bank_id: str, facts: list[Fact], tally: bool = False
                  ) -> int | None:
    """One unit of work: ``facts`` in; with ``tally``, returns how many entities it
    added (created minus deleted), else None. What the units' old versions alone
    mentioned or linked to goes first (:func:`_drop_what_only_they_use`), so the work
    done again after it was cut short between its queries ends the same."""
    ids = [f.id for f in facts]
    mentions, entities = [], {}
    for f in facts:
        for e in {e.id: e for e in f.entities}.values():
            mentions.append({"unit_id": f.id, "entity_id": e.id})
            key = entity_key(e.name)
            row = entities.setdefault(e.id, {"entity_id": e.id, "keys": []})
            row.update(name=e.name, key=key, label=e.label)
            if key not in row["keys"]:
                row["keys"].append(key)
    links = [{"source_id": f.id, "target_id": lk.target_id, "kind": lk.kind,
              "weight": float(lk.weight)}
             for f in facts for lk in f.links if lk.target_id != f.id]
    gone = _drop_what_only_they_use(run, bank_id, ids, list(entities),
                                    list(dict.fromkeys(r["target_id"] for r in links)))
    run(cypher.CLEAR_UNIT_EDGES, {"bank_id": bank_id, "ids": ids})
    run(cypher.UPSERT_UNITS, {"bank_id": bank_id, "units": [{
        "id": f.id, "document_id": f.document_id, "fact_type": f.fact_type,
        "occurred_start": to_epoch(f.occurred_start),
        "occurred_end": to_epoch(f.occurred_end),
        "mentioned_at": to_epoch(f.mentioned_at),
        "tags": sorted(set(f.tags))} for f in facts]})
    created = 0
    if mentions:
        if tally:
            existing = _column(run, cypher.EXISTING_ENTITIES, bank_id=bank_id,
                               ids=list(entities))
            created = len(entities) - int(existing[0] if existing else 0)
        run(cypher.MERGE_ENTITIES, {"bank_id": bank_id, "entities": list(entities.values())})
        run(cypher.MERGE_MENTIONS, {"bank_id": bank_id, "rows": mentions})
    if links:
        run(cypher.MERGE_LINKS, {"bank_id": bank_id, "rows": links})
    _touch(run, bank_id)
    return created - gone if tally else None


def _delete_units(run: Run, bank_id: str, ids: list[str]) -> int:
    """One unit of work: ``ids`` out; returns how many entities it added (minus those
    left without mentions and deleted). Each step decides from the graph as it is, so
    the work done again after it was cut short between its queries ends the same."""
    gone = _drop_what_only_they_use(run, bank_id, ids, [], [])
    run(cypher.CLEAR_UNIT_EDGES, {"bank_id": bank_id, "ids": ids})
    run(cypher.DELETE_UNLINKED_UNITS, {"bank_id": bank_id, "ids": ids})
    run(cypher.MARK_STUBS, {"bank_id": bank_id, "ids": ids})
    _touch(run, bank_id)
    return -gone


def _drop_what_only_they_use(run: Run, bank_id: str, ids: list[str], keep_entities: list[str],
                             keep_targets: list[str]) -> int:
    """Before the units ``ids`` lose their edges: delete the link stubs and entities
    nothing but them uses, except those named to keep (what their new versions use);
    returns the entities deleted. An entity split off another (``split_from``) is kept
    without mentions while that one exists, and goes with it: entities split off one
    deleted here and mentioned by nothing else go first, the deepest first, so a write
    cut short between these deletes finds the rest again when done again."""
    params = {"bank_id": bank_id, "ids": ids}
    run(cypher.DELETE_STUBS_ONLY_THEY_LINK, {**params, "keep": keep_targets})
    found = {r[0]: (r[1], int(r[2])) for r in run(cypher.ENTITIES_ONLY_THEY_MENTION,
                                                  {**params, "keep": keep_entities})}
    doomed = {i for i, (_, origin) in found.items() if not origin}
    while more := {i for i, (of, _) in found.items() if of in doomed and i not in doomed}:
        doomed |= more  # split off one that goes
    levels, seen = [sorted(doomed)], set(doomed)
    while levels[-1]:
        splits = [i for i in _column(run, cypher.SPLITS_WITHOUT_MENTIONS, origins=levels[-1],
                                     keep=keep_entities, **params) if i not in seen]
        seen.update(splits)
        levels.append(splits)
    return sum(deleted(run(cypher.DELETE_ENTITIES, {**params, "ids": level}))
               for level in reversed(levels) if level)


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
                    display_name: str) -> int:
    """One unit of work (see :meth:`CypherGraphStore.merge_entities`); returns how many
    entities it added."""
    found = _entities_by_id(run, bank_id, [survivor_id, *merged])
    gone = [m for m in merged if m in found]
    s = found.get(survivor_id)
    # A survivor merged away or deleted after the request was checked: nothing (entity
    # resolution, which sees the merges in the same order, ignores it too; building the
    # survivor anew from a merged entity would bring back an entity that is gone).
    if s is None:
        return 0
    keys = _keys_of(s)
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
    deleted_n = 0
    if gone:
        run(cypher.REPOINT_SPLITS, {"bank_id": bank_id, "ids": gone, "survivor_id": survivor_id})
        deleted_n = deleted(run(cypher.DELETE_ENTITIES, {"bank_id": bank_id, "ids": gone}))
    _touch(run, bank_id)
    return -deleted_n


def _split_entity(run: Run, bank_id: str, entity_id: str, new_id: str, aliases: list[str],
                  display_name: str, unit_ids: list[str]) -> int:
    """One unit of work (see :meth:`CypherGraphStore.split_entity`); returns how many
    entities it added (1 when ``new_id`` is new)."""
    found = _entities_by_id(run, bank_id, [entity_id, new_id])
    e = found.get(entity_id)
    if e is None:
        return 0
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
    run(cypher.SET_SPLIT_FROM, {"bank_id": bank_id, "id": new_id, "from_id": entity_id})
    run(cypher.SET_ENTITY, {"bank_id": bank_id, "id": entity_id, "name": e[1] or "",
                            "key": e[3] if e[3] in kept else kept[0], "label": e[2] or "",
                            "aliases": kept})
    if unit_ids:
        _move_mentions(run, bank_id, entity_id, new_id, unit_ids)
    _touch(run, bank_id)
    return int(new is None)
