"""Fixtures of the LLM tests: a stub server per test and gateway settings pointing at it.

Backoff sleeps are recorded instead of slept (``gateway.sleeps``), so retry tests are fast
and can assert the backoff schedule."""

from __future__ import annotations

import pytest

from mneme.llm import LlmGateway, LlmSettings, METRICS
from tests.llm.stub import StubLLM

MODEL = "openai/stub-model"


@pytest.fixture
def stub():
    with StubLLM() as s:
        yield s


def make_settings(stub: StubLLM, **overrides) -> LlmSettings:
    values = dict(llm_model=MODEL, llm_base_url=stub.base_url, llm_api_key="sk-test",
                  llm_timeout_s=5.0, llm_max_retries=2, llm_backoff_s=1.0, llm_backoff_max_s=8.0,
                  llm_json_retries=2, llm_max_output_tokens=1024)
    values.update(overrides)
    return LlmSettings(_env_file=None, **values)


def make_gateway(stub: StubLLM, **overrides) -> LlmGateway:
    sleeps: list[float] = []
    gw = LlmGateway(make_settings(stub, **overrides), sleep=sleeps.append)
    gw.sleeps = sleeps
    return gw


@pytest.fixture
def gateway(stub):
    return make_gateway(stub)


@pytest.fixture
def server(stub, tmp_path):
    """A real ``mneme up`` whose every model is the stub (one retry, short backoff)."""
    from tests.e2e.server import Server
    s = Server(tmp_path / "data", env={
        "MNEME_LLM_MODEL": MODEL, "MNEME_LLM_BASE_URL": stub.base_url,
        "MNEME_LLM_API_KEY": "sk-test", "MNEME_LLM_TIMEOUT_S": "10",
        "MNEME_LLM_MAX_RETRIES": "1", "MNEME_LLM_BACKOFF_S": "0.05"}).start()
    yield s
    s.stop()


@pytest.fixture(autouse=True)
def _fresh_metrics():
    METRICS.reset()
    yield


def pytest_configure(config):
    # litellm's own deprecation noise is not ours to fix
    for line in ("ignore::DeprecationWarning:litellm.*", "ignore::UserWarning:pydantic.*",
                 "ignore:.*PydanticDeprecatedSince211.*", "ignore::DeprecationWarning:pydantic.*"):
        config.addinivalue_line("filterwarnings", line)
