"""mneme's topics on the event log: created with their partitions and configs
(:data:`mneme.bus.TOPIC_CONFIGS`) and checked, so that replay from offset 0 keeps working.

On Kafka a history topic (:data:`mneme.bus.HISTORY_TOPICS`) whose records would expire or
be compacted away is an error: projections could no longer be rebuilt from it, and it would
happen silently (Apache Kafka's default ``retention.ms`` is 7 days). Every service checks
at start and refuses to run (:class:`TopicConfigError`); ``mneme topics check`` reports the
same. So is a key topic (:data:`mneme.bus.KEYS`) that is not compacted (its keys would
expire, and every bank's content with them) or has more than one partition. Configs of
the other topics that differ from mneme's are warnings. The embedded log keeps every
record, so it has nothing to check.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from mneme.bus import (ALL_TOPICS, AUDIT, DLQ, HISTORY_TOPICS, INTAKE, KEYS, MANAGED_TOPICS,
                       MEMORY, default_partitions, partition_for)
from mneme.errors import ConfigurationError


class TopicConfigError(ConfigurationError):
    """The topics are not as mneme needs them: a history topic would lose records, or
    co-partitioned topics differ in partition count (the message names each)."""


@dataclass
class Report:
    """What :func:`check` found: ``errors`` (history topics that would lose records,
    partition counts a bank's records cannot be routed by) and ``warnings`` (other configs
    that differ from mneme's), one line each; ``expiring``: some error is a history topic
    whose records would expire or be compacted away."""

    errors: list[str] = field(default_factory=list)
    warnings: list[str] = field(default_factory=list)
    expiring: bool = False


def ensure(log, partitions: int | None = None, keys: bool = True) -> None:
    """Create every mneme topic that is missing: the DLQ and the audit trail with one
    partition (one total order for humans), the key topic with one (its order is its
    state; only with ``keys``: the embedded topology keeps its keys in a file), the
    others with ``partitions`` or their default (:func:`mneme.bus.default_partitions`)."""
    for t in MANAGED_TOPICS if keys else ALL_TOPICS:
        log.ensure_topic(t, 1 if t in (DLQ, AUDIT, KEYS)
                         else partitions or default_partitions(t))


def check(log, partitions: int | None = None) -> Report:
    """Compare the topics' configs on ``log`` with mneme's (a log without
    ``topic_configs``, the embedded one, passes); a missing topic is an error naming
    ``mneme topics create``. On Kafka, a bank-keyed topic (:data:`BANK_KEYED`) is also an
    error when its partition count is not ``partitions`` (``MNEME_PARTITIONS`` when set;
    None: not compared, the topics' own count is used) or when the first or last record of one of its partitions is not on the
    partition its key is routed to now (partitions were added after it was written)."""
    report = Report()
    counts = {t: log.partitions(t) for t in CO_PARTITIONED}
    if len(set(counts.values()) - {0}) > 1:
        report.errors.append(
            " and ".join(f"{t} has {n} partitions" for t, n in counts.items())
            + ": a replica restores a bank's state from these topics by partition number, "
            "so they need the same partition count (recreate them with `mneme topics "
            "create`)")
    describe = getattr(log, "topic_configs", None)
    if describe is None:
        return report
    have = describe(list(MANAGED_TOPICS))
    report.errors += _partition_errors(log, partitions)
    for t in MANAGED_TOPICS:
        if not log.partitions(t):  # its configs would read as "not set"
            report.errors.append(f"{t} does not exist: create the topics with "
                                 "`mneme topics create`")
            continue
        got, wanted = have.get(t, {}), log.configs_for(t)
        limit, sends = got.get("max.message.bytes"), getattr(
            getattr(log, "options", None), "max_request_size", 0)
        if limit is not None and limit.isdigit() and int(limit) < sends:
            report.errors.append(
                f"{t}: max.message.bytes={limit} refuses records the producer may send "
                f"(MNEME_KAFKA_MAX_REQUEST_SIZE={sends}): set max.message.bytes={sends} "
                "or lower the setting")
        if t == KEYS:
            report.errors += _key_topic_errors(got, log.partitions(t))
            continue
        if t in HISTORY_TOPICS:
            for name in ("retention.ms", "retention.bytes"):
                value = got.get(name)
                if value is None and name == "retention.ms":
                    report.expiring = True
                    report.errors.append(f"{t}: retention.ms is not set, so the broker's "
                                         "default applies (7 days on Apache Kafka): history "
                                         "would expire; set retention.ms=-1")
                elif value is not None and value != "-1":
                    report.expiring = True
                    report.errors.append(f"{t}: {name}={value} would expire history; "
                                         f"set {name}=-1")
            if "compact" in got.get("cleanup.policy", ""):
                report.expiring = True
                report.errors.append(f"{t}: cleanup.policy={got['cleanup.policy']} would "
                                     "drop a bank's older events; set cleanup.policy=delete")
            continue
        for name, value in wanted.items():
            if got.get(name, value) != value:
                report.warnings.append(f"{t}: {name}={got[name]} (mneme creates it with "
                                       f"{value})")
    return report


#: Topics keyed by bank and created with ``MNEME_PARTITIONS`` partitions: a bank's records
#: are on partition ``partition_for(bank, count)``, so the count must never change.
BANK_KEYED: tuple[str, ...] = tuple(t for t in ALL_TOPICS if t not in (DLQ, AUDIT))

_SEE = "see the README's Runbook, \"Partitions changed\""


def _partition_errors(log, partitions: int | None) -> list[str]:
    """Bank-keyed topics whose partition count is not ``partitions``, or whose records
    sit on partitions their keys are no longer routed to (Kafka's partitioner takes the
    key's hash modulo the count, so another count moves most banks)."""
    errors = []
    other: dict[int, list[str]] = {}  # count → the topics that have it
    for t in BANK_KEYED:
        n = log.partitions(t)
        if partitions and n and n != partitions:
            other.setdefault(n, []).append(t)
    for n, names in other.items():
        errors.append(
            f"{' and '.join(names)} {'has' if len(names) == 1 else 'have'} {n} partitions "
            f"but MNEME_PARTITIONS={partitions}: a bank's records are routed by the "
            f"partition count, which must stay what the topics were created with; set "
            f"MNEME_PARTITIONS={n} on every process (an existing topic keeps its "
            f"partitions), or {_SEE}")
    edge_keys = getattr(log, "edge_keys", None)
    if edge_keys is None:
        return errors
    keyed = [t for t in BANK_KEYED if log.partitions(t)]
    samples: dict[str, list[tuple[int, str]]] = {t: [] for t in keyed}
    for (t, p), keys in sorted(edge_keys(keyed).items()):
        samples[t].extend((p, k) for k in keys)
    for t, placed in samples.items():
        n = log.partitions(t)
        wrong = [(p, k) for p, k in placed if partition_for(k, n) != p]
        if not wrong:
            continue
        p, k = wrong[0]
        fits = [m for m in range(max(q for q, _ in placed) + 1, n)  # Kafka only adds
                if all(partition_for(key, m) == q for q, key in placed)]
        then = (f"; its records fit {' or '.join(map(str, fits[:3]))} partitions"
                if fits else "")
        errors.append(
            f"{t} has {n} partitions but its records were written with another count "
            f"(bank {k!r} is on partition {p}, and {n} partitions route it to "
            f"{partition_for(k, n)}{then}): partitions were added after records were "
            f"written, so a bank's new records would go to another partition than its old "
            f"ones (out of order, and restored by the wrong replica); Kafka cannot remove "
            f"partitions: {_SEE}")
    return errors


def _key_topic_errors(got: dict[str, str], partitions: int) -> list[str]:
    errors = []
    policy = got.get("cleanup.policy")
    if policy is None or "compact" not in policy:
        errors.append(f"{KEYS}: cleanup.policy={policy or '(not set: the broker default, delete)'}"
                      " would expire the wrapped keys, and every bank's content with them; "
                      "set cleanup.policy=compact")
    elif "delete" in policy and got.get("retention.ms") != "-1":
        errors.append(f"{KEYS}: cleanup.policy={policy} with retention.ms="
                      f"{got.get('retention.ms', '(not set)')} would expire the wrapped keys; "
                      "set cleanup.policy=compact")
    if partitions > 1:
        errors.append(f"{KEYS} has {partitions} partitions: the key store needs exactly 1 "
                      "(its records' order is the key state); recreate it")
    return errors


#: Topics read together by partition number (a partition's changelog restore,
#: :attr:`mneme.router.Group.restore`): they must have the same partition count.
CO_PARTITIONED = (INTAKE, MEMORY)


def require_history(log, partitions: int | None = None) -> None:
    """Raise TopicConfigError when :func:`check` (with ``partitions``, MNEME_PARTITIONS)
    finds errors (the service refuses to start: fix the topics with ``kafka-configs
    --alter`` or recreate them with ``mneme topics create``)."""
    report = check(log, partitions)
    if report.errors:
        why = (" (history must never expire, so that replay and restore can rebuild the "
               "projections)" if report.expiring else "")
        raise TopicConfigError("the event log's topics are not as mneme needs them"
                               + why + ": " + "; ".join(report.errors)
                               + " (see `mneme topics check`)")


__all__ = ["BANK_KEYED", "Report", "TopicConfigError", "check", "ensure", "require_history"]
