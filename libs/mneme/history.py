"""Reading mneme's event history from outside: open the sealed user content of records
taken from the topics (your own Kafka consumer) or the embedded log, with data keys
fetched from the KeyService (``BatchGetDataKeys``).

    with MnemeClient("mneme:50051", api_key=HISTORY_KEY) as m:
        opener = m.history_opener()
        for rec in consumer:                      # aiokafka / kafka-python / confluent
            event = opener.open(rec)
            if event.record_erased:
                continue                          # deleted content: nothing to read
            handle(event.message)                 # mneme.events.v1 message, opened

What :meth:`HistoryOpener.open` returns follows :class:`mneme.bus.sealing.Opener`: content
whose key is destroyed (its document, memory or bank was deleted) is *erased* -- a fact,
observation, entity or alias is dropped from its list, a retained item stays as an empty
placeholder listed in ``rejected_items`` with reason ``erased``, a reflection erases the
whole record -- and the event says how many elements were erased (``erased``,
``record_erased``; the opened record's header ``mneme-erased``).

Keys are cached (LRU, ``cache`` keys) for ``max_age_s`` seconds, found or missing: a
deletion reaches a long-running opener within that time (:meth:`RemoteKeys.forget` drops
them at once).
"""

from __future__ import annotations

import threading
import time
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any, Callable, Iterable, Sequence

from google.protobuf.message import DecodeError, Message

from mneme.bus.codec import message_class
from mneme.bus.sealing import ERASED_HEADER, Opener
from mneme.keys import KEY_BYTES, combine
from mneme.ports import Record

#: Key ids per BatchGetDataKeys call (the server's MNEME_LIMIT_KEY_IDS default).
BATCH = 1000

#: ``fetch(bank_id, key_ids) -> (found: {key_id: 32 bytes}, missing key ids)``.
Fetch = Callable[[str, Sequence[str]], tuple[dict[str, bytes], list[str]]]


class RemoteKeys:
    """A :class:`mneme.ports.SealKeys` over ``fetch`` (the KeyService): data keys by
    (bank, key id), fetched in batches of at most ``batch`` ids and cached (LRU of
    ``cache`` entries, each kept ``max_age_s`` seconds; a missing key is cached as
    missing too). Thread-safe. ``fetch`` errors (``grpc.RpcError``: PERMISSION_DENIED
    without the history scope, UNAVAILABLE, ...) propagate; ValueError for a key that is
    not 32 bytes."""

    def __init__(self, fetch: Fetch, cache: int = 100_000, max_age_s: float = 300.0,
                 batch: int = BATCH, clock: Callable[[], float] = time.monotonic) -> None:
        self.fetch, self.cache, self.max_age_s, self.batch = fetch, cache, max_age_s, batch
        self.clock = clock
        self._keys: OrderedDict[tuple[str, str], tuple[float, bytes | None]] = OrderedDict()
        self._lock = threading.Lock()
        #: BatchGetDataKeys calls made (for tests and metrics).
        self.calls = 0

    def _cached(self, bank_id: str, key_id: str, now: float):
        hit = self._keys.get((bank_id, key_id))
        if hit is None or now - hit[0] > self.max_age_s:
            return False, None
        self._keys.move_to_end((bank_id, key_id))
        return True, hit[1]

    def _lookup(self, bank_id: str, key_ids: Iterable[str], keep: bool
                ) -> dict[str, bytes | None]:
        """Fetch the ids of ``key_ids`` not cached (one call per ``batch`` ids) and cache
        them; with ``keep``, return every id's key (None: missing) as found or fetched
        here -- not re-read from the cache, which a seal naming more keys than it holds,
        or another thread's batch, may have evicted them from meanwhile."""
        now, out, wanted = self.clock(), {}, []
        with self._lock:
            for k in dict.fromkeys(key_ids):
                hit, key = self._cached(bank_id, k, now)
                if not hit:
                    wanted.append(k)
                elif keep:
                    out[k] = key
        for i in range(0, len(wanted), self.batch):
            chunk = wanted[i:i + self.batch]
            found, _missing = self.fetch(bank_id, chunk)
            for k, key in found.items():
                if len(key) != KEY_BYTES:
                    raise ValueError(f"data key {k!r} of bank {bank_id!r}: {len(key)} bytes, "
                                     f"expected {KEY_BYTES}")
            stamp = self.clock()
            with self._lock:
                self.calls += 1
                for k in chunk:  # an id the server did not answer counts as missing
                    self._keys[(bank_id, k)] = (stamp, found.get(k))
                    self._keys.move_to_end((bank_id, k))
                while len(self._keys) > self.cache:
                    self._keys.popitem(last=False)
            if keep:
                out.update((k, found.get(k)) for k in chunk)
        return out

    def prefetch(self, bank_id: str, key_ids: Iterable[str]) -> None:
        """Fetch the ids of ``key_ids`` not cached (one call per ``batch`` ids)."""
        self._lookup(bank_id, key_ids, keep=False)

    def keys(self, bank_id: str, key_ids: Sequence[str]) -> list[bytes] | None:
        """The data keys of ``key_ids`` in order, or None when any is destroyed/unknown."""
        got = self._lookup(bank_id, key_ids, keep=True)
        out = [got[k] for k in key_ids]
        return None if any(k is None for k in out) else out

    def combined(self, bank_id: str, key_ids: Sequence[str]) -> bytes | None:
        """The seal key over ``key_ids`` (:func:`mneme.keys.combine`), or None when any
        of them is destroyed or unknown (the content is erased)."""
        keys = self.keys(bank_id, key_ids)
        return combine(key_ids, keys) if keys is not None else None

    def forget(self, bank_id: str | None = None) -> None:
        """Drop the cached keys of ``bank_id`` (every bank's when None)."""
        with self._lock:
            if bank_id is None:
                self._keys.clear()
            else:
                for k in [k for k in self._keys if k[0] == bank_id]:
                    del self._keys[k]


