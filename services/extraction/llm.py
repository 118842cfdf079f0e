"""Fact extraction with a language model (``MNEME_RETAIN_LLM_MODEL`` / ``MNEME_LLM_MODEL``).

Same interface as :class:`~services.extraction.offline.OfflineExtractor`
(:class:`mneme.ports.Extractor` plus ``extract_many``); what one item becomes:

- **Chunks.** An item longer than ``MNEME_RETAIN_LLM_CHUNK_CHARS`` is cut at paragraph,
  then sentence boundaries; each chunk is one structured call (items of one request run
  concurrently, bounded by the gateway). Facts of a chunk share its ``chunk_id``
  (``derive_id(source_id, i, "chunk", c)``); fact n of item i is ``derive_id(source_id, i, n)``,
  numbered across the item's chunks.
- **Prompt.** The model gets the item's timestamp (ISO and in words, on the clock of the
  item's ``time_zone``), speaker, context and
  the bank's ``retain_mission``, and returns ``{"facts": [{text, fact_type, occurred_start,
  occurred_end, entities, caused_by}]}`` (:data:`FACTS_SCHEMA`): self-contained facts with
  relative time expressions replaced by absolute dates, ``world``/``experience``, the
  period the fact happened in, its entities, and the indices of facts that caused it.
- **Times.** ``occurred_*`` are ISO dates at any granularity; a coarse date spans its whole
  period ("2015" → 2015-01-01 00:00 … 2015-12-31 23:59:59.999999 UTC; "2023-05" → all of
  May). A fact without a usable time falls back to the first time expression in its text
  (:func:`mneme.timeparse.parse_when`, resolved against the item's timestamp), then to the
  whole day of the item's timestamp (as offline). ``mentioned_at`` is the item's timestamp.
  Relative expressions the model left in the text are annotated with their dates, as offline.
- **Entities** go through the bank's :class:`EntityResolver` in item order (deterministic
  whatever order the concurrent calls finish in); the item's speaker is a PERSON mention of
  the facts that name them.
- **Links.** ``causal`` (1.0) from a fact to each fact it was ``caused_by``; ``temporal``
  (1.0) to the previous fact of the item, and (0.5) from an item's first fact to the last
  fact of the previous item of the same document said within a day (as offline); none
  when the model found no fact in the previous item (a reply answers the turn just
  before it, not an earlier one).
- **Failures.** Transport errors are retried by the gateway; malformed, schema-invalid or
  truncated replies are repaired or re-asked, and a chunk still truncated is split in two
  (twice at most). What still fails makes the *item* fail with
  :class:`ItemExtractionFailed` (``reason``: malformed, schema, truncated, timeout,
  rate_limited, unavailable, rejected, auth, context_window, not_configured); the other
  items keep their facts (:class:`ExtractionIncomplete`). An item the model finds nothing
  in (or blank content) yields no facts and is counted as ``no_facts`` — never confused
  with a failure.

After a call, :meth:`LlmExtractor.report` gives the request's per-item outcomes and the
token/cost usage, for the handler to put on ``FactsExtracted``.

By default (extraction mode ``auto``/``llm``) the model's facts are not alone:
:class:`WithOfflineFacts` keeps each item's offline facts beside them, so a model never
makes recall worse than no model; ``llm_only`` uses :class:`LlmExtractor` alone.
:class:`BankModeExtractor` picks per bank.
"""

from __future__ import annotations

import logging
import re
import threading
import unicodedata
from collections import OrderedDict
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from datetime import date, datetime, timedelta, timezone
from itertools import groupby
from typing import Callable, Sequence

from mneme.domain import EXPERIENCE, WORLD, BankConfig, Fact, Link, RetainItem, derive_id, utc
from mneme.errors import resource_shortage
from mneme.llm.types import LlmError, Usage, as_list
from mneme.llm.metrics import METRICS
from mneme.ports import Llm
from mneme.timeparse import day_window, parse_when, wall_clock
from services.extraction.resolver import EntityResolver
from services.extraction.vectors import EmbeddingParts

__all__ = ["LlmExtractor", "BankModeExtractor", "WithOfflineFacts", "OFFLINE", "ItemExtractionFailed", "ExtractionIncomplete",
           "ExtractionReport", "FACTS_SCHEMA", "SYSTEM_PROMPT"]

