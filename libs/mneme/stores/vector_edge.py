"""Vector store over Qdrant Edge (``qdrant-edge-py``): an in-process HNSW shard.

One shard holds every bank; ``bank_id`` is a tenant-keyword payload field and every
request is filtered by it. The payload carries the whole :class:`~mneme.domain.Fact`
(see :func:`fact_to_payload`), so ``get``/``scroll`` hydrate facts without another store.

Deletions are made physical by :meth:`EdgeVectorStore.flush`: Qdrant only marks a deleted
point, its vector and payload stay in the segment files (and its upsert in the write-ahead
log) until the segment is rebuilt. So the shard has no WAL (the consumers flush before they
commit, which is the durability mneme needs) and its vacuum optimizer rebuilds every
segment holding a deleted point; a flush after deletions runs it, once per batch.
"""

from __future__ import annotations

import base64
import copy
import errno
import json
import logging
import os
import shutil
import threading
import uuid
from collections import Counter, OrderedDict
from datetime import datetime
from typing import Any, Callable, Iterable, Sequence

from qdrant_edge import (
    CountRequest,
    Distance,
    EdgeConfig,
    EdgeOptimizersConfig,
    EdgeShard,
    EdgeVectorParams,
    FacetRequest,
    FieldCondition,
    Filter,
    HasIdCondition,
    IsEmptyCondition,
    KeywordIndexParams,
    MatchAny,
    MatchExcept,
    MatchValue,
    Memory,
    PayloadSchemaType,
    Point,
    Query,
    QueryRequest,
    RangeFloat,
    ScrollRequest,
    UpdateOperation,
    VectorStorageDatatype,
)

from mneme.domain import EntityRef, Fact, Filters, Hit, Link, from_epoch, to_epoch
from mneme.stores.filters import TAGS_MATCH_MODES, check_document_id
from mneme.stores.storable import storable, storable_facts
from mneme.stores.unit_counts import COUNTS_FILE, UNTYPED, UnitCounts

log = logging.getLogger(__name__)

#: Payload fields with an index, so filters on them are pushed down cheaply.
_KEYWORD_FIELDS = ("fact_type", "tags", "document_id")
_FLOAT_FIELDS = ("occurred_start", "occurred_end")
_SCROLL_BATCH = 256
#: Vacuum any segment with a deleted point (Qdrant's defaults wait for 20% deleted in
#: segments of 1000+ vectors): what makes a flush after deletions physical.
_PURGING_OPTIMIZERS = dict(deleted_threshold=0.0, vacuum_min_vector_number=1)
#: Segments of at most ~20 MB of vectors (~26k points of 384 float16), up to 8 before the
#: merge optimizer joins any (its default on 2 cores: 2, so it folded every new segment
#: into one ever larger one). An optimize or a purge then rebuilds segments of bounded
#: size, not the bank: on the 100k-fact bank's vectors, optimized every 20k points, each
#: optimize took 1.4-1.8 s and a purge after a deletion 0.3 s (with the defaults: 1.4-5.0
#: s growing, and 1.2 s; never optimized before the first purge: 30.1 s). See INDEX_EVERY.
_SEGMENT_OPTIMIZERS = dict(default_segment_number=8, max_segment_size=20_000)


#: How a new shard stores vectors. float16 halves the vectors' memory (a 100k-fact
#: bank's 153 MB, mapped twice by the binding, a reader's and a writer's) and made a kNN
#: of 100 over 100k points 5.6 ms instead of 8.8-9.4; on 50 random queries the top 20
#: were the float32 ones but for 1 in 1,000, scores within 7e-5.
DATATYPE = VectorStorageDatatype.Float16


#: Where a new shard keeps its vectors: mapped from their files and paged in as searches
#: touch them (``Cold``), not read into memory when the shard opens (the binding's
#: default, ``Cached``, which also maps each file twice and touches both: a 100k-fact
#: bank's 77 MB of vectors counted ~170 MB of RSS after 150 recalls). On 100k random
#: points, 150 kNN of 100 after a fresh open: 168 MB RSS against 265 MB, p50 8.9-9.1 ms
#: against 9.4-9.6. A restarted 100k-fact server: 98 MB less at open, ~20 MB less after
#: 150 recalls: searches page in the read-only mapping, and writes (and, after a while,
#: something not yet found) the read-write one, so both were resident again. The pages are
#: the page cache's: the kernel can drop them under pressure, and the first searches
#: after a reboot read them from disk.
VECTOR_MEMORY = Memory.Cold


#: Free bytes the shard's file system must have for a write (:meth:`EdgeVectorStore._
#: check_room`): Qdrant Edge writes points through memory-mapped files, and a write into a
#: page the full disk cannot back kills the whole process with SIGBUS (no error to catch;
#: seen on a full tmpfs, and ext4 does the same for a mapped sparse file). Below it a write
#: raises ENOSPC instead, which the consumers retry until there is room.
MIN_FREE_BYTES = 64 << 20


