"""Ports: the interfaces handlers depend on. Adapters live in ``mneme.bus`` and
``mneme.stores``; handlers receive them from the composition root (``mneme.bootstrap``).

All ports are synchronous and thread-safe: the embedded server calls them from gRPC
worker threads and from consumer threads at once.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from datetime import datetime
from typing import TYPE_CHECKING, Callable, Hashable, Iterable, Iterator, Protocol, Sequence

from mneme.domain import (Bank, BankConfig, Directive, DocumentRevision, EntityInfo, EntityRef,
                          Fact, Filters, Hit, MentalModel, MentalModelRevision, Operation,
                          RetainItem, StoredDocument, TimeWindow)

if TYPE_CHECKING:  # for annotations only: ports import no protobuf or LLM code at run time
    from contextlib import AbstractContextManager

    from mneme.events.v1 import events_pb2 as ev
    from mneme.llm.types import Completion, Connectivity, JsonResult, Usage
    from mneme.llm.settings import Endpoint, LlmSettings


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

    def groups(self, live_only: bool = False) -> list[str]:
        """Ids of the consumer groups the log knows (with committed offsets), sorted;
        ``live_only``: those with members now, where the log knows membership."""

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

    def count(self, bank_id: str, filters: Filters | None = None) -> int:
        """Number of the bank's units matching ``filters`` (all when None), exact, counted
        by the store (no paging through them)."""

    def facet(self, bank_id: str, key: str, limit: int,
              filters: Filters | None = None) -> list[tuple[str, int]]:
        """The distinct values of the indexed payload field ``key`` (``tags`` or
        ``document_id``) among the bank's units matching ``filters``, with how many units
        hold each: at most ``limit`` pairs, most units first (ties by value), counted by
        the store. ValueError for another key or ``limit`` < 1."""

    def reset(self) -> None:
        """Drop every bank's data (used by replay before rebuilding)."""

    def flush(self) -> None:
        """Make every write made so far durable. Writes are visible to reads when they
        return; they are durable only after flush (or close). Consumers call it before
        committing the offsets of the records whose writes these were (a crash before
        the commit redelivers those records, and the idempotent writes are made again).
        An adapter whose writes are durable on return implements it as a no-op.

        Deletions, too, are physical once it returns: no file of the store holds the
        deleted units' text or vectors any more (an adapter whose deletes leave them in
        its files until a compaction runs it here, once for every deletion since the
        last flush; the consumers call it before committing, so a deletion's operation
        succeeds only after it)."""

    def close(self) -> None:
        """Flush (see :meth:`flush`) and release the store."""


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

    def flush(self) -> None:
        """As :meth:`VectorStore.flush`: every write so far durable, deletions physical."""

    def close(self) -> None:
        """Flush and release the store."""


class GraphStore(Protocol):
    """Units, entities and links as a graph: (:Unit)-[:MENTIONS]->(:Entity),
    (:Unit)-[:LINK {kind, weight}]->(:Unit). Scoped by ``bank_id``."""

    def upsert(self, facts: Sequence[Fact]) -> None: ...

    def delete(self, bank_id: str, ids: Sequence[str]) -> None:
        """Delete units (and entities no unit mentions any more, but a split's new entity
        while the entity it was split off exists; see :meth:`split_entity`)."""

    def delete_where(self, bank_id: str, document_id: str | None = None) -> None: ...

    def count_entities(self, bank_id: str) -> int:
        """Number of the bank's entities (0 for an unknown bank)."""

    def entities(self, bank_id: str, limit: int, after: str = "", tags: Sequence[str] = (),
                 tags_match: str = "any") -> list[EntityInfo]:
        """The next ``limit`` of the bank's entities in id order after ``after`` (mention
        counts, no units or neighbours). With a tag filter (``tags`` in ``tags_match``
        mode, :func:`mneme.domain.tags_match`) counts and first/last seen are over the
        units passing it; one no such unit mentions is in the page with 0 mentions. Units
        whose tags the store does not hold (projected before it kept them) pass no
        filter. ValueError for an unknown mode."""

    def entity(self, bank_id: str, entity_id: str, units: int = 100,
               neighbours: int = 20, tags: Sequence[str] = (),
               tags_match: str = "any") -> EntityInfo | None:
        """One entity with the units mentioning it and its co-mentioned neighbours (with a
        tag filter, as :meth:`entities`: the units passing it only)."""

    def merge_entities(self, bank_id: str, survivor_id: str, merged_ids: Sequence[str],
                       display_name: str = "") -> None:
        """A user's merge: the units mentioning any of ``merged_ids`` mention
        ``survivor_id`` instead, its aliases are the union of theirs (and the key of a
        ``display_name`` that renames it), the merged entities are deleted. Idempotent;
        nothing happens when the survivor does not exist (merged away or deleted since the
        merge was checked), as in entity resolution."""

    def split_entity(self, bank_id: str, entity_id: str, new_id: str, aliases: Sequence[str],
                     display_name: str, unit_ids: Sequence[str]) -> None:
        """A user's split: a new entity ``new_id`` named ``display_name`` takes the alias
        keys ``aliases`` of ``entity_id`` and the mentions of the units ``unit_ids``. The
        new entity exists without mentions while ``entity_id`` (or the survivor of a merge
        of it) exists, and is deleted with it. Idempotent."""

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

    def flush(self) -> None:
        """As :meth:`VectorStore.flush`: every write so far durable, deletions physical."""

    def close(self) -> None:
        """Flush and release the store."""


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