#: What the model must return (OpenAI strict-mode compatible: every property required,
#: no additional properties, nullable dates).
FACTS_SCHEMA: dict = {
    "type": "object", "additionalProperties": False, "required": ["facts"],
    "properties": {"facts": {"type": "array", "items": {
        "type": "object", "additionalProperties": False,
        "required": ["text", "fact_type", "occurred_start", "occurred_end", "entities", "caused_by"],
        "properties": {
            "text": {"type": "string"},
            "fact_type": {"type": "string", "enum": ["world", "experience"]},
            "occurred_start": {"type": ["string", "null"]},
            "occurred_end": {"type": ["string", "null"]},
            "entities": {"type": "array", "items": {
                "type": "object", "additionalProperties": False, "required": ["name", "type"],
                "properties": {"name": {"type": "string"}, "type": {"type": "string"}}}},
            "caused_by": {"type": "array", "items": {"type": "integer"}},
        }}}},
}

#: What a reply is validated against locally: only what cannot be defaulted. Models
#: without constrained decoding often drop optional keys; normalising beats re-asking.
_CHECK_SCHEMA: dict = {
    "type": "object", "required": ["facts"],
    "properties": {"facts": {"type": "array", "items": {
        "type": "object", "required": ["text"],
        "properties": {"text": {"type": "string"}}}}},
}

SYSTEM_PROMPT = """\
You extract long-term memories for an AI agent from one piece of text: a conversation \
turn, a message or part of a document. Reply with JSON only: {"facts": [...]}, where each fact has:

- "text": one self-contained statement that is understandable years later without the \
source. Name people instead of pronouns ("Caroline", not "she" or "the user" when the \
name is known); keep names, numbers, places, reasons and feelings exactly as stated. Put \
closely related details of one event into one fact; separate events are separate facts.
- Replace every relative time expression ("yesterday", "last March", "two weeks ago", \
"next Friday", "this year") in the text with the absolute date or period it means, \
resolved against the time the text was written (given with the text), e.g. written on \
8 May 2023, "yesterday" becomes "on 7 May 2023" and "last year" becomes "in 2022".
- "fact_type": "experience" for what the AI agent/assistant itself did, tried, said or \
learned (written in the first person: "I recommended ..."); "world" for everything else \
(the world, the user and other people, including their preferences, opinions and plans).
- "occurred_start" and "occurred_end": when the fact happened or holds, as ISO 8601 \
dates "YYYY-MM-DD", or coarser "YYYY-MM" or "YYYY" when only the month or year is known \
(a coarse date stands for its whole period), resolved against the time the text was \
written; null when the text gives no clue. One day: the same date twice. "In 2015": \
"2015" and "2015". Use the writing date only when the fact happened then ("today", "just \
now", an ongoing situation being reported).
- "entities": the people, places, organizations, things and events the fact mentions: \
{"name": as written (full name when known), "type": person | place | organization | \
thing | event | concept}.
- "caused_by": the 0-based indices of other facts in your list that caused or explain \
this one (an explicit reason: "because", "so", "that's why", "after ... she decided"); \
[] when none.

Skip greetings, small talk, filler and questions that state nothing. If nothing in the \
text is worth remembering, reply {"facts": []}."""

_LABELS = {"person": "PERSON", "people": "PERSON", "place": "GPE", "location": "GPE",
           "city": "GPE", "country": "GPE", "organization": "ORG", "organisation": "ORG",
           "company": "ORG", "org": "ORG", "event": "EVENT", "thing": "PRODUCT",
           "product": "PRODUCT", "object": "PRODUCT", "work": "WORK_OF_ART",
           "concept": "CONCEPT", "other": "CONCEPT"}
_ISO = re.compile(r"^\s*(\d{4})(?:-(\d{1,2})(?:-(\d{1,2})(?:[T ](\d{1,2}):(\d{2})(?::(\d{2})(?:\.\d+)?)?"
                  r"\s*(Z|[+-]\d{2}:?\d{2})?)?)?)?\s*$")
log = logging.getLogger(__name__)
_SENT_SPLIT = re.compile(r"(?<=[.!?])\s+")
_MAX_SPLITS = 2  # a still-truncated chunk is halved at most twice (→ quarters)
_MIN_SPLIT_CHARS = 200


#: The reason of an item not extracted because its operation was cancelled.
CANCELLED = "cancelled"


class ItemExtractionFailed(Exception):
    """One item could not be extracted. ``reason`` is a short code (see the module docs),
    ``detail`` the last error, ``usage`` what the attempts cost."""

    def __init__(self, item_index: int, reason: str, detail: str, usage: Usage | None = None):
        super().__init__(f"{reason}: {detail}")
        self.item_index, self.reason, self.detail = item_index, reason, detail
        self.usage = usage or Usage()


