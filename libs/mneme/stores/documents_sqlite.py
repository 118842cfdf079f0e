"""search's :class:`mneme.ports.DocumentStore` in SQLite (``<data_dir>/documents.db``):
each document's retains (its upsert history), the latest retain's original text when the
bank stores documents, and each bank's ``store_documents`` setting. Rebuilt on replay
from the intake log alone.

Deleted rows leave no bytes in the file (:mod:`mneme.stores.sqlite_erase`: secure_delete,
and the WAL truncated after every call that deleted something), so a deleted document's
text is gone from the projection as it is from the log (its keys destroyed).
"""

from __future__ import annotations

import json
import sqlite3
import threading
from dataclasses import asdict
from typing import Sequence

from mneme.domain import DocumentRevision, StoredDocument
from mneme.stores import sqlite_erase

_SCHEMA = """
CREATE TABLE IF NOT EXISTS banks (bank_id TEXT PRIMARY KEY, store_text INTEGER NOT NULL);
CREATE TABLE IF NOT EXISTS documents (
  bank_id TEXT NOT NULL, document_id TEXT NOT NULL, created_at REAL NOT NULL,
  updated_at REAL NOT NULL, revisions INTEGER NOT NULL, text TEXT,
  PRIMARY KEY (bank_id, document_id));
CREATE TABLE IF NOT EXISTS revisions (
  bank_id TEXT NOT NULL, document_id TEXT NOT NULL, revision INTEGER NOT NULL,
  operation_id TEXT NOT NULL, at REAL NOT NULL, items INTEGER NOT NULL,
  content_hash TEXT NOT NULL, chars INTEGER NOT NULL, tags TEXT NOT NULL,
  context TEXT NOT NULL, text_stored INTEGER NOT NULL,
  PRIMARY KEY (bank_id, document_id, revision));
CREATE UNIQUE INDEX IF NOT EXISTS revisions_op ON revisions (bank_id, document_id, operation_id);
"""


def dump_document(doc: StoredDocument, revisions: list[DocumentRevision]) -> bytes:
    """One document with every revision as deterministic JSON bytes (both adapters'
    :meth:`~mneme.ports.DocumentStore.dump`)."""
    return json.dumps({**asdict(doc), "history": [asdict(r) for r in revisions]},
                      sort_keys=True, ensure_ascii=False).encode()


def _revision(row) -> DocumentRevision:
    return DocumentRevision(revision=row[0], operation_id=row[1], at=row[2], items=row[3],
                            content_hash=row[4], chars=row[5], tags=tuple(json.loads(row[6])),
                            context=row[7], text_stored=bool(row[8]))


_REV_COLS = "revision, operation_id, at, items, content_hash, chars, tags, context, text_stored"


