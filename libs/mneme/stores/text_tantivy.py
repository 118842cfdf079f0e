"""BM25 text store over Tantivy (``tantivy``), one index directory per bank (so BM25's
statistics are the bank's own; see :class:`TantivyTextStore`).

Text is segmented before analysis by :func:`mneme.cjk.segment` (CJK runs become
overlapping character bigrams, other text is unchanged), then analysed by Tantivy's
``en_stem`` (simple tokenizer, lowercase, English Snowball stemmer). Queries are never
parsed with Tantivy's query language: the user's text goes through the same segmentation
and analysis minus English stop words and the question and function words of
:data:`QUERY_STOP_WORDS`, and the resulting terms are OR-ed as term queries. Filters become
non-scoring boolean clauses, so ``Hit.score`` is the pure BM25 score. Term statistics
(IDF, average length) are the bank's.

The schema is unchanged by segmentation. A shared index written before it is split per
bank on open with its stored text segmented anew, so its CJK text is found by keyword;
only one too old to store its text keeps CJK runs indexed whole until ``mneme replay``
rebuilds it. The file :data:`VERSION_FILE` in an index directory records the analysis
version; opening such an old index without it (or with an older one) logs that warning
once and records the version.

Deletions are made physical by :meth:`TantivyTextStore.flush`: Tantivy only marks a
deleted document, which stays in its segment's files until a merge rewrites the segment
(and the binding offers no merge). Every field is stored, so a flush after deletions
re-indexes the live documents of each segment that holds a deleted one: the segment is
then wholly deleted, Tantivy drops it on commit and its files are garbage-collected. An
index written before fields were stored cannot be rewritten so (its text is not stored):
it says so once, and ``mneme replay`` rebuilds it.
"""

from __future__ import annotations

import fcntl
import json
import logging
import os
import re
import shutil
import threading
import uuid
from collections import OrderedDict
from typing import IO, Any, Iterator, Sequence

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
from mneme.domain import BANK_ID_RE, Fact, Filters, Hit, to_epoch
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
#: Subdirectory of the store's directory holding one index directory per bank.
BANKS_DIR = "banks"
LOCK_FILE = ".mneme-text.lock"
#: Prefix of a directory being deleted (a bank's index, or every bank's): renamed first,
#: so a crash never leaves a half-deleted index under a bank's name; removed on open.
DELETING = ".deleting-"
#: Files of a Tantivy index (and this module's version file), the only ones a split
#: removes from the store's directory.
_INDEX_FILE = re.compile(r"[0-9a-f]{32}\.(idx|term|pos|store|fast|fieldnorm|del)"
                         r"|meta\.json|\.managed\.json|\.tantivy-(meta|writer)\.lock"
                         r"|" + re.escape(VERSION_FILE))
#: Banks whose index stays open (a thread each); the least recently used are closed
#: (reopening one costs ~0.1 ms).
OPEN_INDEXES = 32
#: Banks whose index writer stays open (~6 threads each); the least recently written
#: release theirs (reopening one costs ~0.4 ms).
OPEN_WRITERS = 4
log = logging.getLogger(__name__)


def _schema(stored: bool = True) -> tantivy.Schema:
    """The index schema; every field ``stored`` (so a segment can be re-indexed from its
    documents, see :meth:`TantivyTextStore.purge`), or only ``id`` (indexes written
    before deletions were physical)."""
    sb = SchemaBuilder()
    sb.add_text_field("key", stored=stored, tokenizer_name="raw")  # bank_id + id: the handle
    sb.add_text_field("id", stored=True, tokenizer_name="raw")
    sb.add_text_field("bank_id", stored=stored, tokenizer_name="raw")
    sb.add_text_field("text", stored=stored, tokenizer_name="en_stem")
    sb.add_text_field("fact_type", stored=stored, tokenizer_name="raw")
    sb.add_text_field("document_id", stored=stored, tokenizer_name="raw")
    sb.add_text_field("tags", stored=stored, tokenizer_name="raw")
    # distinct tags; 0 selects untagged units
    sb.add_integer_field("n_tags", stored=stored, indexed=True)
    # Effective bounds: a missing end is taken from the other one (TimeWindow.overlaps).
    sb.add_float_field("occurred_start", stored=stored, indexed=True, fast=True)
    sb.add_float_field("occurred_end", stored=stored, indexed=True, fast=True)
    return sb.build()


