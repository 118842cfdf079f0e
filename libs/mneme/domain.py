"""The memory model (DESIGN §1) as plain dataclasses. Imports no transport or store library.

Times are timezone-aware UTC ``datetime`` values; stores keep them as epoch seconds
(float). Ids are strings (uuid5 where derived, see :func:`derive_id`).
"""

from __future__ import annotations

import re
import uuid
from dataclasses import dataclass, field, replace
from datetime import datetime, timezone
from typing import AbstractSet, Callable, Iterable, Sequence

#: Namespace of every derived id (uuid5), so replay and redelivery give the same ids.
MNEME_NAMESPACE = uuid.UUID("6f1c3a52-8a0e-5d55-9a43-6d6e656d6500")

#: A bank id; always use ``fullmatch`` (``$`` would accept a trailing newline).
BANK_ID_RE = re.compile(r"[a-z0-9][a-z0-9_-]{0,62}")

WORLD = "world"
EXPERIENCE = "experience"
FACT_TYPES = (WORLD, EXPERIENCE)


def derive_id(*parts: object) -> str:
    """Deterministic id: uuid5 over ``parts`` joined by '/', e.g. (event_id, item, n)."""
    return str(uuid.uuid5(MNEME_NAMESPACE, "/".join(str(p) for p in parts)))


def utc(dt: datetime | None) -> datetime | None:
    """Return ``dt`` as an aware UTC datetime (naive values are taken as UTC). A time
    within a day of the range's ends whose offset puts it outside in UTC (year 1 at
    +14:00, year 9999 at -12:00) is the range's end (:data:`MIN_TIME`, :data:`MAX_TIME`)."""
    if dt is None:
        return None
    if dt.tzinfo is None:
        return dt.replace(tzinfo=timezone.utc)
    try:
        return dt.astimezone(timezone.utc)
    except OverflowError:
        return MIN_TIME if dt.year == 1 else MAX_TIME


#: The representable time range (protobuf Timestamp, RFC 3339, Python ``datetime``):
#: 0001-01-01T00:00:00Z … 9999-12-31T23:59:59.999999Z, as epoch seconds.
MIN_EPOCH = -62135596800.0
MAX_EPOCH = 253402300799.999
MIN_TIME = datetime(1, 1, 1, tzinfo=timezone.utc)
MAX_TIME = datetime(9999, 12, 31, 23, 59, 59, 999000, tzinfo=timezone.utc)


def clamp_time(dt: datetime | None) -> datetime | None:
    """``dt`` as aware UTC, clamped into [:data:`MIN_TIME`, :data:`MAX_TIME`] (the last
    millisecond of 9999 is kept clear of the edge: epoch floats round up past it)."""
    if dt is None:
        return None
    dt = utc(dt)
    return MAX_TIME if dt > MAX_TIME else dt


def to_epoch(dt: datetime | None) -> float | None:
    """Aware datetime → epoch seconds (float, clamped to the representable range),
    None stays None."""
    return None if dt is None else min(max(utc(dt).timestamp(), MIN_EPOCH), MAX_EPOCH)


def from_epoch(ts: float | None) -> datetime | None:
    """Epoch seconds → aware UTC datetime, None stays None. Never raises for a number:
    values outside the representable range (e.g. a float that rounded past the end of
    year 9999 in an older store) are clamped, so no stored unit can make a read fail."""
    if ts is None:
        return None
    try:
        ts = float(ts)
    except (TypeError, ValueError):
        return None
    if ts != ts:  # NaN
        return None
    return datetime.fromtimestamp(min(max(ts, MIN_EPOCH), MAX_EPOCH), tz=timezone.utc)


#: A bank's ``config.extraction_mode``: ``auto`` (default: as ``llm`` when a retain model
#: is configured, else ``offline``), ``offline`` (no model), ``llm`` (the model's facts with
#: the offline facts of the same items beside them, so that a model never makes recall
#: worse than no model), ``llm_only`` (the model's facts alone: a smaller index, at the
#: model's mercy).
EXTRACTION_MODES = ("auto", "offline", "llm", "llm_only")