# ---- state ------------------------------------------------------------------------------


class Catalog(Protocol):
    """Banks, their directives and operations: the projection of ``mneme.intake.v1`` (bank
    upserts and deletes, directive changes, requests) and ``mneme.progress.v1`` (operation progress). Every write is an
    idempotent upsert, so redelivered and replayed events change nothing. Times are epoch
    seconds (float) on the way in; :class:`~mneme.domain.Bank` carries aware UTC datetimes,
    :class:`~mneme.domain.Operation` epoch seconds. Adapters: ``mneme.stores.catalog_sqlite``
    (SQLite), ``mneme.stores.memory.MemoryCatalog`` (tests)."""

    def upsert_bank(self, bank_id: str, display_name: str, config: BankConfig, at: float,
                    mask: tuple[str, ...] = ()) -> None:
        """Create the bank or change it at time ``at``. An empty ``mask`` replaces name and
        config; otherwise only the fields it names change ("display_name",
        "config.<field>"; other paths are ignored) and a bank that does not exist stays
        absent (an update never creates). A change keeps ``created_at`` and
        ``incarnation``. Each creation of an id (the first one, and each one after a
        :meth:`delete_bank`) gets the next incarnation: "1", "2", …, counted across
        deletions, so every projection and every replay of the same log agree. A creation
        drops the operations of an earlier incarnation (created before ``at``); those
        created since, projected before the creation from the progress topic, stay."""

    def delete_bank(self, bank_id: str, at: float | None = None) -> None:
        """Remove the bank and its operations. Those operations never come back: later
        :meth:`put_operation` / :meth:`update_operation` calls for their ids are dropped,
        even under a re-created bank of the same id. Deleting an unknown bank is a no-op
        (apart from counting the id's generation as used). ``at`` (the deletion's time,
        epoch seconds): operations created after it stay, as a later incarnation's
        (progress and requests are read from two topics, so a rebuild may project a
        re-created bank's progress before this deletion)."""

    def get_bank(self, bank_id: str) -> Bank | None:
        """The bank, or None when it does not exist."""

    def list_banks(self, limit: int, after: str = "") -> list[Bank]:
        """Banks with ``bank_id > after``, ordered by id, at most ``limit``."""

    def upsert_directive(self, d: Directive, mask: tuple[str, ...] = ()) -> None:
        """Create the directive ``d`` (at ``d.updated_at``), or change it: an empty
        ``mask`` replaces every field, otherwise only those it names
        (:data:`mneme.domain.DIRECTIVE_FIELDS`) change, and a directive that does not
        exist stays absent. A change keeps ``created_at``. Ignored for a bank that does
        not exist (its directives went with it)."""

    def delete_directive(self, bank_id: str, directive_id: str) -> None:
        """Remove the directive (no-op when unknown). :meth:`delete_bank` removes them all."""

    def get_directive(self, bank_id: str, directive_id: str) -> Directive | None:
        """The directive, or None."""

    def list_directives(self, bank_id: str, limit: int, after: str = "") -> list[Directive]:
        """The bank's directives with ``id > after``, ordered by id, at most ``limit``."""

    def upsert_mental_model(self, m: MentalModel, mask: tuple[str, ...] = (),
                            refresh: MentalModelRevision | None = None) -> None:
        """Create ``m`` (at ``m.updated_at``) or change the fields ``mask`` names
        (:data:`mneme.domain.MENTAL_MODEL_FIELDS`; an update never creates). A change of
        the content adds a revision (once per event time: a redelivered event adds none);
        ``refresh`` (a refresh's result) also sets ``based_on``, ``refreshed_at`` and
        ``memory_offset``. Ignored for a bank that does not exist."""

    def erase_mental_model_sources(self, bank_id: str, memory_ids: Iterable[str],
                                   document_id: str = "",
                                   gone: Callable[[str], bool] | None = None) -> int:
        """Deleted memories (``memory_ids``, every memory of ``document_id`` when given,
        and the facts behind a cited observation that ``gone(fact_id)`` says are deleted)
        out of the bank's mental models: each revision whose ``based_on`` cites one is
        removed, and a model whose current content does falls back to its latest
        remaining revision (:func:`mneme.domain.erase_mental_model_sources`). Returns how
        many models changed; idempotent."""

    def delete_mental_model(self, bank_id: str, model_id: str) -> None:
        """Remove the model and its revisions (no-op when unknown)."""

    def get_mental_model(self, bank_id: str, model_id: str) -> MentalModel | None:
        """The model, or None."""

    def list_mental_models(self, bank_id: str, limit: int, after: str = "") -> list[MentalModel]:
        """The bank's models with ``id > after``, ordered by id, at most ``limit``."""

    def mental_model_revisions(self, bank_id: str, model_id: str) -> list[MentalModelRevision]:
        """Every revision of the model's content, oldest first."""

    def put_operation(self, op: Operation) -> None:
        """Insert ``op`` if its id is new; a known id keeps what it has (a redelivered
        request keeps its progress), except that one without a ``source`` (its progress
        was projected before its request) takes ``op``'s ``source`` and ``retry_of``."""

    def update_operation(self, op: Operation) -> None:
        """Replace the operation's progress with ``op`` (inserting it if unknown), keeping
        the stored ``created_at``, ``retry_of`` and ``source`` (when ``op``'s are empty) and a
        stored ``cancel_requested``. The first terminal state (:data:`mneme.domain.TERMINAL`)
        is final: once stored, later updates (a late event, a dead letter after success)
        change nothing."""

    def get_operation(self, operation_id: str) -> Operation | None:
        """The operation (a fresh copy: mutating it changes nothing stored), or None."""

    def count_operations(self, bank_id: str) -> tuple[int, int]:
        """(operations, of which not yet terminal) of the bank, counted by the catalog."""

    def list_operations(self, bank_id: str, limit: int,
                        after: tuple[float, str] | None = None, *, state: str = "",
                        kind: str = "") -> list[Operation]:
        """Newest first (``created_at`` descending, then ``operation_id`` ascending), at
        most ``limit``, only those after ``after`` in that order (the ``(created_at,
        operation_id)`` of the previous page's last one: operations added or deleted
        meanwhile shift nothing); ``bank_id`` "" lists every bank's. ``state`` (one of
        :data:`mneme.domain.OPERATION_STATES`) and ``kind`` ("" : any) keep only those
        operations, selected by the store's query (a page is ``limit`` of them whenever
        that many are left)."""

    def reset(self) -> None:
        """Forget everything, bank generations and deleted operations included (replay
        rebuilds it from the log)."""

    def close(self) -> None: ...


