"""The catalog: banks and operations, a projection of ``mneme.intake.v1`` and
``mneme.progress.v1`` kept in SQLite (owned by the ingest service).

Writes are idempotent upserts, so redelivered events change nothing.
"""

from __future__ import annotations

import dataclasses
import json
import sqlite3
import threading
import time
from typing import Callable, Iterable
from dataclasses import asdict

from mneme.domain import (TERMINAL, Bank, BankConfig, Directive, MentalModel, MentalModelRevision,
                          Operation, erase_mental_model_sources, from_epoch, merge_directive,
                          merge_mental_model, merge_operation)
from mneme.stores import sqlite_erase

_SCHEMA = """
CREATE TABLE IF NOT EXISTS banks (
  bank_id TEXT PRIMARY KEY, display_name TEXT NOT NULL, config TEXT NOT NULL,
  created_at REAL NOT NULL, updated_at REAL NOT NULL, incarnation TEXT NOT NULL DEFAULT '');
CREATE TABLE IF NOT EXISTS operations (
  operation_id TEXT PRIMARY KEY, bank_id TEXT NOT NULL, kind TEXT NOT NULL,
  state TEXT NOT NULL, items_total INTEGER NOT NULL DEFAULT 0,
  items_done INTEGER NOT NULL DEFAULT 0, facts INTEGER NOT NULL DEFAULT 0,
  error TEXT NOT NULL DEFAULT '', memory_ids TEXT NOT NULL DEFAULT '[]',
  created_at REAL NOT NULL, updated_at REAL NOT NULL, item_errors TEXT NOT NULL DEFAULT '[]');
CREATE INDEX IF NOT EXISTS operations_bank ON operations (bank_id, created_at);
-- ListOperations' filters: a bank's operations of one state, or of one kind, newest first.
CREATE INDEX IF NOT EXISTS operations_state ON operations (bank_id, state, created_at);
CREATE INDEX IF NOT EXISTS operations_kind ON operations (bank_id, kind, created_at);
-- The operations not yet ended, for GetBankStats: counting them walks only these (with
-- 200k operations in a bank the one count of both took 73-116 ms; now 9-15 + 0.03 ms).
-- Its condition must read as count_operations' does for SQLite to use it.
CREATE INDEX IF NOT EXISTS operations_pending ON operations (bank_id)
  WHERE state NOT IN ('succeeded', 'failed');
-- Operations of deleted banks: late progress of one never brings it back.
CREATE TABLE IF NOT EXISTS deleted_operations (operation_id TEXT PRIMARY KEY);
CREATE TABLE IF NOT EXISTS directives (
  bank_id TEXT NOT NULL, directive_id TEXT NOT NULL, title TEXT NOT NULL, text TEXT NOT NULL,
  priority INTEGER NOT NULL, active INTEGER NOT NULL, tags TEXT NOT NULL,
  created_at REAL NOT NULL, updated_at REAL NOT NULL, PRIMARY KEY (bank_id, directive_id));
CREATE TABLE IF NOT EXISTS mental_models (
  bank_id TEXT NOT NULL, model_id TEXT NOT NULL, state TEXT NOT NULL,
  PRIMARY KEY (bank_id, model_id));
CREATE TABLE IF NOT EXISTS mental_model_revisions (
  bank_id TEXT NOT NULL, model_id TEXT NOT NULL, revision INTEGER NOT NULL, at REAL NOT NULL,
  content TEXT NOT NULL, based_on TEXT NOT NULL, source TEXT NOT NULL,
  mode TEXT NOT NULL DEFAULT '',
  PRIMARY KEY (bank_id, model_id, revision), UNIQUE (bank_id, model_id, at));
-- How many times each bank id was created (kept when the bank is deleted).
CREATE TABLE IF NOT EXISTS bank_generations (bank_id TEXT PRIMARY KEY, generation INTEGER NOT NULL);
"""

#: The counts of GetBankStats: all of a bank's operations (index-only) and those not yet
#: ended (on the partial index ``operations_pending``, whose condition this one must
#: repeat for SQLite to use it; named, since the planner would rather walk every one of
#: the bank's entries in ``operations_state``, and an error if it ever cannot use it).
COUNT_OPERATIONS = "SELECT count(*) FROM operations WHERE bank_id=?"
COUNT_PENDING_OPERATIONS = ("SELECT count(*) FROM operations INDEXED BY operations_pending "
                            "WHERE bank_id=? AND state NOT IN ('succeeded', 'failed')")
