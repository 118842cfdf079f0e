"""Routing: each service's declaration of what it consumes and produces, and the router
that runs its handlers on records.

A service declares itself once, in ``services/<name>/routes.py``, as a :class:`Service`:
its consumer groups (:class:`Group`: topic → {event type: handler}) and the event types
it produces per topic. Everything else is derived from those declarations: the embedded
runner and the Kafka subscribers (:mod:`mneme.runtime`), replay, the consumer lag of
bank statistics and the AsyncAPI document (:mod:`mneme.runtime.asyncapi`).

A handler is a plain function over protobuf messages and ports::

    def on_retain_requested(m: ev.RetainRequested, meta: EventMeta, *,
                            extractor, embedder) -> list[Message]

It sees no record, header, id or encoding. Its keyword-only parameters name its
dependencies, bound by name when a :class:`Router` is built (a missing one is a
ValueError then, not at the first event). The :class:`Router` decodes a record,
dispatches by type, checks each output is a type the service declares, derives its
deterministic id from the input's, sets the CloudEvents headers and ``traceparent``, and
encodes it; the runner commits the outputs with the input offset.
"""

from __future__ import annotations

import contextlib
import functools
import inspect
import logging
import threading
from dataclasses import dataclass, field
from datetime import datetime, timezone
from typing import Any, Callable, Iterable, Mapping, Sequence

from google.protobuf.message import Message

from mneme.bus import codec
from mneme.bus.codec import Envelope
from mneme.domain import EventMeta, derive_id
from mneme.ports import OutRecord, Record

log = logging.getLogger(__name__)

#: ``handler(message, meta, **deps) -> output messages`` (None or [] for none).
Handler = Callable[..., "Iterable[Message] | None"]


def _check_topics(owner: str, by_topic: Mapping[str, Iterable[type[Message]]]) -> None:
    """ValueError when an event type is declared under a topic it is not published on."""
    for topic, types in by_topic.items():
        for t in types:
            if codec.topic_for(t) != topic:
                raise ValueError(f"{owner}: {t.DESCRIPTOR.name} is published on "
                                 f"{codec.topic_for(t)}, not {topic}")


@dataclass(frozen=True)
class Group:
    """One consumer group of a service.

    ``consumes``: topic → {event type: handler}; the group reads every record of those
    topics and skips types it has no handler for. ``distributed_only``: the group runs
    only when each service has its own process (a service's private copy of a projection
    that the embedded process shares). ``replay``: the group is a projection that
    ``mneme replay`` rebuilds from offset 0. ``secondary``: event types this group
    handles off their operation's path (the operation is done without them), so their
    dead letters do not fail the operation.

    ``state`` says where the projection the group writes lives, which decides how its
    replicas share the work (README "State"):

    - ``"shared"``: the group's state is shared by its replicas or there is none; Kafka
      balances the group's partitions over them (one consumer group, ``name``);
    - ``"replica"``: every replica keeps its own full copy (a small table such as the
      bank catalog), so every replica reads every partition under its own consumer group
      (``<name>.<replica id>``, :func:`mneme.datadir.replica_id`);
    - ``"stores"``: as ``"replica"`` while the process's search stores are files of its
      own (the embedded adapters), as ``"shared"`` when they are servers.

    ``restore``: topic → {event type: handler}, the changelog of a ``"shared"`` group's
    replica-local state (the Kafka Streams model). When a replica is assigned partition
    *p* of the group's topics it first applies these topics' partition *p* through these
    handlers (outputs dropped), from where it last left them (else from offset 0): a topic
    the group reads up to the group's committed offset, plus the outputs the group made
    for those records beyond it; any other topic up to its end. So a replica that takes
    over a bank resumes with the state its previous owner had after the last record it
    committed (:meth:`mneme.runtime.kafka.GroupRun.restore`). Restore handlers must be
    idempotent (they may see a record twice).

    ``durable``: the names of the deps whose writes become durable only when their
    ``flush()`` runs (:meth:`mneme.ports.VectorStore.flush`); the runners call
    :meth:`Router.flush` before they commit the group's offsets, so a committed record's
    writes survive a crash (one flush per batch of records, not one per write).
    """

    name: str
    consumes: Mapping[str, Mapping[type[Message], Handler]]
    distributed_only: bool = False
    replay: bool = False
    secondary: tuple[type[Message], ...] = ()
    state: str = "shared"
    restore: Mapping[str, Mapping[type[Message], Handler]] = field(default_factory=dict)
    durable: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        _check_topics(f"group {self.name}", self.consumes)
        _check_topics(f"group {self.name} (restore)", self.restore)
        if self.state not in ("shared", "replica", "stores"):
            raise ValueError(f"group {self.name}: state must be shared, replica or stores, "
                             f"not {self.state!r}")

    def per_replica(self, local_stores: bool) -> bool:
        """True when each replica runs this group under its own consumer group: always
        for ``state="replica"``, for ``"stores"`` when the stores are replica-local."""
        return self.state == "replica" or (self.state == "stores" and local_stores)

    @property
    def topics(self) -> tuple[str, ...]:
        """The topics this group reads, in declaration order."""
        return tuple(self.consumes)

    def runs_in(self, distributed: bool) -> bool:
        """True when the group runs in the topology (every group runs distributed)."""
        return distributed or not self.distributed_only

    def handled(self, topic: str) -> tuple[str, ...]:
        """Names of the event types this group acts on in ``topic``."""
        return tuple(t.DESCRIPTOR.name for t in self.consumes.get(topic, {}))