class ExtractionIncomplete(Exception):
    """Some items of a request failed. ``facts``: the facts of the items that succeeded
    (item order); ``failures``: item index → :class:`ItemExtractionFailed`.
    ``handlers.extract`` treats it as any batch error and asks again item by item, which
    is served from the extractor's cache without new model calls."""

    def __init__(self, facts: list[Fact], failures: dict[int, ItemExtractionFailed],
                 resolved: dict[int, list[str]] | None = None):
        super().__init__(f"{len(failures)} item(s) failed: " + "; ".join(
            f"item {i}: {f}" for i, f in sorted(failures.items())))
        self.facts, self.failures = facts, failures
        #: failed item index → the entity ids resolved for it before it failed (the
        #: offline extractor's speakers): names it gave that no fact carries
        self.resolved = resolved or {}


@dataclass
class ExtractionReport:
    """Per-request outcome: ``items_total``; ``no_fact_items`` (indices of items that
    yielded nothing); ``failures`` (index → "reason: detail"); ``usage`` summed over the
    request's model calls (cache hits cost nothing)."""

    items_total: int = 0
    no_fact_items: list[int] = field(default_factory=list)
    failures: dict[int, str] = field(default_factory=dict)
    usage: Usage = field(default_factory=Usage)


@dataclass
class _Draft:
    text: str
    fact_type: str
    start: datetime | None
    end: datetime | None
    mentions: list[tuple[str, str]]
    caused_by: list[int]  # indices into the item's drafts
    chunk_no: int


@dataclass
class _ItemResult:
    facts: list[Fact] | None = None
    failure: ItemExtractionFailed | None = None


# ---- time ----------------------------------------------------------------------------------


def _period(value: object) -> tuple[datetime, datetime] | None:
    """An ISO date/time at any granularity → the period it names, its dates as UTC days
    (a time: its wall clock, an offset given with it ignored); None if unusable."""
    if not isinstance(value, str) or not value.strip():
        return None
    m = _ISO.match(value)
    if not m:
        return None
    y, mo, d, hh, mm, ss, tz = m.groups()
    try:
        year = int(y)
        if not 1000 <= year <= 2200:
            return None
        if mo is None:
            return (datetime(year, 1, 1, tzinfo=timezone.utc),
                    day_window(date(year, 12, 31)).end)
        month = int(mo)
        if d is None:
            nxt = date(year + (month == 12), month % 12 + 1, 1)
            return (datetime(year, month, 1, tzinfo=timezone.utc),
                    day_window(nxt - timedelta(days=1)).end)
        day = date(year, month, int(d))
        if hh is None:
            w = day_window(day)
            return w.start, w.end
        # the model reads and answers the writer's wall clock (the prompt's "Written at"):
        # its time is kept as that wall time, as every window holds its dates as UTC days
        # (mneme.timeparse); an offset it repeats is not a conversion to make
        dt = datetime.fromisoformat(f"{day.isoformat()}T{int(hh):02d}:{mm}:{ss or '00'}"
                                    ).replace(tzinfo=timezone.utc)
        return dt, dt
    except ValueError:
        return None


def _window(start: object, end: object) -> tuple[datetime | None, datetime | None]:
    """occurred_start/end from the model's values: start of the start's period, end of
    the end's period (a lone date spans its own period); swapped when reversed."""
    ps, pe = _period(start), _period(end)
    if ps is None and pe is None:
        return None, None
    if ps is None:
        return None, pe[1]
    if pe is None:
        pe = ps
    s, e = ps[0], pe[1]
    if e < s:
        s, e = pe[0], ps[1]
    return s, e


def _annotate(text: str, ts: datetime) -> str:
    """Append resolved dates to relative time expressions the model left in ``text``
    (not to ones already followed by a parenthesis)."""
    for m in reversed(parse_when(text, ts)):
        if m.relative and m.describe() and not text[m.end:].lstrip().startswith("("):
            text = f"{text[:m.end]} ({m.describe()}){text[m.end:]}"
    return text


# ---- text ----------------------------------------------------------------------------------


def split_text(text: str, max_chars: int) -> list[str]:
    """``text`` cut into chunks of at most ``max_chars`` characters: whole paragraphs
    packed greedily, a long paragraph by sentences, a long sentence at whitespace."""
    text = text.strip()
    if len(text) <= max_chars:
        return [text] if text else []
    pieces: list[str] = []
    for para in re.split(r"\n\s*\n", text):
        para = para.strip()
        if not para:
            continue
        if len(para) <= max_chars:
            pieces.append(para)
            continue
        for sent in _SENT_SPLIT.split(para):
            while len(sent) > max_chars:
                cut = sent.rfind(" ", 0, max_chars)
                cut = cut if cut > max_chars // 2 else max_chars
                pieces.append(sent[:cut].strip())
                sent = sent[cut:].strip()
            if sent:
                pieces.append(sent)
    chunks: list[str] = []
    for p in pieces:
        sep = "\n\n" if "\n" in p or (chunks and chunks[-1].endswith("\n")) else " "
        if chunks and len(chunks[-1]) + len(sep) + len(p) <= max_chars:
            chunks[-1] = chunks[-1] + sep + p
        else:
            chunks.append(p)
    return chunks


