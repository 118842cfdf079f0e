"""Language models for mneme through ``litellm`` (DESIGN §4, issue 4).

- :mod:`mneme.llm.settings` — ``MNEME_LLM_*`` / ``MNEME_<OP>_LLM_*`` / ``MNEME_RERANK_*``;
- :mod:`mneme.llm.gateway` — :class:`LlmGateway`: structured output, timeouts, retries,
  concurrency limit, token and cost accounting, connectivity check;
- :mod:`mneme.llm.rerank` — recall's optional cross-encoder over the fused head;
- :mod:`mneme.llm.metrics` — counters of the LLM paths.

Importing this package never imports litellm: the gateway loads it on the first call,
so a process without a configured model stays fast and offline.
"""

from mneme.llm.gateway import (
    Completion, Connectivity, JsonResult, LlmError, LlmGateway, LlmNotConfigured, LlmOutputError,
    LlmRequestError, LlmUnavailable, ToolCall, Usage, load_litellm,
)
from mneme.llm.metrics import METRICS
from mneme.llm.settings import Endpoint, LlmSettings

__all__ = [
    "Completion", "Connectivity", "Endpoint", "JsonResult", "LlmError", "LlmGateway",
    "LlmNotConfigured", "LlmOutputError", "LlmRequestError", "LlmSettings", "LlmUnavailable",
    "METRICS", "ToolCall", "Usage", "load_litellm",
]