@dataclass(frozen=True)
class BankConfig:
    """Per-bank configuration. Traits are 1..5; ``dedup_threshold`` is a cosine in [0, 1]."""

    retain_mission: str = ""
    observations_mission: str = ""
    #: Put into the reflect model's prompt: what the bank's answers are for.
    reflect_mission: str = ""
    skepticism: int = 3
    literalism: int = 3
    empathy: int = 3
    auto_consolidate: bool = True
    dedup_threshold: float = 0.97
    #: One of :data:`EXTRACTION_MODES`.
    extraction_mode: str = "auto"
    #: "crypto_shred": user content is sealed on the log with keys deletions destroy
    #: (mneme.bus.sealing); "none": plaintext topics (no erasure on the log).
    erasure: str = "crypto_shred"
    #: Whether the document projection keeps each retained document's original text
    #: (GetDocument); False keeps its history only.
    store_documents: bool = True


@dataclass(frozen=True)
class Bank:
    """An isolated memory space; ``bank_id`` is a slug matching :data:`BANK_ID_RE`.
    ``incarnation`` numbers this life of the bank id ("1" for the first creation, "2"
    after one deletion and re-creation, …; "" when unknown): a bank created again is a
    new incarnation, so its operations and idempotency keys start afresh."""

    bank_id: str
    display_name: str = ""
    config: BankConfig = field(default_factory=BankConfig)
    created_at: datetime | None = None
    updated_at: datetime | None = None
    incarnation: str = ""


@dataclass(frozen=True)
class Directive:
    """A hard rule reflect follows in a bank: ``text`` ("Answer in German."), a short
    ``title``, ``priority`` (higher first when several apply), ``active`` (inactive ones
    are kept but not applied) and ``tags``: untagged, it applies to every reflect of the
    bank; tagged, to reflects whose tags share one with it. Times are epoch seconds."""

    id: str
    bank_id: str
    text: str
    title: str = ""
    priority: int = 0
    active: bool = True
    tags: tuple[str, ...] = ()
    created_at: float = 0.0
    updated_at: float = 0.0

    def applies_to(self, tags: Sequence[str]) -> bool:
        """Active, and untagged or sharing a tag with ``tags`` (a reflect's)."""
        return self.active and (not self.tags or bool(set(self.tags) & set(tags)))


@dataclass(frozen=True)
class MentalModel:
    """A named, user-curated standing answer of a bank: ``display_name``, the
    ``source_query`` a refresh answers, its ``content`` (the answer, at most ``max_tokens``
    tokens; 0: the default), ``tags`` (its scope: what its refresh recalls, and which
    changes make it stale), ``refresh_policy`` (:data:`REFRESH_POLICIES`) with
    ``refresh_every`` (new facts between refreshes for "every_n_facts"). ``revision``
    counts content changes; ``based_on`` are the memory ids of the latest refresh, and
    ``based_on_documents`` their documents (parallel; "" for none), and
    ``based_on_evidence`` the facts behind the observations among them;
    ``memory_offset`` is where its bank's partition of ``mneme.memory.v1`` ended at the
    latest refresh (or creation): changes after it make the model stale. Times are epoch
    seconds (``refreshed_at`` 0: never refreshed); ``changed_at`` is the time of its
    latest change that was no refresh (its creation, a user's update; 0 in states from
    before it was kept: ``created_at``), what ``updated_at`` falls back to when a
    deletion erases the refreshes after it."""

    id: str
    bank_id: str
    display_name: str
    source_query: str
    content: str = ""
    tags: tuple[str, ...] = ()
    max_tokens: int = 0
    refresh_policy: str = "manual"
    refresh_every: int = 0
    revision: int = 0
    based_on: tuple[str, ...] = ()
    memory_offset: int = 0
    created_at: float = 0.0
    based_on_documents: tuple[str, ...] = ()
    based_on_evidence: tuple[str, ...] = ()
    updated_at: float = 0.0
    refreshed_at: float = 0.0
    changed_at: float = 0.0


