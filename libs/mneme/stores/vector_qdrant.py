"""Vector store over a Qdrant server (``qdrant-client``), the production twin of
:mod:`mneme.stores.vector_edge`.

One collection holds every bank (Qdrant's multitenancy pattern): ``bank_id`` is a keyword
payload index marked ``is_tenant`` and every request is filtered by it; the collection's
HNSW graph is built per tenant (``m=0, payload_m=16``) since no query ever spans banks.
Payloads, point ids and scroll cursors are the Edge adapter's (same helpers), so a fact
reads back identically from either store.

URLs (see :func:`mneme.stores.open_vector_store`)::

    http://host:6333  https://host:6333      REST (``?api_key=…&collection=…&prefer_grpc=1``)
    qdrant://host:6333  qdrants://host:6333  the same, http / https
    qdrant-local:///abs/dir                  qdrant-client local mode (tests and dev only)

Local mode (``QdrantClient(path=…)``) is a pure-Python re-implementation: it accepts but
ignores payload indexes (``is_tenant`` included) and HNSW settings (every search is an
exact scan), and allows one client per directory. It is what the contract suite runs here.
"""

from __future__ import annotations

import contextlib
import threading
import warnings
from typing import Any, Sequence
from urllib.parse import parse_qs, unquote, urlsplit

from qdrant_client import QdrantClient, models as m

from mneme.domain import Fact, Filters, Hit, to_epoch
from mneme.stores.filters import TAGS_MATCH_MODES, check_document_id
from mneme.stores.storable import storable, storable_facts
from mneme.stores.vector_edge import (
    _FLOAT_FIELDS,
    _KEYWORD_FIELDS,
    _decode_cursor,
    _encode_cursor,
    check_facet,
    facet_pairs,
    fact_to_payload,
    facts_in_order,
    payload_to_fact,
    point_id,
)

COLLECTION = "mneme_facts"
#: Points per upsert request (keeps request bodies to a few MB at 384 dims).
UPSERT_BATCH = 256
_SCROLL_BATCH = 256


# ---- filters (qdrant-client models; same semantics as vector_edge.qdrant_filter) ---------------


def _match(key: str, value: str) -> m.FieldCondition:
    return m.FieldCondition(key=key, match=m.MatchValue(value=value))


def _empty(key: str) -> m.IsEmptyCondition:
    # Qdrant's "is empty": field missing, null or [] (so None times and no tags match)
    return m.IsEmptyCondition(is_empty=m.PayloadField(key=key))


def _range(key: str, gte: float | None = None, lte: float | None = None) -> m.FieldCondition:
    return m.FieldCondition(key=key, range=m.Range(gte=gte, lte=lte))


def client_filter(bank_id: str, filters: Filters | None = None) -> m.Filter:
    """The ``qdrant_client`` filter for ``bank_id`` plus ``filters``: the same tree as
    :func:`mneme.stores.vector_edge.qdrant_filter` (which builds Edge's binding types),
    fully pushed down with the semantics of :func:`mneme.stores.filters.fact_matches`.
    ValueError for an unknown ``tags_match``."""
    must: list[Any] = [_match("bank_id", bank_id)]
    must_not: list[Any] = []
    f = filters or Filters()
    if f.types:
        must.append(m.FieldCondition(key="fact_type", match=m.MatchAny(any=list(f.types))))
    if f.document_id:
        must.append(_match("document_id", storable(f.document_id)))
    if f.tags_match not in TAGS_MATCH_MODES:
        raise ValueError(f"unknown tags_match mode {f.tags_match!r}")
    tags = sorted(set(f.tags))
    if f.tags_match == "exact":
        if tags:
            must.extend(_match("tags", t) for t in tags)
            # "except T" matches a point holding any tag outside T
            must_not.append(m.FieldCondition(key="tags", match=m.MatchExcept(**{"except": tags})))
        else:
            must.append(_empty("tags"))
    elif tags:
        any_of = m.FieldCondition(key="tags", match=m.MatchAny(any=tags))
        all_of = m.Filter(must=[_match("tags", t) for t in tags])
        if f.tags_match == "any":
            must.append(m.Filter(should=[any_of, _empty("tags")]))
        elif f.tags_match == "all":
            must.append(m.Filter(should=[all_of, _empty("tags")]))
        elif f.tags_match == "any_strict":
            must.append(any_of)
        else:  # all_strict
            must.append(all_of)
    if f.time_range is not None:
        must.extend(_overlap(to_epoch(f.time_range.start), to_epoch(f.time_range.end)))
    return m.Filter(must=must, must_not=must_not or None)