class ObservationStore(Protocol):
    """consolidation's projection: the facts it has seen, each with its scopes (tag sets,
    sorted tag lists) and whether it is consolidated, and the current state of every
    observation. Facts and observation states are ``mneme.events.v1`` protobuf messages
    (``ev.Fact``, ``ev.Observation``); the store is rebuilt on replay from
    ``FactsExtracted`` / ``FactsRetracted`` / ``ObservationsChanged`` alone. Scopes are
    compared as sets (``["b", "a"]`` is ``["a", "b"]``). Every call is scoped by
    ``bank_id``. Adapters: ``mneme.stores.observations_sqlite`` (SQLite),
    ``mneme.stores.memory.MemoryObservationStore`` (tests)."""

    def add_facts(self, bank_id: str, facts: Iterable[tuple["ev.Fact", list[list[str]]]]) -> None:
        """Record facts as pending, each with its scopes, after those already held (arrival
        order). A fact id the bank already holds keeps its data, scopes and state."""

    def facts(self, bank_id: str, ids: Iterable[str] | None = None, pending: bool = False
              ) -> list[tuple["ev.Fact", list[list[str]]]]:
        """(fact, scopes) in arrival order: those of ``ids`` (unknown ids skipped) or all,
        and only the unconsolidated ones with ``pending``."""

    def facts_by_id(self, bank_id: str, ids: Iterable[str]) -> dict[str, "ev.Fact"]:
        """id → fact for those of ``ids`` the bank holds (unknown ids left out)."""

    def fact_ids_of_document(self, bank_id: str, document_id: str) -> list[str]:
        """Ids of the bank's facts of ``document_id``, in arrival order."""

    def delete_facts(self, bank_id: str, ids: Iterable[str]) -> None:
        """Forget these facts (unknown ids are ignored); observations are untouched."""

    def delete_bank(self, bank_id: str) -> None:
        """Forget the bank's facts and observations."""

    def observations(self, bank_id: str, scope: list[str] | None = None,
                     include_deleted: bool = False) -> dict[str, "ev.Observation"]:
        """id → state of the bank's observations, ordered by id: of one ``scope`` (None:
        every scope), live ones only unless ``include_deleted``."""

    def revision(self, bank_id: str) -> Hashable:
        """An opaque value that changes whenever the bank's observation states held here
        change (an apply that stores any state, a re-embed, the bank's deletion, a reset)
        and is never repeated by another store instance: a caller that keeps observations
        in memory compares it to know they are still what the store holds. Not durable
        (a store opened again starts a new series)."""

    def transaction(self) -> "AbstractContextManager[None]":
        """A block whose writes are one atomic unit: all of them, or (when it raises, or
        the process dies before it ends) none. Blocks nest (the outermost one commits).
        consolidation handles each event in one, with :meth:`record_decision`."""

    def decision(self, cause: str) -> "list | None":
        """The outputs :meth:`record_decision` kept for the event id ``cause`` (messages,
        in order); [] when it was decided here but its outputs are no longer kept (too
        long ago, or the bank forgot facts since): it was handled, so it must not be
        decided again; None: not decided here. Its outputs are then on the log except in
        one case: a later event of the same consumer batch forgot facts and the batch's
        outputs were never appended (a crash or failed append before the batch's commit),
        which loses the earlier events' outputs (a known gap; forgetting only the outputs
        that cite the forgotten facts would close it)."""

    def record_decision(self, bank_id: str, cause: str, outputs: Sequence) -> None:
        """Keep the outputs (``mneme.events.v1`` messages) that the event ``cause`` of
        ``bank_id`` decided, with its writes (inside its :meth:`transaction`), until its
        outputs are surely on the log: the latest 10,000 events' outputs are kept; a
        bank's are forgotten when it forgets facts (they may quote them); the causes
        stay (:meth:`decision` answers [] for them) until the bank is deleted."""

    def apply(self, m: "ev.ObservationsChanged") -> None:
        """Apply one ObservationsChanged atomically: store each observation state whose
        ``version`` is higher than the stored one (an equal or older one is ignored; a
        deleted state is stored as its tombstone, ``mneme.stores.observations_sqlite.
        tombstone``: id, scope, version, times, none of its text, evidence or history), then
        mark ``reset_memory_ids`` pending and ``consolidated_memory_ids`` consolidated
        (unknown ids ignored). Idempotent: applying it again changes nothing."""

    def counts(self, bank_id: str) -> tuple[int, int, int]:
        """(facts, of them consolidated, observation states incl. deleted ones) of the
        bank, counted in the store: what a replay's check compares."""

    def dump(self, bank_id: str) -> list[bytes]:
        """Every observation state of the bank (deleted ones included), ordered by id, as
        deterministic protobuf bytes: what a replay must reproduce byte for byte."""

    def apply_opinions(self, m: "ev.OpinionsChanged") -> None:
        """Apply one OpinionsChanged atomically: store each opinion state whose ``version``
        is higher than the stored one (a deleted one as its tombstone,
        ``mneme.bus.codec.opinion_tombstone``, about no entity any more). Idempotent."""

    def opinions(self, bank_id: str, ids: Iterable[str] | None = None,
                 entity_ids: Iterable[str] | None = None, limit: int = 1000
                 ) -> "dict[str, ev.Opinion]":
        """id → state of the bank's live opinions, ordered by id, at most ``limit``: those
        in ``ids`` and about any of ``entity_ids`` (each filter only when not None)."""

    def dump_opinions(self, bank_id: str) -> list[bytes]:
        """Every opinion state of the bank (deleted ones as tombstones), ordered by id, as
        deterministic protobuf bytes: what a replay must reproduce byte for byte."""

    def replace_vectors(self, bank_id: str, vectors: "dict[str, list[float]]",
                        model: str) -> None:
        """A re-embed (``VectorsReplaced``): each fact, live observation and live opinion
        of the bank whose id is in ``vectors`` (id → vector) gets that vector (observations
        and opinions ``model`` as their ``embedding_model``; versions unchanged); other
        ids are skipped. Atomic, idempotent."""

    def flush(self) -> None:
        """Make every write so far durable: a no-op for a store whose every write is
        (the live one); a store opened for a replay's build may write without syncing
        and syncs here, before the replay switches to it."""

    def reset(self) -> None:
        """Forget every bank (replay rebuilds it)."""

    def close(self) -> None: ...