def _stores_text(path: str) -> bool:
    """Whether the index in ``path`` stores its text field (True when there is none
    yet: it is created with the current schema)."""
    try:
        with open(os.path.join(path, "meta.json")) as f:
            fields = json.load(f)["schema"]
    except FileNotFoundError:
        return True
    for field in fields:
        if field.get("name") == "text":
            return bool(field.get("options", {}).get("stored"))
    return True


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


class _Index:
    """One Tantivy index in directory ``path`` (created when absent, reopened otherwise):
    a bank's index, or the shared index of every bank that data dirs made before
    per-bank indexes hold. Not thread-safe: :class:`TantivyTextStore` holds its lock
    around every call. Every write commits and reloads the searcher before returning."""

    def __init__(self, path: str, check_version: bool = True) -> None:
        self.path = path
        os.makedirs(self.path, exist_ok=True)
        #: False for an index written before every field was stored: its deleted
        #: documents stay in their segments until a merge (``mneme replay`` rebuilds it).
        self.physical_deletes = _stores_text(self.path)
        self._schema = _schema(stored=self.physical_deletes)
        if not self.physical_deletes:
            log.warning("text index %s does not store its documents, so deleted ones stay "
                        "in its segment files until Tantivy merges them; `mneme replay` "
                        "rebuilds it in the current format", self.path)
        self._index = Index(self._schema, path=self.path, reuse=True)
        # opened on the first write and released by release_writer: a writer runs ~6
        # threads, an index 1
        self._writer: tantivy.IndexWriter | None = None
        self._closed = False
        self._deleted = False  # a deletion not purged yet
        if check_version:
            self._check_version()

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
        """The index's writer, opened when none is."""
        if self._closed:
            raise RuntimeError("TantivyTextStore is closed")
        if self._writer is None:
            self._writer = self._index.writer(_WRITER_HEAP, 1)
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

    # -- writes and reads (the store has checked and converted the arguments) --

    def upsert(self, facts: Sequence[Fact]) -> None:
        """Index ``facts``, replacing any earlier version of the same (bank_id, id)."""
        w = self.writer
        for fact in facts:
            key = fact.bank_id + _KEY_SEP + fact.id
            w.delete_documents_by_term("key", key)
            w.add_document(_document(fact, key))
        self._commit()

    def add_documents(self, docs: Sequence[Document]) -> None:
        """Index stored documents of another index (same schema), replacing any with
        the same key."""
        w = self.writer
        for doc in docs:
            w.delete_documents_by_term("key", doc.get_first("key"))
            w.add_document(doc)
        self._commit()

    def delete(self, bank_id: str, ids: Sequence[str]) -> None:
        """Remove the bank's documents with these fact ids."""
        keys = [bank_id + _KEY_SEP + i for i in ids]
        if not keys or not self._any(Query.term_set_query(self._schema, "key", keys)):
            return
        for key in keys:
            self.writer.delete_documents_by_term("key", key)
        self._deleted = True
        self._commit()

    def delete_where(self, bank_id: str, filters: Filters | None) -> None:
        """Remove the bank's documents that match ``filters``."""
        query = self._scoped(bank_id, filters)
        if not self._any(query):  # (a retain deletes its document's old units first)
            return
        self.writer.delete_documents_by_query(query)
        self._deleted = True
        self._commit()

    def _any(self, query: Query) -> bool:
        """Whether ``query`` matches a live document."""
        return bool(self._index.searcher().search(query, limit=1, count=True).count)

    def search(self, bank_id: str, terms: Sequence[str], k: int,
               filters: Filters | None) -> list[Hit]:
        """BM25 of the OR of the analysed ``terms`` over the bank's documents that match
        ``filters``, best first, ties by id."""
        text_q = Query.boolean_query([(Occur.Should, self._term("text", t)) for t in terms])
        q = Query.boolean_query([(Occur.Must, text_q),
                                 (Occur.Must, Query.const_score_query(
                                     self._scoped(bank_id, filters), 0.0))])
        searcher = self._index.searcher()
        # Tantivy orders equal scores by segment address, which depends on commit
        # history; fetch some slack and break ties by id so a rebuilt index (replay)
        # ranks exactly as the original did.
        hits = searcher.search(q, limit=k + 32).hits
        out = [Hit(searcher.doc(addr).get_first("id"), float(score)) for score, addr in hits]
        out.sort(key=lambda h: (-round(h.score, 5), h.id))
        return out[:k]

    def count(self, bank_id: str) -> int:
        """Number of the bank's documents."""
        return int(self._index.searcher().search(self._scoped(bank_id), limit=1,
                                                 count=True).count)

    def documents(self, chunk: int = 10_000) -> Iterator[list[Document]]:
        """Every live document, as stored, ``chunk`` at a time (the split of a large
        index never holds all of them)."""
        searcher = self._index.searcher()
        hits = searcher.search(Query.all_query(), limit=max(1, searcher.num_docs)).hits
        for i in range(0, len(hits), chunk):
            yield [searcher.doc(addr) for _, addr in hits[i:i + chunk]]

    def reset(self) -> None:
        """Delete every document."""
        self.writer.delete_all_documents()
        self._deleted = True
        self._commit()

    def purge(self) -> int:
        """Drop deleted documents from the files: finish running merges (one could be
        copying a deleted document into a new segment), then re-index the live documents
        of every segment that holds a deleted one, from their stored fields, in one
        commit; those segments are then wholly deleted, which Tantivy drops on commit,
        and their files are garbage-collected. Returns the documents re-indexed. Costs
        about the size of those segments. Nothing (0) for an index that does not store
        its fields. A purge that fails leaves the deletion pending (the next flush
        tries again)."""
        if not self.physical_deletes:
            self._deleted = False
            return 0
        if self._writer is not None:
            w, self._writer = self._writer, None
            w.wait_merging_threads()  # (the binding's writer is spent by this)
        self._index.reload()
        searcher = self._index.searcher()
        with open(os.path.join(self.path, "meta.json")) as f:
            segments = json.load(f)["segments"]
        # The searcher's segment ordinals follow meta.json's order (no merge runs
        # now); when the live counts disagree, every segment is re-indexed.
        live = [s["max_doc"] - ((s.get("deletes") or {}).get("num_deleted_docs") or 0)
                for s in segments]
        hits = searcher.search(Query.all_query(), limit=max(1, searcher.num_docs)).hits
        per_segment = [0] * len(segments)
        for _, addr in hits:
            if addr.segment_ord < len(per_segment):
                per_segment[addr.segment_ord] += 1
        if per_segment != live or searcher.num_segments != len(segments):
            dirty = set(range(searcher.num_segments))
        else:
            dirty = {i for i, s in enumerate(segments) if live[i] < s["max_doc"]}
        n = 0
        for _, addr in hits:
            if addr.segment_ord in dirty:
                doc = searcher.doc(addr)
                self.writer.delete_documents_by_term("key", doc.get_first("key"))
                self.writer.add_document(doc)
                n += 1
        self._commit()
        self.writer.garbage_collect_files()
        self._deleted = False
        return n

    def release_writer(self) -> None:
        """Purge deletions, finish merges and release the writer (and its lock); the
        next write opens one again."""
        if self._deleted and not self._closed:
            self.purge()
        if self._writer is not None:
            w, self._writer = self._writer, None
            w.wait_merging_threads()

    def close(self) -> None:
        """:meth:`release_writer`; further writes raise RuntimeError. Idempotent."""
        self.release_writer()
        self._closed = True


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


