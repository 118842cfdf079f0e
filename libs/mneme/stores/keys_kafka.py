"""The :class:`mneme.ports.KeyStore` on a compacted Kafka topic (``mneme.keys.v1``,
:data:`mneme.bus.KEYS`): the distributed topology's wrapped keys, which every process
materialises into memory.

The topic (one partition, ``cleanup.policy=compact``) holds one record per *candidate*
key: each writer's record has a record key of its own, so compaction never lets a later
(losing) writer's bytes replace the winner's, and it keeps the records' order. Values are
JSON (UTF-8)::

    record key                     value
    <bank>/<key id>/<nonce>        {"bank", "key", "scope", "wrapped": base64}   a data key
    <bank>//<nonce>                {"bank", "key": null, "wrapped": base64}      a bank key
    <bank>/<key id>                {"bank", "key", "destroyed": true}            tombstone
    (a candidate's own key)        {"bank", "key", "destroyed": true}            its bytes gone
    <bank>//deleted/<nonce>        {"bank", "key": null, "bank_deleted": true}   DeleteBank
    <bank>//pending/<operation>    {"bank", "key": null, "pending": <operation>,  a deletion's
                                    "request": base64, "keys": [ids] | null,     request
                                    "destroyed": true}
    <bank>//pending/<operation>    {"bank", "key": null, "pending": <operation>,  ... on the
                                    "cleared": true, "destroyed": true}           event log

(``destroyed`` on the pending records only makes a process of an earlier version, which
knows no ``pending``, skip them as the marker of a bank key candidate it never saw.)

Reading the topic in partition order gives the state: for a key id, the first live
candidate wins, and any ``destroyed`` record for the id makes it a tombstone for good
(destruction overwrites every candidate the destroyer knows with a ``destroyed`` value,
not a null, so compaction drops the wrapped bytes but keeps the knowledge that the id is
destroyed); the bank key is the first live bank candidate; ``bank_deleted`` drops
everything of the bank before it (its record key is unique, so compaction keeps it and
the bank's older records stay dropped in a replay).

A destroy with a :class:`~mneme.ports.PendingDeletion` produces its ``pending`` record
*first*, with the ids it destroys (``keys``; null: the whole bank), then the markers: a
multi-record append is not atomic, but the partition keeps their order, so a crash leaves
the request with all, some or none of its markers, never markers without it;
:meth:`KafkaKeyStore.pending_deletions` produces the missing markers before it returns
one. A bank's pending deletion replaces its earlier ones; its ``bank_deleted`` marker
marks it done and drops the pending deletions of the bank's documents and memories written
before it (the bank's deletion deletes them).

Every process reads the topic from offset 0 at open and catches up to the partition's
high watermark (the reader's highwater from a Fetch sent after the call began, via
:meth:`mneme.ports.EventLog.read`) before it answers a miss (an id or bank key it does
not know), before ``add`` decides (it
produces, then reads until its own record: the first candidate in partition order wins,
and ``add`` returns the winner), before ``current``, and every ``poll_s`` seconds in a
background thread, so that a destruction made by another process reaches this one's
:class:`mneme.keys.Keyring` within about ``poll_s`` (listeners, :meth:`KafkaKeyStore.listen`).

Bounded: the in-memory view holds, per key id (live or tombstone), its scope, at most a
40-byte wrapped key and the record keys of its candidates: about 300 bytes in CPython,
so a million keys take about 300 MB; no plaintext key is ever held here.

Residual races (no transactions on the log): a key added by another process between
this process's catch-up and its DeleteBank marker is dropped in every replay (it comes
before the marker) but its wrapped bytes stay on the topic, wrapped by the destroyed
bank key, so they open nothing.
"""

from __future__ import annotations

import base64
import json
import logging
import secrets
import threading
import time
from dataclasses import dataclass, field
from typing import Callable, Sequence

from mneme.bus import KEYS
from mneme.errors import ConfigurationError, RecordTooLarge
from mneme.ports import EventLog, OutRecord, PendingDeletion, StoredKey

log = logging.getLogger(__name__)

#: Seconds between the background catch-ups (how late a destruction by another process
#: reaches this process's caches, at most about this plus one fetch).
POLL_S = 1.0
#: Records read per fetch while catching up.
_BATCH = 500

Listener = Callable[[str, "list[str] | None"], None]


