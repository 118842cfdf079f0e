"""The retry-then-dead-letter policy both runners share (the embedded log's
:class:`mneme.bus.consumer.Consumer` and the Kafka subscribers of
:mod:`mneme.runtime.kafka`).

A record whose handler still fails after the retries (or whose payload cannot be
decoded) is copied to ``mneme.dlq.v1`` with its key, value and headers (``ce_*``,
``content-type``, ``traceparent``) plus ``dlq_topic``, ``dlq_partition``, ``dlq_offset``,
``dlq_group``, ``dlq_attempts`` (0 for undecodable records), ``dlq_error`` ("ExcType:
message"; the message left out when it quotes the event's content, which these headers
and the failed operation would keep in the clear), ``dlq_traceback`` and ``dlq_time``; it
is committed with the input offset, so one poison event never stops a partition. A record
that fails while being read *from* the DLQ is logged and dropped instead, so a DLQ reader
cannot loop.

A dead-lettered event that belongs to an operation (its message has ``bank_id`` and
``operation_id``, a type in :data:`OPERATION_KINDS`) also fails that operation: an
``OperationProgress(state="failed", error=…)`` goes to ``mneme.progress.v1`` with the DLQ
copy, so a sync retain returns FAILED at once instead of waiting for its deadline, and
replay (which re-reads progress) shows the same state.

A DLQ copy larger than the log takes (an input close to Kafka's record size limit, plus
the ``dlq_*`` headers) goes without its value (:func:`without_value`): its header
``dlq_value_omitted`` gives the value's size, and ``mneme dlq replay`` reads the value
from the original record (``dlq_topic``, ``dlq_partition``, ``dlq_offset``; history
topics never expire), so a poison record too large to copy never stalls its partition.
"""

from __future__ import annotations

import logging
import traceback
from datetime import datetime, timezone
from typing import Callable

from google.protobuf.message import Message

from mneme import telemetry
from mneme.bus import DLQ
from mneme.bus.codec import Envelope, encode, format_time
from mneme.domain import CONSOLIDATION_REQUEST_TRIGGERS, derive_id
from mneme.errors import quotes
from mneme.events.v1 import events_pb2 as ev
from mneme.ports import OutRecord, Record

log = logging.getLogger(__name__)

#: The event type a dead letter produces besides the DLQ copy (the failed operation).
FAILED_PROGRESS = ev.OperationProgress

_ERROR_CHARS = 2000
_TRACEBACK_CHARS = 8000


def _retract_kind(m: Message) -> str | None:
    if m.bank_deleted:
        return "delete_bank"
    if m.document_id:
        return "delete_document"
    return "delete_memory" if m.memory_ids else None


def _observations_kind(m: Message) -> str | None:
    # Other triggers follow an operation that already finished (a retain, a deletion):
    # failing to project them does not undo that operation.
    return "consolidate" if m.trigger in CONSOLIDATION_REQUEST_TRIGGERS else None


def describe(rec: Record, env: Envelope | None = None) -> str:
    """``rec`` for a log line an operator follows a request by: its place, bank, event
    type and id and, when its event belongs to one, its operation —
    ``mneme.memory.v1[0]@4 (bank b1, FactsExtracted 3f…, operations/op1)``."""
    headers = dict(rec.headers)
    kind = (headers.get("ce_type") or "?").rsplit(".", 1)[-1]
    op = getattr(env.message, "operation_id", "") if env is not None and env.message else ""
    return (f"{rec.topic}[{rec.partition}]@{rec.offset} (bank {rec.key or '-'}, {kind} "
            f"{headers.get('ce_id') or '-'}" + (f", operations/{op})" if op else ")"))


def error_text(exc: BaseException, env: Envelope | None = None) -> str:
    """``exc`` as ``Type: message`` (a store client's repr may say only
    ``network:ConnectionError``), without the message when it quotes the content of
    ``env``'s event (see :func:`_told`)."""
    return _told(exc, env)[0]


#: Operation kind of each event type that belongs to an operation (message name → kind
#: or a function of the message giving the kind, None for "not an operation's work").
OPERATION_KINDS: dict[str, str | Callable[[Message], str | None]] = {
    "RetainRequested": "retain",
    "FactsExtracted": "retain",
    "DocumentDeleteRequested": "delete_document",
    "MemoryDeleteRequested": "delete_memory",
    "BankDeleted": "delete_bank",
    "ConsolidationRequested": "consolidate",
    "ConsolidationScheduled": "consolidate",
    "FactsRetracted": _retract_kind,
    "ObservationsChanged": _observations_kind,
}


def operation_failed(env: Envelope, error: str, group: str) -> OutRecord | None:
    """The ``OperationProgress(state="failed")`` record that fails the operation
    ``env``'s message belongs to, or None when it belongs to none (no ``bank_id`` /
    ``operation_id``, a type not in :data:`OPERATION_KINDS`, or progress itself, which
    would loop). ``error`` is the failure as users should see it; ``group`` the consumer
    group that gave up (named in the error, and part of the deterministic event id, so a
    redelivered dead letter yields the same progress event)."""
    m = env.message
    if m is None:
        return None
    bank_id, op_id = getattr(m, "bank_id", ""), getattr(m, "operation_id", "")
    kind = OPERATION_KINDS.get(m.DESCRIPTOR.name)
    if callable(kind):
        kind = kind(m)
    if not (bank_id and op_id and kind):
        return None
    total = (m.items_total if m.DESCRIPTOR.name == "FactsExtracted"
             else len(m.items) if m.DESCRIPTOR.name == "RetainRequested" else 0)
    facts = [f.id for f in m.facts] if m.DESCRIPTOR.name == "FactsExtracted" else []
    progress = ev.OperationProgress(
        bank_id=bank_id, operation_id=op_id, kind=kind, state="failed",
        items_total=total, items_done=total, facts=len(facts), memory_ids=facts,
        error=f"{group} could not process {m.DESCRIPTOR.name}: {error}"[:_ERROR_CHARS])
    return encode(progress, bank_id=bank_id, source=f"mneme/{group}",
                  event_id=derive_id(env.id, "dead-letter", group),
                  traceparent=env.traceparent)


