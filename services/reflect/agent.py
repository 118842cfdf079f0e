"""Reflect with a language model (``MNEME_REFLECT_LLM_MODEL`` / ``MNEME_LLM_MODEL``): an
agentic loop that answers a question by searching the bank with tools.

Tools, in order of distillation (the system prompt asks for this order):

1. ``search_mental_models(query)`` — curated standing answers (:data:`MemorySearch` port);
2. ``search_observations(query)`` — consolidated beliefs (:data:`MemorySearch` port);
3. ``recall(query)`` — raw facts through search's recall, at the request's budget.

The mental-model and observation ports default to :func:`no_memories`; the composition root
passes :meth:`services.reflect.mental_models.MentalModels.search` and search's observations.
A mental model shown as fresh may answer on its own (reflect stops early, at any budget); a
stale one is marked so, for the model to verify it against observations and facts. The
loop never answers from nothing or from stale models alone: a reply while no memory was
supplied, or only stale mental models, and ``recall`` was never called is discarded, and
recall is run with the question itself (a ``ToolEvent`` with ``forced=True``).

:meth:`ReflectAgent.revise` is a delta refresh of a mental model: one turn, no tools, that
rewrites the model's current content with the memories that changed since.

Bounds: at most ``MNEME_REFLECT_MAX_ITERATIONS`` model turns (the last one is offered no
tools, so it must answer) and ``MNEME_REFLECT_MAX_CONTEXT_TOKENS`` tokens of memory text in
the context (memories beyond it are not shown; a tool then says the budget is reached).

The system prompt carries the current time (the ``now`` of the request) and the bank's
disposition (skepticism, literalism, empathy, 1–5). Memories are shown with short
references ``[m1]``, ``[m2]`` …; the answer cites them in brackets. Citations are checked
against the memories actually supplied: unknown ones (invented references or ids) are
removed from the text, listed in ``dropped_citations`` and counted
(``mneme.reflect.invalid_citations``); the valid ones are renumbered ``[1]``, ``[2]`` …
in the order of ``based_on``.

With ``response_schema`` (a JSON schema) the answer is a JSON object
``{"answer": <schema>, "memory_ids": [refs]}``; ``structured`` holds the answer and
``text`` its JSON. The streaming variant (:meth:`ReflectAgent.stream`) yields
:class:`ToolEvent`, :class:`TextDelta` and finally :class:`Done`; text of a turn is
streamed live once the loop is grounded (recall tried, or memories other than stale
mental models supplied), so a discarded ungrounded reply is never shown. When the model cannot be reached the agent
falls back to the extractive answer (``extractive=True``) unless text was already streamed.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import re
from dataclasses import dataclass, field
from datetime import datetime
from typing import Callable, Iterator, Protocol, Sequence

from mneme.deadline import current as current_deadline
from mneme.domain import BankConfig, Directive, Memory, RecallOutcome, RecallQuery, utc
from mneme.errors import InvalidArgument
from mneme.limits import limits
from mneme.llm.types import Completion, LlmError, Usage, tool_spec
from mneme.llm.jsonout import JsonOutputError, parse_json, validate
from mneme.llm.metrics import METRICS
from mneme.ports import Llm
from mneme.timeparse import time_zone_name
from services.reflect.handlers import (MODEL_FAILED, Reflection, is_stale_memory,
                                      reflect_offline, scope_filters)

__all__ = ["ReflectAgent", "Memory", "MemorySearch", "no_memories", "AgentReflection",
           "ToolEvent", "TextDelta", "Done", "TOOLS", "system_prompt"]

log = logging.getLogger(__name__)

#: Tool calls run per model turn; a model asking for more (a loop, or an injected order to
#: search everything) gets the first ones, each a recall at the request's budget.
MAX_TOOL_CALLS_PER_TURN = 8


class MemorySearch(Protocol):
    def __call__(self, bank_id: str, query: str, now: datetime, limit: int,
                 tags: Sequence[str] = (), tags_match: str = "any") -> list[Memory]:
        """Up to ``limit`` memories of ``bank_id`` for ``query``, best first. Both ports
        are also given ``tags=`` and ``tags_match=`` (the request's scope, matched as
        Recall matches it: a tag-scoped reflect reads nothing of another scope)."""


def no_memories(bank_id: str, query: str, now: datetime, limit: int, **_) -> list[Memory]:
    """The mental-model and observation ports until those exist: nothing."""
    return []


@dataclass
class AgentReflection(Reflection):
    """A reflect answer from the model. Beyond :class:`Reflection`: ``structured`` (the
    parsed answer when a ``response_schema`` was given), ``usage`` (tokens and cost of all
    turns), ``tools_called`` (tool names in call order), ``dropped_citations`` (cited
    references never supplied), ``iterations`` (model turns) and ``memories_supplied``."""

    structured: object = None
    usage: Usage = field(default_factory=Usage)
    tools_called: list[str] = field(default_factory=list)
    dropped_citations: list[str] = field(default_factory=list)
    iterations: int = 0
    memories_supplied: int = 0


@dataclass
class ToolEvent:
    """A tool ran: its ``name``, ``arguments``, how many memories it returned (``results``,
    new and already shown), and whether the agent ``forced`` it (recall fallback)."""

    name: str
    arguments: dict
    results: int
    forced: bool = False


@dataclass
class TextDelta:
    """A piece of the answer's text (citations already rewritten)."""

    text: str


