"""The :class:`mneme.ports.EntityStore` in SQLite (``<data_dir>/entities.db``): extraction's
entity-resolution decisions per bank, so a restarted process resolves the same way.

Schema v2 (one row per entity, aliases naming entity ids); a file of the earlier
one-entity-per-key schema (v1: ``entities``/``aliases`` keyed by entity key) is migrated
on open with its ids unchanged. Mentions recorded before they named their memory (the
``mentions`` table: entity and scope only) are migrated with an empty fact id, which a
memory's deletion never drops, and files from before mentions were recorded have none;
:meth:`SqliteEntityStore.unrefined_mentions` tells that, and
:meth:`SqliteEntityStore.refine_mentions` records them per memory (from the facts on the
log, read by the composition root), once (``PRAGMA user_version`` 1 after).
"""

from __future__ import annotations

import sqlite3
import threading
from typing import Sequence

from mneme.ports import StoredEntity
from mneme.stores import sqlite_erase

_SCHEMA = """
CREATE TABLE IF NOT EXISTS entities_v2 (
  bank_id TEXT NOT NULL, id TEXT NOT NULL, key TEXT NOT NULL, name TEXT NOT NULL,
  label TEXT NOT NULL, kind TEXT NOT NULL, seq INTEGER NOT NULL, PRIMARY KEY (bank_id, id));
CREATE TABLE IF NOT EXISTS aliases_v2 (
  bank_id TEXT NOT NULL, alias TEXT NOT NULL, id TEXT NOT NULL,
  PRIMARY KEY (bank_id, alias, id));
CREATE TABLE IF NOT EXISTS mentions_v2 (
  bank_id TEXT NOT NULL, id TEXT NOT NULL, scope TEXT NOT NULL, fact TEXT NOT NULL,
  PRIMARY KEY (bank_id, id, scope, fact));
CREATE INDEX IF NOT EXISTS mentions_v2_scope ON mentions_v2(bank_id, scope);
CREATE INDEX IF NOT EXISTS mentions_v2_fact ON mentions_v2(bank_id, fact);
-- the decisions persisted with a cause (the event that took them), kept for the latest
-- DECISIONS_KEPT causes: what a redelivered event publishes again. what: "entity",
-- "claim" or "alias" (key: the alias; name, label, kind: ""); holder: the entity whose
-- deletion erases the row (its own, or the survivor it was merged into)
CREATE TABLE IF NOT EXISTS decided (
  seq INTEGER PRIMARY KEY AUTOINCREMENT, bank_id TEXT NOT NULL, cause TEXT NOT NULL,
  UNIQUE (bank_id, cause));
CREATE TABLE IF NOT EXISTS decisions (
  cause INTEGER NOT NULL, n INTEGER NOT NULL, what TEXT NOT NULL, id TEXT NOT NULL,
  key TEXT NOT NULL, name TEXT NOT NULL, label TEXT NOT NULL, kind TEXT NOT NULL,
  holder TEXT NOT NULL, PRIMARY KEY (cause, n));
CREATE INDEX IF NOT EXISTS decisions_holder ON decisions(holder);
"""

# Causes whose decisions are kept (the latest, in all banks). Only those of events whose
# outputs the log has not committed yet are needed: the embedded runner commits at most a
# batch (100 records) of a partition at a time, a Kafka consumer its fetched records.
DECISIONS_KEPT = 10_000
# mentions (one row per entity and scope) → mentions_v2 (and per fact: "" for the rows
# of before, which a memory's deletion then never drops: kept, as they were)
_MIGRATE_MENTIONS = """
INSERT OR IGNORE INTO mentions_v2(bank_id, id, scope, fact)
  SELECT bank_id, id, scope, '' FROM mentions;
DROP TABLE mentions;
"""
# PRAGMA user_version once the mentions migrated without their memories were given them
# from the log (:meth:`SqliteEntityStore.refine_mentions`; 0 before).
_REFINED = 1
# v1 (one entity per key, aliases by key) → v2; ids are kept as they were.
_MIGRATE_V1 = """
INSERT OR IGNORE INTO entities_v2(bank_id, id, key, name, label, kind, seq)
  SELECT bank_id, id, key, name, label, '', seq FROM entities;
INSERT OR IGNORE INTO aliases_v2(bank_id, alias, id)
  SELECT a.bank_id, a.alias, e.id FROM aliases a JOIN entities e
  ON e.bank_id = a.bank_id AND e.key = a.key ORDER BY a.rowid;
DROP TABLE aliases;
DROP TABLE entities;
"""

