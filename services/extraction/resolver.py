"""Per-bank entity resolution: mention names → stable entity ids, with person aliases.

A mention is ``(name, label)``; the label (a spaCy NER label, ``"CONCEPT"`` or "") maps to
a **kind** (:func:`kind_of`): ``person`` (PERSON), ``org`` (ORG), ``place`` (GPE, LOC,
FAC), ``thing`` (the other named labels, which the small NER model confuses among
themselves: NORP, EVENT, WORK_OF_ART, PRODUCT, LANGUAGE, LAW) -- or no kind at all for a
concept (a noun phrase) or an unlabelled name. A resolved entity has one kind: "Jordan"
the PERSON and "Jordan" the GPE are two entities. A kindless mention is compatible with
every kind, so a noun phrase never takes a named entity away from its kind, and a concept
entity is *claimed* (given its kind and label) by the first named mention of its key.

Rules, in order, for a mention in bank B:
1. an entity of B whose key (``mneme.domain.entity_key``) or alias is the mention's key
   and whose kind is compatible → that entity (the first created, for a kindless mention;
   numbers are part of the key, so "Room 101" and "Room 102" never merge);
2. a ``person`` mention that is a first-name prefix of exactly one known person of B, or
   has one as its first-name prefix ("Mel" ↔ "Melanie", "Caroline" ↔ "Caroline Smith";
   at least 3 letters), becomes an alias of that person; a capitalised one-word kindless
   mention may alias a person only by equalling a first name exactly. Names whose number
   tokens differ (digits, ordinals, roman numerals: :func:`number_tokens`) are never
   aliased ("Agent 007" / "Agent 008", "Henry VII" / "Henry VIII");
3. otherwise a new entity, named by this mention.

The entity id is ``derive_id("entity", bank_id, key)`` for the first entity of a key and
``derive_id("entity", bank_id, key, kind)`` for an entity of another kind with the same
key, so it never changes once given. Every decision is remembered (aliases included), so
the same mention resolves the same way forever after -- redelivered events get the same
ids -- and the outcome is deterministic given the same sequence of calls. State is kept in
memory and, with a ``store`` (:class:`mneme.ports.EntityStore`, e.g.
``mneme.stores.entities_sqlite.SqliteEntityStore``), persisted there, so a restarted
process resolves the same way. The decisions an event takes are recorded under it
(:meth:`EntityResolver.begin`) in the same transaction, so the event, redelivered after a
kill, publishes them again (:meth:`EntityResolver.drain`) although it takes none.

One bank's events are consumed by one worker at a time (events are keyed by bank), which
is what keeps two processes sharing a file from deciding differently.
"""

from __future__ import annotations

import contextlib
import re
import threading
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Iterable, Iterator, Sequence

from mneme.domain import EntityRef, derive_id, entity_key
from mneme.ports import EntityStore, StoredEntity

__all__ = ["EntityResolver", "kind_of", "number_tokens"]

PERSON = "PERSON"
_MIN_PREFIX = 3
# Causes whose decisions a resolver without a store keeps (:meth:`EntityResolver.begin`),
# as many as a store keeps (mneme.stores.entities_sqlite.DECISIONS_KEPT).
_RECORDS_KEPT = 10_000

#: Banks whose entities a resolver with a store keeps in memory, the least recently used
#: dropped beyond it (loaded again from the store on next use). Without a bound a process
#: held every entity and alias of every bank it had resolved in since it started: with
#: many tenants, all of entities.db. A bank with decisions not drained yet stays.
RESOLVER_BANKS = 256

#: spaCy label → kind; a label not listed here (CONCEPT, "", anything else) has no kind.
_KINDS = {"PERSON": "person", "ORG": "org", "GPE": "place", "LOC": "place", "FAC": "place",
          "NORP": "thing", "EVENT": "thing", "WORK_OF_ART": "thing", "PRODUCT": "thing",
          "LANGUAGE": "thing", "LAW": "thing"}

_ORDINAL_WORDS = frozenset("""
first second third fourth fifth sixth seventh eighth ninth tenth eleventh twelfth
thirteenth fourteenth fifteenth sixteenth seventeenth eighteenth nineteenth twentieth
""".split())
# Roman numerals up to 39 (regnal numbers, sequels); longer ones are mostly words ("mix").
_ROMAN = re.compile(r"(?=[ivx])x{0,3}(i[xv]|v?i{0,3})")


