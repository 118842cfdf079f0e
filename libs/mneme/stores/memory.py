"""In-memory adapters of the state ports (:class:`mneme.ports.Catalog`,
:class:`~mneme.ports.ObservationStore`, :class:`~mneme.ports.EntityStore`): complete,
thread-safe implementations with the SQLite adapters' semantics (the contract suites in
``tests/contract`` run against both), for handler tests that should not touch disk.

Nothing returned aliases stored state: values are copied in and out, as a database would.
"""

from __future__ import annotations

import copy
import threading
from contextlib import contextmanager
from dataclasses import asdict, replace
from typing import Callable, Iterable, Iterator, Sequence

from mneme.domain import (TERMINAL, Bank, BankConfig, Directive, MentalModel, MentalModelRevision,
                          Operation, erase_mental_model_sources, from_epoch, merge_directive,
                          merge_mental_model, merge_operation)
from mneme.events.v1 import events_pb2 as ev
from mneme.ports import StoredEntity
from mneme.bus.codec import opinion_tombstone, tombstone
from mneme.stores.revisions import Revisions


# ---- catalog -------------------------------------------------------------------------------


class MemoryCatalog:
    """Banks and operations in dicts (see :class:`mneme.ports.Catalog`)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._banks: dict[str, dict] = {}  # id → display_name, config (dict), times, incarnation
        self._ops: dict[str, Operation] = {}
        self._deleted_ops: set[str] = set()
        self._generations: dict[str, int] = {}
        self._directives: dict[tuple[str, str], Directive] = {}
        self._models: dict[tuple[str, str], MentalModel] = {}
        self._revisions: dict[tuple[str, str], list[MentalModelRevision]] = {}

    # ---- banks ----
    def upsert_bank(self, bank_id: str, display_name: str, config: BankConfig, at: float,
                    mask: tuple[str, ...] = ()) -> None:
        with self._lock:
            row = self._banks.get(bank_id)
            new = asdict(config)
            if mask:
                if row is None:
                    return  # an update never creates
                merged = dict(row["config"])
                for path in mask:
                    if path.startswith("config.") and path[7:] in new:
                        merged[path[7:]] = new[path[7:]]
                row.update(display_name=display_name if "display_name" in mask
                           else row["display_name"], config=merged, updated_at=at)
                return
            if row is not None:
                row.update(display_name=display_name, config=new, updated_at=at)
                return
            n = self._generations.get(bank_id, 0) + 1
            self._generations[bank_id] = n
            # the earlier incarnation's last operations (its DeleteBank's) go with it
            # (not those created since, projected before this from the progress topic)
            self._drop_operations(bank_id, lambda op: op.created_at < at)
            self._banks[bank_id] = dict(display_name=display_name, config=new, created_at=at,
                                        updated_at=at, incarnation=str(n))

    def _drop_operations(self, bank_id: str, when) -> None:
        gone = [i for i, op in self._ops.items() if op.bank_id == bank_id and when(op)]
        self._deleted_ops.update(gone)
        for i in gone:
            del self._ops[i]

    def delete_bank(self, bank_id: str, at: float | None = None) -> None:
        with self._lock:
            self._banks.pop(bank_id, None)
            for k in [k for k in self._directives if k[0] == bank_id]:
                del self._directives[k]
            for k in [k for k in self._models if k[0] == bank_id]:
                del self._models[k]
                self._revisions.pop(k, None)
            self._generations.setdefault(bank_id, 1)  # as SQLite: a deleted id was used once
            self._drop_operations(bank_id, lambda op: at is None or op.created_at <= at)

    def get_bank(self, bank_id: str) -> Bank | None:
        with self._lock:
            row = self._banks.get(bank_id)
            return _bank(bank_id, row) if row is not None else None

    def list_banks(self, limit: int, after: str = "") -> list[Bank]:
        with self._lock:
            ids = sorted(i for i in self._banks if i > after)[:max(limit, 0)]
            return [_bank(i, self._banks[i]) for i in ids]

    # ---- directives ----
    def upsert_directive(self, d: Directive, mask: tuple[str, ...] = ()) -> None:
        with self._lock:
            if d.bank_id not in self._banks:
                return
            d = merge_directive(self._directives.get((d.bank_id, d.id)), d, mask)
            if d is not None:  # an update never creates
                self._directives[(d.bank_id, d.id)] = d

    def delete_directive(self, bank_id: str, directive_id: str) -> None:
        with self._lock:
            self._directives.pop((bank_id, directive_id), None)

    def get_directive(self, bank_id: str, directive_id: str) -> Directive | None:
        with self._lock:
            return self._directives.get((bank_id, directive_id))

    def list_directives(self, bank_id: str, limit: int, after: str = "") -> list[Directive]:
        with self._lock:
            ids = sorted(i for b, i in self._directives if b == bank_id and i > after)
            return [self._directives[(bank_id, i)] for i in ids[:max(limit, 0)]]

    # ---- mental models ----
    def upsert_mental_model(self, m: MentalModel, mask: tuple[str, ...] = (),
                            refresh: MentalModelRevision | None = None) -> None:
        with self._lock:
            if m.bank_id not in self._banks:
                return
            key = (m.bank_id, m.id)
            new, revision = merge_mental_model(self._models.get(key), m, mask, refresh)
            if new is None:
                return
            revs = self._revisions.setdefault(key, [])
            if revision is not None and all(r.at != revision.at for r in revs):
                revs.append(replace(revision, revision=len(revs) + 1))
            self._models[key] = replace(new, revision=len(revs))

    def erase_mental_model_sources(self, bank_id: str, memory_ids: Iterable[str],
                                   document_id: str = "",
                                   gone: Callable[[str], bool] | None = None) -> int:
        """See :meth:`mneme.ports.Catalog.erase_mental_model_sources`."""
        ids, changed = set(memory_ids), 0
        with self._lock:
            for key in [k for k in self._models if k[0] == bank_id]:
                out = erase_mental_model_sources(self._models[key], self._revisions.get(key, []),
                                                 ids, document_id, gone)
                if out:
                    self._models[key], self._revisions[key] = out
                    changed += 1
        return changed

    def delete_mental_model(self, bank_id: str, model_id: str) -> None:
        with self._lock:
            self._models.pop((bank_id, model_id), None)
            self._revisions.pop((bank_id, model_id), None)

    def get_mental_model(self, bank_id: str, model_id: str) -> MentalModel | None:
        with self._lock:
            return self._models.get((bank_id, model_id))

    def list_mental_models(self, bank_id: str, limit: int, after: str = "") -> list[MentalModel]:
        with self._lock:
            ids = sorted(i for b, i in self._models if b == bank_id and i > after)
            return [self._models[(bank_id, i)] for i in ids[:max(limit, 0)]]

    def mental_model_revisions(self, bank_id: str, model_id: str) -> list[MentalModelRevision]:
        with self._lock:
            return list(self._revisions.get((bank_id, model_id), ()))

    # ---- operations ----
    def put_operation(self, op: Operation) -> None:
        with self._lock:
            if op.operation_id in self._deleted_ops:
                return
            old = self._ops.get(op.operation_id)
            if old is None:
                self._ops[op.operation_id] = _copy_op(op)
            elif op.source and not old.source:  # its progress came first
                old.source, old.retry_of = op.source, op.retry_of

    def update_operation(self, op: Operation) -> None:
        with self._lock:
            if op.operation_id in self._deleted_ops:
                return
            old = self._ops.get(op.operation_id)
            if old is not None and old.state in TERMINAL:
                return  # the first terminal state is final
            stored = _copy_op(merge_operation(old, op))
            if old is not None:
                stored.created_at = old.created_at
            self._ops[op.operation_id] = stored

    def get_operation(self, operation_id: str) -> Operation | None:
        with self._lock:
            op = self._ops.get(operation_id)
            return _copy_op(op) if op is not None else None

    def count_operations(self, bank_id: str) -> tuple[int, int]:
        """(operations, of which not yet terminal) of the bank."""
        with self._lock:
            ops = [o for o in self._ops.values() if o.bank_id == bank_id]
            return len(ops), sum(1 for o in ops if not o.done)

    def list_operations(self, bank_id: str, limit: int,
                        after: tuple[float, str] | None = None, *, state: str = "",
                        kind: str = "") -> list[Operation]:
        with self._lock:
            ops = [o for o in self._ops.values() if (not bank_id or o.bank_id == bank_id)
                   and (not state or o.state == state) and (not kind or o.kind == kind)
                   and (after is None or o.created_at < after[0]
                        or (o.created_at == after[0] and o.operation_id > after[1]))]
            ops.sort(key=lambda o: o.operation_id)
            ops.sort(key=lambda o: o.created_at, reverse=True)  # stable: ties stay by id
            return [_copy_op(o) for o in ops[:max(limit, 0)]]

    def reset(self) -> None:
        with self._lock:
            self._banks.clear()
            self._directives.clear()
            self._models.clear()
            self._revisions.clear()
            self._ops.clear()
            self._deleted_ops.clear()
            self._generations.clear()

    def close(self) -> None:
        pass


def _bank(bank_id: str, row: dict) -> Bank:
    known = BankConfig.__dataclass_fields__
    return Bank(bank_id=bank_id, display_name=row["display_name"],
                config=BankConfig(**{k: v for k, v in row["config"].items() if k in known}),
                created_at=from_epoch(row["created_at"]), updated_at=from_epoch(row["updated_at"]),
                incarnation=row["incarnation"])


def _copy_op(op: Operation) -> Operation:
    return replace(op, memory_ids=list(op.memory_ids),
                   item_errors=[tuple(e) for e in op.item_errors])


# ---- observations ------------------------------------------------------------------------


class MemoryObservationStore:
    """consolidation's projection in dicts (see :class:`mneme.ports.ObservationStore`).
    Messages are kept as their deterministic bytes, so callers never share them."""

    def __init__(self) -> None:
        self._lock = threading.RLock()
        self._seq = 0
        # bank → fact id → [seq, document_id, scopes, consolidated, bytes]
        self._facts: dict[str, dict[str, list]] = {}
        # bank → observation id → (scope key, version, deleted, bytes)
        self._obs: dict[str, dict[str, tuple]] = {}
        # bank → opinion id → (version, deleted, entity ids, bytes)
        self._opinions: dict[str, dict[str, tuple]] = {}
        # "outputs": cause → (bank, [(message class, bytes)]), oldest first; "handled":
        # cause → bank of every event decided (its outputs may be forgotten)
        self._decisions: dict[str, dict] = {"outputs": {}, "handled": {}}
        self._changes = Revisions()  # of each bank's observations
        self._depth = 0

    def revision(self, bank_id: str) -> tuple[int, int, int]:
        """See :meth:`mneme.ports.ObservationStore.revision`."""
        with self._lock:
            return self._changes.of(bank_id)

    @contextmanager
    def transaction(self) -> Iterator[None]:
        """See :meth:`mneme.ports.ObservationStore.transaction` (a rollback restores a
        copy taken when the outermost block began)."""
        with self._lock:
            if self._depth:
                self._depth += 1
                try:
                    yield
                finally:
                    self._depth -= 1
                return
            kept = copy.deepcopy((self._seq, self._facts, self._obs, self._opinions,
                                  self._decisions))
            self._depth = 1
            try:
                yield
            except BaseException:
                (self._seq, self._facts, self._obs, self._opinions, self._decisions) = kept
                self._changes.reset()
                raise
            finally:
                self._depth = 0

    def decision(self, cause: str) -> list | None:
        """See :meth:`mneme.ports.ObservationStore.decision`."""
        with self._lock:
            got = self._decisions["outputs"].get(cause)
            if got is None:
                return [] if cause in self._decisions["handled"] else None
        return [cls.FromString(b) for cls, b in got[1]]

    def record_decision(self, bank_id: str, cause: str, outputs: Sequence) -> None:
        """See :meth:`mneme.ports.ObservationStore.record_decision`."""
        from mneme.stores.observations_sqlite import DECISIONS_KEPT
        with self._lock:
            kept = self._decisions["outputs"]
            kept.pop(cause, None)
            kept[cause] = (bank_id, [(type(m), m.SerializeToString(deterministic=True))
                                     for m in outputs])
            self._decisions["handled"][cause] = bank_id
            while len(kept) > DECISIONS_KEPT:
                del kept[next(iter(kept))]

    def _forget_decisions(self, bank_id: str, causes: bool = False) -> None:
        """Drop the bank's kept outputs (they may quote its facts); with ``causes``, also
        that its events were handled (the bank is deleted)."""
        for d in (self._decisions["outputs"], *((self._decisions["handled"],) if causes
                                                  else ())):
            for k in [k for k, v in d.items() if (v[0] if isinstance(v, tuple) else v)
                      == bank_id]:
                del d[k]

    def flush(self) -> None:
        """Nothing to make durable (memory)."""

    def close(self) -> None:
        pass

    def reset(self) -> None:
        with self._lock:
            self._facts.clear()
            self._obs.clear()
            self._opinions.clear()
            self._decisions = {"outputs": {}, "handled": {}}
            self._changes.reset()

    # ---- facts ----
    def add_facts(self, bank_id: str, facts: Iterable[tuple[ev.Fact, list[list[str]]]]) -> None:
        with self._lock:
            bank = self._facts.setdefault(bank_id, {})
            for f, scopes in facts:
                if f.id not in bank:
                    self._seq += 1
                    bank[f.id] = [self._seq, f.document_id, copy.deepcopy([list(s) for s in scopes]),
                                  False, f.SerializeToString(deterministic=True)]

    def _rows(self, bank_id: str) -> list[tuple[str, list]]:
        return sorted(self._facts.get(bank_id, {}).items(), key=lambda kv: kv[1][0])

    def facts(self, bank_id: str, ids: Iterable[str] | None = None, pending: bool = False
              ) -> list[tuple[ev.Fact, list[list[str]]]]:
        want = set(ids) if ids is not None else None
        with self._lock:
            return [(ev.Fact.FromString(r[4]), copy.deepcopy(r[2])) for i, r in self._rows(bank_id)
                    if (want is None or i in want) and not (pending and r[3])]

    def facts_by_id(self, bank_id: str, ids: Iterable[str]) -> dict[str, ev.Fact]:
        with self._lock:
            bank = self._facts.get(bank_id, {})
            return {i: ev.Fact.FromString(bank[i][4]) for i in sorted(set(ids)) if i in bank}

    def fact_ids_of_document(self, bank_id: str, document_id: str) -> list[str]:
        with self._lock:
            return [i for i, r in self._rows(bank_id) if r[1] == document_id]

    def delete_facts(self, bank_id: str, ids: Iterable[str]) -> None:
        with self._lock:
            bank = self._facts.get(bank_id, {})
            if [bank.pop(i) for i in ids if i in bank]:
                self._forget_decisions(bank_id)  # they may quote the facts

    def delete_bank(self, bank_id: str) -> None:
        with self._lock:
            self._facts.pop(bank_id, None)
            self._obs.pop(bank_id, None)
            self._opinions.pop(bank_id, None)
            self._forget_decisions(bank_id, causes=True)
            self._changes.bump(bank_id)

    def _mark(self, bank_id: str, ids: Iterable[str], consolidated: bool) -> None:
        bank = self._facts.get(bank_id, {})
        for i in ids:
            if i in bank:
                bank[i][3] = consolidated

    def replace_vectors(self, bank_id: str, vectors: dict[str, list[float]], model: str) -> None:
        """See :meth:`mneme.ports.ObservationStore.replace_vectors`."""
        with self._lock:
            for i, r in self._facts.get(bank_id, {}).items():
                if i in vectors:
                    f = ev.Fact.FromString(r[4])
                    f.embedding[:] = vectors[i]
                    r[4] = f.SerializeToString(deterministic=True)
            for table, cls, at in ((self._obs, ev.Observation, 3), (self._opinions, ev.Opinion, 3)):
                bank = table.get(bank_id, {})
                for i, r in list(bank.items()):
                    if i not in vectors:
                        continue
                    o = cls.FromString(r[at])
                    if o.deleted:
                        continue
                    o.embedding[:] = vectors[i]
                    o.embedding_model = model
                    bank[i] = (*r[:at], o.SerializeToString(deterministic=True))
            self._changes.bump(bank_id)

    # ---- observations ----
    def observations(self, bank_id: str, scope: list[str] | None = None,
                     include_deleted: bool = False) -> dict[str, ev.Observation]:
        key = _scope_key(scope) if scope is not None else None
        with self._lock:
            rows = sorted(self._obs.get(bank_id, {}).items())
            return {i: ev.Observation.FromString(r[3]) for i, r in rows
                    if (key is None or r[0] == key) and (include_deleted or not r[2])}

    def apply(self, m: ev.ObservationsChanged) -> None:
        with self._lock:  # nothing below can fail halfway, so this is atomic
            bank = self._obs.setdefault(m.bank_id, {})
            for o in m.observations:
                old = bank.get(o.id)
                if old is not None and old[1] >= o.version:
                    continue
                self._changes.bump(m.bank_id)
                o = tombstone(o)  # as the SQLite store keeps a deleted one
                bank[o.id] = (_scope_key(o.scope), o.version, bool(o.deleted),
                              o.SerializeToString(deterministic=True))
            self._mark(m.bank_id, m.reset_memory_ids, False)
            self._mark(m.bank_id, m.consolidated_memory_ids, True)

    # ---- opinions ----
    def apply_opinions(self, m: ev.OpinionsChanged) -> None:
        with self._lock:
            bank = self._opinions.setdefault(m.bank_id, {})
            for o in m.opinions:
                old = bank.get(o.id)
                if old is not None and old[0] >= o.version:
                    continue
                o = opinion_tombstone(o)
                bank[o.id] = (o.version, bool(o.deleted), frozenset(e.id for e in o.entities),
                              o.SerializeToString(deterministic=True))

    def opinions(self, bank_id: str, ids: Iterable[str] | None = None,
                 entity_ids: Iterable[str] | None = None, limit: int = 1000
                 ) -> dict[str, ev.Opinion]:
        want = set(ids) if ids is not None else None
        ents = set(entity_ids) if entity_ids is not None else None
        with self._lock:
            rows = sorted(self._opinions.get(bank_id, {}).items())
            hits = [(i, r) for i, r in rows if not r[1] and (want is None or i in want)
                    and (ents is None or r[2] & ents)][:limit]
            return {i: ev.Opinion.FromString(r[3]) for i, r in hits}

    def dump_opinions(self, bank_id: str) -> list[bytes]:
        with self._lock:
            return [r[3] for _, r in sorted(self._opinions.get(bank_id, {}).items())]

    def counts(self, bank_id: str) -> tuple[int, int, int]:
        with self._lock:
            facts = self._facts.get(bank_id, {}).values()
            return (len(facts), sum(1 for f in facts if f[3]),
                    len(self._obs.get(bank_id, {})))

    def dump(self, bank_id: str) -> list[bytes]:
        with self._lock:
            return [r[3] for _, r in sorted(self._obs.get(bank_id, {}).items())]


def _scope_key(tags: Iterable[str]) -> tuple[str, ...]:
    return tuple(sorted(set(tags)))


# ---- entities ----------------------------------------------------------------------------


class MemoryEntityStore:
    """Entity-resolution decisions in dicts (see :class:`mneme.ports.EntityStore`).
    ``close`` keeps the data (a test may hand the same store to a new resolver to play a
    restart)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._entities: dict[str, dict[str, StoredEntity]] = {}  # bank → id → entity (in order)
        self._aliases: dict[str, dict[tuple[str, str], None]] = {}  # bank → ordered pair set
        # bank → entity id → {(scope, fact id or "")}
        self._mentions: dict[str, dict[str, set[tuple[str, str]]]] = {}
        # (bank, cause) → (entities, claims, aliases) recorded, oldest cause first
        self._decisions: dict[tuple[str, str], tuple[list, list, list]] = {}
        # bank → merged entity id → the survivor whose deletion erases its records
        self._holders: dict[str, dict[str, str]] = {}

    def load(self, bank_id: str) -> tuple[list[StoredEntity], list[tuple[str, str]]]:
        with self._lock:
            return (list(self._entities.get(bank_id, {}).values()),
                    list(self._aliases.get(bank_id, {})))

    def persist(self, bank_id: str, entities: Sequence[StoredEntity] = (),
                claims: Sequence[StoredEntity] = (),
                aliases: Sequence[tuple[str, str]] = (), cause: str = "") -> None:
        from mneme.stores.entities_sqlite import DECISIONS_KEPT
        with self._lock:
            if cause and (entities or claims or aliases):
                kept = self._decisions.setdefault((bank_id, cause), ([], [], []))
                for into, new in zip(kept, (entities, claims, aliases)):
                    into.extend(new)
                while len(self._decisions) > DECISIONS_KEPT:
                    del self._decisions[next(iter(self._decisions))]
            known = self._entities.setdefault(bank_id, {})
            for e in entities:
                known.setdefault(e.id, e)
            for e in claims:
                if e.id in known:
                    known[e.id] = replace(known[e.id], label=e.label, kind=e.kind)
            pairs = self._aliases.setdefault(bank_id, {})
            for a, i in aliases:
                pairs.setdefault((a, i), None)

    def rewrite(self, bank_id: str, entities: Sequence[StoredEntity] = (),
                aliases: Sequence[tuple[str, str]] = (), removed: Sequence[str] = (),
                mentions_of: Sequence[tuple[str, str]] = ()) -> None:
        with self._lock:
            known = self._entities.setdefault(bank_id, {})
            for e in entities:
                known[e.id] = e  # a known id keeps its place in the dict's order
            scopes = self._mentions.setdefault(bank_id, {})
            for i, src in mentions_of:
                if scopes.get(src):
                    scopes.setdefault(i, set()).update(scopes[src])
            touched = {e.id for e in entities} | set(removed)
            pairs = self._aliases.setdefault(bank_id, {})
            for pair in [p for p in pairs if p[1] in touched]:
                del pairs[pair]
            for a, i in aliases:
                pairs.setdefault((a, i), None)
            holders = self._holders.setdefault(bank_id, {})
            for i, src in mentions_of:
                if src in removed:
                    holders[src] = i
                    for k, v in list(holders.items()):
                        if v == src:
                            holders[k] = i
            for i in removed:
                known.pop(i, None)
                scopes.pop(i, None)

    def decisions(self, bank_id: str, cause: str) -> tuple[list[StoredEntity],
                                                          list[StoredEntity],
                                                          list[tuple[str, str]]]:
        with self._lock:
            got = self._decisions.get((bank_id, cause), ([], [], []))
            return list(got[0]), list(got[1]), list(got[2])

    def add_mentions(self, bank_id: str, mentions: Sequence[tuple[str, ...]]) -> None:
        with self._lock:
            known = self._mentions.setdefault(bank_id, {})
            for i, s, *fact in mentions:
                known.setdefault(i, set()).add((s, fact[0] if fact else ""))

    def drop_scope(self, bank_id: str, scope: str) -> list[str]:
        return self._drop(bank_id, lambda m: m[0] == scope)

    def drop_facts(self, bank_id: str, fact_ids: Sequence[str]) -> list[str]:
        facts = set(fact_ids) - {""}
        return self._drop(bank_id, lambda m: m[1] in facts)

    def _drop(self, bank_id: str, dropped) -> list[str]:
        with self._lock:
            known = self._mentions.get(bank_id, {})
            gone = []
            for i, mentions in list(known.items()):
                left = {m for m in mentions if not dropped(m)}
                if len(left) < len(mentions):
                    known[i] = left
                    if not left:
                        del known[i]
                        gone.append(i)
            self._delete_entities(bank_id, gone)
            return gone

    def drop_entities(self, bank_id: str, entity_ids: Sequence[str]) -> list[str]:
        with self._lock:
            known = self._entities.get(bank_id, {})
            gone = [i for i in dict.fromkeys(entity_ids) if i in known]
            for i in gone:
                self._mentions.get(bank_id, {}).pop(i, None)
            self._delete_entities(bank_id, gone)
            return gone

    def _delete_entities(self, bank_id: str, gone: list[str]) -> None:
        """The entities ``gone`` (mentions already dropped), their aliases and recorded
        decisions (under the caller's lock)."""
        for i in gone:
            self._entities.get(bank_id, {}).pop(i, None)
            pairs = self._aliases.get(bank_id, {})
            for pair in [p for p in pairs if p[1] == i]:
                del pairs[pair]
        held = self._holders.get(bank_id, {})
        erased = set(gone) | {k for k, v in held.items() if v in gone}
        for (b, _), (es, cs, als) in self._decisions.items():
            if b == bank_id and erased:
                es[:] = [e for e in es if e.id not in erased]
                cs[:] = [e for e in cs if e.id not in erased]
                als[:] = [a for a in als if a[1] not in erased]

    def forget(self, bank_id: str) -> None:
        with self._lock:
            self._entities.pop(bank_id, None)
            self._aliases.pop(bank_id, None)
            self._mentions.pop(bank_id, None)
            for k in [k for k in self._decisions if k[0] == bank_id]:
                del self._decisions[k]
            self._holders.pop(bank_id, None)

    def close(self) -> None:
        pass