@dataclass(frozen=True)
class MentalModelRevision:
    """One content of a mental model: ``revision`` (1, 2, ...), the ``content``, the
    memory ids it was ``based_on`` (empty for content a user wrote), ``source``
    ("user", "refresh" or "refresh_offline"), when (epoch seconds), the refresh
    ``mode`` that made it ("full", "delta"; empty for content a user wrote), the
    ``documents`` of its ``based_on`` (parallel; "" for none), the model's
    ``memory_offset`` with it (:class:`MentalModel`) and the ``evidence`` of the
    observations it cites (their facts' ids)."""

    revision: int
    content: str
    based_on: tuple[str, ...] = ()
    source: str = "user"
    at: float = 0.0
    mode: str = ""
    documents: tuple[str, ...] = ()
    memory_offset: int = 0
    evidence: tuple[str, ...] = ()


#: How a mental model is kept current: on request, after a consolidation that leaves it
#: stale, or every ``refresh_every`` new facts in its scope (reflect's group
#: ``reflect-refresh``).
REFRESH_POLICIES = ("manual", "after_consolidation", "every_n_facts")
#: The fields of a mental model an update_mask may name.
MENTAL_MODEL_FIELDS = ("display_name", "source_query", "content", "tags", "max_tokens",
                       "refresh_policy", "refresh_every")

def merge_mental_model(old: MentalModel | None, m: MentalModel, mask: tuple[str, ...],
                       refresh: MentalModelRevision | None
                       ) -> tuple[MentalModel | None, MentalModelRevision | None]:
    """The state after applying event ``m`` (``mask``, ``refresh``: see
    :meth:`mneme.ports.Catalog.upsert_mental_model`) to ``old``, and the revision it adds
    (None: the content did not change). (None, None) for an update of an unknown model.
    Shared by every catalog adapter."""
    # a refresh's time is not kept apart: a deletion may erase it (see
    # erase_mental_model_sources)
    changed = m.updated_at if refresh is None else (
        (old.changed_at or old.created_at) if old else m.updated_at)
    if mask:
        if old is None:
            return None, None
        new = replace(old, updated_at=m.updated_at, changed_at=changed, **{
            f: getattr(m, f) for f in MENTAL_MODEL_FIELDS if f in mask})
    else:
        new = replace(m, created_at=old.created_at if old else m.updated_at,
                      revision=old.revision if old else 0, changed_at=changed)
    if refresh is not None:
        new = replace(new, based_on=tuple(refresh.based_on),
                      based_on_documents=tuple(refresh.documents),
                      based_on_evidence=tuple(refresh.evidence),
                      refreshed_at=m.updated_at, memory_offset=m.memory_offset)
    elif not mask:
        new = replace(new, memory_offset=m.memory_offset)
    if refresh is None and "content" in mask:  # a user's content (or a clear) cites nothing
        new = replace(new, based_on=(), based_on_documents=(), based_on_evidence=())
    changed = "content" in mask or (not mask and bool(m.content))
    revision = None
    if changed:
        revision = refresh if refresh is not None else MentalModelRevision(0, m.content)
        revision = replace(revision, content=m.content, at=m.updated_at,
                           memory_offset=new.memory_offset)
    return new, revision


def cites_deleted(based_on: Sequence[str], documents: Sequence[str], memory_ids: AbstractSet[str],
                  document_id: str, evidence: Sequence[str] = (),
                  gone: Callable[[str], bool] | None = None) -> bool:
    """True when content ``based_on`` these memory ids (retained in ``documents``,
    parallel), and on the facts ``evidence`` behind the observations it cites, stands on
    a deleted memory (``memory_ids``), a memory of the deleted document ``document_id``
    ("" for none), or an evidence fact ``gone`` says is deleted (its key destroyed: an
    evidence fact's document is not known here)."""
    return (bool(memory_ids.intersection(based_on)) or bool(memory_ids.intersection(evidence))
            or bool(document_id and document_id in documents)
            or (gone is not None and any(gone(i) for i in evidence)))


