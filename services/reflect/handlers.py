"""reflect's handler. Offline (no LLM) it is extractive: it recalls, keeps the memories
that best cover the question, and quotes them with their dates; ``extractive`` is set so
callers never mistake it for reasoning."""

from __future__ import annotations

import re
from dataclasses import dataclass, field, replace
from datetime import datetime
from typing import Callable, Iterable, Sequence

from mneme.domain import Directive, EventMeta, Filters, RecallOutcome, RecallQuery
from mneme.errors import FailedPrecondition, InvalidArgument, Unavailable
from mneme.timeparse import time_zone_name

_WORD = re.compile(r"[a-z0-9]+")
_STOP = frozenset("""a an the and or but of to in on at for with by from is are was were be been
do does did what when where who whom which why how i you he she it we they me my your his her
its our their this that these those there have has had not no yes about as into than then so
would could should can will just any some""".split())


@dataclass
class Reflection:
    """A reflect answer: ``text``, the memory ids it is based on, ``extractive`` flag;
    ``kinds`` maps an id of ``based_on`` to its kind ("mental_model", "observation";
    absent: a fact); ``directives`` are the ids of the directives the answer was told to
    follow (none offline: an extractive answer follows no rule); ``evidence`` the facts
    it cites as the model was shown them (:class:`mneme.domain.Memory`: what opinion
    formation needs); ``documents`` the document of a cited fact, where known (id →
    document id: deleting it erases a mental model's content based on the answer);
    ``sources`` the facts behind a cited observation (id → their ids)."""

    text: str
    based_on: list[str] = field(default_factory=list)
    extractive: bool = True
    kinds: dict[str, str] = field(default_factory=dict)
    directives: list[str] = field(default_factory=list)
    evidence: list = field(default_factory=list)
    documents: dict[str, str] = field(default_factory=dict)
    sources: dict[str, tuple] = field(default_factory=dict)


def scope_filters(tags: Sequence[str], tags_match: str = "any") -> Filters:
    """Recall's filters for a reflect scoped to ``tags`` in ``tags_match`` mode (a mode of
    :func:`mneme.domain.tags_match`; "any": units sharing one of them, and untagged ones).
    No filter when ``tags`` is empty, except in "exact" mode (the untagged units only), as
    Recall reads an empty ``tags``."""
    if tags or tags_match == "exact":
        return Filters(tags=tuple(tags), tags_match=tags_match)
    return Filters()


#: The largest answer a reflect model writes in one call by default, and the cap of a
#: request's ``max_tokens`` (``MNEME_LLM_MAX_OUTPUT_TOKENS``'s default): the model's output
#: cap bounds it anyway.
DEFAULT_ANSWER_TOKENS = 4096


def approx_tokens(text: str) -> int:
    """About one token per 4 characters: the count where no tokenizer is given."""
    return len(text) // 4 + 1 if text else 0


def answer_tokens(max_tokens: int, cap: int = DEFAULT_ANSWER_TOKENS) -> int:
    """The bound of a reflect answer for a request's ``max_tokens``: ``cap`` for 0, else
    the smaller of the two. Raises InvalidArgument naming ``max_tokens`` when negative."""
    if max_tokens < 0:
        raise InvalidArgument("max_tokens", "must not be negative")
    return min(max_tokens or cap, cap)


def fits(text: str, max_tokens: int, count: Callable[[str], int]) -> bool:
    """Whether ``text`` is at most ``max_tokens`` tokens by ``count``. Always counted: a
    character can be several tokens (a Hangul syllable is split into its letters)."""
    return count(text) <= max_tokens