# ---- documents -----------------------------------------------------------------------------


class MemoryDocumentStore:
    """Documents, their revisions and text in dicts (see :class:`mneme.ports.DocumentStore`)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._storage: dict[str, bool] = {}
        # (bank, document) → {"created", "updated", "text", "history": [DocumentRevision]}
        self._docs: dict[tuple[str, str], dict] = {}

    def set_storage(self, bank_id: str, store_text: bool) -> None:
        with self._lock:
            self._storage[bank_id] = bool(store_text)

    def storage(self, bank_id: str) -> bool:
        with self._lock:
            return self._storage.get(bank_id, True)

    def add_revisions(self, bank_id: str, entries) -> int:
        added = 0
        with self._lock:
            for document_id, rev, text in entries:
                doc = self._docs.get((bank_id, document_id))
                if doc is not None and any(r.operation_id == rev.operation_id
                                           for r in doc["history"]):
                    continue
                if doc is None:
                    doc = self._docs[(bank_id, document_id)] = dict(created=rev.at, history=[])
                doc["history"] = [replace(r, content_hash="", chars=0, context="",
                                          text_stored=False) for r in doc["history"]]
                doc["history"].append(replace(rev, revision=len(doc["history"]) + 1,
                                              tags=tuple(rev.tags)))
                doc.update(updated=rev.at, text=text)
                added += 1
        return added

    def delete_document(self, bank_id: str, document_id: str) -> bool:
        with self._lock:
            return self._docs.pop((bank_id, document_id), None) is not None

    def delete_bank(self, bank_id: str) -> None:
        with self._lock:
            self._storage.pop(bank_id, None)
            for k in [k for k in self._docs if k[0] == bank_id]:
                del self._docs[k]

    def _doc(self, bank_id: str, document_id: str, text: bool):
        from mneme.domain import StoredDocument
        d = self._docs[(bank_id, document_id)]
        return StoredDocument(bank_id=bank_id, document_id=document_id, created_at=d["created"],
                              updated_at=d["updated"], latest=d["history"][-1],
                              revisions=len(d["history"]), text=d["text"] if text else None)

    def get(self, bank_id: str, document_id: str):
        with self._lock:
            if (bank_id, document_id) not in self._docs:
                return None
            return self._doc(bank_id, document_id, True)

    def revisions(self, bank_id: str, document_id: str, limit: int) -> list:
        with self._lock:
            d = self._docs.get((bank_id, document_id))
            return list(d["history"][-limit:]) if d is not None and limit > 0 else []

    def list(self, bank_id: str, limit: int, after: str = "") -> list:
        with self._lock:
            ids = sorted(i for b, i in self._docs if b == bank_id and i > after)[:max(limit, 0)]
            return [self._doc(bank_id, i, False) for i in ids]

    def count(self, bank_id: str) -> int:
        with self._lock:
            return sum(1 for b, _ in self._docs if b == bank_id)

    def dump(self, bank_id: str) -> list[bytes]:
        from mneme.stores.documents_sqlite import dump_document
        with self._lock:
            ids = sorted(i for b, i in self._docs if b == bank_id)
            return [dump_document(self._doc(bank_id, i, True), list(self._docs[(bank_id, i)]["history"]))
                    for i in ids]

    def reset(self) -> None:
        with self._lock:
            self._storage.clear()
            self._docs.clear()

    def close(self) -> None:
        pass