def erase_mental_model_sources(old: MentalModel, revisions: Sequence[MentalModelRevision],
                               memory_ids: AbstractSet[str], document_id: str = "",
                               gone: Callable[[str], bool] | None = None
                               ) -> tuple[MentalModel, list[MentalModelRevision]] | None:
    """The model ``old`` and its ``revisions`` (oldest first) without the contents that
    stand on deleted memories (:func:`cites_deleted`), or None when none does. The kept
    revisions are numbered 1, 2, ... again, and when the current content is among those
    dropped, the model falls back to the latest kept one (empty when none is left): what
    a replay gives, where those contents are sealed under the deleted memories' keys and
    so are skipped (:mod:`mneme.bus.sealing`). Shared by every catalog adapter."""
    def hit(r: MentalModelRevision) -> bool:
        return cites_deleted(r.based_on, r.documents, memory_ids, document_id, r.evidence, gone)
    current = cites_deleted(old.based_on, old.based_on_documents, memory_ids, document_id,
                            old.based_on_evidence, gone)
    if not current and not any(hit(r) for r in revisions):
        return None
    kept = [replace(r, revision=n) for n, r in enumerate((r for r in revisions if not hit(r)), 1)]
    erased = max((r.at for r in revisions if hit(r)), default=0.0)
    new = replace(old, revision=len(kept),
                  refreshed_at=max((r.at for r in kept if r.source != "user"), default=0.0))
    if old.updated_at <= erased:  # its latest change was an erased refresh: the one before
        new = replace(new, updated_at=max([old.changed_at or old.created_at,
                                           *(r.at for r in kept)]))
    if current:
        # the state the kept content was made in (no content left: stale, refreshed in full)
        last = kept[-1] if kept else MentalModelRevision(0, "")
        new = replace(new, content=last.content, based_on=last.based_on,
                      based_on_documents=last.documents, based_on_evidence=last.evidence,
                      memory_offset=last.memory_offset)
    return new, kept


#: The fields of a directive an update_mask may name.
DIRECTIVE_FIELDS = ("title", "text", "priority", "active", "tags")


def merge_directive(old: Directive | None, d: Directive, mask: tuple[str, ...]
                    ) -> Directive | None:
    """The directive after applying event ``d`` (see
    :meth:`mneme.ports.Catalog.upsert_directive`) to ``old``: with ``mask`` only those
    fields change (None for an update of an unknown directive), without it ``d`` replaces
    it; the creation time is kept. Shared by every catalog adapter."""
    if mask:
        if old is None:
            return None
        return replace(old, updated_at=d.updated_at,
                       **{f: getattr(d, f) for f in DIRECTIVE_FIELDS if f in mask})
    return replace(d, tags=tuple(d.tags), created_at=old.created_at if old else d.updated_at)


@dataclass(frozen=True)
class DocumentRevision:
    """One retain (upsert) of a document: ``revision`` (1, 2, ... since the document was
    last deleted), the retain's ``operation_id``, its time ``at`` (epoch seconds of the
    intake event), the ``items`` of the retain that carried the document, the SHA-256
    (hex) ``content_hash`` and length in characters ``chars`` of its text (the items'
    contents joined by :data:`DOCUMENT_JOIN`), the items' distinct sorted ``tags``, the
    first item's ``context`` ("" when the text is not stored) and whether the text was
    stored (``text_stored``)."""

    revision: int
    operation_id: str
    at: float
    items: int = 1
    content_hash: str = ""
    chars: int = 0
    tags: tuple[str, ...] = ()
    context: str = ""
    text_stored: bool = False


@dataclass(frozen=True)
class StoredDocument:
    """A document as the document projection holds it: first and latest retain times
    (epoch seconds), the latest retain's ``text`` (None when that retain's text was not
    stored), its revision (``latest``), and how many revisions there are."""

    bank_id: str
    document_id: str
    created_at: float
    updated_at: float
    latest: DocumentRevision
    revisions: int
    text: str | None = None