def _halves(text: str) -> list[str] | None:
    """``text`` split in two at the paragraph or sentence boundary nearest its middle;
    None when it is too short or has no boundary."""
    if len(text) < _MIN_SPLIT_CHARS:
        return None
    mid = len(text) // 2
    cuts = [m.end() for m in re.finditer(r"\n\s*\n|(?<=[.!?])\s+", text)]
    cuts = [c for c in cuts if 0 < c < len(text)]
    if not cuts:
        return None
    cut = min(cuts, key=lambda c: abs(c - mid))
    parts = [text[:cut].strip(), text[cut:].strip()]
    return parts if all(parts) else None


# ---- what a reply may hold --------------------------------------------------------------------

#: The longest entity name kept (characters): longer is no name but a model's runaway text.
MAX_ENTITY_NAME_CHARS = 256


def max_facts(chunk: str) -> int:
    """The most facts one reply may give for ``chunk``: 16, plus one per 20 characters (a
    list "A, B, C" can give a fact per entry; a 6,000-character chunk 316). The facts
    beyond are dropped: a model that lists thousands of facts for a sentence is looping."""
    return 16 + len(chunk) // 20


def max_fact_chars(chunk: str) -> int:
    """The longest fact text kept for ``chunk``: twice its length plus 500 characters
    (names for pronouns and absolute dates make a fact longer than what it restates, never
    by this much). A longer fact is dropped: it cannot be a statement of this text."""
    return 2 * len(chunk) + 500


def _bounded(facts: list, chunk: str) -> list[dict | None]:
    """The model's ``facts`` for ``chunk`` in their positions (``caused_by`` indexes them),
    cut to :func:`max_facts`; a fact that is no object or whose text is longer than
    :func:`max_fact_chars` is None. Each drop is counted
    (``mneme.llm.output_errors{reason="oversized"}``) and logged, never quoted."""
    limit, longest = max_facts(chunk), max_fact_chars(chunk)
    out: list[dict | None] = []
    for f in facts[:limit]:
        ok = isinstance(f, dict) and not (isinstance(f.get("text"), str)
                                          and len(f["text"]) > longest)
        out.append(f if ok else None)
    dropped = len(facts) - sum(f is not None for f in out)
    if dropped:
        METRICS.add("mneme.llm.output_errors", dropped, operation="retain", reason="oversized")
        log.info("retain: dropped %d of the model's %d facts (more than %d facts, a fact "
                 "over %d characters, or not an object)", dropped, len(facts), limit, longest)
    return out


#: Format characters that are part of a name's spelling (Persian, Hindi, emoji
#: sequences), kept: the zero-width non-joiner and joiner.
_JOINERS = frozenset("\u200c\u200d")


def _name(value: object) -> str:
    """An entity name as kept: control and format characters (NUL, bell, zero-width
    spaces, direction marks; not the joiners of :data:`_JOINERS`) removed, whitespace
    collapsed; "" when nothing is left, when it is no string, or when it is longer than
    :data:`MAX_ENTITY_NAME_CHARS`."""
    if not isinstance(value, str):
        return ""
    name = " ".join("".join(ch for ch in value if unicodedata.category(ch) not in ("Cc", "Cf")
                            or ch.isspace() or ch in _JOINERS).split())
    if not name.strip("".join(_JOINERS)):  # joiners alone spell nothing
        return ""
    return name if len(name) <= MAX_ENTITY_NAME_CHARS else ""


# ---- the extractor ---------------------------------------------------------------------------


