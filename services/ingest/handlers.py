"""ingest's handlers: the write commands (validate, append to the intake topic, wait
for read-your-writes) and the catalog projection of intake and progress events."""

from __future__ import annotations

import base64
import contextlib
import functools
import inspect
import hashlib
import json
import logging
import threading
import time
import uuid
import weakref
from dataclasses import dataclass, field, replace
from typing import Callable, Sequence

from mneme import bank_catalog, limits
from mneme.bus import INTAKE, MEMORY, codec, partition_for
from mneme.domain import (DIRECTIVE_FIELDS, EXTRACTION_MODES, Bank, BankConfig, Directive,
                          EventMeta, Operation, RetainItem, derive_id)
from mneme.deadline import current as current_deadline
from mneme.errors import (AlreadyExists, Cancelled, DeadlineExceeded, FailedPrecondition,
                          InvalidArgument, NotFound, Unavailable)
from mneme.events.v1 import events_pb2 as ev
from mneme.keys import Keyring, document_scope, fact_key_id
from mneme.locks import KeyedLocks
from mneme.names import check_bank_id, check_uuid
from mneme.slots import WaitSlots
from mneme.ports import Catalog, EventLog, Llm, OutRecord, PendingDeletion, Record

log = logging.getLogger(__name__)

#: Bank fields UpdateBank's ``update_mask`` may name (AIP-134), relative to the bank.
CONFIG_FIELDS = tuple(BankConfig.__dataclass_fields__)
MASK_PATHS = ("display_name", *(f"config.{f}" for f in CONFIG_FIELDS))
#: Seconds an async request waits, at most, for its operation to be in the catalog
#: (read-your-writes: it is there within milliseconds while the catalog's consumer runs).
ASYNC_PROJECTED_S = 5.0
#: The tenant (:meth:`mneme.slots.WaitSlots.try_hold`) of those waits: one for all of them.
ASYNC_WAITS = "async-waits"


# ---- projection: the catalog of operations (banks: mneme.bank_catalog) ---------------------

#: Operation kind of each request event.
_KIND = {"RetainRequested": "retain", "DocumentDeleteRequested": "delete_document",
         "BankDeleted": "delete_bank",
         "MemoryDeleteRequested": "delete_memory", "ConsolidationRequested": "consolidate",
         "EntityMergeRequested": "merge_entities", "EntitySplitRequested": "split_entity"}


def on_operation_requested(m, meta: EventMeta, *, catalog: Catalog) -> list:
    """A request (retain, document or memory deletion, consolidation, entity merge or
    split) becomes a pending operation in ``catalog``; a retain counts its items.
    Idempotent; produces nothing."""
    at = meta.time.timestamp()
    retain = isinstance(m, ev.RetainRequested)
    kind = _KIND[m.DESCRIPTOR.name]
    if isinstance(m, ev.ConsolidationRequested) and m.action == "delete_opinion":
        kind = "delete_opinion"
    catalog.put_operation(Operation(
        m.operation_id, m.bank_id, kind,
        items_total=len(m.items) if retain else 0, created_at=at, updated_at=at,
        retry_of=m.retry_of if retain else "",
        source="/".join(map(str, meta.position)) if meta.position else ""))
    return []


def on_deletion_requested(m: ev.DocumentDeleteRequested | ev.MemoryDeleteRequested,
                          meta: EventMeta, *, catalog: Catalog, keyring=None) -> list:
    """A DeleteDocument or DeleteMemory: a pending operation, and the mental-model
    contents that cite what it deletes erased (:func:`mneme.bank_catalog.on_sources_deleted`;
    ``keyring``: the data keys). Idempotent; produces nothing."""
    on_operation_requested(m, meta, catalog=catalog)
    return bank_catalog.on_sources_deleted(m, meta, catalog=catalog, keyring=keyring)


def on_operation_cancel_requested(m: ev.OperationCancelRequested, meta: EventMeta, *,
                                  catalog: Catalog) -> list:
    """CancelOperation: the operation (when known and not yet ended) shows
    ``cancel_requested``; extraction stops its work (it looks for this event on the log)
    and its progress ends it. Idempotent; produces nothing."""
    op = catalog.get_operation(m.operation_id)
    if op is not None and not op.done and not op.cancel_requested:
        catalog.update_operation(replace(op, cancel_requested=True,
                                         updated_at=meta.time.timestamp()))
    return []


def on_bank_deleted(m: ev.BankDeleted, meta: EventMeta, *, catalog: Catalog) -> list:
    """The bank leaves the catalog (its operations with it); its deletion becomes a
    pending operation of its own when it has one. Idempotent; produces nothing. A repeat
    of a deletion already projected (its operation known: ingest appends a kept
    deletion again when it cannot tell that the first append landed) changes nothing:
    dropping the bank's operations again would drop the deletion's own. (Its operation
    known while the bank is still there is its progress, projected first from the other
    topic: the deletion is not projected yet.)"""
    if (m.operation_id and catalog.get_operation(m.operation_id) is not None
            and catalog.get_bank(m.bank_id) is None):
        return []
    bank_catalog.on_bank_deleted(m, meta, catalog=catalog)
    if m.operation_id:
        on_operation_requested(m, meta, catalog=catalog)
    return []


def on_operation_progress(m: ev.OperationProgress, meta: EventMeta, *, catalog: Catalog) -> list:
    """Progress of an operation (the first terminal state stays final: see the Catalog
    port). Produces nothing."""
    at = meta.time.timestamp()
    catalog.update_operation(Operation(
        m.operation_id, m.bank_id, m.kind, m.state, m.items_total, m.items_done, m.facts,
        m.error, list(m.memory_ids), created_at=at, updated_at=at,
        item_errors=[(f.item_index, f.field, f.error) for f in m.failures],
        cancelled=m.cancelled, cancel_requested=m.cancelled))
    return []