#: What joins the contents of a retain's items of one document into its text.
DOCUMENT_JOIN = "\n\n"


@dataclass(frozen=True)
class RetainItem:
    """One item to retain. ``timestamp`` is when it was said/happened (UTC);
    ``time_zone`` the zone it was said in (IANA name or offset, "" = UTC), whose calendar
    its relative dates resolve in (:func:`mneme.timeparse.wall_clock`)."""

    content: str
    timestamp: datetime
    context: str = ""
    document_id: str = ""
    tags: tuple[str, ...] = ()
    metadata: dict[str, str] = field(default_factory=dict)
    time_zone: str = ""


@dataclass(frozen=True, slots=True)
class EntityRef:
    """A resolved entity mention: ``id`` is per bank, ``label`` a spaCy label or CONCEPT."""

    id: str
    name: str
    label: str = ""


@dataclass(frozen=True)
class EntityInfo:
    """An entity of a bank as the graph holds it: ``id``, latest ``name``, ``label`` (a
    spaCy label or CONCEPT), ``aliases`` (every :func:`entity_key` it has had, sorted),
    ``mentions`` (live units mentioning it). :meth:`mneme.ports.GraphStore.entity` also
    fills ``units`` (ids of units mentioning it, most recent first, capped) and
    ``neighbours`` ((entity id, name, label, units mentioning both), most shared first).
    ``first_seen``/``last_seen``: the earliest and latest time (UTC) of the live units
    mentioning it, each unit's time being when it was told (``mentioned_at``), or when it
    happened (``occurred_start``) for a unit without one; None when no such unit has
    either."""

    id: str
    name: str
    label: str = ""
    aliases: tuple[str, ...] = ()
    mentions: int = 0
    units: tuple[str, ...] = ()
    neighbours: tuple[tuple[str, str, str, int], ...] = ()
    first_seen: datetime | None = None
    last_seen: datetime | None = None


@dataclass(frozen=True, slots=True)
class Link:
    """A directed link from a unit to ``target_id``; ``kind`` in entity/temporal/semantic/causal."""

    target_id: str
    kind: str
    weight: float = 1.0


@dataclass(slots=True)
class Fact:
    """A memory unit: one self-contained statement with its times, entities and vector.

    ``occurred_start``/``occurred_end`` bound when it happened (coarse dates span the
    whole period); ``mentioned_at`` is when it was told. ``embedding`` has the
    embedder's dimension (384 for all-MiniLM-L6-v2).
    """

    id: str
    bank_id: str
    text: str
    fact_type: str = WORLD
    context: str = ""
    occurred_start: datetime | None = None
    occurred_end: datetime | None = None
    mentioned_at: datetime | None = None
    tags: tuple[str, ...] = ()
    metadata: dict[str, str] = field(default_factory=dict)
    document_id: str = ""
    chunk_id: str = ""
    entities: list[EntityRef] = field(default_factory=list)
    embedding: list[float] = field(default_factory=list)
    links: list[Link] = field(default_factory=list)
    item_index: int = 0


@dataclass(frozen=True)
class TimeWindow:
    """A closed time interval [start, end] in UTC; either end may be open (None)."""

    start: datetime | None = None
    end: datetime | None = None

    def overlaps(self, start: datetime | None, end: datetime | None) -> bool:
        """True when [start, end] (None = unbounded) intersects this window."""
        s = start or end
        e = end or start
        if s is None:
            return False
        if self.end is not None and s > self.end:
            return False
        if self.start is not None and e < self.start:
            return False
        return True


#: The tag-matching modes of ``Filters.tags_match``.
TAGS_MATCH_MODES = ("any", "all", "any_strict", "all_strict", "exact")


