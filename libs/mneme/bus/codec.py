"""Event codec: protobuf payloads with CloudEvents attributes in Kafka headers, and
conversions between the domain model and the event messages.

Wire format (CloudEvents Kafka protocol binding v1.0, *binary content mode*,
https://github.com/cloudevents/spec/blob/v1.0.2/cloudevents/bindings/kafka-protocol-binding.md):
the record value is the event data (protobuf bytes of a ``mneme.events.v1`` message); each
context attribute is a header ``ce_<attribute>``; the data content type is the
``content-type`` header; the record key is the partition key (``bank_id``). Headers::

    ce_specversion  "1.0"
    ce_id           uuid4, or the caller's deterministic id for derived events
    ce_type         "mneme.events.v1.<MessageName>"
    ce_source       the producing component, e.g. "mneme/extraction"
    ce_time         RFC 3339 UTC with microseconds, e.g. "2024-05-01T12:00:00.000000Z"
    ce_subject      the bank_id
    content-type    "application/protobuf"
    traceparent     W3C Trace Context (only when given)

The headers are written here rather than by the ``cloudevents`` SDK (2.2.0): it writes
``ce_time`` without the fraction when it is zero, ``traceparent`` as ``ce_traceparent``,
invents an id and a time for records without them (redelivery must keep both), and
decoded ~5x slower (measured for issue 10).

Float precision: ``Fact.embedding`` and ``Link.weight`` are ``float`` (IEEE float32) in
the proto, so domain → proto rounds them to float32. ``fact_from_pb(fact_to_pb(f)) == f``
holds exactly when those values are already float32-representable (embedders return
float32; use :func:`to_float32` when building facts by hand). proto → domain → proto is
always exact. ``BankConfig.dedup_threshold`` is a double and always exact. Times are
exact to the microsecond (``datetime`` resolution).
"""

from __future__ import annotations

import uuid
from array import array
from dataclasses import dataclass
from datetime import datetime, timedelta, timezone
from typing import Iterable

from google.protobuf import json_format
from google.protobuf.message import Message
from google.protobuf.timestamp_pb2 import Timestamp

from mneme import telemetry
from mneme.bus import AUDIT, INTAKE, MEMORY, PROGRESS, REFLECT
from mneme.domain import (MAX_EPOCH, MIN_EPOCH, BankConfig, EntityRef, Fact, Link, RetainItem,
                          clamp_time, utc)
from mneme.events.v1 import events_pb2
from mneme.ports import OutRecord, Record

SPECVERSION = "1.0"
CONTENT_TYPE = "application/protobuf"
TYPE_PREFIX = "mneme.events.v1."

#: Topic of each event type, by ``ce_type``.
TOPIC_OF_TYPE: dict[str, str] = {
    TYPE_PREFIX + m.DESCRIPTOR.name: topic
    for topic, messages in (
        (INTAKE, (events_pb2.BankUpserted, events_pb2.BankDeleted, events_pb2.DirectiveChanged,
                  events_pb2.MentalModelChanged,
                  events_pb2.RetainRequested, events_pb2.DocumentDeleteRequested,
                  events_pb2.MemoryDeleteRequested, events_pb2.ConsolidationRequested,
                  events_pb2.OperationCancelRequested, events_pb2.EntityMergeRequested,
                  events_pb2.EntitySplitRequested)),
        (MEMORY, (events_pb2.FactsExtracted, events_pb2.FactsRetracted,
                  events_pb2.ConsolidationScheduled, events_pb2.ObservationsChanged,
                  events_pb2.EntitiesResolved, events_pb2.OpinionsChanged,
                  events_pb2.EntitiesMerged, events_pb2.EntitySplit,
                  events_pb2.VectorsReplaced)),
        (PROGRESS, (events_pb2.OperationProgress,)),
        (REFLECT, (events_pb2.ReflectionRecorded,)),
        (AUDIT, (events_pb2.AuditRecorded,)),
    )
    for m in messages
}

_EPOCH = datetime(1970, 1, 1, tzinfo=timezone.utc)
_PROTOBUF_TYPES = {CONTENT_TYPE, "application/x-protobuf"}