class LlmExtractor:
    """:class:`mneme.ports.Extractor` with a language model (see the module docs).

    ``gateway``: its ``retain`` endpoint does the work; ``resolver``: the per-bank entity
    resolver (default: memory-only); ``bank_config(bank_id)``: the bank's config (for
    ``retain_mission``; None or a missing bank → no mission); ``annotate_times`` as offline;
    ``cache_size``: how many items' outcomes are kept so that asking again for an item of
    a recent request (the handler's per-item retry, a redelivered event) costs no new
    model call. Thread-safe.
    """

    def __init__(self, gateway: Llm, resolver: EntityResolver | None = None,
                 bank_config: Callable[[str], BankConfig | None] | None = None,
                 annotate_times: bool = True, link_adjacent: bool = True, cache_size: int = 512):
        self.gateway = gateway
        self.resolver = resolver or EntityResolver()
        self.bank_config = bank_config or (lambda bank_id: None)
        self.annotate_times = annotate_times
        self.link_adjacent = link_adjacent
        self._cache: OrderedDict[tuple, _ItemResult] = OrderedDict()
        self._cache_size = cache_size
        self._reports: OrderedDict[str, ExtractionReport] = OrderedDict()
        self._lock = threading.Lock()
        self._pool: ThreadPoolExecutor | None = None

    # ---- public API --------------------------------------------------------------------

    def extract(self, bank_id: str, item: RetainItem, item_index: int,
                source_id: str) -> list[Fact]:
        """Facts of one item; ids ``derive_id(source_id, item_index, n)``. Raises
        :class:`ItemExtractionFailed` when the item cannot be extracted."""
        try:
            return self.extract_many(bank_id, [item], source_id, first_index=item_index)
        except ExtractionIncomplete as e:
            raise e.failures[item_index] from None

    def extract_many(self, bank_id: str, items: Sequence[RetainItem], source_id: str,
                     first_index: int = 0, stop: Callable[[], bool] | None = None) -> list[Fact]:
        """Facts of all ``items`` of one request, in item order (item k has index
        ``first_index + k``). Raises :class:`ExtractionIncomplete` (with the facts of
        the items that succeeded) when any item failed. ``stop()`` is asked before each
        item's model calls: once it is true (the operation was cancelled) the items not
        started fail with reason "cancelled" (not cached)."""
        mission = (self.bank_config(bank_id) or BankConfig()).retain_mission.strip()
        keys = [(bank_id, source_id, first_index + k, hash(it.content), hash(it.timestamp),
                 it.time_zone)
                for k, it in enumerate(items)]
        report = ExtractionReport(items_total=len(items))
        results: list[_ItemResult | None] = []
        with self._lock:
            for key in keys:
                hit = self._cache.get(key)
                if hit is not None:
                    self._cache.move_to_end(key)
                results.append(hit)
        todo = [k for k, r in enumerate(results) if r is None]
        drafts: dict[int, list[_Draft]] = {}
        if todo:
            def run(k: int):
                if stop is not None and stop():
                    raise ItemExtractionFailed(first_index + k, CANCELLED,
                                               "the operation was cancelled before this item "
                                               "was extracted")
                return self._drafts(items[k], first_index + k, mission)
            if len(todo) == 1:
                outs = [self._guard(run, todo[0])]
            else:
                outs = list(self._executor().map(lambda k: self._guard(run, k), todo))
            for k, (ds, usage, failure) in zip(todo, outs):
                report.usage.add(usage)
                if failure is not None:
                    results[k] = _ItemResult(failure=failure)
                else:
                    drafts[k] = ds
            # Resolve all new items' entities in item order, in one transaction: the
            # outcome must not depend on which concurrent call finished first.
            order = sorted(drafts)
            mention_lists = [d.mentions for k in order for d in drafts[k]]
            refs = iter(self.resolver.resolve_many(bank_id, mention_lists) if mention_lists else [])
            for k in order:
                results[k] = _ItemResult(facts=self._facts(bank_id, items[k], first_index + k,
                                                           source_id, drafts[k], refs))
            for k in todo:
                r = results[k]
                METRICS.add("mneme.retain.documents", outcome="failed" if r.failure else
                            "no_facts" if not r.facts else "extracted")
            with self._lock:
                for k in todo:
                    # not kept: a cancelled item, nor one that failed for want of open
                    # files (a model call's connection): tried again, it must call again
                    f = results[k].failure
                    if f is None or (f.reason != CANCELLED and resource_shortage(f) is None):
                        self._cache[keys[k]] = results[k]
                while len(self._cache) > self._cache_size:
                    self._cache.popitem(last=False)

        facts: list[Fact] = []
        failures: dict[int, ItemExtractionFailed] = {}
        prev: tuple[RetainItem, Fact] | None = None
        for k, (item, r) in enumerate(zip(items, results)):
            idx = first_index + k
            if r.failure is not None:
                failures[idx] = r.failure
                report.failures[idx] = str(r.failure)
                prev = None
                continue
            if not r.facts:
                report.no_fact_items.append(idx)
                prev = None  # the next item answers this one, not the one before it
                continue
            item_facts = [_copy(f) for f in r.facts]  # cached facts stay pristine
            if self.link_adjacent and prev is not None:
                p_item, p_fact = prev
                if p_item.document_id == item.document_id and \
                        abs(utc(p_item.timestamp) - utc(item.timestamp)) <= timedelta(days=1):
                    item_facts[0].links.append(Link(p_fact.id, "temporal", 0.5))
            facts += item_facts
            prev = (item, item_facts[-1])
        with self._lock:
            self._reports[source_id] = report
            while len(self._reports) > 64:
                self._reports.popitem(last=False)
        if failures:
            raise ExtractionIncomplete(facts, failures)
        return facts

    def report(self, source_id: str) -> ExtractionReport | None:
        """The outcome of the latest ``extract_many`` for ``source_id`` (removed once
        read); None when there was none."""
        with self._lock:
            return self._reports.pop(source_id, None)

    def close(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=False)
            self._pool = None

    # ---- one item --------------------------------------------------------------------

    def _executor(self) -> ThreadPoolExecutor:
        with self._lock:
            if self._pool is None:
                self._pool = ThreadPoolExecutor(self.gateway.settings.llm_max_concurrency,
                                                thread_name_prefix="llm-extract")
            return self._pool

    @staticmethod
    def _guard(run, k):
        try:
            ds, usage = run(k)
            return ds, usage, None
        except ItemExtractionFailed as f:
            return None, f.usage, f

    def _drafts(self, item: RetainItem, idx: int, mission: str) -> tuple[list[_Draft], Usage]:
        """The item's facts before entity resolution, and the usage of its calls. Raises
        ItemExtractionFailed."""
        usage = Usage()
        text = (item.content or "").strip()
        if not text:
            return [], usage
        chunks = split_text(text, self.gateway.settings.retain_llm_chunk_chars)
        drafts: list[_Draft] = []
        for c, chunk in enumerate(chunks):
            part = (c + 1, len(chunks)) if len(chunks) > 1 else None
            for raw in self._ask(item, idx, chunk, part, mission, usage, _MAX_SPLITS):
                # caused_by indexes the model's own list: map its positions to the drafts
                # kept (a fact dropped as unusable shifts every later one)
                at: dict[int, int] = {}
                mine: list[_Draft] = []
                for pos, fact in enumerate(raw):
                    d = self._draft(fact, item, c) if fact is not None else None
                    if d is not None:
                        at[pos] = len(drafts) + len(mine)
                        mine.append(d)
                for d in mine:
                    d.caused_by = [at[j] for j in dict.fromkeys(d.caused_by) if j in at]
                drafts += mine
        for n, d in enumerate(drafts):
            d.caused_by = [j for j in d.caused_by if j != n]
        return drafts, usage

    def _ask(self, item: RetainItem, idx: int, chunk: str, part, mission: str, usage: Usage,
             splits_left: int) -> list[list[dict]]:
        """The model's fact lists for ``chunk`` (one list per call: a truncated chunk is
        halved and asked again). Raises ItemExtractionFailed."""
        try:
            res = self.gateway.complete_json("retain", self._messages(item, chunk, part, mission),
                                             FACTS_SCHEMA, check_schema=_CHECK_SCHEMA,
                                             schema_name="facts", temperature=0.0)
        except LlmError as e:
            usage.add(e.usage)
            halves = _halves(chunk) if e.reason in ("truncated", "context_window") else None
            if halves and splits_left > 0:
                out: list[list[dict]] = []
                for h in halves:
                    out += self._ask(item, idx, h, part, mission, usage, splits_left - 1)
                return out
            raise ItemExtractionFailed(idx, e.reason, str(e), usage) from e
        usage.add(res.usage)
        facts = res.value.get("facts") if isinstance(res.value, dict) else None
        return [_bounded(as_list(facts), chunk)]

    def _messages(self, item: RetainItem, chunk: str, part, mission: str) -> list[dict]:
        ts = wall_clock(item.timestamp, item.time_zone)  # the writer's own clock and date
        lines = [f"Written at: {ts.isoformat().replace('+00:00', 'Z')} "
                 f"({ts:%A}, {ts.day} {ts:%B %Y})"]
        meta = item.metadata or {}
        if meta.get("speaker"):
            role = meta.get("speaker_role", "")
            lines.append(f"Speaker: {meta['speaker']}" + (f" ({role})" if role else ""))
        if item.context:
            lines.append(f"Context: {item.context}")
        caption = next((meta[k] for k in ("blip_caption", "image_caption", "caption") if meta.get(k)), "")
        if caption:
            lines.append(f"Shared image: {caption}")
        if part:
            lines.append(f"This is part {part[0]} of {part[1]} of a longer text.")
        lines.append(f'Text:\n"""\n{chunk}\n"""')
        system = SYSTEM_PROMPT
        if mission:
            system += ("\n\nThis memory bank's mission (what to focus on and what to leave out): "
                       + mission)
        return [{"role": "system", "content": system}, {"role": "user", "content": "\n".join(lines)}]

    def _draft(self, fact: dict, item: RetainItem, chunk_no: int) -> _Draft | None:
        text = fact.get("text")
        if not isinstance(text, str) or not text.strip():
            return None
        ts = wall_clock(item.timestamp, item.time_zone)
        text = " ".join(text.split())
        if self.annotate_times:
            text = _annotate(text, ts)
        start, end = _window(fact.get("occurred_start"), fact.get("occurred_end"))
        if start is None and end is None:
            found = parse_when(text, ts)
            w = found[0].window if found else day_window(ts)
            start, end = w.start, w.end
        ftype = fact.get("fact_type")
        mentions: list[tuple[str, str]] = []
        speaker = ((item.metadata or {}).get("speaker") or "").strip()
        if speaker and speaker.split()[0].lower() in text.lower():
            mentions.append((speaker, "PERSON"))
        for e in as_list(fact.get("entities")):
            name = _name(e.get("name")) if isinstance(e, dict) else ""
            if name:
                label = _LABELS.get(str(e.get("type") or "").strip().lower(), "CONCEPT")
                mentions.append((name, label))
        causes = [j for j in as_list(fact.get("caused_by")) if isinstance(j, int) and not isinstance(j, bool)]
        return _Draft(text, ftype if ftype in (WORLD, EXPERIENCE) else WORLD, start, end,
                      mentions, causes, chunk_no)

    def _facts(self, bank_id: str, item: RetainItem, idx: int, source_id: str,
               drafts: list[_Draft], refs) -> list[Fact]:
        ts = utc(item.timestamp)
        model = self.gateway.endpoint("retain").model if self.gateway.configured("retain") else ""
        ids = [derive_id(source_id, idx, n) for n in range(len(drafts))]
        facts: list[Fact] = []
        for n, d in enumerate(drafts):
            meta = dict(item.metadata or {})
            meta["extracted_by"] = model
            links = [Link(ids[j], "causal", 1.0) for j in d.caused_by]
            if n > 0:
                links.append(Link(ids[n - 1], "temporal", 1.0))
            facts.append(Fact(
                id=ids[n], bank_id=bank_id, text=d.text, fact_type=d.fact_type,
                context=item.context, occurred_start=d.start, occurred_end=d.end,
                mentioned_at=ts, tags=tuple(item.tags), metadata=meta,
                document_id=item.document_id, chunk_id=derive_id(source_id, idx, "chunk", d.chunk_no),
                entities=list(next(refs)), links=links, item_index=idx))
        return facts