def tags_match(unit_tags: Iterable[str], tags: Iterable[str], mode: str = "any") -> bool:
    """Whether a unit with ``unit_tags`` (U) passes a tag filter ``tags`` (T) in ``mode``.

    - ``any``: U∩T≠∅, or U is empty (untagged units are shared by every scope)
    - ``all``: T⊆U, or U is empty
    - ``any_strict``: U∩T≠∅
    - ``all_strict``: T⊆U
    - ``exact``: set(U) == set(T)

    An empty T means "no tag filter" (always True), except in ``exact`` mode, where it
    selects units without tags. Raises ValueError for an unknown ``mode``.
    """
    if mode not in TAGS_MATCH_MODES:
        raise ValueError(f"unknown tags_match mode {mode!r}; expected one of {TAGS_MATCH_MODES}")
    u, t = set(unit_tags), set(tags)
    if mode == "exact":
        return u == t
    if not t:
        return True
    if mode == "any":
        return not u or bool(u & t)
    if mode == "all":
        return not u or t <= u
    if mode == "any_strict":
        return bool(u & t)
    return t <= u  # all_strict


def tags_filter_set(tags: Iterable[str], mode: str = "any") -> bool:
    """Whether the tag filter ``tags`` in ``mode`` excludes anything: a non-empty ``tags``,
    or ``exact`` mode (which with no tags selects the untagged units). Otherwise
    :func:`tags_match` passes every unit, and a read may skip the filter. ValueError for
    an unknown ``mode``."""
    if mode not in TAGS_MATCH_MODES:
        raise ValueError(f"unknown tags_match mode {mode!r}; expected one of {TAGS_MATCH_MODES}")
    return mode == "exact" or any(True for _ in tags)


@dataclass(frozen=True)
class Filters:
    """Recall/list filters. ``tags_match`` in any, all, any_strict, all_strict, exact."""

    types: tuple[str, ...] = ()
    tags: tuple[str, ...] = ()
    tags_match: str = "any"
    time_range: TimeWindow | None = None
    document_id: str = ""


@dataclass
class Hit:
    """One store hit: a unit id with the arm's raw score (higher is better)."""

    id: str
    score: float


_ARTICLES = ("the ", "a ", "an ", "my ", "our ", "his ", "her ", "their ")


def entity_key(name: str) -> str:
    """Canonical key of an entity name, used for resolution within a bank: lowercased,
    possessive "'s" and punctuation dropped, a leading article or possessive pronoun
    removed, whitespace collapsed. Numbers are kept ("Room 101" ≠ "Room 102")."""
    s = name.lower().replace("\u2019", "'")
    s = re.sub(r"'s\b", "", s)
    s = re.sub(r"[^\w\s-]", " ", s)
    s = " ".join(s.split())
    for a in _ARTICLES:
        if s.startswith(a) and len(s) > len(a):
            s = s[len(a):]
            break
    return s


#: ``ObservationsChanged.trigger`` values that answer a user's request (Consolidate,
#: ClearObservations): their projection completes that operation. The others ("auto",
#: "retract") follow an operation that already ended (a retain, a deletion).
CONSOLIDATION_REQUEST_TRIGGERS = ("consolidate", "reconsolidate", "clear", "clear_memory")


@dataclass
class Memory:
    """A memory as a reasoning model is shown it (reflect's tools): its store ``id``,
    ``text``, ``kind`` (mental_model, observation, fact), when it happened (``when``),
    and its fact type when a fact; a fact also keeps when it was told (``mentioned_at``)
    and its ``entities`` (:class:`EntityRef`), which opinions formed from it are about, and
    the ``document_id`` it was retained in ("" for none); an observation its ``sources``,
    the ids of the facts it stands on (its evidence)."""

    id: str
    text: str
    kind: str = "fact"
    when: datetime | None = None
    fact_type: str = ""
    mentioned_at: datetime | None = None
    entities: tuple = ()
    document_id: str = ""
    sources: tuple[str, ...] = ()


BUDGETS = ("low", "mid", "high")