#: New points since the last optimize after which :meth:`EdgeVectorStore.flush` runs it
#: (a replaced point is not a new one): the new points get their HNSW index in a segment
#: of their own (bounded, see ``_SEGMENT_OPTIMIZERS``). Qdrant Edge never optimizes by
#: itself, and the binding holds the GIL while it does. Before, only the purge after a
#: deletion optimized, so a bank's points all stayed in one exhaustively searched segment
#: until then, and that purge indexed all of them at once: on the 100k-fact bank of
#: ``make bench-load`` a retain that replaced one document took 39.6 s, the server
#: answering nothing meanwhile.
INDEX_EVERY = 20_000


def _stored_params(config_file: str) -> tuple[VectorStorageDatatype, Memory | None]:
    """The vector datatype and memory placement of the shard whose ``edge_config.json``
    is ``config_file``: float32 when it names no datatype (shards made before
    :data:`DATATYPE`; the binding refuses to load a shard with a config of another
    datatype), None (the binding's default) when it names no placement (shards made
    before :data:`VECTOR_MEMORY`, whose segments keep theirs)."""
    with open(config_file, encoding="utf-8") as fh:
        params = (json.load(fh).get("vectors") or {}).get("") or {}
    name = str(params.get("datatype") or "float32").capitalize()  # "float16" -> Float16
    memory = str(params.get("memory") or "").capitalize()  # "cold" -> Cold
    return (getattr(VectorStorageDatatype, name, VectorStorageDatatype.Float32),
            getattr(Memory, memory, None) if memory else None)


# ---- payload <-> Fact ---------------------------------------------------------------------


#: Payload fields :meth:`EdgeVectorStore.facet` counts (keyword-indexed).
FACET_KEYS = ("tags", "document_id")


def check_facet(key: str, limit: int) -> None:
    """ValueError unless ``key`` is one of :data:`FACET_KEYS` and ``limit`` >= 1."""
    if key not in FACET_KEYS:
        raise ValueError(f"facet key must be one of {', '.join(FACET_KEYS)}, got {key!r}")
    if limit < 1:
        raise ValueError("limit must be positive")


def facet_pairs(hits, limit: int) -> list[tuple[str, int]]:
    """(value, count) of a facet's hits without the empty value (a unit with no document
    id has none), most units first, ties by value, at most ``limit``."""
    pairs = [(str(h.value), int(h.count)) for h in hits if h.value != ""]
    return sorted(pairs, key=lambda p: (-p[1], p[0]))[:limit]


def fact_to_payload(fact: Fact) -> dict[str, Any]:
    """The Qdrant payload of ``fact``: every field but the embedding. The fields filters
    use (:func:`qdrant_filter`; indexed, see :data:`_KEYWORD_FIELDS`) and ``id`` stay
    fields of their own; the rest is one compact JSON array under ``unit`` (text,
    context, mentioned_at, metadata, chunk_id, entities, links, item_index; times as
    epoch seconds or null).

    Why one field: the binding converts a payload field by field, at ~6-20 µs a field and
    more per field the more there are (measured: 16 short strings 260 µs, one 6 µs), and
    the same again when a payload is read back. A LoCoMo fact with 3 entities and 15 links
    took 902 µs a point as a flat payload and 137 µs packed (qdrant-edge 0.x, 2 cores), the
    largest part of a replay and of the vector arm's hydration."""
    return {
        "id": fact.id,
        "bank_id": fact.bank_id,
        "fact_type": fact.fact_type,
        "document_id": fact.document_id,
        "tags": list(fact.tags),
        "occurred_start": to_epoch(fact.occurred_start),
        "occurred_end": to_epoch(fact.occurred_end),
        "unit": json.dumps(
            [fact.text, fact.context, to_epoch(fact.mentioned_at), fact.metadata,
             fact.chunk_id, [[e.id, e.name, e.label] for e in fact.entities],
             [[lk.target_id, lk.kind, float(lk.weight)] for lk in fact.links],
             int(fact.item_index)],
            separators=(",", ":"), ensure_ascii=False),
    }