class CatalogChanges:
    """The :class:`~mneme.ports.Catalog` ingest's group writes, which wakes the sync waits
    (:attr:`changed`, a Condition) after every write, so a retain returns as soon as its
    progress is projected rather than at the next poll. Reads pass through."""

    def __init__(self, catalog: Catalog) -> None:
        self.catalog = catalog
        self.changed = threading.Condition()

    def _wrote(self) -> None:
        with self.changed:
            self.changed.notify_all()

    def upsert_bank(self, *args, **kwargs) -> None:
        self.catalog.upsert_bank(*args, **kwargs)
        self._wrote()

    def delete_bank(self, bank_id: str, at: float | None = None) -> None:
        self.catalog.delete_bank(bank_id, at)
        self._wrote()

    def upsert_directive(self, *args, **kwargs) -> None:
        self.catalog.upsert_directive(*args, **kwargs)
        self._wrote()

    def delete_directive(self, *args, **kwargs) -> None:
        self.catalog.delete_directive(*args, **kwargs)
        self._wrote()

    def upsert_mental_model(self, *args, **kwargs) -> None:
        self.catalog.upsert_mental_model(*args, **kwargs)
        self._wrote()

    def delete_mental_model(self, *args, **kwargs) -> None:
        self.catalog.delete_mental_model(*args, **kwargs)
        self._wrote()

    def put_operation(self, op: Operation) -> None:
        self.catalog.put_operation(op)
        self._wrote()

    def update_operation(self, op: Operation) -> None:
        self.catalog.update_operation(op)
        self._wrote()

    def reset(self) -> None:
        self.catalog.reset()
        self._wrote()

    def __getattr__(self, name: str):  # the reads (get_*, list_*, close)
        return getattr(self.catalog, name)


def _check_directive(d: Directive, fields: Sequence[str]) -> None:
    if "text" in fields and not d.text.strip():
        raise InvalidArgument("directive.text", "required: the rule reflect must follow")
    if "tags" in fields:
        for i, t in enumerate(d.tags):
            if not t.strip():
                raise InvalidArgument(f"directive.tags[{i}]", "must not be empty")


def _directive_event(d: Directive, mask: Sequence[str]) -> ev.DirectiveChanged:
    """The DirectiveChanged of creating ``d`` (empty ``mask``) or of changing its
    ``mask`` fields (only those are carried)."""
    fields = mask or DIRECTIVE_FIELDS
    m = ev.DirectiveChanged(bank_id=d.bank_id, id=d.id, update_mask=list(mask))
    for f in fields:
        value = getattr(d, f)
        if f == "tags":
            m.tags.extend(dict.fromkeys(value))
        else:
            setattr(m, f, value)
    return m


# ---- commands ----------------------------------------------------------------------------


class BankGate:
    """One bank's writes against its deletion: any number of writers hold it
    :meth:`shared` from their check that the bank exists to their append, a deletion
    holds it :meth:`exclusive` until the catalog has dropped the bank. So no write
    checked against the bank lands on the log after its BankDeleted (it would be
    extracted and stored into no bank, and show up in the bank made again under the
    id). A waiting deletion goes before new writers."""

    def __init__(self) -> None:
        self._cond = threading.Condition()
        self._writers = 0
        self._deleting = False

    @contextlib.contextmanager
    def shared(self):
        with self._cond:
            while self._deleting:
                self._cond.wait()
            self._writers += 1
        try:
            yield
        finally:
            with self._cond:
                self._writers -= 1
                if not self._writers:
                    self._cond.notify_all()

    @contextlib.contextmanager
    def exclusive(self):
        with self._cond:
            while self._deleting:
                self._cond.wait()
            self._deleting = True  # from here new writers wait
            while self._writers:
                self._cond.wait()
        try:
            yield
        finally:
            with self._cond:
                self._deleting = False
                self._cond.notify_all()


#: How many retains with a ``request_id`` :class:`Ingest` remembers having appended
#: (about 100 bytes each): a repeat of an older one finds it in the catalog by then.
APPENDED_REQUESTS = 10_000


def _sync_bounded(method):
    """A write that may wait for its operation (its ``wait`` argument, True by default)
    holds one of :attr:`Ingest.sync_calls` while it runs (:meth:`Ingest._sync_slot`),
    counted against the share of its bank: its ``bank_id``, its directive's (``d``), or
    the bank of the operation it names (``operation_id``: RetryOperation)."""
    signature = inspect.signature(method)

    @functools.wraps(method)
    def bounded(self, *args, **kwargs):
        bound = signature.bind(self, *args, **kwargs).arguments
        bank_id = bound.get("bank_id") or getattr(bound.get("d"), "bank_id", "")
        # (a catalog read only when a tenant's share is set; unknown: the method says so)
        if not bank_id and bound.get("operation_id") and self.slots.share < self.slots.size:
            op = self.catalog.get_operation(bound["operation_id"])
            bank_id = op.bank_id if op is not None else ""
        with self._sync_slot(bound.get("wait", True), bank_id):
            return method(self, *args, **kwargs)
    return bounded