def _overlap(lo: float | None, hi: float | None) -> list[Any]:
    """[s, e] ∩ [lo, hi] ≠ ∅ where a missing s (or e) is taken from the other end and a
    unit without any time never matches (:meth:`mneme.domain.TimeWindow.overlaps`)."""
    start, end = "occurred_start", "occurred_end"
    conds: list[Any] = [m.Filter(should=[m.Filter(must_not=[_empty(start)]),
                                         m.Filter(must_not=[_empty(end)])])]
    if hi is not None:  # effective start <= hi
        conds.append(m.Filter(should=[
            _range(start, lte=hi), m.Filter(must=[_empty(start), _range(end, lte=hi)])]))
    if lo is not None:  # effective end >= lo
        conds.append(m.Filter(should=[
            _range(end, gte=lo), m.Filter(must=[_empty(end), _range(start, gte=lo)])]))
    return conds


# ---- URLs -------------------------------------------------------------------------------------


def parse_qdrant_url(url: str) -> dict[str, Any]:
    """Keyword arguments of :class:`QdrantVectorStore` for a store URL.

    ``http(s)://[api_key@]host[:port][/prefix][?api_key=…&collection=…&prefer_grpc=1&timeout=s]``,
    ``qdrant://`` (= http) and ``qdrants://`` (= https) with the same parts, or
    ``qdrant-local:///abs/dir`` (local mode). Returns ``{"url": …}`` or ``{"path": …}``
    plus any of ``prefix``, ``api_key``, ``collection``, ``prefer_grpc``, ``timeout``.
    ValueError for another scheme, a missing host or an unknown query parameter.
    """
    parts = urlsplit(url)
    scheme = parts.scheme.lower()
    query = {k: v[-1] for k, v in parse_qs(parts.query, keep_blank_values=True).items()}
    unknown = set(query) - {"api_key", "collection", "prefer_grpc", "timeout"}
    if unknown:
        raise ValueError(f"vector store URL {url!r}: unknown parameter(s) {sorted(unknown)}")
    out: dict[str, Any] = {}
    if scheme == "qdrant-local":
        from mneme.stores import _local_path
        out["path"] = _local_path(url.split("?", 1)[0])
    elif scheme in ("http", "https", "qdrant", "qdrants"):
        if not parts.hostname:
            raise ValueError(f"vector store URL {url!r} needs a host")
        http = {"qdrant": "http", "qdrants": "https"}.get(scheme, scheme)
        host = f"[{parts.hostname}]" if ":" in parts.hostname else parts.hostname
        out["url"] = f"{http}://{host}:{parts.port or 6333}"
        if parts.path.strip("/"):  # Qdrant behind a reverse proxy under a path
            out["prefix"] = "/" + parts.path.strip("/")
        if parts.username:  # http://KEY@host:6333 — the API key as user info
            out["api_key"] = unquote(parts.username)
    else:
        raise ValueError(f"not a Qdrant URL: {url!r}")
    if query.get("api_key"):
        out["api_key"] = query["api_key"]
    if query.get("collection"):
        out["collection"] = query["collection"]
    if "prefer_grpc" in query:
        out["prefer_grpc"] = query["prefer_grpc"].lower() in ("1", "true", "yes", "")
    if query.get("timeout"):
        out["timeout"] = int(float(query["timeout"]))
    return out


# ---- the store --------------------------------------------------------------------------------