@dataclass(frozen=True)
class Service:
    """A service's declaration: ``name`` (its ``ce_source`` is ``mneme/<name>``), its
    consumer groups, and ``produces`` (topic → event types it publishes, from its
    handlers and its API alike)."""

    name: str
    groups: tuple[Group, ...] = ()
    produces: Mapping[str, tuple[type[Message], ...]] = field(default_factory=dict)

    def __post_init__(self) -> None:
        _check_topics(f"service {self.name}", self.produces)

    @property
    def source(self) -> str:
        """The ``ce_source`` of what this service publishes."""
        return f"mneme/{self.name}"

    def group(self, name: str) -> Group:
        """The group called ``name``; KeyError when the service has none."""
        for g in self.groups:
            if g.name == name:
                return g
        raise KeyError(f"service {self.name} has no consumer group {name!r}")

    def may_produce(self, message: Message) -> bool:
        """True when ``message``'s type is one this service declares it publishes."""
        return type(message) in self.produces.get(codec.topic_for(message), ())


def _bind(fn: Handler, deps: Mapping[str, Any], where: str) -> Callable[[Message, EventMeta], Any]:
    """``fn`` with the dependencies its keyword-only parameters name taken from ``deps``."""
    kwargs = {}
    for p in inspect.signature(fn).parameters.values():
        if p.kind is not inspect.Parameter.KEYWORD_ONLY:
            continue
        if p.name in deps:
            kwargs[p.name] = deps[p.name]
        elif p.default is inspect.Parameter.empty:
            raise ValueError(f"{where}: handler {fn.__qualname__} needs {p.name!r}, "
                             f"which the composition root does not provide")
    return functools.partial(fn, **kwargs)


def meta_of(env: Envelope, record: Record) -> EventMeta:
    """The :class:`EventMeta` handlers see: the event id (``ce_id``; for an event without
    one, e.g. hand-written, its position ``topic/partition/offset``, which redelivery
    keeps) and its time (``ce_time``, else the record's timestamp, else now)."""
    at = env.time
    if at is None:
        at = (datetime.fromtimestamp(record.timestamp, tz=timezone.utc) if record.timestamp
              else datetime.now(timezone.utc))
    return EventMeta(id=env.id or f"{record.topic}/{record.partition}/{record.offset}", time=at,
                     position=(record.topic, record.partition, record.offset))


