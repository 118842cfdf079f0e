"""The event bus: topic names, Kafka-compatible partitioning and event-log adapters.

Topics (DESIGN §3), each keyed by ``bank_id`` so one bank's events stay in order:

====================  =========================================================
``mneme.intake.v1``   what users asked (banks, retains, deletions)
``mneme.memory.v1``   what the system derived (facts, retractions)
``mneme.progress.v1`` operation progress, projection watermarks
``mneme.reflect.v1``  reflections (audit)
``mneme.dlq.v1``      events that failed after retries, with the error
``mneme.audit.v1``    bank deletions, key use and refused requests (audit)
``mneme.keys.v1``     crypto-shredding's wrapped keys (Kafka only; compacted
                      state, not events: :mod:`mneme.stores.keys_kafka`)
====================  =========================================================

Adapters are chosen by URL with :func:`mneme.bus.logs.open_event_log` (the composition
root's; this package itself imports no adapter); the embedded one is
:class:`mneme.bus.sqlite_log.SqliteEventLog`.
"""

from __future__ import annotations

from functools import lru_cache
from typing import Callable, Sequence, TypeVar

_T = TypeVar("_T")

INTAKE = "mneme.intake.v1"
MEMORY = "mneme.memory.v1"
PROGRESS = "mneme.progress.v1"
REFLECT = "mneme.reflect.v1"
DLQ = "mneme.dlq.v1"
AUDIT = "mneme.audit.v1"
#: The wrapped keys of crypto-shredding in the distributed topology: a compacted topic of
#: one partition whose records (JSON, no CloudEvents) every process materialises
#: (:mod:`mneme.stores.keys_kafka`). Not an event topic: not in :data:`ALL_TOPICS`
#: (what the services consume and the AsyncAPI document describes), and not for other
#: consumers.
KEYS = "mneme.keys.v1"

#: Encoded bytes (before sealing) of the elements one record of an event that may grow
#: with its request carries at most (FactsExtracted's facts, ObservationsChanged's
#: observations and ids): a larger one goes out in parts. Half of Kafka's default record
#: limit (1 MiB: the producer's ``max.request.size``, the broker's
#: ``message.max.bytes``), leaving room for what sealing adds (a nonce, a tag and the
#: key ids per element, ~100 bytes) and the record's headers. The services use
#: :func:`part_bytes` of the configured limit (``MNEME_KAFKA_MAX_REQUEST_SIZE``).
PART_BYTES = 512 * 1024


def part_bytes(max_request_size: int) -> int:
    """The part budget (bytes of elements per record, see :data:`PART_BYTES`) for a
    producer whose records may be ``max_request_size`` bytes: half of it, as the
    default's is of Kafka's 1 MiB."""
    return max_request_size // 2


def pack(elements: Sequence[_T], size: Callable[[_T], int], room: int) -> list[list[_T]]:
    """``elements`` in order, cut into consecutive groups whose ``size`` (bytes) adds up
    to at most ``room`` each (an element larger than that alone): the parts of an event
    sent in parts (:data:`PART_BYTES`). Deterministic; [[]] for no elements."""
    groups: list[list[_T]] = [[]]
    used = 0
    for e in elements:
        n = size(e)
        if groups[-1] and used + n > room:
            groups.append([])
            used = 0
        groups[-1].append(e)
        used += n
    return groups

#: The event topics.
ALL_TOPICS: tuple[str, ...] = (INTAKE, MEMORY, PROGRESS, REFLECT, DLQ, AUDIT)

#: Every topic mneme creates and checks on Kafka (``mneme topics create|check``).
MANAGED_TOPICS: tuple[str, ...] = (*ALL_TOPICS, KEYS)

#: Partitions of a topic a consumer or producer creates when it finds none
#: (Kafka's ``auto.create.topics.enable`` with ``num.partitions``).
DEFAULT_PARTITIONS = 4

#: Partitions of the topics mneme creates on Kafka when ``MNEME_PARTITIONS`` is unset:
#: a shared consumer group runs on at most this many replicas, and 12 splits evenly
#: over 1, 2, 3, 4 or 6 of them.
KAFKA_PARTITIONS = 12