@dataclass(frozen=True)
class Envelope:
    """A decoded event: the CloudEvents attributes and the payload.

    ``message`` is the ``mneme.events.v1`` protobuf, or None when ``type`` is not a type
    this code knows (consumers skip those: schemas evolve by adding types). ``time`` is
    an aware UTC datetime (None when the header is missing).
    """

    id: str
    type: str
    source: str
    time: datetime | None
    subject: str
    traceparent: str | None
    message: Message | None
    specversion: str = SPECVERSION
    content_type: str = CONTENT_TYPE


def event_type(message: Message | type[Message]) -> str:
    """The ``ce_type`` of a message (instance or class): "mneme.events.v1.<Name>"."""
    return TYPE_PREFIX + message.DESCRIPTOR.name


def topic_for(message: Message | type[Message]) -> str:
    """The topic a message type is published on. Raises ValueError for a message that is
    not a top-level event (e.g. ``Fact`` on its own)."""
    t = event_type(message)
    try:
        return TOPIC_OF_TYPE[t]
    except KeyError:
        raise ValueError(f"{t} is not an event type with a topic") from None


def format_time(dt: datetime) -> str:
    """RFC 3339 UTC timestamp with microseconds and a ``Z`` suffix."""
    return utc(dt).strftime("%Y-%m-%dT%H:%M:%S.%fZ")


def encode(event_msg: Message, *, bank_id: str, source: str, event_id: str | None = None,
           time: datetime | None = None, traceparent: str | None = None) -> OutRecord:
    """Wrap an event message as a record for its topic (see :data:`TOPIC_OF_TYPE`).

    ``bank_id`` is the record key (one bank's events keep their order) and ``ce_subject``;
    ``event_id`` defaults to a uuid4 (derived events pass a deterministic uuid5 so
    redelivery and replay give the same id); ``time`` defaults to now (UTC; naive values
    are taken as UTC). Raises ValueError for a message without a topic, an empty
    ``bank_id`` or ``source``, or a message whose own ``bank_id`` field disagrees.
    """
    topic = topic_for(event_msg)
    if not bank_id:
        raise ValueError("bank_id is required (it is the record key)")
    if not source:
        raise ValueError("source is required (ce_source)")
    own = getattr(event_msg, "bank_id", "")
    if own and own != bank_id:
        raise ValueError(f"message bank_id {own!r} differs from bank_id {bank_id!r}")
    headers = {
        "ce_specversion": SPECVERSION,
        "ce_id": event_id or str(uuid.uuid4()),
        "ce_type": event_type(event_msg),
        "ce_source": source,
        "ce_time": format_time(time or datetime.now(timezone.utc)),
        "ce_subject": bank_id,
        "content-type": CONTENT_TYPE,
    }
    # Inside a span (the gRPC call, the consumer's span of the causing record) the event
    # continues that span's trace; otherwise the given context is passed on as it is.
    traceparent = telemetry.current_traceparent() or traceparent
    if traceparent:
        headers["traceparent"] = traceparent
    return OutRecord(topic=topic, key=bank_id, value=event_msg.SerializeToString(),
                     headers=headers)


def message_class(ce_type: str) -> type[Message] | None:
    """The protobuf class of a ``ce_type``, or None when this code does not know it."""
    if not ce_type.startswith(TYPE_PREFIX):
        return None
    name = ce_type[len(TYPE_PREFIX):]
    if name not in events_pb2.DESCRIPTOR.message_types_by_name:
        return None
    return getattr(events_pb2, name)


def decode(record: Record) -> Envelope:
    """Read the CloudEvents headers and parse the payload of ``record``.

    Unknown or missing ``ce_type`` → ``message`` None. The payload is parsed as protobuf
    (``application/protobuf``, ``application/x-protobuf`` or no content-type) or as
    protobuf JSON (``application/json``, for hand-written external events).
    Raises ``google.protobuf.message.DecodeError`` / ``json_format.ParseError`` for a
    corrupt payload and ValueError for an unsupported content-type or a malformed
    ``ce_time``; consumers dead-letter those.
    """
    h = record.headers
    ce_type = h.get("ce_type", "")
    content_type = h.get("content-type", CONTENT_TYPE)
    raw_time = h.get("ce_time")
    message: Message | None = None
    cls = message_class(ce_type)
    if cls is not None:
        media = content_type.split(";", 1)[0].strip().lower()
        if media in _PROTOBUF_TYPES:
            message = cls.FromString(record.value)
        elif media == "application/json":
            message = json_format.Parse(bytes(record.value).decode("utf-8"), cls())
        else:
            raise ValueError(f"unsupported content-type {content_type!r} for {ce_type}")
    return Envelope(
        id=h.get("ce_id", ""),
        type=ce_type,
        source=h.get("ce_source", ""),
        time=utc(datetime.fromisoformat(raw_time)) if raw_time else None,
        subject=h.get("ce_subject", record.key),
        traceparent=h.get("traceparent"),
        message=message,
        specversion=h.get("ce_specversion", ""),
        content_type=content_type,
    )