class Router:
    """Runs one consumer group's handlers: ``router(envelope, record) -> [OutRecord]``.

    ``deps`` are the ports and settings the handlers name (see the module docstring);
    every handler's are checked here (ValueError naming the missing one). Types the group
    has no handler for, and unknown types, yield nothing. Each output must be a type
    ``service`` declares (TypeError otherwise: a handler bug is dead-lettered, never
    published). Output ids are ``derive_id(input id, group, type, n)`` (n counts outputs
    of one type), so a redelivered or replayed input yields the same ids.

    ``group_id`` is the consumer group's id on the event log: the group's name, or for a
    group that runs once per replica (:meth:`Group.per_replica`) the replica's own id.
    Output ids use the name, so every replica derives the same ones.

    ``restore`` True: the router of the group's :attr:`Group.restore` handlers instead
    (what a replica applies when it is assigned a partition).

    Calls are serialised (the runners call one group's router one record at a time
    anyway); :meth:`paused` holds them between two records, where the position of every
    partition is known (a replay's switch to a new store generation).

    :meth:`flush` makes the writes of the records handled so far durable (the group's
    :attr:`Group.durable` deps, each of which must be in ``deps`` with a callable
    ``flush``: ValueError naming it otherwise); runners call it before every commit.
    """

    def __init__(self, service: Service, group: str, deps: Mapping[str, Any],
                 group_id: str | None = None, restore: bool = False) -> None:
        self.service = service
        self.group = service.group(group)
        self.group_id = group_id or self.group.name
        routes = self.group.restore if restore else self.group.consumes
        self._topics = tuple(routes)
        self._handlers = {t.DESCRIPTOR.full_name: _bind(fn, deps, f"{service.name}/{group}")
                          for handlers in routes.values() for t, fn in handlers.items()}
        self._secondary = {t.DESCRIPTOR.full_name for t in self.group.secondary}
        self._durable = []
        for name in self.group.durable:
            if name not in deps:
                raise ValueError(f"{service.name}/{group}: durable dep {name!r} is not "
                                 "provided by the composition root")
            if not callable(getattr(deps[name], "flush", None)):
                raise ValueError(f"{service.name}/{group}: durable dep {name!r} "
                                 f"({type(deps[name]).__name__}) has no flush()")
            self._durable.append(deps[name])
        self._gate = threading.Lock()
        self._seen = threading.Lock()  # guards _next, read while a call runs
        self._next: dict[tuple[str, int], int] = {}
        self._busy: tuple[str, int] | None = None  # the partition of the call running

    def positions(self) -> dict[tuple[str, int], int]:
        """(topic, partition) → the offset after the last record this router was called
        with in this process (now, without waiting)."""
        with self._seen:
            return dict(self._next)

    def in_progress(self) -> tuple[str, int] | None:
        """(topic, partition) of the record being handled now, or None."""
        return self._busy

    @contextlib.contextmanager
    def paused(self):
        """Hold every call until the block ends, after the one in progress; yields
        (topic, partition) → the offset after the last record this router was called with
        in this process (partitions it has not seen are absent: their position is the
        group's committed offset)."""
        with self._gate:
            yield self.positions()

    def flush(self) -> None:
        """Make the writes of every record handled so far durable: ``flush()`` of each
        :attr:`Group.durable` dep, in order (nothing when the group names none). Call it
        before committing their offsets; raises what a flush raises (then commit
        nothing: the records are handled again, idempotently). Not serialised with
        calls: a write made meanwhile is flushed too, which is harmless."""
        for dep in self._durable:
            dep.flush()

    @property
    def topics(self) -> tuple[str, ...]:
        """The topics this router's handlers read (the group's, or its restore topics)."""
        return self._topics

    @functools.cached_property
    def types(self) -> frozenset[str]:
        """The CloudEvents types (``ce_type``) this router has handlers for."""
        return frozenset(codec.TYPE_PREFIX + name.rsplit(".", 1)[-1]
                         for name in self._handlers)

    def output_ids(self, causes: Iterable[str], topic: str, per_type: int = 8
                   ) -> dict[str, tuple[str, str, int]]:
        """The ids :meth:`encode` gives the outputs on ``topic`` of the events ``causes``
        (their :class:`EventMeta` ids): up to ``per_type`` outputs of each type the
        service publishes there, each → (cause, type name, n). An event can have more
        (an output sent in parts): :meth:`output_id` gives the next ones."""
        names = [t.DESCRIPTOR.name for t in self.service.produces.get(topic, ())]
        return {self.output_id(c, name, n): (c, name, n)
                for c in causes for name in names for n in range(per_type)}

    def output_id(self, cause: str, name: str, n: int) -> str:
        """The id :meth:`encode` gives the ``n``-th output (from 0) of type ``name`` of the
        event ``cause``."""
        return derive_id(cause, self.group.name, name, str(n))

    def handles(self, message: Message) -> bool:
        """True when this group has a handler for ``message``'s type."""
        return message.DESCRIPTOR.full_name in self._handlers

    def fails_operation(self, message: Message) -> bool:
        """False for the types this group handles off their operation's path."""
        return message.DESCRIPTOR.full_name not in self._secondary

    def __call__(self, env: Envelope, record: Record) -> list[OutRecord]:
        with self._gate:
            tp = (record.topic, record.partition)
            with self._seen:
                self._next[tp] = record.offset + 1
                self._busy = tp
            try:
                return self._handle(env, record)
            finally:
                self._busy = None

    def _handle(self, env: Envelope, record: Record) -> list[OutRecord]:
        m = env.message
        if m is None:
            return []
        fn = self._handlers.get(m.DESCRIPTOR.full_name)
        if fn is None:
            return []
        meta = meta_of(env, record)
        return self.encode(list(fn(m, meta) or []), meta.id, env.traceparent)

    def encode(self, outputs: Sequence[Message], cause: str,
               traceparent: str | None = None) -> list[OutRecord]:
        """``outputs`` of the handler of the event ``cause`` (its :class:`EventMeta` id) as
        records (see the class docstring)."""
        seen: dict[str, int] = {}
        records = []
        for out in outputs:
            if not isinstance(out, Message):
                raise TypeError(f"{self.group.name}: a handler returned {type(out).__name__}, "
                                "expected an event message")
            if not self.service.may_produce(out):
                raise TypeError(f"{self.service.name} does not declare that it produces "
                                f"{out.DESCRIPTOR.name} (services/{self.service.name}/routes.py)")
            name = out.DESCRIPTOR.name
            n = seen[name] = seen.get(name, -1) + 1
            records.append(codec.encode(
                out, bank_id=out.bank_id, source=self.service.source,
                event_id=self.output_id(cause, name, n),
                traceparent=traceparent))
        return records


