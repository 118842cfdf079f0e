"""Ports: the interfaces handlers depend on. Adapters live in ``mneme.bus`` and
``mneme.stores``; handlers receive them from the composition root (``mneme.bootstrap``).

All ports are synchronous and thread-safe: the embedded server calls them from gRPC
worker threads and from consumer threads at once.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from datetime import datetime
from typing import Protocol, Sequence

from mneme.domain import EntityRef, Fact, Filters, Hit, RetainItem, TimeWindow


# ---- event log ------------------------------------------------------------------------


@dataclass(frozen=True)
class Record:
    """One event on the log. ``offset`` is per (topic, partition), starting at 0;
    ``timestamp`` is epoch seconds of the append; ``headers`` carry the CloudEvents
    attributes (``ce_id``, ``ce_type``, ...)."""

    topic: str
    partition: int
    offset: int
    key: str
    value: bytes
    headers: dict[str, str] = field(default_factory=dict)
    timestamp: float = 0.0


@dataclass(frozen=True)
class OutRecord:
    """A record to append: the partition is chosen from ``key``."""

    topic: str
    key: str
    value: bytes
    headers: dict[str, str] = field(default_factory=dict)


class EventLog(Protocol):
    """A partitioned append-only log with consumer-group offsets (Kafka's model).

    Partition of a key: ``mneme.bus.partition_for(key, partitions)``, so one key's
    records stay in order. Offsets committed for a group are the *next* offset to read.
    """

    def ensure_topic(self, topic: str, partitions: int) -> None: ...

    def partitions(self, topic: str) -> int: ...

    def append(self, records: Sequence[OutRecord]) -> list[Record]:
        """Append durably (on return the records survive a crash); returns them with offsets."""

    def read(self, topic: str, partition: int, offset: int, limit: int = 100) -> list[Record]:
        """Records with offset >= ``offset``, in order, at most ``limit``."""

    def end_offset(self, topic: str, partition: int) -> int:
        """The offset the next appended record will get (the high watermark)."""

    def committed(self, group: str, topic: str, partition: int) -> int:
        """The group's next offset to read; 0 when it never committed."""

    def commit(self, group: str, offsets: dict[tuple[str, int], int],
               produce: Sequence[OutRecord] = ()) -> list[Record]:
        """Commit ``offsets`` for ``group`` after appending ``produce``. The embedded log
        does both in one transaction (exactly once); a Kafka adapter appends first, then
        commits (at least once, made exact by idempotent consumers)."""

    def reset_group(self, group: str, topics: Sequence[str] | None = None) -> None:
        """Forget the group's offsets (on ``topics``, or all), so it re-reads from 0."""

    def close(self) -> None: ...


# ---- stores ----------------------------------------------------------------------------


class VectorStore(Protocol):
    """Vectors plus the full fact payload (the source for get/list and recall hydration).

    Every call is scoped by ``bank_id``; nothing of another bank is ever returned.
    """

    def upsert(self, facts: Sequence[Fact]) -> None:
        """Insert or replace facts by id (idempotent)."""

    def delete(self, bank_id: str, ids: Sequence[str]) -> None: ...

    def delete_where(self, bank_id: str, document_id: str | None = None) -> list[str]:
        """Delete the bank's facts of ``document_id`` (or all of the bank when None);
        returns the deleted ids."""

    def search(self, bank_id: str, vector: Sequence[float], k: int,
               filters: Filters | None = None) -> list[Hit]:
        """kNN by cosine similarity, best first; ``Hit.score`` is the cosine."""

    def get(self, bank_id: str, ids: Sequence[str], with_vectors: bool = False) -> list[Fact]:
        """The facts with these ids (missing ids are skipped), in the order asked."""

    def scroll(self, bank_id: str, limit: int, after: str | None = None,
               filters: Filters | None = None) -> tuple[list[Fact], str | None]:
        """Page through the bank's facts in a stable order; returns (page, next cursor)."""

    def count(self, bank_id: str) -> int: ...

    def reset(self) -> None:
        """Drop every bank's data (used by replay before rebuilding)."""

    def close(self) -> None: ...


class TextStore(Protocol):
    """BM25 full-text index over fact text (English stemming), scoped by ``bank_id``."""

    def upsert(self, facts: Sequence[Fact]) -> None: ...

    def delete(self, bank_id: str, ids: Sequence[str]) -> None: ...

    def delete_where(self, bank_id: str, document_id: str | None = None) -> None: ...

    def search(self, bank_id: str, query: str, k: int,
               filters: Filters | None = None) -> list[Hit]:
        """BM25 ranking, best first; ``Hit.score`` is the BM25 score. Free text from the
        user must never raise a query-syntax error."""

    def count(self, bank_id: str) -> int: ...

    def reset(self) -> None: ...

    def close(self) -> None: ...


class GraphStore(Protocol):
    """Units, entities and links as a graph: (:Unit)-[:MENTIONS]->(:Entity),
    (:Unit)-[:LINK {kind, weight}]->(:Unit). Scoped by ``bank_id``."""

    def upsert(self, facts: Sequence[Fact]) -> None: ...

    def delete(self, bank_id: str, ids: Sequence[str]) -> None:
        """Delete units (and entities no unit mentions any more)."""

    def delete_where(self, bank_id: str, document_id: str | None = None) -> None: ...

    def find_entities(self, bank_id: str, keys: Sequence[str]) -> list[EntityRef]:
        """Entities of the bank whose canonical key (``mneme.nlp.entity_key``) is in ``keys``."""

    def spread(self, bank_id: str, seeds: dict[str, float], entity_ids: Sequence[str],
               k: int, hops: int = 2, decay: float = 0.5) -> list[Hit]:
        """Spreading activation: start from seed units (id → activation) and from the
        units mentioning ``entity_ids``; each hop along entity/causal/temporal/semantic
        links multiplies activation by ``decay`` × link weight. Returns the ``k`` most
        activated units (seeds included), best first."""

    def count(self, bank_id: str) -> int: ...

    def reset(self) -> None: ...

    def close(self) -> None: ...


# ---- models -----------------------------------------------------------------------------


class Embedder(Protocol):
    """Sentence embeddings; vectors are L2-normalised, ``dim`` floats each."""

    model_name: str
    dim: int

    def embed(self, texts: Sequence[str]) -> list[list[float]]: ...


class TokenCounter(Protocol):
    def count(self, text: str) -> int:
        """Number of tokens of ``text`` (offline tokenizer)."""


class Extractor(Protocol):
    """Turns one retain item into facts (without embeddings; the handler adds them)."""

    def extract(self, bank_id: str, item: RetainItem, item_index: int,
                source_id: str) -> list[Fact]:
        """Facts of ``item``; ids are ``derive_id(source_id, item_index, n)``."""


class QueryAnalyzer(Protocol):
    """What recall needs to know about a query before searching."""

    def entity_keys(self, query: str) -> list[str]:
        """Canonical keys of the entities mentioned in the query."""

    def time_window(self, query: str, now: datetime) -> TimeWindow | None:
        """The time window the query refers to, relative to ``now``; None if none."""
