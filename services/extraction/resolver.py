"""Per-bank entity resolution: mention names → stable entity ids, with person aliases.

Rules, in order, for a mention (name, label) in bank B:
1. its key (``mneme.domain.entity_key``) is a known entity or alias of B → that entity
   (whatever the label: the key is the identity; numbers are part of the key, so
   "Room 101" and "Room 102" never merge);
2. a PERSON mention that is a first-name prefix of exactly one known PERSON of B, or has
   one as its first-name prefix ("Mel" ↔ "Melanie", "Caroline" ↔ "Caroline Smith"; at least
   3 letters), becomes an alias of that person (a capitalised one-word mention with another
   label may alias a person only by equalling a first name exactly, since the small NER
   model labels names as ORG or PRODUCT now and then);
3. otherwise a new entity, named by this mention.

The entity id is ``derive_id("entity", bank_id, key)`` of the canonical (first-seen)
name, so it never changes once given. Every decision is remembered (aliases included), so
the same mention resolves the same way forever after -- redelivered events get the same
ids -- and the outcome is deterministic given the same sequence of calls. State is kept in
memory and, with ``path``, in SQLite, so a restarted process resolves the same way.

One bank's events are consumed by one worker at a time (events are keyed by bank), which
is what keeps two processes sharing a file from deciding differently.
"""

from __future__ import annotations

import sqlite3
import threading
from dataclasses import dataclass, field
from typing import Iterable, Sequence

from mneme.domain import EntityRef, derive_id, entity_key

__all__ = ["EntityResolver"]

PERSON = "PERSON"
_MIN_PREFIX = 3

_SCHEMA = """
CREATE TABLE IF NOT EXISTS entities (
  bank_id TEXT NOT NULL, key TEXT NOT NULL, id TEXT NOT NULL, name TEXT NOT NULL,
  label TEXT NOT NULL, seq INTEGER NOT NULL, PRIMARY KEY (bank_id, key));
CREATE TABLE IF NOT EXISTS aliases (
  bank_id TEXT NOT NULL, alias TEXT NOT NULL, key TEXT NOT NULL,
  PRIMARY KEY (bank_id, alias));
"""


@dataclass
class _Bank:
    entities: dict[str, EntityRef] = field(default_factory=dict)  # canonical key → ref
    aliases: dict[str, str] = field(default_factory=dict)  # alias key → canonical key
    persons: list[str] = field(default_factory=list)  # canonical keys of PERSON entities
    names_of: dict[str, list[str]] = field(default_factory=dict)  # canonical key → its alias keys

    def add_alias(self, alias: str, canon: str) -> None:
        self.aliases[alias] = canon
        self.names_of.setdefault(canon, []).append(alias)


def _digits(s: str) -> str:
    return "".join(ch for ch in s if ch.isdigit())


def _prefix_of(short: str, long: str) -> bool:
    """True when ``short`` names the start of ``long``: its words lead ``long``'s words,
    the last of them possibly cut ("mel" / "melanie", "caroline" / "caroline smith")."""
    if short == long or len(short.replace(" ", "")) < _MIN_PREFIX:
        return False
    sw, lw = short.split(), long.split()
    if len(sw) > len(lw):
        return False
    if sw[:-1] != lw[:len(sw) - 1]:
        return False
    return lw[len(sw) - 1].startswith(sw[-1]) and (len(sw) < len(lw) or sw[-1] != lw[-1])