def cut_to_tokens(text: str, max_tokens: int, count: Callable[[str], int]) -> str:
    """The longest prefix of ``text`` of at most ``max_tokens`` tokens by ``count``, ended
    at a word when one fits (else at a character); ``text`` itself when it fits. The
    prefixes are searched by halving (about log2(length) counts)."""
    if fits(text, max_tokens, count):
        return text
    ends = [m.start() for m in re.finditer(r"\s+", text)]  # the ends of whole words

    def longest(cuts: list[int]) -> int:
        lo, hi, best = 0, len(cuts) - 1, -1
        while lo <= hi:  # the prefix's token count grows with its length
            mid = (lo + hi) // 2
            if fits(text[:cuts[mid]].rstrip(), max_tokens, count):
                best, lo = mid, mid + 1
            else:
                hi = mid - 1
        return best
    i = longest(ends)
    if i >= 0:
        return text[:ends[i]].rstrip()
    chars = list(range(1, len(text)))
    i = longest(chars)
    return text[:chars[i]] if i >= 0 else ""


#: Why an answer is extractive: no reflect model, or the model failed (after its retries).
NO_MODEL = "no language model configured"
MODEL_FAILED = "the reflect model failed"
NO_MEMORIES = f"I have no memories that answer this (extractive answer, {NO_MODEL})."


def reflect_offline(bank_id: str, query: str, context: str, budget: str, now: datetime,
                    recall: Callable[[RecallQuery], RecallOutcome], max_quotes: int = 5,
                    tags: Sequence[str] = (), why: str = NO_MODEL, *, tags_match: str = "any",
                    max_tokens: int = DEFAULT_ANSWER_TOKENS,
                    count: Callable[[str], int] = approx_tokens) -> Reflection:
    """Extractive reflect: recall (``budget``, within ``tags`` in ``tags_match`` mode:
    :func:`scope_filters`), rerank the head by how many of the question's content words
    each memory covers, and quote the best ``max_quotes``; ``why`` says in the answer why
    it is extractive (:data:`NO_MODEL`, or :data:`MODEL_FAILED` for a model's fallback).
    The answer is at most ``max_tokens`` tokens by ``count``: its quotes, in order, while
    they fit whole (the rest left out, and uncited); when not even one does, the text is
    cut within the first (still cited). Raises InvalidArgument for an empty query."""
    if not query or not query.strip():
        raise InvalidArgument("query", "must not be empty")
    outcome = recall(RecallQuery(bank_id=bank_id, query=query, query_timestamp=now,
                                 filters=scope_filters(tags, tags_match), budget=budget,
                                 max_tokens=2048, time_zone=time_zone_name(now)))
    if not outcome.results:
        return Reflection(cut_to_tokens(
            NO_MEMORIES if why == NO_MODEL else
            f"I have no memories that answer this (extractive answer, {why}).",
            max_tokens, count), [], True)
    terms = content_terms(query + " " + context)
    ranked = sorted(enumerate(outcome.results),
                    key=lambda p: (-_coverage(p[1].fact.text, terms), p[0]))[:max_quotes]
    ranked.sort(key=lambda p: p[0])  # keep recall order among the chosen ones
    head = f"Extractive answer ({why}); the most relevant memories:"
    text, chosen = head, []
    for _, s in ranked:
        longer = text + "\n" + quote_line(s.fact.text, s.fact.occurred_start or s.fact.mentioned_at)
        if not fits(longer, max_tokens, count):
            if not chosen:  # not one whole quote fits: as much of the first as does
                text = cut_to_tokens(longer, max_tokens, count)
                chosen = [s] if len(text) > len(head) + 1 else []
            break
        text = longer
        chosen.append(s)
    return Reflection(text, [s.fact.id for s in chosen], True,
                      documents={s.fact.id: s.fact.document_id for s in chosen})


#: How :meth:`services.reflect.mental_models.MentalModels.search` marks a stale model in
#: the text the agent is shown.
STALE_MARK = "STALE: verify it against observations and facts"


def is_stale_memory(memory) -> bool:
    """True for a :class:`mneme.domain.Memory` that is a mental model marked stale."""
    return memory.kind == "mental_model" and f"({STALE_MARK};" in memory.text


#: The extractive answer when recall finds nothing.