def _copy(f: Fact) -> Fact:
    from dataclasses import replace
    return replace(f, links=list(f.links), entities=list(f.entities), metadata=dict(f.metadata),
                   embedding=list(f.embedding))


#: ``Fact.metadata["extracted_by"]`` of the offline facts kept beside a model's facts.
OFFLINE = "offline"


class WithOfflineFacts:
    """The model's facts of each item with the offline extractor's facts of the same item
    beside them (extraction modes ``auto`` and ``llm``), so that a model can add to what
    is remembered but never lose it: a turn the model skips, shortens or misreads is
    still recalled as offline would recall it.

    The offline facts carry ``metadata["extracted_by"] = "offline"`` and ids derived from
    ``derive_id(source_id, "offline")`` (fact n of item i: ``derive_id(that, i, n)``), so
    they never collide with the model's. An item the model *failed* on gets no offline
    facts: it fails as before (recorded on the operation with its reason, retried by
    RetryOperation) rather than being half-remembered. Same interface as the extractors
    (``extract``, ``extract_many``, ``embedding_parts``, ``report``)."""

    def __init__(self, llm: "LlmExtractor", offline) -> None:
        self.llm, self.offline = llm, offline

    def extract(self, bank_id: str, item: RetainItem, item_index: int,
                source_id: str) -> list[Fact]:
        """Facts of one item. Raises :class:`ItemExtractionFailed` as the model's extractor."""
        facts = self.llm.extract(bank_id, item, item_index, source_id)
        return facts + self._offline(bank_id, [item], source_id, item_index)

    def extract_many(self, bank_id: str, items: Sequence[RetainItem], source_id: str,
                     first_index: int = 0, stop: Callable[[], bool] | None = None) -> list[Fact]:
        """Facts of all ``items``: per item, the model's facts then the offline ones.
        Raises :class:`ExtractionIncomplete` (with the facts of the items that
        succeeded, offline ones included) when the model failed on any item."""
        try:
            facts, failures = self.llm.extract_many(bank_id, items, source_id, first_index,
                                                    stop), {}
        except ExtractionIncomplete as e:
            facts, failures = e.facts, e.failures
        # offline over each run of consecutive items the model did not fail on, so that
        # adjacent turns stay linked as offline links them
        for ok, run in groupby(range(len(items)), key=lambda k: first_index + k not in failures):
            if ok:
                ks = list(run)
                facts += self._offline(bank_id, items[ks[0]:ks[-1] + 1], source_id,
                                       first_index + ks[0])
        facts.sort(key=lambda f: f.item_index)  # stable: the model's facts first per item
        if failures:
            raise ExtractionIncomplete(facts, failures)
        return facts

    def report(self, source_id: str) -> ExtractionReport | None:
        """The model's report of the latest request (see :meth:`LlmExtractor.report`)."""
        return self.llm.report(source_id)

    def _offline(self, bank_id: str, items: Sequence[RetainItem], source_id: str,
                 first_index: int) -> list[Fact]:
        facts = self.offline.extract_many(bank_id, items, derive_id(source_id, OFFLINE),
                                          first_index=first_index)
        for f in facts:
            f.metadata["extracted_by"] = OFFLINE
        return facts

    def embedding_parts(self, facts: Sequence[Fact]) -> list[EmbeddingParts]:
        """How to embed: an offline fact as the offline extractor embeds it (its
        sentences, a short reply with the turn it answers, the turn before as context,
        among the offline facts), a model's fact as its own text (it is self-contained)."""
        offline = [k for k, f in enumerate(facts) if f.metadata.get("extracted_by") == OFFLINE]
        out = [EmbeddingParts((f.text,)) for f in facts]
        rule = getattr(self.offline, "embedding_parts", None)
        if rule is not None and offline:
            for k, p in zip(offline, rule([facts[k] for k in offline])):
                out[k] = EmbeddingParts(p.texts, None if p.context is None else offline[p.context])
        return out