class DocumentStore(Protocol):
    """search's document projection of ``mneme.intake.v1``: per (bank, document id) its
    retains (:class:`~mneme.domain.DocumentRevision`, the upsert history) and the latest
    retain's original text when the bank stores documents; per bank whether it does.
    Rebuilt by replay from ``BankUpserted`` / ``RetainRequested`` /
    ``DocumentDeleteRequested`` / ``BankDeleted`` alone. A deleted document or bank
    leaves nothing of its text behind (SQLite: secure_delete, WAL truncated). Every call
    is scoped by ``bank_id``. Adapters: ``mneme.stores.documents_sqlite`` (SQLite),
    ``mneme.stores.memory.MemoryDocumentStore`` (tests)."""

    def set_storage(self, bank_id: str, store_text: bool) -> None:
        """Whether the bank's later retains keep their text (its ``store_documents``)."""

    def storage(self, bank_id: str) -> bool:
        """The bank's setting; True for a bank never set."""

    def add_revisions(self, bank_id: str,
                      entries: Sequence[tuple[str, DocumentRevision, str | None]]) -> int:
        """Record, in one write, each (document id, revision, text): a retain of the
        document at ``rev.at``, made its latest: its text becomes ``text`` (None: not
        stored; the previous text is dropped). The revision number is the next one of
        the document (``rev.revision`` is ignored). The earlier revisions lose their
        text's fingerprint (``content_hash``, ``chars``, ``context``, ``text_stored``
        cleared): the retain replaced that text, and erased it from the log (its keys
        destroyed), so a replay reads them as erased and records them so. Idempotent: a
        retain whose ``operation_id`` the document already has changes nothing. Returns
        how many were recorded."""

    def delete_document(self, bank_id: str, document_id: str) -> bool:
        """Forget the document, its text and its history; True when it was held."""

    def delete_bank(self, bank_id: str) -> None:
        """Forget the bank's documents and its setting."""

    def get(self, bank_id: str, document_id: str) -> StoredDocument | None:
        """The document with its latest revision and text, or None."""

    def revisions(self, bank_id: str, document_id: str, limit: int) -> list[DocumentRevision]:
        """The document's latest ``limit`` revisions, oldest first ([] when unknown)."""

    def list(self, bank_id: str, limit: int, after: str = "") -> list[StoredDocument]:
        """The bank's documents with ``document_id > after`` in id order, at most
        ``limit``, without their text (``text`` None)."""

    def count(self, bank_id: str) -> int:
        """Number of the bank's documents."""

    def dump(self, bank_id: str) -> list[bytes]:
        """Every document of the bank with its history and text, by id, as deterministic
        bytes: what a replay must reproduce byte for byte."""

    def reset(self) -> None:
        """Forget every bank (replay rebuilds it)."""

    def close(self) -> None: ...