def payload_to_fact(payload: dict[str, Any], vector: Sequence[float] | None = None,
                    shared: dict[Any, Any] | None = None) -> Fact:
    """Inverse of :func:`fact_to_payload`; ``vector`` becomes the embedding (else []).
    Also reads the flat payloads written before ``unit`` (every field its own).

    ``shared``: a dict through which values repeated across facts (bank and document ids,
    metadata keys and values, entity ids, names and labels, link kinds, times) become one
    object each; a fact kept in a cache then costs ~1.6 KB instead of ~3.4 (measured over
    6,000 LoCoMo facts, with :class:`Fact`'s slots). The caller bounds it."""
    if "unit" in payload:
        text, context, mentioned, metadata, chunk_id, entities, links, item_index = (
            json.loads(payload["unit"]))
        one = (shared if shared is not None else {}).setdefault

        def same(value: Any) -> Any:
            return one(value, value)

        return Fact(
            id=payload["id"], bank_id=same(payload["bank_id"]), text=text,
            fact_type=payload.get("fact_type", "world"), context=context,
            occurred_start=_time(payload.get("occurred_start"), one),
            occurred_end=_time(payload.get("occurred_end"), one),
            mentioned_at=_time(mentioned, one), tags=tuple(payload.get("tags") or ()),
            metadata={same(str(k)): same(str(v)) for k, v in metadata.items()},
            document_id=same(payload.get("document_id", "")),
            chunk_id=chunk_id,
            entities=[one((i, n, lb), EntityRef(i, n, lb)) for i, n, lb in entities],
            embedding=[float(x) for x in vector] if vector is not None else [],
            links=[Link(t, same(k), float(w)) for t, k, w in links],
            item_index=int(item_index))
    return Fact(
        id=payload["id"],
        bank_id=payload["bank_id"],
        text=payload.get("text", ""),
        fact_type=payload.get("fact_type", "world"),
        context=payload.get("context", ""),
        occurred_start=from_epoch(payload.get("occurred_start")),
        occurred_end=from_epoch(payload.get("occurred_end")),
        mentioned_at=from_epoch(payload.get("mentioned_at")),
        tags=tuple(payload.get("tags") or ()),
        metadata={str(k): str(v) for k, v in (payload.get("metadata") or {}).items()},
        document_id=payload.get("document_id", ""),
        chunk_id=payload.get("chunk_id", ""),
        entities=[EntityRef(e["id"], e.get("name", ""), e.get("label", ""))
                  for e in payload.get("entities") or ()],
        embedding=[float(x) for x in vector] if vector is not None else [],
        links=[Link(lk["target_id"], lk.get("kind", ""), float(lk.get("weight", 1.0)))
               for lk in payload.get("links") or ()],
        item_index=int(payload.get("item_index", 0)),
    )


def _time(epoch: float | None, one: Callable[[Any, Any], Any]) -> datetime | None:
    # keyed by (tag, epoch): a float key must not meet an equal string or id
    return None if epoch is None else one(("t", epoch), from_epoch(epoch))


def point_id(fact_id: str) -> str:
    """Qdrant point id of a fact id: the id itself when it is a UUID (canonical form),
    else a uuid5 of it (Qdrant accepts only UUIDs and unsigned integers)."""
    try:
        return str(uuid.UUID(fact_id))
    except ValueError:
        return str(uuid.uuid5(uuid.NAMESPACE_URL, "mneme-fact:" + fact_id))


# ---- filters ----------------------------------------------------------------------------------


def _match(key: str, value: str) -> FieldCondition:
    return FieldCondition(key, match=MatchValue(value))


def qdrant_filter(bank_id: str, filters: Filters | None = None) -> Filter:
    """The Qdrant filter for ``bank_id`` plus ``filters`` (same semantics as
    :func:`mneme.stores.filters.fact_matches`, fully pushed down)."""
    must: list[Any] = [_match("bank_id", bank_id)]
    must_not: list[Any] = []
    f = filters or Filters()
    if f.types:
        must.append(FieldCondition("fact_type", match=MatchAny(list(f.types))))
    if f.document_id:
        must.append(_match("document_id", storable(f.document_id)))
    if f.tags_match not in TAGS_MATCH_MODES:
        raise ValueError(f"unknown tags_match mode {f.tags_match!r}")
    tags = sorted(set(f.tags))
    untagged = IsEmptyCondition("tags")
    if f.tags_match == "exact":
        if tags:
            must.extend(_match("tags", t) for t in tags)
            # "except T" matches a point holding any tag outside T
            must_not.append(FieldCondition("tags", match=MatchExcept(tags)))
        else:
            must.append(untagged)
    elif tags:
        any_of = FieldCondition("tags", match=MatchAny(tags))
        all_of = Filter(must=[_match("tags", t) for t in tags])
        if f.tags_match == "any":
            must.append(Filter(should=[any_of, untagged]))
        elif f.tags_match == "all":
            must.append(Filter(should=[all_of, untagged]))
        elif f.tags_match == "any_strict":
            must.append(any_of)
        else:  # all_strict
            must.append(all_of)
    if f.time_range is not None:
        must.extend(_overlap(to_epoch(f.time_range.start), to_epoch(f.time_range.end)))
    return Filter(must=must, must_not=must_not or None)