def groups_of(services: Iterable[Service], distributed: bool) -> dict[str, tuple[str, ...]]:
    """Consumer group → topics, for the groups that run in the topology (``distributed``
    includes the :attr:`Group.distributed_only` ones)."""
    return {g.name: g.topics for s in services for g in s.groups if g.runs_in(distributed)}


def group_ids(services: Iterable[Service], distributed: bool, known: Iterable[str] = ()
              ) -> dict[str, tuple[str, ...]]:
    """Consumer group id on the log → topics, for every group that runs in the topology.
    Embedded, or for a ``"shared"`` group, its name. In the distributed topology a group
    run per replica (``"replica"``) is listed under each id of ``known`` (the log's
    groups) that is ``<name>.<replica>``; a ``"stores"`` group under its name when the
    log knows it (the replicas share store servers), else under those ids."""
    known = sorted(set(known))
    out: dict[str, tuple[str, ...]] = {}
    for s in services:
        for g in s.groups:
            if not g.runs_in(distributed):
                continue
            copies = [k for k in known if k.startswith(g.name + ".")
                      and "." not in k[len(g.name) + 1:]]
            if not distributed or g.state == "shared" or (g.state == "stores"
                                                          and g.name in known):
                out[g.name] = g.topics
            else:
                out.update((k, g.topics) for k in copies)
    return out


__all__ = ["Group", "Handler", "Router", "Service", "group_ids", "groups_of", "meta_of"]
