"""Conversions between the gRPC API messages (``mneme.v1``) and the domain model."""

from __future__ import annotations

import threading
from collections import OrderedDict
from datetime import datetime
from typing import Sequence

from mneme.domain import (EXPERIENCE, OPINION, WORLD, Bank, BankConfig, Fact, Filters, RetainItem,
                          TimeWindow, from_epoch, utc)
from mneme.errors import InvalidArgument
from mneme.grpc_util import dt_to_ts, ts_to_dt
from mneme.names import bank_name, memory_name, unit_name  # noqa: F401 - memory_name re-exported
from mneme.domain import Operation
from mneme.v1 import operations_pb2, recall_pb2, resources_pb2

_TYPE_TO_PB = {WORLD: resources_pb2.WORLD, EXPERIENCE: resources_pb2.EXPERIENCE,
               "observation": resources_pb2.OBSERVATION, OPINION: resources_pb2.OPINION}
_PB_TO_TYPE = {v: k for k, v in _TYPE_TO_PB.items()}
_STATE = {"pending": operations_pb2.PENDING, "running": operations_pb2.RUNNING,
          "succeeded": operations_pb2.SUCCEEDED, "failed": operations_pb2.FAILED}
BUDGET = {recall_pb2.BUDGET_UNSPECIFIED: "mid", recall_pb2.LOW: "low",
          recall_pb2.MID: "mid", recall_pb2.HIGH: "high"}
TAGS_MATCH = {recall_pb2.TAGS_MATCH_UNSPECIFIED: "any", recall_pb2.ANY: "any",
              recall_pb2.ALL: "all", recall_pb2.ANY_STRICT: "any_strict",
              recall_pb2.ALL_STRICT: "all_strict", recall_pb2.EXACT: "exact"}


def populated(msg, fields: Sequence[str], prefix: str = "") -> list[str]:
    """The fields among ``fields`` that are populated in message ``msg`` (AIP-134: what
    an update without a mask changes), as ``prefix + name`` in ``fields``' order: a field
    with presence (a message, an ``optional`` scalar) when set, a repeated field when not
    empty, any other scalar when not its zero value (a client sets a field to 0, "" or
    false only through a mask)."""
    out = []
    for f in fields:
        fd = msg.DESCRIPTOR.fields_by_name[f]
        if fd.is_repeated:
            has = len(getattr(msg, f)) > 0
        elif fd.has_presence:
            has = msg.HasField(f)
        else:
            has = getattr(msg, f) != fd.default_value
        if has:
            out.append(prefix + f)
    return out


def update_paths(mask: Sequence[str], fields: Sequence[str], resource=None) -> list[str]:
    """The fields an AIP-134 ``update_mask`` names among ``fields``, in ``fields``' order
    and without repeats: "*" names them all; an empty mask names those populated in
    ``resource``, the request's message (:func:`populated`; none without it).
    InvalidArgument naming ``update_mask.paths[i]`` for a path that is not one of them."""
    if not mask:
        return populated(resource, fields) if resource is not None else []
    named: set[str] = set()
    for i, p in enumerate(mask):
        if p == "*":
            named.update(fields)
        elif p in fields:
            named.add(p)
        else:
            raise InvalidArgument(f"update_mask.paths[{i}]",
                                  f"unknown field {p!r}; one of {', '.join(fields)} or *")
    return [f for f in fields if f in named]


def bank_paths_populated(bank: resources_pb2.Bank) -> list[str]:
    """The UpdateBank paths an empty ``update_mask`` means (AIP-134): "display_name" when
    set and "config.<field>" for each populated config field (:func:`populated`)."""
    return (populated(bank, ("display_name",))
            + populated(bank.config, [f.name for f in bank.config.DESCRIPTOR.fields], "config."))


def bank_config_from_api(c: resources_pb2.BankConfig) -> BankConfig:
    """API config → domain; zero values mean the defaults (traits 3, threshold 0.97)."""
    return BankConfig(
        retain_mission=c.retain_mission, observations_mission=c.observations_mission,
        skepticism=c.skepticism or 3, literalism=c.literalism or 3, empathy=c.empathy or 3,
        auto_consolidate=c.auto_consolidate if c.HasField("auto_consolidate") else True,
        dedup_threshold=c.dedup_threshold or 0.97, extraction_mode=c.extraction_mode or "auto",
        erasure=c.erasure or "crypto_shred", reflect_mission=c.reflect_mission,
        store_documents=c.store_documents if c.HasField("store_documents") else True)


