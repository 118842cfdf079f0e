"""Kafka through FastStream: the subscribers and publishers of the services' consumer
groups, declared once from their :class:`mneme.router.Service` declarations, and the
runner that consumes and produces with them.

:func:`build_broker` is the one place they are declared. Per consumer group and topic
it reads, a subscriber with ``group_id`` the group (Kafka spreads the group's partitions
over every process running it), manual acknowledgement (``AckPolicy.MANUAL``: the offset
is committed by :class:`DeliveryMiddleware` once the outputs are produced),
``auto_offset_reset="earliest"`` and the consumer timeouts of
:class:`~mneme.bus.kafka_log.KafkaOptions`; per service and topic it produces, a
publisher, and per group one to the DLQ. Without routers the broker is only described
(never started): :mod:`mneme.runtime.asyncapi` writes the AsyncAPI document from it.

:class:`KafkaRunner` runs such a broker on its own asyncio loop in a thread. Per record:

1. :class:`DeliveryMiddleware` (FastStream middleware of the group's subscribers)
   decodes it (:func:`mneme.bus.codec.decode` of a :class:`mneme.ports.Record`); an
   undecodable one is dead-lettered at once, a type the group has no handler for is
   skipped; both are acknowledged;
2. the subscriber's handler runs the group's :class:`~mneme.router.Router` (a plain,
   synchronous function) off the event loop (``asyncio.to_thread``: heartbeats go on),
   inside the record's CONSUMER span and with :func:`mneme.deadline.current` cancelled
   by :meth:`KafkaRunner.stop`, then produces its outputs and waits for every send;
3. the middleware retries a failing handler (tenacity, exponential backoff), then
   produces the dead letters (:func:`mneme.bus.dead_letter.records`: the DLQ copy and
   the failed progress of its operation). An output larger than Kafka takes
   (:class:`mneme.errors.RecordTooLarge`) is not retried: it would be as large again. A
   DLQ copy too large with its ``dlq_*`` headers goes without its value
   (:func:`mneme.bus.dead_letter.without_value`), so the partition never stalls on it;
4. it makes the group's writes durable (:meth:`mneme.router.Router.flush`, in a worker
   thread) and commits the input offset. The outputs -- a sync retain's progress among
   them -- are on the brokers before the flush, so it is off the request's path. A
   flush that raises is never followed by a commit: the record is sought back (handled
   again, idempotently) after a backoff.

Delivery is at least once: the offset is committed only after the outputs are on the
brokers, and outputs have deterministic ids, so a redelivered record yields duplicates
that consumers drop (DESIGN §3). Each subscriber handles one record at a time, so the
records of one partition are handled strictly in order; a group's handlers never run
concurrently in one process (one lock per group, as on the embedded log). Before a
rebalance takes partitions away, the revocation waits for the record in hand to be
committed, so its new owner starts after it.
"""

from __future__ import annotations

import asyncio
import dataclasses
import functools
import json
import logging
import threading
import time
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Union

import tenacity
from aiokafka import ConsumerRebalanceListener
from aiokafka.errors import IllegalStateError, KafkaError
from faststream.kafka import KafkaBroker, KafkaRouter, Topic
from faststream.kafka.annotations import KafkaMessage
from faststream.middlewares import AckPolicy, BaseMiddleware
from google.protobuf.message import Message

from mneme import deadline, retry, telemetry
from mneme.bus import DLQ, PROGRESS, default_partitions, dead_letter
from mneme.bus.codec import CONTENT_TYPE, Envelope, decode, event_type
from mneme.bus.kafka_log import KafkaOptions, record_of, refused_as_too_large
from mneme.bus.sealing import erased_record
from mneme.datadir import write_atomic
from mneme.errors import Cancelled, RecordTooLarge, held_back
from mneme.ports import OutRecord, Record
from mneme.router import Router, Service, meta_of

log = logging.getLogger(__name__)

#: The broker the AsyncAPI document names (docker-compose.yml's).
SERVER = "kafka:9092"

#: Seconds between a runner's reads of its groups' lag (:meth:`GroupRun.lag_snapshot`).
LAG_REFRESH_S = 1.0
#: Seconds a restore runs at most between two chances for the group's other partitions
#: to be handled (it holds the group's lock meanwhile).
RESTORE_STEP_S = 0.05

#: Outputs of each type per event a restore first looks for after the committed offset
#: (its previous owner's decisions); each one it finds makes it look for one more, so an
#: output sent in many parts is restored whole.
OUTPUTS_LISTED = 8


class _Abandoned(Exception):
    """The runner stops: leave the record in hand uncommitted (redelivered later)."""


class _ProtobufCodec:
    """Record values are bytes already (the router encodes them): passed through, with
    ``application/protobuf`` as the content type FastStream sets (a record's own
    ``content-type`` header wins)."""

    async def decode(self, msg):  # noqa: ANN001 - FastStream's StreamMessage
        return msg.body

    async def encode(self, msg, serializer=None) -> tuple[bytes, str | None]:  # noqa: ANN001
        if not isinstance(msg, (bytes, bytearray, memoryview)):
            raise TypeError(f"mneme publishes encoded records (bytes), got {type(msg).__name__}")
        return bytes(msg), CONTENT_TYPE


