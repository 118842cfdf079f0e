"""The Kafka event log: :class:`mneme.ports.EventLog` over Apache Kafka with aiokafka.

What it maps to in the Kafka protocol:

* topics are created with the admin client (CreateTopics) with their partition counts
  and ``replication_factor``; an existing topic keeps its partitions (a warning is
  logged when they differ, as the embedded log does);
* ``append`` produces with ``acks=all`` (the record is in every in-sync replica when the
  call returns) to the partition :func:`mneme.bus.partition_for` picks, which is Kafka's
  own default partitioner, so the embedded log and Kafka agree on a bank's partition.
  A multi-record append is *not* atomic (no transactions): on failure some records may be
  on the log; callers retry with the same deterministic event ids;
* headers are the CloudEvents Kafka binding's binary mode (``ce_*``, ``content-type``)
  plus W3C ``traceparent``; Kafka headers are bytes, so values are UTF-8 encoded here and
  decoded on read (mneme's headers are ``str``; non-UTF-8 bytes are decoded with
  replacement);
* ``end_offset`` is the partition's high watermark as reported by a Fetch response
  (``highwater()``); ``committed``/``commit`` are OffsetFetch/OffsetCommit of the group;
* consumer groups whose partitions Kafka assigns to the processes of a service are run
  by FastStream (:mod:`mneme.runtime.kafka`); this log's ``commit`` is a plain
  OffsetCommit outside any membership (replay, tools).

Delivery: a consumer stores its effects, then produces its outputs, then commits the
offsets — at least once; consumers are idempotent (deterministic ids, upserts), so the
effects are exactly once (DESIGN §3).

aiokafka is asyncio; the port is synchronous and thread-safe, so each instance runs one
event loop in a daemon thread and the sync methods submit coroutines to it.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import logging
import threading
import time
from dataclasses import dataclass
from typing import Iterable, Sequence
from urllib.parse import parse_qs, urlsplit

import tenacity
from aiokafka import AIOKafkaConsumer, AIOKafkaProducer, TopicPartition
from aiokafka.admin import AIOKafkaAdminClient, NewTopic
from aiokafka.admin.config_resource import ConfigResource, ConfigResourceType
from aiokafka.client import AIOKafkaClient
from aiokafka.errors import (CommitFailedError, IllegalStateError, KafkaConnectionError,
                             KafkaError, KafkaTimeoutError, MessageSizeTooLargeError,
                             RecordListTooLargeError, RecordTooLargeError,
                             TopicAlreadyExistsError)

from mneme.bus import (ALL_TOPICS, TOPIC_CONFIGS, StaleCommitError, default_partitions,
                       partition_for)
from mneme.bus.security import KafkaSecurity
from mneme.errors import ConfigurationError, RecordTooLarge, Unavailable
from mneme.ports import OutRecord, Record

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class KafkaOptions:
    """Client settings. Durations are milliseconds, as in Kafka's client configs.
    ``security``: TLS and SASL of every client (:class:`mneme.bus.security.KafkaSecurity`).

    The defaults are Kafka's production defaults; tests against a single local broker
    lower ``session_timeout_ms``/``heartbeat_interval_ms`` so group joins take ~1 s.
    ``enable_idempotence`` needs a broker with the idempotent producer (Apache Kafka has
    it; the ``tansu`` test broker does not). ``connect_timeout_s``: how long the
    constructor retries an unreachable broker before raising ConnectionError.
    ``fetch_max_wait_ms``: how long the services' group consumers let a fetch wait for
    records (aiokafka's default, 500 ms, is paid by every hop of a sync retain);
    ``topic_fetch_max_wait_ms``: (topic, ms) pairs overriding it for the consumers of
    those topics (:meth:`fetch_wait`). ValueError for a wait outside 0..60000 ms.
    """

    client_id: str = "mneme"
    security: KafkaSecurity = KafkaSecurity()
    replication_factor: int = 1
    session_timeout_ms: int = 45_000
    heartbeat_interval_ms: int = 3_000
    max_poll_interval_ms: int = 300_000
    request_timeout_ms: int = 30_000
    enable_idempotence: bool = True
    max_request_size: int = 1_048_576
    connect_timeout_s: float = 60.0
    fetch_max_wait_ms: int = 100
    topic_fetch_max_wait_ms: tuple[tuple[str, int], ...] = ()

    def __post_init__(self) -> None:
        for name, ms in (("fetch_max_wait_ms", self.fetch_max_wait_ms),
                         *self.topic_fetch_max_wait_ms):
            if not isinstance(ms, int) or not 0 <= ms <= 60_000:
                raise ValueError(f"fetch wait of {name}: {ms!r} is not 0..60000 ms")

    def fetch_wait(self, topic: str) -> int:
        """The fetch wait (ms) of the group consumers reading ``topic``."""
        return dict(self.topic_fetch_max_wait_ms).get(topic, self.fetch_max_wait_ms)


def parse_kafka_url(url: str) -> tuple[str, dict[str, str]]:
    """``kafka://host:port[,host:port][?option=value]`` → (bootstrap servers, options).

    Raises :class:`mneme.errors.ConfigurationError` (a ValueError) when no host is given."""
    parts = urlsplit(url)
    servers = parts.netloc
    if not servers or not all(s.strip() for s in servers.split(",")):
        raise ConfigurationError(f"MNEME_BUS_URL: a kafka URL needs host:port[,host:port], as "
                                 f"in kafka://kafka:9092; got {url!r}")
    return servers, {k: v[-1] for k, v in parse_qs(parts.query).items()}


def _headers_out(headers: dict[str, str]) -> list[tuple[str, bytes]]:
    return [(k, v.encode("utf-8")) for k, v in headers.items()]


def _headers_in(headers: Iterable[tuple[str, bytes]] | None) -> dict[str, str]:
    return {k: (v or b"").decode("utf-8", "replace") for k, v in headers or ()}


#: What the producer or the brokers raise for a record larger than they take.
#: Apache Kafka's default ``message.max.bytes`` (brokers) / ``max.message.bytes`` (topics).
KAFKA_DEFAULT_MESSAGE_BYTES = 1_048_588

TOO_LARGE = (MessageSizeTooLargeError, RecordTooLargeError, RecordListTooLargeError)


@contextlib.contextmanager
def refused_as_too_large(record: OutRecord):
    """Around sending ``record`` (or awaiting its acknowledgement): one of
    :data:`TOO_LARGE` becomes :class:`mneme.errors.RecordTooLarge`, naming its event
    type, topic and size."""
    try:
        yield
    except TOO_LARGE as exc:
        kind = record.headers.get("ce_type", "record").rsplit(".", 1)[-1]
        raise RecordTooLarge(
            f"{kind} of bank {record.key!r} is {len(record.value):,} bytes, more than the "
            f"event log takes for one record on {record.topic} (Kafka's max.request.size / "
            f"max.message.bytes, 1 MiB by default); split the request into smaller ones "
            f"({type(exc).__name__})") from exc


def record_of(msg) -> Record:
    """aiokafka ConsumerRecord → Record (timestamp ms → epoch seconds)."""
    key = msg.key.decode("utf-8", "replace") if msg.key is not None else ""
    return Record(msg.topic, msg.partition, msg.offset, key, bytes(msg.value or b""),
                  _headers_in(msg.headers), (msg.timestamp or 0) / 1000.0)


async def _cancel_tasks(timeout: float) -> None:
    """Cancel every other task of the running loop and wait up to ``timeout`` s for them."""
    tasks = [t for t in asyncio.all_tasks() if t is not asyncio.current_task()]
    for t in tasks:
        t.cancel()
    if tasks:
        await asyncio.wait(tasks, timeout=timeout)


class _LoopThread:
    """One asyncio loop in a daemon thread; ``run`` submits a coroutine and waits.

    After :meth:`stop`, calls still waiting (from other threads) end with
    ``concurrent.futures.CancelledError`` and new ones raise RuntimeError at once: a
    stopped loop never runs them, and a thread left waiting forever would keep the
    process from exiting."""

    def __init__(self, name: str) -> None:
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, name=name, daemon=True)
        self.thread.start()
        self._pending: set[concurrent.futures.Future] = set()
        self._guard = threading.Lock()
        self._stopped = False

    def run(self, coro, timeout: float | None = None):
        if threading.current_thread() is self.thread:
            coro.close()
            raise RuntimeError("blocking call from the Kafka loop thread")
        with self._guard:
            if self._stopped:
                coro.close()
                raise RuntimeError("the Kafka connection is closed")
            fut = asyncio.run_coroutine_threadsafe(coro, self.loop)
            self._pending.add(fut)
        try:
            return fut.result(timeout)
        finally:
            with self._guard:
                self._pending.discard(fut)

    def stop(self) -> None:
        """Cancel the tasks still on the loop and wait (at most 5 s) until they end, then
        stop the loop and close it (its selector and self-pipe), once its thread ended;
        cancel the calls still waiting on it."""
        with self._guard:
            self._stopped = True
            pending = list(self._pending)
        if self.thread.is_alive():
            # a task left pending when the loop closes is destroyed mid-await (an
            # unraisable "coroutine ignored GeneratorExit"): cancel each and let it unwind
            with contextlib.suppress(Exception):
                asyncio.run_coroutine_threadsafe(_cancel_tasks(5.0), self.loop).result(6)
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(5)
        for fut in pending:
            fut.cancel()
        if not self.thread.is_alive():
            self.loop.close()


class KafkaEventLog:
    """An :class:`mneme.ports.EventLog` on Kafka brokers ``bootstrap_servers``
    ("host:port[,host:port]"). Connects in the constructor, retrying for
    ``options.connect_timeout_s`` seconds; raises ConnectionError if no broker answers.
    Thread-safe. Close it (after the members) to leave groups and flush the producer."""

    def __init__(self, bootstrap_servers: str, options: KafkaOptions | None = None) -> None:
        self.bootstrap_servers = bootstrap_servers
        self.options = options or KafkaOptions()
        self._loop = _LoopThread(f"kafka-{self.options.client_id}")
        self._pcache: dict[str, int] = {}
        self._lost: dict[str, tuple[int, int]] = {}  # what the last ping found missing
        self._groups: dict[str, AIOKafkaConsumer] = {}   # offset queries/simple commits
        self._closed = False
        try:
            self._loop.run(self._connect())
        except BaseException:
            self._loop.stop()
            raise

    # ---- connection --------------------------------------------------------------

    def _common(self) -> dict:
        # Every client this log makes (metadata, admin, producer, consumers) goes
        # through here, so each gets the TLS/SASL arguments.
        return dict(bootstrap_servers=self.bootstrap_servers, client_id=self.options.client_id,
                    request_timeout_ms=self.options.request_timeout_ms,
                    **self.options.security.client_kwargs())

    async def _connect(self) -> None:
        self._lock = asyncio.Lock()         # serialises the reader / probe consumers

        async def bootstrap() -> None:
            self._meta = AIOKafkaClient(**self._common())
            try:
                await self._meta.bootstrap()
            except KafkaError:
                await self._meta.close()
                raise

        # A broker that is not up yet (compose, k8s start order): retry every 0.5 s for
        # connect_timeout_s seconds, then give up with the last error.
        try:
            await tenacity.AsyncRetrying(
                retry=tenacity.retry_if_exception_type(KafkaError),
                stop=tenacity.stop_after_delay(self.options.connect_timeout_s),
                wait=tenacity.wait_fixed(0.5), reraise=True)(bootstrap)
        except KafkaError as exc:
            raise ConnectionError(f"no Kafka broker at {self.bootstrap_servers} "
                                  f"after {self.options.connect_timeout_s:.0f}s: {exc}") from exc
        self._admin = AIOKafkaAdminClient(**self._common())
        await self._admin.start()
        self._producer = AIOKafkaProducer(
            **self._common(), acks="all", enable_idempotence=self.options.enable_idempotence,
            linger_ms=0, max_request_size=self.options.max_request_size)
        try:
            await self._producer.start()
        except KafkaError as exc:
            await self._producer.stop()
            await self._admin.close()
            await self._meta.close()
            if not self.options.enable_idempotence or isinstance(
                    exc, (KafkaConnectionError, KafkaTimeoutError)):
                raise
            # the broker answered, but not the idempotent producer's InitProducerId
            raise ConfigurationError(
                f"the Kafka broker at {self.bootstrap_servers} refused an idempotent "
                f"producer ({type(exc).__name__}: {exc}): a broker without it needs "
                "MNEME_KAFKA_ENABLE_IDEMPOTENCE=false") from exc
        # No group: used for read() and end_offset() with manual assignment.
        self._reader = AIOKafkaConsumer(**self._common(), enable_auto_commit=False,
                                        auto_offset_reset="earliest", fetch_max_wait_ms=10)
        await self._reader.start()
        self._reader_next: dict[TopicPartition, int] = {}

    def ping(self, timeout: float = 5.0) -> bool:
        """True when a broker answers a metadata request within ``timeout`` seconds and
        every topic this log has used still has at least the partitions it had then
        (False, with an error logged, for a topic deleted or recreated smaller under the
        running process: its writes would fail or land on another log)."""
        if self._closed:
            return False
        try:
            md = self._loop.run(self._meta.fetch_all_metadata(), timeout)
        except Exception:
            return False
        lost = {t: (n, len(md.partitions_for_topic(t) or ()))
                for t, n in list(self._pcache.items())}
        lost = {t: c for t, c in lost.items() if c[1] < c[0]}
        if lost and lost != self._lost:
            log.error("the brokers at %s lost topics this process uses: %s; its writes "
                      "are refused until they are restored (then restart it)",
                      self.bootstrap_servers, ", ".join(
                          f"{t} has {now} partitions, had {n}" for t, (n, now) in lost.items()))
        self._lost = lost
        return not lost

    # ---- topics ------------------------------------------------------------------

    def ensure_topic(self, topic: str, partitions: int) -> None:
        """Create ``topic`` with ``partitions`` partitions, the replication factor of the
        options and its configs (:meth:`configs_for`) unless it exists; waits until the
        brokers' metadata shows it. An existing topic is left as it is (``mneme topics
        check`` reports what differs). Raises ValueError for an empty name or
        ``partitions`` < 1."""
        if not topic:
            raise ValueError("topic name must not be empty")
        if partitions < 1:
            raise ValueError(f"partitions must be >= 1, got {partitions}")
        self._loop.run(self._ensure_topic(topic, partitions))

    def configs_for(self, topic: str) -> dict[str, str]:
        """The Kafka configs mneme wants ``topic`` to have: :data:`mneme.bus.TOPIC_CONFIGS`
        plus ``min.insync.replicas`` (replication factor − 1, at least 1) and, for a
        producer limit above Kafka's default record size (1,048,588 bytes), a
        ``max.message.bytes`` that takes it."""
        wanted = dict(TOPIC_CONFIGS.get(topic, {}))
        wanted["min.insync.replicas"] = str(max(1, self.options.replication_factor - 1))
        if self.options.max_request_size > KAFKA_DEFAULT_MESSAGE_BYTES:
            wanted["max.message.bytes"] = str(self.options.max_request_size)
        return wanted

    def topic_configs(self, topics: Sequence[str]) -> dict[str, dict[str, str]]:
        """The configs the brokers report for each of ``topics`` (name → value; a broker
        may leave out the ones at their defaults). Raises KafkaError for an unknown
        topic."""
        async def describe() -> dict[str, dict[str, str]]:
            out: dict[str, dict[str, str]] = {}
            for resp in await self._admin.describe_configs(
                    [ConfigResource(ConfigResourceType.TOPIC, t) for t in topics]):
                for code, message, _, name, entries in resp.resources:
                    if code:
                        raise KafkaError(f"describing topic {name}: error {code} {message}")
                    out[name] = {e[0]: e[1] for e in entries if e[1] is not None}
            return out
        return self._loop.run(describe())

    async def _ensure_topic(self, topic: str, partitions: int) -> int:
        existing = await self._partitions(topic)
        if not existing:
            resp = await self._admin.create_topics(
                [NewTopic(topic, partitions, self.options.replication_factor,
                          topic_configs=self.configs_for(topic))])
            for _, code, message in resp.topic_errors:
                if code not in (0, TopicAlreadyExistsError.errno):
                    raise KafkaError(f"creating topic {topic}: error {code} {message}")
            for _ in range(100):  # creation is asynchronous on the brokers
                existing = await self._partitions(topic, refresh=True)
                if existing:
                    break
                await asyncio.sleep(0.05)
            else:
                raise KafkaError(f"topic {topic} did not appear in the metadata")
        if existing != partitions:
            log.warning("topic %s exists with %d partitions; keeping them (asked for %d)",
                        topic, existing, partitions)
        return existing

    async def _partitions(self, topic: str, refresh: bool = False) -> int:
        n = self._pcache.get(topic)
        if n is None or refresh:
            # A metadata request for *all* topics never auto-creates one.
            md = await self._meta.fetch_all_metadata()
            n = len(md.partitions_for_topic(topic) or ())
            if n:
                self._pcache[topic] = n
        return n

    def partitions(self, topic: str) -> int:
        """Partition count of ``topic``; 0 when it does not exist."""
        n = self._pcache.get(topic)
        return n if n else self._loop.run(self._partitions(topic, refresh=True))

    # ---- append / read -----------------------------------------------------------

    def append(self, records: Sequence[OutRecord]) -> list[Record]:
        """Produce ``records`` with acks=all and wait for every acknowledgement; returns
        them with partition, offset and broker timestamp (epoch seconds). Missing topics
        are created with :func:`mneme.bus.default_partitions`. Not atomic across records
        (see the module docstring). Raises TypeError for a malformed record,
        :class:`mneme.errors.RecordTooLarge` for one larger than Kafka takes,
        :class:`mneme.errors.Unavailable` (from the ``aiokafka.errors.KafkaError``) when
        the brokers refuse or time out: a gRPC write answers UNAVAILABLE, which a client
        may retry, not UNKNOWN."""
        records = list(records)
        for r in records:
            _check(r)
        if not records:
            return []
        try:
            return self._loop.run(self._append(records))
        except KafkaError as exc:
            raise Unavailable(f"the event log (Kafka at {self.bootstrap_servers}) did not "
                              f"take the records: {type(exc).__name__}: {exc}") from exc

    async def _append(self, records: list[OutRecord]) -> list[Record]:
        futures = []
        for r in records:
            n = await self._partitions(r.topic) or await self._ensure_topic(
                r.topic, default_partitions(r.topic))
            p = partition_for(r.key, n)
            if r.topic in self._lost or p not in (
                    await self._producer.partitions_for(r.topic) or ()):
                # the topic was deleted or recreated with fewer partitions meanwhile (as
                # the last ping found, or the producer's metadata says: aiokafka would
                # fail the send with a bare assertion, or some brokers create it anew)
                raise KafkaError(f"{r.topic} has no partition {p} on the brokers any more "
                                 f"(it had {n} partitions): the topic was deleted or "
                                 f"recreated under the running process")
            with refused_as_too_large(r):  # a client's request, not the brokers failing
                futures.append(await self._producer.send(
                    r.topic, bytes(r.value), key=r.key.encode("utf-8"), partition=p,
                    headers=_headers_out(r.headers)))
        out = []
        for r, fut in zip(records, futures):
            with refused_as_too_large(r):  # the brokers' limit may be lower than the producer's
                md = await fut
            ts = md.timestamp / 1000.0 if md.timestamp and md.timestamp > 0 else time.time()
            out.append(Record(r.topic, md.partition, md.offset, r.key, bytes(r.value),
                              dict(r.headers), ts))
        return out

    def read(self, topic: str, partition: int, offset: int, limit: int = 100,
             timeout: float = 5.0) -> list[Record]:
        """Up to ``limit`` records of (``topic``, ``partition``) from ``offset``, in order;
        [] at the end (or after ``timeout`` seconds without a fetch answer)."""
        if limit <= 0:
            return []
        return self._loop.run(self._read(TopicPartition(topic, partition), offset, limit,
                                         timeout))

    async def _read(self, tp: TopicPartition, offset: int, limit: int,
                    timeout: float) -> list[Record]:
        async with self._lock:
            c = self._reader
            if tp not in c.assignment():
                c.assign([tp])
                self._reader_next = {}
            if self._reader_next.get(tp) != offset:
                c.seek(tp, offset)
                self._reader_next[tp] = offset
            deadline = time.monotonic() + timeout
            # The end is known only from a Fetch *sent* after this call began: a high
            # watermark from an earlier one may predate a record just produced. The
            # second response processed since the start is such a one.
            since_ms, first_ms = time.time() * 1000, None
            while True:
                got = (await c.getmany(tp, timeout_ms=50, max_records=limit)).get(tp, [])
                if got:
                    self._reader_next[tp] = got[-1].offset + 1
                    return [record_of(m) for m in got]
                polled = c.last_poll_timestamp(tp)
                if polled is not None and polled >= since_ms:
                    first_ms = polled if first_ms is None else first_ms
                    hw = c.highwater(tp)
                    if polled > first_ms and hw is not None and hw <= offset:
                        return []
                if time.monotonic() > deadline:
                    return []

    def end_offset(self, topic: str, partition: int) -> int:
        """The high watermark of (``topic``, ``partition``): the offset the next record
        will get, as the last Fetch response reported it (0 for an unknown topic)."""
        return self.end_offsets([(topic, partition)])[(topic, partition)]

    def end_offsets(self, partitions: Iterable[tuple[str, int]],
                    timeout: float | None = None) -> dict[tuple[str, int], int]:
        """High watermarks of several partitions with one fetch round. ``timeout``:
        seconds at most (None: the requests' own timeouts, 30 s and more with the
        brokers away), then ``aiokafka.errors.KafkaTimeoutError`` -- for a read that
        promises an answer within a bound."""
        tps = [TopicPartition(t, p) for t, p in partitions]
        if not tps:
            return {}
        if timeout is None:
            return self._loop.run(self._end_offsets(tps))
        try:
            return self._loop.run(asyncio.wait_for(self._end_offsets(tps), timeout))
        except TimeoutError as exc:  # cancelled on the loop: its reader lock is free
            raise KafkaTimeoutError(f"no high watermarks within {timeout:.1f}s") from exc

    async def _end_offsets(self, tps: list[TopicPartition]) -> dict[tuple[str, int], int]:
        # The high watermark is read from a Fetch response rather than ListOffsets:
        # it is what consumers see, and some Kafka-protocol brokers answer ListOffsets
        # LATEST with the last batch's base offset.
        known = [tp for tp in tps if await self._partitions(tp.topic) > tp.partition]
        out = {(tp.topic, tp.partition): 0 for tp in tps}
        if not known:
            return out
        async with self._lock:
            c = self._reader
            c.assign(known)  # fresh partition states: highwater() is None until a fetch
            self._reader_next = {}
            try:
                starts = await c.end_offsets(known)
            except KafkaError:
                starts = {}
            for tp in known:
                c.seek(tp, starts.get(tp, 0))
            deadline = time.monotonic() + 10.0
            while any(c.highwater(tp) is None for tp in known):
                if time.monotonic() > deadline:
                    raise KafkaError("no fetch answer for the high watermarks")
                await c.getmany(*known, timeout_ms=20, max_records=1)
            for tp in known:
                out[(tp.topic, tp.partition)] = c.highwater(tp)
        return out

    def edge_keys(self, topics: Sequence[str], timeout: float = 10.0
                  ) -> dict[tuple[str, int], list[str]]:
        """The keys of the first and the last record of every partition of ``topics``:
        (topic, partition) → [first key, last key] (an empty partition is left out, and
        so is one whose records do not arrive within ``timeout`` seconds). Two fetch
        rounds over all the partitions at once, whatever the log's length: what
        :func:`mneme.bus.topics.check` compares with each key's partition."""
        return self._loop.run(self._edge_keys(list(topics), timeout))

    async def _edge_keys(self, topics: list[str], timeout: float
                         ) -> dict[tuple[str, int], list[str]]:
        tps = [TopicPartition(t, p) for t in topics for p in range(await self._partitions(t))]
        ends = await self._end_offsets(tps)
        live = [tp for tp in tps if ends[(tp.topic, tp.partition)] > 0]
        out: dict[tuple[str, int], list[str]] = {}
        if not live:
            return out
        async with self._lock:
            c = self._reader
            c.assign(live)
            self._reader_next = {}
            try:
                starts = await c.beginning_offsets(live)
            except KafkaError:
                starts = {}
            for last in (False, True):
                for tp in live:
                    start = starts.get(tp, 0)
                    c.seek(tp, max(start, ends[(tp.topic, tp.partition)] - 1) if last
                           else start)
                got: dict[TopicPartition, bytes | None] = {}
                deadline = time.monotonic() + timeout
                while len(got) < len(live) and time.monotonic() < deadline:
                    for tp, msgs in (await c.getmany(timeout_ms=50)).items():
                        if msgs and tp not in got:  # the first one at the seek offset
                            got[tp] = msgs[0].key
                for tp, key in got.items():
                    out.setdefault((tp.topic, tp.partition), []).append(
                        (key or b"").decode("utf-8", "replace"))
        return out

    # ---- consumer groups ---------------------------------------------------------

    async def _group_client(self, group: str) -> AIOKafkaConsumer:
        c = self._groups.get(group)
        if c is None:  # never subscribes, so it never joins the group
            c = AIOKafkaConsumer(**self._common(), group_id=group, enable_auto_commit=False)
            await c.start()
            self._groups[group] = c
        return c

    def committed(self, group: str, topic: str, partition: int,
                  timeout: float | None = None) -> int:
        """``group``'s committed next offset on (``topic``, ``partition``) (OffsetFetch);
        0 when it never committed there. ``timeout``: seconds at most, then
        ``aiokafka.errors.KafkaTimeoutError`` (as :meth:`end_offsets`)."""
        fetch = self._committed(group, TopicPartition(topic, partition))
        if timeout is None:
            return self._loop.run(fetch)
        try:
            return self._loop.run(asyncio.wait_for(fetch, max(0.0, timeout)))
        except TimeoutError as exc:
            raise KafkaTimeoutError(f"no committed offset within {timeout:.1f}s") from exc

    async def _committed(self, group: str, tp: TopicPartition) -> int:
        c = await self._group_client(group)
        off = await c.committed(tp)
        return 0 if off is None or off < 0 else off

    def commit(self, group: str, offsets: dict[tuple[str, int], int],
               produce: Sequence[OutRecord] = ()) -> list[Record]:
        """Produce ``produce`` (acks=all), *then* commit ``offsets`` for ``group``: at
        least once. A member of ``group`` in this process commits as that member;
        otherwise this is a "simple" commit, which Kafka accepts only while the group
        has no active members. Raises :class:`mneme.bus.StaleCommitError` when Kafka
        refuses the commit (a rebalance moved the partitions; the outputs are already
        produced and will be produced again by the new owner, with the same ids).

        Stale-commit guard (the embedded log's rule): before producing, the group's
        committed offsets are fetched (OffsetFetch); an offset below the committed one,
        or equal to it while ``produce`` is non-empty, raises StaleCommitError with
        nothing produced or committed. Without transactions a race remains: another
        client committing between that fetch and this OffsetCommit is not seen, so both
        produce their outputs (same ids; consumers are idempotent) and the later commit
        wins, even if lower. Raises ValueError
        for a negative offset."""
        produce = list(produce)
        if any(off < 0 for off in offsets.values()):
            raise ValueError(f"negative offset in {offsets!r}")

        async def _stored() -> list[tuple[tuple[str, int], int, int]]:
            return [(tp, off, await self._committed(group, TopicPartition(*tp)))
                    for tp, off in offsets.items()]
        for (t, p), off, stored in self._loop.run(_stored()) if offsets else ():
            # stored 0 is also "never committed" (and what reset_group stores): free
            if off < stored or (off == stored and produce and stored > 0):
                raise StaleCommitError(
                    f"group {group!r} is at offset {stored} on {t}[{p}]; refusing commit "
                    f"of {off}" + (" with records" if produce else ""))
        out = self.append(produce)
        self._loop.run(self._simple_commit(group, offsets))
        return out

    async def _simple_commit(self, group: str, offsets: dict[tuple[str, int], int]) -> None:
        if not offsets:
            return
        c = await self._group_client(group)
        tps = {TopicPartition(t, p): off for (t, p), off in offsets.items()}
        c.assign(list(tps))
        try:
            await c.commit(tps)
        except (CommitFailedError, IllegalStateError) as exc:
            raise StaleCommitError(f"group {group!r} refused the commit (is it running? "
                                   f"stop its consumers first): {exc}") from exc

    def reset_group(self, group: str, topics: Sequence[str] | None = None) -> None:
        """Set ``group``'s offsets on every partition of ``topics`` (default: mneme's
        topics) to 0, so it re-reads from the beginning (replay). Kafka accepts this only
        while the group has no active members: raises StaleCommitError otherwise."""
        offsets = {}
        for t in topics if topics is not None else ALL_TOPICS:
            for p in range(self.partitions(t)):
                offsets[(t, p)] = 0
        self._loop.run(self._simple_commit(group, offsets))

    def groups(self, live_only: bool = False) -> list[str]:
        """Ids of the consumer groups the brokers know (ListGroups: live ones and those
        with committed offsets), sorted; with ``live_only`` only those that have members
        now (DescribeGroups), e.g. not a removed replica's own groups."""
        return self._loop.run(self._group_ids(live_only))

    async def _group_ids(self, live_only: bool) -> list[str]:
        # list_consumer_groups gives (group id, protocol type) tuples
        ids = sorted({g[0] for g in await self._admin.list_consumer_groups()} - {""})
        if not live_only or not ids:
            return ids
        try:
            live = await self._with_members(ids)
        except Exception:  # one group's answer the client cannot read: ask one by one
            live = set()
            for i in ids:
                try:
                    live |= await self._with_members([i])
                except Exception:  # unknown: counted live rather than hidden
                    live.add(i)
        return [i for i in ids if i in live]

    async def _with_members(self, ids: list[str]) -> set[str]:
        """Those of ``ids`` that have members now (DescribeGroups)."""
        live = set()
        for resp in await self._admin.describe_consumer_groups(ids):
            for g in resp.groups:  # (error, id, state, protocol type, protocol, members, …)
                if len(g) > 5 and g[5]:
                    live.add(g[1])
        return live

    def group_offsets(self, group: str, topics: Iterable[str] = ALL_TOPICS
                      ) -> dict[tuple[str, int], int]:
        """``group``'s committed next offsets on every partition of ``topics``."""
        return {(t, p): self.committed(group, t, p)
                for t in topics for p in range(self.partitions(t))}

    def lag(self, group: str, topics: Iterable[str]) -> dict[tuple[str, int], int]:
        """High watermark − committed offset per partition of ``topics`` for ``group``."""
        tps = [(t, p) for t in topics for p in range(self.partitions(t))]
        ends = self.end_offsets(tps)
        return {tp: max(0, ends[tp] - self.committed(group, *tp)) for tp in tps}

    # ---- lifecycle ---------------------------------------------------------------

    def close(self) -> None:
        """Flush the producer and close the connections."""
        if self._closed:
            return
        self._closed = True

        async def _close() -> None:
            for c in [*self._groups.values(), self._reader]:
                with contextlib.suppress(Exception):
                    await c.stop()
            with contextlib.suppress(Exception):
                await self._producer.stop()
            with contextlib.suppress(Exception):
                await self._admin.close()
            with contextlib.suppress(Exception):
                await self._meta.close()
        try:
            self._loop.run(_close(), 30)
        finally:
            self._loop.stop()

    def __enter__(self) -> "KafkaEventLog":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"KafkaEventLog({self.bootstrap_servers!r})"