@dataclass(frozen=True)
class OpenedEvent:
    """One record of the history, opened. ``message``: the ``mneme.events.v1`` message
    with its sealed content restored (None for a ``ce_type`` this SDK does not know:
    skip it); ``erased``: elements whose content was erased; ``record_erased``: nothing
    of the record can be read (skip it); ``record``: the opened record (its headers carry
    ``mneme-erased`` when something was erased)."""

    ce_type: str
    bank_id: str
    message: Message | None
    erased: int
    record_erased: bool
    record: Record


def _text(v: Any) -> str:
    if v is None:
        return ""
    return v.decode("utf-8", "replace") if isinstance(v, (bytes, bytearray, memoryview)) \
        else str(v)


def as_record(rec: Any) -> Record:
    """``rec`` as a :class:`mneme.ports.Record`: a Record itself, or a Kafka client's
    message -- attributes ``topic``/``partition``/``offset``/``key``/``value``/``headers``
    (aiokafka, kafka-python: headers as ``[(name, bytes)]``) or the same as methods
    (confluent-kafka)."""
    if isinstance(rec, Record):
        return rec

    def get(name: str, default=None):
        v = getattr(rec, name, default)
        return v() if callable(v) else v

    headers = get("headers") or ()
    items = headers.items() if isinstance(headers, dict) else headers
    value = get("value")
    return Record(topic=_text(get("topic")), partition=int(get("partition") or 0),
                  offset=int(get("offset") or 0), key=_text(get("key")),
                  value=bytes(value or b""), headers={str(k): _text(v) for k, v in items})


def _where(rec: Record) -> str:
    """The record's coordinates for an error: topic[partition]@offset (type)."""
    kind = rec.headers.get("ce_type") or "no ce_type"
    return f"{rec.topic or '(no topic)'}[{rec.partition}]@{rec.offset} ({kind})"


class HistoryOpener:
    """Opens records of mneme's history with keys from ``keys`` (a
    :class:`RemoteKeys`, or any :class:`mneme.ports.SealKeys`). Raises ValueError for a
    seal that does not authenticate (tampered or corrupt record) and
    ``google.protobuf.message.DecodeError`` for a value that is not its event, each
    naming the record (topic, partition, offset, type; the record is the exception's
    ``record``)."""

    def __init__(self, keys) -> None:
        self.keys = keys
        self._opener = Opener(keys)

    def open(self, record: Any) -> OpenedEvent:
        """The record (see :func:`as_record` for what is accepted) decoded and opened,
        the keys of all its seals fetched first (one BatchGetDataKeys per 1000 ids not
        cached, not one per sealed element)."""
        return self.open_all([record])[0]

    def _opened(self, rec: Record, msg: Message | None) -> OpenedEvent:
        try:
            return self._event(self._opener.open(rec, msg))
        except (DecodeError, ValueError) as e:
            err = type(e)(f"{_where(rec)}: {e}")
            err.record = rec
            raise err from e

    @staticmethod
    def _event(rec: Record) -> OpenedEvent:
        ce_type = rec.headers.get("ce_type", "")
        cls = message_class(ce_type)
        erased = rec.headers.get(ERASED_HEADER, "")
        return OpenedEvent(ce_type=ce_type, bank_id=rec.headers.get("ce_subject") or rec.key,
                           message=cls.FromString(rec.value) if cls is not None else None,
                           erased=1 if erased == "record" else int(erased or 0),
                           record_erased=erased == "record", record=rec)

    def open_value(self, ce_type: str, bank_id: str, value: bytes) -> OpenedEvent:
        """Open a value read without its record: its ``ce_type`` header and bank id (the
        record key, or ``ce_subject``)."""
        return self.open(Record(topic="", partition=0, offset=0, key=bank_id, value=value,
                                headers={"ce_type": ce_type, "ce_subject": bank_id}))

    def open_all(self, records: Iterable[Any]) -> list[OpenedEvent]:
        """Open many records, fetching the keys they name first (one BatchGetDataKeys
        per bank and 1000 ids, when :attr:`keys` can prefetch)."""
        recs = [as_record(r) for r in records]
        msgs = self._opener.prefetch(recs)
        return [self._opened(r, m) for r, m in zip(recs, msgs)]


__all__ = ["BATCH", "HistoryOpener", "OpenedEvent", "RemoteKeys", "as_record"]