class TantivyTextStore:
    """:class:`mneme.ports.TextStore` over Tantivy in directory ``path`` (created when
    absent, reopened otherwise): one index per bank, in ``path/banks/<bank_id>``.

    Why an index per bank: BM25's statistics (document frequencies, average length) are
    those of the index searched. In one shared index a bank's keyword ranking would
    change when another tenant writes, and a bank's raw BM25 scores would tell how
    common a word is in other banks. Deleting a bank removes its directory.

    A data dir made before holds one index of every bank in ``path`` itself. It is split
    into per-bank indexes when opened (from its stored fields; the old files are then
    removed). An index too old to store its fields cannot be split: it keeps serving
    every bank, with shared statistics, until ``mneme replay`` rebuilds it (a warning
    says so).

    Every write commits and reloads the searcher before returning, so it is durable and
    searchable at once. Deletions are physical once :meth:`flush` returns (a deleted
    bank's directory at once: renamed aside, then removed). At most
    :data:`OPEN_INDEXES` banks' indexes stay open and :data:`OPEN_WRITERS` of them keep
    a writer, the least recently used close first. One store per directory: a second one
    (or process) on the same ``path`` raises :class:`TextStoreLocked`. Thread-safe (one
    lock).
    """

    def __init__(self, path: str) -> None:
        self.path = os.path.abspath(path)
        os.makedirs(self.path, exist_ok=True)
        self._lockfile = _lock(self.path)
        self._banks_dir = os.path.join(self.path, BANKS_DIR)
        self._open: OrderedDict[str, _Index] = OrderedDict()
        self._writers: OrderedDict[str, _Index] = OrderedDict()  # by path
        self._analyzer = _query_analyzer()
        self._lock = threading.RLock()
        self._closed = False
        #: The shared index of a data dir made before per-bank indexes, when it could
        #: not be split (it does not store its fields); it then serves every bank.
        self._shared: _Index | None = None
        try:
            self._remove_deleting()
            if os.path.exists(os.path.join(self.path, "meta.json")):
                self._split_shared()
            if self._shared is None:
                self._remove_old_files()
        except BaseException:
            self._release()
            raise

    # -- the indexes --

    def _bank_path(self, bank_id: str) -> str | None:
        """The bank's index directory; None when ``bank_id`` is no bank id (it names a
        directory, so only :data:`mneme.domain.BANK_ID_RE` is one)."""
        if not BANK_ID_RE.fullmatch(bank_id or ""):
            return None
        return os.path.join(self._banks_dir, bank_id)

    def _check_open(self) -> None:
        if self._closed:
            raise RuntimeError("TantivyTextStore is closed")

    def _index_of(self, bank_id: str, create: bool) -> _Index | None:
        """The bank's open index, opened (or, with ``create``, created) when needed;
        None for a bank without one. Caller holds the lock."""
        self._check_open()
        if create and self._bank_path(bank_id) is None:
            raise ValueError(f"not a bank id: {bank_id!r}")
        if self._shared is not None:
            return self._shared
        index = self._open.get(bank_id)
        if index is not None:
            self._open.move_to_end(bank_id)
            return index
        path = self._bank_path(bank_id)
        if path is None or not (create or os.path.isdir(path)):
            return None
        while len(self._open) >= OPEN_INDEXES:
            _, oldest = self._open.popitem(last=False)
            self._writers.pop(oldest.path, None)
            oldest.close()
        index = self._open[bank_id] = _Index(path)
        return index

    def _writing(self, index: _Index) -> _Index:
        """``index``, about to be written: the least recently written beyond
        :data:`OPEN_WRITERS` release their writers. Caller holds the lock."""
        self._writers[index.path] = index
        self._writers.move_to_end(index.path)
        while len(self._writers) > OPEN_WRITERS:
            _, oldest = self._writers.popitem(last=False)
            oldest.release_writer()
        return index

    def _split_shared(self) -> None:
        """Move the documents of a shared index in ``path`` into per-bank indexes, then
        remove its files (see the class docs). Idempotent: a split that stopped midway
        is done again on the next open."""
        shared = _Index(self.path, check_version=False)  # (its text is segmented anew)
        if not shared.physical_deletes:
            shared._check_version()
            log.warning("text index %s holds every bank in one index, with BM25 "
                        "statistics shared by the banks, and cannot be split per bank "
                        "(it does not store its documents): `mneme replay` rebuilds it "
                        "(with --force if its check refuses the new ranking)", self.path)
            self._shared = shared
            return
        banks: set[str] = set()
        for chunk in shared.documents():
            by_bank: dict[str, list[Document]] = {}
            for doc in chunk:
                fields = doc.to_dict()
                # re-segmented: documents of an index from before CJK segmentation hold
                # their text as written (segmenting segmented text changes nothing)
                fields["text"] = [segment(t) for t in fields.get("text", [])]
                by_bank.setdefault(fields["bank_id"][0], []).append(
                    Document.from_dict(fields, shared._schema))
            for bank_id, docs in sorted(by_bank.items()):
                if self._bank_path(bank_id) is None:  # (no request can name it)
                    log.warning("text index %s: %d documents of %r, which is no bank id, "
                                "are not kept", self.path, len(docs), bank_id)
                    continue
                self._writing(self._index_of(bank_id, create=True)).add_documents(docs)
                banks.add(bank_id)
        shared.close()
        log.info("text index %s: split into %d per-bank indexes", self.path, len(banks))
        # meta.json first: without it the old files are no index any more
        os.remove(os.path.join(self.path, "meta.json"))

    def _remove_old_files(self) -> None:
        """Remove the files of a shared index already split (a split stopped before it
        removed them all: they may hold deleted text). Only Tantivy's files: the
        directory may hold others."""
        for name in os.listdir(self.path):
            full = os.path.join(self.path, name)
            if _INDEX_FILE.fullmatch(name) and os.path.isfile(full):
                os.remove(full)

    def _remove_deleting(self) -> None:
        """Finish deletions a crash (or a Tantivy thread still writing a lock file)
        stopped: every directory renamed to be deleted."""
        for parent in (self.path, self._banks_dir):
            if os.path.isdir(parent):
                for name in os.listdir(parent):
                    if name.startswith(DELETING):
                        shutil.rmtree(os.path.join(parent, name), ignore_errors=True)

    def _remove_dir(self, path: str) -> None:
        """Delete directory ``path``: renamed first (durably), so a crash leaves no
        half-deleted index under its name, then removed (what a Tantivy thread still
        recreates meanwhile goes on the next open). Caller holds the lock."""
        if not os.path.isdir(path):
            return
        parent = os.path.dirname(path)
        gone = os.path.join(parent, f"{DELETING}{os.path.basename(path)}-{uuid.uuid4().hex}")
        os.rename(path, gone)
        fd = os.open(parent, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)
        shutil.rmtree(gone, ignore_errors=True)

    def query_terms(self, text: str) -> list[str]:
        """The distinct index terms of free ``text`` (CJK bigrams, stemmed words, no stop
        words), in order, at most :data:`MAX_QUERY_TERMS`."""
        terms = list(dict.fromkeys(self._analyzer.analyze(segment(text))))
        return terms[:MAX_QUERY_TERMS]

    # -- TextStore --

    def upsert(self, facts: Sequence[Fact]) -> None:
        """Index ``facts``, replacing any earlier version of the same (bank_id, id).
        ValueError for a fact whose bank id is not one (:data:`mneme.domain.BANK_ID_RE`)."""
        if not facts:
            return
        facts = storable_facts(facts)  # the same text as every other store holds
        by_bank: dict[str, list[Fact]] = {}
        for fact in facts:
            by_bank.setdefault(fact.bank_id, []).append(fact)
        with self._lock:
            for bank_id, bank_facts in by_bank.items():
                self._writing(self._index_of(bank_id, create=True)).upsert(bank_facts)

    def delete(self, bank_id: str, ids: Sequence[str]) -> None:
        """Remove the bank's documents with these fact ids."""
        if not ids:
            return
        with self._lock:
            index = self._index_of(bank_id, create=False)
            if index is not None:
                self._writing(index).delete(bank_id, ids)

    def delete_where(self, bank_id: str, document_id: str | None = None) -> None:
        """Remove the bank's documents of ``document_id``; all of the bank when None (its
        index directory is removed). ValueError for "" (never means "the whole bank")."""
        check_document_id(document_id)
        document_id = storable(document_id)
        with self._lock:
            self._check_open()
            path = self._bank_path(bank_id)
            if document_id or self._shared is not None or path is None:
                index = self._index_of(bank_id, create=False)
                if index is not None:
                    filters = Filters(document_id=document_id) if document_id else None
                    self._writing(index).delete_where(bank_id, filters)
                return
            # the whole bank: its directory goes, without opening it (it may be damaged)
            index = self._open.pop(bank_id, None)
            if index is not None:
                self._writers.pop(index.path, None)
                index._deleted = False  # (its files go: nothing to purge)
                index.close()
                del index  # the last reference: its reader thread ends before the removal
            self._remove_dir(path)

    def search(self, bank_id: str, query: str, k: int,
               filters: Filters | None = None) -> list[Hit]:
        """BM25 over the bank's fact texts, with the bank's own statistics, best first
        (``Hit.score`` = BM25). Any text is accepted; a query with no indexable term
        (empty, stop words, punctuation) → []."""
        terms = self.query_terms(query)
        if k <= 0 or not terms:
            return []
        with self._lock:
            index = self._index_of(bank_id, create=False)
            return [] if index is None else index.search(bank_id, terms, k, filters)

    def count(self, bank_id: str) -> int:
        """Number of the bank's indexed facts."""
        with self._lock:
            index = self._index_of(bank_id, create=False)
            return 0 if index is None else index.count(bank_id)

    def reset(self) -> None:
        """Delete every bank's documents."""
        with self._lock:
            self._check_open()
            if self._shared is not None:
                self._writing(self._shared).reset()
                return
            self._close_indexes(purge=False)
            self._remove_dir(self._banks_dir)

    def flush(self) -> None:
        """Every write commits before it returns (durable already); after deletions,
        :meth:`purge` makes them physical."""
        with self._lock:
            if not self._closed and any(i._deleted for i in self._indexes()):
                self.purge(only_deleted=True)

    def purge(self, only_deleted: bool = False) -> int:
        """Make deletions physical in every open index (:meth:`_Index.purge`); with
        ``only_deleted``, only in those that deleted something since their last purge
        (an index closed since purged then). Returns the documents re-indexed.
        RuntimeError once closed."""
        with self._lock:
            self._check_open()
            n = 0
            for index in self._indexes():
                if index._deleted or not only_deleted:
                    n += index.purge()
                    if index.path not in self._writers:  # (keep to OPEN_WRITERS)
                        index.release_writer()
            return n

    def _indexes(self) -> list[_Index]:
        """The open indexes; caller holds the lock."""
        return [self._shared] if self._shared is not None else list(self._open.values())

    def _close_indexes(self, purge: bool = True) -> None:
        for index in self._indexes():
            if not purge:
                index._deleted = False
            index.close()
        self._open.clear()
        self._writers.clear()
        self._shared = None

    def _release(self) -> None:
        self._close_indexes()
        self._closed = True
        if self._lockfile is not None:
            self._lockfile.close()  # (releases the lock)
            self._lockfile = None

    def close(self) -> None:
        """Purge deletions (see :meth:`flush`), finish merges and release the writer
        locks and the directory; further writes, :meth:`reset` and :meth:`purge` raise
        RuntimeError, :meth:`flush` does nothing. Idempotent."""
        with self._lock:
            if not self._closed:
                self._release()


class TextStoreLocked(RuntimeError):
    """Another store (in this process or another) has the text store's directory open."""


def _lock(path: str) -> IO[str]:
    """An exclusive lock on ``path``'s :data:`LOCK_FILE`, held while the returned file
    stays open. :class:`TextStoreLocked` when another store holds it."""
    f = open(os.path.join(path, LOCK_FILE), "a")
    try:
        fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        f.close()
        raise TextStoreLocked(f"text store {path} is open in another store or process") from None
    return f