class EntityResolver:
    """Resolves entity mentions per bank (see the module docs for the rules).

    ``path``: SQLite file to persist the state to (created if missing); None keeps it in
    memory only. Thread-safe: one lock serialises all calls.
    """

    def __init__(self, path: str | None = None):
        self._lock = threading.RLock()
        self._banks: dict[str, _Bank] = {}
        self._db: sqlite3.Connection | None = None
        self._seq = 0
        if path:
            self._db = sqlite3.connect(path, check_same_thread=False, isolation_level=None)
            self._db.execute("PRAGMA journal_mode=WAL")
            self._db.execute("PRAGMA synchronous=NORMAL")
            self._db.executescript(_SCHEMA)
            row = self._db.execute("SELECT COALESCE(MAX(seq), 0) FROM entities").fetchone()
            self._seq = int(row[0])

    # ---- state --------------------------------------------------------------------------

    def _bank(self, bank_id: str) -> _Bank:
        b = self._banks.get(bank_id)
        if b is not None:
            return b
        b = _Bank()
        if self._db is not None:
            for key, id_, name, label in self._db.execute(
                    "SELECT key, id, name, label FROM entities WHERE bank_id=? ORDER BY seq",
                    (bank_id,)):
                b.entities[key] = EntityRef(id=id_, name=name, label=label)
                if label == PERSON:
                    b.persons.append(key)
            for alias, key in self._db.execute(
                    "SELECT alias, key FROM aliases WHERE bank_id=? ORDER BY rowid", (bank_id,)):
                b.add_alias(alias, key)
        self._banks[bank_id] = b
        return b

    def _find(self, b: _Bank, key: str) -> str | None:
        if key in b.entities:
            return key
        return b.aliases.get(key)

    def _person_match(self, b: _Bank, key: str, strict: bool) -> str | None:
        """The one PERSON entity this name is a first-name prefix of (or that is a prefix
        of it); None when there is none or more than one."""
        hits = []
        for canon in b.persons:
            aliases = b.names_of.get(canon, ())
            # Only full names may be the shorter side: a nickname alias ("mel" of
            # "melanie") must not pull in "Melissa".
            full = [canon, *(a for a in aliases if not _prefix_of(a, canon))]
            for n in (canon, *aliases):
                if _digits(n) != _digits(key):
                    continue
                if strict:
                    ok = n.split()[0] == key
                else:
                    ok = _prefix_of(key, n) or (n in full and _prefix_of(n, key))
                if ok:
                    hits.append(canon)
                    break
        return hits[0] if len(hits) == 1 else None

    def _resolve_one(self, bank_id: str, b: _Bank, name: str, label: str,
                     pending: list[tuple]) -> EntityRef | None:
        name = " ".join(name.split())
        key = entity_key(name)
        if not key:
            return None
        canon = self._find(b, key)
        if canon is None:
            if label == PERSON:
                canon = self._person_match(b, key, strict=False)
            elif " " not in name and name[:1].isupper():
                canon = self._person_match(b, key, strict=True)
            if canon is not None:
                b.add_alias(key, canon)
                pending.append(("alias", bank_id, key, canon))
        if canon is not None:
            return b.entities[canon]
        ref = EntityRef(id=derive_id("entity", bank_id, key), name=name, label=label or "")
        b.entities[key] = ref
        if label == PERSON:
            b.persons.append(key)
        self._seq += 1
        pending.append(("entity", bank_id, key, ref, self._seq))
        return ref

    def _persist(self, pending: list[tuple]) -> None:
        if self._db is None or not pending:
            return
        with self._db:  # one transaction per call
            self._db.execute("BEGIN")
            for p in pending:
                if p[0] == "entity":
                    _, bank_id, key, ref, seq = p
                    self._db.execute(
                        "INSERT OR IGNORE INTO entities(bank_id, key, id, name, label, seq) "
                        "VALUES (?,?,?,?,?,?)", (bank_id, key, ref.id, ref.name, ref.label, seq))
                else:
                    _, bank_id, alias, key = p
                    self._db.execute("INSERT OR IGNORE INTO aliases(bank_id, alias, key) VALUES (?,?,?)",
                                     (bank_id, alias, key))

    # ---- API ----------------------------------------------------------------------------

    def resolve(self, bank_id: str, mentions: Iterable[tuple[str, str]]) -> list[EntityRef]:
        """Resolve ``[(name, label)]`` in ``bank_id`` → entity refs (canonical name and
        label), deduplicated by id, in order of first mention. Creates entities (and
        aliases) as needed and persists them before returning."""
        return self.resolve_many(bank_id, [list(mentions)])[0]

    def resolve_many(self, bank_id: str,
                     mention_lists: Sequence[Sequence[tuple[str, str]]]) -> list[list[EntityRef]]:
        """:meth:`resolve` for several mention lists in order (one per fact), with one
        SQLite transaction for all of them."""
        with self._lock:
            b = self._bank(bank_id)
            pending: list[tuple] = []
            out: list[list[EntityRef]] = []
            for mentions in mention_lists:
                refs: list[EntityRef] = []
                seen: set[str] = set()
                for name, label in mentions:
                    ref = self._resolve_one(bank_id, b, name, label, pending)
                    if ref is not None and ref.id not in seen:
                        seen.add(ref.id)
                        refs.append(ref)
                out.append(refs)
            self._persist(pending)
            return out

    def lookup(self, bank_id: str, names: Iterable[str]) -> list[EntityRef]:
        """Known entities for names or keys (aliases followed), without creating any --
        e.g. to map a query's "Mel" to Melanie's entity. Unknown names are skipped."""
        with self._lock:
            b = self._bank(bank_id)
            out: list[EntityRef] = []
            for n in names:
                canon = self._find(b, entity_key(n))
                if canon is not None and b.entities[canon] not in out:
                    out.append(b.entities[canon])
            return out

    def entities(self, bank_id: str) -> list[EntityRef]:
        """All entities of the bank, in creation order."""
        with self._lock:
            return list(self._bank(bank_id).entities.values())

    def aliases(self, bank_id: str) -> dict[str, str]:
        """Alias key → canonical key for the bank."""
        with self._lock:
            return dict(self._bank(bank_id).aliases)

    def forget(self, bank_id: str) -> None:
        """Drop everything known about the bank (when the bank is deleted)."""
        with self._lock:
            self._banks.pop(bank_id, None)  # the seq counter stays monotonic
            if self._db is not None:
                with self._db:
                    self._db.execute("BEGIN")
                    self._db.execute("DELETE FROM entities WHERE bank_id=?", (bank_id,))
                    self._db.execute("DELETE FROM aliases WHERE bank_id=?", (bank_id,))

    forget_bank = forget

    def close(self) -> None:
        """Close the SQLite file (memory state stays usable for reads)."""
        with self._lock:
            if self._db is not None:
                self._db.close()
                self._db = None
