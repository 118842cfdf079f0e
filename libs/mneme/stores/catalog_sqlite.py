"""The catalog: banks and operations, a projection of ``mneme.intake.v1`` and
``mneme.progress.v1`` kept in SQLite (owned by the ingest service).

Writes are idempotent upserts, so redelivered events change nothing.
"""

from __future__ import annotations

import json
import sqlite3
import threading
import time
from dataclasses import asdict, dataclass, field

from mneme.domain import Bank, BankConfig, from_epoch

_SCHEMA = """
CREATE TABLE IF NOT EXISTS banks (
  bank_id TEXT PRIMARY KEY, display_name TEXT NOT NULL, config TEXT NOT NULL,
  created_at REAL NOT NULL, updated_at REAL NOT NULL);
CREATE TABLE IF NOT EXISTS operations (
  operation_id TEXT PRIMARY KEY, bank_id TEXT NOT NULL, kind TEXT NOT NULL,
  state TEXT NOT NULL, items_total INTEGER NOT NULL DEFAULT 0,
  items_done INTEGER NOT NULL DEFAULT 0, facts INTEGER NOT NULL DEFAULT 0,
  error TEXT NOT NULL DEFAULT '', memory_ids TEXT NOT NULL DEFAULT '[]',
  created_at REAL NOT NULL, updated_at REAL NOT NULL);
CREATE INDEX IF NOT EXISTS operations_bank ON operations (bank_id, created_at);
"""

TERMINAL = ("succeeded", "failed")


@dataclass
class Operation:
    """A long-running request. ``state``: pending, running, succeeded, failed.
    Times are epoch seconds."""

    operation_id: str
    bank_id: str
    kind: str
    state: str = "pending"
    items_total: int = 0
    items_done: int = 0
    facts: int = 0
    error: str = ""
    memory_ids: list[str] = field(default_factory=list)
    created_at: float = 0.0
    updated_at: float = 0.0

    @property
    def done(self) -> bool:
        return self.state in TERMINAL


class SqliteCatalog:
    """Banks and operations in one SQLite file (``path``; ":memory:" for tests)."""

    def __init__(self, path: str):
        self._db = sqlite3.connect(path, check_same_thread=False, isolation_level=None)
        self._db.execute("PRAGMA journal_mode=WAL")
        self._db.execute("PRAGMA busy_timeout=10000")
        self._db.executescript(_SCHEMA)
        self._lock = threading.Lock()

    # ---- banks ----
    def upsert_bank(self, bank_id: str, display_name: str, config: BankConfig, at: float) -> None:
        with self._lock:
            self._db.execute(
                "INSERT INTO banks VALUES (?,?,?,?,?) ON CONFLICT(bank_id) DO UPDATE SET "
                "display_name=excluded.display_name, config=excluded.config, "
                "updated_at=excluded.updated_at",
                (bank_id, display_name, json.dumps(asdict(config)), at, at))

    def delete_bank(self, bank_id: str) -> None:
        with self._lock:
            self._db.execute("DELETE FROM banks WHERE bank_id=?", (bank_id,))

    def get_bank(self, bank_id: str) -> Bank | None:
        with self._lock:
            row = self._db.execute("SELECT * FROM banks WHERE bank_id=?", (bank_id,)).fetchone()
        return _bank(row) if row else None

    def list_banks(self, limit: int, after: str = "") -> list[Bank]:
        """Banks ordered by id, ``bank_id > after``, at most ``limit``."""
        with self._lock:
            rows = self._db.execute(
                "SELECT * FROM banks WHERE bank_id > ? ORDER BY bank_id LIMIT ?",
                (after, limit)).fetchall()
        return [_bank(r) for r in rows]

    # ---- operations ----
    def put_operation(self, op: Operation) -> None:
        """Insert the operation if it is new (a redelivered request keeps its progress)."""
        with self._lock:
            self._db.execute(
                "INSERT OR IGNORE INTO operations VALUES (?,?,?,?,?,?,?,?,?,?,?)",
                (op.operation_id, op.bank_id, op.kind, op.state, op.items_total,
                 op.items_done, op.facts, op.error, json.dumps(op.memory_ids),
                 op.created_at, op.updated_at))

    def update_operation(self, op: Operation) -> None:
        """Apply progress; a terminal state is never reverted by a late event."""
        with self._lock:
            row = self._db.execute("SELECT state, created_at FROM operations WHERE operation_id=?",
                                   (op.operation_id,)).fetchone()
            if row and row[0] in TERMINAL and op.state not in TERMINAL:
                return
            created = row[1] if row else op.created_at
            self._db.execute(
                "INSERT OR REPLACE INTO operations VALUES (?,?,?,?,?,?,?,?,?,?,?)",
                (op.operation_id, op.bank_id, op.kind, op.state, op.items_total,
                 op.items_done, op.facts, op.error, json.dumps(op.memory_ids),
                 created, op.updated_at))

    def get_operation(self, operation_id: str) -> Operation | None:
        with self._lock:
            row = self._db.execute("SELECT * FROM operations WHERE operation_id=?",
                                   (operation_id,)).fetchone()
        return _op(row) if row else None

    def list_operations(self, bank_id: str, limit: int, offset: int = 0) -> list[Operation]:
        """Newest first; ``bank_id`` empty lists every bank."""
        q = "SELECT * FROM operations"
        args: tuple = ()
        if bank_id:
            q += " WHERE bank_id=?"
            args = (bank_id,)
        q += " ORDER BY created_at DESC, operation_id LIMIT ? OFFSET ?"
        with self._lock:
            rows = self._db.execute(q, args + (limit, offset)).fetchall()
        return [_op(r) for r in rows]

    def reset(self) -> None:
        with self._lock:
            self._db.execute("DELETE FROM banks")
            self._db.execute("DELETE FROM operations")

    def close(self) -> None:
        with self._lock:
            self._db.close()


def _bank(row) -> Bank:
    return Bank(bank_id=row[0], display_name=row[1], config=BankConfig(**json.loads(row[2])),
                created_at=from_epoch(row[3]), updated_at=from_epoch(row[4]))


def _op(row) -> Operation:
    return Operation(operation_id=row[0], bank_id=row[1], kind=row[2], state=row[3],
                     items_total=row[4], items_done=row[5], facts=row[6], error=row[7],
                     memory_ids=json.loads(row[8]), created_at=row[9], updated_at=row[10])


def now() -> float:
    """Wall-clock epoch seconds (catalog bookkeeping only, never memory times)."""
    return time.time()