# ---- domain <-> proto ----------------------------------------------------------------


def to_float32(values: Iterable[float]) -> list[float]:
    """``values`` rounded to the nearest IEEE float32 (what the proto ``float`` keeps)."""
    return array("f", values).tolist()


def timestamp_to_pb(dt: datetime) -> Timestamp:
    """Aware (or naive = UTC) datetime → ``google.protobuf.Timestamp``, exact to the
    microsecond (integer arithmetic, no float rounding; dates before 1970 work)."""
    delta = utc(dt) - _EPOCH
    micros = (delta.days * 86400 + delta.seconds) * 1_000_000 + delta.microseconds
    seconds, rest = divmod(micros, 1_000_000)
    return Timestamp(seconds=seconds, nanos=rest * 1000)


def timestamp_from_pb(ts: Timestamp) -> datetime:
    """``google.protobuf.Timestamp`` → aware UTC datetime (nanoseconds truncated to
    microseconds). Tolerant of any value already on a log: seconds outside years
    1..9999 and nanos outside [0, 1e9) are clamped, never raised on."""
    seconds = min(max(ts.seconds, int(MIN_EPOCH)), int(MAX_EPOCH))
    micros = min(max(ts.nanos, 0), 999_999_999) // 1000
    return clamp_time(_EPOCH + timedelta(seconds=seconds, microseconds=micros))


def _set_time(pb: Message, name: str, dt: datetime | None) -> None:
    if dt is not None:
        getattr(pb, name).CopyFrom(timestamp_to_pb(dt))


def _get_time(pb: Message, name: str) -> datetime | None:
    return timestamp_from_pb(getattr(pb, name)) if pb.HasField(name) else None


def fact_to_pb(fact: Fact) -> events_pb2.Fact:
    """Domain Fact → ``events_pb2.Fact`` (every field; ``bank_id`` travels on the
    enclosing event, not per fact). Embedding and link weights become float32."""
    pb = events_pb2.Fact(
        id=fact.id, text=fact.text, fact_type=fact.fact_type, context=fact.context,
        tags=list(fact.tags), metadata=dict(fact.metadata), document_id=fact.document_id,
        chunk_id=fact.chunk_id,
        entities=[events_pb2.Entity(id=e.id, name=e.name, label=e.label)
                  for e in fact.entities],
        embedding=fact.embedding,
        links=[events_pb2.Link(target_id=ln.target_id, kind=ln.kind, weight=ln.weight)
               for ln in fact.links],
        item_index=fact.item_index,
    )
    _set_time(pb, "occurred_start", fact.occurred_start)
    _set_time(pb, "occurred_end", fact.occurred_end)
    _set_time(pb, "mentioned_at", fact.mentioned_at)
    return pb


def fact_from_pb(pb: events_pb2.Fact, bank_id: str) -> Fact:
    """``events_pb2.Fact`` of bank ``bank_id`` → domain Fact; unset times become None."""
    return Fact(
        id=pb.id, bank_id=bank_id, text=pb.text, fact_type=pb.fact_type, context=pb.context,
        occurred_start=_get_time(pb, "occurred_start"),
        occurred_end=_get_time(pb, "occurred_end"),
        mentioned_at=_get_time(pb, "mentioned_at"),
        tags=tuple(pb.tags), metadata=dict(pb.metadata), document_id=pb.document_id,
        chunk_id=pb.chunk_id,
        entities=[EntityRef(id=e.id, name=e.name, label=e.label) for e in pb.entities],
        embedding=list(pb.embedding),
        links=[Link(target_id=ln.target_id, kind=ln.kind, weight=ln.weight) for ln in pb.links],
        item_index=pb.item_index,
    )


