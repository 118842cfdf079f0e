"""The :class:`mneme.ports.KeyStore` in SQLite (``<data_dir>/keys.db``): the embedded
topology's wrapped keys. A destroyed key's bytes are overwritten in the file
(``secure_delete``) and cut from the WAL at once (:mod:`mneme.stores.sqlite_erase`), so
erasure does not wait for a vacuum.
"""

from __future__ import annotations

import contextlib
import sqlite3
import threading
import time
from typing import Callable, Sequence

from mneme.ports import PendingDeletion, StoredKey
from mneme.stores import sqlite_erase

#: Ids per ``IN (...)`` of :meth:`SqliteKeyStore.get_many` (under SQLite's default limit
#: of 32,766 host parameters, and small enough to stay one quick index probe each).
_IN_BATCH = 500

_SCHEMA = """
CREATE TABLE IF NOT EXISTS bank_keys (bank_id TEXT PRIMARY KEY, wrapped BLOB NOT NULL);
CREATE TABLE IF NOT EXISTS data_keys (
  bank_id TEXT NOT NULL, key_id TEXT NOT NULL, scope TEXT NOT NULL, wrapped BLOB,
  created REAL NOT NULL, PRIMARY KEY (bank_id, key_id));
CREATE INDEX IF NOT EXISTS data_keys_scope ON data_keys(bank_id, scope, created);
CREATE TABLE IF NOT EXISTS pending_deletions (
  seq INTEGER PRIMARY KEY AUTOINCREMENT, bank_id TEXT NOT NULL,
  operation_id TEXT NOT NULL UNIQUE, request BLOB NOT NULL);
CREATE INDEX IF NOT EXISTS pending_deletions_bank ON pending_deletions(bank_id, seq);
"""


