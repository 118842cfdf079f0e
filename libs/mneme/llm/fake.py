"""A scripted :class:`mneme.ports.Llm` for tests: no network, no litellm.

Script replies per operation, as the stub server of ``tests/llm/stub.py`` is scripted per
route: ``fake.on("retain", reply({"facts": []}))``; each call pops the first reply of the
first rule of its operation whose ``match`` substring occurs in the request (its messages
as JSON, or the rerank query and documents). A reply is a :func:`reply` (chat), a
:func:`scores` (rerank), an :class:`~mneme.llm.gateway.LlmError` (raised, as the
gateway raises after its retries) or a callable ``(FakeCall) -> reply``. A call nothing
answers raises ``LlmUnavailable`` (the gateway's answer to the stub's "unscripted" 500).
Every call is recorded in :attr:`FakeLlm.calls`.

Results are the gateway's own types (``Completion``, ``JsonResult``, ``Usage``,
``Connectivity``), and :meth:`FakeLlm.complete_json` *is* the gateway's (parsing, schema
validation, re-asking, the doubled cap after truncation) running over the fake
:meth:`FakeLlm.complete`, so structured-output behaviour cannot drift from production.
"""

from __future__ import annotations

import json
import threading
import time
from dataclasses import dataclass, field
from typing import Callable, Iterator

from mneme.llm.gateway import (Completion, Connectivity, LlmError, LlmGateway, LlmNotConfigured,
                               LlmUnavailable, ToolCall, Usage)
from mneme.llm.settings import CHAT_OPERATIONS, OPERATIONS, Endpoint, LlmSettings

__all__ = ["FakeCall", "FakeLlm", "FakeReply", "reply", "scores"]


@dataclass
class FakeReply:
    """A scripted answer: chat (``text``, ``tool_calls`` as ``[{"name", "arguments"}]``,
    ``finish_reason``, token counts) or rerank (``scores[i]`` for document i)."""

    kind: str  # chat | rerank
    text: str = ""
    tool_calls: list[dict] = field(default_factory=list)
    finish_reason: str = "stop"
    prompt_tokens: int = 100
    completion_tokens: int = 20
    scores: list[float] = field(default_factory=list)


def reply(content: str | dict | list | None = "", *, tool_calls: list[dict] | None = None,
          finish_reason: str | None = None, prompt_tokens: int = 100,
          completion_tokens: int = 20) -> FakeReply:
    """A chat reply, as ``tests.llm.stub.chat``: dict/list ``content`` is JSON-encoded;
    ``finish_reason`` defaults to ``tool_calls`` with tool calls, else ``stop``."""
    if isinstance(content, (dict, list)):
        content = json.dumps(content)
    return FakeReply("chat", content or "", list(tool_calls or []),
                     finish_reason or ("tool_calls" if tool_calls else "stop"),
                     prompt_tokens, completion_tokens)


def scores(values: list[float]) -> FakeReply:
    """A rerank reply giving document i the relevance ``values[i]``."""
    return FakeReply("rerank", scores=list(values))


@dataclass
class FakeCall:
    """One recorded call: ``method`` (complete, stream, rerank), ``operation``, the chat
    ``messages`` (rerank: ``query`` and ``documents``) and the other keyword arguments."""

    method: str
    operation: str
    messages: list[dict] = field(default_factory=list)
    kwargs: dict = field(default_factory=dict)
    query: str = ""
    documents: list[str] = field(default_factory=list)

    def text(self) -> str:
        """All message contents joined (what the model was shown)."""
        return "\n".join(str(m.get("content") or "") for m in self.messages)


@dataclass
class _Rule:
    operation: str
    match: str | None
    replies: list