class QdrantVectorStore:
    """:class:`mneme.ports.VectorStore` over one Qdrant collection.

    Give ``url`` (a server: ``http://host:6333``) or ``path`` (local mode) or a ready
    ``client``. ``dim`` is the embedding dimension; distance is cosine, so ``Hit.score``
    is the cosine similarity and stored vectors come back L2-normalised. The collection
    and its payload indexes are created when missing (a concurrent creator is tolerated);
    an existing collection of another dimension or distance → ValueError.

    Every write waits until the server has applied it (``wait=True``), so it is durable
    (in the server's WAL) and visible to reads on return. Server mode is thread-safe
    without a lock (the HTTP client pools connections); local mode is serialised by one.
    Fact ids must be unique across banks (point ids are derived from them alone).
    """

    def __init__(self, dim: int, *, url: str | None = None, path: str | None = None,
                 api_key: str | None = None, collection: str = COLLECTION,
                 prefer_grpc: bool = False, timeout: int | None = None,
                 prefix: str | None = None, client: QdrantClient | None = None) -> None:
        if dim <= 0:
            raise ValueError(f"dim must be positive, got {dim}")
        if sum(x is not None for x in (url, path, client)) != 1:
            raise ValueError("give exactly one of url, path or client")
        self.dim = dim
        self.collection = collection
        self.local = path is not None or (client is not None and _is_local(client))
        self._client: QdrantClient | None = client or (
            QdrantClient(path=path) if path is not None else
            QdrantClient(url=url, api_key=api_key, prefer_grpc=prefer_grpc, timeout=timeout,
                         prefix=prefix))
        # local mode is plain Python over shared dicts: serialise it
        self._lock: Any = threading.RLock() if self.local else contextlib.nullcontext()
        try:
            self._ensure_collection()
        except BaseException:
            self.close()  # release the pool (or local mode's directory lock)
            raise

    @classmethod
    def from_url(cls, url: str, dim: int) -> "QdrantVectorStore":
        """The store for a URL of :func:`parse_qdrant_url`'s forms."""
        return cls(dim, **parse_qdrant_url(url))

    @property
    def client(self) -> QdrantClient:
        if self._client is None:
            raise RuntimeError("QdrantVectorStore is closed")
        return self._client

    # -- lifecycle --

    def _ensure_collection(self) -> None:
        c, name = self.client, self.collection
        if not c.collection_exists(name):
            try:
                c.create_collection(
                    name,
                    vectors_config=m.VectorParams(size=self.dim, distance=m.Distance.COSINE),
                    # per-tenant HNSW graphs only: every query is filtered by bank_id
                    hnsw_config=m.HnswConfigDiff(m=0, payload_m=16),
                )
            except Exception:
                if not c.collection_exists(name):  # else another process won the race
                    raise
        params = c.get_collection(name).config.params.vectors
        if isinstance(params, m.VectorParams) and (
                params.size != self.dim or params.distance != m.Distance.COSINE):
            raise ValueError(f"collection {name!r} holds {params.size}-d {params.distance} "
                             f"vectors; this store needs dim={self.dim}, cosine")
        self._ensure_indexes()

    def _ensure_indexes(self) -> None:
        c, name = self.client, self.collection
        have = set(c.get_collection(name).payload_schema or {})
        # bank_id: the tenant, with its own HNSW graph per value (payload_m). The filter
        # fields narrow a search inside one bank; extra graphs per document id or tag
        # would cost memory and indexing time for nothing, hence enable_hnsw=False.
        wanted: list[tuple[str, Any]] = [
            ("bank_id", m.KeywordIndexParams(type=m.KeywordIndexType.KEYWORD, is_tenant=True))]
        wanted += [(f, m.KeywordIndexParams(type=m.KeywordIndexType.KEYWORD, enable_hnsw=False))
                   for f in _KEYWORD_FIELDS]
        wanted += [(f, m.FloatIndexParams(type=m.FloatIndexType.FLOAT, enable_hnsw=False))
                   for f in _FLOAT_FIELDS]
        with warnings.catch_warnings():
            # local mode warns that it ignores payload indexes; we know (module doc)
            warnings.filterwarnings("ignore", message="Payload indexes have no effect")
            for field_name, schema in wanted:
                if field_name not in have:
                    c.create_payload_index(name, field_name, field_schema=schema, wait=True)

    def close(self) -> None:
        """Release the client (local mode: the directory lock); further calls raise
        RuntimeError. Idempotent."""
        with self._lock:
            if self._client is not None:
                client, self._client = self._client, None
                client.close()

    def flush(self) -> None:
        """No-op: every write returns once the server has applied it (``wait=True``:
        in its WAL), and local mode persists each write before it returns."""

    def reset(self) -> None:
        """Drop every bank's points: the collection is deleted and recreated empty."""
        with self._lock:
            self.client.delete_collection(self.collection)
            self._ensure_collection()

    def drop(self) -> None:
        """Delete the collection (an old store generation); the store is unusable after."""
        with self._lock:
            self.client.delete_collection(self.collection)

    # -- writes --

    def upsert(self, facts: Sequence[Fact]) -> None:
        """Insert or replace ``facts`` by id. Each needs an embedding of ``dim`` floats
        (ValueError otherwise, before anything is written)."""
        points = []
        for fact in storable_facts(facts):  # the same text as every other store holds
            if len(fact.embedding) != self.dim:
                raise ValueError(f"fact {fact.id}: embedding has {len(fact.embedding)} "
                                 f"dimensions, the store expects {self.dim}")
            points.append(m.PointStruct(id=point_id(fact.id),
                                        vector=[float(x) for x in fact.embedding],
                                        payload=fact_to_payload(fact)))
        with self._lock:
            for i in range(0, len(points), UPSERT_BATCH):
                self.client.upsert(self.collection, points=points[i:i + UPSERT_BATCH],
                                   wait=True)

    def _delete_by_filter(self, flt: m.Filter) -> None:
        self.client.delete(self.collection, points_selector=m.FilterSelector(filter=flt),
                           wait=True)

    def delete(self, bank_id: str, ids: Sequence[str]) -> None:
        """Delete the bank's facts with these ids (ids of other banks are left alone)."""
        if not ids:
            return
        flt = m.Filter(must=[_match("bank_id", bank_id),
                             m.HasIdCondition(has_id=sorted({point_id(i) for i in ids}))])
        with self._lock:
            self._delete_by_filter(flt)

    def delete_where(self, bank_id: str, document_id: str | None = None) -> list[str]:
        """Delete the bank's facts of ``document_id`` (all of the bank when None);
        returns the deleted fact ids. ValueError for "" (never means "the whole bank")."""
        check_document_id(document_id)
        document_id = storable(document_id)
        flt = client_filter(bank_id, Filters(document_id=document_id) if document_id else None)
        with self._lock:
            ids = [p["id"] for p in self._scan(flt, payload=["id"])]
            if ids:
                self._delete_by_filter(flt)
        return ids

    # -- reads --

    def search(self, bank_id: str, vector: Sequence[float], k: int,
               filters: Filters | None = None) -> list[Hit]:
        """kNN (cosine) within the bank, best first; ``Hit.score`` is the cosine
        similarity in [-1, 1]. ValueError when ``vector`` has the wrong dimension."""
        if k <= 0:
            return []
        if len(vector) != self.dim:
            raise ValueError(f"query vector has {len(vector)} dimensions, expected {self.dim}")
        with self._lock:
            points = self.client.query_points(
                self.collection, query=[float(x) for x in vector], limit=k,
                query_filter=client_filter(bank_id, filters), with_payload=["id"],
                with_vectors=False).points
        return [Hit(p.payload["id"], float(p.score)) for p in points]

    def get(self, bank_id: str, ids: Sequence[str], with_vectors: bool = False) -> list[Fact]:
        """The bank's facts with these ids, in the order asked; unknown ids, ids of other
        banks and repeats are skipped. Embeddings only when ``with_vectors``."""
        if not ids:
            return []
        with self._lock:
            records = self.client.retrieve(self.collection, ids=sorted({point_id(i) for i in ids}),
                                           with_payload=True, with_vectors=with_vectors)
        return facts_in_order(records, ids, bank_id, with_vectors)

    def scroll(self, bank_id: str, limit: int, after: str | None = None,
               filters: Filters | None = None) -> tuple[list[Fact], str | None]:
        """One page of at most ``limit`` facts of the bank matching ``filters``, in point-id
        order; returns (page, cursor), cursor None on the last page. Cursors are the Edge
        adapter's (opaque strings); ValueError for one this store did not make."""
        if limit <= 0:
            raise ValueError("limit must be positive")
        offset = _decode_cursor(after) if after else None
        with self._lock:
            records, nxt = self.client.scroll(
                self.collection, scroll_filter=client_filter(bank_id, filters), limit=limit,
                offset=offset, with_payload=True, with_vectors=False)
        page = [payload_to_fact(r.payload) for r in records]
        return page, (_encode_cursor(str(nxt)) if nxt is not None else None)

    def count(self, bank_id: str, filters: Filters | None = None) -> int:
        """Number of the bank's units matching ``filters`` (all when None), exact."""
        with self._lock:
            return int(self.client.count(self.collection,
                                         count_filter=client_filter(bank_id, filters),
                                         exact=True).count)

    def facet(self, bank_id: str, key: str, limit: int,
              filters: Filters | None = None) -> list[tuple[str, int]]:
        """The distinct values of ``key`` (``tags`` or ``document_id``) among the bank's
        units matching ``filters``, with their unit counts: at most ``limit``, most units
        first (ties by value). Exact counts (Qdrant's facet API, keyword index)."""
        check_facet(key, limit)
        with self._lock:
            hits = self.client.facet(self.collection, key, facet_filter=client_filter(
                bank_id, filters), limit=int(limit) + 1, exact=True).hits
        return facet_pairs(hits, limit)

    def _scan(self, flt: m.Filter, payload: list[str]) -> list[dict[str, Any]]:
        """Every matching point's (partial) payload; caller holds the lock."""
        out: list[dict[str, Any]] = []
        offset = None
        while True:
            records, offset = self.client.scroll(
                self.collection, scroll_filter=flt, limit=_SCROLL_BATCH, offset=offset,
                with_payload=payload, with_vectors=False)
            out.extend(r.payload for r in records)
            if offset is None:
                return out


def _is_local(client: QdrantClient) -> bool:
    # QdrantLocal is the in-process implementation behind QdrantClient(path=/":memory:")
    return type(getattr(client, "_client", None)).__name__ == "QdrantLocal"