def quote_line(text: str, when: datetime | None) -> str:
    """A memory as one line of an extractive answer: "- <text> (<date>)"."""
    date = f" ({when:%d %B %Y})" if when else ""
    return f"- {text.strip().replace(chr(10), ' ')}{date}"


def content_terms(text: str) -> set[str]:
    """The lower-cased words of ``text`` without stop words (what a question asks about)."""
    return {w for w in _WORD.findall(text.lower()) if w not in _STOP}


def _coverage(text: str, terms: set[str]) -> int:
    words = set(_WORD.findall(text.lower()))
    return len(terms & words)


def on_memory_changed(m, meta: EventMeta, *, mental_models) -> list:
    """A FactsExtracted or ObservationsChanged of a bank: refresh its mental models whose
    policy is due (:meth:`services.reflect.mental_models.MentalModels.refresh_due`).
    Produces nothing: a refresh appends its own MentalModelChanged. Of an event sent in
    parts (``part``/``parts``) only the last counts: an earlier one is half a change (a
    reconsolidation's first part deletes every observation), and a check per part would
    refresh once per part."""
    from mneme.events.v1 import events_pb2 as ev
    if m.part < m.parts:
        return []
    mental_models.refresh_due(m.bank_id, isinstance(m, ev.ObservationsChanged), meta.time)
    return []


def on_reflection_recorded(m, meta: EventMeta, *, opinions) -> list:
    """A reflection → the opinions it forms (``opinions``: a
    :class:`services.reflect.opinions.OpinionFormer`)."""
    return opinions.form(m, meta)


def model_failed(e: Exception, max_tokens: int = 0
                 ) -> Unavailable | FailedPrecondition | InvalidArgument:
    """The error a caller gets when the reflect model failed where no extractive answer
    can stand in (a ``response_schema`` to fill, or part of the answer already streamed),
    naming the model's failure reason: FailedPrecondition (gRPC FAILED_PRECONDITION) for
    a refusal asking again cannot cure (``LlmRequestError``: a wrong key, a prompt over
    the context window; ``LlmNotConfigured``), else Unavailable (UNAVAILABLE: ask again).
    An answer cut off at its token cap (``LlmOutputError``, reason "truncated") is cut off
    again when asked again: InvalidArgument naming ``max_tokens`` when the caller set it
    (``max_tokens`` > 0), else FailedPrecondition (the server's cap)."""
    from mneme.llm.types import LlmNotConfigured, LlmOutputError, LlmRequestError
    reason = getattr(e, "reason", "error")
    if isinstance(e, LlmOutputError) and reason == "truncated":
        if max_tokens > 0:
            return InvalidArgument("max_tokens", f"{max_tokens} tokens do not hold the "
                                   f"model's answer ({e}): ask with a larger max_tokens, or "
                                   "0 for the server's cap")
        return FailedPrecondition(f"the reflect model's answer did not fit in the server's "
                                  f"token cap ({e}); asking again fails the same way "
                                  "(MNEME_LLM_MAX_OUTPUT_TOKENS)")
    if isinstance(e, (LlmRequestError, LlmNotConfigured)):
        return FailedPrecondition(f"the reflect model refused the request ({reason}): {e}; "
                                  "asking again fails the same way until its settings change")
    return Unavailable(f"the reflect model failed ({reason}): {e}")