#: Default partition counts. The DLQ has one partition: it is low volume and read by
#: humans, so one total order is more useful than parallelism.
TOPIC_PARTITIONS: dict[str, int] = {INTAKE: 4, MEMORY: 4, PROGRESS: 4, REFLECT: 4, DLQ: 1,
                                   AUDIT: 1, KEYS: 1}

#: The history topics: their records are the source every projection is rebuilt from, so
#: they must never expire (replay from offset 0).
HISTORY_TOPICS: tuple[str, ...] = (INTAKE, MEMORY)

#: Kafka topic configs mneme creates its topics with (and ``mneme topics check``
#: verifies): history, reflections and the audit trail kept forever; progress (what
#: read-your-writes waits on) for 7 days; dead letters for 30 days (time to inspect and
#: re-publish them); the key topic compacted (each record key's latest value kept for ever,
#: so a destroyed key's wrapped bytes go and its "destroyed" marker stays).
#: ``min.insync.replicas`` comes from the replication factor.
TOPIC_CONFIGS: dict[str, dict[str, str]] = {
    INTAKE: {"retention.ms": "-1", "retention.bytes": "-1", "cleanup.policy": "delete"},
    MEMORY: {"retention.ms": "-1", "retention.bytes": "-1", "cleanup.policy": "delete"},
    REFLECT: {"retention.ms": "-1", "cleanup.policy": "delete"},
    AUDIT: {"retention.ms": "-1", "cleanup.policy": "delete"},
    PROGRESS: {"retention.ms": str(7 * 86_400_000), "cleanup.policy": "delete"},
    DLQ: {"retention.ms": str(30 * 86_400_000), "cleanup.policy": "delete"},
    KEYS: {"cleanup.policy": "compact", "retention.ms": "-1"},
}


class StaleCommitError(RuntimeError):
    """A consumer-group commit was refused because the group's stored offset is already
    past it (or equal to it while records were to be produced): another consumer of the
    group handled those records, and producing again would duplicate them. Nothing of
    the commit was written; re-read the committed offset and carry on from there."""


def partition_for(key: str | bytes, partitions: int) -> int:
    """Partition of ``key`` among ``partitions``: Kafka's default partitioner for keyed
    records, ``toPositive(murmur2(utf8(key))) % partitions`` where ``toPositive(x) =
    x & 0x7fffffff`` (``org.apache.kafka.clients.producer.internals.BuiltInPartitioner
    .partitionForKey``), computed by aiokafka's ``DefaultPartitioner`` (the one its
    producer uses). So the embedded log and a Kafka producer put a bank on the same
    partition number.

    Raises ValueError when ``partitions`` < 1.
    """
    if partitions < 1:
        raise ValueError(f"partitions must be >= 1, got {partitions}")
    return _partition(key if isinstance(key, str) else bytes(key), partitions)


@lru_cache(maxsize=65536)  # keys are bank ids, few and hot; murmur2 in Python is ~5 µs
def _partition(key: str | bytes, partitions: int) -> int:
    # Imported here, not at the top: ``aiokafka.partitioner`` runs aiokafka's package
    # __init__ (client, consumer, producer, asyncio: ~100 ms), which importing mneme.bus
    # (~6 ms, used by the CLI and every embedded process) should not pay.
    from aiokafka.partitioner import DefaultPartitioner

    data = key.encode("utf-8") if isinstance(key, str) else key
    return DefaultPartitioner()(data, range(partitions), None)


def default_partitions(topic: str) -> int:
    """Partition count to create ``topic`` with: :data:`TOPIC_PARTITIONS` or
    :data:`DEFAULT_PARTITIONS`."""
    return TOPIC_PARTITIONS.get(topic, DEFAULT_PARTITIONS)


__all__ = [
    "ALL_TOPICS", "DEFAULT_PARTITIONS", "DLQ", "HISTORY_TOPICS", "INTAKE", "KAFKA_PARTITIONS",
    "KEYS", "MANAGED_TOPICS", "MEMORY", "PROGRESS",
    "REFLECT", "TOPIC_CONFIGS",
    "StaleCommitError", "TOPIC_PARTITIONS", "default_partitions",
    "partition_for",
]