def bank_to_api(b: Bank) -> resources_pb2.Bank:
    c = b.config
    return resources_pb2.Bank(
        name=bank_name(b.bank_id), display_name=b.display_name,
        config=resources_pb2.BankConfig(
            retain_mission=c.retain_mission, observations_mission=c.observations_mission,
            skepticism=c.skepticism, literalism=c.literalism, empathy=c.empathy,
            auto_consolidate=c.auto_consolidate, dedup_threshold=c.dedup_threshold,
            extraction_mode=c.extraction_mode, erasure=c.erasure,
            reflect_mission=c.reflect_mission, store_documents=c.store_documents),
        create_time=dt_to_ts(b.created_at), update_time=dt_to_ts(b.updated_at))


def retain_items_from_api(items, now: datetime) -> list[RetainItem]:
    """API items → domain; an unset timestamp means ``now`` (the request's arrival). An
    unrepresentable timestamp (refused per item by the limits) is taken as ``now`` here:
    that item is never extracted."""
    out = []
    for n, i in enumerate(items):
        try:
            ts = ts_to_dt(i.timestamp, f"items[{n}].timestamp") if i.HasField("timestamp") else None
        except InvalidArgument:
            ts = None
        out.append(RetainItem(content=i.content, context=i.context, timestamp=ts or utc(now),
                              document_id=i.document_id, tags=tuple(i.tags),
                              metadata=dict(i.metadata), time_zone=i.time_zone.strip()))
    return out


def types_from_api(types, field: str = "types") -> tuple[str, ...]:
    out = []
    for n, t in enumerate(types):
        if t not in _PB_TO_TYPE:
            raise InvalidArgument(f"{field}[{n}]", "must be WORLD, EXPERIENCE, OBSERVATION or OPINION")
        out.append(_PB_TO_TYPE[t])
    return tuple(out)


def time_range_from_api(tr, field: str = "time_range") -> TimeWindow | None:
    start, end = ts_to_dt(tr.start, f"{field}.start"), ts_to_dt(tr.end, f"{field}.end")
    if start is None and end is None:
        return None
    if start and end and start > end:
        raise InvalidArgument(f"{field}.start", "must not be after end")
    return TimeWindow(start, end)


def check_tags(tags, field: str = "tags") -> tuple[str, ...]:
    """``tags`` as a tuple; InvalidArgument naming ``field[i]`` for an empty or blank tag
    (no memory carries one, so as a filter or a scope it could only match nothing)."""
    for i, t in enumerate(tags):
        if not t.strip():
            raise InvalidArgument(f"{field}[{i}]", "must not be empty")
    return tuple(tags)


def tag_filter(r) -> tuple[tuple[str, ...], str]:
    """The tag filter of a request with RecallRequest's ``tags`` and ``tags_match`` fields
    (Recall, ListEntities, GetEntity) as (tags, mode of
    :data:`mneme.domain.TAGS_MATCH_MODES`); InvalidArgument naming ``tags[i]`` or
    ``tags_match``."""
    tags = check_tags(r.tags)
    if r.tags_match not in TAGS_MATCH:
        raise InvalidArgument("tags_match", "unknown value")
    return tags, TAGS_MATCH[r.tags_match]


def filters_from_recall(r: recall_pb2.RecallRequest) -> Filters:
    """The filters of a RecallRequest; InvalidArgument naming the field."""
    tags, mode = tag_filter(r)
    return Filters(types=types_from_api(r.types), tags=tags,
                   tags_match=mode,
                   time_range=time_range_from_api(r.time_range) if r.HasField("time_range") else None,
                   document_id=r.document_id)


def memory_to_api(f: Fact) -> resources_pb2.Memory:
    """The unit as the API's Memory; its name is in the collection of its type
    (:func:`mneme.names.unit_name`: an observation is ``banks/{bank}/observations/{id}``,
    as ObservationService names it)."""
    return resources_pb2.Memory(
        name=unit_name(f.bank_id, f.id, f.fact_type), id=f.id, text=f.text,
        fact_type=_TYPE_TO_PB.get(f.fact_type, resources_pb2.FACT_TYPE_UNSPECIFIED),
        context=f.context, occurred_start=dt_to_ts(f.occurred_start),
        occurred_end=dt_to_ts(f.occurred_end), mentioned_at=dt_to_ts(f.mentioned_at),
        tags=list(f.tags), metadata=dict(f.metadata), document_id=f.document_id,
        chunk_id=f.chunk_id,
        entities=[resources_pb2.EntityRef(id=e.id, name=e.name, label=e.label) for e in f.entities])