@dataclass(frozen=True)
class StoredEntity:
    """One entity as an :class:`EntityStore` keeps it: ``id`` (stable, per bank),
    canonical ``key`` (:func:`mneme.domain.entity_key`), display ``name``, ``label``
    (spaCy label, "CONCEPT" or "") and ``kind`` (person, org, place, thing, or "" until
    a named mention claims it)."""

    id: str
    key: str
    name: str
    label: str = ""
    kind: str = ""


class EntityStore(Protocol):
    """The storage of entity resolution (the rules are the resolver's,
    ``services.extraction.resolver``): per bank, the entities in creation order and the
    aliases (alias key → entity id) in the order they were made. A bank's decisions are
    written by one worker at a time (events are keyed by bank). Adapters:
    ``mneme.stores.entities_sqlite`` (SQLite), ``mneme.stores.memory.MemoryEntityStore``."""

    def load(self, bank_id: str) -> tuple[list[StoredEntity], list[tuple[str, str]]]:
        """The bank's (entities in creation order, [(alias, entity id)] in creation
        order); ([], []) for a bank with none."""

    def persist(self, bank_id: str, entities: Sequence[StoredEntity] = (),
                claims: Sequence[StoredEntity] = (),
                aliases: Sequence[tuple[str, str]] = (), cause: str = "") -> None:
        """Store new decisions in one transaction: ``entities`` are appended in order
        (an id the bank already has keeps its first record); ``claims`` set the ``label``
        and ``kind`` of known entities (unknown ids ignored); ``aliases`` are appended in
        order (a known (alias, id) pair is kept once). With a ``cause`` (the event that
        took them), the decisions are also recorded under it, as given, after those
        recorded before (:meth:`decisions`), in the same transaction: a process killed
        before the event's outputs were on the log gets it again and must publish them
        again. The latest 10,000 causes (of all banks) are kept."""

    def decisions(self, bank_id: str, cause: str) -> tuple[list[StoredEntity],
                                                          list[StoredEntity],
                                                          list[tuple[str, str]]]:
        """The decisions :meth:`persist` recorded under ``cause`` in ``bank_id``:
        (entities, claims, (alias, entity id) pairs), each in order; all empty when none
        were (or long ago). The records of entities deleted since (:meth:`drop_scope`,
        :meth:`drop_facts`, :meth:`forget`) are gone with them; those of an entity merged
        into another (:meth:`rewrite`) go when that one does."""

    def rewrite(self, bank_id: str, entities: Sequence[StoredEntity] = (),
                aliases: Sequence[tuple[str, str]] = (), removed: Sequence[str] = (),
                mentions_of: Sequence[tuple[str, str]] = ()) -> None:
        """A user's correction (entities merged or split) in one transaction:
        ``entities`` are written whole (a known id takes the given key, name, label and
        kind and keeps its place in creation order; a new one is appended); first
        ``mentions_of`` (entity id, from id) gives the entity every scope that mentions
        ``from id``; then every alias of the ``entities`` and ``removed`` ids is dropped
        and ``aliases`` [(alias, entity id)] written in order (the complete aliases of
        those entities); the ``removed`` entities are deleted with their mentions."""

    def add_mentions(self, bank_id: str, mentions: Sequence[tuple[str, ...]]) -> None:
        """Record mentions (entity id, scope[, fact id]): the entity is mentioned by
        content of that scope (a document ``d:<id>``, or the items of a retain without
        one ``r:<op>``), by the fact (memory) ``fact id`` when given (none: by content of
        the scope that is in no fact, e.g. a cancelled item)."""

    def drop_scope(self, bank_id: str, scope: str) -> list[str]:
        """Forget the mentions of ``scope`` (its document was deleted) and delete the
        entities, with their aliases, that it mentioned and nothing else does now
        (overwritten in the storage), and what :meth:`decisions` recorded of them:
        their ids. Entities with no recorded mention are kept."""

    def drop_facts(self, bank_id: str, fact_ids: Sequence[str]) -> list[str]:
        """As :meth:`drop_scope`, for the mentions by the facts ``fact_ids`` (the memories
        were deleted): the entities only they mentioned are deleted; their ids."""

    def drop_entities(self, bank_id: str, entity_ids: Sequence[str]) -> list[str]:
        """Delete the entities ``entity_ids`` with their aliases, mentions and what
        :meth:`decisions` recorded of them, whatever mentions them (another replica's
        resolver forgot them): the ids that were known."""

    def forget(self, bank_id: str) -> None:
        """Drop the bank's entities, aliases, mentions and recorded decisions (the bank
        was deleted)."""

    def close(self) -> None:
        """Release the storage; later calls may raise."""


