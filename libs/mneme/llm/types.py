"""What callers of the :class:`mneme.ports.Llm` port see: results (:class:`Usage`,
:class:`Completion`, :class:`ToolCall`, :class:`JsonResult`, :class:`Connectivity`), the
errors (:class:`LlmError` and its subclasses) and request helpers (:func:`tool_spec`,
:func:`dumps`). No litellm, no gateway: handlers and ports import these without depending
on the adapter (:mod:`mneme.llm.gateway` implements the port and re-exports them).
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field

from mneme.errors import RemoteError
from mneme.llm.jsonout import JsonOutputError, parse_json


@dataclass
class Usage:
    """What calls cost: ``calls`` HTTP attempts that got an answer (``failed_calls``
    those that did not), ``input_tokens``/``output_tokens`` as the provider reported them,
    ``cost_usd`` from litellm's price map (0 for unpriced models such as local ones),
    ``latency_s`` summed wall time of the attempts. ``model`` is the litellm model string
    (models joined by "," when a sum mixes them)."""

    model: str = ""
    calls: int = 0
    failed_calls: int = 0
    input_tokens: int = 0
    output_tokens: int = 0
    cost_usd: float = 0.0
    latency_s: float = 0.0

    def add(self, other: "Usage") -> "Usage":
        """Add ``other`` into this one (in place); returns self."""
        models = [m for m in (self.model.split(",") + other.model.split(",")) if m]
        self.model = ",".join(dict.fromkeys(models))
        self.calls += other.calls
        self.failed_calls += other.failed_calls
        self.input_tokens += other.input_tokens
        self.output_tokens += other.output_tokens
        self.cost_usd += other.cost_usd
        self.latency_s += other.latency_s
        return self

    def as_metadata(self, prefix: str = "llm.") -> dict[str, str]:
        """String map for event metadata / headers: model, calls, input_tokens,
        output_tokens, cost_usd (6 decimals)."""
        return {f"{prefix}model": self.model, f"{prefix}calls": str(self.calls),
                f"{prefix}input_tokens": str(self.input_tokens),
                f"{prefix}output_tokens": str(self.output_tokens),
                f"{prefix}cost_usd": f"{self.cost_usd:.6f}"}


@dataclass
class ToolCall:
    """A function call the model asked for; ``arguments`` is the raw JSON text."""

    id: str
    name: str
    arguments: str = "{}"

    def args(self) -> dict:
        """The arguments as a dict ({} when they are not a JSON object)."""
        try:
            v = parse_json(self.arguments or "{}")
        except JsonOutputError:
            return {}
        return v if isinstance(v, dict) else {}


@dataclass
class Completion:
    """One chat completion: ``text`` (may be empty with tool calls), ``finish_reason``
    (stop, length, tool_calls, ...), ``tool_calls`` and the ``usage`` of every attempt
    it took."""

    text: str
    finish_reason: str
    tool_calls: list[ToolCall] = field(default_factory=list)
    usage: Usage = field(default_factory=Usage)

    @property
    def truncated(self) -> bool:
        return self.finish_reason == "length"

    def message(self) -> dict:
        """This reply as an assistant message to continue the conversation with."""
        m: dict = {"role": "assistant", "content": self.text or None}
        if self.tool_calls:
            m["tool_calls"] = [{"id": t.id, "type": "function",
                                "function": {"name": t.name, "arguments": t.arguments}}
                               for t in self.tool_calls]
        return m


@dataclass
class JsonResult:
    """A parsed, schema-valid structured reply, the usage of all attempts, and how many
    attempts (model calls) it took."""

    value: object
    usage: Usage
    attempts: int


class LlmError(RemoteError):
    """A model call failed. ``reason`` is a short machine-readable code (see the
    subclasses); ``usage`` what the failed attempts cost. Its message quotes the provider
    (:class:`mneme.errors.RemoteError`)."""

    reason = "error"

    def __init__(self, message: str, reason: str | None = None, usage: Usage | None = None):
        super().__init__(message)
        if reason:
            self.reason = reason
        self.usage = usage or Usage()


class LlmNotConfigured(LlmError):
    reason = "not_configured"


class LlmUnavailable(LlmError):
    """Transient failures outlasted the retries: reason ``rate_limited``, ``timeout`` or
    ``unavailable`` (5xx, connection refused)."""

    reason = "unavailable"


class LlmRequestError(LlmError):
    """The provider rejected the request (4xx other than 408/429): reason ``rejected``,
    ``auth`` or ``context_window``. Not retried."""

    reason = "rejected"


class LlmOutputError(LlmError):
    """The model's reply stayed unusable after re-asking: reason ``malformed`` (not
    JSON), ``schema`` (JSON not matching the schema) or ``truncated`` (hit the token cap)."""

    reason = "malformed"


@dataclass
class Connectivity:
    """Result of :meth:`LlmGateway.check` for one operation: ``ok``, the round trip in
    seconds, and the error when not ok."""

    operation: str
    model: str
    ok: bool
    latency_s: float
    error: str = ""


def tool_spec(name: str, description: str, properties: dict, required: list[str]) -> dict:
    """An OpenAI function-tool spec."""
    return {"type": "function", "function": {
        "name": name, "description": description,
        "parameters": {"type": "object", "properties": properties, "required": required,
                       "additionalProperties": False}}}


def as_list(value: object) -> list:
    """``value`` when it is a list, else [] (a model may give a number or a string where
    the schema asks for a list)."""
    return value if isinstance(value, list) else []


def dumps(obj) -> str:
    """Compact JSON for prompts (keeps non-ASCII readable)."""
    return json.dumps(obj, ensure_ascii=False, separators=(",", ":"))


__all__ = [
    "Completion", "Connectivity", "JsonResult", "LlmError", "LlmNotConfigured", "LlmOutputError",
    "LlmRequestError", "LlmUnavailable", "ToolCall", "Usage", "as_list", "dumps", "tool_spec",
]