class SqliteDocumentStore:
    """The projection in one SQLite file (``path``; ":memory:" in tests). Thread-safe."""

    def __init__(self, path: str):
        self._db = sqlite3.connect(path, check_same_thread=False, isolation_level=None)
        self._db.execute("PRAGMA journal_mode=WAL")
        sqlite_erase.secure(self._db)
        self._db.executescript(_SCHEMA)
        self._lock = threading.RLock()

    def close(self) -> None:
        self._db.close()

    def reset(self) -> None:
        with self._lock:
            self._db.executescript("DELETE FROM banks; DELETE FROM documents; "
                                   "DELETE FROM revisions;")
            sqlite_erase.truncate_wal(self._db)

    def set_storage(self, bank_id: str, store_text: bool) -> None:
        with self._lock:
            self._db.execute("INSERT OR REPLACE INTO banks VALUES (?,?)", (bank_id, int(store_text)))

    def storage(self, bank_id: str) -> bool:
        with self._lock:
            row = self._db.execute("SELECT store_text FROM banks WHERE bank_id=?",
                                   (bank_id,)).fetchone()
        return True if row is None else bool(row[0])

    def add_revisions(self, bank_id: str,
                      entries: Sequence[tuple[str, DocumentRevision, str | None]]) -> int:
        """One transaction (one sync for a retain's documents); the WAL is truncated
        when an earlier text was replaced (its bytes must not outlive it: the new
        retain replaced the document)."""
        added, replaced = 0, False
        with self._lock:
            self._db.execute("BEGIN")
            try:
                for document_id, rev, text in entries:
                    if self._db.execute(
                            "SELECT 1 FROM revisions WHERE bank_id=? AND document_id=? AND "
                            "operation_id=?", (bank_id, document_id, rev.operation_id)).fetchone():
                        continue
                    row = self._db.execute(
                        "SELECT created_at, revisions, text FROM documents WHERE bank_id=? AND "
                        "document_id=?", (bank_id, document_id)).fetchone()
                    n = (row[1] if row else 0) + 1
                    if row is not None:  # the replaced text's fingerprint goes with it
                        self._db.execute(
                            "UPDATE revisions SET content_hash='', chars=0, context='', "
                            "text_stored=0 WHERE bank_id=? AND document_id=?",
                            (bank_id, document_id))
                    self._db.execute(
                        "INSERT OR REPLACE INTO documents VALUES (?,?,?,?,?,?)",
                        (bank_id, document_id, row[0] if row else rev.at, rev.at, n, text))
                    self._db.execute(
                        f"INSERT INTO revisions (bank_id, document_id, {_REV_COLS}) "
                        "VALUES (?,?,?,?,?,?,?,?,?,?,?)",
                        (bank_id, document_id, n, rev.operation_id, rev.at, rev.items,
                         rev.content_hash, rev.chars, json.dumps(list(rev.tags)), rev.context,
                         int(rev.text_stored)))
                    added += 1
                    replaced |= row is not None
                self._db.execute("COMMIT")
            except BaseException:
                if self._db.in_transaction:  # (SQLite may have rolled it back itself)
                    self._db.execute("ROLLBACK")
                raise
            if replaced:
                sqlite_erase.truncate_wal(self._db)
        return added

    def delete_document(self, bank_id: str, document_id: str) -> bool:
        with self._lock:
            before = self._db.total_changes
            self._db.execute("BEGIN")
            try:
                self._db.execute("DELETE FROM documents WHERE bank_id=? AND document_id=?",
                                 (bank_id, document_id))
                self._db.execute("DELETE FROM revisions WHERE bank_id=? AND document_id=?",
                                 (bank_id, document_id))
                self._db.execute("COMMIT")
            except BaseException:
                if self._db.in_transaction:  # (SQLite may have rolled it back itself)
                    self._db.execute("ROLLBACK")
                raise
            gone = self._db.total_changes != before
            if gone:
                sqlite_erase.truncate_wal(self._db)
        return gone

    def delete_bank(self, bank_id: str) -> None:
        with self._lock:
            for table in ("banks", "documents", "revisions"):
                self._db.execute(f"DELETE FROM {table} WHERE bank_id=?", (bank_id,))
            sqlite_erase.truncate_wal(self._db)

    def _doc(self, bank_id: str, row, text: bool) -> StoredDocument:
        document_id, created, updated, n, body = row
        latest = self._db.execute(
            f"SELECT {_REV_COLS} FROM revisions WHERE bank_id=? AND document_id=? AND "
            "revision=?", (bank_id, document_id, n)).fetchone()
        return StoredDocument(bank_id=bank_id, document_id=document_id, created_at=created,
                              updated_at=updated, latest=_revision(latest), revisions=n,
                              text=body if text else None)

    def get(self, bank_id: str, document_id: str) -> StoredDocument | None:
        with self._lock:
            row = self._db.execute(
                "SELECT document_id, created_at, updated_at, revisions, text FROM documents "
                "WHERE bank_id=? AND document_id=?", (bank_id, document_id)).fetchone()
            return self._doc(bank_id, row, True) if row else None

    def revisions(self, bank_id: str, document_id: str, limit: int) -> list[DocumentRevision]:
        with self._lock:
            rows = self._db.execute(
                f"SELECT {_REV_COLS} FROM revisions WHERE bank_id=? AND document_id=? "
                "ORDER BY revision DESC LIMIT ?", (bank_id, document_id, max(limit, 0))).fetchall()
        return [_revision(r) for r in reversed(rows)]

    def list(self, bank_id: str, limit: int, after: str = "") -> list[StoredDocument]:
        with self._lock:
            rows = self._db.execute(
                "SELECT document_id, created_at, updated_at, revisions, NULL FROM documents "
                "WHERE bank_id=? AND document_id>? ORDER BY document_id LIMIT ?",
                (bank_id, after, max(limit, 0))).fetchall()
            return [self._doc(bank_id, r, False) for r in rows]

    def count(self, bank_id: str) -> int:
        with self._lock:
            return self._db.execute("SELECT COUNT(*) FROM documents WHERE bank_id=?",
                                    (bank_id,)).fetchone()[0]

    def dump(self, bank_id: str) -> list[bytes]:
        out = []
        after = ""
        while True:
            page = self.list(bank_id, 500, after)
            for d in page:
                full = self.get(bank_id, d.document_id)
                out.append(dump_document(full, self.revisions(bank_id, d.document_id,
                                                              full.revisions)))
            if len(page) < 500:
                return out
            after = page[-1].document_id