@dataclass(frozen=True)
class RecallQuery:
    """A recall request. ``max_tokens`` bounds the summed token counts of result texts;
    ``budget`` (low/mid/high) sets how many candidates each arm fetches;
    ``query_timestamp`` is "now" for relative expressions in the query, read in the
    calendar of ``time_zone`` (IANA name or offset, "" = UTC); ``deadline``
    (a :class:`mneme.deadline.Deadline`, None: none) stops the work when the caller
    stops waiting. ``include_entities`` / ``include_documents``: token budgets of the
    entities the results mention and of the documents they come from (None: not asked
    for, the default; see :mod:`services.search.include`)."""

    bank_id: str
    query: str
    query_timestamp: datetime
    filters: Filters = field(default_factory=Filters)
    budget: str = "mid"
    max_tokens: int = 4096
    deadline: object = field(default=None, compare=False)
    time_zone: str = ""
    include_entities: int | None = None
    include_documents: int | None = None


@dataclass
class Scored:
    """A recalled fact with why it was chosen: per-arm ``scores`` and 1-based ``ranks``
    (keys semantic, keyword, graph, temporal; absent = arm did not return it), the fused
    ``rrf`` score, the ``boost`` added, the ``final`` score and its text's ``tokens``."""

    fact: Fact
    scores: dict[str, float] = field(default_factory=dict)
    ranks: dict[str, int] = field(default_factory=dict)
    rrf: float = 0.0
    boost: float = 0.0
    final: float = 0.0
    tokens: int = 0


@dataclass
class IncludedEntity:
    """An entity recalled facts mention (``ref``: id, name, label as they mention it) with
    the observations about it, best first, and the ``tokens`` of its name and theirs."""

    ref: EntityRef
    observations: list[Fact] = field(default_factory=list)
    tokens: int = 0


@dataclass
class IncludedDocument:
    """A document recalled facts (``memory_ids``) come from: its stored ``text`` (a
    prefix when ``truncated``) and that text's ``tokens``."""

    document_id: str
    text: str
    truncated: bool = False
    tokens: int = 0
    memory_ids: list[str] = field(default_factory=list)


@dataclass
class RecallOutcome:
    """Recall results in order, their token total and the query's parsed time window;
    ``entities`` and ``documents`` only when the query asked for them."""

    results: list[Scored]
    total_tokens: int
    time_window: TimeWindow | None = None
    entities: list[IncludedEntity] = field(default_factory=list)
    documents: list[IncludedDocument] = field(default_factory=list)


#: Operation states after which nothing changes (an operation always reaches one).
TERMINAL = ("succeeded", "failed")
#: Every state of an operation, in the order it goes through them.
OPERATION_STATES = ("pending", "running", *TERMINAL)
#: Every kind of operation (``Operation.kind``): what request made it.
OPERATION_KINDS = ("retain", "delete_document", "delete_memory", "delete_bank", "consolidate",
                   "delete_opinion", "merge_entities", "split_entity")


@dataclass
class Operation:
    """A long-running request. ``state``: pending, running, succeeded, failed.
    Times are epoch seconds."""

    operation_id: str
    bank_id: str
    kind: str
    state: str = "pending"
    items_total: int = 0
    items_done: int = 0
    facts: int = 0
    error: str = ""
    memory_ids: list[str] = field(default_factory=list)
    created_at: float = 0.0
    updated_at: float = 0.0
    #: Items that failed alone: (item index, request field or "", error).
    item_errors: list[tuple[int, str, str]] = field(default_factory=list)
    #: CancelOperation was requested; ``cancelled``: the work stopped before it was done
    #: (the operation is failed).
    cancel_requested: bool = False
    cancelled: bool = False
    #: The operation this one retries (RetryOperation), or "".
    retry_of: str = ""
    #: Where its request is on the log, "topic/partition/offset" ("" when unknown):
    #: RetryOperation reads the request back from there.
    source: str = ""

    @property
    def done(self) -> bool:
        return self.state in TERMINAL