@dataclass
class Ingest:
    """The write side. ``log`` is the event log, ``catalog`` the ingest projection
    (consumer group ``group``), ``retain_timeout_s`` the default deadline of sync work
    (seconds); what it appends carries ``ce_source`` ``source``."""

    log: EventLog
    catalog: Catalog
    retain_timeout_s: float = 600.0
    poll_s: float = 0.05  # the longest sleep of a sync wait between catalog writes
    llm: Llm | None = None  # for check_llm
    group: str = ""   # the catalog projection's consumer group (services/ingest/routes.py)
    source: str = ""  # ce_source of what it appends (the ingest Service's)
    #: For GetBankStats: search's projections when this process has them, and the
    #: consumer groups that run in the topology (``groups() -> {group id: topics}``).
    stores: object = None
    #: For GetBankProfile: search's document projection when this process has it.
    documents: object = None
    groups: Callable[[], dict] = dict
    #: ``catch_up(bank_id | None)``: before a read, wait for this replica's catalog to
    #: hold what other replicas wrote (distributed, :func:`mneme.bootstrap`); no-op here.
    catch_up: Callable[[str | None], object] = lambda bank_id: True
    #: The data keys of crypto-shredding (:class:`mneme.keys.Keyring`), or None. A
    #: deletion destroys its keys *before* its request is appended: once the call
    #: returns, nothing deleted can be read back from the log, and a retain that follows
    #: gets new keys. The key store keeps the request with the destruction (one write)
    #: until it is on the log, so a deletion cut between the two (a kill, a failed
    #: append) is appended by :meth:`complete_deletions`: at ingest's start, and before
    #: the next write to its bank, with its operation id (the stores would otherwise
    #: serve content the log can no longer open, and a replay would disagree).
    keys: Keyring | None = None
    #: A sync deletion also waits for every other projection (embedded: they run in this
    #: process). Off on Kafka for now: there the wait did not end in the integration tests.
    wait_projections: bool = True
    #: Operation ids of retains with a ``request_id`` this process appended and its
    #: catalog may not show yet, with their item counts (the last
    #: :data:`APPENDED_REQUESTS`): a repeat arriving before the first is projected is
    #: answered from it instead of appended again (a second copy would be handled as a
    #: replacement of its document, its facts briefly gone).
    _appended: dict = field(default_factory=dict, repr=False)
    _appended_lock: threading.Lock = field(default_factory=threading.Lock, repr=False)
    #: One lock per operation id being appended, or per id being created or deleted,
    #: so a slow append holds up only an identical request, never another one.
    _id_locks: KeyedLocks = field(default_factory=KeyedLocks, repr=False)
    #: How many sync writes (Retain, DeleteDocument, DeleteMemory, Consolidate,
    #: DeleteOpinion, DeleteBank; and the writes that wait for the catalog: UpsertBank,
    #: UpdateBank, directive writes, RetryOperation) may wait for their
    #: operation or projection at once (0: no bound). Each
    #: holds a gRPC worker thread while it waits; beyond the bound a sync write is refused
    #: (ResourceExhausted) before it changes anything, so reads and async writes keep
    #: threads to run on.
    sync_calls: int = 0
    #: The slots those waits hold (:class:`mneme.slots.WaitSlots`): the process's own,
    #: shared with every other service's waiting calls; None: ``sync_calls`` of its own.
    slots: WaitSlots | None = None
    #: A :class:`BankGate` per bank being written or deleted (gone with its last holder).
    _gates: weakref.WeakValueDictionary = field(
        default_factory=weakref.WeakValueDictionary, repr=False)
    #: bank id → the record of its BankDeleted while the catalog may not have dropped
    #: it yet (a deletion whose wait ran out): writes to it are refused until then.
    _deleting: dict = field(default_factory=dict, repr=False)
    #: Operation ids of the deletions this process is destroying and appending now (not
    #: for :meth:`complete_deletions` to append a second time).
    _deletions_running: set = field(default_factory=set, repr=False)

    def __post_init__(self) -> None:
        if self.slots is None:
            self.slots = WaitSlots(self.sync_calls)

    def _gate(self, bank_id: str) -> BankGate:
        with self._appended_lock:
            gate = self._gates.get(bank_id)
            if gate is None:
                gate = self._gates[bank_id] = BankGate()
            return gate

    @staticmethod
    def _caller_waits(what: str) -> None:
        """Before a write changes anything (its append; a deletion's keys before it):
        DeadlineExceeded / Cancelled when the caller's deadline has passed or the caller
        went away (:func:`mneme.deadline.current`), so a call already answered with that
        status writes nothing its retry would write again."""
        current_deadline().check(what)

    @contextlib.contextmanager
    def _sync_slot(self, wait: bool, bank_id: str = ""):
        """Held by a sync write (``wait``) on ``bank_id`` from its start to the end of its
        wait: one of :attr:`slots`. ResourceExhausted, before anything is written, when
        they are all taken or its tenant holds its share (:class:`WaitSlots`)."""
        if not wait:
            yield
            return
        with self.slots.hold(bank_id):
            yield

    @contextlib.contextmanager
    def _writing(self, bank_id: str):
        """Held from a write's check that ``bank_id`` exists to its append: a DeleteBank
        waits for it, and a write waits for a DeleteBank (:class:`BankGate`). Entered
        only while the caller still waits (:meth:`_caller_waits`)."""
        gate = self._gate(bank_id)
        with gate.shared():
            self._caller_waits(f"write to bank {bank_id!r}")
            self.complete_deletions(bank_id)  # a deletion cut short goes before the write
            self._refuse_while_deleting(bank_id)
            yield

    def _refuse_while_deleting(self, bank_id: str) -> None:
        """NotFound while a DeleteBank of ``bank_id`` this process appended is not yet
        projected by its catalog (its wait ran out): the catalog still holds the bank, but
        nothing may be written to it, nor may it be deleted again. No CreateBank after
        that deletion can have been acknowledged yet (it waits for its own record)."""
        rec = self._deleting.get(bank_id)
        if rec is not None:
            if self.log.committed(self.group, rec.topic, rec.partition) <= rec.offset:
                raise NotFound(f"bank {bank_id!r} is being deleted")
            self._deleting.pop(bank_id, None)

    def _append(self, msg, bank_id: str) -> Record:
        return self.log.append([codec.encode(msg, bank_id=bank_id, source=self.source)])[0]

    def _destroy_and_append(self, msg, bank_id: str, destroy: Callable | None) -> Record:
        """A deletion: ``destroy(pending)`` destroys its keys (a Keyring call) with the
        request kept in the key store, then the request is appended and the kept copy
        cleared. ``destroy`` None (no keys to destroy): only the append."""
        out = codec.encode(msg, bank_id=bank_id, source=self.source)
        if self.keys is None or destroy is None:
            return self.log.append([out])[0]
        op_id = msg.operation_id
        with self._appended_lock:
            self._deletions_running.add(op_id)
        try:
            destroy(PendingDeletion(bank_id, op_id, _pack(out)))
            rec = self.log.append([out])[0]
            self._cleared(bank_id, op_id)
        finally:  # appended and cleared, or left for complete_deletions
            with self._appended_lock:
                self._deletions_running.discard(op_id)
        return rec

    def _cleared(self, bank_id: str, op_id: str) -> None:
        """Clear a kept deletion whose request is on the log. A failure is only logged:
        the deletion is done, and the request appended again at the next start or write
        to the bank is a harmless repeat (same operation and event id)."""
        try:
            self.keys.clear_pending(bank_id, op_id)
        except Exception:  # noqa: BLE001 - see above
            log.warning("bank %s: the kept request of deletion %s was not cleared; it is "
                        "appended again later (a repeat)", bank_id, op_id, exc_info=True)

    def complete_deletions(self, bank_id: str | None = None) -> int:
        """Append the deletions the key store kept (of ``bank_id``, or of every bank; not
        those this process is appending now), oldest first, each as the record first
        written for it (same operation and event id), then clear them: a deletion whose
        keys were destroyed but whose request did not reach the log (the process was
        killed in between, or the append failed) completes, and its operation ends. A
        BankDeleted completed this way refuses writes to the bank until the catalog has
        dropped it, as :meth:`delete_bank` does. Returns how many were appended; raises
        the log's errors (Unavailable), leaving the rest kept."""
        if self.keys is None:
            return 0
        pending = self.keys.pending_deletions(bank_id)
        if not pending:  # the usual case: one look-up, no lock
            return 0
        done = 0
        for p in pending:
            with self._id_locks.hold(f"deletion:{p.operation_id}"):
                with self._appended_lock:
                    if p.operation_id in self._deletions_running:
                        continue
                if not any(q.operation_id == p.operation_id
                           for q in self.keys.pending_deletions(p.bank_id)):
                    continue  # completed meanwhile by another call
                out = _unpack(p.request)
                rec = self.log.append([out])[0]
                if codec.decode(out).type == codec.event_type(ev.BankDeleted):
                    self._deleting[p.bank_id] = rec
                log.info("bank %s: deletion %s completed (its keys were destroyed, its "
                         "request had not reached the event log)", p.bank_id, p.operation_id)
                self._cleared(p.bank_id, p.operation_id)
                done += 1
        return done

    def _wait(self, done: Callable[[], bool], timeout: float, what: str,
              poll: float | None = None) -> None:
        """Until ``done()``: woken by every catalog write (:class:`CatalogChanges`),
        else every ``poll`` seconds (default ``poll_s``; deadline, damage and
        cancellation are checked then too)."""
        call = current_deadline()
        left = call.remaining()  # the caller's own deadline bounds the wait too
        timeout = timeout if left is None else min(timeout, left)
        deadline = time.monotonic() + timeout
        changed = getattr(self.catalog, "changed", None) or threading.Condition()
        with changed:  # held while checking, so a write in between is not missed
            while not done():
                if time.monotonic() > deadline:
                    raise DeadlineExceeded(
                        f"{what} not finished within {timeout:.1f}s; it goes on")
                damage = getattr(self.log, "damage", None)  # embedded log found damaged: no
                if damage:  # consumer will finish the work, so do not wait for the deadline
                    raise Unavailable(f"{what}: the event log is damaged ({damage}); see "
                                      "`mneme log recover`")
                if call.cancelled():  # the caller went away: stop waiting (work goes on)
                    raise Cancelled(f"{what}: the call was cancelled; the operation goes on")
                changed.wait(poll or self.poll_s)

    def _wait_every_projection(self, bank_id: str, timeout: float,
                               rec: Record | None = None) -> None:
        """Until every running consumer group that reads ``mneme.memory.v1`` has committed
        the bank's memory records that exist now (search's deletion progress is among
        them), and every one that reads ``mneme.intake.v1`` the deletion request ``rec``
        itself (search's document projection erases the text there): a sync deletion
        returns once every projection (consolidation's, entity resolution's, the
        documents') has dropped what it deleted, not only search. Bounded by ``timeout``
        like the operation's wait."""
        # the groups running now (a declared group no process runs would never commit)
        live = set(self.log.groups(live_only=True))
        groups = {g: t for g, t in self.groups().items() if g in live}
        readers = [g for g, topics in groups.items() if MEMORY in topics]
        intake = [g for g, topics in groups.items() if INTAKE in topics] if rec else []
        n = self.log.partitions(MEMORY) if readers else 0
        if not n and not intake:
            return
        p = partition_for(bank_id, n) if n else 0
        end = self.log.end_offset(MEMORY, p) if n else 0
        self._wait(lambda: all(self.log.committed(g, MEMORY, p) >= end for g in readers)
                   and all(self.log.committed(g, rec.topic, rec.partition) > rec.offset
                           for g in intake),
                   max(timeout, 0.0), f"the projections of bank {bank_id!r}")

    def _wait_projected(self, rec: Record, timeout: float) -> None:
        """Read-your-writes on the catalog: wait until the ingest group consumed ``rec``."""
        # the commit follows the catalog write that wakes the wait: poll it closely
        self._wait(lambda: self.log.committed(self.group, rec.topic, rec.partition) > rec.offset,
                   timeout, "catalog projection", poll=0.01)

    def require_bank(self, bank_id: str, fresh: bool = True) -> Bank:
        """The bank, as every replica's writes left it; NotFound when it does not exist.
        ``fresh`` False: a bank this replica knows is taken as it is (a write needs only
        to know that it exists; the event applies to the bank as the log has it), and the
        catalog catches up only when it does not know it."""
        bank = None if fresh else self.catalog.get_bank(bank_id)
        if bank is not None:
            return bank
        self.catch_up(bank_id)
        bank = self.catalog.get_bank(bank_id)
        if bank is None:
            raise NotFound(f"bank {bank_id!r} not found")
        return bank

    @_sync_bounded
    def upsert_bank(self, bank_id: str, display_name: str, config: BankConfig,
                    timeout: float | None = None) -> Bank:
        """Create or update a bank; returns it as projected."""
        check_bank_id(bank_id, "bank.name")
        _check_config(config)
        self._caller_waits(f"upsert bank {bank_id!r}")
        self.complete_deletions(bank_id)  # a deletion cut short goes before the new bank
        rec = self._append(ev.BankUpserted(bank_id=bank_id, display_name=display_name,
                                           config=codec.bank_config_to_pb(config)), bank_id)
        self._wait_projected(rec, timeout or self.retain_timeout_s)
        return self.require_bank(bank_id)

    @_sync_bounded
    def update_bank(self, bank_id: str, display_name: str, config: BankConfig,
                    mask: Sequence[str], timeout: float | None = None) -> Bank:
        """Change the fields of an existing bank named in ``mask`` (paths relative to the
        bank: "display_name", "config", "config.<field>"; "*" = all; empty = none, the
        transport names the populated fields: :func:`mneme.apiconv.bank_paths_populated`);
        returns the bank as projected. NotFound for an unknown bank; InvalidArgument for an
        unknown path or an invalid value of a masked field."""
        with self._writing(bank_id):
            return self._update_bank(bank_id, display_name, config, mask, timeout)

    def _update_bank(self, bank_id: str, display_name: str, config: BankConfig,
                     mask: Sequence[str], timeout: float | None) -> Bank:
        current = self.require_bank(bank_id)
        paths: list[str] = []
        for i, p in enumerate(mask):
            if p == "*":
                paths.extend(MASK_PATHS)
            elif p == "config":
                paths.extend(f"config.{f}" for f in CONFIG_FIELDS)
            elif p in MASK_PATHS:
                paths.append(p)
            else:
                raise InvalidArgument(f"update_mask.paths[{i}]",
                                      f"unknown field {p!r}; one of {', '.join(MASK_PATHS)}, "
                                      "config or *")
        paths = list(dict.fromkeys(paths))
        if not paths:  # nothing to change (an empty mask on the log would replace it all)
            return current
        changed = {p[7:]: getattr(config, p[7:]) for p in paths if p.startswith("config.")}
        merged = replace(current.config, **changed)
        _check_config(merged)
        rec = self._append(ev.BankUpserted(bank_id=bank_id, display_name=display_name,
                                           config=codec.bank_config_to_pb(merged),
                                           update_mask=paths), bank_id)
        self._wait_projected(rec, timeout or self.retain_timeout_s)
        return self.require_bank(bank_id)

    # ---- directives ----

    def require_directive(self, bank_id: str, directive_id: str) -> Directive:
        """The directive as projected (the bank's partition caught up first); NotFound
        for an unknown bank or directive."""
        self.require_bank(bank_id)
        d = self.catalog.get_directive(bank_id, directive_id)
        if d is None:
            raise NotFound(f"directive {directive_id!r} not found in bank {bank_id!r}")
        return d

    @_sync_bounded
    def create_directive(self, d: Directive, timeout: float | None = None,
                         directive_id: str = "") -> Directive:
        """Create ``d`` in its bank under ``directive_id`` (a UUID the client chose,
        AIP-133) or a new id; returns it as projected. NotFound for an unknown bank;
        InvalidArgument (``directive.<field>``, ``directive_id``) for an empty text or
        tag or an id that is not a UUID; AlreadyExists when the bank has a directive of
        that id (a retry of a create whose answer was lost)."""
        _check_directive(d, DIRECTIVE_FIELDS)
        if directive_id:
            check_uuid(directive_id, "directive_id", "directive id")
        d = replace(d, id=directive_id or str(uuid.uuid4()))
        # one create of an id at a time here, until it is projected (two replicas may race)
        with self._id_locks.hold(f"directive:{d.bank_id}/{d.id}"):
            with self._writing(d.bank_id):
                self.require_bank(d.bank_id, fresh=False)
                if directive_id and self.catalog.get_directive(d.bank_id, d.id) is not None:
                    raise AlreadyExists(f"directive {d.id!r} exists in bank {d.bank_id!r}")
                rec = self._append(_directive_event(d, ()), d.bank_id)
            self._wait_projected(rec, timeout or self.retain_timeout_s)
        return self.require_directive(d.bank_id, d.id)

    @_sync_bounded
    def update_directive(self, d: Directive, paths: Sequence[str],
                         timeout: float | None = None) -> Directive:
        """Change the fields ``paths`` of directive ``d.id`` (some of
        :data:`~mneme.domain.DIRECTIVE_FIELDS`: :func:`mneme.apiconv.update_paths`; none:
        no change); returns it as projected. NotFound for an unknown bank or directive;
        InvalidArgument naming ``directive.<field>`` for a bad value."""
        with self._writing(d.bank_id):
            current = self.require_directive(d.bank_id, d.id)
            paths = [p for p in DIRECTIVE_FIELDS if p in paths]
            if not paths:  # nothing to change (an event without a mask would replace it all)
                return current
            _check_directive(d, paths)
            rec = self._append(_directive_event(d, paths), d.bank_id)
        self._wait_projected(rec, timeout or self.retain_timeout_s)
        return self.require_directive(d.bank_id, d.id)

    @_sync_bounded
    def delete_directive(self, bank_id: str, directive_id: str,
                         timeout: float | None = None) -> None:
        """Delete the directive; NotFound for an unknown bank or directive (also for all
        but one of several deletions of it at once in this process)."""
        with self._id_locks.hold(f"directive:{bank_id}/{directive_id}"):
            with self._writing(bank_id):
                self.require_directive(bank_id, directive_id)
                rec = self._append(ev.DirectiveChanged(bank_id=bank_id, id=directive_id,
                                                       deleted=True), bank_id)
            self._wait_projected(rec, timeout or self.retain_timeout_s)

    @_sync_bounded
    def delete_bank(self, bank_id: str, timeout: float | None = None) -> Operation:
        """Delete a bank; returns once search has purged its units from its stores (the
        operation, kind "delete_bank", terminal) or raises DeadlineExceeded."""
        op_id = str(uuid.uuid4())
        # exclusive: no write checked against this bank is appended after its deletion
        with self._gate(bank_id).exclusive():
            self._caller_waits(f"delete bank {bank_id!r}")
            self.complete_deletions(bank_id)
            self._refuse_while_deleting(bank_id)
            self.require_bank(bank_id)
            rec = self._destroy_and_append(
                ev.BankDeleted(bank_id=bank_id, operation_id=op_id), bank_id,
                self.keys and functools.partial(self.keys.destroy_bank, bank_id))
            # writes are refused until the catalog has dropped the bank, also when this
            # wait runs out (:meth:`_writing`)
            self._deleting[bank_id] = rec
            self._wait_projected(rec, timeout or self.retain_timeout_s)
            self._deleting.pop(bank_id, None)  # the catalog has dropped it
        return self._finish(op_id, rec, bank_id, "delete_bank", 0, True, timeout)

    @_sync_bounded
    def retain(self, bank_id: str, items: Sequence[RetainItem], wait: bool = True,
               timeout: float | None = None, request_id: str = "",
               observation_scopes: ev.ObservationScopes | None = None,
               rejected: dict[int, list[tuple[str, str]]] | None = None) -> Operation:
        """Append one RetainRequested for ``items``. With ``wait`` (sync), return once
        search has indexed the facts (operation terminal) or raise DeadlineExceeded.

        Items that break a rule (empty content, or the transport's limit violations in
        ``rejected``: index → [(field, description)]) fail alone: they travel as empty
        placeholders with their errors (``rejected_items``) and the operation lists them
        in ``item_errors``; the others are stored. When every item is bad the request is
        refused (InvalidArgument naming each field) and nothing is appended.

        A ``request_id`` makes the call idempotent within this incarnation of the bank:
        the operation id derives from (bank incarnation, request_id), a known operation is
        not appended again, and fact ids derive from the operation."""
        with self._writing(bank_id):
            op_id, rec, total = self._append_retain_once(bank_id, items, request_id,
                                                         observation_scopes, rejected)
        return self._finish(op_id, rec, bank_id, "retain", total, wait, timeout)

    def _append_retain_once(self, bank_id: str, items: Sequence[RetainItem], request_id: str,
                            observation_scopes, rejected) -> tuple[str, Record | None, int]:
        """The checks and the append of :meth:`retain`: (operation id, its record or None
        when a request with this ``request_id`` is known already, items total)."""
        # a request_id is looked up among the operations: those of every replica
        bank = self.require_bank(bank_id, fresh=bool(request_id))
        bad = _check_items(items, dict(rejected or {}))
        if len(bad) == len(items):
            violations = [v for i in sorted(bad) for v in bad[i]]
            raise InvalidArgument(*violations[0], *violations[1:])
        # The first incarnation keeps the key of banks made before incarnations existed.
        scope = (bank_id,) if bank.incarnation in ("", "1") else (bank_id, bank.incarnation)
        op_id = derive_id("retain", *scope, request_id) if request_id else str(uuid.uuid4())
        msg = _retain_requested(op_id, bank_id, items, bad, observation_scopes)
        if not request_id:
            return op_id, self._append(msg, bank_id), len(items)
        # the wait for the operation is outside _append_once's lock
        return (op_id, *self._append_once(op_id, len(items), lambda: self._append(msg, bank_id),
                                          request=msg))

    def _append_once(self, op_id: str, total: int, append: Callable[[], Record],
                     request: ev.RetainRequested | None = None) -> tuple[Record | None, int]:
        """Append operation ``op_id``'s request (``append()``, of ``total`` items) unless
        the catalog or this process has it already: (its record, ``total``), or (None,
        the known operation's items total). Check and append are one step per operation
        id, so identical calls at once append it once in this process (two ingest
        replicas may still both append; a second copy would be handled as a replacement
        of its documents, their facts briefly gone). With ``request`` (a retain's, whose
        id the client chose by its ``request_id``), a known operation must have been
        asked for by the same request: InvalidArgument naming ``request_id`` otherwise,
        instead of answering for other items than the caller sent."""
        digest = _request_digest(request) if request is not None else b""
        with self._id_locks.hold(op_id):
            known = self.catalog.get_operation(op_id)
            with self._appended_lock:
                mine = self._appended.get(op_id)
            if known is not None or mine is not None:
                if request is not None:
                    self._check_same_request(op_id, known, mine, digest)
                return None, (known.items_total if known is not None else mine[0])
            rec = append()
            with self._appended_lock:
                self._appended[op_id] = (total, digest)
                while len(self._appended) > APPENDED_REQUESTS:  # oldest first
                    del self._appended[next(iter(self._appended))]
            return rec, total

    def _check_same_request(self, op_id: str, known: Operation | None,
                            mine: tuple[int, bytes] | None, digest: bytes) -> None:
        """InvalidArgument naming ``request_id`` when operation ``op_id`` (``known`` in
        the catalog, or ``mine``: (items, digest) appended by this process) was asked for
        by another request than the one of ``digest``. The request of a catalogued
        operation is read back from the log (opened); one whose content was erased since
        (its document or bank deleted) cannot be compared and is taken as the same."""
        if mine is not None:
            theirs = mine[1]
        else:
            try:
                logged = self._request_of(known)
            except FailedPrecondition:
                return
            if any(r.reason == "erased" for r in logged.rejected_items):
                return
            theirs = _request_digest(logged)
        if theirs != digest:
            raise InvalidArgument(
                "request_id", f"already used in this bank by operations/{op_id} for another "
                "request (other items, tags or scopes): a retry must resend the same "
                "request; a new request needs a new request_id")

    @_sync_bounded
    def delete_document(self, bank_id: str, document_id: str, wait: bool = True,
                        timeout: float | None = None) -> Operation:
        if not document_id:
            raise InvalidArgument("document_id", "required")
        op_id = str(uuid.uuid4())
        with self._writing(bank_id):
            self.require_bank(bank_id, fresh=False)
            rec = self._destroy_and_append(
                ev.DocumentDeleteRequested(bank_id=bank_id, operation_id=op_id,
                                           document_id=document_id), bank_id,
                self.keys and functools.partial(self.keys.destroy_scope, bank_id,
                                                document_scope(document_id)))
        return self._finish(op_id, rec, bank_id, "delete_document", 0, wait, timeout)

    @_sync_bounded
    def delete_memory(self, bank_id: str, memory_id: str, wait: bool = True,
                      timeout: float | None = None) -> Operation:
        op_id = str(uuid.uuid4())
        with self._writing(bank_id):
            self.require_bank(bank_id, fresh=False)
            own = fact_key_id(memory_id)
            # Only a fact has a key of its own. A tombstone for an observation's or an
            # opinion's id (a DeleteMemory search then refuses) would mark everything
            # sealed later that cites it as citing a deleted fact: erased at birth.
            destroy = (functools.partial(self.keys.destroy, bank_id, [own])
                       if self.keys is not None and self.keys.known(bank_id, own) else None)
            rec = self._destroy_and_append(ev.MemoryDeleteRequested(
                bank_id=bank_id, operation_id=op_id, memory_id=memory_id), bank_id, destroy)
        return self._finish(op_id, rec, bank_id, "delete_memory", 0, wait, timeout)

    def data_keys(self, bank_id: str, key_ids: Sequence[str]
                  ) -> tuple[list[tuple[str, bytes]], list[str]]:
        """The data keys of ``key_ids`` for an external reader of the history: ([(key id,
        32 bytes)] found, [key ids missing: destroyed or unknown]), in request order.
        FailedPrecondition when this process keeps no keys (its log is not sealed)."""
        if self.keys is None:
            raise FailedPrecondition(
                "this server keeps no data keys: its event log is not sealed, so records "
                "need no key")
        found, missing = [], []
        keys = self.keys.lookup(bank_id, key_ids)  # one store read (catch-up) for the misses
        for k in key_ids:
            key = keys[k]
            if key is None:
                missing.append(k)
            else:
                found.append((k, key))
        return found, missing

    @_sync_bounded
    def consolidate(self, bank_id: str, action: str = "consolidate",
                    observation_scopes: ev.ObservationScopes | None = None, memory_id: str = "",
                    wait: bool = True, timeout: float | None = None) -> Operation:
        """Append a ConsolidationRequested (``action``: consolidate, reconsolidate, clear,
        clear_memory). With ``wait``, return once search has projected the resulting
        observations (operation kind "consolidate" succeeded) or raise DeadlineExceeded."""
        if action not in ("consolidate", "reconsolidate", "clear", "clear_memory"):
            raise InvalidArgument("action", "unknown consolidation action")
        if action == "clear_memory" and not memory_id:
            raise InvalidArgument("memory_id", "required")
        op_id = str(uuid.uuid4())
        with self._writing(bank_id):
            self.require_bank(bank_id)
            rec = self._append(ev.ConsolidationRequested(
                bank_id=bank_id, operation_id=op_id, action=action,
                observation_scopes=observation_scopes, memory_id=memory_id), bank_id)
        return self._finish(op_id, rec, bank_id, "consolidate", 0, wait, timeout)

    @_sync_bounded
    def delete_opinion(self, bank_id: str, opinion_id: str, wait: bool = True,
                       timeout: float | None = None) -> Operation:
        """Append the deletion of opinion ``opinion_id`` (a ConsolidationRequested with
        action "delete_opinion": consolidation decides it in the bank's order, so no later
        revision brings it back). With ``wait``, return once it is out of every projection;
        the operation fails ("opinion not found") when the bank has no such opinion."""
        op_id = str(uuid.uuid4())
        with self._writing(bank_id):
            self.require_bank(bank_id)
            rec = self._append(ev.ConsolidationRequested(
                bank_id=bank_id, operation_id=op_id, action="delete_opinion",
                memory_id=opinion_id), bank_id)
        return self._finish(op_id, rec, bank_id, "delete_opinion", 0, wait, timeout)

    def _finish(self, op_id, rec, bank_id, kind, total, wait, timeout) -> Operation:
        timeout = timeout or self.retain_timeout_s
        if wait:
            started = time.monotonic()

            def ended() -> bool:
                o = self.catalog.get_operation(op_id)
                if o is None and kind != "delete_bank" and self._bank_gone(bank_id, rec):
                    raise NotFound(f"bank {bank_id!r} was deleted while operation {op_id} "
                                   "ran: its work went with the bank")
                return o is not None and o.done
            self._wait(ended, timeout, f"operation {op_id}")
            if kind.startswith("delete_") and self.wait_projections:
                self._wait_every_projection(bank_id, timeout - (time.monotonic() - started),
                                            rec)
            op = self.catalog.get_operation(op_id)
            if op is None:  # its bank was deleted since it ended
                raise NotFound(f"operation {op_id!r} not found: bank {bank_id!r} was deleted")
            return op
        # Async: acknowledged once durable on the log and in this catalog, so the
        # operation just named is found by GetOperation and CancelOperation at once. A
        # catalog that does not catch up soon (a stalled consumer) does not fail a write
        # already durable: the pending operation is returned as the request made it.
        # The wait holds a slot when one is free (all such waits count as one tenant, so
        # they never take a bank's share from its sync calls); when none is, it is skipped
        # rather than refused (the write is durable) and leaves the thread to other calls.
        if rec is not None:
            with self.slots.try_hold(ASYNC_WAITS) as held, \
                    contextlib.suppress(DeadlineExceeded):
                if held:
                    self._wait_projected(rec, min(timeout, ASYNC_PROJECTED_S))
        now = (rec.timestamp if rec else 0) or time.time()
        return self.catalog.get_operation(op_id) or Operation(
            op_id, bank_id, kind, "pending", items_total=total, created_at=now, updated_at=now)

    def _bank_gone(self, bank_id: str, rec: Record | None) -> bool:
        """Whether the operation of request ``rec`` (None: appended by another call), not
        in the catalog, went with its bank: the catalog has projected the request (so it
        held the operation) or no longer holds the bank (a DeleteBank drops both)."""
        if rec is not None:
            return self.log.committed(self.group, rec.topic, rec.partition) > rec.offset
        return self.catalog.get_bank(bank_id) is None

    def check_llm(self, bank_id: str) -> tuple[str, list]:
        """Probe the models this bank would use (one tiny call each, no retries). Returns
        (extraction: "llm" or "offline", [mneme.llm.gateway.Connectivity])."""
        bank = self.require_bank(bank_id)
        gw = self.llm
        if gw is None:
            return "offline", []
        mode = bank.config.extraction_mode
        extraction = "llm" if mode != "offline" and gw.configured("retain") else "offline"
        ops = tuple(op for op in ("retain", "reflect", "consolidation", "rerank")
                    if gw.configured(op) and (op != "retain" or extraction == "llm"))
        return extraction, gw.check(ops) if ops else []

    # Not bounded by the slots: it is how a caller frees the consumers that the waiting
    # calls holding them wait for (its own wait still stops at its deadline or cancel).
    def cancel_operation(self, operation_id: str, timeout: float | None = None) -> Operation:
        """CancelOperation: append an OperationCancelRequested for a pending or running
        retain and return the operation once this catalog shows ``cancel_requested``.
        Extraction stops before its next item (it finds the event after the retain on the
        bank's partition) and the operation ends failed and ``cancelled``; work finished
        before that stays. A second call returns the operation unchanged. NotFound for
        an unknown operation; FailedPrecondition when it has ended or is not a retain."""
        op = self.get_operation(operation_id)
        if op.done:
            raise FailedPrecondition(
                f"operation {operation_id} has ended ({op.state.upper()}); only a pending "
                "or running operation can be cancelled")
        if op.kind != "retain":
            raise FailedPrecondition(
                f"operation {operation_id} is a {op.kind}, which cannot be cancelled: only "
                "a retain can (a deletion destroys its data keys at once)")
        if op.cancel_requested:
            return op
        rec = self._append(ev.OperationCancelRequested(bank_id=op.bank_id,
                                                       operation_id=operation_id), op.bank_id)
        self._wait_projected(rec, timeout or self.retain_timeout_s)
        return self.catalog.get_operation(operation_id) or op

    @_sync_bounded
    def retry_operation(self, operation_id: str, timeout: float | None = None) -> Operation:
        """RetryOperation: a new retain (id derived from ``operation_id``, ``retry_of``
        naming it) of an ended retain's failed or unprocessed items (its item_errors: a
        FAILED retain's, or those of a retain that SUCCEEDED with some items failed),
        with the other items of their documents (a retain replaces its documents' facts,
        so a document goes again whole), read back from the log as the original request
        had them (sealed with the same keys). All items when the operation failed as a
        whole (no item_errors). Returns the new operation once this catalog holds it
        (pending); retrying the same operation again returns it. NotFound for an unknown
        operation; FailedPrecondition when it has not ended, succeeded with every item,
        is not a retain, or nothing of it can be retried (items refused by the API were
        never logged; erased content is gone)."""
        with self._writing(self.get_operation(operation_id).bank_id):
            return self._retry_operation(operation_id, timeout)

    def _retry_operation(self, operation_id: str, timeout: float | None) -> Operation:
        op = self.get_operation(operation_id)  # again: its bank may have been deleted since
        if op.kind != "retain":
            raise FailedPrecondition(
                f"operation {operation_id} is a {op.kind}: only a retain can be retried "
                "(request the deletion or consolidation again)")
        if not op.done:
            raise FailedPrecondition(
                f"operation {operation_id} is {op.state.upper()}: only an operation that has "
                "ended can be retried")
        if op.state == "succeeded" and not op.item_errors:
            raise FailedPrecondition(
                f"operation {operation_id} SUCCEEDED with every item: nothing to retry")
        retry_id = derive_id("retry", operation_id)
        if (known := self.catalog.get_operation(retry_id)) is not None:
            return known
        req = self._request_of(op)
        logged = range(len(req.items))
        refused = {r.item_index for r in req.rejected_items if r.reason == "rejected"}
        erased = {r.item_index for r in req.rejected_items if r.reason == "erased"}
        failed = {i for i, _, _ in op.item_errors if i in logged} or set(logged)
        docs = {req.items[i].document_id for i in failed} - {""}
        again = [i for i in logged if i not in refused
                 and (i in failed or req.items[i].document_id in docs)]
        if not again:
            raise FailedPrecondition(
                f"operation {operation_id} has nothing to retry: its failed items were "
                "refused by the API (invalid or over a limit) and never logged; retain them "
                "again, corrected")
        if gone := [i for i in again if i in erased]:
            raise FailedPrecondition(
                f"operation {operation_id} cannot be retried: the content of items[{gone[0]}] "
                "was erased (its document or bank was deleted)")
        msg = ev.RetainRequested(
            bank_id=op.bank_id, operation_id=retry_id, items=[req.items[i] for i in again],
            observation_scopes=(req.observation_scopes if req.HasField("observation_scopes")
                                else None),
            retry_of=operation_id, retried_item_indexes=again)
        # once, also when the same retry is asked for several times at once
        rec, _ = self._append_once(retry_id, len(again), lambda: self._append(msg, op.bank_id))
        if rec is not None:
            self._wait_projected(rec, timeout or self.retain_timeout_s)
        else:  # another call appended it: wait for it in the catalog the same way
            with contextlib.suppress(DeadlineExceeded):
                self._wait(lambda: self.catalog.get_operation(retry_id) is not None,
                           timeout or self.retain_timeout_s, "catalog projection", poll=0.01)
        return self.catalog.get_operation(retry_id) or Operation(
            retry_id, op.bank_id, "retain", items_total=len(again), retry_of=operation_id)

    def _request_of(self, op: Operation) -> ev.RetainRequested:
        """The RetainRequested of ``op``, read back from its position on the log (opened:
        erased items are placeholders listed in ``rejected_items``, reason "erased").
        FailedPrecondition when it cannot be found."""
        try:
            topic, partition, offset = op.source.rsplit("/", 2)
            recs = self.log.read(topic, int(partition), int(offset), 1)
        except ValueError:
            recs = []
        msg = codec.decode(recs[0]).message if recs and recs[0].offset == int(offset) else None
        if not isinstance(msg, ev.RetainRequested) or msg.operation_id != op.operation_id:
            raise FailedPrecondition(
                f"operation {op.operation_id} cannot be retried: its request is not found on "
                "the event log")
        return msg

    def get_operation(self, operation_id: str) -> Operation:
        """The operation, as every replica's writes left it; NotFound when unknown."""
        self.catch_up(None)  # its bank is not in the name: every partition
        op = self.catalog.get_operation(operation_id)
        if op is None:
            raise NotFound(f"operation {operation_id!r} not found")
        return op