def retain_item_to_pb(item: RetainItem) -> events_pb2.RetainItem:
    """Domain RetainItem → ``events_pb2.RetainItem``."""
    pb = events_pb2.RetainItem(content=item.content, context=item.context,
                               document_id=item.document_id, tags=list(item.tags),
                               metadata=dict(item.metadata), time_zone=item.time_zone)
    _set_time(pb, "timestamp", item.timestamp)
    return pb


def retain_item_from_pb(pb: events_pb2.RetainItem) -> RetainItem:
    """``events_pb2.RetainItem`` → domain RetainItem. A missing timestamp becomes None
    (the ingest API stamps every item, so only hand-written events lack one)."""
    return RetainItem(content=pb.content, timestamp=_get_time(pb, "timestamp"),
                      context=pb.context, document_id=pb.document_id, tags=tuple(pb.tags),
                      metadata=dict(pb.metadata), time_zone=pb.time_zone)


def tombstone(o: events_pb2.Observation) -> events_pb2.Observation:
    """What is kept of a deleted observation state ``o``, in the event that deletes it
    and in the stores: id, scope, version, ``deleted`` and its created/updated times --
    enough to order later states by version and to count it
    (:meth:`mneme.ports.ObservationStore.dump`); its text, evidence (quotes), history,
    embedding and entities are dropped (they are the deleted facts' content, and a
    deletion must stay readable once their keys are destroyed). A live ``o`` is returned
    as it is."""
    if not o.deleted:
        return o
    t = events_pb2.Observation(id=o.id, scope=o.scope, version=o.version, deleted=True)
    for name in ("created_at", "updated_at"):
        if o.HasField(name):
            getattr(t, name).CopyFrom(getattr(o, name))
    return t


def opinion_tombstone(o: events_pb2.Opinion) -> events_pb2.Opinion:
    """What is kept of a deleted opinion state ``o`` (as :func:`tombstone` keeps of an
    observation): id, version, ``deleted`` and its times; a live ``o`` as it is."""
    if not o.deleted:
        return o
    t = events_pb2.Opinion(id=o.id, version=o.version, deleted=True)
    for name in ("created_at", "updated_at"):
        if o.HasField(name):
            getattr(t, name).CopyFrom(getattr(o, name))
    return t


def bank_config_to_pb(config: BankConfig) -> events_pb2.BankConfig:
    """Domain BankConfig → ``events_pb2.BankConfig`` (every field, exact)."""
    return events_pb2.BankConfig(
        retain_mission=config.retain_mission,
        observations_mission=config.observations_mission,
        skepticism=config.skepticism, literalism=config.literalism, empathy=config.empathy,
        auto_consolidate=config.auto_consolidate, dedup_threshold=config.dedup_threshold,
        extraction_mode=config.extraction_mode, erasure=config.erasure,
        reflect_mission=config.reflect_mission, store_documents=config.store_documents)


def bank_config_from_pb(pb: events_pb2.BankConfig | None) -> BankConfig:
    """``events_pb2.BankConfig`` → domain BankConfig. None gives the defaults; proto3
    zero values that are invalid in the domain (traits 0, empty ``extraction_mode``)
    take the domain defaults, so a partially filled message still makes a valid config.
    Pass None for an event without a config (an unset submessage reads as zeros):
    ``bank_config_from_pb(m.config if m.HasField("config") else None)``."""
    d = BankConfig()
    if pb is None:
        return d
    return BankConfig(
        retain_mission=pb.retain_mission,
        observations_mission=pb.observations_mission,
        skepticism=pb.skepticism or d.skepticism,
        literalism=pb.literalism or d.literalism,
        empathy=pb.empathy or d.empathy,
        auto_consolidate=pb.auto_consolidate,
        dedup_threshold=pb.dedup_threshold,
        extraction_mode=pb.extraction_mode or d.extraction_mode,
        erasure=pb.erasure or d.erasure, reflect_mission=pb.reflect_mission,
        store_documents=pb.store_documents if pb.HasField("store_documents") else True)


__all__ = [
    "CONTENT_TYPE", "Envelope", "SPECVERSION", "TOPIC_OF_TYPE", "TYPE_PREFIX",
    "bank_config_from_pb", "bank_config_to_pb", "decode", "encode", "event_type",
    "fact_from_pb", "fact_to_pb", "format_time", "message_class", "retain_item_from_pb",
    "retain_item_to_pb", "timestamp_from_pb", "timestamp_to_pb", "to_float32", "tombstone",
    "topic_for",
]