if set(TERMINAL) != {"succeeded", "failed"}:
    raise ImportError("operations_pending and COUNT_PENDING_OPERATIONS must follow TERMINAL")

# Columns added after the first release: (table, column, DDL) for older catalog files.
_MIGRATIONS = (("banks", "incarnation", "TEXT NOT NULL DEFAULT ''"),
               ("operations", "item_errors", "TEXT NOT NULL DEFAULT '[]'"),
               ("mental_model_revisions", "mode", "TEXT NOT NULL DEFAULT ''"),
               ("mental_model_revisions", "documents", "TEXT NOT NULL DEFAULT '[]'"),
               ("mental_model_revisions", "memory_offset", "INTEGER NOT NULL DEFAULT 0"),
               ("mental_model_revisions", "evidence", "TEXT NOT NULL DEFAULT '[]'"),
               ("operations", "cancel_requested", "INTEGER NOT NULL DEFAULT 0"),
               ("operations", "cancelled", "INTEGER NOT NULL DEFAULT 0"),
               ("operations", "retry_of", "TEXT NOT NULL DEFAULT ''"),
               ("operations", "source", "TEXT NOT NULL DEFAULT ''"))
_OP_COLUMNS = ("operation_id, bank_id, kind, state, items_total, items_done, facts, error, "
               "memory_ids, created_at, updated_at, item_errors, cancel_requested, cancelled, "
               "retry_of, source")
_OP_MARKS = ",".join("?" * 16)
_BANK_COLUMNS = "bank_id, display_name, config, created_at, updated_at, incarnation"
_DIRECTIVE_COLUMNS = ("bank_id, directive_id, title, text, priority, active, tags, created_at, "
                      "updated_at")


def mental_model_from_json(state: str) -> MentalModel:
    d = json.loads(state)
    return MentalModel(**{**d, "tags": tuple(d["tags"]), "based_on": tuple(d["based_on"]),
                          "based_on_documents": tuple(d.get("based_on_documents", ())),
                          "based_on_evidence": tuple(d.get("based_on_evidence", ()))})


def _directive(row) -> Directive:
    return Directive(id=row[1], bank_id=row[0], title=row[2], text=row[3], priority=row[4],
                     active=bool(row[5]), tags=tuple(json.loads(row[6])), created_at=row[7],
                     updated_at=row[8])


