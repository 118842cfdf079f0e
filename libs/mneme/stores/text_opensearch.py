"""BM25 text store over OpenSearch (``opensearch-py``), the production twin of
:mod:`mneme.stores.text_tantivy`.

One index holds every bank, so BM25's statistics (document frequencies, average length)
are shared by the banks: a bank's keyword ranking changes when another bank is written,
and its scores tell how common a word is in other banks. With ``per_bank`` (URL
``?per_bank=1``) every bank has an index of its own, ``<index>-<bank_id>``, created on
its first write and deleted with the bank: the statistics are the bank's own (as in the
Tantivy adapter), at the cost of one index per bank: one primary shard, and a replica
where there is a second node (``auto_expand_replicas: 0-1``), which OpenSearch counts
against ``cluster.max_shards_per_node`` (1,000 by default). The settings and mappings are
installed as an index template (so an index re-created by an operator or by
auto-creation gets them too) and given explicitly when the store creates an index: ``text`` is analysed with
:data:`ANALYZER` -- the built-in ``english`` analyzer's chain (standard tokenizer,
possessive stemmer, lowercase, English stop words, Porter stemmer) with ``cjk_width`` and
``cjk_bigram`` added -- after the client has segmented it with :func:`mneme.cjk.segment`
(CJK runs as space-separated character bigrams, other text unchanged). The standard
tokenizer splits a Han bigram into its two characters and ``cjk_bigram`` joins them again,
so every CJK token is the bigram the Tantivy adapter indexes, on OpenSearch and on test
stand-ins whose ``cjk_bigram`` skips Hangul or Katakana alike. An index created before
(``english`` analyzer) keeps working for Latin-script text; a warning says that
``mneme replay`` (which drops and recreates the index) makes its CJK text searchable. The
filter fields are ``keyword``/numeric and queried in filter context, so they never
change ``Hit.score``, which is the pure BM25 score. Documents are routed by ``bank_id``
(one bank's documents share a shard) and their ``_id`` is ``"{bank_id}:{fact_id}"``.

The user's text only ever goes into a ``match`` query (no query-string syntax, so nothing
raises on odd input), capped to :data:`MAX_QUERY_WORDS` words / :data:`MAX_QUERY_CHARS`
characters to stay under OpenSearch's 1024-clause limit. Writes use
``refresh=wait_for`` (``refresh=true`` for delete-by-query), so they are searchable
on return.

URLs: ``http(s)://[user:password@]host[:9200][/prefix][?index=…&per_bank=1&verify_certs=0]``.
"""

from __future__ import annotations

import logging
import re

from typing import Any, Sequence
from urllib.parse import parse_qs, unquote, urlsplit

from opensearchpy import OpenSearch
from opensearchpy.exceptions import NotFoundError, RequestError

from mneme.cjk import segment
from mneme.domain import BANK_ID_RE, Fact, Filters, Hit, to_epoch
from mneme.retrieval import QUERY_STOP_WORDS
from mneme.stores.filters import TAGS_MATCH_MODES, check_document_id
from mneme.stores.storable import storable, storable_facts

INDEX = "mneme-facts"
#: Query text beyond this many words / characters is ignored (like Tantivy's 64 terms);
#: 1024 characters make at most ~512 tokens, under the default max_clause_count of 1024.
MAX_QUERY_WORDS = 64
MAX_QUERY_CHARS = 1024
#: Extra hits fetched so ties can be broken by id (see ``search``).
_TIE_SLACK = 32
_MAX_WINDOW = 10_000  # index.max_result_window default
log = logging.getLogger(__name__)

#: Name of the text analyzer defined in :data:`SETTINGS`.
ANALYZER = "mneme_text"

