"""Consumer runner: one consumer group over a set of topics on an EventLog, in a thread.

For each partition the runner reads a batch from the group's position, decodes each
record (:func:`mneme.bus.codec.decode`), calls the handler, and commits the next offset
together with every record the handler returned (``EventLog.commit``: one transaction
on the embedded log, so effects on the log are exactly once). Records of one partition
are handled strictly in offset order; partitions are visited round robin.

Failure policy (per record):

* unknown ``ce_type`` (``Envelope.message`` is None) → skipped, committed;
* undecodable payload → dead-lettered at once (retrying cannot help);
* handler raises → the batch prefix already handled is committed, then the record is
  retried with exponential backoff (``max_attempts`` in all); if it still fails it is
  dead-lettered (:mod:`mneme.bus.dead_letter`: the DLQ copy, and the failed progress of
  its operation) in the same transaction that commits its offset.
  A record that still fails for want of disk space or open files, or because a store
  server does not answer (:func:`mneme.errors.held_back`), is not dead-lettered: the
  pass stops (:class:`ShortOfResources`) and the record is handled again after the
  backoff below, until there is room or the store is back.

When the log itself fails (a read or commit raises, e.g. the embedded log is damaged),
the runner backs off exponentially up to ``error_backoff_max`` seconds and logs the
failure once per streak (then every tenth time), rather than spinning.

Handlers run again after a crash for records whose batch was not committed yet, so their
side effects outside the log (projections) must be idempotent upserts (DESIGN §3).

Writes a handler makes outside the log may become durable only when flushed (a store's
``flush()``, :attr:`mneme.router.Group.durable`): before every commit the runner calls
``flush`` (a Router's :meth:`~mneme.router.Router.flush`), once per committed batch, not
per record. A flush that raises commits nothing: the position stays where it was, the
runner backs off as after a failure of the log (``stats["flush_failures"]``), and the
records are read and handled again (idempotently) before the next try.

The runner reads every partition of its topics and keeps the group's offsets on the log
itself (:class:`LogMember`): it runs the embedded topology, and replay on either log.
Consumer groups shared by several processes run on Kafka through FastStream instead
(:mod:`mneme.runtime.kafka`), where Kafka assigns the partitions.
"""

from __future__ import annotations

import logging
import threading
import time
from typing import Callable, Iterable, Sequence

import tenacity
from google.protobuf.message import Message

from mneme import deadline, retry, telemetry
from mneme.bus import DLQ, StaleCommitError, dead_letter, default_partitions
from mneme.bus.codec import Envelope, decode
from mneme.bus.sealing import check_opened, erased_record
from mneme.errors import Cancelled, held_back
from mneme.ports import EventLog, OutRecord, Record

log = logging.getLogger(__name__)

#: ``handler(envelope, record) -> records to produce`` (None means none).
Handler = Callable[[Envelope, Record], "Sequence[OutRecord] | None"]

#: Seconds between the consumer's own reads of its lag (:meth:`Consumer.lag_snapshot`).
LAG_REFRESH_S = 1.0


class FlushFailed(RuntimeError):
    """The handler's writes could not be made durable, so their offsets were not
    committed (the records are handled again)."""


class ShortOfResources(RuntimeError):
    """A record's handler still failed for want of disk space or open files, or of a
    store server that does not answer, after its retries (:func:`mneme.errors.held_back`):
    the pass stops there, nothing of
    the record is committed, and the record is handled again after a backoff. Such a
    failure is the process's, not the record's: dead-lettering it would fail its
    operation and leave its effects out of the projections for good."""


class LogMember:
    """A consumer group's view of a log without partition assignment: every partition
    of ``topics``, offsets read and committed with ``EventLog.commit`` (one transaction
    with the outputs on the embedded log)."""

    def __init__(self, log_: EventLog, group: str, topics: Sequence[str]) -> None:
        self.log, self.group, self.topics = log_, group, tuple(topics)

    def assignments(self) -> list[tuple[str, int]]:
        """Every (topic, partition) of the topics."""
        return [(t, p) for t in self.topics for p in range(self.log.partitions(t))]

    def read(self, topic: str, partition: int, offset: int, limit: int) -> list[Record]:
        return self.log.read(topic, partition, offset, limit)

    def token(self):
        """A change token to pass to :meth:`wait` (taken before a pass reads)."""
        fn = getattr(self.log, "change_token", None)
        return fn() if fn is not None else None

    def wait(self, timeout: float, token=None, stop: threading.Event | None = None) -> bool:
        """Block up to ``timeout`` seconds for an append (polling when the log cannot
        signal one)."""
        fn = getattr(self.log, "wait_for_append", None)
        if fn is not None:
            return fn(timeout, token)
        (stop or threading.Event()).wait(timeout)
        return False

    def committed(self, topic: str, partition: int) -> int:
        return self.log.committed(self.group, topic, partition)

    def commit(self, offsets: dict[tuple[str, int], int],
               produce: Sequence[OutRecord] = ()) -> list[Record]:
        return self.log.commit(self.group, offsets, produce=produce)