def content(m: Message) -> list[str]:
    """The user content of an opened event ``m``: the string values of its sealed fields
    (:data:`mneme.bus.sealing.SEALED_FIELDS`), a metadata map's keys and values, in every
    submessage."""
    from mneme.bus.sealing import SEALED_FIELDS  # (sealing is the heavier module)
    out: list[str] = []
    sealed = SEALED_FIELDS.get(m.DESCRIPTOR.full_name, frozenset())
    for fd, value in m.ListFields():
        if fd.message_type is not None and fd.message_type.GetOptions().map_entry:
            if fd.name in sealed:
                out += [f"{k}" for k in value] + [v for v in value.values() if isinstance(v, str)]
            continue
        values = value if fd.is_repeated else [value]
        for v in values:
            if isinstance(v, Message):
                out += content(v)
            elif isinstance(v, str) and fd.name in sealed:
                out.append(v)
    return out


def _told(exc: BaseException, env: Envelope | None) -> tuple[str, str]:
    """(error, traceback) of ``exc`` as a dead letter may say them in the clear: without
    the exception's message when it quotes the event's content (:func:`content`), which
    its keys no longer guard there (a ValueError quoting the text it could not parse)."""
    error = f"{type(exc).__name__}: {exc}"
    tb = "".join(traceback.format_exception(type(exc), exc, exc.__traceback__))
    if env is None or env.message is None:
        return error, tb
    said, seen, e = [], set(), exc  # the messages of the chain a traceback prints
    while e is not None and id(e) not in seen and len(said) < 10:
        seen.add(id(e))
        said.append(str(e)[:_TRACEBACK_CHARS])
        e = e.__cause__ or (None if e.__suppress_context__ else e.__context__)
    if not quotes("\n".join(said), content(env.message)):
        return error, tb
    error = f"{type(exc).__name__}: (its message quotes the event's content: not repeated)"
    return error, "".join(traceback.format_tb(exc.__traceback__)) + error


def records(rec: Record, exc: BaseException, attempts: int, group: str, env: Envelope | None,
            *, dlq_topic: str = DLQ,
            fails_operation: Callable[[Message], bool] = lambda m: True) -> list[OutRecord]:
    """What to produce for ``rec``, which failed ``attempts`` times with ``exc`` in
    ``group``: its DLQ copy plus, when its event belongs to an operation and
    ``fails_operation(message)`` (False for a group's off-path types:
    :attr:`mneme.router.Group.secondary`), the progress event failing it
    (:func:`operation_failed`); [] for a record read from ``dlq_topic`` itself."""
    telemetry.count_dead_letter(group, rec.topic)
    if rec.topic == dlq_topic:
        log.error("consumer %s: dropping dead letter %s after %d attempts: %s",
                  group, describe(rec, env), attempts, error_text(exc, env))
        return []
    error, tb = _told(exc, env)
    log.error("consumer %s: dead-lettering %s after %d attempts (mneme dlq list): %s", group,
              describe(rec, env), attempts, error)
    headers = dict(rec.headers)
    headers.update({
        "dlq_topic": rec.topic,
        "dlq_partition": str(rec.partition),
        "dlq_offset": str(rec.offset),
        "dlq_group": group,
        "dlq_attempts": str(attempts),
        "dlq_error": error[:_ERROR_CHARS],
        "dlq_traceback": tb[-_TRACEBACK_CHARS:],
        "dlq_time": format_time(datetime.now(timezone.utc)),
    })
    out = [OutRecord(topic=dlq_topic, key=rec.key, value=bytes(rec.value), headers=headers)]
    failed = None
    if env is not None and env.message is not None and fails_operation(env.message):
        try:
            failed = operation_failed(env, error, group)
        except Exception:  # never let the failure report stop the dead letter
            log.exception("consumer %s: cannot build the failed progress", group)
    return out + ([failed] if failed is not None else [])


#: Header of a DLQ copy produced without its value: the value's size in bytes.
VALUE_OMITTED = "dlq_value_omitted"


def without_value(outs: list[OutRecord], dlq_topic: str = DLQ) -> list[OutRecord]:
    """``outs`` (what :func:`records` returned) with the DLQ copy's value left out and
    its size in the :data:`VALUE_OMITTED` header: for a copy larger than the log takes.
    The original record stays where the ``dlq_*`` headers say."""
    out = []
    for o in outs:
        if o.topic == dlq_topic and VALUE_OMITTED not in o.headers:
            log.error("dead letter of %s[%s]@%s too large for the DLQ: copied without its "
                      "value (%d bytes)", o.headers.get("dlq_topic"),
                      o.headers.get("dlq_partition"), o.headers.get("dlq_offset"), len(o.value))
            o = OutRecord(topic=o.topic, key=o.key, value=b"",
                          headers={**o.headers, VALUE_OMITTED: str(len(o.value))})
        out.append(o)
    return out


__all__ = ["OPERATION_KINDS", "VALUE_OMITTED", "content", "operation_failed", "records",
           "without_value"]