@dataclass
class Delivery:
    """How a working broker's subscribers deliver records: ``max_attempts`` handler
    calls per record before it is dead-lettered (>= 1), retry *n* waiting
    ``min(backoff * 2**(n-1), backoff_max)`` seconds; ``dlq_topic``; ``stopping`` (set by
    :meth:`KafkaRunner.stop`: handlers see it as a cancelled deadline). ``groups`` is
    filled by :func:`build_broker`: group → :class:`GroupRun`."""

    max_attempts: int = 3
    backoff: float = 0.05
    backoff_max: float = 2.0
    dlq_topic: str = DLQ
    revoke_wait_s: float = 300.0
    stopping: threading.Event = field(default_factory=threading.Event)
    groups: dict[str, "GroupRun"] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.max_attempts < 1:
            raise ValueError(f"max_attempts must be >= 1, got {self.max_attempts}")
        self._stop_async: asyncio.Event | None = None

    def stop_event(self) -> asyncio.Event:
        """The asyncio twin of ``stopping`` (created on the runner's loop)."""
        if self._stop_async is None:
            self._stop_async = asyncio.Event()
            if self.stopping.is_set():
                self._stop_async.set()
        return self._stop_async

    async def sleep(self, seconds: float) -> None:
        """Sleep ``seconds``, returning early when the runner stops."""
        try:
            await asyncio.wait_for(self.stop_event().wait(), seconds)
        except TimeoutError:
            pass


class Checkpoints:
    """How far each restore (:attr:`mneme.router.Group.restore`) has brought this
    replica's local state: (group, topic, partition) → the next changelog offset not yet
    reflected in it. Kept in a JSON file (``path``; None: in memory only), replaced
    atomically on every change. A lost or stale file only costs time: restoring from an
    earlier offset applies idempotent records again."""

    def __init__(self, path: Path | None = None) -> None:
        self.path = path
        self._lock = threading.Lock()
        self._marks: dict[str, int] = {}
        if path is not None and path.exists():
            try:
                self._marks = {k: int(v) for k, v in json.loads(path.read_text()).items()}
            except (ValueError, AttributeError):  # unreadable: restore from the start
                log.warning("restore checkpoints %s unreadable; restoring from offset 0", path)

    @staticmethod
    def _key(group: str, topic: str, partition: int) -> str:
        return f"{group}|{topic}|{partition}"

    def get(self, group: str, topic: str, partition: int) -> int:
        """The next offset to restore from (0 when never restored)."""
        with self._lock:
            return self._marks.get(self._key(group, topic, partition), 0)

    def advance(self, group: str, marks: Mapping[tuple[str, int], int]) -> None:
        """Record ``marks`` ((topic, partition) → next offset) for ``group``; a mark
        never moves back here (a record reflected stays reflected)."""
        with self._lock:
            for (t, p), off in marks.items():
                k = self._key(group, t, p)
                self._marks[k] = max(off, self._marks.get(k, 0))
            if self.path is not None:
                write_atomic(self.path, json.dumps(self._marks, sort_keys=True))

    def forget(self, group: str, topic: str, partition: int) -> None:
        """Drop a mark (its topic was recreated: restore from 0)."""
        with self._lock:
            self._marks.pop(self._key(group, topic, partition), None)