def _check(r: OutRecord) -> None:
    if not isinstance(r.topic, str) or not r.topic:
        raise TypeError(f"record topic must be a non-empty str, got {r.topic!r}")
    if not isinstance(r.key, str):
        raise TypeError(f"record key must be str, got {type(r.key).__name__}")
    if not isinstance(r.value, (bytes, bytearray, memoryview)):
        raise TypeError(f"record value must be bytes, got {type(r.value).__name__}")
    for k, v in r.headers.items():
        if not isinstance(k, str) or not isinstance(v, str):
            raise TypeError(f"record headers must be str -> str, got {k!r}: {v!r}")


def open_kafka(url: str, **overrides) -> KafkaEventLog:
    """A :class:`KafkaEventLog` for ``kafka://host:port[,host:port][?opt=value]``.
    Options (query string or keyword ``overrides``, the latter winning) are the fields of
    :class:`KafkaOptions`. Raises ValueError for a bad URL or unknown option."""
    servers, query = parse_kafka_url(url)
    fields = KafkaOptions.__dataclass_fields__
    opts: dict = {}
    for k, v in {**query, **{k: v for k, v in overrides.items() if v is not None}}.items():
        if k not in fields:
            raise ConfigurationError(f"unknown kafka option {k!r} (known: {', '.join(fields)})")
        kind = fields[k].type
        if isinstance(v, str) and kind in ("int", "float", "bool"):
            v = (v.lower() in ("1", "true", "yes")) if kind == "bool" else \
                (int(v) if kind == "int" else float(v))
        opts[k] = v
    return KafkaEventLog(servers, KafkaOptions(**opts))


__all__ = ["KafkaEventLog", "KafkaOptions", "open_kafka", "parse_kafka_url", "record_of"]