@dataclass
class Done:
    """The end of a stream, with the complete :class:`AgentReflection`."""

    reflection: AgentReflection


TOOLS = [
    tool_spec("search_mental_models", "Search the bank's mental models: curated standing answers "
              "to recurring questions. Try this first.",
              {"query": {"type": "string", "description": "What to look for"}}, ["query"]),
    tool_spec("search_observations", "Search consolidated observations: deduplicated beliefs "
              "backed by several facts. Try this second.",
              {"query": {"type": "string", "description": "What to look for"}}, ["query"]),
    tool_spec("recall", "Search the raw facts (what was said and done, with dates). Use it when "
              "the searches above return nothing or not enough; call it again with other "
              "words (names, places, time expressions) to find more.",
              {"query": {"type": "string", "description": "What to look for"}}, ["query"]),
]

_TRAITS = {
    "skepticism": {1: "Take the memories at face value.",
                   2: "Mostly trust the memories; mention an obvious contradiction.",
                   3: "Weigh the memories; point out contradictions and thin evidence.",
                   4: "Be critical: prefer claims several memories support, flag weak or "
                      "conflicting evidence and say how sure you are.",
                   5: "Be highly skeptical: accept only what the memories clearly support, "
                      "question single or conflicting sources, and state your uncertainty."},
    "literalism": {1: "Read between the lines: infer intent and likely implications.",
                   2: "Interpret freely where the memories strongly suggest something.",
                   3: "Balance what is stated with reasonable inference, marking inferences.",
                   4: "Stick closely to what the memories state; mark any inference.",
                   5: "Answer strictly from what the memories literally state; no inference."},
    "empathy": {1: "Use a neutral, purely factual tone.",
                2: "Be matter-of-fact, polite.",
                3: "Be considerate of the people involved.",
                4: "Be warm; acknowledge feelings the memories show.",
                5: "Be very warm and supportive; acknowledge feelings and circumstances."},
}

_REF = re.compile(r"^m\d+$")
_UUID = re.compile(r"^[0-9a-f]{8}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{12}$", re.I)
_BRACKET = re.compile(r"\s?\[([^\[\]\n]{1,400})\]")


def _when(dt: datetime | None) -> str:
    return f"{utc(dt):%Y-%m-%d}" if dt else "undated"


def _trait(cfg: BankConfig, name: str) -> str:
    v = min(5, max(1, int(getattr(cfg, name) or 3)))
    return f"- {name} {v}/5: {_TRAITS[name][v]}"