class GroupRun:
    """One consumer group's state in a working broker: its router, publishers (topic →
    FastStream publisher), counters (``stats``: handled, skipped, dead_lettered,
    retries, commit_failures, flush_failures), the records in hand and its lag. Also what
    :func:`mneme.telemetry.track_consumer` reports (``group``, ``running``,
    :meth:`lag_snapshot`)."""

    def __init__(self, router: Router, delivery: Delivery, restorer: Router | None = None,
                 event_log: Any = None, checkpoints: Checkpoints | None = None) -> None:
        self.router = router
        self.restorer = restorer  # the group's restore handlers (None: no local state)
        self.log = event_log
        self.checkpoints = checkpoints or Checkpoints()
        self.restored = 0  # changelog records applied by restores
        self.group = router.group.name
        self.group_id = router.group_id  # the consumer group on the brokers
        self.topics = router.topics
        self.delivery = delivery
        self.publishers: dict[str, Any] = {}
        self.stats = dict.fromkeys(("handled", "skipped", "dead_lettered", "retries",
                                    "commit_failures", "flush_failures"), 0)
        self.running = False
        self._lag: dict[tuple[str, int], int] = {}
        self._lock = asyncio.Lock()  # a group's handlers one at a time in this process
        # topic → the record in hand and its envelope (a subscriber handles one at a time;
        # the middleware decodes it once and the handler takes it from here)
        self._in_hand: dict[str, tuple[Record, Envelope]] = {}
        self._idle: dict[str, asyncio.Event] = {}
        # (topic, partition) → next offset this process committed there (flushed first)
        self.done: dict[tuple[str, int], int] = {}
        # (topic, partition) → next offset this process handled there: its writes are
        # visible (maybe not flushed nor committed yet), what read-your-writes waits for
        self.handled_to: dict[tuple[str, int], int] = {}
        # partition → the assignment restoring it now (its records wait, paused)
        self.restoring: dict[int, object] = {}
        # topic → the partitions of it this process holds now (``done`` keeps those it
        # held before a rebalance too)
        self.owned: dict[str, set[int]] = {}
        self.restore_tasks: set[asyncio.Future] = set()
        self._until_stopped = deadline.Deadline(None, lambda: not delivery.stopping.is_set())

    # ---- bookkeeping (on the runner's loop) ---------------------------------------

    @property
    def busy(self) -> bool:
        """True while a record of this group is in hand in this process."""
        return bool(self._in_hand)

    def _idle_event(self, topic: str) -> asyncio.Event:
        ev = self._idle.get(topic)
        if ev is None:
            ev = self._idle[topic] = asyncio.Event()
            ev.set()
        return ev

    def begin(self, rec: Record, env: Envelope | None) -> None:
        self._in_hand[rec.topic] = (rec, env)
        self._idle_event(rec.topic).clear()

    def end(self, topic: str) -> None:
        self._in_hand.pop(topic, None)
        self._idle_event(topic).set()

    async def wait_idle_topic(self, topic: str, timeout: float) -> bool:
        try:
            await asyncio.wait_for(self._idle_event(topic).wait(), timeout)
            return True
        except TimeoutError:
            return False

    def lag_snapshot(self) -> dict[tuple[str, int], int]:
        """The group's lag as of at most :data:`LAG_REFRESH_S` ago ({} before the first
        read): a metric scrape never touches the brokers."""
        return self._lag

    # ---- one record ---------------------------------------------------------------

    def _call(self, env: Envelope, rec: Record) -> list[OutRecord]:
        # Runs in a worker thread. A span per record, child of the record's traceparent
        # (the outputs encoded inside carry it on); a stop cancels the deadline, so a
        # long handler stops between steps and the record is redelivered.
        with telemetry.consume_span(self.group, rec, env), deadline.bind(self._until_stopped):
            return self.router(env, rec)

    async def handle(self, message) -> None:  # noqa: ANN001 - FastStream's KafkaMessage
        """The subscribers' handler: route the record, produce the outputs, wait for
        every send. Raises what the router or the brokers raise (the middleware retries)."""
        rec, env = self._in_hand[message.raw_message.topic]
        async with self._lock:
            outs = await asyncio.to_thread(self._call, env, rec)
        await self.produce(outs)
        self.stats["handled"] += 1

    @property
    def sealer(self):
        """The log's :class:`~mneme.bus.sealing.Sealer`, or None (content in plaintext)."""
        return getattr(self.log, "sealer", None)

    async def produce(self, records: Sequence[OutRecord]) -> None:
        """Send ``records`` (keyed: aiokafka's partitioner puts a bank on Kafka's default
        partition), their user content sealed, and wait until the brokers acknowledge all
        of them. Raises :class:`mneme.errors.RecordTooLarge` for a record larger than
        Kafka takes."""
        if records and self.sealer is not None:  # key lookups may block: off the loop
            records = await asyncio.to_thread(lambda: [self.sealer.seal(r) for r in records])
        pending = []
        for r in records:
            # every topic a router or a dead letter writes has its group's publisher
            with refused_as_too_large(r):
                pending.append((r, await self.publishers[r.topic].publish(
                    bytes(r.value), key=r.key.encode("utf-8"), headers=dict(r.headers),
                    correlation_id=r.headers.get("ce_id") or None, no_confirm=True)))
        for r, fut in pending:
            with refused_as_too_large(r):
                await fut

    def dead_letters(self, rec: Record, exc: BaseException, attempts: int,
                     env: Envelope | None) -> list[OutRecord]:
        self.stats["dead_lettered"] += 1
        return dead_letter.records(rec, exc, attempts, self.group, env,
                                   dlq_topic=self.delivery.dlq_topic,
                                   fails_operation=self.router.fails_operation)

    # ---- replica-local state (worker threads, under the group's lock) -------------

    def restore(self, partitions: Sequence[int]) -> int:
        """Bring the local state up to date for newly assigned ``partitions`` in one go
        (:meth:`restore_steps`); returns the number of records applied."""
        steps = self.restore_steps(partitions)
        while (applied := _step(steps)) is None:
            pass
        return applied

    def restore_steps(self, partitions: Sequence[int], step: float = RESTORE_STEP_S):
        """Bring the local state up to date for newly assigned ``partitions``
        (:attr:`mneme.router.Group.restore`), as a generator that yields about every
        ``step`` seconds (a caller may let other work run in between); its return
        value is the number of records applied. The checkpoints are written once, at the
        end: a restore stopped halfway leaves them as they were.

        Per restore topic and partition, from the checkpoint on: a topic the group reads
        up to the group's committed offset (where this replica's consumer starts: the
        records after it it handles itself, in order), plus the outputs its previous
        owner produced beyond that offset for the records before it (its own decisions
        that come back on the topic it reads, found by their derived ids); any other
        topic up to its end."""
        applied, marks = 0, {}
        for t in self.restorer.topics:
            consumed = t in self.topics
            for p in partitions:
                end = self.log.end_offset(t, p)
                start = self.checkpoints.get(self.group, t, p)
                if start > end:  # the topic was recreated since
                    self.checkpoints.forget(self.group, t, p)
                    start = 0
                target = min(self.log.committed(self.group_id, t, p), end) if consumed else end
                causes: list[str] = []
                n, reached = yield from self._apply(t, p, start, target, step, causes=causes)
                applied += n
                ids = self.router.output_ids(causes, t, OUTPUTS_LISTED) if causes else {}
                if ids:
                    applied += (yield from self._apply(t, p, target, end, step, only=ids))[0]
                marks[(t, p)] = max(start, reached)
        self.restorer.flush()  # a mark says what the local state reflects durably
        self.checkpoints.advance(self.group, marks)  # one write for the assignment
        self.restored += applied
        return applied

    def _apply(self, topic: str, partition: int, start: int, stop: int, step: float, *,
               causes: list[str] | None = None,
               only: dict[str, tuple[str, str, int]] | None = None):
        """Apply the restore handlers to ``topic[partition]`` records in [start, stop)
        (only those whose ``ce_id`` is in ``only``, when given: ids from
        :meth:`Router.output_ids` listing :data:`OUTPUTS_LISTED` of each type, extended
        past each one applied), yielding about every ``step`` seconds;
        collect the applied records' event ids in ``causes``. Returns (records applied,
        next offset)."""
        applied, reached, wanted = 0, start, self.restorer.types
        pause_at = time.monotonic() + step
        for rec in self._records(topic, partition, start, stop):
            if time.monotonic() >= pause_at:
                yield
                pause_at = time.monotonic() + step
            reached = rec.offset + 1
            if rec.headers.get("ce_type") not in wanted:
                continue  # not part of this state: no decode
            if only is not None:
                listed = only.get(rec.headers.get("ce_id"))
                if listed is None:
                    continue
                # an event's outputs of a type may be more than listed (an output sent
                # in parts): each one found lists the one OUTPUTS_LISTED further on
                cause, name, n = listed
                more = n + OUTPUTS_LISTED
                only.setdefault(self.router.output_id(cause, name, more), (cause, name, more))
            try:
                env = decode(rec)
            except Exception:  # a poison record: its live handler dead-letters it
                continue
            self.restorer(env, rec)
            applied += 1
            if causes is not None:
                causes.append(meta_of(env, rec).id)
        return applied, reached

    def _records(self, topic: str, partition: int, start: int, stop: int):
        """The records of ``topic[partition]`` in [start, stop), in offset order. They
        are known to exist: a read that brings none is the brokers not answering
        (RuntimeError after three tries), never the end."""
        off, empty = start, 0
        while off < stop:
            batch = self.log.read(topic, partition, off, limit=500)
            if not batch:
                empty += 1
                if empty == 3:
                    raise RuntimeError(f"restore of {topic}[{partition}]: no records from "
                                       f"offset {off} though the partition ends at {stop}")
                continue
            empty = 0
            for rec in batch:
                if rec.offset >= stop:
                    return
                yield rec
            off = batch[-1].offset + 1

    def leave(self, partitions: Sequence[int]) -> None:
        """Partitions go to another replica (the record in hand is committed): mark how
        far the local state reflects each restore topic, so a later restore resumes there
        -- for a topic the group reads, what it handled; for another, its end now (the
        outputs of everything handled are on it)."""
        marks = {}
        for t in self.restorer.topics:
            for p in partitions:
                if p in self.restoring:  # not restored: its state reflects no more than before
                    continue
                if t in self.topics:
                    if (t, p) in self.done:
                        marks[(t, p)] = self.done[(t, p)]
                else:
                    marks[(t, p)] = self.log.end_offset(t, p)
        self.router.flush()  # the handlers' writes those marks count, durable first
        self.checkpoints.advance(self.group, marks)