def record_reflection(bank_id: str, query: str, r: Reflection, tags: Sequence[str] = (),
                      evidence: Sequence[str] = ()):
    """The ``ReflectionRecorded`` event of ``r`` (topic ``mneme.reflect.v1``: for audit,
    and for the opinions formed from it), with the reflect's ``tags``. ``evidence``: more
    facts the answer restates (a revision's: those behind the content it revised)."""
    from mneme.events.v1 import events_pb2 as ev

    # The facts behind cited observations and mental models: the answer restates them,
    # so it is sealed under their keys too (deleting one erases it).
    behind = [f for f in (*(f for i in r.based_on for f in r.sources.get(i, ())), *evidence)
              if f not in r.based_on]
    msg = ev.ReflectionRecorded(bank_id=bank_id, query=query, answer=r.text,
                                based_on=r.based_on, extractive=r.extractive,
                                evidence_memory_ids=list(dict.fromkeys(behind)),
                                tools_called=getattr(r, "tools_called", []),
                                dropped_citations=len(getattr(r, "dropped_citations", [])),
                                tags=list(tags))
    for m in r.evidence:
        e = msg.evidence.add(memory_id=m.id, entities=[
            ev.Entity(id=x.id, name=x.name, label=x.label) for x in m.entities])
        if m.mentioned_at is not None:
            e.mentioned_at.FromDatetime(m.mentioned_at)
    u = getattr(r, "usage", None)
    if u is not None and u.calls:
        msg.llm_usage.CopyFrom(ev.LlmUsage(model=u.model, calls=u.calls, failed_calls=u.failed_calls,
                                           input_tokens=u.input_tokens, output_tokens=u.output_tokens,
                                           cost_usd=u.cost_usd))
    return msg


#: Most directives one reflect is told to follow (the highest priorities).
MAX_DIRECTIVES = 50


def directives_in_scope(directives: Iterable[Directive], tags: Sequence[str]) -> list[Directive]:
    """The active directives that apply to a reflect with ``tags`` (untagged ones always,
    tagged ones when they share a tag), highest priority first (ties by id), at most
    :data:`MAX_DIRECTIVES`."""
    found = [d for d in directives if d.applies_to(tags)]
    return sorted(found, key=lambda d: (-d.priority, d.id))[:MAX_DIRECTIVES]