MAPPINGS: dict[str, Any] = {
    "dynamic": "strict",  # a typo'd field fails loudly instead of growing the mapping
    "_source": {"enabled": True},
    "properties": {
        "id": {"type": "keyword"},
        "bank_id": {"type": "keyword"},
        "text": {"type": "text", "analyzer": ANALYZER},
        "fact_type": {"type": "keyword"},
        "document_id": {"type": "keyword"},
        "tags": {"type": "keyword"},
        "n_tags": {"type": "integer"},  # distinct tags: 0 selects untagged, n for "exact"
        # effective bounds: a missing end is taken from the other (TimeWindow.overlaps)
        "occurred_start": {"type": "double"},
        "occurred_end": {"type": "double"},
    },
}
#: One primary shard; a replica only where there is a node to hold it (a single node
#: would count an unassignable replica against ``cluster.max_shards_per_node``).
SETTINGS: dict[str, Any] = {"index": {"number_of_shards": 1, "auto_expand_replicas": "0-1"},
                            "analysis": {
    "filter": {
        "mneme_possessive": {"type": "stemmer", "language": "possessive_english"},
        "mneme_stop": {"type": "stop", "stopwords": "_english_"},
        "mneme_stem": {"type": "stemmer", "language": "english"},
    },
    "analyzer": {ANALYZER: {
        "type": "custom", "tokenizer": "standard",
        "filter": ["cjk_width", "mneme_possessive", "lowercase", "cjk_bigram", "mneme_stop",
                   "mneme_stem"]}},
}}


def parse_opensearch_url(url: str) -> dict[str, Any]:
    """Keyword arguments of :class:`OpenSearchTextStore` for
    ``http(s)://[user:password@]host[:port][/prefix][?index=name&per_bank=0|1&verify_certs=0|1]``
    (port 9200 when absent). ValueError for another scheme, no host or an unknown
    parameter."""
    parts = urlsplit(url)
    scheme = parts.scheme.lower()
    if scheme not in ("http", "https") or not parts.hostname:
        raise ValueError(f"not an OpenSearch URL (http(s)://host:9200): {url!r}")
    query = {k: v[-1] for k, v in parse_qs(parts.query, keep_blank_values=True).items()}
    unknown = set(query) - {"index", "verify_certs", "per_bank"}
    if unknown:
        raise ValueError(f"text store URL {url!r}: unknown parameter(s) {sorted(unknown)}")
    host: dict[str, Any] = {"host": parts.hostname, "port": parts.port or 9200,
                            "scheme": scheme}
    if parts.path.strip("/"):  # OpenSearch behind a reverse proxy under a path
        host["url_prefix"] = "/" + parts.path.strip("/")
    out: dict[str, Any] = {"hosts": [host]}
    if parts.username:
        out["http_auth"] = (unquote(parts.username), unquote(parts.password or ""))
    if query.get("index"):
        out["index"] = query["index"]
    if "per_bank" in query:
        out["per_bank"] = _flag(url, "per_bank", query["per_bank"])
    if scheme == "https":
        out["verify_certs"] = query.get("verify_certs", "1").lower() not in ("0", "false", "no")
    return out


def _flag(url: str, name: str, value: str) -> bool:
    if value.lower() in ("1", "true", "yes"):
        return True
    if value.lower() in ("0", "false", "no", ""):
        return False
    raise ValueError(f"text store URL {url!r}: {name} must be 0 or 1, got {value!r}")


_QUERY_STOP = frozenset(QUERY_STOP_WORDS)


def clip_query(text: str) -> str:
    """The part of free ``text`` that is searched: at most :data:`MAX_QUERY_CHARS`
    characters and :data:`MAX_QUERY_WORDS` distinct whitespace-separated words."""
    words = list(dict.fromkeys(text[:MAX_QUERY_CHARS].split()))
    return " ".join(words[:MAX_QUERY_WORDS])


def filter_clauses(bank_id: str, filters: Filters | None) -> list[dict[str, Any]]:
    """Filter-context clauses for the bank and ``filters``: every field pushed down, with
    the semantics of :func:`mneme.stores.filters.fact_matches` (``exact`` tags via
    ``n_tags``; untagged units via ``n_tags = 0``). ValueError for an unknown mode."""
    f = filters or Filters()
    clauses: list[dict[str, Any]] = [{"term": {"bank_id": bank_id}}]
    if f.types:
        clauses.append({"terms": {"fact_type": list(f.types)}})
    if f.document_id:
        clauses.append({"term": {"document_id": storable(f.document_id)}})
    if f.tags_match not in TAGS_MATCH_MODES:
        raise ValueError(f"unknown tags_match mode {f.tags_match!r}")
    tags = sorted(set(f.tags))
    untagged = {"term": {"n_tags": 0}}
    all_of = [{"term": {"tags": t}} for t in tags]
    if f.tags_match == "exact":
        clauses.extend(all_of)
        clauses.append({"term": {"n_tags": len(tags)}})
    elif tags:
        any_of = {"terms": {"tags": tags}}
        if f.tags_match == "any":
            clauses.append(_either(any_of, untagged))
        elif f.tags_match == "all":
            clauses.append(_either({"bool": {"filter": all_of}}, untagged))
        elif f.tags_match == "any_strict":
            clauses.append(any_of)
        else:  # all_strict
            clauses.extend(all_of)
    if f.time_range is not None:
        lo, hi = to_epoch(f.time_range.start), to_epoch(f.time_range.end)
        # a unit without times has neither field, so it never matches a time range
        clauses.append({"exists": {"field": "occurred_start"}})
        if hi is not None:
            clauses.append({"range": {"occurred_start": {"lte": hi}}})
        if lo is not None:
            clauses.append({"range": {"occurred_end": {"gte": lo}}})
    return clauses