class BankModeExtractor:
    """Chooses the extractor per bank by ``BankConfig.extraction_mode``: ``llm`` → the
    model's facts with the offline facts beside them (:class:`WithOfflineFacts`),
    ``llm_only`` → the model's facts alone (:class:`LlmExtractor`), ``offline`` → the
    offline extractor, ``""``/``auto`` → as ``llm`` when a retain model is configured,
    else offline. A bank asking for ``llm`` or ``llm_only`` on a server with no model gets
    offline extraction (logged once per bank, counted as
    ``mneme.retain.llm_unavailable_fallback``): retained text must still become memories.

    ``llm`` may be None (no model configured: everything is offline and litellm is never
    imported). Same interface as the extractors, plus :meth:`report`."""

    def __init__(self, offline, llm: LlmExtractor | None,
                 bank_config: Callable[[str], BankConfig | None] | None = None):
        self.offline, self.llm = offline, llm
        self.with_offline = WithOfflineFacts(llm, offline) if llm is not None else None
        self.bank_config = bank_config or (lambda bank_id: None)
        self._warned: set[str] = set()

    def for_bank(self, bank_id: str):
        """The extractor ``bank_id`` uses now."""
        cfg = self.bank_config(bank_id)
        mode = (cfg.extraction_mode if cfg is not None else "").strip().lower()
        have_llm = self.llm is not None and self.llm.gateway.configured("retain")
        if mode == "offline":
            return self.offline
        if mode in ("llm", "llm_only") and not have_llm:
            if bank_id not in self._warned:
                self._warned.add(bank_id)
                import logging
                logging.getLogger(__name__).warning(
                    "bank %s asks for LLM extraction but no model is configured "
                    "(MNEME_RETAIN_LLM_MODEL / MNEME_LLM_MODEL): extracting offline", bank_id)
            METRICS.add("mneme.retain.llm_unavailable_fallback")
            return self.offline
        if not have_llm:
            return self.offline
        return self.llm if mode == "llm_only" else self.with_offline

    def extract(self, bank_id: str, item: RetainItem, item_index: int, source_id: str) -> list[Fact]:
        return self.for_bank(bank_id).extract(bank_id, item, item_index, source_id)

    def extract_many(self, bank_id: str, items: Sequence[RetainItem], source_id: str,
                     first_index: int = 0, stop: Callable[[], bool] | None = None) -> list[Fact]:
        return self.for_bank(bank_id).extract_many(bank_id, items, source_id,
                                                   first_index=first_index, stop=stop)

    def report(self, source_id: str) -> ExtractionReport | None:
        return self.llm.report(source_id) if self.llm is not None else None