def kind_of(label: str) -> str:
    """The kind of a mention label: "person", "org", "place", "thing", or "" (no kind:
    CONCEPT, an empty or unknown label) -- see the module docs."""
    return _KINDS.get((label or "").upper(), "")


def number_tokens(key: str) -> tuple[str, ...]:
    """The tokens of an entity key that number or date it, in order: every token with a
    digit ("101", "2023", "14th", "q3"), ordinal words ("second"), and roman numerals
    after the first word ("henry viii" → ("viii",)). Two names whose number tokens differ
    name different things."""
    out = []
    for i, w in enumerate(key.split()):
        if any(c.isdigit() for c in w) or w in _ORDINAL_WORDS or (i and _ROMAN.fullmatch(w)):
            out.append(w)
    return tuple(out)


@dataclass
class _Entity:
    ref: EntityRef
    key: str
    kind: str  # "" until a named mention claims it


@dataclass
class _Bank:
    entities: dict[str, _Entity] = field(default_factory=dict)  # id → entity, creation order
    by_key: dict[str, list[str]] = field(default_factory=dict)  # key or alias → entity ids
    aliases: dict[str, list[str]] = field(default_factory=dict)  # alias → entity ids
    persons: list[str] = field(default_factory=list)  # ids of person entities
    alias_keys: dict[str, list[str]] = field(default_factory=dict)  # entity id → its aliases

    def add(self, e: _Entity) -> None:
        self.entities[e.ref.id] = e
        self.by_key.setdefault(e.key, []).append(e.ref.id)
        if e.kind == "person":
            self.persons.append(e.ref.id)

    def add_alias(self, alias: str, id_: str) -> None:
        self.aliases.setdefault(alias, []).append(id_)
        self.by_key.setdefault(alias, []).append(id_)
        self.alias_keys.setdefault(id_, []).append(alias)


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

    ``store``: where decisions are persisted (a bank is loaded from it on first use);
    None keeps them in memory only. Thread-safe: one lock serialises all calls.
    """

    def __init__(self, store: EntityStore | None = None):
        self._lock = threading.RLock()
        # bank → its entities, least recently used first (see RESOLVER_BANKS)
        self._banks: OrderedDict[str, _Bank] = OrderedDict()
        self._store = store
        # bank → decisions since the last drain taken for no cause (:meth:`begin`)
        self._journal: dict[str, tuple[list, list, list]] = {}
        # bank → the event whose decisions it is taking now (:meth:`begin`)
        self._cause: dict[str, str] = {}
        # without a store: (bank, cause) → its decisions, the latest _RECORDS_KEPT causes
        self._records: dict[tuple[str, str], tuple[list, list, list]] = {}

    # ---- state --------------------------------------------------------------------------

    def _bank(self, bank_id: str) -> _Bank:
        b = self._banks.get(bank_id)
        if b is not None:
            self._banks.move_to_end(bank_id)
            return b
        self._evict()
        b = _Bank()
        if self._store is not None:
            entities, aliases = self._store.load(bank_id)
            for e in entities:
                b.add(_Entity(EntityRef(id=e.id, name=e.name, label=e.label), e.key, e.kind))
            for alias, id_ in aliases:
                if id_ in b.entities:
                    b.add_alias(alias, id_)
        self._banks[bank_id] = b
        return b

    def _evict(self) -> None:
        """Drop the least recently used banks beyond :data:`RESOLVER_BANKS` (lock held);
        only with a store (without one, memory is all there is), and never a bank with
        decisions a :meth:`drain` has not taken yet (its journal or cause)."""
        if self._store is None:
            return
        over = len(self._banks) - RESOLVER_BANKS + 1
        for bank_id in list(self._banks):
            if over <= 0:
                break
            if bank_id not in self._journal and bank_id not in self._cause:
                del self._banks[bank_id]
                over -= 1

    @contextlib.contextmanager
    def _changing(self, bank_id: str) -> Iterator[None]:
        """A block that changes the bank in memory, then in the store (lock held). When
        it raises (the store's write failed: a full disk), the bank's memory state is
        dropped, to be loaded again from the store on next use: kept, it would hold
        decisions the store does not, which a retry would then find and never persist."""
        try:
            yield
        except BaseException:
            if self._store is not None:
                self._banks.pop(bank_id, None)
            raise

    def _find(self, b: _Bank, key: str, kind: str) -> tuple[_Entity | None, bool]:
        """The entity a mention of ``key`` and ``kind`` resolves to by key or alias, and
        whether the mention claims it (a kindless entity meeting its first named mention)."""
        ids = b.by_key.get(key, ())
        if not kind:
            return (b.entities[ids[0]], False) if ids else (None, False)
        for i in ids:
            if b.entities[i].kind == kind:
                return b.entities[i], False
        for i in ids:
            if not b.entities[i].kind:
                return b.entities[i], True
        return None, False

    def _person_match(self, b: _Bank, key: str, strict: bool) -> _Entity | None:
        """The one person entity this name is a first-name prefix of (or that is a prefix
        of it); None when there is none or more than one."""
        hits = []
        nums = number_tokens(key)
        for pid in b.persons:
            e = b.entities[pid]
            aliases = b.alias_keys.get(pid, ())
            # Only full names may be the shorter side: a nickname alias ("mel" of
            # "melanie") must not pull in "Melissa".
            full = [e.key, *(a for a in aliases if not _prefix_of(a, e.key))]
            for n in (e.key, *aliases):
                if number_tokens(n) != nums:
                    continue
                if strict:
                    ok = n.split()[0] == key
                else:
                    ok = _prefix_of(key, n) or (n in full and _prefix_of(n, key))
                if ok:
                    hits.append(e)
                    break
        return hits[0] if len(hits) == 1 else None

    def _resolve_one(self, bank_id: str, b: _Bank, name: str, label: str,
                     pending: list[tuple]) -> EntityRef | None:
        name = " ".join(name.split())
        key = entity_key(name)
        if not key:
            return None
        kind = kind_of(label)
        ent, claim = self._find(b, key, kind)
        if claim:
            ent.kind = kind
            ent.ref = EntityRef(id=ent.ref.id, name=ent.ref.name, label=label)
            if kind == "person":
                b.persons.append(ent.ref.id)
            pending.append(("claim", bank_id, ent))
        if ent is None:
            if kind == "person":
                ent = self._person_match(b, key, strict=False)
            elif not kind and " " not in name and name[:1].isupper():
                ent = self._person_match(b, key, strict=True)
            if ent is not None:
                b.add_alias(key, ent.ref.id)
                pending.append(("alias", bank_id, key, ent.ref.id))
        if ent is not None:
            return ent.ref
        id_ = derive_id("entity", bank_id, key)
        if id_ in b.entities:  # this key has an entity of another kind already
            id_ = derive_id("entity", bank_id, key, kind)
        ent = _Entity(EntityRef(id=id_, name=name, label=label or ""), key, kind)
        b.add(ent)
        pending.append(("entity", bank_id, ent))
        return ent.ref

    def _persist(self, bank_id: str, pending: list[tuple]) -> None:
        """Write one call's decisions to the store in one transaction, recorded under
        the bank's current cause (:meth:`begin`) in that transaction, or else to the
        bank's journal (:meth:`drain`). Entities are taken as they are now (an entity
        created and claimed in the same call is stored claimed)."""
        if not pending:
            return
        def stored(e: _Entity) -> StoredEntity:
            return StoredEntity(id=e.ref.id, key=e.key, name=e.ref.name, label=e.ref.label,
                                kind=e.kind)
        entities = [stored(p[2]) for p in pending if p[0] == "entity"]
        claims = [stored(p[2]) for p in pending if p[0] == "claim"]
        aliases = [(p[2], p[3]) for p in pending if p[0] == "alias"]
        cause = self._cause.get(bank_id, "")
        if self._store is not None:
            self._store.persist(bank_id, entities=entities, claims=claims, aliases=aliases,
                                cause=cause)
        if cause and self._store is not None:
            return  # recorded by the store
        if cause:
            into = self._records.pop((bank_id, cause), ([], [], []))
            self._records[(bank_id, cause)] = into  # the latest cause last
            while len(self._records) > _RECORDS_KEPT:
                del self._records[next(iter(self._records))]
        else:
            into = self._journal.setdefault(bank_id, ([], [], []))
        for kept, new in zip(into, (entities, claims, aliases)):
            kept.extend(new)

    # ---- API ----------------------------------------------------------------------------

    def resolve(self, bank_id: str, mentions: Iterable[tuple[str, str]]) -> list[EntityRef]:
        """Resolve ``[(name, label)]`` in ``bank_id`` → entity refs (canonical name and
        label), deduplicated by id, in order of first mention. Creates entities (and
        aliases) as needed and persists them before returning."""
        return self.resolve_many(bank_id, [list(mentions)])[0]

    def resolve_many(self, bank_id: str,
                     mention_lists: Sequence[Sequence[tuple[str, str]]]) -> list[list[EntityRef]]:
        """:meth:`resolve` for several mention lists in order (one per fact), with one
        store transaction for all of them."""
        with self._lock, self._changing(bank_id):
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
            self._persist(bank_id, pending)  # refused: _changing drops the bank's memory
            return out

    def lookup(self, bank_id: str, names: Iterable[str]) -> list[EntityRef]:
        """Known entities for names or keys (aliases followed; every kind of a shared
        name), without creating any -- e.g. to map a query's "Mel" to Melanie's entity.
        Unknown names are skipped."""
        with self._lock:
            b = self._bank(bank_id)
            out: list[EntityRef] = []
            for n in names:
                for i in b.by_key.get(entity_key(n), ()):
                    if b.entities[i].ref not in out:
                        out.append(b.entities[i].ref)
            return out

    def knows(self, bank_id: str, entity_id: str) -> bool:
        """True when the bank has the entity ``entity_id`` (not merged away, forgotten or
        never made)."""
        with self._lock:
            return entity_id in self._bank(bank_id).entities

    def entities(self, bank_id: str) -> list[EntityRef]:
        """All entities of the bank, in creation order."""
        with self._lock:
            return [e.ref for e in self._bank(bank_id).entities.values()]

    def aliases(self, bank_id: str) -> dict[str, str]:
        """Alias key → canonical key of the (first) entity it names, for the bank."""
        with self._lock:
            b = self._bank(bank_id)
            return {a: b.entities[ids[0]].key for a, ids in b.aliases.items()}

    def begin(self, bank_id: str, cause: str) -> None:
        """The decisions taken in ``bank_id`` from now until :meth:`drain` are the event
        ``cause``'s (e.g. its CloudEvents id): recorded under it, with the store in the
        transaction that persists them (:meth:`EntityStore.persist`). A redelivered event
        (the process was killed before its outputs were on the log) finds its decisions
        taken and takes none: :meth:`drain` still returns them."""
        with self._lock:
            self._cause[bank_id] = cause

    def drain(self, bank_id: str) -> tuple[list[StoredEntity], list[StoredEntity],
                                             list[tuple[str, str]]]:
        """The decisions of ``bank_id`` to publish, and forgets them: those taken for no
        cause since the last drain, then every one recorded for the current cause
        (:meth:`begin`, which ends here) -- also by an earlier delivery of the same event
        -- as (entities created, claims, (alias, entity id) pairs), each in order.
        Extraction publishes them (``EntitiesResolved``) so another replica can
        :meth:`learn` them."""
        with self._lock:
            out = self._journal.pop(bank_id, ([], [], []))
            cause = self._cause.pop(bank_id, "")
            if cause:
                recorded = (self._store.decisions(bank_id, cause) if self._store is not None
                            else self._records.get((bank_id, cause), ([], [], [])))
                for kept, more in zip(out, recorded):
                    kept.extend(more)
            entities, claims, aliases = out
            return entities, claims, aliases

    def learn(self, bank_id: str, entities: Sequence[StoredEntity] = (),
              claims: Sequence[StoredEntity] = (),
              aliases: Sequence[tuple[str, str]] = ()) -> None:
        """Take decisions made elsewhere (a :meth:`drain` of another replica's resolver,
        restored from the changelog) as if made here: entities in their creation order
        (a known id is kept), claims, aliases. Idempotent; persisted to the store."""
        with self._lock, self._changing(bank_id):
            b = self._bank(bank_id)
            for e in entities:
                if e.id not in b.entities:
                    b.add(_Entity(EntityRef(id=e.id, name=e.name, label=e.label), e.key, e.kind))
            for c in claims:
                ent = b.entities.get(c.id)
                if ent is not None and not ent.kind and c.kind:
                    ent.kind = c.kind
                    ent.ref = EntityRef(id=ent.ref.id, name=ent.ref.name, label=c.label)
                    if c.kind == "person":
                        b.persons.append(ent.ref.id)
            for alias, id_ in aliases:
                if id_ in b.entities and id_ not in b.aliases.get(alias, ()):
                    b.add_alias(alias, id_)
            if self._store is not None:
                self._store.persist(bank_id, entities=list(entities), claims=list(claims),
                                    aliases=list(aliases))

    # ---- user corrections (EntityService.MergeEntities / SplitEntity) ------------------

    def _unindex(self, b: _Bank, id_: str, keys: Sequence[str]) -> None:
        """Take ``keys`` (its key or aliases) away from entity ``id_`` in the indexes."""
        for key in keys:
            for index in (b.by_key, b.aliases):
                ids = index.get(key)
                if ids and id_ in ids:
                    ids.remove(id_)
                    if not ids:
                        del index[key]
        own, keys = b.alias_keys.get(id_), set(keys)
        if own is not None:
            own[:] = [a for a in own if a not in keys]

    def _drop(self, b: _Bank, id_: str) -> _Entity | None:
        e = b.entities.pop(id_, None)
        if e is not None:
            self._unindex(b, id_, [e.key, *b.alias_keys.pop(id_, [])])
            if id_ in b.persons:
                b.persons.remove(id_)
        return e

    def _rewrite(self, bank_id: str, b: _Bank, entities: Sequence[_Entity],
                 removed: Sequence[str] = (), mentions_of: Sequence[tuple[str, str]] = ()
                 ) -> None:
        if self._store is None:
            return
        stored = [StoredEntity(id=e.ref.id, key=e.key, name=e.ref.name, label=e.ref.label,
                               kind=e.kind) for e in entities]
        aliases = [(a, e.ref.id) for e in entities for a in b.alias_keys.get(e.ref.id, ())]
        self._store.rewrite(bank_id, entities=stored, aliases=aliases, removed=list(removed),
                            mentions_of=list(mentions_of))

    def merge(self, bank_id: str, survivor_id: str, merged_ids: Sequence[str],
              display_name: str = "") -> bool:
        """The entities ``merged_ids`` become ``survivor_id``: their keys and aliases are
        the survivor's aliases (later mentions of them resolve to it), they are forgotten,
        and a ``display_name`` renames the survivor (its key becomes an alias too).
        Idempotent (merged ids no longer known are skipped); nothing happens when the
        survivor is unknown here. Persisted in one store transaction. True when something
        changed."""
        with self._lock, self._changing(bank_id):
            b = self._bank(bank_id)
            s = b.entities.get(survivor_id)
            if s is None:
                return False
            own = b.alias_keys.setdefault(survivor_id, [])
            taken: list[str] = []
            gone: list[str] = []
            for mid in dict.fromkeys(merged_ids):
                if mid == survivor_id or mid not in b.entities:
                    continue
                keys = [b.entities[mid].key, *b.alias_keys.get(mid, ())]
                self._drop(b, mid)
                gone.append(mid)
                taken += [k for k in keys if k != s.key and k not in own and k not in taken]
            name = " ".join(display_name.split())
            if name and name != s.ref.name:
                s.ref = EntityRef(id=s.ref.id, name=name, label=s.ref.label)
                k = entity_key(name)
                if k and k != s.key and k not in own and k not in taken:
                    taken.append(k)
            elif not gone:
                return False
            for k in taken:
                b.add_alias(k, survivor_id)
            self._rewrite(bank_id, b, [s], gone, [(survivor_id, g) for g in gone])
            return True

    def split(self, bank_id: str, entity_id: str, new_id: str, aliases: Sequence[str],
              display_name: str) -> bool:
        """A new entity ``new_id`` named ``display_name`` (kind and label of
        ``entity_id``) takes the keys ``aliases`` from ``entity_id``: later mentions of
        them resolve to it. When the entity's own key moves, its first remaining alias
        becomes its key (none left: it keeps the key too). Idempotent: applied again
        (redelivery, or a restore replaying the changelog from before it) it only takes
        the moved keys from ``entity_id`` again. Nothing happens when ``entity_id`` is
        unknown here. True when something changed."""
        with self._lock, self._changing(bank_id):
            b = self._bank(bank_id)
            e = b.entities.get(entity_id)
            if e is None:
                return False
            own = [e.key, *b.alias_keys.get(entity_id, ())]
            moved = [k for k in dict.fromkeys(aliases) if k in own]
            new = b.entities.get(new_id)
            if new is not None and not moved:
                return False
            kept = [k for k in own if k not in moved]
            if not kept:  # an entity keeps a name to be found by
                kept, moved = [e.key], [k for k in moved if k != e.key]
            self._unindex(b, entity_id, moved)
            if e.key in moved:
                b.alias_keys[entity_id] = [a for a in b.alias_keys.get(entity_id, [])
                                           if a != kept[0]]
                e.key = kept[0]  # still indexed under it (it was an alias)
            if new is None:
                name = " ".join(display_name.split()) or new_id
                new_key = entity_key(name) or (moved[0] if moved else new_id)
                new = _Entity(EntityRef(id=new_id, name=name, label=e.ref.label), new_key,
                              e.kind)
                b.add(new)
            for k in moved:
                if k != new.key and k not in b.alias_keys.get(new_id, ()):
                    b.add_alias(k, new_id)
            self._rewrite(bank_id, b, [e, new], (), [(new_id, entity_id)])
            return True

    def note_mentions(self, bank_id: str, mentions: Iterable[tuple[str, ...]]) -> None:
        """Record that entities are mentioned by content of scopes ([(entity id, scope[,
        fact id])], :meth:`EntityStore.add_mentions`), so :meth:`forget_scope` and
        :meth:`forget_facts` can drop the ones only a deleted document or memory named.
        Without a store nothing is recorded."""
        pairs = list(dict.fromkeys(tuple(m) for m in mentions))
        if self._store is not None and pairs:
            with self._lock:
                self._store.add_mentions(bank_id, pairs)

    def forget_scope(self, bank_id: str, scope: str) -> list[str]:
        """A document (scope) was deleted: the entities it mentioned and nothing else does
        are forgotten, with their aliases (names are user content: erasure). Returns
        their ids; later mentions of those names make them again (same ids)."""
        if self._store is None:
            return []
        with self._lock:
            return self._forgotten(bank_id, self._store.drop_scope(bank_id, scope))

    def forget_facts(self, bank_id: str, fact_ids: Sequence[str]) -> list[str]:
        """As :meth:`forget_scope`, for deleted memories (facts): the entities only they
        mentioned are forgotten, so a later mention of one of their names neither
        resolves to nor is named after what was deleted. Returns their ids."""
        if self._store is None or not fact_ids:
            return []
        with self._lock:
            return self._forgotten(bank_id, self._store.drop_facts(bank_id, list(fact_ids)))

    def forget_entities(self, bank_id: str, entity_ids: Sequence[str]) -> list[str]:
        """Forget these entities by id, with their aliases, mentions and recorded
        decisions (a restore applying what the deciding replica forgot:
        ``FactsRetracted.forgotten_entity_ids``). Returns the ids that were known."""
        if not entity_ids:
            return []
        with self._lock:
            if self._store is not None:
                return self._forgotten(bank_id, self._store.drop_entities(
                    bank_id, list(entity_ids)))
            b = self._banks.get(bank_id)
            return self._forgotten(bank_id, [i for i in dict.fromkeys(entity_ids)
                                             if b is not None and i in b.entities])

    def _forgotten(self, bank_id: str, gone: list[str]) -> list[str]:
        """Take the entities ``gone`` (deleted from the store) out of memory too."""
        b = self._banks.get(bank_id)
        if b is not None:
            for i in gone:
                e = b.entities.pop(i, None)
                if e is None:
                    continue
                self._unindex(b, i, (e.key, *b.alias_keys.pop(i, [])))
                if i in b.persons:
                    b.persons.remove(i)
        return gone

    def forget(self, bank_id: str) -> None:
        """Drop everything known about the bank (when the bank is deleted)."""
        with self._lock:
            self._banks.pop(bank_id, None)
            self._journal.pop(bank_id, None)
            self._cause.pop(bank_id, None)
            for k in [k for k in self._records if k[0] == bank_id]:
                del self._records[k]
            if self._store is not None:
                self._store.forget(bank_id)

    forget_bank = forget

    def close(self) -> None:
        """Close the store (memory state stays usable; nothing more is persisted)."""
        with self._lock:
            if self._store is not None:
                self._store.close()
                self._store = None