@dataclass(frozen=True)
class StoredKey:
    """One data key as a :class:`KeyStore` keeps it: its ``scope`` (what a deletion
    destroys together: ``d:<document>``, ``r:<operation>``, ``q``, ``bank``) and the key
    ``wrapped`` by the bank key (RFC 3394, 40 bytes), None once destroyed (a tombstone:
    the id can never be created again)."""

    scope: str
    wrapped: bytes | None


@dataclass(frozen=True)
class PendingDeletion:
    """A deletion whose keys a :class:`KeyStore` destroyed and whose request may not be
    on the event log yet: operation ``operation_id`` of bank ``bank_id``, and
    ``request``, the record to append (opaque bytes: the caller's encoding). Written
    with the destruction, so a crash or a failed append between the two leaves it for
    the writer to append again (ingest's ``Ingest.complete_deletions``)."""

    bank_id: str
    operation_id: str
    request: bytes


class KeyStore(Protocol):
    """The wrapped keys of crypto-shredding (:mod:`mneme.keys`): per bank, its bank key
    (wrapped by the :class:`Kms`) and its data keys by id. First writer wins: adding a
    key that exists returns the stored one. Adapters: ``mneme.stores.keys_sqlite``
    (embedded, a file in the data dir); ``mneme.stores.keys_kafka`` (a compacted topic
    every process materialises)."""

    def bank_key(self, bank_id: str) -> bytes | None:
        """The bank's wrapped bank key, or None (never made, or the bank was deleted)."""

    def add_bank_key(self, bank_id: str, wrapped: bytes) -> bytes:
        """Store the bank key unless the bank has one: the stored wrapped key."""

    def get(self, bank_id: str, key_id: str) -> StoredKey | None:
        """The key ``key_id`` (a tombstone when destroyed), or None when unknown."""

    def get_many(self, bank_id: str, key_ids: Sequence[str]) -> dict[str, StoredKey]:
        """:meth:`get` of every id in one read (opening a batch of records): key id → its
        row, for the ids that are known (tombstones included)."""

    def add(self, bank_id: str, key_id: str, scope: str, wrapped: bytes) -> StoredKey:
        """Store a new key unless ``key_id`` exists (live or tombstone): the stored row."""

    def add_many(self, bank_id: str, rows: Sequence[tuple[str, str, bytes]]
                 ) -> dict[str, StoredKey]:
        """:meth:`add` of every (key_id, scope, wrapped) in one write (the keys a record
        needs: one durable write per record, not per key): key id → the stored row."""

    def current(self, bank_id: str, scope: str) -> str | None:
        """The id of the newest live generation key of ``scope`` (``<scope>#<gen>``;
        not the other keys in the scope, such as a fact's own), or None."""

    def destroy_scope(self, bank_id: str, scope: str,
                      pending: PendingDeletion | None = None) -> list[str]:
        """Tombstone every live key of ``scope``: the ids destroyed. With ``pending``,
        the deletion's request is kept (:meth:`pending_deletions`) in the same write:
        no crash leaves the keys destroyed without it (also when nothing was live)."""

    def destroy(self, bank_id: str, key_ids: Sequence[str],
                pending: PendingDeletion | None = None) -> list[str]:
        """Tombstone these ids (unknown ones too, so they are never created): the ids.
        ``pending`` as in :meth:`destroy_scope`."""

    def destroy_bank(self, bank_id: str, pending: PendingDeletion | None = None) -> None:
        """Drop the bank key and every row of the bank. ``pending`` as in
        :meth:`destroy_scope`; it replaces the bank's other pending deletions (its request
        deletes all they do)."""

    def pending_deletions(self, bank_id: str | None = None) -> list[PendingDeletion]:
        """The deletions kept by a destroy and not cleared yet (of ``bank_id``, or of
        every bank), oldest first; their keys are destroyed when this returns. A shared
        store answers from what it has read (it reads everything at open)."""

    def clear_pending(self, bank_id: str, operation_id: str) -> None:
        """Forget the pending deletion of ``operation_id`` (its request is on the log);
        no-op when unknown."""

    def listen(self, callback: Callable[[str, "list[str] | None"], None]) -> None:
        """Call ``callback(bank_id, key_ids)`` after keys are destroyed (``key_ids``
        None: the whole bank), by this process or -- for a store shared between
        processes -- another one, so caches of unwrapped keys drop them
        (:meth:`mneme.keys.Keyring.forget`). Called with no lock of the store held."""

    def close(self) -> None: ...


