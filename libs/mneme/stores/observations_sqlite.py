"""consolidation's :class:`mneme.ports.ObservationStore` in SQLite
(``<data_dir>/observations.db``): the facts it has seen (with their scopes and whether they are consolidated) and the current state of
every observation. Rebuilt on replay from ``FactsExtracted`` / ``FactsRetracted`` /
``ObservationsChanged`` alone (no model), so it matches what the live service held.

Observation states are stored as deterministic protobuf bytes (``ev.Observation``);
:meth:`apply` keeps the highest ``version`` of each, so re-applying an event it already
applied (its own decision coming back from the log, a redelivery) changes nothing. A
deleted observation is kept as a :func:`tombstone` (its version, without its text,
evidence or history), so nothing of the facts it was built from outlives them.

Deleted rows leave no bytes in the file (:mod:`mneme.stores.sqlite_erase`: secure_delete,
and the WAL truncated after every call that deleted something).

:meth:`transaction` makes one event's writes one commit, together with the decisions
(outputs) the event made (:meth:`record_decision`): the log commits those outputs only
after the store has, so a process killed in between gets the event again and must send
the same decisions (:meth:`decision`) instead of deciding anew from a state that already
holds them.
"""

from __future__ import annotations

import json
import sqlite3
import threading
from contextlib import contextmanager
from typing import Iterable, Iterator, Sequence

from google.protobuf.message import Message

from mneme.bus.codec import opinion_tombstone, tombstone
from mneme.events.v1 import events_pb2 as ev
from mneme.stores import sqlite_erase
from mneme.stores.revisions import Revisions

_SCHEMA = """
CREATE TABLE IF NOT EXISTS facts (
  bank_id TEXT NOT NULL, id TEXT NOT NULL, seq INTEGER NOT NULL, document_id TEXT NOT NULL,
  scopes TEXT NOT NULL, consolidated INTEGER NOT NULL DEFAULT 0, data BLOB NOT NULL,
  PRIMARY KEY (bank_id, id));
CREATE INDEX IF NOT EXISTS facts_doc ON facts (bank_id, document_id);
-- MAX(seq) for each batch of new facts, and a bank's pending facts in arrival order:
-- without them both scan every fact held (each retain then costs O(facts in the store))
CREATE INDEX IF NOT EXISTS facts_seq ON facts (seq);
CREATE INDEX IF NOT EXISTS facts_pending ON facts (bank_id, consolidated, seq);
CREATE TABLE IF NOT EXISTS observations (
  bank_id TEXT NOT NULL, id TEXT NOT NULL, scope TEXT NOT NULL, version INTEGER NOT NULL,
  deleted INTEGER NOT NULL, data BLOB NOT NULL, PRIMARY KEY (bank_id, id));
CREATE INDEX IF NOT EXISTS obs_scope ON observations (bank_id, scope);
-- opinions: their states, and which entities each is about (the candidates a new fact
-- about those entities may revise)
CREATE TABLE IF NOT EXISTS opinions (
  bank_id TEXT NOT NULL, id TEXT NOT NULL, version INTEGER NOT NULL, deleted INTEGER NOT NULL,
  data BLOB NOT NULL, PRIMARY KEY (bank_id, id));
CREATE TABLE IF NOT EXISTS opinion_entities (
  bank_id TEXT NOT NULL, entity_id TEXT NOT NULL, opinion_id TEXT NOT NULL,
  PRIMARY KEY (bank_id, entity_id, opinion_id));
CREATE TABLE IF NOT EXISTS counters (name TEXT PRIMARY KEY, value INTEGER NOT NULL);
-- the outputs of the latest events decided (see record_decision), by causing event id;
-- older events' causes with no outputs (types '[]'): handled, not to be decided again
CREATE TABLE IF NOT EXISTS decisions (
  seq INTEGER PRIMARY KEY AUTOINCREMENT, bank_id TEXT NOT NULL, cause TEXT NOT NULL UNIQUE,
  types TEXT NOT NULL, data BLOB NOT NULL);
CREATE INDEX IF NOT EXISTS decisions_bank ON decisions (bank_id);
"""