def _pack(out: OutRecord) -> bytes:
    """A record to append, as a key store keeps a deletion's request (JSON)."""
    return json.dumps({"topic": out.topic, "key": out.key, "headers": out.headers,
                       "value": base64.b64encode(out.value).decode()}).encode()


def _unpack(request: bytes) -> OutRecord:
    """The record :func:`_pack` packed."""
    d = json.loads(request)
    return OutRecord(d["topic"], d["key"], base64.b64decode(d["value"]), dict(d["headers"]))


def _retain_requested(op_id: str, bank_id: str, items: Sequence[RetainItem], bad: dict,
                      observation_scopes) -> ev.RetainRequested:
    """The RetainRequested of operation ``op_id`` (``bad``: index → violations of the
    items that travel as empty placeholders)."""
    return ev.RetainRequested(
        bank_id=bank_id, operation_id=op_id,
        items=[ev.RetainItem() if i in bad else codec.retain_item_to_pb(it)
               for i, it in enumerate(items)],
        observation_scopes=observation_scopes,
        rejected_items=[ev.ItemFailure(item_index=i, field=limits.field_on_log(f), error=d,
                                       reason="rejected")
                        for i in sorted(bad) for f, d in bad[i][:1]])


def _request_digest(msg: ev.RetainRequested) -> bytes:
    """SHA-256 of what a retain asked for (items, scopes, refusals; not its operation
    id), kept in memory only: equal for a request and its exact repeat. The items'
    timestamps are left out: ingest stamps an item sent without one with the time it
    arrived, so a repeat of it carries another; so are the seals an opened request
    read back from the log keeps (:mod:`mneme.bus.sealing`)."""
    body = ev.RetainRequested()
    body.CopyFrom(msg)
    body.ClearField("operation_id")
    for item in body.items:
        item.ClearField("timestamp")
        item.ClearField("seal")
    return hashlib.sha256(body.SerializeToString(deterministic=True)).digest()