def merge_operation(old: Operation | None, op: Operation) -> Operation:
    """``op`` (new progress) over the stored ``old``: what progress events do not carry
    is kept (``retry_of``, ``source`` when ``op``'s are empty; a ``cancel_requested``
    stays requested). Shared by the catalog adapters."""
    if old is None:
        return op
    return replace(op, retry_of=op.retry_of or old.retry_of, source=op.source or old.source,
                   cancel_requested=op.cancel_requested or old.cancel_requested)


@dataclass(frozen=True)
class EventMeta:
    """What a handler knows of the event it handles besides its message: ``id`` (the
    CloudEvents ``ce_id``; derive output ids and model-call keys from it so redelivery
    repeats them) and ``time`` (an aware UTC datetime: ``ce_time``, else the record's
    timestamp)."""

    id: str
    time: datetime
    #: The record's (topic, partition, offset), when it came from the log.
    position: tuple[str, int, int] | None = None


# ---- opinions ---------------------------------------------------------------------------

#: The fact_type of an opinion unit in search's vector store.
OPINION = "opinion"
#: How a new fact bears on an opinion (the model's answer), and the change it records.
OPINION_RELATIONS = {"support": "reinforced", "weaken": "weakened", "contradict": "contradicted"}
#: Step of one revision: support moves the confidence this fraction of the way to 1,
#: weakening this fraction of the way to 0, a contradiction twice that.
OPINION_STEP = 0.1
#: Evidence counts above this add nothing to an opinion's initial confidence.
OPINION_EVIDENCE_CAP = 5
#: Days after which a memory counts half as recent (exponential decay).
OPINION_HALF_LIFE_DAYS = 365.0


def _clamp_confidence(c: float) -> float:
    return round(min(0.95, max(0.05, c)), 4)


def initial_confidence(evidence_ages_days: Sequence[float], skepticism: int = 3) -> float:
    """Confidence in [0.05, 0.95] of an opinion formed on memories of the given ages (days
    between each memory's ``mentioned_at`` and the reflection; negative counts as 0).

    ``0.3 + 0.12 · min(n, 5) · (0.5 + 0.5 · r)`` where ``n`` is the evidence count and ``r``
    the mean recency ``2^(-age / 365)`` in (0, 1]; times ``1 - 0.1 · (skepticism - 3)`` (a
    skeptical bank, 5, believes 20 % less; a trusting one, 1, 20 % more). Five fresh memories
    give 0.9, one gives 0.42 (our own rule: evidence count and recency, as the issue asks)."""
    n = min(len(evidence_ages_days), OPINION_EVIDENCE_CAP)
    if n == 0:
        return _clamp_confidence(0.3 * (1 - 0.1 * (skepticism - 3)))
    r = sum(0.5 ** (max(a, 0.0) / OPINION_HALF_LIFE_DAYS)
            for a in evidence_ages_days) / len(evidence_ages_days)
    return _clamp_confidence((0.3 + 0.12 * n * (0.5 + 0.5 * r)) * (1 - 0.1 * (skepticism - 3)))


def revise_confidence(confidence: float, relation: str) -> float:
    """The confidence after a new fact that ``relation``s the opinion ("support",
    "weaken", "contradict"): support ``c + s(1 - c)``, weaken ``c - s·c``, contradict
    ``c - 2s·c`` with ``s`` = :data:`OPINION_STEP` (so a contradiction weighs twice a
    weakening), kept within [0.05, 0.95] and rounded to 4 decimals (events carry it as a
    32-bit float). Raises ValueError for another relation."""
    confidence = round(confidence, 4)
    if relation == "support":
        return _clamp_confidence(confidence + OPINION_STEP * (1 - confidence))
    if relation == "weaken":
        return _clamp_confidence(confidence - OPINION_STEP * confidence)
    if relation == "contradict":
        return _clamp_confidence(confidence - 2 * OPINION_STEP * confidence)
    raise ValueError(f"relation: must be one of {', '.join(OPINION_RELATIONS)}")