class FakeLlm:
    """Scripted model calls (see the module docs). ``operations``: those with a model
    (default: every chat operation; add "rerank" for the reranker); ``model``: the
    model string results report; ``settings``: the tuning callers read (default: the
    settings' defaults, never the environment); ``stream_piece``: characters per
    streamed delta. Thread-safe."""

    def __init__(self, operations: tuple[str, ...] = CHAT_OPERATIONS, *,
                 model: str = "fake/model", settings: LlmSettings | None = None,
                 stream_piece: int = 5):
        for op in operations:
            if op not in OPERATIONS:
                raise ValueError(f"operation: must be one of {', '.join(OPERATIONS)}")
        self.operations = tuple(operations)
        self.model = model
        self.settings = settings or LlmSettings.model_construct()
        self.stream_piece = max(1, stream_piece)
        self.calls: list[FakeCall] = []
        self._rules: list[_Rule] = []
        self._lock = threading.Lock()

    # ---- scripting ---------------------------------------------------------------------

    def on(self, operation: str, *replies, match: str | None = None) -> "FakeLlm":
        """Script ``replies`` for ``operation``, used in order by calls whose request
        contains ``match`` (any call when None). Returns self."""
        with self._lock:
            self._rules.append(_Rule(operation, match, list(replies)))
        return self

    def pending(self) -> int:
        """How many scripted replies are still unused."""
        with self._lock:
            return sum(len(r.replies) for r in self._rules)

    def requests(self, operation: str | None = None) -> list[FakeCall]:
        """The recorded calls (of one operation)."""
        with self._lock:
            return [c for c in self.calls if operation is None or c.operation == operation]

    def _answer(self, call: FakeCall, raw: str, kind: str) -> FakeReply:
        with self._lock:
            self.calls.append(call)
            r = None
            for rule in self._rules:
                if rule.operation == call.operation and rule.replies and (
                        rule.match is None or rule.match in raw):
                    r = rule.replies.pop(0)
                    break
        if callable(r) and not isinstance(r, FakeReply):
            r = r(call)
        if isinstance(r, BaseException):
            raise r
        if r is None:
            raise LlmUnavailable(f"{call.operation}: no scripted reply (unscripted)",
                                 "unavailable", Usage(model=self.model, failed_calls=1))
        if r.kind != kind:
            raise TypeError(f"{call.operation}: scripted a {r.kind} reply for a {kind} call")
        return r

    # ---- the port ----------------------------------------------------------------------

    def configured(self, operation: str) -> bool:
        return operation in self.operations

    def endpoint(self, operation: str) -> Endpoint | None:
        if operation not in OPERATIONS:
            raise ValueError(f"operation: must be one of {', '.join(OPERATIONS)}")
        return Endpoint(operation, self.model) if self.configured(operation) else None

    def _require(self, operation: str) -> Endpoint:
        ep = self.endpoint(operation)
        if ep is None:
            raise LlmNotConfigured(f"no model configured for {operation}")
        return ep

    def complete(self, operation: str, messages: list[dict], *, tools: list[dict] | None = None,
                 tool_choice: str | None = None, response_schema: dict | None = None,
                 schema_name: str = "output", strict: bool = True, max_tokens: int | None = None,
                 temperature: float | None = None, timeout: float | None = None) -> Completion:
        """The next scripted chat reply as a :class:`Completion` (usage: one call and the
        reply's token counts)."""
        self._require(operation)
        kw = dict(tools=tools, tool_choice=tool_choice, response_schema=response_schema,
                  schema_name=schema_name, strict=strict, max_tokens=max_tokens,
                  temperature=temperature, timeout=timeout)
        return self._completion(FakeCall("complete", operation, list(messages), kw), messages)

    def _completion(self, call: FakeCall, messages) -> Completion:
        t0 = time.monotonic()
        r = self._answer(call, json.dumps(messages, default=str), "chat")
        calls = [ToolCall(f"call_{i}", c["name"], json.dumps(c.get("arguments", {})))
                 for i, c in enumerate(r.tool_calls)]
        usage = Usage(model=self.model, calls=1, input_tokens=r.prompt_tokens,
                      output_tokens=r.completion_tokens, latency_s=time.monotonic() - t0)
        return Completion(r.text, r.finish_reason, calls, usage)

    def stream(self, operation: str, messages: list[dict], *, tools: list[dict] | None = None,
               tool_choice: str | None = None, max_tokens: int | None = None,
               temperature: float | None = None,
               timeout: float | None = None) -> Iterator[str | Completion]:
        """The next scripted reply in ``stream_piece``-character deltas, then the whole
        :class:`Completion`."""
        self._require(operation)
        kw = dict(tools=tools, tool_choice=tool_choice, max_tokens=max_tokens,
                  temperature=temperature, timeout=timeout)
        c = self._completion(FakeCall("stream", operation, list(messages), kw), messages)
        for i in range(0, len(c.text), self.stream_piece):
            yield c.text[i:i + self.stream_piece]
        yield c

    #: The gateway's own structured output over :meth:`complete` (see the module docs):
    #: it needs only ``settings`` and ``complete``.
    complete_json = LlmGateway.complete_json

    def rerank(self, query: str, documents: list[str], *,
               top_n: int | None = None) -> tuple[list[tuple[int, float]], Usage]:
        """The next scripted rerank reply: [(index, score)] best first, at most ``top_n``."""
        self._require("rerank")
        call = FakeCall("rerank", "rerank", kwargs={"top_n": top_n}, query=query,
                        documents=list(documents))
        r = self._answer(call, json.dumps({"query": query, "documents": documents}), "rerank")
        ranked = sorted(((i, float(s)) for i, s in enumerate(r.scores[:len(documents)])),
                        key=lambda p: -p[1])
        return ranked[:top_n or len(documents)], Usage(model=self.model, calls=1)

    def check(self, operations: tuple[str, ...] | None = None) -> list[Connectivity]:
        """One scripted call per operation (as the gateway's probe); never raises."""
        ops = operations or tuple(o for o in OPERATIONS if self.configured(o))
        out = []
        for op in ops:
            if not self.configured(op):
                out.append(Connectivity(op, "", False, 0.0, "no model configured"))
                continue
            t0 = time.monotonic()
            try:
                if op == "rerank":
                    self.rerank("ping", ["ping", "pong"])
                else:
                    self.complete(op, [{"role": "user", "content": "Reply with the single word OK."}],
                                  max_tokens=5)
                out.append(Connectivity(op, self.model, True, time.monotonic() - t0, ""))
            except LlmError as e:
                out.append(Connectivity(op, self.model, False, time.monotonic() - t0, str(e)))
        return out


#: A reply may also be computed from the call.
Responder = Callable[[FakeCall], "FakeReply | LlmError"]