@dataclass
class _Key:
    scope: str
    wrapped: bytes | None               # None: a tombstone
    candidates: list[str] = field(default_factory=list)   # record keys seen for the id


@dataclass
class _Pending:
    request: bytes
    keys: list[str] | None              # the ids it destroys; None: the whole bank
    done: bool = False                  # a bank's: its bank_deleted marker was read


@dataclass
class _Bank:
    wrapped: bytes | None = None        # the winning bank key
    winner: str | None = None           # its record key
    candidates: list[str] = field(default_factory=list)
    keys: dict[str, _Key] = field(default_factory=dict)
    #: scope -> live ids in that scope, in partition order (current() scans from the end)
    scopes: dict[str, dict[str, None]] = field(default_factory=dict)


class KafkaKeyStore:
    """Bank keys and data keys on the compacted topic ``topic`` of ``log`` (an
    :class:`mneme.ports.EventLog`, normally a :class:`mneme.bus.kafka_log.KafkaEventLog`
    of its own: the background reads go through its reader). Creates the topic (one
    partition) when missing and reads it whole before returning; raises
    ConfigurationError when the topic has more than one partition (the records' total
    order is the state), and the log's errors (``KafkaError``, ConnectionError;
    :class:`mneme.errors.Unavailable` from an append) when the brokers do not answer. Thread-safe. ``poll_s`` ≤ 0: no background thread (tests).
    """

    def __init__(self, log: EventLog, topic: str = KEYS, *, poll_s: float = POLL_S,
                 timeout_s: float = 30.0) -> None:
        self._log, self.topic, self.timeout_s = log, topic, timeout_s
        if log.partitions(topic) == 0:
            log.ensure_topic(topic, 1)
        n = log.partitions(topic)
        if n != 1:
            raise ConfigurationError(f"{topic} has {n} partitions; the key topic needs "
                                     "exactly 1 (its records' order is the key state): "
                                     "recreate it with `mneme topics create`")
        self._banks: dict[str, _Bank] = {}
        #: (bank, operation) -> its pending deletion, in partition order
        self._pending: dict[tuple[str, str], _Pending] = {}
        self._next = 0                      # the next offset of the topic to apply
        self._caught_up_from = -1.0         # start (monotonic) of the last full catch-up
        self._view = threading.Lock()       # guards _banks and _next
        self._reading = threading.Lock()    # one catch-up at a time
        self._listeners: list[Listener] = []
        self._closed = threading.Event()
        self.catch_up()
        self._poller = None
        if poll_s > 0:
            self._poller = threading.Thread(target=self._poll, args=(poll_s,), daemon=True,
                                            name="mneme-keys")
            self._poller.start()

    # ---- materialisation --------------------------------------------------------------

    def listen(self, callback: Listener) -> None:
        """Call ``callback(bank_id, key_ids)`` whenever the materialisation learns that
        keys were destroyed (``key_ids`` None: the whole bank), by this process or
        another. Called with no lock of this store held; exceptions are logged."""
        self._listeners.append(callback)

    def catch_up(self, until: int | None = None) -> None:
        """Apply every record up to the partition's end (and at least up to offset
        ``until``): about two fetch round trips when nothing is new (~100 ms on the tansu
        test broker, ~2 × ``fetch.max.wait`` of 10 ms on Apache Kafka). Callers waiting
        for a catch-up in progress share the next one. Raises TimeoutError when ``until``
        is not reached within ``timeout_s`` seconds."""
        destroyed: list[tuple[str, list[str] | None]] = []
        called = time.monotonic()
        deadline = called + self.timeout_s
        with self._reading:
            if until is None and self._caught_up_from >= called:
                return  # one that began after this call did it (callers that wait share)
            started = time.monotonic()
            while True:
                records = self._log.read(self.topic, 0, self._next, _BATCH)
                if records:
                    with self._view:
                        for r in records:
                            if r.offset >= self._next:
                                self._apply(r.key, r.value, destroyed)
                                self._next = r.offset + 1
                    continue
                if until is None or self._next > until:
                    self._caught_up_from = started
                    break
                if time.monotonic() > deadline:
                    raise TimeoutError(f"{self.topic}: offset {until} not read within "
                                       f"{self.timeout_s:.0f}s")
        self._notify(destroyed)

    def _notify(self, destroyed: list[tuple[str, list[str] | None]]) -> None:
        for bank_id, ids in destroyed:
            for cb in list(self._listeners):
                try:
                    cb(bank_id, ids)
                except Exception:  # noqa: BLE001 - one listener must not stop the others
                    log.exception("key store listener failed for bank %s", bank_id)

    def _poll(self, every: float) -> None:
        wait = every
        while not self._closed.wait(wait):
            try:
                self.catch_up()
                wait = every
            except Exception as exc:  # noqa: BLE001 - the broker may be away for a while
                if self._closed.is_set():
                    return
                wait = min(30.0, wait * 2)  # a long outage: one warning every 30 s
                log.warning("%s: catching up failed (%r); retrying in %.1fs", self.topic,
                            exc, wait)

    def _apply(self, record_key: str, value: bytes,
               destroyed: list[tuple[str, list[str] | None]]) -> None:
        try:
            v = json.loads(value)
            bank_id = v["bank"]
            key_id = v.get("key")
        except (ValueError, KeyError, TypeError):
            log.warning("%s: record %r is not a key record; skipped", self.topic, record_key)
            return
        if "pending" in v:
            try:
                self._apply_pending(bank_id, v)
            except (ValueError, KeyError, TypeError):
                log.warning("%s: record %r is not a pending deletion; skipped", self.topic,
                            record_key)
            return
        if v.get("bank_deleted"):
            for (b, op), p in list(self._pending.items()):
                if b != bank_id:
                    continue
                if p.keys is None:
                    p.done = True
                else:  # deleted with the bank
                    del self._pending[(b, op)]
            if self._banks.pop(bank_id, None) is not None:
                destroyed.append((bank_id, None))
            return
        bank = self._banks.setdefault(bank_id, _Bank())
        if key_id is None:  # a bank key candidate
            if v.get("destroyed"):
                if record_key == bank.winner and bank.wrapped is not None:
                    bank.wrapped = bank.winner = None
                    destroyed.append((bank_id, None))
                return
            if record_key not in bank.candidates:
                bank.candidates.append(record_key)
            if bank.wrapped is None:  # the first live candidate wins
                bank.wrapped, bank.winner = base64.b64decode(v["wrapped"]), record_key
            return
        row = bank.keys.get(key_id)
        if v.get("destroyed"):
            if row is None:
                row = bank.keys[key_id] = _Key(v.get("scope", ""), None)
                destroyed.append((bank_id, [key_id]))
            elif row.wrapped is not None:
                row.wrapped = None
                bank.scopes.get(row.scope, {}).pop(key_id, None)
                destroyed.append((bank_id, [key_id]))
            if record_key not in row.candidates:
                row.candidates.append(record_key)
            return
        if row is None:  # the first candidate of the id: the winner
            scope = v["scope"]
            bank.keys[key_id] = _Key(scope, base64.b64decode(v["wrapped"]), [record_key])
            bank.scopes.setdefault(scope, {})[key_id] = None
        elif record_key not in row.candidates:  # a later writer lost (or came too late)
            row.candidates.append(record_key)

    def _apply_pending(self, bank_id: str, v: dict) -> None:
        op = str(v["pending"])
        if v.get("cleared"):
            self._pending.pop((bank_id, op), None)
            return
        keys = v.get("keys")
        if keys is None:  # a bank's deletion: its request deletes what the others would
            for k in [k for k in self._pending if k[0] == bank_id]:
                del self._pending[k]
        self._pending[(bank_id, op)] = _Pending(base64.b64decode(v["request"]),
                                                None if keys is None else list(keys))

    @staticmethod
    def _pending_record(pending: PendingDeletion, keys: list[str] | None) -> tuple[str, dict]:
        return (f"{pending.bank_id}//pending/{pending.operation_id}", {
            "bank": pending.bank_id, "key": None, "pending": pending.operation_id,
            "request": base64.b64encode(pending.request).decode(), "keys": keys,
            "destroyed": True})  # skipped by earlier versions (module docstring)

    # ---- writing ----------------------------------------------------------------------

    def _produce(self, values: Sequence[tuple[str, dict]]) -> int:
        """Append (record key, value) pairs; the offset of the last."""
        out = self._log.append([OutRecord(self.topic, k, json.dumps(v).encode(), {})
                                for k, v in values])
        return out[-1].offset

    def _row(self, bank_id: str, key_id: str) -> StoredKey | None:
        bank = self._banks.get(bank_id)
        row = bank.keys.get(key_id) if bank is not None else None
        return StoredKey(row.scope, row.wrapped) if row is not None else None

    # ---- the KeyStore port ------------------------------------------------------------

    def bank_key(self, bank_id: str) -> bytes | None:
        with self._view:
            bank = self._banks.get(bank_id)
            if bank is not None and bank.wrapped is not None:
                return bank.wrapped
        self.catch_up()
        with self._view:
            bank = self._banks.get(bank_id)
            return bank.wrapped if bank is not None else None

    def add_bank_key(self, bank_id: str, wrapped: bytes) -> bytes:
        for _ in range(3):
            self.catch_up()
            with self._view:
                bank = self._banks.get(bank_id)
                if bank is not None and bank.wrapped is not None:
                    return bank.wrapped
            offset = self._produce([(f"{bank_id}//{secrets.token_hex(8)}", {
                "bank": bank_id, "key": None,
                "wrapped": base64.b64encode(wrapped).decode()})])
            self.catch_up(offset)
            with self._view:
                bank = self._banks.get(bank_id)
                if bank is not None and bank.wrapped is not None:
                    return bank.wrapped
            # the bank was deleted between our record and the end: make it again
        raise RuntimeError(f"bank {bank_id!r}: no bank key could be stored on {self.topic} "
                           "(the bank is being deleted over and over)")

    def get(self, bank_id: str, key_id: str) -> StoredKey | None:
        with self._view:
            row = self._row(bank_id, key_id)
        if row is not None:
            # Known: a tombstone is final; a live key destroyed by another process since
            # the last catch-up reads live until the next (within poll_s), as a key the
            # Keyring has cached would (what it seals then opens nothing: erased at birth).
            return row
        self.catch_up()  # a miss: maybe made by another process
        with self._view:
            return self._row(bank_id, key_id)

    def get_many(self, bank_id: str, key_ids: Sequence[str]) -> dict[str, StoredKey]:
        ids = list(dict.fromkeys(key_ids))
        with self._view:
            out = {k: row for k in ids if (row := self._row(bank_id, k)) is not None}
        if len(out) < len(ids):
            self.catch_up()  # misses: maybe made by another process (one catch-up for all)
            with self._view:
                out |= {k: row for k in ids
                        if k not in out and (row := self._row(bank_id, k)) is not None}
        return out

    def add(self, bank_id: str, key_id: str, scope: str, wrapped: bytes) -> StoredKey:
        if not key_id:
            raise ValueError("key_id must not be empty")
        self.catch_up()
        with self._view:
            row = self._row(bank_id, key_id)
        if row is not None:
            return row
        offset = self._produce([(f"{bank_id}/{key_id}/{secrets.token_hex(8)}", {
            "bank": bank_id, "key": key_id, "scope": scope,
            "wrapped": base64.b64encode(wrapped).decode()})])
        self.catch_up(offset)
        with self._view:
            row = self._row(bank_id, key_id)
        # None: the bank was deleted after our record; what was sealed with it is erased
        return row if row is not None else StoredKey(scope, None)

    def add_many(self, bank_id: str, rows: Sequence[tuple[str, str, bytes]]
                 ) -> dict[str, StoredKey]:
        """:meth:`add` of every row with one produce and one catch-up (the winners)."""
        if not rows:
            return {}
        if any(not key_id for key_id, _, _ in rows):
            raise ValueError("key_id must not be empty")
        self.catch_up()
        out: dict[str, StoredKey] = {}
        values: list[tuple[str, dict]] = []
        with self._view:
            for key_id, scope, wrapped in rows:
                row = self._row(bank_id, key_id)
                if row is not None:
                    out[key_id] = row
                elif key_id not in {v[1]["key"] for v in values}:
                    values.append((f"{bank_id}/{key_id}/{secrets.token_hex(8)}", {
                        "bank": bank_id, "key": key_id, "scope": scope,
                        "wrapped": base64.b64encode(wrapped).decode()}))
        if values:
            self.catch_up(self._produce(values))
            with self._view:
                for _, v in values:
                    row = self._row(bank_id, v["key"])
                    out[v["key"]] = row if row is not None else StoredKey(v["scope"], None)
        return out

    def current(self, bank_id: str, scope: str) -> str | None:
        self.catch_up()
        prefix = scope + "#"
        with self._view:
            bank = self._banks.get(bank_id)
            live = bank.scopes.get(scope, {}) if bank is not None else {}
            for key_id in reversed(live):
                if key_id.startswith(prefix):
                    return key_id
        return None

    def destroy_scope(self, bank_id: str, scope: str,
                      pending: PendingDeletion | None = None) -> list[str]:
        self.catch_up()
        with self._view:
            bank = self._banks.get(bank_id)
            ids = list(bank.scopes.get(scope, {})) if bank is not None else []
        return self.destroy(bank_id, ids, pending) if ids or pending else []

    def destroy(self, bank_id: str, key_ids: Sequence[str],
                pending: PendingDeletion | None = None) -> list[str]:
        if not key_ids and pending is None:
            return []
        self.catch_up()
        # the request first: a crash between the records leaves it, never markers alone
        values: list[tuple[str, dict]] = (
            [self._pending_record(pending, list(key_ids))] if pending is not None else [])
        with self._view:
            bank = self._banks.get(bank_id)
            for k in key_ids:
                row = bank.keys.get(k) if bank is not None else None
                marker = {"bank": bank_id, "key": k, "destroyed": True}
                if row is not None:
                    marker["scope"] = row.scope
                # the id's own marker (kept for ids never created), then every candidate
                values.append((f"{bank_id}/{k}", marker))
                values += [(c, marker) for c in (row.candidates if row else ())
                           if c != f"{bank_id}/{k}"]
        try:
            self.catch_up(self._produce(values))
        except RecordTooLarge as exc:  # the producer refuses the request's record, which
            # comes first, before it sends the markers
            if pending is None:
                raise
            raise RecordTooLarge(
                f"the request of operation {pending.operation_id} of bank {bank_id!r}, kept "
                f"on {self.topic} while the keys it replaces are destroyed, is "
                f"{len(values[0][1]['request']):,} bytes there (base64), more than the event "
                f"log takes for one record (Kafka's max.request.size / max.message.bytes, 1 "
                f"MiB by default); split the request into smaller ones") from exc
        return list(key_ids)

    def destroy_bank(self, bank_id: str, pending: PendingDeletion | None = None) -> None:
        self.catch_up()
        values: list[tuple[str, dict]] = (
            [self._pending_record(pending, None)] if pending is not None else [])
        with self._view:
            bank = self._banks.get(bank_id)
            if bank is not None:
                for c in bank.candidates:
                    values.append((c, {"bank": bank_id, "key": None, "destroyed": True}))
                for k, row in bank.keys.items():
                    marker = {"bank": bank_id, "key": k, "scope": row.scope, "destroyed": True}
                    values += [(c, marker) for c in row.candidates]
        values.append((f"{bank_id}//deleted/{secrets.token_hex(8)}",
                       {"bank": bank_id, "key": None, "bank_deleted": True}))
        self.catch_up(self._produce(values))

    def pending_deletions(self, bank_id: str | None = None) -> list[PendingDeletion]:
        """As this process has read the topic (at open, then every ``poll_s``); a
        deletion whose markers a crash cut short gets them first."""
        with self._view:
            found = [(b, op, p) for (b, op), p in self._pending.items()
                     if bank_id is None or b == bank_id]
        out = []
        for b, op, p in found:
            if p.keys is None:
                if not p.done:
                    self.destroy_bank(b)
            else:
                with self._view:
                    missing = [k for k in p.keys
                               if (row := self._row(b, k)) is None or row.wrapped is not None]
                self.destroy(b, missing)
            out.append(PendingDeletion(b, op, p.request))
        return out

    def clear_pending(self, bank_id: str, operation_id: str) -> None:
        with self._view:
            known = (bank_id, operation_id) in self._pending
        if known:
            self.catch_up(self._produce([(f"{bank_id}//pending/{operation_id}", {
                "bank": bank_id, "key": None, "pending": operation_id, "cleared": True,
                "destroyed": True})]))

    def close(self) -> None:
        """Stop the background catch-up (the log is the caller's to close)."""
        self._closed.set()
        if self._poller is not None:
            self._poller.join(self.timeout_s)

    def __repr__(self) -> str:
        return f"KafkaKeyStore({self._log!r}, {self.topic!r})"


__all__ = ["KafkaKeyStore", "POLL_S"]