def _clock(now: datetime) -> datetime:
    """``now`` on its own zone's clock; naive = UTC."""
    return now if now.tzinfo is not None else utc(now)


def system_prompt(cfg: BankConfig, now: datetime, response_schema: dict | None,
                  directives: Sequence[Directive] = ()) -> str:
    """The reflect system prompt: role, current time, tool order, citation rules,
    disposition, the bank's ``reflect_mission``, its ``directives`` in force (in the order given: highest priority
    first) and (with ``response_schema``) the answer format. ``now`` is shown on its own
    zone's clock (the caller's ``time_zone``; naive = UTC)."""
    now = _clock(now)
    parts = [
        "You are the reflection module of a long-term memory system for an AI agent. You "
        "answer a question by reasoning over the memories of one memory bank, which you "
        "retrieve with tools.",
        f"Current time: {now.isoformat(timespec='seconds').replace('+00:00', 'Z')} "
        f"({now:%A}, {now.day} {now:%B %Y}). Interpret \"now\", \"recently\", \"last year\" "
        "relative to it; memories carry the dates they happened.",
        "Search from the most to the least distilled knowledge and stop once you have enough:\n"
        "1. search_mental_models — curated standing answers;\n"
        "2. search_observations — consolidated beliefs;\n"
        "3. recall — raw facts; use it whenever the above return nothing or not enough, "
        "several times with different words if needed.\n"
        "Never say you do not know before you have used recall.",
        "Answer from the memories only; never invent facts, counts or dates. When memories "
        "conflict, prefer the more recent one and say so. Cite the memories your answer "
        "relies on by their reference in square brackets right after the claim, e.g. "
        "\"She moved to Berlin in 2021 [m3].\" Cite only references you were given.",
        "Disposition:\n" + "\n".join(_trait(cfg, t) for t in ("skepticism", "literalism", "empathy")),
    ]
    if cfg.reflect_mission.strip():
        parts.append("Mission of this memory bank (what your answers are for):\n"
                     + cfg.reflect_mission.strip())
    if directives:
        parts.append(
            "Directives of this memory bank: rules you must follow in every answer, above "
            "the disposition and your own judgement; when two conflict, the earlier one "
            "wins:\n" + "\n".join(f"{i}. {' '.join(d.text.split())}"
                                  for i, d in enumerate(directives, 1)))
    if response_schema is not None:
        parts.append(
            "When you answer, reply with only a JSON object {\"answer\": ..., \"memory_ids\": "
            "[...]} where \"answer\" matches this JSON schema and \"memory_ids\" lists the "
            "references (like \"m3\") of the memories the answer relies on:\n"
            + json.dumps(response_schema, ensure_ascii=False))
    return "\n\n".join(parts)


def revise_prompt(cfg: BankConfig, now: datetime, directives: Sequence[Directive] = ()) -> str:
    """The system prompt of :meth:`ReflectAgent.revise`: role, current time, citation
    rules, disposition, mission and directives (no tools)."""
    now = _clock(now)
    parts = [
        "You are the reflection module of a long-term memory system for an AI agent. You "
        "keep a mental model: a standing, cited answer to one question about the memories "
        "of one memory bank, revised as new memories arrive.",
        f"Current time: {now.isoformat(timespec='seconds').replace('+00:00', 'Z')}.",
        "Answer from the memories only; never invent facts, counts or dates. Cite the "
        "memories each statement relies on by their reference in square brackets right "
        "after it, e.g. \"She moved to Berlin in 2021 [m3].\" Cite only references you "
        "were given.",
        "Disposition:\n" + "\n".join(_trait(cfg, t) for t in ("skepticism", "literalism", "empathy")),
    ]
    if cfg.reflect_mission.strip():
        parts.append("Mission of this memory bank (what your answers are for):\n"
                     + cfg.reflect_mission.strip())
    if directives:
        parts.append("Directives of this memory bank: rules you must follow, the earlier "
                     "first:\n" + "\n".join(f"{i}. {' '.join(d.text.split())}"
                                             for i, d in enumerate(directives, 1)))
    return "\n\n".join(parts)