class SealKeys(Protocol):
    """Where a reader of sealed content gets its keys (:class:`mneme.bus.sealing.Opener`):
    :class:`mneme.keys.Keyring` in the services, ``mneme.client.RemoteKeys`` (the
    KeyService) in the SDK."""

    def combined(self, bank_id: str, key_ids: Sequence[str]) -> bytes | None:
        """The 32-byte seal key over ``key_ids`` (:func:`mneme.keys.combine` of their data
        keys, in that order), or None when any of them is destroyed or unknown."""

    def prefetch(self, bank_id: str, key_ids: Iterable[str]) -> None:
        """Load the data keys of ``key_ids`` not yet held in one read (or a few), so
        that opening a batch of records asks the store once, not once per key. Ids
        that are destroyed or unknown are skipped; :meth:`combined` still answers None
        for them."""


class Kms(Protocol):
    """Wraps bank keys with a master key held outside the key store (``mneme.keys.
    LocalKms``: an env-provided key; Vault transit or a cloud KMS behind the same calls).
    ``unwrap`` raises ValueError for a blob it did not wrap for that bank."""

    def wrap(self, bank_id: str, key: bytes) -> bytes: ...

    def unwrap(self, bank_id: str, blob: bytes) -> bytes: ...


class Llm(Protocol):
    """The model calls handlers and agents make (``mneme.llm.gateway.LlmGateway``; the
    fake is ``mneme.llm.fake.FakeLlm``). ``operation`` is one of retain, reflect,
    consolidation, rerank. Results carry their cost (:class:`mneme.llm.gateway.Usage`).
    Errors are :class:`mneme.llm.gateway.LlmError` subclasses: ``LlmNotConfigured`` (no
    model for the operation), ``LlmUnavailable`` (transient failures outlasted the
    retries), ``LlmRequestError`` (rejected), ``LlmOutputError`` (no usable structured
    reply). Thread-safe."""

    #: Tuning callers read: ``llm_max_concurrency``, ``retain_llm_chunk_chars`` (chars),
    #: ``reflect_max_iterations``, ``reflect_max_context_tokens``, ``rerank_head``.
    settings: "LlmSettings"

    def configured(self, operation: str) -> bool:
        """True when ``operation`` has a model (cheap; no call is made)."""

    def endpoint(self, operation: str) -> "Endpoint | None":
        """Where ``operation``'s calls go (``.model`` names it), None when unconfigured."""

    def complete(self, operation: str, messages: list[dict], *, tools: list[dict] | None = None,
                 tool_choice: str | None = None, response_schema: dict | None = None,
                 schema_name: str = "output", strict: bool = True, max_tokens: int | None = None,
                 temperature: float | None = None, timeout: float | None = None) -> "Completion":
        """One chat completion over OpenAI-style ``messages`` (``tools``: OpenAI function
        specs); the reply is not parsed. ``timeout`` in seconds per attempt."""

    def stream(self, operation: str, messages: list[dict], *, tools: list[dict] | None = None,
               tool_choice: str | None = None, max_tokens: int | None = None,
               temperature: float | None = None,
               timeout: float | None = None) -> Iterator["str | Completion"]:
        """Streaming completion: text deltas (str) as they arrive, then, last, the whole
        :class:`~mneme.llm.gateway.Completion` (its text is the deltas joined)."""

    def complete_json(self, operation: str, messages: list[dict], schema: dict, *,
                      check_schema: dict | None = None, schema_name: str = "output",
                      strict: bool = True, max_tokens: int | None = None,
                      temperature: float | None = 0.0,
                      timeout: float | None = None) -> "JsonResult":
        """A reply parsed as JSON and valid against ``check_schema`` (default ``schema``),
        re-asking the model when it is not. Raises ``LlmOutputError`` when it stays
        unusable."""

    def rerank(self, query: str, documents: list[str], *,
               top_n: int | None = None) -> tuple[list[tuple[int, float]], "Usage"]:
        """Relevance of ``documents`` to ``query``: [(document index, score)] best first
        (at most ``top_n``), and the usage."""

    def check(self, operations: tuple[str, ...] | None = None) -> list["Connectivity"]:
        """Probe each operation's model with one tiny call, no retries (default: every
        configured operation). Never raises: failures are ``Connectivity.ok`` False."""