class MemoryMessages:
    """Serialized :func:`memory_to_api` messages of recently returned facts, so that
    returning a fact again parses bytes in C (~9 µs a fact) instead of building the
    message from Python values (~50 µs; a recall returns ~100 facts at 4,096 tokens, and
    this was a third of the Recall handler's time on a 10k-fact bank).

    A hit needs the same unit (bank id, id) *and* the very same field objects. The search
    store's hydration cache hands out shallow copies of one :class:`Fact`, which share
    them; a fact read from a store again, changed, or built another way has new objects and
    misses, so a stale message is never returned (a mutation in place of a shared field
    would already corrupt the hydration cache). At most ``size`` facts (LRU); thread-safe.
    """

    def __init__(self, size: int = 20_000):
        self.size = size
        self._lock = threading.Lock()
        self._cache: OrderedDict[tuple[str, str], tuple[tuple, bytes]] = OrderedDict()

    @staticmethod
    def _fields(f: Fact) -> tuple:
        return (f.text, f.fact_type, f.context, f.occurred_start, f.occurred_end,
                f.mentioned_at, f.tags, f.metadata, f.document_id, f.chunk_id, f.entities)

    def fill(self, target: resources_pb2.Memory, f: Fact) -> None:
        """Set ``target`` (an empty Memory, e.g. a result's ``memory`` field) to
        ``memory_to_api(f)``."""
        key, fields = (f.bank_id, f.id), self._fields(f)
        with self._lock:
            hit = self._cache.get(key)
            if hit is not None:
                self._cache.move_to_end(key)
        if hit is not None and all(a is b for a, b in zip(hit[0], fields)):
            target.MergeFromString(hit[1])
            return
        m = memory_to_api(f)
        target.CopyFrom(m)
        data = m.SerializeToString()
        with self._lock:
            self._cache[key] = (fields, data)
            while len(self._cache) > self.size:
                self._cache.popitem(last=False)


def operation_to_api(o: Operation) -> operations_pb2.Operation:
    return operations_pb2.Operation(
        name=f"operations/{o.operation_id}", bank_id=o.bank_id, kind=o.kind,
        state=_STATE.get(o.state, operations_pb2.OPERATION_STATE_UNSPECIFIED),
        items_total=o.items_total, items_done=o.items_done, facts=o.facts, error=o.error,
        create_time=dt_to_ts(from_epoch(o.created_at)), update_time=dt_to_ts(from_epoch(o.updated_at)),
        item_errors=[operations_pb2.ItemError(item_index=i, field=f, error=e)
                     for i, f, e in o.item_errors],
        cancel_requested=o.cancel_requested, cancelled=o.cancelled,
        retry_of=f"operations/{o.retry_of}" if o.retry_of else "")


_SCOPE_MODES = {resources_pb2.ObservationScopes.MODE_UNSPECIFIED: "",
                resources_pb2.ObservationScopes.EXACT: "exact",
                resources_pb2.ObservationScopes.PER_TAG: "per_tag",
                resources_pb2.ObservationScopes.COMBINED: "combined",
                resources_pb2.ObservationScopes.SHARED: "shared",
                resources_pb2.ObservationScopes.EXPLICIT: "explicit"}


def observation_scopes_from_api(s: resources_pb2.ObservationScopes,
                                field: str = "observation_scopes"):
    """API scopes → the event message (``mneme.events.v1.ObservationScopes``).
    EXPLICIT needs at least one scope. Raises InvalidArgument."""
    from mneme.events.v1 import events_pb2
    if s.mode not in _SCOPE_MODES:
        raise InvalidArgument(f"{field}.mode", "unknown value")
    mode = _SCOPE_MODES[s.mode]
    if mode == "explicit" and not s.scopes:
        raise InvalidArgument(f"{field}.scopes", "EXPLICIT needs at least one scope")
    for i, x in enumerate(s.scopes):
        check_tags(x.tags, f"{field}.scopes[{i}].tags")
    return events_pb2.ObservationScopes(
        mode=mode, scopes=[events_pb2.ScopeTags(tags=list(x.tags)) for x in s.scopes])