def _wrapper_schema(response_schema: dict) -> dict:
    return {"type": "object", "required": ["answer", "memory_ids"], "additionalProperties": False,
            "properties": {"answer": response_schema,
                           "memory_ids": {"type": "array", "items": {"type": "string"}}}}


class _Context:
    """The memories supplied so far (ref ↔ id) and the token budget they use."""

    def __init__(self, max_tokens: int, count: Callable[[str], int]):
        self.max_tokens, self.count = max_tokens, count
        self.used = 0
        self.by_ref: dict[str, Memory] = {}
        self.ref_of: dict[str, str] = {}  # memory id → ref

    @property
    def grounded(self) -> bool:
        """True once a memory other than a stale mental model was supplied."""
        return any(not is_stale_memory(m) for m in self.by_ref.values())

    @property
    def exhausted(self) -> bool:
        return self.used >= self.max_tokens

    def remaining(self) -> int:
        return max(0, self.max_tokens - self.used)

    def supply(self, memories: Sequence[Memory]) -> tuple[list[str], bool]:
        """Lines for ``memories`` (already shown ones by reference only) and whether some
        did not fit into the budget."""
        lines, cut = [], False
        for m in memories:
            ref = self.ref_of.get(m.id)
            if ref is None:
                line = self._line(f"m{len(self.by_ref) + 1}", m)
                n = self.count(line)
                if self.used + n > self.max_tokens:
                    cut = True
                    continue
                ref = f"m{len(self.by_ref) + 1}"
                self.by_ref[ref], self.ref_of[m.id] = m, ref
                self.used += n
                lines.append(line)
            else:
                lines.append(f"[{ref}] (shown above)")
        return lines, cut

    @staticmethod
    def _line(ref: str, m: Memory) -> str:
        kind = {"mental_model": "mental model", "observation": "observation"}.get(m.kind, m.fact_type or "fact")
        return f"[{ref}] {_when(m.when)} · {kind} · {' '.join(m.text.split())}"

    def resolve(self, token: str) -> str | None:
        """The memory id a cited token names (a ref or a supplied id), else None."""
        if token in self.by_ref:
            return self.by_ref[token].id
        return token if token in self.ref_of else None


class _Citations:
    """Rewrites citations in streamed text: valid refs → ``[n]`` (position in
    ``based_on``), unknown ones removed and recorded. Holds back text from an unclosed
    ``[`` until it closes (or grows past 400 characters)."""

    def __init__(self, ctx: _Context):
        self.ctx = ctx
        self.based_on: list[str] = []
        self.dropped: list[str] = []
        self._buf = ""

    def _group(self, m: re.Match) -> str:
        tokens = [t for t in re.split(r"[,;\s]+", m.group(1).strip()) if t]
        if not tokens or not all(_REF.match(t) or _UUID.match(t) or self.ctx.resolve(t) for t in tokens):
            return m.group(0)  # not a citation ("[sic]", "[1]" in quoted text)
        nums = []
        for t in tokens:
            mid = self.ctx.resolve(t)
            if mid is None:
                self.dropped.append(t)
                continue
            if mid not in self.based_on:
                self.based_on.append(mid)
            n = self.based_on.index(mid) + 1
            if n not in nums:
                nums.append(n)
        if not nums:
            return ""
        lead = " " if m.group(0).startswith(" ") else ""
        return f"{lead}[{', '.join(map(str, nums))}]"

    def feed(self, text: str) -> str:
        self._buf += text
        cut = len(self._buf)
        open_at = self._buf.rfind("[")
        if open_at >= 0 and "]" not in self._buf[open_at:] and len(self._buf) - open_at <= 400:
            cut = open_at - (1 if open_at > 0 and self._buf[open_at - 1] == " " else 0)
        ready, self._buf = self._buf[:cut], self._buf[cut:]
        return _BRACKET.sub(self._group, ready)

    def flush(self) -> str:
        ready, self._buf = self._buf, ""
        return _BRACKET.sub(self._group, ready)


