"""Language-model settings from ``MNEME_*`` environment variables (pydantic-settings).

One model per operation: ``retain`` (fact extraction), ``reflect``, ``consolidation``
(observations, a later issue) and ``rerank``. The first three fall back to
``MNEME_LLM_MODEL`` (and its base URL and key); rerank is configured on its own because
cross-encoders are served by other endpoints than chat models. Model strings are
litellm's ``provider/model`` (``openai/gpt-4o-mini``, ``ollama_chat/llama3.1``,
``hosted_vllm/Qwen/Qwen2.5-7B-Instruct``, ``cohere/rerank-english-v3.0``).
"""

from __future__ import annotations

from dataclasses import dataclass

from urllib.parse import urlsplit

from pydantic import Field, SecretStr, field_validator
from pydantic_settings import BaseSettings, SettingsConfigDict

#: Operations that call a chat model.
CHAT_OPERATIONS = ("retain", "reflect", "consolidation")
OPERATIONS = CHAT_OPERATIONS + ("rerank",)


@dataclass(frozen=True)
class Endpoint:
    """Where one operation's calls go: litellm ``model`` string, ``base_url`` (None: the
    provider's default or its own environment variables) and ``api_key`` (None: likewise)."""

    operation: str
    model: str
    base_url: str | None = None
    api_key: str | None = None


def _secret(s: SecretStr | None) -> str | None:
    v = s.get_secret_value() if s is not None else ""
    return v or None


class LlmSettings(BaseSettings):
    """LLM gateway settings. Durations are seconds; token counts are the model's tokens."""

    model_config = SettingsConfigDict(env_prefix="MNEME_", extra="ignore")

    llm_model: str = Field(default="", description="Default chat model (litellm string); "
                           "empty: no LLM, offline extraction and extractive reflect")
    llm_base_url: str = Field(default="", description="Base URL of the default model's "
                              "server, e.g. http://localhost:8000/v1 (vLLM)")
    llm_api_key: SecretStr | None = Field(default=None, description="API key of the default model")
    retain_llm_model: str = Field(default="", description="Extraction model (default: MNEME_LLM_MODEL)")
    retain_llm_base_url: str = Field(default="", description="Its base URL (default: MNEME_LLM_BASE_URL)")
    retain_llm_api_key: SecretStr | None = Field(default=None, description="Its key (default: MNEME_LLM_API_KEY)")
    reflect_llm_model: str = Field(default="", description="Reflect model (default: MNEME_LLM_MODEL)")
    reflect_llm_base_url: str = Field(default="", description="Its base URL (default: MNEME_LLM_BASE_URL)")
    reflect_llm_api_key: SecretStr | None = Field(default=None, description="Its key (default: MNEME_LLM_API_KEY)")
    consolidation_llm_model: str = Field(default="", description="Consolidation model (default: MNEME_LLM_MODEL)")
    consolidation_llm_base_url: str = Field(default="", description="Its base URL (default: MNEME_LLM_BASE_URL)")
    consolidation_llm_api_key: SecretStr | None = Field(default=None, description="Its key (default: MNEME_LLM_API_KEY)")
    rerank_model: str = Field(default="", description="Cross-encoder for recall's head "
                              "(litellm rerank), e.g. cohere/rerank-english-v3.0; empty: no rerank")
    rerank_base_url: str = Field(default="", description="Rerank server base URL")
    rerank_api_key: SecretStr | None = Field(default=None, description="Rerank API key")
    rerank_head: int = Field(default=50, ge=1, description="How many fused candidates are reranked")
    rerank_timeout_s: float = Field(default=10.0, gt=0, description="Rerank call timeout "
                                    "(recall's hot path: on failure fusion order stands)")

    llm_timeout_s: float = Field(default=120.0, gt=0, description="Timeout of one LLM HTTP call")
    llm_max_retries: int = Field(default=4, ge=0, description="Retries of a call on 429, 5xx, "
                                 "timeouts and connection errors (exponential backoff)")
    llm_backoff_s: float = Field(default=1.0, ge=0, description="First backoff; doubles per retry (with jitter)")
    llm_backoff_max_s: float = Field(default=30.0, ge=0, description="Longest backoff (also caps Retry-After)")
    llm_breaker_failures: int = Field(default=5, ge=0, description="Consecutive timeouts, "
                                      "connection errors or 5xx of one endpoint that open its "
                                      "circuit breaker (calls then fail at once as unavailable); "
                                      "0: no breaker")
    llm_breaker_cooldown_s: float = Field(default=30.0, ge=0, description="How long an open "
                                          "breaker fails calls before one trial call is let "
                                          "through (its success closes it); 0: no breaker")
    llm_max_concurrency: int = Field(default=4, ge=1, description="Concurrent LLM calls per process")
    llm_max_output_tokens: int = Field(default=4096, ge=64, description="Output token cap of one call")
    llm_json_mode: str = Field(default="schema", pattern="^(schema|object|none)$",
                               description="How structured output is asked for: schema "
                               "(JSON schema response_format), object (JSON mode), none "
                               "(schema in the prompt only)")
    llm_json_retries: int = Field(default=2, ge=0, description="Re-asks after malformed, "
                                  "schema-invalid or truncated output")
    retain_llm_chunk_chars: int = Field(default=6000, ge=500, description="Longest text "
                                        "(characters) sent in one extraction call; longer "
                                        "items are split at paragraph/sentence boundaries")
    reflect_max_iterations: int = Field(default=6, ge=1, description="Model turns of the reflect loop")
    reflect_max_context_tokens: int = Field(default=6000, ge=256, description="Memory "
                                            "tokens reflect may put into the model's context")

    @field_validator("llm_base_url", "retain_llm_base_url", "reflect_llm_base_url",
                     "consolidation_llm_base_url", "rerank_base_url")
    @classmethod
    def _base_url(cls, url: str) -> str:
        """Empty, ``default`` (the provider's own endpoint) or an http(s) URL with a host:
        anything else ("localhost:8000", a bare host name) started the server and failed
        every model call."""
        if url in ("", "default"):
            return url
        parts = urlsplit(url)
        if parts.scheme not in ("http", "https") or not parts.hostname:
            raise ValueError("must be an http:// or https:// URL with a host "
                             "(e.g. http://localhost:8000/v1), or default")
        return url

    def endpoint(self, operation: str) -> Endpoint | None:
        """The endpoint of ``operation`` (retain, reflect, consolidation, rerank), or None
        when no model is configured for it. Chat operations inherit model, base URL and key
        from ``MNEME_LLM_*`` field by field; a base URL of ``default`` means the provider's
        own endpoint (to override an inherited local URL). Raises ValueError for an
        unknown operation."""
        if operation not in OPERATIONS:
            raise ValueError(f"operation: must be one of {', '.join(OPERATIONS)}")
        if operation == "rerank":
            if not self.rerank_model:
                return None
            base = self.rerank_base_url
            return Endpoint("rerank", self.rerank_model,
                            None if base in ("", "default") else base, _secret(self.rerank_api_key))
        model = getattr(self, f"{operation}_llm_model") or self.llm_model
        if not model:
            return None
        base = getattr(self, f"{operation}_llm_base_url") or self.llm_base_url
        key = _secret(getattr(self, f"{operation}_llm_api_key")) or _secret(self.llm_api_key)
        return Endpoint(operation, model, None if base in ("", "default") else base, key)

    def configured(self, operation: str) -> bool:
        return self.endpoint(operation) is not None