# Decisions kept (the latest, in all banks). Only those of events whose outputs the log has
# not committed yet are needed: the embedded runner commits at most a batch (100 records)
# of a partition at a time, a Kafka consumer its fetched records.
DECISIONS_KEPT = 10_000


def _scope_key(tags: Iterable[str]) -> str:
    """The stored key of a scope (a tag set): JSON of the sorted, deduplicated tags."""
    return json.dumps(sorted(set(tags)))


class SqliteObservationStore:
    """The projection in one SQLite file (``path``; ":memory:" in tests). Thread-safe.

    Every write is one transaction, durable on return; ``durable=False`` (a replay's
    build of a new generation, deleted when the replay fails) writes without syncing
    until :meth:`flush` (a build makes a transaction per record: a WAL sync each
    took half of consolidation's replay)."""

    def __init__(self, path: str, durable: bool = True):
        self._db = sqlite3.connect(path, check_same_thread=False, isolation_level=None)
        self._db.execute("PRAGMA journal_mode=WAL")
        self._durable = durable
        if not durable:
            self._db.execute("PRAGMA synchronous=OFF")
        sqlite_erase.secure(self._db)
        self._db.executescript(_SCHEMA)
        self._lock = threading.RLock()
        self._changes = Revisions()  # of each bank's observations
        self._depth = 0  # open transaction() blocks
        self._erase = False  # a committed deletion is to truncate the WAL

    @contextmanager
    def transaction(self) -> Iterator[None]:
        """Every write inside is one SQLite transaction, committed when the outermost
        block ends and rolled back (all of it) when it raises; blocks nest. Holds the
        store's lock throughout (other threads wait)."""
        with self._lock:
            if self._depth:
                self._depth += 1
                try:
                    yield
                finally:
                    self._depth -= 1
                return
            self._db.execute("BEGIN")
            self._depth = 1
            try:
                yield
                self._depth = 0
                self._db.execute("COMMIT")
            except BaseException:
                self._depth, self._erase = 0, False
                # SQLite rolls the whole transaction back itself on some errors (a full
                # disk, an I/O error), and a failed COMMIT may leave it open: roll back
                # what is left, and drop the states kept either way
                self._changes.reset()  # what callers kept may hold rolled-back states
                if self._db.in_transaction:
                    self._db.execute("ROLLBACK")
                raise
            if self._erase:
                self._erase = False
                sqlite_erase.truncate_wal(self._db)

    def decision(self, cause: str) -> list[Message] | None:
        """The outputs recorded for the event ``cause`` (:meth:`record_decision`): [] once
        they were forgotten (beyond the latest :data:`DECISIONS_KEPT`, or when the bank
        forgot facts since), None when it was not decided here (see the port for the one
        case in which forgotten outputs were not on the log)."""
        with self._lock:
            row = self._db.execute("SELECT types, data FROM decisions WHERE cause=?",
                                   (cause,)).fetchone()
        if row is None:
            return None
        out, data, at = [], row[1], 0
        for name in json.loads(row[0]):  # each message: 4-byte length, then its bytes
            n = int.from_bytes(data[at:at + 4], "big")
            out.append(getattr(ev, name).FromString(data[at + 4:at + 4 + n]))
            at += 4 + n
        return out

    def record_decision(self, bank_id: str, cause: str, outputs: Sequence[Message]) -> None:
        """Keep the outputs (``mneme.events.v1`` messages) the event ``cause`` of
        ``bank_id`` decided, in the transaction that holds its writes; the outputs of the
        oldest beyond :data:`DECISIONS_KEPT` are dropped, and a bank's when it forgets
        facts (they may quote them), but not their causes (see :meth:`decision`)."""
        blobs = [m.SerializeToString(deterministic=True) for m in outputs]
        with self.transaction():
            cur = self._db.execute(
                "INSERT OR REPLACE INTO decisions (bank_id, cause, types, data) VALUES (?,?,?,?)",
                (bank_id, cause, json.dumps([type(m).DESCRIPTOR.name for m in outputs]),
                 b"".join(len(b).to_bytes(4, "big") + b for b in blobs)))
            # beyond the latest DECISIONS_KEPT only the cause stays (the event was
            # handled: its outputs are on the log), so that a group reset to earlier
            # offsets does not decide it again against a later state
            self._db.execute("UPDATE decisions SET types='[]', data=x'' WHERE seq = ?",
                             (cur.lastrowid - DECISIONS_KEPT,))

    def revision(self, bank_id: str) -> tuple[int, int, int]:
        """See :meth:`mneme.ports.ObservationStore.revision`."""
        with self._lock:
            return self._changes.of(bank_id)

    def close(self) -> None:
        self._db.close()

    def flush(self) -> None:
        """Make every write so far durable: a store opened with ``durable=False`` copies
        its WAL into the database file and syncs it (a checkpoint under
        ``synchronous=FULL``), then writes as a durable one; nothing otherwise."""
        with self._lock:
            if self._durable:
                return
            self._db.execute("PRAGMA synchronous=FULL")
            self._db.execute("PRAGMA wal_checkpoint(TRUNCATE)")
            self._durable = True

    def reset(self) -> None:
        """Forget everything (replay rebuilds it)."""
        with self._lock:
            self._db.executescript("DELETE FROM facts; DELETE FROM observations; DELETE FROM counters; "
                                   "DELETE FROM opinions; DELETE FROM opinion_entities; "
                                   "DELETE FROM decisions;")
            self._changes.reset()
            sqlite_erase.truncate_wal(self._db)

    # ---- facts --------------------------------------------------------------------------

    def add_facts(self, bank_id: str, facts: Iterable[tuple[ev.Fact, list[list[str]]]]) -> None:
        """Record facts (pending) with their scopes; a known fact keeps its state. One
        transaction (one commit, not one per fact: each is a WAL sync)."""
        with self.transaction():
            seq = self._db.execute("SELECT COALESCE(MAX(seq), 0) FROM facts").fetchone()[0]
            self._db.executemany(
                "INSERT OR IGNORE INTO facts VALUES (?,?,?,?,?,0,?)",
                [(bank_id, f.id, seq + n, f.document_id, json.dumps(scopes),
                  f.SerializeToString(deterministic=True))
                 for n, (f, scopes) in enumerate(facts, 1)])

    def facts(self, bank_id: str, ids: Iterable[str] | None = None, pending: bool = False
              ) -> list[tuple[ev.Fact, list[list[str]]]]:
        """Facts (in arrival order) with their scopes: those of ``ids``, or all (only the
        unconsolidated ones with ``pending``). With ``ids`` only those rows are read, so
        the cost follows ``ids``, not the bank."""
        q = "SELECT seq, data, scopes FROM facts WHERE bank_id=?"
        if pending:
            q += " AND consolidated=0"
        with self._lock:
            if ids is None:
                rows = self._db.execute(q + " ORDER BY seq", (bank_id,)).fetchall()
            else:
                want, rows = sorted(set(ids)), []
                for i in range(0, len(want), 500):  # SQLite's bound on host parameters
                    part = want[i:i + 500]
                    rows += self._db.execute(f"{q} AND id IN ({','.join('?' * len(part))})",
                                             (bank_id, *part)).fetchall()
                rows.sort()
        return [(ev.Fact.FromString(d), json.loads(s)) for _, d, s in rows]

    def facts_by_id(self, bank_id: str, ids: Iterable[str]) -> dict[str, ev.Fact]:
        """id → fact for those of ``ids`` the store holds (unknown ids are left out)."""
        want = sorted(set(ids))
        out: dict[str, ev.Fact] = {}
        with self._lock:
            for i in range(0, len(want), 500):  # SQLite's bound on host parameters
                part = want[i:i + 500]
                q = f"SELECT id, data FROM facts WHERE bank_id=? AND id IN ({','.join('?' * len(part))})"
                out.update((r[0], ev.Fact.FromString(r[1]))
                           for r in self._db.execute(q, [bank_id, *part]))
        return out

    def fact_ids_of_document(self, bank_id: str, document_id: str) -> list[str]:
        with self._lock:
            return [r[0] for r in self._db.execute(
                "SELECT id FROM facts WHERE bank_id=? AND document_id=? ORDER BY seq",
                (bank_id, document_id))]

    def delete_facts(self, bank_id: str, ids: Iterable[str]) -> None:
        """Forget these facts (one transaction; the WAL truncated when any was held)."""
        with self._lock:
            before = self._db.total_changes
            with self.transaction():
                self._db.executemany("DELETE FROM facts WHERE bank_id=? AND id=?",
                                     [(bank_id, i) for i in ids])
                if self._db.total_changes != before:  # the outputs may quote the facts
                    self._db.execute("UPDATE decisions SET types='[]', data=x'' "
                                     "WHERE bank_id=?", (bank_id,))
                    self._erase = True

    def delete_bank(self, bank_id: str) -> None:
        with self.transaction():
            for table in ("facts", "observations", "opinions", "opinion_entities",
                          "decisions"):
                self._db.execute(f"DELETE FROM {table} WHERE bank_id=?", (bank_id,))
            self._changes.bump(bank_id)
            self._erase = True

    def _mark(self, bank_id: str, ids: Iterable[str], consolidated: int) -> None:
        self._db.executemany("UPDATE facts SET consolidated=? WHERE bank_id=? AND id=?",
                             [(consolidated, bank_id, i) for i in ids])

    def replace_vectors(self, bank_id: str, vectors: dict[str, list[float]], model: str) -> None:
        """A re-embed: the facts, observations and opinions of ``bank_id`` among
        ``vectors`` (id → vector) get their new vector (observations and opinions also
        ``model`` as their ``embedding_model``; versions unchanged). Unknown ids are
        skipped. One transaction. Idempotent."""
        if not vectors:
            return
        ids = sorted(vectors)
        with self.transaction():
            for table, cls in (("facts", ev.Fact), ("observations", ev.Observation),
                               ("opinions", ev.Opinion)):
                for i in range(0, len(ids), 500):  # SQLite's bound on host parameters
                    part = ids[i:i + 500]
                    rows = self._db.execute(
                        f"SELECT id, data FROM {table} WHERE bank_id=? AND id IN "
                        f"({','.join('?' * len(part))})", (bank_id, *part)).fetchall()
                    updates = []
                    for uid, data in rows:
                        msg = cls.FromString(data)
                        if getattr(msg, "deleted", False):
                            continue  # a tombstone keeps no vector
                        msg.embedding[:] = vectors[uid]
                        if table != "facts":
                            msg.embedding_model = model
                        updates.append((msg.SerializeToString(deterministic=True),
                                        bank_id, uid))
                    self._db.executemany(
                        f"UPDATE {table} SET data=? WHERE bank_id=? AND id=?", updates)
            self._changes.bump(bank_id)

    # ---- observations -------------------------------------------------------------------

    def observations(self, bank_id: str, scope: list[str] | None = None,
                     include_deleted: bool = False) -> dict[str, ev.Observation]:
        """id → state of the bank's observations (of one scope), live ones unless
        ``include_deleted``."""
        q, args = "SELECT data FROM observations WHERE bank_id=?", [bank_id]
        if scope is not None:
            q += " AND scope=?"
            args.append(_scope_key(scope))
        if not include_deleted:
            q += " AND deleted=0"
        with self._lock:
            rows = self._db.execute(q + " ORDER BY id", args).fetchall()
        return {o.id: o for o in (ev.Observation.FromString(r[0]) for r in rows)}

    def apply(self, m: ev.ObservationsChanged) -> None:
        """Apply one ObservationsChanged: upsert each state whose version is newer than
        the stored one (a deleted one as its :func:`tombstone`, after which the WAL is
        truncated); mark consolidated and reset facts. Idempotent."""
        with self.transaction():
            written = False
            for o in m.observations:
                row = self._db.execute("SELECT version FROM observations WHERE bank_id=? AND id=?",
                                       (m.bank_id, o.id)).fetchone()
                if row is not None and row[0] >= o.version:
                    continue
                written = True
                self._erase |= o.deleted and row is not None
                o = tombstone(o)
                self._db.execute("INSERT OR REPLACE INTO observations VALUES (?,?,?,?,?,?)",
                                 (m.bank_id, o.id, _scope_key(o.scope), o.version,
                                  int(o.deleted), o.SerializeToString(deterministic=True)))
            self._mark(m.bank_id, m.reset_memory_ids, 0)
            self._mark(m.bank_id, m.consolidated_memory_ids, 1)
            if written:
                self._changes.bump(m.bank_id)

    def counts(self, bank_id: str) -> tuple[int, int, int]:
        """(facts, consolidated facts, observation states incl. deleted) of the bank."""
        with self._lock:
            facts, done = self._db.execute(
                "SELECT COUNT(*), COALESCE(SUM(consolidated), 0) FROM facts WHERE bank_id=?",
                (bank_id,)).fetchone()
            [obs] = self._db.execute("SELECT COUNT(*) FROM observations WHERE bank_id=?",
                                     (bank_id,)).fetchone()
        return facts, done, obs

    def dump(self, bank_id: str) -> list[bytes]:
        """Every observation state of the bank (deleted included) as bytes, by id: what
        replay must reproduce byte for byte."""
        with self._lock:
            return [r[0] for r in self._db.execute(
                "SELECT data FROM observations WHERE bank_id=? ORDER BY id", (bank_id,))]

    # ---- opinions -----------------------------------------------------------------------

    def apply_opinions(self, m: ev.OpinionsChanged) -> None:
        """Upsert each opinion state newer than the stored one (a deleted one as its
        :func:`opinion_tombstone`, about no entity any more). Idempotent."""
        with self.transaction():
            for o in m.opinions:
                row = self._db.execute("SELECT version FROM opinions WHERE bank_id=? AND id=?",
                                       (m.bank_id, o.id)).fetchone()
                if row is not None and row[0] >= o.version:
                    continue
                self._erase |= o.deleted and row is not None
                o = opinion_tombstone(o)
                self._db.execute("INSERT OR REPLACE INTO opinions VALUES (?,?,?,?,?)",
                                 (m.bank_id, o.id, o.version, int(o.deleted),
                                  o.SerializeToString(deterministic=True)))
                self._db.execute("DELETE FROM opinion_entities WHERE bank_id=? AND opinion_id=?",
                                 (m.bank_id, o.id))
                self._db.executemany("INSERT OR IGNORE INTO opinion_entities VALUES (?,?,?)",
                                     [(m.bank_id, e.id, o.id) for e in o.entities if e.id])

    def opinions(self, bank_id: str, ids: Iterable[str] | None = None,
                 entity_ids: Iterable[str] | None = None, limit: int = 1000
                 ) -> dict[str, ev.Opinion]:
        """id → state of the bank's live opinions (those listed in ``ids``, or about any of
        ``entity_ids``; all when both are None), at most ``limit``, by id."""
        q, args = "SELECT o.data FROM opinions o WHERE o.bank_id=? AND o.deleted=0", [bank_id]
        if ids is not None:
            ids = list(ids)
            q += f" AND o.id IN ({','.join('?' * len(ids))})"
            args += ids
        if entity_ids is not None:
            ents = list(entity_ids)
            q += (" AND o.id IN (SELECT opinion_id FROM opinion_entities WHERE bank_id=? AND "
                  f"entity_id IN ({','.join('?' * len(ents))}))")
            args += [bank_id, *ents]
        with self._lock:
            rows = self._db.execute(q + " ORDER BY o.id LIMIT ?", [*args, limit]).fetchall()
        return {o.id: o for o in (ev.Opinion.FromString(r[0]) for r in rows)}

    def dump_opinions(self, bank_id: str) -> list[bytes]:
        """Every opinion state of the bank (deleted ones as tombstones) as bytes, by id."""
        with self._lock:
            return [r[0] for r in self._db.execute(
                "SELECT data FROM opinions WHERE bank_id=? ORDER BY id", (bank_id,))]