# spaCy label → kind as the resolver mapped them when v2 came (``resolver.kind_of``): v1
# rows had no kind column, so the migration derives it from the stored label. Frozen
# here on purpose: a migration must give the same result whatever the rules become.
_V1_KINDS = {"PERSON": "person", "ORG": "org", "GPE": "place", "LOC": "place", "FAC": "place",
             "NORP": "thing", "EVENT": "thing", "WORK_OF_ART": "thing", "PRODUCT": "thing",
             "LANGUAGE": "thing", "LAW": "thing"}


class SqliteEntityStore:
    """Entities and aliases in one SQLite file (``path``, created if missing; ":memory:"
    for tests). Entities are ordered by a process-wide ``seq`` (creation order), aliases
    by rowid. Thread-safe (one lock)."""

    def __init__(self, path: str):
        self._lock = threading.Lock()
        self._db = sqlite3.connect(path, check_same_thread=False, isolation_level=None)
        self._db.execute("PRAGMA journal_mode=WAL")
        self._db.execute("PRAGMA synchronous=NORMAL")
        sqlite_erase.secure(self._db)  # a forgotten bank's names leave no bytes behind
        fresh = self._db.execute(
            "SELECT count(*) FROM sqlite_master WHERE type='table'").fetchone()[0] == 0
        self._db.executescript(_SCHEMA)
        self._migrate()
        if fresh:  # no mention of before to refine
            self._db.execute(f"PRAGMA user_version={_REFINED}")
        row = self._db.execute("SELECT COALESCE(MAX(seq), 0) FROM entities_v2").fetchone()
        self._seq = int(row[0])

    def _migrate(self) -> None:
        tables = {r[0] for r in self._db.execute(
            "SELECT name FROM sqlite_master WHERE type='table'")}
        if "mentions" in tables:
            self._db.executescript("BEGIN;" + _MIGRATE_MENTIONS + "COMMIT;")
        if "entities" not in tables:
            return
        self._db.executescript("BEGIN;" + _MIGRATE_V1 + "COMMIT;")
        # kinds from the stored labels (kept per row, so a v1 bank resolves as before)
        for id_, bank_id, label in self._db.execute(
                "SELECT id, bank_id, label FROM entities_v2 WHERE kind=''").fetchall():
            kind = _V1_KINDS.get((label or "").upper(), "")
            if kind:
                self._db.execute("UPDATE entities_v2 SET kind=? WHERE bank_id=? AND id=?",
                                 (kind, bank_id, id_))

    def unrefined_mentions(self) -> bool:
        """True when mentions from before they named their memories (fact id "", or no
        mention at all: files from before mentions were recorded) wait for
        :meth:`refine_mentions`."""
        with self._lock:
            (version,) = self._db.execute("PRAGMA user_version").fetchone()
            if version >= _REFINED:
                return False
            return self._db.execute(
                "SELECT 1 FROM mentions_v2 WHERE fact='' UNION ALL SELECT 1 FROM entities_v2 e "
                "WHERE NOT EXISTS (SELECT 1 FROM mentions_v2 m WHERE m.bank_id=e.bank_id "
                "AND m.id=e.id) LIMIT 1").fetchone() is not None

    def refine_mentions(self, by_bank: dict[str, Sequence[tuple[str, str, str]]]) -> int:
        """Record the mentions ``by_bank`` (bank id → [(entity id, scope, fact id)], the
        facts on the log) of the entities this file knows, in one transaction, and drop
        each mention without a memory they refine (same entity and scope; one they do not
        cover stays as it was). Marks the file refined (:meth:`unrefined_mentions` False
        from then on). Returns the mentions without a memory that were dropped."""
        with self._lock, self._db:
            self._db.execute("BEGIN")
            for bank_id, rows in by_bank.items():
                self._db.executemany(
                    "INSERT OR IGNORE INTO mentions_v2(bank_id, id, scope, fact) "
                    "SELECT bank_id, id, ?, ? FROM entities_v2 WHERE bank_id=? AND id=?",
                    [(sc, f, bank_id, i) for i, sc, f in rows if f])
            dropped = self._db.execute(
                "DELETE FROM mentions_v2 WHERE fact='' AND EXISTS (SELECT 1 FROM mentions_v2 m "
                "WHERE m.bank_id=mentions_v2.bank_id AND m.id=mentions_v2.id "
                "AND m.scope=mentions_v2.scope AND m.fact<>'')").rowcount
            self._db.execute(f"PRAGMA user_version={_REFINED}")
        return dropped

    def load(self, bank_id: str) -> tuple[list[StoredEntity], list[tuple[str, str]]]:
        """The bank's entities by ``seq`` and its (alias, entity id) pairs by rowid."""
        with self._lock:
            entities = [StoredEntity(id=i, key=k, name=n, label=lb, kind=kd)
                        for i, k, n, lb, kd in self._db.execute(
                            "SELECT id, key, name, label, kind FROM entities_v2 "
                            "WHERE bank_id=? ORDER BY seq", (bank_id,))]
            aliases = [(a, i) for a, i in self._db.execute(
                "SELECT alias, id FROM aliases_v2 WHERE bank_id=? ORDER BY rowid", (bank_id,))]
        return entities, aliases

    def persist(self, bank_id: str, entities: Sequence[StoredEntity] = (),
                claims: Sequence[StoredEntity] = (),
                aliases: Sequence[tuple[str, str]] = (), cause: str = "") -> None:
        """One transaction: new entities (next ``seq`` each, a known id ignored), claims
        (label and kind), aliases (a known pair ignored), and with a ``cause`` all of
        them recorded under it (:meth:`decisions`)."""
        if not (entities or claims or aliases):
            return
        with self._lock, self._db:
            self._db.execute("BEGIN")
            if cause:
                self._record(bank_id, cause, entities, claims, aliases)
            for e in entities:
                self._seq += 1  # monotonic across banks and forgets, as before the port
                self._db.execute(
                    "INSERT OR IGNORE INTO entities_v2(bank_id, id, key, name, label, kind, seq)"
                    " VALUES (?,?,?,?,?,?,?)",
                    (bank_id, e.id, e.key, e.name, e.label, e.kind, self._seq))
            for e in claims:
                self._db.execute("UPDATE entities_v2 SET label=?, kind=? WHERE bank_id=? AND id=?",
                                 (e.label, e.kind, bank_id, e.id))
            self._db.executemany("INSERT OR IGNORE INTO aliases_v2(bank_id, alias, id) "
                                 "VALUES (?,?,?)", [(bank_id, a, i) for a, i in aliases])

    def _record(self, bank_id: str, cause: str, entities: Sequence[StoredEntity],
                claims: Sequence[StoredEntity], aliases: Sequence[tuple[str, str]]) -> None:
        """Append the decisions to those of ``cause`` (inside persist's transaction) and
        drop the causes beyond the latest :data:`DECISIONS_KEPT`."""
        self._db.execute("INSERT OR IGNORE INTO decided(bank_id, cause) VALUES (?,?)",
                         (bank_id, cause))
        (seq,) = self._db.execute("SELECT seq FROM decided WHERE bank_id=? AND cause=?",
                                  (bank_id, cause)).fetchone()
        (n,) = self._db.execute("SELECT COALESCE(MAX(n), 0) FROM decisions WHERE cause=?",
                                (seq,)).fetchone()
        rows = [*(("entity", e.id, e.key, e.name, e.label, e.kind) for e in entities),
                *(("claim", e.id, e.key, e.name, e.label, e.kind) for e in claims),
                *(("alias", i, a, "", "", "") for a, i in aliases)]
        self._db.executemany(
            "INSERT INTO decisions(cause, n, what, id, key, name, label, kind, holder) "
            "VALUES (?,?,?,?,?,?,?,?,?)", [(seq, n + k, *r, r[1]) for k, r in enumerate(rows, 1)])
        (last,) = self._db.execute("SELECT MAX(seq) FROM decided").fetchone()
        if last > DECISIONS_KEPT:
            self._db.execute("DELETE FROM decisions WHERE cause <= ?", (last - DECISIONS_KEPT,))
            self._db.execute("DELETE FROM decided WHERE seq <= ?", (last - DECISIONS_KEPT,))

    def decisions(self, bank_id: str, cause: str) -> tuple[list[StoredEntity],
                                                          list[StoredEntity],
                                                          list[tuple[str, str]]]:
        """See :meth:`mneme.ports.EntityStore.decisions`."""
        out: tuple[list, list, list] = ([], [], [])
        with self._lock:
            rows = self._db.execute(
                "SELECT d.what, d.id, d.key, d.name, d.label, d.kind FROM decisions d "
                "JOIN decided c ON c.seq = d.cause WHERE c.bank_id=? AND c.cause=? "
                "ORDER BY d.n", (bank_id, cause)).fetchall()
        for what, i, k, n, lb, kd in rows:
            if what == "alias":
                out[2].append((k, i))
            else:
                out[0 if what == "entity" else 1].append(StoredEntity(i, k, n, lb, kd))
        return out

    def rewrite(self, bank_id: str, entities: Sequence[StoredEntity] = (),
                aliases: Sequence[tuple[str, str]] = (), removed: Sequence[str] = (),
                mentions_of: Sequence[tuple[str, str]] = ()) -> None:
        """One transaction (see :meth:`mneme.ports.EntityStore.rewrite`); a removed
        entity's rows are overwritten in the file (names are user content)."""
        if not (entities or aliases or removed or mentions_of):
            return
        touched = list(dict.fromkeys([*(e.id for e in entities), *removed]))
        with self._lock, self._db:
            self._db.execute("BEGIN")
            for e in entities:
                updated = self._db.execute(
                    "UPDATE entities_v2 SET key=?, name=?, label=?, kind=? "
                    "WHERE bank_id=? AND id=?", (e.key, e.name, e.label, e.kind, bank_id, e.id))
                if not updated.rowcount:
                    self._seq += 1
                    self._db.execute(
                        "INSERT INTO entities_v2(bank_id, id, key, name, label, kind, seq)"
                        " VALUES (?,?,?,?,?,?,?)",
                        (bank_id, e.id, e.key, e.name, e.label, e.kind, self._seq))
            for i, src in mentions_of:
                self._db.execute(
                    "INSERT OR IGNORE INTO mentions_v2(bank_id, id, scope, fact) "
                    "SELECT bank_id, ?, scope, fact FROM mentions_v2 WHERE bank_id=? AND id=?",
                    (i, bank_id, src))
            self._db.executemany("DELETE FROM aliases_v2 WHERE bank_id=? AND id=?",
                                 [(bank_id, i) for i in touched])
            self._db.executemany("INSERT OR IGNORE INTO aliases_v2(bank_id, alias, id) "
                                 "VALUES (?,?,?)", [(bank_id, a, i) for a, i in aliases])
            for i, src in mentions_of:  # a merged entity's records go with the survivor
                if src in removed:
                    self._db.execute(
                        "UPDATE decisions SET holder=? WHERE holder=? AND cause IN "
                        "(SELECT seq FROM decided WHERE bank_id=?)", (i, src, bank_id))
            for i in removed:
                self._db.execute("DELETE FROM entities_v2 WHERE bank_id=? AND id=?",
                                 (bank_id, i))
                self._db.execute("DELETE FROM mentions_v2 WHERE bank_id=? AND id=?",
                                 (bank_id, i))

    def add_mentions(self, bank_id: str, mentions: Sequence[tuple[str, ...]]) -> None:
        if not mentions:
            return
        rows = [(bank_id, i, s, fact[0] if fact else "") for i, s, *fact in mentions]
        with self._lock, self._db:
            self._db.executemany("INSERT OR IGNORE INTO mentions_v2(bank_id, id, scope, fact) "
                                 "VALUES (?,?,?,?)", rows)

    def drop_scope(self, bank_id: str, scope: str) -> list[str]:
        return self._drop(bank_id, "scope=?", [scope])

    def drop_facts(self, bank_id: str, fact_ids: Sequence[str]) -> list[str]:
        facts = [f for f in dict.fromkeys(fact_ids) if f]
        gone: list[str] = []
        for k in range(0, len(facts), 500):  # (SQLite's bound on parameters)
            chunk = facts[k:k + 500]
            gone += self._drop(bank_id, f"fact IN ({','.join('?' * len(chunk))})", chunk)
        return gone

    def _drop(self, bank_id: str, where: str, params: list[str]) -> list[str]:
        """Delete the mention rows ``where`` selects, then the entities (and aliases)
        left without one: their ids."""
        with self._lock:
            ids = list(dict.fromkeys(r[0] for r in self._db.execute(
                f"SELECT id FROM mentions_v2 WHERE bank_id=? AND {where}", [bank_id, *params])))
            if not ids:
                return []
            with self._db:
                self._db.execute("BEGIN")
                self._db.execute(f"DELETE FROM mentions_v2 WHERE bank_id=? AND {where}",
                                 [bank_id, *params])
                gone = [i for i in ids if self._db.execute(
                    "SELECT 1 FROM mentions_v2 WHERE bank_id=? AND id=? LIMIT 1",
                    (bank_id, i)).fetchone() is None]
                for i in gone:
                    self._delete_entity(bank_id, i)
            if gone:
                sqlite_erase.truncate_wal(self._db)
            return gone

    def drop_entities(self, bank_id: str, entity_ids: Sequence[str]) -> list[str]:
        with self._lock:
            gone = [i for i in dict.fromkeys(entity_ids) if self._db.execute(
                "SELECT 1 FROM entities_v2 WHERE bank_id=? AND id=?", (bank_id, i)).fetchone()]
            if not gone:
                return []
            with self._db:
                self._db.execute("BEGIN")
                for i in gone:
                    self._delete_entity(bank_id, i)
            sqlite_erase.truncate_wal(self._db)
            return gone

    def _delete_entity(self, bank_id: str, entity_id: str) -> None:
        """The entity, its aliases, mentions and recorded decisions (in the caller's
        transaction)."""
        for table in ("entities_v2", "aliases_v2", "mentions_v2"):
            self._db.execute(f"DELETE FROM {table} WHERE bank_id=? AND id=?",
                             (bank_id, entity_id))
        self._db.execute("DELETE FROM decisions WHERE holder=? AND cause IN "
                         "(SELECT seq FROM decided WHERE bank_id=?)", (entity_id, bank_id))

    def forget(self, bank_id: str) -> None:
        """Drop the bank's entities, aliases, mentions and recorded decisions, overwritten
        in the file and out of the WAL (:mod:`~mneme.stores.sqlite_erase`)."""
        with self._lock:
            with self._db:
                self._db.execute("BEGIN")
                self._db.execute("DELETE FROM entities_v2 WHERE bank_id=?", (bank_id,))
                self._db.execute("DELETE FROM aliases_v2 WHERE bank_id=?", (bank_id,))
                self._db.execute("DELETE FROM mentions_v2 WHERE bank_id=?", (bank_id,))
                self._db.execute("DELETE FROM decisions WHERE cause IN "
                                 "(SELECT seq FROM decided WHERE bank_id=?)", (bank_id,))
                self._db.execute("DELETE FROM decided WHERE bank_id=?", (bank_id,))
            sqlite_erase.truncate_wal(self._db)

    def close(self) -> None:
        with self._lock:
            self._db.close()