def _check_config(c: BankConfig) -> None:
    for f in ("skepticism", "literalism", "empathy"):
        v = getattr(c, f)
        if not 1 <= v <= 5:
            raise InvalidArgument(f"bank.config.{f}", "must be between 1 and 5")
    if not 0.0 < c.dedup_threshold <= 1.0:
        raise InvalidArgument("bank.config.dedup_threshold", "must be in (0, 1]")
    if c.extraction_mode not in EXTRACTION_MODES:
        raise InvalidArgument("bank.config.extraction_mode",
                              "must be one of " + ", ".join(map(repr, EXTRACTION_MODES)))
    if c.erasure not in ("crypto_shred", "none"):
        raise InvalidArgument("bank.config.erasure", "must be 'crypto_shred' or 'none'")


def _check_items(items: Sequence[RetainItem],
                 bad: dict[int, list[tuple[str, str]]]) -> dict[int, list[tuple[str, str]]]:
    """The items that fail alone (index → violations): ``bad`` (the transport's limit
    violations, :mod:`mneme.limits`: sizes, counts, characters) plus the domain rules
    (content required, tags non-empty). Raises InvalidArgument for a request without
    items."""
    if not items:
        raise InvalidArgument("items", "at least one item is required")
    for i, it in enumerate(items):
        found = []
        if not it.content or not it.content.strip():
            found.append((f"items[{i}].content", "must not be empty"))
        for j, t in enumerate(it.tags):
            if not t.strip():
                found.append((f"items[{i}].tags[{j}]", "must not be empty"))
        if found:
            bad.setdefault(i, []).extend(found)
    return bad