class SqliteCatalog:
    """Banks and operations in one SQLite file (``path``; ":memory:" for tests)."""

    def __init__(self, path: str):
        self._db = sqlite3.connect(path, check_same_thread=False, isolation_level=None)
        self._db.execute("PRAGMA journal_mode=WAL")
        self._db.execute("PRAGMA busy_timeout=10000")
        sqlite_erase.secure(self._db)  # a deleted bank's rows leave no bytes behind
        self._db.executescript(_SCHEMA)
        for table, column, ddl in _MIGRATIONS:
            have = {r[1] for r in self._db.execute(f"PRAGMA table_info({table})")}
            if column not in have:
                self._db.execute(f"ALTER TABLE {table} ADD COLUMN {column} {ddl}")
        self._lock = threading.Lock()

    # ---- banks ----
    def upsert_bank(self, bank_id: str, display_name: str, config: BankConfig, at: float,
                    mask: tuple[str, ...] = ()) -> None:
        """Create the bank or change it. A bank created again after a deletion is a new
        incarnation (:attr:`mneme.domain.Bank.incarnation`: 1, 2, … per creation of the
        id, counted from the log, so every projection and every replay agree), so its
        idempotency keys never collide with the old one's. An empty ``mask`` replaces
        name and config; otherwise only the fields it names change ("display_name",
        "config.<field>"), and a bank that does not exist is left absent (an update never
        creates)."""
        with self._lock:
            row = self._db.execute("SELECT display_name, config FROM banks WHERE bank_id=?",
                                   (bank_id,)).fetchone()
            if mask:
                if row is None:
                    return
                merged = json.loads(row[1])
                new = asdict(config)
                for path in mask:
                    if path.startswith("config.") and path[7:] in new:
                        merged[path[7:]] = new[path[7:]]
                display_name = display_name if "display_name" in mask else row[0]
                config_json = json.dumps(merged)
            else:
                config_json = json.dumps(asdict(config))
            incarnation = ""
            if row is None:
                gen = self._db.execute("SELECT generation FROM bank_generations WHERE bank_id=?",
                                       (bank_id,)).fetchone()
                n = (gen[0] if gen else 0) + 1
                self._db.execute("INSERT OR REPLACE INTO bank_generations VALUES (?,?)",
                                 (bank_id, n))
                incarnation = str(n)
                # the earlier incarnation's last operations (its DeleteBank's) go with it
                # (not those created since, projected before this from the progress topic)
                self._drop_operations(bank_id, "created_at < ?", at)
            self._db.execute(
                f"INSERT INTO banks ({_BANK_COLUMNS}) VALUES (?,?,?,?,?,?) ON CONFLICT(bank_id) "
                "DO UPDATE SET display_name=excluded.display_name, config=excluded.config, "
                "updated_at=excluded.updated_at",
                (bank_id, display_name, config_json, at, at, incarnation))

    def _drop_operations(self, bank_id: str, when: str, at: float | None) -> None:
        """The bank's operations ``when`` (a condition on created_at, with ``at``; all of
        them when ``at`` is None) deleted for good (their ids kept in deleted_operations)."""
        where, args = ("bank_id=?", (bank_id,)) if at is None else (
            f"bank_id=? AND {when}", (bank_id, at))
        self._db.execute("INSERT OR IGNORE INTO deleted_operations "
                         f"SELECT operation_id FROM operations WHERE {where}", args)
        self._db.execute(f"DELETE FROM operations WHERE {where}", args)

    def delete_bank(self, bank_id: str, at: float | None = None) -> None:
        """Delete the bank and its operations (they belong to this incarnation only: with
        ``at``, those created up to it); their rows are overwritten in the file and the
        WAL truncated (:mod:`~mneme.stores.sqlite_erase`)."""
        with self._lock:
            self._db.execute("DELETE FROM banks WHERE bank_id=?", (bank_id,))
            # A bank made before generations were counted was its first incarnation.
            self._db.execute("INSERT OR IGNORE INTO bank_generations VALUES (?, 1)", (bank_id,))
            self._drop_operations(bank_id, "created_at <= ?", at)
            self._db.execute("DELETE FROM directives WHERE bank_id=?", (bank_id,))
            self._db.execute("DELETE FROM mental_models WHERE bank_id=?", (bank_id,))
            self._db.execute("DELETE FROM mental_model_revisions WHERE bank_id=?", (bank_id,))
            sqlite_erase.truncate_wal(self._db)

    def get_bank(self, bank_id: str) -> Bank | None:
        with self._lock:
            row = self._db.execute(f"SELECT {_BANK_COLUMNS} FROM banks WHERE bank_id=?",
                                   (bank_id,)).fetchone()
        return _bank(row) if row else None

    def list_banks(self, limit: int, after: str = "") -> list[Bank]:
        """Banks ordered by id, ``bank_id > after``, at most ``limit``."""
        with self._lock:
            rows = self._db.execute(
                f"SELECT {_BANK_COLUMNS} FROM banks WHERE bank_id > ? ORDER BY bank_id LIMIT ?",
                (after, limit)).fetchall()
        return [_bank(r) for r in rows]

    # ---- operations ----
    def put_operation(self, op: Operation) -> None:
        """Insert the operation if it is new (a redelivered request keeps its progress;
        one whose progress was projected first gains ``source`` and ``retry_of``)."""
        with self._lock:
            if self._deleted(op.operation_id):
                return
            self._db.execute(
                f"INSERT OR IGNORE INTO operations ({_OP_COLUMNS}) VALUES ({_OP_MARKS})",
                _op_row(op, op.created_at))
            if op.source:  # its progress came first: what only the request knows
                self._db.execute("UPDATE operations SET source=?, retry_of=? WHERE "
                                 "operation_id=? AND source=''",
                                 (op.source, op.retry_of, op.operation_id))

    def update_operation(self, op: Operation) -> None:
        """Apply progress; the first terminal state is final (a late event, or a second
        verdict such as a dead letter after success, never changes it), and late progress
        of an operation of a deleted bank is dropped (it never reappears under a recreated
        bank)."""
        with self._lock:
            if self._deleted(op.operation_id):
                return
            row = self._db.execute(f"SELECT {_OP_COLUMNS} FROM operations WHERE operation_id=?",
                                   (op.operation_id,)).fetchone()
            old = _op(row) if row else None
            if old is not None and old.state in TERMINAL:
                return
            self._db.execute(
                f"INSERT OR REPLACE INTO operations ({_OP_COLUMNS}) VALUES ({_OP_MARKS})",
                _op_row(merge_operation(old, op), old.created_at if old else op.created_at))

    def _deleted(self, operation_id: str) -> bool:
        return self._db.execute("SELECT 1 FROM deleted_operations WHERE operation_id=?",
                                (operation_id,)).fetchone() is not None

    def get_operation(self, operation_id: str) -> Operation | None:
        with self._lock:
            row = self._db.execute(f"SELECT {_OP_COLUMNS} FROM operations WHERE operation_id=?",
                                   (operation_id,)).fetchone()
        return _op(row) if row else None

    def count_operations(self, bank_id: str) -> tuple[int, int]:
        """(operations, of which not yet terminal) of the bank: two index-only counts
        (all of the bank's, ~50 ns each; the pending ones in their partial index)."""
        with self._lock:  # (one connection: no write comes between the two)
            (total,) = self._db.execute(COUNT_OPERATIONS, (bank_id,)).fetchone()
            (pending,) = self._db.execute(COUNT_PENDING_OPERATIONS, (bank_id,)).fetchone()
        return int(total), int(pending)

    def list_operations(self, bank_id: str, limit: int,
                        after: tuple[float, str] | None = None, *, state: str = "",
                        kind: str = "") -> list[Operation]:
        """Newest first, after ``after`` (keyset: see the port), of ``state`` and
        ``kind`` when given (in the query, on the indexes operations_state and
        operations_kind); ``bank_id`` empty lists every bank."""
        where, args = [], []
        if bank_id:
            where.append("bank_id=?")
            args.append(bank_id)
        for column, value in (("state", state), ("kind", kind)):
            if value:
                where.append(f"{column}=?")
                args.append(value)
        if after is not None:
            where.append("(created_at < ? OR (created_at = ? AND operation_id > ?))")
            args += [after[0], after[0], after[1]]
        q = f"SELECT {_OP_COLUMNS} FROM operations"
        if where:
            q += " WHERE " + " AND ".join(where)
        q += " ORDER BY created_at DESC, operation_id LIMIT ?"
        with self._lock:
            rows = self._db.execute(q, (*args, limit)).fetchall()
        return [_op(r) for r in rows]

    # ---- directives ----
    def upsert_directive(self, d: Directive, mask: tuple[str, ...] = ()) -> None:
        with self._lock:
            if self._db.execute("SELECT 1 FROM banks WHERE bank_id=?", (d.bank_id,)).fetchone() is None:
                return
            d = merge_directive(self._directive(d.bank_id, d.id), d, mask)
            if d is None:
                return  # an update never creates
            self._db.execute(
                "INSERT OR REPLACE INTO directives VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?)",
                (d.bank_id, d.id, d.title, d.text, int(d.priority), int(bool(d.active)),
                 json.dumps(list(d.tags)), d.created_at, d.updated_at))

    def delete_directive(self, bank_id: str, directive_id: str) -> None:
        with self._lock:
            self._db.execute("DELETE FROM directives WHERE bank_id=? AND directive_id=?",
                             (bank_id, directive_id))

    def get_directive(self, bank_id: str, directive_id: str) -> Directive | None:
        with self._lock:
            return self._directive(bank_id, directive_id)

    def list_directives(self, bank_id: str, limit: int, after: str = "") -> list[Directive]:
        with self._lock:
            rows = self._db.execute(
                f"SELECT {_DIRECTIVE_COLUMNS} FROM directives WHERE bank_id=? AND directive_id>? "
                "ORDER BY directive_id LIMIT ?", (bank_id, after, max(limit, 0))).fetchall()
        return [_directive(r) for r in rows]

    # ---- mental models (the state as JSON: one row, one read) ----
    def upsert_mental_model(self, m: MentalModel, mask: tuple[str, ...] = (),
                            refresh: MentalModelRevision | None = None) -> None:
        with self._lock:
            if self._db.execute("SELECT 1 FROM banks WHERE bank_id=?", (m.bank_id,)).fetchone() is None:
                return
            old = self._mental_model(m.bank_id, m.id)
            new, revision = merge_mental_model(old, m, mask, refresh)
            if new is None:
                return
            self._db.execute("BEGIN IMMEDIATE")
            try:
                if revision is not None:
                    top = self._db.execute(
                        "SELECT coalesce(max(revision), 0) FROM mental_model_revisions "
                        "WHERE bank_id=? AND model_id=?", (m.bank_id, m.id)).fetchone()[0]
                    self._insert_revision(m.bank_id, m.id,
                                          dataclasses.replace(revision, revision=top + 1))
                n = self._db.execute("SELECT coalesce(max(revision), 0) FROM mental_model_revisions "
                                     "WHERE bank_id=? AND model_id=?", (m.bank_id, m.id)).fetchone()[0]
                new = dataclasses.replace(new, revision=n)
                self._db.execute("INSERT OR REPLACE INTO mental_models VALUES (?, ?, ?)",
                                 (m.bank_id, m.id, json.dumps(dataclasses.asdict(new))))
                self._db.execute("COMMIT")
            except BaseException:
                if self._db.in_transaction:  # (SQLite may have rolled it back itself)
                    self._db.execute("ROLLBACK")
                raise

    def _insert_revision(self, bank_id: str, model_id: str, r: MentalModelRevision) -> None:
        self._db.execute(
            "INSERT OR IGNORE INTO mental_model_revisions (bank_id, model_id, revision, at, "
            "content, based_on, source, mode, documents, memory_offset, evidence) "
            "VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?)",
            (bank_id, model_id, r.revision, r.at, r.content, json.dumps(list(r.based_on)),
             r.source, r.mode, json.dumps(list(r.documents)), r.memory_offset,
             json.dumps(list(r.evidence))))

    def erase_mental_model_sources(self, bank_id: str, memory_ids: Iterable[str],
                                   document_id: str = "",
                                   gone: Callable[[str], bool] | None = None) -> int:
        """See :meth:`mneme.ports.Catalog.erase_mental_model_sources`; the models citing
        them are found by SQLite's ``json_each`` over the revisions."""
        ids = sorted(set(memory_ids))
        marks = ",".join("?" * len(ids))
        cited = (f"EXISTS (SELECT 1 FROM json_each(based_on) WHERE value IN ({marks})) OR "
                 f"EXISTS (SELECT 1 FROM json_each(evidence) WHERE value IN ({marks}))"
                 if ids else "0")
        # revisions citing observations are candidates whenever ``gone`` may judge them
        observed = "evidence != '[]'" if gone is not None else "0"
        with self._lock:
            # "\x00" matches no document: an empty document_id erases by memory id only
            models = [r[0] for r in self._db.execute(
                "SELECT DISTINCT model_id FROM mental_model_revisions WHERE bank_id=? AND "
                f"({cited} OR {observed} OR "
                "EXISTS (SELECT 1 FROM json_each(documents) WHERE value=?))",
                (bank_id, *ids, *ids, document_id or "\x00"))]
            changed = 0
            for model_id in models:
                old = self._mental_model(bank_id, model_id)
                out = old and erase_mental_model_sources(
                    old, self._revisions(bank_id, model_id), set(ids), document_id, gone)
                if not out:
                    continue
                new, kept = out
                self._db.execute("BEGIN IMMEDIATE")
                try:
                    self._db.execute("DELETE FROM mental_model_revisions WHERE bank_id=? AND "
                                     "model_id=?", (bank_id, model_id))
                    for r in kept:
                        self._insert_revision(bank_id, model_id, r)
                    self._db.execute("INSERT OR REPLACE INTO mental_models VALUES (?, ?, ?)",
                                     (bank_id, model_id, json.dumps(dataclasses.asdict(new))))
                    self._db.execute("COMMIT")
                except BaseException:
                    if self._db.in_transaction:  # (SQLite may have rolled it back itself)
                        self._db.execute("ROLLBACK")
                    raise
                changed += 1
            if changed:
                sqlite_erase.truncate_wal(self._db)  # the erased contents' old pages
        return changed

    def delete_mental_model(self, bank_id: str, model_id: str) -> None:
        with self._lock:
            self._db.execute("DELETE FROM mental_models WHERE bank_id=? AND model_id=?",
                             (bank_id, model_id))
            self._db.execute("DELETE FROM mental_model_revisions WHERE bank_id=? AND model_id=?",
                             (bank_id, model_id))

    def get_mental_model(self, bank_id: str, model_id: str) -> MentalModel | None:
        with self._lock:
            return self._mental_model(bank_id, model_id)

    def list_mental_models(self, bank_id: str, limit: int, after: str = "") -> list[MentalModel]:
        with self._lock:
            rows = self._db.execute(
                "SELECT state FROM mental_models WHERE bank_id=? AND model_id>? "
                "ORDER BY model_id LIMIT ?", (bank_id, after, max(limit, 0))).fetchall()
        return [mental_model_from_json(r[0]) for r in rows]

    def mental_model_revisions(self, bank_id: str, model_id: str) -> list[MentalModelRevision]:
        with self._lock:
            return self._revisions(bank_id, model_id)

    def _revisions(self, bank_id: str, model_id: str) -> list[MentalModelRevision]:
        rows = self._db.execute(
            "SELECT revision, content, based_on, source, at, mode, documents, memory_offset, "
            "evidence FROM mental_model_revisions WHERE bank_id=? AND model_id=? "
            "ORDER BY revision", (bank_id, model_id)).fetchall()
        return [MentalModelRevision(r[0], r[1], tuple(json.loads(r[2])), r[3], r[4], r[5],
                                    tuple(json.loads(r[6])), r[7], tuple(json.loads(r[8])))
                for r in rows]

    def _mental_model(self, bank_id: str, model_id: str) -> MentalModel | None:
        row = self._db.execute("SELECT state FROM mental_models WHERE bank_id=? AND model_id=?",
                               (bank_id, model_id)).fetchone()
        return mental_model_from_json(row[0]) if row else None

    def _directive(self, bank_id: str, directive_id: str) -> Directive | None:
        row = self._db.execute(f"SELECT {_DIRECTIVE_COLUMNS} FROM directives "
                               "WHERE bank_id=? AND directive_id=?", (bank_id, directive_id)).fetchone()
        return _directive(row) if row else None

    def reset(self) -> None:
        with self._lock:
            self._db.execute("DELETE FROM banks")
            self._db.execute("DELETE FROM directives")
            self._db.execute("DELETE FROM mental_models")
            self._db.execute("DELETE FROM mental_model_revisions")
            self._db.execute("DELETE FROM operations")
            self._db.execute("DELETE FROM deleted_operations")
            self._db.execute("DELETE FROM bank_generations")

    def close(self) -> None:
        with self._lock:
            self._db.close()


