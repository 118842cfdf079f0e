"""BM25 text store over Tantivy (``tantivy``), one index directory for every bank.

Text is segmented before analysis by :func:`mneme.cjk.segment` (CJK runs become
overlapping character bigrams, other text is unchanged), then analysed by Tantivy's
``en_stem`` (simple tokenizer, lowercase, English Snowball stemmer). Queries are never
parsed with Tantivy's query language: the user's text goes through the same segmentation
and analysis minus English stop words and the question and function words of
:data:`QUERY_STOP_WORDS`, and the resulting terms are OR-ed as term queries. Filters become
non-scoring boolean clauses, so ``Hit.score`` is the pure BM25 score. Term statistics
(IDF, average length) are index-wide, not per bank.

The schema is unchanged by segmentation, so an index written before it opens as before
and its Latin-script text is searched as before; CJK text it holds was indexed as whole
runs and is found by keyword only after ``mneme replay`` rebuilds the index. The file
:data:`VERSION_FILE` in the index directory records the analysis version; opening an
index without it (or with an older one) logs that warning once and records the version.
"""

from __future__ import annotations

import logging
import os
import threading
from typing import Any, Sequence

import tantivy
from tantivy import (
    Document,
    FieldType,
    Filter as TokenFilter,
    Index,
    Occur,
    Query,
    SchemaBuilder,
    TextAnalyzerBuilder,
    Tokenizer,
)

from mneme.cjk import segment
from mneme.domain import Fact, Filters, Hit, to_epoch
from mneme.retrieval import QUERY_STOP_WORDS
from mneme.stores.filters import TAGS_MATCH_MODES, check_document_id
from mneme.stores.storable import storable, storable_facts

#: Most distinct query terms used; the rest of a very long query is ignored.
MAX_QUERY_TERMS = 64
_WRITER_HEAP = 32_000_000
_KEY_SEP = "\x1f"  # joins bank_id and id into the unique document key
#: Version of the text analysis (2: CJK bigram segmentation), kept in VERSION_FILE.
ANALYSIS_VERSION = 2
VERSION_FILE = "mneme-analysis-version"
log = logging.getLogger(__name__)


def _schema() -> tantivy.Schema:
    sb = SchemaBuilder()
    sb.add_text_field("key", tokenizer_name="raw")  # bank_id + id: delete/upsert handle
    sb.add_text_field("id", stored=True, tokenizer_name="raw")
    sb.add_text_field("bank_id", tokenizer_name="raw")
    sb.add_text_field("text", tokenizer_name="en_stem")
    sb.add_text_field("fact_type", tokenizer_name="raw")
    sb.add_text_field("document_id", tokenizer_name="raw")
    sb.add_text_field("tags", tokenizer_name="raw")
    sb.add_integer_field("n_tags", indexed=True)  # distinct tags; 0 selects untagged units
    # Effective bounds: a missing end is taken from the other one (TimeWindow.overlaps).
    sb.add_float_field("occurred_start", indexed=True, fast=True)
    sb.add_float_field("occurred_end", indexed=True, fast=True)
    return sb.build()


def _query_analyzer() -> tantivy.TextAnalyzer:
    """``en_stem`` (simple, remove_long(40), lowercase, stemmer) plus stop-word filters
    placed before stemming, as the stop lists hold unstemmed words: Tantivy's English
    list and :data:`QUERY_STOP_WORDS`."""
    return (TextAnalyzerBuilder(Tokenizer.simple())
            .filter(TokenFilter.remove_long(40))
            .filter(TokenFilter.lowercase())
            .filter(TokenFilter.stopword("english"))
            .filter(TokenFilter.custom_stopword(list(QUERY_STOP_WORDS)))
            .filter(TokenFilter.stemmer("english"))
            .build())