def _either(a: dict[str, Any], b: dict[str, Any]) -> dict[str, Any]:
    return {"bool": {"should": [a, b], "minimum_should_match": 1}}


def fact_document(fact: Fact) -> dict[str, Any]:
    """The indexed ``_source`` of ``fact``: its text segmented (:func:`mneme.cjk.segment`),
    times as effective epoch-second bounds (absent when the fact has none)."""
    tags = sorted(set(fact.tags))
    doc: dict[str, Any] = {"id": fact.id, "bank_id": fact.bank_id, "text": segment(fact.text),
                           "fact_type": fact.fact_type, "document_id": fact.document_id,
                           "tags": tags, "n_tags": len(tags)}
    start, end = to_epoch(fact.occurred_start), to_epoch(fact.occurred_end)
    if start is not None or end is not None:
        doc["occurred_start"] = start if start is not None else end
        doc["occurred_end"] = end if end is not None else start
    return doc


class OpenSearchTextStore:
    """:class:`mneme.ports.TextStore` over one OpenSearch index (``index``), or with
    ``per_bank`` one index per bank (``<index>-<bank_id>``; see the module docs), reached
    at ``hosts`` (opensearch-py host dicts) or through a ready ``client``.

    The template and the index (a bank's index: on its first write, and again when a
    write finds it deleted by another replica) are created when missing (a concurrent
    creator is tolerated). Errors of the cluster surface as ``opensearchpy`` exceptions
    (``ConnectionError``, ``TransportError``); a bulk write with failed items raises
    RuntimeError naming the first failure. Thread-safe (the client pools connections).
    """

    def __init__(self, *, hosts: list[dict[str, Any]] | None = None, index: str = INDEX,
                 http_auth: tuple[str, str] | None = None, verify_certs: bool = True,
                 client: OpenSearch | None = None, timeout: float = 30.0,
                 per_bank: bool = False) -> None:
        if (hosts is None) == (client is None):
            raise ValueError("give exactly one of hosts or client")
        self.index = index
        self.per_bank = per_bank
        self._made: set[str] = set()  # bank indexes known to exist (per_bank)
        self._client: OpenSearch | None = client or OpenSearch(
            hosts=hosts, http_auth=http_auth, verify_certs=verify_certs, timeout=timeout,
            use_ssl=any(h.get("scheme") == "https" for h in hosts or ()))
        try:
            self._ensure_index()
        except BaseException:
            self.close()
            raise

    @classmethod
    def from_url(cls, url: str) -> "OpenSearchTextStore":
        """The store for a URL of :func:`parse_opensearch_url`'s form."""
        return cls(**parse_opensearch_url(url))

    @property
    def client(self) -> OpenSearch:
        if self._client is None:
            raise RuntimeError("OpenSearchTextStore is closed")
        return self._client

    # -- lifecycle --

    def _ensure_index(self) -> None:
        c = self.client
        c.indices.put_index_template(name=self.index, body={
            "index_patterns": [self._pattern() if self.per_bank else self.index],
            "template": {"settings": SETTINGS, "mappings": MAPPINGS}})
        if self.per_bank:
            if c.indices.exists(index=self.index):
                log.warning("OpenSearch index %s holds banks from before per_bank was set; "
                            "they are not searched until `mneme replay` rebuilds the text "
                            "store, and it is deleted with the store's reset or drop",
                            self.index)
            return  # a bank's index is made on its first write
        if self._bank_indexes():
            log.warning("OpenSearch indexes %s-* hold banks from when per_bank was set; "
                        "they are not searched until `mneme replay` rebuilds the text "
                        "store, and are deleted with the store's reset or drop", self.index)
        if c.indices.exists(index=self.index):
            self._check_analyzer()
            return
        self._create(self.index)

    def _create(self, index: str) -> None:
        try:
            self.client.indices.create(index=index,
                                       body={"settings": SETTINGS, "mappings": MAPPINGS})
        except RequestError as e:
            if e.error != "resource_already_exists_exception":  # else a concurrent creator
                raise

    def _pattern(self) -> str:
        return f"{self.index}-*"

    def index_of(self, bank_id: str) -> str | None:
        """The index holding ``bank_id``'s documents; None (per_bank) when ``bank_id`` is
        no bank id (:data:`mneme.domain.BANK_ID_RE`: lowercase, so a valid index name)."""
        if not self.per_bank:
            return self.index
        return f"{self.index}-{bank_id}" if BANK_ID_RE.fullmatch(bank_id or "") else None

    def _writable(self, bank_id: str) -> str:
        """The bank's index, created when missing. ValueError for no bank id."""
        index = self._existing(bank_id)
        if index is None:
            index = self.index_of(bank_id)
            if index is None:
                raise ValueError(f"not a bank id: {bank_id!r}")
            self._create(index)
            self._made.add(index)
        return index

    def _bank_indexes(self) -> list[str]:
        """Every bank's index (per_bank)."""
        try:
            return sorted(self.client.indices.get(index=self._pattern()))
        except NotFoundError:
            return []

    def _check_analyzer(self) -> None:
        """Warn when an existing index analyses ``text`` otherwise than :data:`MAPPINGS`
        (an index created before CJK segmentation): see the module docs."""
        try:
            props = self.client.indices.get_mapping(index=self.index)[self.index][
                "mappings"].get("properties", {})
        except (KeyError, NotFoundError):
            return
        got = props.get("text", {}).get("analyzer", "standard")
        if got != ANALYZER:
            log.warning("OpenSearch index %s analyses text with %r, not %r: CJK text is "
                        "not found by keyword until `mneme replay` recreates the index",
                        self.index, got, ANALYZER)

    def close(self) -> None:
        """Close the client's connections; further calls raise RuntimeError. Idempotent."""
        if self._client is not None:
            client, self._client = self._client, None
            client.close()

    def flush(self) -> None:
        """No-op: OpenSearch fsyncs its translog before it answers a write (the default
        ``index.translog.durability=request``)."""

    def reset(self) -> None:
        """Delete every bank's documents: the index and every bank's index (both
        layouts) are dropped, and the one in use created afresh."""
        self._delete_indexes()
        self._ensure_index()

    def _delete_indexes(self) -> None:
        # Both layouts: an index of the other one is left from before per_bank changed
        # and may hold deleted banks' text. By name: a wildcard delete is refused where
        # action.destructive_requires_name is set.
        for index in [self.index] + self._bank_indexes():
            try:
                self.client.indices.delete(index=index)
            except NotFoundError:
                pass
        self._made.clear()

    def drop(self) -> None:
        """Delete the index, every bank's index (both layouts) and the template (an old
        store generation)."""
        self._delete_indexes()
        try:
            self.client.indices.delete_index_template(name=self.index)
        except NotFoundError:
            pass

    # -- writes --

    def _doc_id(self, bank_id: str, fact_id: str) -> str:
        return f"{bank_id}:{fact_id}"  # bank ids hold no ':' (BANK_ID_RE)

    def _bulk(self, ops: list[dict[str, Any]], retry_missing: bool = False) -> None:
        """Send ``ops``; RuntimeError naming the first failed item. With
        ``retry_missing`` (per_bank writes), indexes another replica deleted meanwhile
        (``index_not_found_exception``, where auto-creation is off) are created again
        and the bulk is sent once more (its writes are idempotent)."""
        if not ops:
            return
        resp = self.client.bulk(body=ops, refresh="wait_for")
        if not resp.get("errors"):
            return
        failed = []
        for item in resp["items"]:
            (action, result), = item.items()
            # deleting an id that is not there is fine (idempotent deletes)
            if result.get("status", 200) >= 300 and not (
                    action == "delete" and result.get("status") == 404):
                failed.append((action, result))
        missing = {r.get("_index") for a, r in failed
                   if (r.get("error") or {}).get("type") == "index_not_found_exception"}
        if failed and retry_missing and self.per_bank and missing == {
                r.get("_index") for _, r in failed}:
            for index in missing:
                self._create(index)
            return self._bulk(ops)
        if failed:
            action, result = failed[0]
            raise RuntimeError(f"OpenSearch bulk {action} of {result.get('_id')} "
                               f"failed: {result.get('error')}")

    def upsert(self, facts: Sequence[Fact]) -> None:
        """Index ``facts``, replacing any earlier version of the same (bank_id, id);
        searchable on return."""
        ops: list[dict[str, Any]] = []
        facts = storable_facts(facts)  # the same text as every other store holds
        indexes = {b: self._writable(b) for b in {f.bank_id for f in facts}}
        for fact in {(f.bank_id, f.id): f for f in facts}.values():
            ops.append({"index": {"_index": indexes[fact.bank_id], "routing": fact.bank_id,
                                  "_id": self._doc_id(fact.bank_id, fact.id)}})
            ops.append(fact_document(fact))
        self._bulk(ops, retry_missing=True)

    def delete(self, bank_id: str, ids: Sequence[str]) -> None:
        """Remove the bank's documents with these fact ids (unknown ids are ignored)."""
        index = self._existing(bank_id)
        if index is None:
            return
        self._bulk([{"delete": {"_index": index, "routing": bank_id,
                                "_id": self._doc_id(bank_id, i)}}
                    for i in dict.fromkeys(ids)])

    def _existing(self, bank_id: str) -> str | None:
        """The bank's index if it exists (always the index, shared); None otherwise, so
        that a deletion never auto-creates a bank's index."""
        index = self.index_of(bank_id)
        if not self.per_bank or index is None or index in self._made:
            return index
        if not self.client.indices.exists(index=index):
            return None
        self._made.add(index)
        return index

    def delete_where(self, bank_id: str, document_id: str | None = None) -> None:
        """Remove the bank's documents of ``document_id`` (all of the bank when None)
        with one delete-by-query; per_bank, the whole bank by deleting its index.
        ValueError for "" (never means "the whole bank")."""
        check_document_id(document_id)
        document_id = storable(document_id)
        index = self._existing(bank_id)
        if index is None:
            return
        if self.per_bank and not document_id:
            self._made.discard(index)
            try:
                self.client.indices.delete(index=index)
            except NotFoundError:
                pass
            return
        filters = Filters(document_id=document_id) if document_id else None
        try:
            self.client.delete_by_query(
                index=index, routing=bank_id, refresh=True, conflicts="proceed",
                body={"query": {"bool": {"filter": filter_clauses(bank_id, filters)}}})
        except NotFoundError:  # (per_bank: deleted meanwhile)
            self._made.discard(index)

    # -- reads --

    def search(self, bank_id: str, query: str, k: int,
               filters: Filters | None = None) -> list[Hit]:
        """BM25 over the bank's fact texts, best first (``Hit.score`` = BM25; filters do
        not change it). Any text is accepted; one with no indexable term → []."""
        # Question and function words only add noise to BM25 (see QUERY_STOP_WORDS); the
        # Tantivy adapter drops the same ones in its query analyzer.
        text = clip_query(" ".join(w for w in re.findall(r"\w+", segment(query))
                                   if w.lower() not in _QUERY_STOP))
        if k <= 0 or not text:
            return []
        body = {
            "query": {"bool": {
                "must": [{"match": {"text": {"query": text, "operator": "or"}}}],
                "filter": filter_clauses(bank_id, filters)}},
            "size": min(k + _TIE_SLACK, _MAX_WINDOW),
            "_source": ["id"],
            "track_total_hits": False,
        }
        index = self.index_of(bank_id)
        if index is None:
            return []
        try:
            resp = self.client.search(index=index, routing=bank_id, body=body)
        except NotFoundError:
            if not self.per_bank:
                raise
            return []  # a bank never written
        out = [Hit(h["_source"]["id"], float(h["_score"])) for h in resp["hits"]["hits"]]
        # Equal scores come back in segment order, which depends on write history; break
        # ties by id (as the Tantivy adapter does) so a rebuilt index ranks the same.
        out.sort(key=lambda h: (-round(h.score, 5), h.id))
        return out[:k]

    def count(self, bank_id: str) -> int:
        """Number of the bank's indexed facts."""
        index = self.index_of(bank_id)
        if index is None:
            return 0
        try:
            resp = self.client.count(index=index, routing=bank_id, body={
                "query": {"bool": {"filter": [{"term": {"bank_id": bank_id}}]}}})
        except NotFoundError:
            if not self.per_bank:
                raise
            return 0  # a bank never written
        return int(resp["count"])