def _overlap(lo: float | None, hi: float | None) -> list[Any]:
    """Conditions for [s, e] ∩ [lo, hi] ≠ ∅, where a missing s (or e) is taken from the
    other end and a unit without any time never matches (TimeWindow.overlaps)."""
    start, end = "occurred_start", "occurred_end"
    conds: list[Any] = [Filter(should=[Filter(must_not=[IsEmptyCondition(start)]),
                                       Filter(must_not=[IsEmptyCondition(end)])])]
    if hi is not None:  # effective start <= hi
        conds.append(Filter(should=[
            FieldCondition(start, range=RangeFloat(lte=hi)),
            Filter(must=[IsEmptyCondition(start), FieldCondition(end, range=RangeFloat(lte=hi))]),
        ]))
    if lo is not None:  # effective end >= lo
        conds.append(Filter(should=[
            FieldCondition(end, range=RangeFloat(gte=lo)),
            Filter(must=[IsEmptyCondition(end), FieldCondition(start, range=RangeFloat(gte=lo))]),
        ]))
    return conds


# ---- the store --------------------------------------------------------------------------------


class EdgeVectorStore:
    """:class:`mneme.ports.VectorStore` over one Qdrant Edge shard in ``path``.

    ``dim`` is the embedding dimension (384 for all-MiniLM-L6-v2); distance is cosine, so
    stored vectors come back L2-normalised. A new shard stores them as float16
    (:data:`DATATYPE`; a shard made as float32 by an older version stays float32 until a
    replay builds a new one), so they come back within ~1e-3 of what was written. The
    shard is created when ``path`` holds none and loaded otherwise (creation, its payload indexes and :meth:`optimize` are flushed
    at once). A write is visible to reads when it returns but durable only after
    :meth:`flush` or :meth:`close` (an fsync: ~10 ms on a disk, so the consumers flush
    once per batch, before committing its offsets; a crash before then redelivers the
    records and their idempotent upserts are made again). All methods are serialised by
    one lock (thread-safe).

    Deletions are physical once :meth:`flush` returns: a flush after any deletion runs
    the vacuum (:meth:`purge`), which rebuilds the segments holding deleted points, so no
    file of the shard keeps their vectors or payloads. The shard keeps no write-ahead log
    (it would hold every upsert ever made); a shard made with one by an older version is
    copied once into one without, when opened.

    Every bank shares the shard and a fact's point id is its own id, so fact ids must be
    unique across banks (they are: uuid5 of the causing event and position).

    :meth:`get` without vectors keeps the last :attr:`cache_units` units it hydrated
    (LRU): recall hydrates ~130 candidates per query, and turning the binding's payloads
    into facts cost more than the rest of the vector arm. The shard is this process's
    own (the directory is opened by one process), so every write passes through here and
    drops the units it touches from the cache.

    For the same reason it keeps each bank's units by fact type as it writes
    (:class:`mneme.stores.unit_counts.UnitCounts`, saved in the shard's directory when it
    closes): :meth:`count` by type alone answers from them at any bank size.
    """

    #: Units kept hydrated by :meth:`get` (~1.9 KB each with the values they share).
    cache_units = 20_000

    def __init__(self, path: str, dim: int, index_every: int | None = INDEX_EVERY) -> None:
        if dim <= 0:
            raise ValueError(f"dim must be positive, got {dim}")
        if index_every is not None and index_every <= 0:
            raise ValueError(f"index_every must be positive or None, got {index_every}")
        self.path = os.path.abspath(path)
        self.dim = dim
        #: new points since the last optimize after which a flush optimizes
        #: (:data:`INDEX_EVERY`; None: only :meth:`purge` and :meth:`optimize` do)
        self.index_every = index_every
        self._lock = threading.RLock()
        self._dirty = False  # a write since the last flush
        self._deleted = False  # a deletion not purged yet (see purge)
        self._cache: OrderedDict[tuple[str, str], Fact] = OrderedDict()
        # values the cached facts share (see payload_to_fact)
        self._shared: dict[Any, Any] = {}
        self._shard: EdgeShard | None = self._open()
        # the shard's points at the last optimize (a shard written before INDEX_EVERY:
        # those it indexed, maybe none); replaced points are not new ones
        self._optimized_points = self._shard.info().indexed_vectors_count
        self._counts = self._open_counts()

    # -- lifecycle --

    def _config(self, wal: bool = False, datatype: VectorStorageDatatype | None = None,
                memory: Memory | None = VECTOR_MEMORY) -> EdgeConfig:
        return EdgeConfig(vectors=EdgeVectorParams(size=self.dim, distance=Distance.Cosine,
                                                   datatype=datatype or DATATYPE,
                                                   memory=memory),
                          optimizers=EdgeOptimizersConfig(**_PURGING_OPTIMIZERS,
                                                          **_SEGMENT_OPTIMIZERS),
                          wal_enabled=wal)

    def _open(self) -> EdgeShard:
        config_file = os.path.join(self.path, "edge_config.json")
        if os.path.exists(config_file) and _has_wal(config_file):
            self._drop_wal()
        if os.path.exists(config_file):
            # passing the config makes Edge check the stored vectors have our dimension
            try:
                datatype, memory = _stored_params(config_file)
                shard = EdgeShard.load(self.path, self._config(datatype=datatype,
                                                               memory=memory))
            except Exception as e:  # the binding raises a bare Exception
                if "ncompatible" in str(e):
                    raise ValueError(
                        f"shard at {self.path} does not fit dim={self.dim}: {e}") from e
                raise
        else:
            os.makedirs(self.path, exist_ok=True)
            shard = EdgeShard.create(self.path, self._config())
        have = set(shard.info().payload_schema)
        if "bank_id" not in have:
            shard.update(UpdateOperation.create_field_index(
                "bank_id", KeywordIndexParams(is_tenant=True)))
        for name in _KEYWORD_FIELDS:
            if name not in have:
                shard.update(UpdateOperation.create_field_index(name, PayloadSchemaType.Keyword))
        for name in _FLOAT_FIELDS:
            if name not in have:
                shard.update(UpdateOperation.create_field_index(name, PayloadSchemaType.Float))
        shard.flush()
        return shard

    def _drop_wal(self) -> None:
        """Copy a shard made with a write-ahead log (before deletions were physical) into
        one without, point by point with vectors and payloads, then put it in its place.
        The copy is complete before the swap, so a crash leaves either shard whole (a
        leftover copy is made again)."""
        tmp = self.path + ".nowal"
        shutil.rmtree(tmp, ignore_errors=True)
        old = EdgeShard.load(self.path, EdgeConfig(
            vectors=EdgeVectorParams(size=self.dim, distance=Distance.Cosine)))
        try:
            new = EdgeShard.create(tmp, self._config())
            offset, n = None, 0
            while True:
                records, offset = old.scroll(ScrollRequest(
                    offset=offset, limit=_SCROLL_BATCH, with_payload=True, with_vector=True))
                if records:
                    new.update(UpdateOperation.upsert_points(
                        [Point(r.id, r.vector, r.payload) for r in records]))
                    n += len(records)
                if offset is None:
                    break
            new.flush()
            new.close()
        finally:
            old.close()
        gone = self.path + ".wal-old"
        os.replace(self.path, gone)
        os.replace(tmp, self.path)
        shutil.rmtree(gone, ignore_errors=True)
        log.warning("vector store %s: copied %d points into a shard without write-ahead "
                    "log (deleted points are now purged from the files)", self.path, n)

    @property
    def shard(self) -> EdgeShard:
        if self._shard is None:
            raise RuntimeError("EdgeVectorStore is closed")
        return self._shard

    def flush(self) -> None:
        """Make every write so far durable (one fsync of the shard) and, after deletions,
        physical (:meth:`purge`); once the shard holds :attr:`index_every` more points than
        at the last optimize, index them (:meth:`optimize`, ~1.5 s per 20k points).
        Nothing when no write was made since the last flush, or once closed
        (:meth:`close` flushed them)."""
        with self._lock:
            if self._deleted and self._shard is not None:
                self.purge()
            if self._dirty and self._shard is not None:
                if self.index_every is not None and (self._shard.info().points_count
                                                     - self._optimized_points
                                                     >= self.index_every):
                    self.optimize()
                else:
                    self._shard.flush()
                    self._dirty = False

    def purge(self) -> bool:
        """Rebuild every segment holding a deleted point (Qdrant's vacuum, with the
        thresholds of :data:`_PURGING_OPTIMIZERS`) and flush, so no file keeps a deleted
        point's vector or payload; True if a segment was rebuilt. :meth:`flush` calls it
        after deletions: one purge covers every deletion since the last. It runs Qdrant's
        other optimizers too (an HNSW build when the new points grew past the indexing
        threshold: seconds at 20k points, then ~0.5 s per purge) and holds the lock."""
        return self.optimize()  # (Qdrant's optimize runs the vacuum with the rest)

    def close(self) -> None:
        """Flush (deletions purged), save the unit counts, and release the shard; further
        calls raise RuntimeError."""
        with self._lock:
            if self._shard is not None:
                if self._deleted:
                    self.purge()
                self._shard.flush()
                self._dirty = False
                self._save_counts()
                self._shard.close()
                self._shard = None
            self._cache.clear()
            self._shared.clear()

    def reset(self) -> None:
        """Drop every bank's points (the shard directory is recreated empty)."""
        with self._lock:
            if self._shard is None:
                raise RuntimeError("EdgeVectorStore is closed")
            self.close()  # (clears the cache)
            shutil.rmtree(self.path, ignore_errors=True)  # (the counts' file too)
            self._shard = self._open()
            self._optimized_points = 0
            self._counts = self._open_counts()

    def optimize(self) -> bool:
        """Build the HNSW index (and merge segments) for points added since the last
        call; True if anything changed. Qdrant Edge never does this by itself: until then
        new points are searched exhaustively (exact, ~5 ms per 30k 384-d points). The
        binding holds the GIL meanwhile (~1.5 s per 20k new points; a shard never
        optimized, all at once: 28 s at 100k), so :meth:`flush` calls it once per
        :attr:`index_every` points, not per request."""
        with self._lock:
            changed = bool(self.shard.optimize())
            self.shard.flush()  # every write so far, too
            self._dirty = self._deleted = False  # (the vacuum ran too)
            self._optimized_points = self.shard.info().points_count
            return changed

    # -- unit counts --

    def _open_counts(self) -> UnitCounts:
        return UnitCounts(os.path.join(self.path, COUNTS_FILE), self._stamp(),
                          self._count_bank)

    def _save_counts(self) -> None:
        """Save the unit counts with the stamp of the flushed shard; caller holds the
        lock, after a flush."""
        self._counts.save(self._stamp())

    def _stamp(self) -> list:
        """What the shard's files hold, as far as the counts care: its point total and
        each segment's saved version (Qdrant's ``segments/*/segment.json``; the version
        is the last operation the segment applied). Any write that reached the files,
        by this code or another, changes it."""
        root = os.path.join(self.path, "segments")
        segments = []
        for name in sorted(os.listdir(root)) if os.path.isdir(root) else ():
            try:
                with open(os.path.join(root, name, "segment.json"), encoding="utf-8") as fh:
                    segments.append([name, json.load(fh).get("version")])
            except (OSError, ValueError):
                segments.append([name, None])
        return [self.shard.info().points_count, segments]

    def _count_bank(self, bank_id: str) -> dict[str, int]:
        """The bank's units by fact type, counted in the shard (exact facet of the
        keyword index, linear in the bank; :class:`UnitCounts` asks once per bank).
        Points without a fact type count under :data:`UNTYPED`."""
        flt = qdrant_filter(bank_id)
        hits = self.shard.facet(FacetRequest("fact_type", limit=_TYPES_MAX + 1, exact=True,
                                             filter=flt)).hits
        counts: dict[str, int] = {}
        for h in hits:
            key = str(h.value) if h.value else UNTYPED
            counts[key] = counts.get(key, 0) + int(h.count)
        if len(hits) > _TYPES_MAX:  # (types beyond would count as untyped)
            raise RuntimeError(f"bank {bank_id} has over {_TYPES_MAX} fact types")
        untyped = int(self.shard.count(CountRequest(filter=flt, exact=True))) \
            - sum(counts.values())
        if untyped > 0:
            counts[UNTYPED] = counts.get(UNTYPED, 0) + untyped
        return counts

    def _stored_types(self, ids: Sequence[str]) -> list[tuple[str, str]]:
        """(bank, fact type) of each point among ``ids`` (point ids) the shard holds;
        caller holds the lock."""
        if not ids:
            return []
        records = self.shard.retrieve(list(ids), with_payload=["bank_id", "fact_type"],
                                      with_vector=False)
        return [(str(r.payload.get("bank_id", "")), _type_key(r.payload))
                for r in records if r.payload]

    def _check_room(self) -> None:
        """OSError(ENOSPC) when the shard's file system has less than
        :data:`MIN_FREE_BYTES` free (see there): refused before the shard writes."""
        st = os.statvfs(self.path)
        free = st.f_bavail * st.f_frsize
        if free < MIN_FREE_BYTES:
            raise OSError(errno.ENOSPC, f"no space left on device for the vector store: "
                          f"{free >> 20} MiB free in {self.path}, it writes with at least "
                          f"{MIN_FREE_BYTES >> 20} MiB free (Qdrant Edge's memory-mapped "
                          f"writes on a full disk kill the process)")

    def _update_counted(self, op, added: Iterable[tuple[str, str]],
                        removed: Iterable[tuple[str, str]]) -> None:
        """Apply ``op`` to the shard, then its effect to the counts: one unit more for
        each (bank, fact type) of ``added``, one fewer for each of ``removed``. Those
        banks are counted *before* the update when not yet known (so the load does not
        see it); when the update fails, their counts are forgotten, since a part of it
        may have been applied. Caller holds the lock."""
        by_bank: dict[str, Counter[str]] = {}
        for sign, units in ((1, added), (-1, removed)):
            for bank, fact_type in units:
                by_bank.setdefault(bank, Counter())[fact_type] += sign
        for bank in by_bank:
            self._counts.of(bank)
        self._check_room()
        try:
            self.shard.update(op)
        except BaseException:
            for bank in by_bank:
                self._counts.forget(bank)
            raise
        for bank, change in by_bank.items():
            self._counts.apply(bank, change)

    # -- writes --

    def upsert(self, facts: Sequence[Fact]) -> None:
        """Insert or replace ``facts`` by id. Each needs an embedding of ``dim`` floats
        (ValueError otherwise, before anything is written)."""
        points, keys = [], []
        new: dict[str, tuple[str, str]] = {}  # point id → (bank, type); the last one stored
        for fact in storable_facts(facts):  # the same text as every other store holds
            if len(fact.embedding) != self.dim:
                raise ValueError(f"fact {fact.id}: embedding has {len(fact.embedding)} "
                                 f"dimensions, the store expects {self.dim}")
            payload = fact_to_payload(fact)
            pid = point_id(fact.id)
            points.append(Point(pid, [float(x) for x in fact.embedding], payload))
            keys.append((fact.bank_id, fact.id))
            new[pid] = (fact.bank_id, _type_key(payload))
        if not points:
            return
        with self._lock:
            self._dirty = True  # set first: a failed update may have applied a part
            self._forget(keys)
            self._update_counted(UpdateOperation.upsert_points(points), new.values(),
                                 self._stored_types(list(new)))  # (the replaced points)

    def delete(self, bank_id: str, ids: Sequence[str]) -> None:
        """Delete the bank's facts with these ids (ids of other banks are left alone).
        Ids with no point change nothing, and leave no purge to make: a redelivered or
        repeated deletion (consolidation's retraction of observations search already
        dropped) costs a lookup, not a vacuum."""
        if not ids:
            return
        pids = {point_id(i) for i in ids}
        flt = Filter(must=[_match("bank_id", bank_id), HasIdCondition(pids)])
        with self._lock:
            gone = [t for b, t in self._stored_types(list(pids)) if b == bank_id]
            if not gone:
                return
            self._dirty = self._deleted = True
            self._forget(((bank_id, i) for i in ids), erased=True)
            self._update_counted(UpdateOperation.delete_points_by_filter(flt), (),
                                 [(bank_id, t) for t in gone])

    def delete_where(self, bank_id: str, document_id: str | None = None) -> list[str]:
        """Delete the bank's facts of ``document_id`` (all of the bank when None);
        returns the deleted fact ids. ValueError for "" (never means "the whole bank")."""
        check_document_id(document_id)
        document_id = storable(document_id)
        flt = qdrant_filter(bank_id, Filters(document_id=document_id) if document_id else None)
        with self._lock:
            found = self._scan(flt, payload=["id", "fact_type"])
            ids = [p["id"] for p in found]
            if ids:
                self._dirty = self._deleted = True
                self._forget(((bank_id, i) for i in ids), erased=True)
                self._update_counted(UpdateOperation.delete_points_by_filter(flt), (),
                                     [(bank_id, _type_key(p)) for p in found])
        return ids

    def _forget(self, keys, erased: bool = False) -> None:
        """Drop (bank_id, fact id) ``keys`` from the hydration cache; caller holds the lock.
        ``erased``: the facts are deleted, so the values shared with them (names, metadata)
        are dropped too, not kept in memory until the next bound is reached."""
        for k in keys:
            self._cache.pop(k, None)
        if erased:
            self._shared.clear()

    # -- reads --

    def search(self, bank_id: str, vector: Sequence[float], k: int,
               filters: Filters | None = None) -> list[Hit]:
        """kNN (HNSW, cosine) within the bank, best first; ``Hit.score`` is the cosine
        similarity in [-1, 1]. ValueError when ``vector`` has the wrong dimension."""
        if k <= 0:
            return []
        if len(vector) != self.dim:
            raise ValueError(f"query vector has {len(vector)} dimensions, expected {self.dim}")
        req = QueryRequest(limit=k, query=Query.Nearest([float(x) for x in vector]),
                           filter=qdrant_filter(bank_id, filters),
                           with_payload=["id"], with_vector=False)
        with self._lock:
            points = self.shard.query(req)
        return [Hit(p.payload["id"], float(p.score)) for p in points]

    def get(self, bank_id: str, ids: Sequence[str], with_vectors: bool = False) -> list[Fact]:
        """The bank's facts with these ids, in the order asked; unknown ids, ids of other
        banks and repeats are skipped. Embeddings only when ``with_vectors``."""
        if not ids:
            return []
        if with_vectors:
            with self._lock:
                records = self.shard.retrieve(list({point_id(i) for i in ids}),
                                              with_payload=True, with_vector=True)
            return facts_in_order(records, ids, bank_id, True)
        found: dict[str, Fact] = {}
        with self._lock:
            missing = []
            for i in dict.fromkeys(ids):
                f = self._cache.get((bank_id, i))
                if f is None:
                    missing.append(i)
                else:
                    self._cache.move_to_end((bank_id, i))
                    found[i] = f
            if missing:
                records = self.shard.retrieve([point_id(i) for i in missing],
                                              with_payload=True, with_vector=False)
                if len(self._shared) > 4 * self.cache_units:
                    self._shared.clear()  # bounded; cached facts keep what they share
                for f in facts_in_order(records, missing, bank_id, False, self._shared):
                    found[f.id] = self._cache[(bank_id, f.id)] = f
                while len(self._cache) > self.cache_units:
                    self._cache.popitem(last=False)
        # copies: a caller that sets a field must not change what the next caller gets
        return [copy.copy(found[i]) for i in dict.fromkeys(ids) if i in found]

    def scroll(self, bank_id: str, limit: int, after: str | None = None,
               filters: Filters | None = None) -> tuple[list[Fact], str | None]:
        """One page of at most ``limit`` facts of the bank matching ``filters``, in point-id
        order; returns (page, cursor), cursor None on the last page. Pass the cursor back
        as ``after`` for the next page; ValueError for a cursor this store did not make."""
        if limit <= 0:
            raise ValueError("limit must be positive")
        req = ScrollRequest(offset=_decode_cursor(after) if after else None, limit=limit,
                            filter=qdrant_filter(bank_id, filters), with_payload=True,
                            with_vector=False)
        with self._lock:
            records, nxt = self.shard.scroll(req)
        page = [payload_to_fact(r.payload) for r in records]
        return page, (_encode_cursor(str(nxt)) if nxt is not None else None)

    def count(self, bank_id: str, filters: Filters | None = None) -> int:
        """Number of the bank's units matching ``filters`` (all when None), exact. By
        fact type alone (or no filter) it is the kept count (a dict lookup; the first
        call for a bank this store has not counted yet walks it once); other filters
        count in the shard, linear in the bank."""
        with self._lock:
            self.shard  # (RuntimeError once closed, as for every other call)
            if _types_only(filters):
                return self._counts.total(bank_id, filters.types if filters else ())
            return int(self.shard.count(CountRequest(filter=qdrant_filter(bank_id, filters),
                                                     exact=True)))

    def facet(self, bank_id: str, key: str, limit: int,
              filters: Filters | None = None) -> list[tuple[str, int]]:
        """The distinct values of ``key`` (:data:`FACET_KEYS`) among the bank's units
        matching ``filters``, with their unit counts: at most ``limit``, most units first
        (ties by value). Exact counts, from the field's keyword index."""
        check_facet(key, limit)
        with self._lock:
            hits = self.shard.facet(FacetRequest(key, limit=int(limit) + 1, exact=True,
                                                 filter=qdrant_filter(bank_id, filters))).hits
        return facet_pairs(hits, limit)

    def _scan(self, flt: Filter, payload: list[str]) -> list[dict[str, Any]]:
        """Every matching point's (partial) payload; caller holds the lock."""
        out: list[dict[str, Any]] = []
        offset = None
        while True:
            records, offset = self.shard.scroll(ScrollRequest(
                offset=offset, limit=_SCROLL_BATCH, filter=flt, with_payload=payload,
                with_vector=False))
            out.extend(r.payload for r in records)
            if offset is None:
                return out