class DeliveryMiddleware(BaseMiddleware):
    """The retry-then-DLQ policy and the acknowledgement of one group's records (see the
    module docstring). Built per record by FastStream: ``functools.partial(
    DeliveryMiddleware, run=group_run)``."""

    def __init__(self, msg: Any, /, *, context: Any, run: GroupRun) -> None:
        super().__init__(msg, context=context)
        self.run = run
        self.attempts = 0

    async def consume_scope(self, call_next, msg):  # noqa: ANN001 - FastStream's types
        run, delivery = self.run, self.run.delivery
        if delivery.stopping.is_set():
            await msg.nack()  # seek back: a later commit must not pass this record
            return None
        rec = record_of(msg.raw_message)
        try:
            if run.sealer is not None:  # key lookups may block: off the loop
                rec = await asyncio.to_thread(run.sealer.open, rec)
            env = decode(rec)
        except Exception as exc:  # corrupt payload: retrying cannot help
            env, undecodable = None, exc
        run.begin(rec, env)
        try:
            outs = []
            if env is None:
                outs = run.dead_letters(rec, undecodable, 0, None)
            elif (env.message is None or not run.router.handles(env.message)
                  or erased_record(rec)):  # erased: its keys were destroyed
                run.stats["skipped"] += 1
            else:
                try:
                    await self._attempts(call_next, msg, rec, env)
                except _Abandoned:
                    await msg.nack()
                    return None
                except Exception as exc:
                    short = held_back(exc)
                    if short is not None:  # the process's failure: handle it again later
                        log.error("consumer %s: %s held back for want of %s, handled again "
                                  "after a backoff: %s", run.group, dead_letter.describe(rec, env),
                                  short, dead_letter.error_text(exc, env))
                        await msg.nack()
                        await delivery.sleep(delivery.backoff_max)
                        return None
                    outs = run.dead_letters(rec, exc, self.attempts, env)
            try:
                try:
                    await run.produce(outs)
                except RecordTooLarge:  # the DLQ copy, with its dlq_* headers: would never fit
                    outs = dead_letter.without_value(outs, delivery.dlq_topic)
                    await run.produce(outs)
            except Exception:  # the brokers refuse: handle the record again
                log.exception("consumer %s: cannot produce the dead letters of %s[%d]@%d",
                              run.group, rec.topic, rec.partition, rec.offset)
                await msg.nack()
                await delivery.sleep(delivery.backoff_max)
                return None
            tp = (rec.topic, rec.partition)
            run.handled_to[tp] = max(run.handled_to.get(tp, 0), rec.offset + 1)
            try:  # the commit below covers this record's writes: durable first
                if run.router.group.durable:  # else nothing to flush: no thread hop
                    await asyncio.to_thread(run.router.flush)
            except Exception:  # never commit: handle the record again after a backoff
                run.stats["flush_failures"] += 1
                log.exception("consumer %s: cannot make the writes of %s[%d]@%d durable; "
                              "not committing", run.group, rec.topic, rec.partition,
                              rec.offset)
                await msg.nack()
                await delivery.sleep(delivery.backoff_max)
                return None
            await self._ack(msg, rec)
            return None
        finally:
            run.end(rec.topic)

    async def _attempts(self, call_next, msg, rec: Record,  # noqa: ANN001
                        env=None) -> None:
        run, delivery = self.run, self.run.delivery

        def abandoned(exc: BaseException) -> bool:
            return isinstance(exc, _Abandoned) or (
                isinstance(exc, Cancelled) and delivery.stopping.is_set())

        def retryable(exc: BaseException) -> bool:  # an output too large stays too large
            return not (abandoned(exc) or isinstance(exc, RecordTooLarge))

        def before_sleep(state: tenacity.RetryCallState) -> None:
            run.stats["retries"] += 1
            log.warning("consumer %s: %s failed (attempt %d/%d): %s", run.group,
                        dead_letter.describe(rec, env), state.attempt_number,
                        delivery.max_attempts,
                        dead_letter.error_text(state.outcome.exception(), env))

        retrying = tenacity.AsyncRetrying(
            stop=tenacity.stop_after_attempt(delivery.max_attempts),
            wait=retry.backoff(delivery.backoff, delivery.backoff_max),
            retry=tenacity.retry_if_exception(retryable),
            sleep=delivery.sleep, before_sleep=before_sleep, reraise=True)
        try:
            async for attempt in retrying:
                with attempt:
                    self.attempts = attempt.retry_state.attempt_number
                    if self.attempts > 1 and delivery.stopping.is_set():
                        raise _Abandoned()
                    await call_next(msg)
        except Exception as exc:
            if abandoned(exc):  # stopped mid-record: not the record's fault
                raise _Abandoned() from exc
            raise

    async def _ack(self, msg, rec: Record) -> None:  # noqa: ANN001
        try:
            await msg.ack()  # commits the consumer's position: this record and before
            self.run.done[(rec.topic, rec.partition)] = rec.offset + 1
        except (KafkaError, IllegalStateError) as exc:
            # A rebalance moved the partition: its new owner handles the record again
            # (same output ids), so this is a duplicate, not a loss.
            self.run.stats["commit_failures"] += 1
            log.warning("consumer %s: commit of %s[%d]@%d refused: %r", self.run.group,
                        rec.topic, rec.partition, rec.offset, exc)