class Reflector:
    """The Reflect API's two calls over ``agent`` (a reflect model's
    :class:`services.reflect.agent.ReflectAgent`, or None: :func:`reflect_offline` over
    ``recall``). ``directives(bank_id)`` lists the bank's directives (the catalog's; None:
    none are known here); those in scope of a call's ``tags`` go into the agent's prompt.
    ``mental_models`` (a :class:`services.reflect.mental_models.MentalModels`) answers
    first offline when a fresh model covers the question. A call's ``tags`` (matched in
    its ``tags_match`` mode) also scope every read of the bank: recall, and the
    mental-model and observation searches. A call's ``max_tokens`` bounds its answer
    (:func:`answer_tokens`: 0 and larger values are ``answer_cap``); an extractive answer
    is cut to it by ``tokens`` (a :class:`mneme.ports.TokenCounter`, recall's; None: about
    4 characters a token). Every answer is passed to ``record(message)`` as a
    ReflectionRecorded."""

    def __init__(self, agent, recall: Callable, record: Callable,
                 directives: Callable[[str], Iterable[Directive]] | None = None,
                 mental_models=None, tokens=None,
                 answer_cap: int = DEFAULT_ANSWER_TOKENS) -> None:
        self.agent, self.recall, self.record = agent, recall, record
        self.directives, self.mental_models = directives, mental_models
        self.count = tokens.count if tokens is not None else approx_tokens
        self.answer_cap = answer_cap

    def _callers(self, max_tokens: int) -> int:
        """``max_tokens`` when it, not the server's cap, bounded the answer; else 0."""
        return max_tokens if 0 < max_tokens < self.answer_cap else 0

    def _in_scope(self, bank_id: str, tags: Sequence[str]) -> list[Directive]:
        return directives_in_scope(self.directives(bank_id), tags) if self.directives else []

    def reflect(self, bank_id, query, context, budget, now, response_schema=None,
                tags: Sequence[str] = (), mental_models: bool = True, *,
                tags_match: str = "any", max_tokens: int = 0) -> Reflection:
        """One answer. InvalidArgument for a ``response_schema`` without a reflect model,
        or a negative ``max_tokens``; Unavailable when the model failed and no extractive
        answer can stand in (a ``response_schema`` it never filled).
        ``mental_models`` False leaves the bank's mental models out (a refresh of one
        must not answer from it)."""
        limit = answer_tokens(max_tokens, self.answer_cap)
        if self.agent is None and response_schema is not None:
            raise InvalidArgument("response_schema", "needs a reflect model "
                                  "(MNEME_REFLECT_LLM_MODEL or MNEME_LLM_MODEL)")
        if self.agent is not None:
            from mneme.llm.types import LlmError
            try:
                r = self.agent(bank_id, query, context, budget, now, response_schema,
                               directives=self._in_scope(bank_id, tags), tags=tags,
                               mental_models=mental_models, tags_match=tags_match,
                               max_tokens=limit)
            except LlmError as e:  # no fallback was possible (a schema, a streamed part)
                raise model_failed(e, self._callers(max_tokens)) from e
        else:
            if not query or not query.strip():
                raise InvalidArgument("query", "must not be empty")
            def from_recall() -> Reflection:
                return reflect_offline(bank_id, query, context, budget, now, self.recall,
                                       tags=tags, tags_match=tags_match, max_tokens=limit,
                                       count=self.count)
            r = ((self.mental_models.answer_offline(bank_id, query, tags, from_recall,
                                                    tags_match=tags_match)
                  if self.mental_models is not None and mental_models else None)
                 or from_recall())
            if not fits(r.text, limit, self.count):  # a mental model's content
                r = replace(r, text=cut_to_tokens(r.text, limit, self.count))
        self.record(record_reflection(bank_id, query, r, tags))
        return r

    def revise(self, bank_id: str, query: str, prior: str, cited: Sequence[str],
               new: Sequence, now: datetime, tags: Sequence[str] = (),
               evidence: Sequence[str] = ()) -> Reflection | None:
        """The reflect model's revision of an answer to ``query`` (a delta refresh of a
        mental model): ``prior`` is the current answer citing ``[n]`` = ``cited[n-1]``,
        ``new`` the memories (:class:`mneme.domain.Memory`) that changed since. None
        without a reflect model, or when it fails and the agent falls back offline (the
        caller merges extractively). Recorded like an answer, with ``evidence`` (the facts
        behind ``prior``'s cited observations) among the facts it restates."""
        if self.agent is None:
            return None
        from mneme.llm.types import LlmError
        try:
            r = self.agent.revise(bank_id, query, prior, cited, new, now,
                                  directives=self._in_scope(bank_id, tags))
        except LlmError:
            if not self.agent.fallback_offline:
                raise
            return None
        # the revision restates ``prior``: sealed under the facts behind it too
        self.record(record_reflection(bank_id, query, r, tags, evidence))
        return r

    def stream(self, bank_id, query, context, budget, now, response_schema=None,
               tags: Sequence[str] = (), *, tags_match: str = "any", max_tokens: int = 0):
        """The agent's events as they happen, ending with ``Done``; offline, ``Done`` only
        (arguments as :meth:`reflect`). Raises Unavailable when the model fails after
        part of the answer was streamed (it cannot be taken back, so there is no
        extractive fallback then): the client may ask again."""
        from mneme.llm.types import LlmError
        from services.reflect.agent import Done
        if self.agent is None:
            yield Done(self.reflect(bank_id, query, context, budget, now, response_schema, tags,
                                    tags_match=tags_match, max_tokens=max_tokens))
            return
        limit = answer_tokens(max_tokens, self.answer_cap)
        try:
            for event in self.agent.stream(bank_id, query, context, budget, now,
                                           response_schema,
                                           directives=self._in_scope(bank_id, tags), tags=tags,
                                           tags_match=tags_match, max_tokens=limit):
                if isinstance(event, Done):
                    self.record(record_reflection(bank_id, query, event.reflection, tags))
                yield event
        except LlmError as e:
            raise model_failed(e, self._callers(max_tokens)) from e