class SqliteKeyStore:
    """Bank keys and data keys in one SQLite file (``path``, created if missing;
    ":memory:" for tests). Thread-safe (one lock)."""

    def __init__(self, path: str):
        self._lock = threading.Lock()
        self._db = sqlite3.connect(path, check_same_thread=False, isolation_level=None)
        self._db.execute("PRAGMA journal_mode=WAL")
        self._db.execute("PRAGMA synchronous=FULL")  # a key lost is content lost
        sqlite_erase.secure(self._db)
        self._db.executescript(_SCHEMA)
        self._listeners: list[Callable[[str, list[str] | None], None]] = []

    def listen(self, callback: Callable[[str, list[str] | None], None]) -> None:
        """Call ``callback(bank_id, key_ids | None)`` after each destruction made through
        this store (one process holds the embedded data dir, so there is no other)."""
        self._listeners.append(callback)

    def _notify(self, bank_id: str, key_ids: list[str] | None) -> None:
        for cb in list(self._listeners):
            cb(bank_id, key_ids)

    def bank_key(self, bank_id: str) -> bytes | None:
        with self._lock:
            row = self._db.execute("SELECT wrapped FROM bank_keys WHERE bank_id=?",
                                   (bank_id,)).fetchone()
        return bytes(row[0]) if row else None

    def add_bank_key(self, bank_id: str, wrapped: bytes) -> bytes:
        with self._lock:
            self._db.execute("INSERT OR IGNORE INTO bank_keys(bank_id, wrapped) VALUES (?, ?)",
                             (bank_id, wrapped))
            row = self._db.execute("SELECT wrapped FROM bank_keys WHERE bank_id=?",
                                   (bank_id,)).fetchone()
        return bytes(row[0])

    def get(self, bank_id: str, key_id: str) -> StoredKey | None:
        with self._lock:
            row = self._db.execute("SELECT scope, wrapped FROM data_keys WHERE bank_id=? AND "
                                   "key_id=?", (bank_id, key_id)).fetchone()
        if row is None:
            return None
        return StoredKey(row[0], bytes(row[1]) if row[1] is not None else None)

    def get_many(self, bank_id: str, key_ids: Sequence[str]) -> dict[str, StoredKey]:
        ids = list(dict.fromkeys(key_ids))
        out: dict[str, StoredKey] = {}
        with self._lock:
            for i in range(0, len(ids), _IN_BATCH):
                chunk = ids[i:i + _IN_BATCH]
                rows = self._db.execute(
                    "SELECT key_id, scope, wrapped FROM data_keys WHERE bank_id=? AND key_id "
                    f"IN ({','.join('?' * len(chunk))})", (bank_id, *chunk)).fetchall()
                for key_id, scope, wrapped in rows:
                    out[key_id] = StoredKey(scope, bytes(wrapped) if wrapped is not None else None)
        return out

    def add(self, bank_id: str, key_id: str, scope: str, wrapped: bytes) -> StoredKey:
        with self._lock:
            self._db.execute("INSERT OR IGNORE INTO data_keys(bank_id, key_id, scope, wrapped, "
                             "created) VALUES (?, ?, ?, ?, ?)",
                             (bank_id, key_id, scope, wrapped, time.time()))
            row = self._db.execute("SELECT scope, wrapped FROM data_keys WHERE bank_id=? AND "
                                   "key_id=?", (bank_id, key_id)).fetchone()
        return StoredKey(row[0], bytes(row[1]) if row[1] is not None else None)

    def add_many(self, bank_id: str, rows: Sequence[tuple[str, str, bytes]]
                 ) -> dict[str, StoredKey]:
        if not rows:
            return {}
        now = time.time()
        out: dict[str, StoredKey] = {}
        with self._lock:
            with self._transaction():
                for key_id, scope, wrapped in rows:
                    self._db.execute("INSERT OR IGNORE INTO data_keys(bank_id, key_id, scope, "
                                     "wrapped, created) VALUES (?, ?, ?, ?, ?)",
                                     (bank_id, key_id, scope, wrapped, now))
                    row = self._db.execute("SELECT scope, wrapped FROM data_keys WHERE "
                                           "bank_id=? AND key_id=?", (bank_id, key_id)).fetchone()
                    out[key_id] = StoredKey(row[0], bytes(row[1]) if row[1] is not None else None)
        return out

    def current(self, bank_id: str, scope: str) -> str | None:
        with self._lock:
            # a scope's generations (<scope>#<gen>), not the other keys in it (f:<fact>)
            row = self._db.execute("SELECT key_id FROM data_keys WHERE bank_id=? AND scope=? "
                                   "AND wrapped IS NOT NULL AND substr(key_id, 1, ?) = ? "
                                   "ORDER BY created DESC LIMIT 1",
                                   (bank_id, scope, len(scope) + 1, scope + "#")).fetchone()
        return row[0] if row else None

    @contextlib.contextmanager
    def _transaction(self):
        """One explicit transaction (lock held by the caller): committed when the block
        ends, rolled back when it raises."""
        self._db.execute("BEGIN")
        try:
            yield
            self._db.execute("COMMIT")
        except BaseException:
            # SQLite rolls the whole transaction back itself on some errors (a full
            # disk, an I/O error): a ROLLBACK then fails and would hide the error
            if self._db.in_transaction:
                self._db.execute("ROLLBACK")
            raise

    def _keep(self, pending: PendingDeletion | None) -> None:
        """Record ``pending`` (lock held, inside the destroy's transaction)."""
        if pending is not None:
            self._db.execute("INSERT OR IGNORE INTO pending_deletions(bank_id, operation_id, "
                             "request) VALUES (?, ?, ?)",
                             (pending.bank_id, pending.operation_id, pending.request))

    def destroy_scope(self, bank_id: str, scope: str,
                      pending: PendingDeletion | None = None) -> list[str]:
        with self._lock:
            with self._transaction():
                ids = [r[0] for r in self._db.execute(
                    "SELECT key_id FROM data_keys WHERE bank_id=? AND scope=? AND wrapped IS "
                    "NOT NULL", (bank_id, scope))]
                if ids:
                    self._db.execute("UPDATE data_keys SET wrapped=NULL WHERE bank_id=? AND "
                                     "scope=?", (bank_id, scope))
                self._keep(pending)
            if ids:
                sqlite_erase.truncate_wal(self._db)
        if ids:
            self._notify(bank_id, ids)
        return ids

    def destroy(self, bank_id: str, key_ids: Sequence[str],
                pending: PendingDeletion | None = None) -> list[str]:
        if not key_ids and pending is None:
            return []
        now = time.time()
        with self._lock:
            with self._transaction():
                for k in key_ids:
                    self._db.execute("INSERT OR IGNORE INTO data_keys(bank_id, key_id, scope, "
                                     "wrapped, created) VALUES (?, ?, '', NULL, ?)",
                                     (bank_id, k, now))
                    self._db.execute("UPDATE data_keys SET wrapped=NULL WHERE bank_id=? AND "
                                     "key_id=?", (bank_id, k))
                self._keep(pending)
            sqlite_erase.truncate_wal(self._db)
        if key_ids:
            self._notify(bank_id, list(key_ids))
        return list(key_ids)

    def destroy_bank(self, bank_id: str, pending: PendingDeletion | None = None) -> None:
        with self._lock:
            with self._transaction():
                self._db.execute("DELETE FROM data_keys WHERE bank_id=?", (bank_id,))
                self._db.execute("DELETE FROM bank_keys WHERE bank_id=?", (bank_id,))
                if pending is not None:  # its BankDeleted deletes what the others would
                    self._db.execute("DELETE FROM pending_deletions WHERE bank_id=?",
                                     (bank_id,))
                self._keep(pending)
            sqlite_erase.truncate_wal(self._db)
        self._notify(bank_id, None)

    def pending_deletions(self, bank_id: str | None = None) -> list[PendingDeletion]:
        with self._lock:
            rows = self._db.execute(
                "SELECT bank_id, operation_id, request FROM pending_deletions "
                + ("WHERE bank_id=? " if bank_id is not None else "") + "ORDER BY seq",
                (bank_id,) if bank_id is not None else ()).fetchall()
        return [PendingDeletion(b, op, bytes(r)) for b, op, r in rows]

    def clear_pending(self, bank_id: str, operation_id: str) -> None:
        with self._lock:
            self._db.execute("DELETE FROM pending_deletions WHERE bank_id=? AND "
                             "operation_id=?", (bank_id, operation_id))

    def close(self) -> None:
        with self._lock:
            self._db.close()


__all__ = ["SqliteKeyStore"]