class _RevokeAfterCommit(ConsumerRebalanceListener):
    """Before partitions of ``topic`` leave this process, wait (up to ``timeout`` s)
    for the record in hand to be handled and committed. When partitions arrive, restore
    their local state first: they are paused (no record of theirs is fetched) while a
    task restores them step by step under the group's lock, so the consumer goes on
    polling -- the other partitions' records are handled between the steps, and a restore
    longer than ``max.poll.interval.ms`` does not drop the member -- and resumed once
    restored. ``subscriber``: the FastStream subscriber whose consumer this listens to
    (set after it is built)."""

    def __init__(self, run: GroupRun, topic: str, timeout: float) -> None:
        self.run, self.topic, self.timeout = run, topic, timeout
        self.subscriber: Any = None

    async def on_partitions_revoked(self, revoked) -> None:  # noqa: ANN001
        if revoked and not await self.run.wait_idle_topic(self.topic, self.timeout):
            log.warning("consumer %s: partitions of %s revoked with a record in hand",
                        self.run.group, self.topic)
        run = self.run
        parts = sorted(tp.partition for tp in revoked if tp.topic == self.topic)
        run.owned[self.topic] = run.owned.get(self.topic, set()) - set(parts)
        if revoked and run.restorer is not None:
            try:
                await asyncio.to_thread(run.leave, parts)  # not those still restoring
                for p in parts:  # their restore stops at its next step
                    run.restoring.pop(p, None)
            except Exception:  # the next restore starts from an earlier mark: slower only
                log.exception("consumer %s: cannot mark the local state of %s", run.group,
                              parts)

    async def on_partitions_assigned(self, assigned) -> None:  # noqa: ANN001
        """Pause the new partitions and restore each one's local state in a task; each is
        resumed when its restore is done (no record is handled on a state not restored)."""
        run = self.run
        tps = [tp for tp in assigned if tp.topic == self.topic]
        parts = sorted(tp.partition for tp in tps)
        run.owned[self.topic] = set(parts)  # the whole assignment (eager rebalancing)
        if not parts or run.restorer is None:
            return
        consumer = self.subscriber.consumer
        consumer.pause(*tps)
        for tp in tps:  # one task each: a short restore does not wait for a long one
            token = run.restoring[tp.partition] = object()
            task = asyncio.ensure_future(self._restore(tp, consumer, token))
            run.restore_tasks.add(task)
            task.add_done_callback(run.restore_tasks.discard)

    async def _restore(self, tp: Any, consumer: Any, token: object) -> None:
        run, parts = self.run, [tp.partition]
        started = time.monotonic()

        def current() -> bool:  # still this assignment's, and the runner goes on
            return not run.delivery.stopping.is_set() and run.restoring.get(tp.partition) is token

        def warn(state: tenacity.RetryCallState) -> None:
            log.warning("consumer %s: restoring partitions %s failed (%r); retrying",
                        run.group, parts, state.outcome.exception())
        # Records must not be handled on a state that is not restored: retry until the
        # restore works (the brokers answer again) or the runner stops.
        retrying = tenacity.AsyncRetrying(
            wait=retry.backoff(0.5, 10.0), before_sleep=warn, reraise=True,
            stop=lambda _: run.delivery.stopping.is_set(), sleep=run.delivery.sleep)
        try:
            async for attempt in retrying:
                with attempt:
                    steps, n = run.restore_steps(parts), None
                    while n is None:
                        if not current():
                            return  # revoked meanwhile (or stopping): its next owner restores
                        async with run._lock:  # not while a handler of the group runs here
                            n = await asyncio.to_thread(_step, steps)
        except Exception:
            if current():
                log.exception("consumer %s: restoring partitions %s failed", run.group, parts)
            return
        if not current():
            return
        run.restoring.pop(tp.partition, None)
        if tp in consumer.assignment():
            consumer.resume(tp)
        log.info("consumer %s: restored %d records of partitions %s in %.1fs", run.group,
                 n, parts, time.monotonic() - started)