def _bank(row) -> Bank:
    known = BankConfig.__dataclass_fields__
    config = BankConfig(**{k: v for k, v in json.loads(row[2]).items() if k in known})
    return Bank(bank_id=row[0], display_name=row[1], config=config,
                created_at=from_epoch(row[3]), updated_at=from_epoch(row[4]),
                incarnation=row[5] or "")


def _op_row(op: Operation, created: float) -> tuple:
    return (op.operation_id, op.bank_id, op.kind, op.state, op.items_total, op.items_done,
            op.facts, op.error, json.dumps(op.memory_ids), created, op.updated_at,
            json.dumps([list(e) for e in op.item_errors]), int(op.cancel_requested),
            int(op.cancelled), op.retry_of, op.source)


def _op(row) -> Operation:
    return Operation(operation_id=row[0], bank_id=row[1], kind=row[2], state=row[3],
                     items_total=row[4], items_done=row[5], facts=row[6], error=row[7],
                     memory_ids=json.loads(row[8]), created_at=row[9], updated_at=row[10],
                     item_errors=[tuple(e) for e in json.loads(row[11] or "[]")],
                     cancel_requested=bool(row[12]), cancelled=bool(row[13]), retry_of=row[14],
                     source=row[15])


def now() -> float:
    """Wall-clock epoch seconds (catalog bookkeeping only, never memory times)."""
    return time.time()