class TantivyTextStore:
    """:class:`mneme.ports.TextStore` over a Tantivy index in directory ``path``
    (created when absent, reopened otherwise).

    Every write commits and reloads the searcher before returning, so it is durable and
    searchable at once. One writer per directory: a second store (or process) on the
    same ``path`` fails with Tantivy's lock error. Thread-safe (one lock).
    """

    def __init__(self, path: str) -> None:
        self.path = os.path.abspath(path)
        os.makedirs(self.path, exist_ok=True)
        self._schema = _schema()
        self._index = Index(self._schema, path=self.path, reuse=True)
        self._writer: tantivy.IndexWriter | None = self._index.writer(_WRITER_HEAP, 1)
        self._check_version()
        self._analyzer = _query_analyzer()
        self._lock = threading.RLock()

    def _check_version(self) -> None:
        """Warn when the index holds documents analysed by an older version (see the
        module docs), then record the current version."""
        marker = os.path.join(self.path, VERSION_FILE)
        try:
            with open(marker) as f:
                version = int(f.read().strip() or 0)
        except (OSError, ValueError):
            version = 0
        if version >= ANALYSIS_VERSION:
            return
        if self._index.searcher().num_docs:
            log.warning("text index %s was written by text analysis v%d (now v%d): CJK "
                        "text indexed before is not found by keyword until `mneme replay` "
                        "rebuilds the index; other text is unaffected", self.path, version,
                        ANALYSIS_VERSION)
        with open(marker + ".tmp", "w") as f:
            f.write(f"{ANALYSIS_VERSION}\n")
        os.replace(marker + ".tmp", marker)

    @property
    def writer(self) -> tantivy.IndexWriter:
        if self._writer is None:
            raise RuntimeError("TantivyTextStore is closed")
        return self._writer

    def _commit(self) -> None:
        self.writer.commit()
        self._index.reload()

    # -- query building --

    def _term(self, field: str, value: Any) -> Query:
        return Query.term_query(self._schema, field, value)

    def _filter_clauses(self, bank_id: str, filters: Filters | None) -> list[Query]:
        """Boolean Must clauses for the bank and ``filters`` (fully pushed down)."""
        f = filters or Filters()
        clauses = [self._term("bank_id", bank_id)]
        if f.types:
            clauses.append(Query.term_set_query(self._schema, "fact_type", list(f.types)))
        if f.document_id:
            clauses.append(self._term("document_id", storable(f.document_id)))
        if f.tags_match not in TAGS_MATCH_MODES:
            raise ValueError(f"unknown tags_match mode {f.tags_match!r}")
        tags = sorted(set(f.tags))
        untagged = self._term("n_tags", 0)
        if f.tags_match == "exact":
            clauses.extend(self._term("tags", t) for t in tags)
            clauses.append(self._term("n_tags", len(tags)))
        elif tags:
            any_of = Query.term_set_query(self._schema, "tags", tags)
            all_of = Query.boolean_query([(Occur.Must, self._term("tags", t)) for t in tags])
            if f.tags_match == "any":
                clauses.append(Query.boolean_query([(Occur.Should, any_of),
                                                    (Occur.Should, untagged)]))
            elif f.tags_match == "all":
                clauses.append(Query.boolean_query([(Occur.Should, all_of),
                                                    (Occur.Should, untagged)]))
            elif f.tags_match == "any_strict":
                clauses.append(any_of)
            else:
                clauses.append(all_of)
        if f.time_range is not None:
            lo, hi = to_epoch(f.time_range.start), to_epoch(f.time_range.end)
            # A unit without times has neither field, so it never matches a time range.
            clauses.append(Query.exists_query("occurred_start"))
            if hi is not None:
                clauses.append(Query.range_query(self._schema, "occurred_start",
                                                 FieldType.Float, upper_bound=hi))
            if lo is not None:
                clauses.append(Query.range_query(self._schema, "occurred_end",
                                                 FieldType.Float, lower_bound=lo))
        return clauses

    def _scoped(self, bank_id: str, filters: Filters | None = None) -> Query:
        return Query.boolean_query([(Occur.Must, c)
                                    for c in self._filter_clauses(bank_id, filters)])

    def query_terms(self, text: str) -> list[str]:
        """The distinct index terms of free ``text`` (CJK bigrams, stemmed words, no stop
        words), in order, at most :data:`MAX_QUERY_TERMS`."""
        terms = list(dict.fromkeys(self._analyzer.analyze(segment(text))))
        return terms[:MAX_QUERY_TERMS]

    # -- TextStore --

    def upsert(self, facts: Sequence[Fact]) -> None:
        """Index ``facts``, replacing any earlier version of the same (bank_id, id)."""
        if not facts:
            return
        facts = storable_facts(facts)  # the same text as every other store holds
        with self._lock:
            w = self.writer
            for fact in facts:
                key = fact.bank_id + _KEY_SEP + fact.id
                w.delete_documents_by_term("key", key)
                w.add_document(self._document(fact, key))
            self._commit()

    @staticmethod
    def _document(fact: Fact, key: str) -> Document:
        doc = Document()
        doc.add_text("key", key)
        doc.add_text("id", fact.id)
        doc.add_text("bank_id", fact.bank_id)
        doc.add_text("text", segment(fact.text))
        doc.add_text("fact_type", fact.fact_type)
        doc.add_text("document_id", fact.document_id)
        tags = sorted(set(fact.tags))
        for t in tags:
            doc.add_text("tags", t)
        doc.add_integer("n_tags", len(tags))
        start, end = to_epoch(fact.occurred_start), to_epoch(fact.occurred_end)
        if start is not None or end is not None:
            doc.add_float("occurred_start", start if start is not None else end)
            doc.add_float("occurred_end", end if end is not None else start)
        return doc

    def delete(self, bank_id: str, ids: Sequence[str]) -> None:
        """Remove the bank's documents with these fact ids."""
        if not ids:
            return
        with self._lock:
            for i in ids:
                self.writer.delete_documents_by_term("key", bank_id + _KEY_SEP + i)
            self._commit()

    def delete_where(self, bank_id: str, document_id: str | None = None) -> None:
        """Remove the bank's documents of ``document_id`` (all of the bank when None).
        ValueError for "" (never means "the whole bank")."""
        check_document_id(document_id)
        document_id = storable(document_id)
        filters = Filters(document_id=document_id) if document_id else None
        with self._lock:
            self.writer.delete_documents_by_query(self._scoped(bank_id, filters))
            self._commit()

    def search(self, bank_id: str, query: str, k: int,
               filters: Filters | None = None) -> list[Hit]:
        """BM25 over the bank's fact texts, best first (``Hit.score`` = BM25). Any text is
        accepted; a query with no indexable term (empty, stop words, punctuation) → []."""
        terms = self.query_terms(query)
        if k <= 0 or not terms:
            return []
        text_q = Query.boolean_query([(Occur.Should, self._term("text", t)) for t in terms])
        q = Query.boolean_query([(Occur.Must, text_q),
                                 (Occur.Must, Query.const_score_query(
                                     self._scoped(bank_id, filters), 0.0))])
        with self._lock:
            searcher = self._index.searcher()
            # Tantivy orders equal scores by segment address, which depends on commit
            # history; fetch some slack and break ties by id so a rebuilt index (replay)
            # ranks exactly as the original did.
            hits = searcher.search(q, limit=k + 32).hits
            out = [Hit(searcher.doc(addr).get_first("id"), float(score)) for score, addr in hits]
        out.sort(key=lambda h: (-round(h.score, 5), h.id))
        return out[:k]

    def count(self, bank_id: str) -> int:
        """Number of the bank's indexed facts."""
        with self._lock:
            return int(self._index.searcher().search(self._scoped(bank_id), limit=1,
                                                     count=True).count)

    def reset(self) -> None:
        """Delete every bank's documents."""
        with self._lock:
            self.writer.delete_all_documents()
            self._commit()

    def flush(self) -> None:
        """No-op: every write commits before it returns (durable already)."""

    def close(self) -> None:
        """Finish merges and release the writer lock; further writes raise RuntimeError."""
        with self._lock:
            if self._writer is not None:
                w, self._writer = self._writer, None
                w.wait_merging_threads()