def _step(steps) -> int | None:
    """Run one step of a :meth:`GroupRun.restore_steps` generator: None while it goes
    on, its result when it is done."""
    try:
        next(steps)
    except StopIteration as done:
        return done.value
    return None


def _consumer_settings(o: KafkaOptions, topic: str) -> dict[str, Any]:
    return dict(session_timeout_ms=o.session_timeout_ms,
                heartbeat_interval_ms=o.heartbeat_interval_ms,
                max_poll_interval_ms=o.max_poll_interval_ms,
                fetch_max_wait_ms=o.fetch_wait(topic))


def _stub(name: str, model: Any):
    async def handle(body) -> None:  # noqa: ANN001 - annotated below
        """Never called: a described broker is never started."""
    handle.__annotations__ = {"body": model, "return": None}  # the class, not a string
    handle.__name__ = handle.__qualname__ = f"on_{name}"
    return handle


def _runtime_handler(run: GroupRun):
    async def handle(message: KafkaMessage) -> None:
        await run.handle(message)
    handle.__name__ = handle.__qualname__ = f"on_{run.group.replace('-', '_')}"
    return handle


def build_broker(services: Iterable[Service], routers: Mapping[str, Router] | None = None,
                 *, bootstrap_servers: str = SERVER, options: KafkaOptions | None = None,
                 delivery: Delivery | None = None, groups: Iterable[str] | None = None,
                 restorers: Mapping[str, Router] | None = None, event_log: Any = None,
                 checkpoints: Checkpoints | None = None) -> KafkaBroker:
    """The KafkaBroker of ``services``: per consumer group and topic it reads, a
    subscriber (channel title ``<group>.consume.<topic>``); per group a DLQ publisher
    (``<group>.produce.<dlq>``); per service and topic it produces, a publisher
    (``<service>.produce.<topic>``).

    ``routers`` None: describe-only (every group, payloads from the event types' models;
    never start it). Otherwise ``routers`` (group → Router) are the groups that run (the
    ``groups`` subset when given), each subscriber's handler is its router, and
    ``delivery`` (default :class:`Delivery()`) gets the :class:`GroupRun` of each group.
    ``options``: client settings (default :class:`KafkaOptions()`). Raises KeyError for
    a group in ``groups`` that no router runs. ``restorers`` (group → restore Router),
    ``event_log`` (what they read) and ``checkpoints``: the replica-local state of the
    groups that have it (:meth:`GroupRun.restore`)."""
    services = tuple(services)
    o = options or KafkaOptions()
    describe = routers is None
    delivery = delivery if delivery is not None else Delivery()
    broker = KafkaBroker(
        bootstrap_servers, client_id=o.client_id, request_timeout_ms=o.request_timeout_ms,
        acks="all", enable_idempotence=o.enable_idempotence, linger_ms=0,
        max_request_size=o.max_request_size,
        security=o.security.faststream(),  # TLS/SASL: the log's own (mneme.bus.security)
        graceful_timeout=30.0, codec=_ProtobufCodec(), log_level=logging.DEBUG,
        description="Apache Kafka (`MNEME_BUS_URL=kafka://HOST:PORT`; kafka:9092 in "
                    "docker-compose.yml). Records are keyed by `bank_id`.")
    models = payload = None
    if describe:
        from mneme.runtime.asyncapi import event_models  # lazy: pydantic models

        models = event_models()

        def payload(types: Sequence[type[Message]]) -> Any:
            ms = [models[t.DESCRIPTOR.name] for t in types]
            return ms[0] if len(ms) == 1 else Union[tuple(ms)]  # noqa: UP007
    wanted = None if groups is None else set(groups)
    if wanted is not None and routers is not None:
        missing = wanted - set(routers)
        if missing:
            raise KeyError(f"no router for consumer group(s) {sorted(missing)}")
    for service in services:
        for group in service.groups:
            if describe:
                run = None
            elif group.name not in routers or (wanted is not None and group.name not in wanted):
                continue
            else:
                run = GroupRun(routers[group.name], delivery,
                               (restorers or {}).get(group.name), event_log, checkpoints)
                delivery.groups[group.name] = run
            # One FastStream router per group: its middleware is the group's policy.
            fs = KafkaRouter(middlewares=() if run is None else
                             (functools.partial(DeliveryMiddleware, run=run),))
            for topic, handlers in group.consumes.items():
                listener = None if run is None else _RevokeAfterCommit(
                    run, topic, delivery.revoke_wait_s)
                sub = fs.subscriber(
                    Topic(topic, num_partitions=default_partitions(topic),
                          replication_factor=o.replication_factor),
                    group_id=group.name if run is None else run.group_id,
                    ack_policy=AckPolicy.MANUAL,
                    auto_offset_reset="earliest", title=f"{group.name}.consume.{topic}",
                    description=f"Service `{service.name}`, consumer group `{group.name}`, "
                                f"reads `{topic}`.",
                    listener=listener, **_consumer_settings(o, topic))
                if listener is not None:
                    listener.subscriber = sub  # its consumer pauses restoring partitions
                if run is None:
                    for t in handlers:
                        name = t.DESCRIPTOR.name
                        sub(filter=(lambda ce: lambda m: m.headers.get("ce_type") == ce)(
                            event_type(t)))(_stub(name, models[name]))
                else:
                    sub(_runtime_handler(run))
            dlq = fs.publisher(delivery.dlq_topic, title=f"{group.name}.produce."
                               f"{delivery.dlq_topic}",
                               description=f"Consumer group `{group.name}` (service "
                                           f"`{service.name}`) dead-letters what it cannot "
                                           "handle after retries.",
                               **({"schema": payload(_all_types())} if describe else {}))
            # A dead letter of an operation's event fails the operation on progress.
            failed = fs.publisher(PROGRESS, title=f"{group.name}.dead-letter.{PROGRESS}",
                                  description=f"Consumer group `{group.name}` (service "
                                              f"`{service.name}`) fails the operation of an "
                                              "event it dead-letters (OperationProgress, "
                                              "state `failed`).",
                                  **({"schema": payload(
                                      (dead_letter.FAILED_PROGRESS,))} if describe else {}))
            broker.include_router(fs)
            if run is not None:
                run.publishers[delivery.dlq_topic] = dlq
                run.publishers.setdefault(PROGRESS, failed)
        for topic, types in service.produces.items():
            pub = broker.publisher(topic, title=f"{service.name}.produce.{topic}",
                                   description=f"Service `{service.name}` (ce_source "
                                               f"`{service.source}`) publishes to `{topic}`.",
                                   **({"schema": payload(types)} if describe else {}))
            for run in delivery.groups.values():
                if run.router.service.name == service.name:
                    run.publishers.setdefault(topic, pub)
    return broker