class Consumer:
    """Runs consumer group ``group`` over ``topics`` of ``log`` in a background thread.

    ``handler(envelope, record)`` returns the records to produce (see :data:`Handler`;
    a :class:`mneme.router.Router` is one). ``fails_operation(message)``: whether a dead
    letter of that message fails its operation (default yes; a Router's
    :meth:`~mneme.router.Router.fails_operation` answers for its group).
    ``batch_size``: records read and committed at once per partition.
    ``max_attempts``: handler calls per record before it is dead-lettered (>= 1);
    retry *n* waits ``min(backoff * 2**(n-1), backoff_max)`` seconds.
    ``idle_wait``: seconds to block waiting for appends when caught up (the log's
    ``wait_for_append`` wakes it earlier; logs without one are polled at this period).
    ``error_backoff_max``: cap in seconds of the exponential backoff after the log itself
    fails (n failures in a row wait ``min(backoff * 2**n, error_backoff_max)``).
    ``flush``: called before every commit to make the handler's writes durable (default:
    the handler's own ``flush`` when it has one, as a Router does; else nothing). When it
    raises, nothing is committed and the pass fails with :class:`FlushFailed` (the
    background thread backs off as above; a caller of :meth:`run_once` sees it).

    The consumer creates missing topics (and the DLQ) with
    :func:`mneme.bus.default_partitions`. One Consumer per group per process. On Kafka
    the group's partitions are spread over the processes running it (see the module
    docstring); the embedded log has no partition assignment, so two live consumers of
    one group would both read every partition (the log's stale-commit check keeps their
    outputs from being duplicated, at the cost of wasted work).
    """

    def __init__(self, log: EventLog, group: str, topics: Iterable[str], handler: Handler, *,
                 batch_size: int = 100, max_attempts: int = 3, backoff: float = 0.05,
                 backoff_max: float = 2.0, idle_wait: float = 1.0,
                 dlq_topic: str = DLQ, error_backoff_max: float = 30.0,
                 fails_operation: Callable[[Message], bool] | None = None,
                 flush: Callable[[], None] | None = None) -> None:
        if batch_size < 1:
            raise ValueError(f"batch_size must be >= 1, got {batch_size}")
        if max_attempts < 1:
            raise ValueError(f"max_attempts must be >= 1, got {max_attempts}")
        self.log = log
        self.group = group
        self.topics = tuple(dict.fromkeys(topics))
        if not self.topics:
            raise ValueError("a consumer needs at least one topic")
        self.handler = handler
        self.batch_size = batch_size
        self.max_attempts = max_attempts
        self.backoff = backoff
        self.backoff_max = backoff_max
        self.idle_wait = idle_wait
        self.dlq_topic = dlq_topic
        self._fails_operation = fails_operation or (lambda m: True)
        if flush is None:
            flush = getattr(handler, "flush", None)
        self._flush = flush if callable(flush) else (lambda: None)
        self._until_stopped = deadline.Deadline(None, lambda: not self._stop.is_set())
        self._lag_snapshot: dict[tuple[str, int], int] = {}
        self._lag_at = float("-inf")
        #: False: commit offsets only, produce nothing, dead letters included (replay:
        #: everything the handlers would produce is on the log already).
        self.produce = True
        #: (topic, partition) → offset to stop before (None: no bound; a partition not
        #: named is not read): a replay catching up to exactly where another consumer is.
        self.until: dict[tuple[str, int], int] | None = None
        self.error_backoff_max = error_backoff_max
        #: Counters: handled, skipped, dead_lettered, retries, stale_commits, errors,
        #: flush_failures (flushes that raised: those commits were not made).
        self.stats = dict.fromkeys(
            ("handled", "skipped", "dead_lettered", "retries", "stale_commits", "errors",
             "flush_failures"), 0)
        #: The last exception the run loop caught (log or commit failure), if any.
        self.last_error: BaseException | None = None
        self._positions: dict[tuple[str, int], int] = {}
        self._busy = False           # a batch is being handled (wait_idle is not idle)
        self._cond = threading.Condition()  # notified after every pass / commit
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._topics_ready = False
        self._member = None
        telemetry.track_consumer(self)  # mneme.consumer.lag while it runs

    @property
    def member(self) -> LogMember:
        """This consumer's view of its group on the log (topics created on first use)."""
        if self._member is None:
            self._ensure_topics()
            self._member = LogMember(self.log, self.group, self.topics)
        return self._member

    # ---- lifecycle ---------------------------------------------------------------

    def start(self) -> "Consumer":
        """Start the background thread (named ``consumer-<group>``); returns self.
        Raises RuntimeError when already running."""
        if self._thread is not None and self._thread.is_alive():
            raise RuntimeError(f"consumer {self.group!r} is already running")
        self._stop.clear()
        self._ensure_topics()
        self._refresh_lag(force=True)
        self._thread = threading.Thread(target=self._run, name=f"consumer-{self.group}",
                                        daemon=True)
        self._thread.start()
        return self

    def stop(self, timeout: float | None = 10.0) -> bool:
        """Ask the thread to stop after the record in hand, commit what it handled and
        join it. A record waiting for a retry is abandoned uncommitted (it is handled
        again on the next start). Returns True when the thread ended within ``timeout``
        seconds."""
        self._stop.set()
        wake = getattr(self.log, "wake", None)
        if wake is not None:
            wake()
        thread = self._thread
        if thread is None:
            return True
        thread.join(timeout)
        if thread.is_alive():
            return False
        self._thread = None
        return True

    @property
    def running(self) -> bool:
        """True while the background thread is alive."""
        return self._thread is not None and self._thread.is_alive()

    def __enter__(self) -> "Consumer":
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    # ---- progress ----------------------------------------------------------------

    def assignments(self) -> list[tuple[str, int]]:
        """The (topic, partition)s this consumer reads: every partition of its topics."""
        return self.member.assignments()

    def lag(self) -> dict[tuple[str, int], int]:
        """Records not yet committed by the group, per (topic, partition) of every
        partition of its topics (not only this process's): end offset − committed
        offset, read from the log, so other processes' commits count too."""
        tps = [(t, p) for t in self.topics for p in range(self.log.partitions(t))]
        ends = _end_offsets(self.log, tps)
        return {tp: max(0, ends[tp] - self.log.committed(self.group, *tp)) for tp in tps}

    def lag_snapshot(self) -> dict[tuple[str, int], int]:
        """:meth:`lag` as of at most :data:`LAG_REFRESH_S` ago, read by the consumer's own
        thread ({} before the first read): metric scrapes, which run on threads of their
        own, never touch the log."""
        return self._lag_snapshot

    def _refresh_lag(self, force: bool = False) -> None:
        now = time.monotonic()
        if force or now - self._lag_at >= LAG_REFRESH_S:
            self._lag_at = now
            try:
                self._lag_snapshot = self.lag()
            except Exception:  # the log is busy or away: keep the last values
                pass

    def wait_idle(self, timeout: float = 10.0) -> bool:
        """Block until the consumer has handled and committed everything up to the end
        offsets of all its partitions as of each check; True when caught up, False after
        ``timeout`` seconds. Useful in tests and after a replay."""
        deadline = time.monotonic() + timeout
        while True:
            if self._caught_up():
                return True
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                return False
            with self._cond:
                self._cond.wait(min(remaining, 0.05))

    def _caught_up(self) -> bool:
        member = self.member
        with self._cond:
            if self._busy:
                return False
            positions = dict(self._positions)
        tps = member.assignments()
        ends = _end_offsets(self.log, tps)
        for t, p in tps:
            pos = positions.get((t, p))
            if pos is None:
                pos = member.committed(t, p)
            if pos < ends[(t, p)]:
                return False
        return True

    # ---- the loop ----------------------------------------------------------------

    def _ensure_topics(self) -> None:
        if self._topics_ready:
            return
        for t in (*self.topics, self.dlq_topic):
            if self.log.partitions(t) == 0:
                self.log.ensure_topic(t, default_partitions(t))
        self._topics_ready = True

    def _run(self) -> None:
        member = self.member
        failures, held = 0, False
        while not self._stop.is_set():
            token = None
            self._refresh_lag()
            try:
                token = member.token()
                n = self.run_once()
                if failures and held:
                    log.warning("consumer %s: records handled again after %d held-back "
                                "passes", self.group, failures)
                elif failures:
                    log.warning("consumer %s: the log answers again after %d failures",
                                self.group, failures)
                failures = 0
            except Exception as exc:  # the log itself failed, or a record is held back
                failures += 1
                held = isinstance(exc, ShortOfResources)
                self.stats["errors"] += 1
                self.last_error = exc
                delay = retry.backoff(self.backoff, self.error_backoff_max).delay(failures + 1)
                if held and (failures == 1 or failures % 10 == 0):
                    # the server's shortage or a store away, not the log: no traceback
                    log.error("%s (held back %d time(s), next try in %.1fs)", exc, failures,
                              delay)
                elif failures == 1:
                    log.exception("consumer %s: pass failed; backing off", self.group)
                elif failures % 10 == 0:  # a damaged log: say so now and then, not always
                    log.error("consumer %s: pass failed (%d in a row, next try in %.1fs): %s",
                              self.group, failures, delay, exc)
                with self._cond:  # re-read committed offsets: the batch may be lost
                    self._positions.clear()
                self._stop.wait(delay)
                continue
            if n == 0 and not self._stop.is_set():
                try:
                    member.wait(self.idle_wait, token, self._stop)
                except Exception as exc:  # broker unreachable: back off, keep going
                    self.last_error = exc
                    self._stop.wait(self.backoff_max)

    def run_once(self) -> int:
        """One pass: handle at most ``batch_size`` records of every partition. Returns
        the number of records handled (including skipped and dead-lettered ones). Runs
        in the caller's thread; do not call it while the background thread runs."""
        self._ensure_topics()
        total = 0
        try:
            for t, p in self.member.assignments():
                if self._stop.is_set() and total:
                    break
                total += self._process(t, p)
        finally:
            with self._cond:
                self._busy = False
                self._cond.notify_all()
        return total

    def _position(self, topic: str, partition: int) -> int:
        pos = self._positions.get((topic, partition))
        if pos is None:
            pos = self.member.committed(topic, partition)
            with self._cond:
                self._positions[(topic, partition)] = pos
        return pos

    def _process(self, topic: str, partition: int) -> int:
        member = self.member
        start = self._position(topic, partition)
        limit = self.batch_size
        if self.until is not None:
            limit = min(limit, self.until.get((topic, partition), 0) - start)
            if limit <= 0:
                return 0
        records = member.read(topic, partition, start, limit)
        if not records:
            return 0
        with self._cond:
            self._busy = True
        base = start                  # first offset not yet committed
        next_off = start              # offset after the last handled record
        outputs: list[OutRecord] = []
        handled = 0
        for rec in records:
            try:
                check_opened(rec)
                env = decode(rec)
            except Exception as exc:  # corrupt payload: retries cannot help
                outs = self._dead_letter(rec, exc, attempts=0, env=None)
            else:
                if env.message is None or erased_record(rec):  # erased: keys destroyed
                    self.stats["skipped"] += 1
                    outs = []
                else:
                    try:
                        outs = self._call(env, rec)
                    except Exception as exc:
                        # Commit the handled prefix first, so a crash or stop while this
                        # record is retried loses none of the work before it.
                        if next_off > base:
                            if not self._commit(topic, partition, next_off, outputs):
                                return handled
                            base, outputs = next_off, []
                        if isinstance(exc, Cancelled) and self._stop.is_set():
                            return handled  # stopped mid-record: left uncommitted
                        outs = self._retry(env, rec, exc)
                        if outs is None:  # stop requested while backing off
                            return handled
            outputs.extend(outs)
            next_off = rec.offset + 1
            handled += 1
            if self._stop.is_set():
                break
        if next_off > base:
            self._commit(topic, partition, next_off, outputs)
        return handled

    def _call(self, env: Envelope, rec: Record) -> list[OutRecord]:
        # A span per record, child of the record's traceparent: what the handler appends
        # (its outputs, encoded inside the span) carries this span's context onwards.
        # Long handlers see the stop request as a cancelled call (mneme.deadline.current):
        # they stop between steps, and the record is handled again on the next start.
        with telemetry.consume_span(self.group, rec, env), deadline.bind(self._until_stopped):
            result = self.handler(env, rec)
        outs = list(result or [])
        for o in outs:  # a bad output must fail the handler, not the commit, forever
            if not isinstance(o, OutRecord):
                raise TypeError(f"handler returned {type(o).__name__}, expected OutRecord")
            if not isinstance(o.key, str) or not isinstance(o.value, (bytes, bytearray)):
                raise TypeError(f"handler returned a record with key {type(o.key).__name__}"
                                f" and value {type(o.value).__name__} (need str, bytes)")
            if not all(isinstance(k, str) and isinstance(v, str) for k, v in o.headers.items()):
                raise TypeError("handler returned a record with non-str headers")
        self.stats["handled"] += 1
        return outs

    def _retry(self, env: Envelope, rec: Record, exc: Exception) -> list[OutRecord] | None:
        """Retry ``rec`` up to ``max_attempts`` in all (the first, failed with ``exc``,
        included); its outputs, a dead letter, or None when stop was requested meanwhile."""
        first = [exc]

        def attempt() -> list[OutRecord]:
            if first:  # the attempt already made: its failure starts the policy
                raise first.pop()
            if self._stop.is_set():
                raise Cancelled("stopping")
            self.stats["retries"] += 1
            return self._call(env, rec)

        def warn(state: tenacity.RetryCallState) -> None:
            log.warning("consumer %s: %s failed (attempt %d/%d): %s", self.group,
                        dead_letter.describe(rec, env), state.attempt_number,
                        self.max_attempts, dead_letter.error_text(state.outcome.exception(), env))

        stopping = lambda e: isinstance(e, Cancelled) and self._stop.is_set()  # noqa: E731
        policy = tenacity.Retrying(
            stop=tenacity.stop_after_attempt(self.max_attempts),
            wait=retry.backoff(self.backoff, self.backoff_max),
            sleep=tenacity.sleep_using_event(self._stop),
            retry=tenacity.retry_if_exception(lambda e: not stopping(e)),
            before_sleep=warn, reraise=True)
        try:
            return policy(attempt)
        except Exception as last:
            if stopping(last):
                return None
            short = held_back(last)
            if short is not None:
                raise ShortOfResources(
                    f"consumer {self.group}: {dead_letter.describe(rec, env)} held back for "
                    f"want of {short}, handled again later: "
                    f"{dead_letter.error_text(last, env)}") from last
            return self._dead_letter(rec, last, attempts=self.max_attempts, env=env)

    def _dead_letter(self, rec: Record, exc: BaseException, attempts: int,
                     env: Envelope | None) -> list[OutRecord]:
        self.stats["dead_lettered"] += 1
        return dead_letter.records(rec, exc, attempts, self.group, env, dlq_topic=self.dlq_topic,
                                   fails_operation=self._fails_operation)

    def _commit(self, topic: str, partition: int, next_off: int,
                outputs: Sequence[OutRecord]) -> bool:
        """Flush the handler's writes, then commit ``next_off`` with ``outputs``; False
        when the log refused it as stale (another consumer of the group got there first:
        carry on from its offset). :class:`FlushFailed` when the flush raised (nothing
        committed; the position stays where it was)."""
        try:
            self._flush()
        except Exception as exc:
            self.stats["flush_failures"] += 1
            raise FlushFailed(f"consumer {self.group}: cannot make the writes of "
                              f"{topic}[{partition}] up to offset {next_off} durable; "
                              f"not committed: {exc!r}") from exc
        try:
            self.member.commit({(topic, partition): next_off},
                               produce=outputs if self.produce else ())
        except StaleCommitError as exc:
            self.stats["stale_commits"] += 1
            log.warning("consumer %s: %s; re-reading the committed offset", self.group, exc)
            with self._cond:
                self._positions.pop((topic, partition), None)
            return False
        with self._cond:
            self._positions[(topic, partition)] = next_off
            self._cond.notify_all()
        return True


def _end_offsets(log_: EventLog, tps: list[tuple[str, int]]) -> dict[tuple[str, int], int]:
    """End offsets of ``tps``, in one round when the log can (Kafka)."""
    fn = getattr(log_, "end_offsets", None)
    if fn is not None:
        return fn(tps)
    return {tp: log_.end_offset(*tp) for tp in tps}


__all__ = ["Consumer", "FlushFailed", "Handler", "LogMember", "ShortOfResources"]