def _approx_tokens(text: str) -> int:
    return len(text) // 4 + 1


class ReflectAgent:
    """Reflect as an agentic loop (see the module docs).

    ``recall(RecallQuery) -> RecallOutcome`` is search's recall (in process or remote);
    ``mental_models`` / ``observations`` are :class:`MemorySearch` ports;
    ``bank_config(bank_id)`` gives the disposition traits (None → defaults 3/3/3);
    ``tokens``: a :class:`mneme.ports.TokenCounter` for the context budget (default: ~4
    characters per token); ``fallback_offline``: answer extractively when the model is
    unreachable. Calling the agent has ``reflect_offline``'s signature (minus ``recall``)
    plus ``response_schema``."""

    def __init__(self, gateway: Llm, recall: Callable[[RecallQuery], RecallOutcome], *,
                 mental_models: MemorySearch = no_memories, observations: MemorySearch = no_memories,
                 bank_config: Callable[[str], BankConfig | None] | None = None, tokens=None,
                 max_iterations: int | None = None, max_context_tokens: int | None = None,
                 fallback_offline: bool = True):
        st = gateway.settings
        self.gateway, self.recall = gateway, recall
        self.mental_models, self.observations = mental_models, observations
        self.bank_config = bank_config or (lambda bank_id: None)
        self.count = tokens.count if tokens is not None else _approx_tokens
        self.max_iterations = max_iterations or st.reflect_max_iterations
        self.max_context_tokens = max_context_tokens or st.reflect_max_context_tokens
        self.fallback_offline = fallback_offline

    # ---- entry points ----------------------------------------------------------------------

    def __call__(self, bank_id: str, query: str, context: str, budget: str, now: datetime,
                 response_schema: dict | None = None,
                 directives: Sequence[Directive] = (), tags: Sequence[str] = (),
                 mental_models: bool = True, tags_match: str = "any",
                 max_tokens: int | None = None) -> AgentReflection:
        """Answer ``query`` (``context``: extra text from the caller; ``budget``:
        low/mid/high for recall; ``now``: the current time; ``directives``: the rules in
        force, highest priority first; ``tags``: the scope of every read of the bank
        (recall, the mental-model and observation searches), matched in ``tags_match``
        mode as Recall matches it; ``mental_models`` False: the mental-model tool finds
        nothing; ``max_tokens``: the model's max tokens on every turn, and the bound of an
        extractive fallback (None: the gateway's ``llm_max_output_tokens``)). Raises
        InvalidArgument for an empty query,
        LlmError when the model fails and ``fallback_offline`` is off."""
        for ev in self._run(bank_id, query, context, budget, now, response_schema,
                            live=False, directives=directives, tags=tags,
                            mental_models=mental_models, tags_match=tags_match,
                            max_tokens=max_tokens):
            if isinstance(ev, Done):
                return ev.reflection
        raise RuntimeError("reflect loop ended without an answer")  # unreachable

    reflect = __call__

    def stream(self, bank_id: str, query: str, context: str, budget: str, now: datetime,
               response_schema: dict | None = None,
               directives: Sequence[Directive] = (),
               tags: Sequence[str] = (), tags_match: str = "any",
               max_tokens: int | None = None) -> Iterator[ToolEvent | TextDelta | Done]:
        """The streaming variant: :class:`ToolEvent` per tool run, :class:`TextDelta` as
        the answer is generated, and last :class:`Done` (whose ``reflection.text`` is the
        concatenation of the deltas of the final turn)."""
        return self._run(bank_id, query, context, budget, now, response_schema, live=True,
                         directives=directives, tags=tags, tags_match=tags_match,
                         max_tokens=max_tokens)

    # ---- the loop ----------------------------------------------------------------------------

    def _run(self, bank_id, query, context, budget, now, response_schema, live: bool,
             directives: Sequence[Directive] = (), tags: Sequence[str] = (),
             mental_models: bool = True, tags_match: str = "any",
             max_tokens: int | None = None):
        scope = (tags, tags_match)
        if not query or not query.strip():
            raise InvalidArgument("query", "must not be empty")
        cfg = self.bank_config(bank_id) or BankConfig()
        ctx = _Context(self.max_context_tokens, self.count)
        usage = Usage()
        called: list[str] = []
        user = f"Question: {query.strip()}"
        if context and context.strip():
            user += f"\n\nContext from the caller: {context.strip()}"
        messages = [{"role": "system", "content": system_prompt(cfg, now, response_schema,
                                                                directives)},
                    {"role": "user", "content": user}]
        streamed = False
        answer: Completion | None = None
        turn_cit, turn_text = _Citations(ctx), []
        it = 0
        try:
            while it < self.max_iterations:
                current_deadline().check("reflect")  # stop when the caller stops waiting
                it += 1
                last = it == self.max_iterations or ctx.exhausted
                grounded = "recall" in called or ctx.grounded
                tools = None if last else TOOLS
                turn_cit, turn_text = _Citations(ctx), []  # citations of this turn only
                if live and grounded:
                    c = None
                    for piece in self.gateway.stream("reflect", messages, tools=tools,
                                                     temperature=0.2, max_tokens=max_tokens):
                        if isinstance(piece, Completion):
                            c = piece
                        elif response_schema is None:
                            out = turn_cit.feed(piece)
                            if out:
                                streamed = True
                                turn_text.append(out)
                                yield TextDelta(out)
                        else:
                            streamed = True
                            yield TextDelta(piece)
                else:
                    c = self.gateway.complete("reflect", messages, tools=tools, temperature=0.2,
                                              max_tokens=max_tokens)
                usage.add(c.usage)
                if c.tool_calls and not last:
                    # the calls beyond the bound are neither run nor kept in the turn
                    c = dataclasses.replace(c, tool_calls=c.tool_calls[:MAX_TOOL_CALLS_PER_TURN])
                    messages.append(c.message())
                    for tc in c.tool_calls:
                        text, n = self._tool(tc.name, tc.args(), bank_id, budget, now, ctx,
                                             scope, mental_models)
                        called.append(tc.name)
                        messages.append({"role": "tool", "tool_call_id": tc.id, "content": text})
                        yield ToolEvent(tc.name, tc.args(), n)
                    continue
                if not grounded:
                    # An answer before any memory was seen, or from stale mental models
                    # alone: search the raw facts first.
                    args = {"query": query.strip()}
                    text, n = self._tool("recall", args, bank_id, budget, now, ctx, scope)
                    called.append("recall")
                    call_id = f"forced_recall_{it}"
                    messages.append({"role": "assistant", "content": None, "tool_calls": [{
                        "id": call_id, "type": "function",
                        "function": {"name": "recall", "arguments": json.dumps(args)}}]})
                    messages.append({"role": "tool", "tool_call_id": call_id, "content": text})
                    yield ToolEvent("recall", args, n, forced=True)
                    if it >= self.max_iterations:
                        it -= 1  # the discarded turn must not use up the last answer turn
                    continue
                answer = c
                break
        except LlmError as e:
            usage.add(e.usage)
            # an extractive answer cannot fill a response_schema: the caller would get text
            # where it asked for that JSON
            if not self.fallback_offline or streamed or response_schema is not None:
                raise
            log.warning("reflect: model failed (%s); answering extractively", e)
            bound = {} if max_tokens is None else {"max_tokens": max_tokens}
            r = reflect_offline(bank_id, query, context, budget, now, self.recall, tags=tags,
                                why=MODEL_FAILED, tags_match=tags_match, count=self.count,
                                **bound)
            # keeps the quoted facts' documents: a mental model refreshed from this answer
            # records them, and deleting one of them must erase its content
            yield Done(AgentReflection(r.text, r.based_on, True, documents=r.documents,
                                       usage=usage, tools_called=called, iterations=it,
                                       memories_supplied=len(ctx.by_ref)))
            return

        structured = None
        if response_schema is not None:
            structured, based_on, dropped, extra = self._structured(answer, messages, response_schema,
                                                                    ctx, max_tokens)
            usage.add(extra)
            text = json.dumps(structured, ensure_ascii=False)
        else:
            if live and turn_text:
                tail = turn_cit.flush()
                if tail:
                    yield TextDelta(tail)
                text, rewritten = "".join(turn_text) + tail, turn_cit
            else:
                rewritten = _Citations(ctx)
                text = rewritten.feed(answer.text) + rewritten.flush()
                if live and text:
                    yield TextDelta(text)
            based_on, dropped = rewritten.based_on, rewritten.dropped
        if dropped:
            METRICS.add("mneme.reflect.invalid_citations", len(dropped))
            log.info("reflect: dropped %d citation(s) of memories never supplied: %s",
                     len(dropped), dropped)
        kinds = {m.id: m.kind for m in ctx.by_ref.values() if m.id in based_on and m.kind != "fact"}
        evidence = [m for m in ctx.by_ref.values() if m.id in based_on and m.kind == "fact"]
        sources = {m.id: m.sources for m in ctx.by_ref.values() if m.id in based_on and m.sources}
        yield Done(AgentReflection(text.strip(), based_on, False, kinds=kinds, evidence=evidence,
                                   sources=sources,
                                   directives=[d.id for d in directives], structured=structured,
                                   usage=usage, tools_called=called, dropped_citations=dropped,
                                   iterations=it, memories_supplied=len(ctx.by_ref)))

    def revise(self, bank_id: str, query: str, prior: str, cited: Sequence[str],
               new: Sequence[Memory], now: datetime,
               directives: Sequence[Directive] = ()) -> AgentReflection:
        """A delta refresh of a mental model: the model rewrites ``prior`` (the current
        answer to ``query``, citing ``[n]`` = ``cited[n-1]``) with the memories ``new``
        (what changed in its scope since), in one turn without tools. The answer cites
        like reflect's (``[1]`` … in the order of ``based_on``; the kept citations of
        ``prior`` are valid references). Raises LlmError when the model fails."""
        cfg = self.bank_config(bank_id) or BankConfig()
        ctx = _Context(self.max_context_tokens, self.count)
        for i in cited:  # the current content's citations are references too (not shown)
            ref = f"m{len(ctx.by_ref) + 1}"
            ctx.by_ref[ref], ctx.ref_of[i] = Memory(i, "", "fact"), ref

        def as_refs(mt: re.Match) -> str:
            nums = [int(n) for n in re.split(r"\s*,\s*", mt.group(1))]
            if not all(0 < n <= len(cited) for n in nums):
                return mt.group(0)
            return f"[{', '.join(ctx.ref_of[cited[n - 1]] for n in nums)}]"
        current = re.sub(r"\[(\d+(?:\s*,\s*\d+)*)\]", as_refs, prior)
        lines, cut = ctx.supply(new)
        user = (f"Question: {query.strip()}\n\nYour current answer (its references point to "
                "memories you saw before):\n" + (current.strip() or "(none)")
                + "\n\nMemories that are new or revised since then:\n" + "\n".join(lines)
                + ("\n(context budget reached: some were left out)" if cut else "")
                + "\n\nUpdate the answer: keep the statements the new memories do not "
                "contradict, with their references; add what the new memories add to the "
                "answer; where they contradict it, prefer the more recent and say so. Cite "
                "as before. Reply with the updated answer only.")
        messages = [{"role": "system", "content": revise_prompt(cfg, now, directives)},
                    {"role": "user", "content": user}]
        c = self.gateway.complete("reflect", messages, tools=None, temperature=0.2)
        cit = _Citations(ctx)
        text = cit.feed(c.text) + cit.flush()
        if cit.dropped:
            METRICS.add("mneme.reflect.invalid_citations", len(cit.dropped))
        usage = Usage()
        usage.add(c.usage)
        kinds = {m.id: m.kind for m in ctx.by_ref.values()
                 if m.id in cit.based_on and m.kind != "fact"}
        return AgentReflection(text.strip(), cit.based_on, False, kinds=kinds,
                               sources={m.id: m.sources for m in ctx.by_ref.values()
                                        if m.id in cit.based_on and m.sources},
                               directives=[d.id for d in directives], usage=usage,
                               dropped_citations=cit.dropped, iterations=1,
                               memories_supplied=len(new))

    def _structured(self, answer: Completion, messages, response_schema, ctx: _Context,
                    max_tokens: int | None = None):
        """(answer value, based_on ids, dropped refs, extra usage) from the final reply,
        asking once more with the schema enforced when the reply does not match (with
        ``max_tokens``; :meth:`mneme.llm.LlmGateway.complete_json` doubles it, within its
        cap, for a reply cut off: JSON cut short is no answer)."""
        wrapper = _wrapper_schema(response_schema)
        extra = Usage()
        try:
            value = parse_json(answer.text)
            validate(value, wrapper)
        except JsonOutputError:
            convo = messages + [{"role": "assistant", "content": answer.text or ""},
                                {"role": "user", "content": "Give the final answer now as the JSON "
                                 "object described in the instructions, nothing else."}]
            res = self.gateway.complete_json("reflect", convo, wrapper, schema_name="reflect_answer",
                                             strict=False, temperature=0.0, max_tokens=max_tokens)
            value, extra = res.value, res.usage
        based_on, dropped = [], []
        for t in value.get("memory_ids") or []:
            mid = ctx.resolve(str(t))
            if mid is None:
                dropped.append(str(t))
            elif mid not in based_on:
                based_on.append(mid)
        return value.get("answer"), based_on, dropped, extra

    # ---- tools -------------------------------------------------------------------------------

    def _tool(self, name: str, args: dict, bank_id: str, budget: str, now: datetime,
              ctx: _Context, scope: tuple[Sequence[str], str] = ((), "any"),
              mental_models: bool = True) -> tuple[str, int]:
        """Run one tool; (text for the model, number of memories returned). ``scope``
        (the request's tags, its tags_match mode) scopes recall
        (:func:`services.reflect.handlers.scope_filters`) and the mental-model and
        observation searches."""
        tags, tags_match = scope
        # the model's query, cut as a caller's would be refused beyond it
        query = str(args.get("query") or "").strip()[:limits().query_chars]
        if not query:
            return "Error: the query argument is required.", 0
        current_deadline().check(f"reflect: {name}")
        if name == "search_mental_models":
            memories = (self.mental_models(bank_id, query, now, 5, tags=tags, tags_match=tags_match)
                        if mental_models else [])
            empty = "No mental model matches. Search the observations next."
        elif name == "search_observations":
            memories = self.observations(bank_id, query, now, 10, tags=tags, tags_match=tags_match)
            empty = "No observation matches. Search the raw facts with recall next."
        elif name == "recall":
            outcome = self.recall(RecallQuery(
                bank_id=bank_id, query=query, query_timestamp=now,
                filters=scope_filters(tags, tags_match),
                budget=budget, max_tokens=max(1, min(ctx.remaining(), 2048)),
                time_zone=time_zone_name(now)))
            memories = [Memory(s.fact.id, s.fact.text, "fact",
                               s.fact.occurred_start or s.fact.mentioned_at, s.fact.fact_type,
                               s.fact.mentioned_at, tuple(s.fact.entities), s.fact.document_id)
                        for s in outcome.results]
            empty = "No memories match. Try other words, or answer that the bank has no memory of it."
        else:
            return f"Error: unknown tool {name!r}.", 0
        if not memories:
            return empty, 0
        lines, cut = ctx.supply(memories)
        if cut:
            lines.append("(context budget reached: some results were left out; answer with "
                         "what you have)")
        return "\n".join(lines), len(memories)