def _all_types() -> tuple[type[Message], ...]:
    from mneme.bus.codec import TOPIC_OF_TYPE, message_class

    return tuple(message_class(t) for t in TOPIC_OF_TYPE)


class KafkaRunner:
    """Runs the consumer groups of ``routers`` (group → :class:`~mneme.router.Router`)
    on Kafka through FastStream (:func:`build_broker`), on its own asyncio loop in a
    thread (``kafka-runner``). ``log`` is the process's
    :class:`~mneme.bus.kafka_log.KafkaEventLog`: its brokers and options (unless
    ``options`` is given), topic creation, and the offsets :meth:`wait_idle` and
    :meth:`lag` read. ``max_attempts``, ``backoff``, ``backoff_max`` (seconds),
    ``dlq_topic``: the retry-then-DLQ policy (:class:`Delivery`). ``restorers`` (group →
    restore :class:`~mneme.router.Router`) restore a group's replica-local state when it
    is assigned partitions, tracked in the ``checkpoints`` file (:class:`Checkpoints`).

    Several processes running the same groups share their partitions (Kafka consumer
    groups). Raises ValueError for ``max_attempts`` < 1."""

    def __init__(self, log, routers: Mapping[str, Router],  # noqa: ANN001 - KafkaEventLog
                 options: KafkaOptions | None = None, *, max_attempts: int = 3,
                 backoff: float = 0.05, backoff_max: float = 2.0, dlq_topic: str = DLQ,
                 restorers: Mapping[str, Router] | None = None,
                 checkpoints: Path | None = None) -> None:
        self.log = log
        self.routers = dict(routers)
        self.restorers = dict(restorers or {})
        self.checkpoints = Checkpoints(checkpoints)
        self.options = options or getattr(log, "options", None) or KafkaOptions()
        self.delivery = Delivery(max_attempts=max_attempts, backoff=backoff,
                                 backoff_max=backoff_max, dlq_topic=dlq_topic,
                                 revoke_wait_s=self.options.max_poll_interval_ms / 1000)
        self._services = tuple({id(r.service): r.service
                                for r in self.routers.values()}.values())
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self._broker: KafkaBroker | None = None
        self._lag_task: asyncio.Future | None = None

    # ---- lifecycle ---------------------------------------------------------------

    @property
    def groups(self) -> dict[str, GroupRun]:
        """Group → :class:`GroupRun` of the running groups ({} before :meth:`start`)."""
        return self.delivery.groups

    @property
    def running(self) -> bool:
        """True between :meth:`start` and :meth:`stop`."""
        return self._thread is not None and self._thread.is_alive()

    def start(self, groups: Iterable[str] | None = None, timeout: float = 60.0) -> "KafkaRunner":
        """Create the topics the groups read and write (when missing), connect, and start
        the subscribers of every group (or of ``groups``); returns self once they have
        started (their group joins go on in the background). Raises RuntimeError when
        running; what the brokers raise when they cannot be reached in ``timeout`` s."""
        if self.running:
            raise RuntimeError("the Kafka runner is already running")
        # the same policy, a fresh stop event and no groups yet
        self.delivery = dataclasses.replace(self.delivery, stopping=threading.Event(),
                                            groups={})
        self._ensure_topics(groups)
        self._broker = build_broker(self._services, self.routers,
                                    bootstrap_servers=self.log.bootstrap_servers,
                                    options=self.options, delivery=self.delivery,
                                    groups=groups, restorers=self.restorers,
                                    event_log=self.log, checkpoints=self.checkpoints)
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name="kafka-runner",
                                        daemon=True)
        self._thread.start()
        try:
            self._run(self._start(), timeout)
        except BaseException:
            self._shutdown_loop()
            raise
        for run in self.groups.values():
            telemetry.track_consumer(run)  # mneme.consumer.lag while it runs
        return self

    async def _start(self) -> None:
        self.delivery.stop_event()
        broker = self._broker
        await broker.connect()
        # KafkaBroker.start, but every subscriber joins its group at once: aiokafka's start
        # waits for an assignment, and one after another each join would rebalance the
        # members already in (a group's topics are one member each in this process).
        await asyncio.gather(*(sub.start() for sub in broker.subscribers))
        for pub in broker.publishers:
            await pub.start()
        broker.running = True
        for run in self.groups.values():
            run.running = True
        self._lag_task = asyncio.ensure_future(self._refresh_lag())

    def stop(self, timeout: float = 30.0) -> bool:
        """Stop after the records in hand (a handler in progress sees a cancelled
        deadline; a record left unfinished is not committed and is handled again by the
        group's next owner), leave the groups and close the connections. True when all
        ended within ``timeout`` seconds."""
        if self._loop is None:
            return True
        self.delivery.stopping.set()
        self._loop.call_soon_threadsafe(self.delivery.stop_event().set)
        for run in self.groups.values():
            run.running = False
        ok = True
        try:
            self._run(self._stop(), timeout)
        except Exception:
            log.exception("Kafka runner: stopping failed")
            ok = False
        return self._shutdown_loop() and ok

    async def _stop(self) -> None:
        if self._lag_task is not None:
            self._lag_task.cancel()
        for run in self.groups.values():  # a restore stops at its next step
            await asyncio.gather(*run.restore_tasks, return_exceptions=True)
        await self._broker.stop()
        for run in self.groups.values():  # where a restart's restores may resume
            if run.restorer is not None:
                # only what it holds: a partition lost in a rebalance was marked then, and
                # its changelog has grown since with its new owner's decisions
                parts = sorted({p for (t, p) in run.done
                                if t in run.topics and p in run.owned.get(t, ())})
                try:
                    await asyncio.to_thread(run.leave, parts)
                except Exception:
                    log.exception("consumer %s: cannot mark its local state", run.group)

    def _shutdown_loop(self) -> bool:
        loop, thread = self._loop, self._thread
        self._loop = self._thread = None
        if loop is None:
            return True
        loop.call_soon_threadsafe(loop.stop)
        thread.join(10)
        if not thread.is_alive():
            loop.close()
        return not thread.is_alive()

    def _run(self, coro, timeout: float | None):  # noqa: ANN001
        return asyncio.run_coroutine_threadsafe(coro, self._loop).result(timeout)

    def __enter__(self) -> "KafkaRunner":
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def _ensure_topics(self, groups: Iterable[str] | None) -> None:
        wanted = None if groups is None else set(groups)
        topics: dict[str, None] = {self.delivery.dlq_topic: None, PROGRESS: None}
        for name, r in self.routers.items():
            if wanted is None or name in wanted:
                topics.update(dict.fromkeys(r.topics))
                topics.update(dict.fromkeys(r.service.produces))
        for t in topics:
            if self.log.partitions(t) == 0:
                self.log.ensure_topic(t, default_partitions(t))

    # ---- progress ----------------------------------------------------------------

    def lag(self, group: str) -> dict[tuple[str, int], int]:
        """Records ``group`` has not committed yet per (topic, partition) of every
        partition of its topics (all processes' commits count): high watermark −
        committed offset. Raises KeyError for a group this runner does not run."""
        return self.log.lag(self.routers[group].group_id, self.routers[group].topics)

    def lag_snapshot(self) -> dict[tuple[str, int], int]:
        """Every running group's lag as of at most :data:`LAG_REFRESH_S` ago, merged
        ((topic, partition) → the largest lag of a group there)."""
        out: dict[tuple[str, int], int] = {}
        for run in self.groups.values():
            for tp, n in run.lag_snapshot().items():
                out[tp] = max(n, out.get(tp, 0))
        return out

    async def _refresh_lag(self) -> None:
        while True:
            for name, run in list(self.groups.items()):
                try:
                    run._lag = await asyncio.to_thread(self.lag, name)
                except Exception:  # the brokers are busy or away: keep the last values
                    pass
            await asyncio.sleep(LAG_REFRESH_S)

    def wait_idle(self, group: str | None = None, timeout: float = 10.0) -> bool:
        """Block until ``group`` (every running group when None) has committed up to the
        high watermark of every partition of its topics, with no record in hand here;
        True when caught up, False after ``timeout`` seconds."""
        names = list(self.groups) if group is None else [group]
        end = time.monotonic() + timeout
        while True:
            try:
                if all(self._caught_up(g) for g in names):
                    return True
            except KafkaError:  # no fetch answer yet: not known to be caught up
                pass
            if time.monotonic() >= end:
                return False
            time.sleep(0.05)

    def catch_up(self, partitions: Mapping[str, Iterable[tuple[str, int]]],
                 timeout: float = 5.0) -> bool:
        """Block until this process's groups (``partitions``: group → (topic,
        partition) pairs) have handled every record that is on those partitions now:
        read-your-writes for a replica's own copy of a projection
        (:attr:`mneme.router.Group.state`). One read of the high watermarks for all of
        them. True when caught up, False after ``timeout`` seconds (the caller serves
        what it has) or when the brokers do not answer. KeyError for a group this
        runner does not run."""
        wanted = {g: list(tps) for g, tps in partitions.items()}
        runs = {g: self.groups[g] for g in wanted}
        end = time.monotonic() + timeout
        try:  # bounded too: with the brokers away the fetch alone takes 40 s and more
            target = self.log.end_offsets({tp for tps in wanted.values() for tp in tps},
                                          timeout=timeout)
        except KafkaError:
            return False
        for g, tps in wanted.items():  # before a first record here: what the group committed
            run, gid = runs[g], self.routers[g].group_id
            for tp in tps:
                if tp not in run.done and target[tp] > 0:
                    try:
                        at = self.log.committed(gid, *tp, timeout=end - time.monotonic())
                    except KafkaError:
                        return False
                    run.done.setdefault(tp, at)
        def reached(run: GroupRun, tp: tuple[str, int]) -> int:  # handled is visible
            return max(run.done.get(tp, 0), run.handled_to.get(tp, 0))
        while any(reached(runs[g], tp) < target[tp] for g, tps in wanted.items()
                  for tp in tps):
            if time.monotonic() >= end:
                return False
            time.sleep(0.005)
        return True

    def _caught_up(self, group: str) -> bool:
        done = not any(self.lag(group).values())
        return done and not self.groups[group].busy  # read last: a record in hand is not done


__all__ = ["Delivery", "DeliveryMiddleware", "GroupRun", "KafkaRunner", "SERVER",
           "build_broker"]