#: Most distinct fact types one bank's count expects (there are four).
_TYPES_MAX = 64


def _type_key(payload: dict[str, Any]) -> str:
    """The fact type a payload counts under (:data:`UNTYPED` for none or empty)."""
    return str(payload.get("fact_type") or UNTYPED)


def _types_only(filters: Filters | None) -> bool:
    """Whether ``filters`` narrows by fact type alone (None: not at all), so the kept
    unit counts answer it. (``exact`` with no tags means "untagged": a real filter.)"""
    f = filters or Filters()
    return f.tags_match in TAGS_MATCH_MODES and not (
        f.tags or f.tags_match == "exact" or f.time_range is not None or f.document_id)


def _has_wal(config_file: str) -> bool:
    """Whether the shard whose ``edge_config.json`` this is keeps a write-ahead log
    (Qdrant Edge's default, so a config without the key has one)."""
    with open(config_file) as f:
        return json.load(f).get("wal_enabled", True) is not False


def _encode_cursor(pid: str) -> str:
    return base64.urlsafe_b64encode(pid.encode()).decode().rstrip("=")


def _decode_cursor(cursor: str) -> str:
    try:
        pid = base64.urlsafe_b64decode(cursor + "=" * (-len(cursor) % 4)).decode()
        return str(uuid.UUID(pid))
    except (ValueError, UnicodeDecodeError) as e:
        raise ValueError(f"invalid scroll cursor {cursor!r}") from e


def facts_in_order(records, ids: Sequence[str], bank_id: str, with_vectors: bool,
                   shared: dict[Any, Any] | None = None) -> list[Fact]:
    """Retrieved point records (``.payload``, ``.vector``) → the bank's facts in the order
    of ``ids``, each once; records of another bank are dropped (ids are global).
    ``shared``: as for :func:`payload_to_fact`."""
    by_id = {r.payload["id"]: r for r in records
             if r.payload and r.payload.get("bank_id") == bank_id}
    out, seen = [], set()
    for i in ids:
        r = by_id.get(i)
        if r is not None and i not in seen:
            seen.add(i)
            out.append(payload_to_fact(r.payload, r.vector if with_vectors else None, shared))
    return out
