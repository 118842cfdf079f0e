"""The LLM gateway over real HTTP against the stub: structured output, repair and
re-asking, retries with backoff, timeouts, accounting, streaming, connectivity."""

from __future__ import annotations

import threading
import time
import traceback

import pytest

from mneme.llm import (LlmOutputError, LlmRequestError, LlmSettings, LlmUnavailable, METRICS)
from tests.llm.conftest import MODEL, make_gateway
from tests.llm.stub import chat, delay, status

SCHEMA = {"type": "object", "required": ["x"], "additionalProperties": False,
          "properties": {"x": {"type": "integer"}}}
MSGS = [{"role": "user", "content": "give x"}]


def test_structured_output_by_schema_with_usage(stub, gateway):
    stub.on("chat", chat({"x": 7}, prompt_tokens=11, completion_tokens=4))
    res = gateway.complete_json("retain", MSGS, SCHEMA, schema_name="thing")
    assert res.value == {"x": 7} and res.attempts == 1
    assert (res.usage.calls, res.usage.input_tokens, res.usage.output_tokens) == (1, 11, 4)
    assert res.usage.model == MODEL and res.usage.cost_usd == 0.0
    body = stub.chat_requests()[0].body
    assert body["response_format"] == {"type": "json_schema", "json_schema": {
        "name": "thing", "schema": SCHEMA, "strict": True}}
    assert body["model"] == "stub-model" and body["max_tokens"] == 1024
    assert METRICS.get("mneme.llm.tokens", direction="input") == 11
    assert METRICS.get("mneme.llm.requests", outcome="ok") == 1


def test_fenced_json_with_trailing_comma_is_repaired_without_asking_again(stub, gateway):
    stub.on("chat", chat('Here you go:\n```json\n{"x": 3,}\n```'))
    assert gateway.complete_json("retain", MSGS, SCHEMA).value == {"x": 3}
    assert len(stub.chat_requests()) == 1


def test_malformed_then_schema_invalid_then_valid_is_re_asked(stub, gateway):
    stub.on("chat", chat("not json at all"), chat({"x": "seven"}), chat({"x": 7}))
    res = gateway.complete_json("retain", MSGS, SCHEMA)
    assert res.value == {"x": 7} and res.attempts == 3 and res.usage.calls == 3
    reqs = stub.chat_requests()
    assert "not valid JSON" in reqs[1].messages[-1]["content"]
    assert reqs[1].messages[-2] == {"role": "assistant", "content": "not json at all"}
    assert "x: 'seven' is not of type 'integer'" in reqs[2].messages[-1]["content"]
    assert METRICS.get("mneme.llm.output_errors") == 2


def test_malformed_every_time_raises_output_error_with_usage(stub, gateway):
    stub.on("chat", *[chat("{{{ nope", completion_tokens=5)] * 3)
    with pytest.raises(LlmOutputError) as e:
        gateway.complete_json("retain", MSGS, SCHEMA)
    assert e.value.reason == "malformed" and e.value.usage.calls == 3
    assert e.value.usage.output_tokens == 15


def test_truncated_reply_is_asked_again_with_a_larger_cap(stub):
    gw = make_gateway(stub, llm_max_output_tokens=2000)
    stub.on("chat", chat('{"x": ', finish_reason="length"), chat({"x": 1}))
    res = gw.complete_json("retain", MSGS, SCHEMA, max_tokens=500)
    assert res.value == {"x": 1}
    assert [r.body["max_tokens"] for r in stub.chat_requests()] == [500, 1000]


def test_truncated_at_the_cap_is_an_output_error(stub, gateway):
    stub.on("chat", chat('{"x": ', finish_reason="length"))
    with pytest.raises(LlmOutputError) as e:
        gateway.complete_json("retain", MSGS, SCHEMA)
    assert e.value.reason == "truncated"
    assert len(stub.chat_requests()) == 1  # the same cap would cut it off again


def test_429_and_5xx_are_retried_with_exponential_backoff(stub, gateway):
    stub.on("chat", status(429), status(503), chat({"x": 1}))
    res = gateway.complete_json("retain", MSGS, SCHEMA)
    assert res.value == {"x": 1} and res.usage.calls == 1 and res.usage.failed_calls == 2
    assert len(gateway.sleeps) == 2
    assert 0.8 <= gateway.sleeps[0] <= 1.2 and 1.6 <= gateway.sleeps[1] <= 2.4
    assert METRICS.get("mneme.llm.retries", reason="rate_limited") == 1
    assert METRICS.get("mneme.llm.retries", reason="unavailable") == 1


def test_retry_after_is_honoured_up_to_the_cap(stub, gateway):
    stub.on("chat", status(429, retry_after=5), status(429, retry_after=60), chat({"x": 1}))
    gateway.complete_json("retain", MSGS, SCHEMA)
    assert gateway.sleeps[0] == pytest.approx(5.0) and gateway.sleeps[1] == pytest.approx(8.0)


def test_rate_limited_beyond_retries_raises_unavailable(stub, gateway):
    stub.on("chat", *[status(429)] * 3)
    with pytest.raises(LlmUnavailable) as e:
        gateway.complete("retain", MSGS)
    assert e.value.reason == "rate_limited" and e.value.usage.failed_calls == 3


def test_timeouts_are_retried_then_raise(stub):
    # timeouts of 1 s against replies of 5 s: long enough that a busy machine's quick
    # replies would not time out, short enough that waiting for the replies would show
    gw = make_gateway(stub, llm_timeout_s=1.0, llm_max_retries=1)
    stub.on("chat", delay(5.0), delay(5.0))
    t0 = time.monotonic()
    with pytest.raises(LlmUnavailable) as e:
        gw.complete("retain", MSGS)
    assert e.value.reason == "timeout" and e.value.usage.failed_calls == 2
    assert time.monotonic() - t0 < 8


def test_timeout_then_success(stub):
    gw = make_gateway(stub, llm_timeout_s=1.0)
    stub.on("chat", delay(5.0), chat("fine"))
    assert gw.complete("retain", MSGS).text == "fine"


def test_client_errors_are_not_retried(stub, gateway):
    stub.on("chat", status(400, "bad request"), chat("never"))
    with pytest.raises(LlmRequestError):
        gateway.complete("retain", MSGS)
    assert len(stub.chat_requests()) == 1 and gateway.sleeps == []


def test_a_provider_error_quoting_the_request_is_not_repeated(stub, gateway, caplog):
    # providers often echo the input they reject: those words would carry a memory's text
    # into logs, item failures on the event log and operation errors, out of any deletion
    secret = "ZEBRA-SECRET-4711"
    msgs = [{"role": "user", "content": f"Alice: my vault code is \"{secret}\", keep it."}]
    stub.on("chat", status(400, f"invalid content: Alice: my vault code is \"{secret}\""),
            status(400, "model 'stub' does not exist"),
            status(503, f"overloaded while reading: my vault code is \"{secret}\""),
            status(503, f"overloaded while reading: my vault code is \"{secret}\""),
            status(503, f"overloaded while reading: my vault code is \"{secret}\""))
    for expected in (LlmRequestError, LlmRequestError, LlmUnavailable):
        with pytest.raises(expected) as e:
            gateway.complete("retain", msgs)
        # what a log.exception of it would print, and what was logged
        words = "".join(traceback.format_exception(e.value))
        words += "\n".join(r.getMessage() for r in caplog.records)
        if expected is LlmRequestError and "does not exist" in words:
            continue  # a message that quotes nothing of the request is kept
        assert secret not in words and "vault code" not in words
        assert "quotes the request" in str(e.value) and "HTTP" in str(e.value)
    assert "does not exist" in "\n".join(r.getMessage() for r in caplog.records)


def test_concurrency_limit(stub):
    gw = make_gateway(stub, llm_max_concurrency=1)
    stub.on("chat", delay(0.3, chat("a")), delay(0.3, chat("b")))
    threads = [threading.Thread(target=gw.complete, args=("retain", MSGS)) for _ in range(2)]
    t0 = time.monotonic()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert time.monotonic() - t0 >= 0.6  # one after the other


def test_streaming_yields_deltas_then_the_completion(stub, gateway):
    stub.on("chat", chat("hello there, world", prompt_tokens=9, completion_tokens=4))
    pieces = list(gateway.stream("reflect", MSGS))
    *deltas, final = pieces
    assert "".join(deltas) == "hello there, world" and len(deltas) > 1
    assert final.text == "hello there, world" and final.finish_reason == "stop"
    assert (final.usage.input_tokens, final.usage.output_tokens) == (9, 4)
    assert stub.chat_requests()[0].body["stream"] is True


def test_streaming_assembles_tool_calls(stub, gateway):
    stub.on("chat", chat(None, tool_calls=[{"name": "recall", "arguments": {"query": "q"}}]))
    *_, final = list(gateway.stream("reflect", MSGS, tools=[{"type": "function", "function": {
        "name": "recall", "parameters": {"type": "object", "properties": {}}}}]))
    assert [(t.name, t.args()) for t in final.tool_calls] == [("recall", {"query": "q"})]


def test_connectivity_check(stub, gateway):
    stub.on("chat", chat("OK"))
    (ok,) = gateway.check(("retain",))
    assert ok.ok and ok.model == MODEL and ok.error == ""
    (bad,) = gateway.check(("reflect",))  # unscripted: HTTP 500, no retries in a probe
    assert not bad.ok and "unavailable" in bad.error
    assert gateway.check(("rerank",))[0].error == "no model configured"


def test_models_per_operation_inherit_from_the_default():
    st = LlmSettings(_env_file=None, llm_model="hosted_vllm/base", llm_base_url="http://vllm:8000/v1",
                     llm_api_key="k", reflect_llm_model="openai/gpt-4o",
                     reflect_llm_base_url="default", rerank_model="cohere/rerank-english-v3.0")
    assert st.endpoint("retain").model == "hosted_vllm/base"
    assert st.endpoint("retain").base_url == "http://vllm:8000/v1"
    r = st.endpoint("reflect")
    assert (r.model, r.base_url, r.api_key) == ("openai/gpt-4o", None, "k")
    assert st.endpoint("rerank").base_url is None and st.endpoint("rerank").api_key is None
    assert LlmSettings(_env_file=None).endpoint("retain") is None


def test_settings_read_the_environment(monkeypatch):
    monkeypatch.setenv("MNEME_LLM_MODEL", "ollama_chat/llama3.1")
    monkeypatch.setenv("MNEME_LLM_BASE_URL", "http://localhost:11434")
    monkeypatch.setenv("MNEME_RETAIN_LLM_MODEL", "ollama_chat/qwen2.5:7b")
    monkeypatch.setenv("MNEME_RERANK_MODEL", "hosted_vllm/BAAI/bge-reranker-v2-m3")
    st = LlmSettings(_env_file=None)
    assert st.endpoint("retain").model == "ollama_chat/qwen2.5:7b"
    assert st.endpoint("consolidation").model == "ollama_chat/llama3.1"
    assert st.endpoint("rerank").model == "hosted_vllm/BAAI/bge-reranker-v2-m3"


def test_cost_of_a_priced_model_is_accounted(stub):
    gw = make_gateway(stub, llm_model="openai/gpt-4o-mini")
    stub.on("chat", chat({"x": 1}, prompt_tokens=1_000_000, completion_tokens=0))
    res = gw.complete_json("retain", MSGS, SCHEMA)
    # litellm's local price map: gpt-4o-mini input is $0.15 per million tokens
    assert res.usage.cost_usd == pytest.approx(0.15, rel=0.5)
    assert res.usage.as_metadata()["llm.cost_usd"] == f"{res.usage.cost_usd:.6f}"
    assert METRICS.get("mneme.llm.cost") == pytest.approx(res.usage.cost_usd)


def test_a_vllm_server_through_hosted_vllm(stub):
    gw = make_gateway(stub, llm_model="hosted_vllm/Qwen/Qwen2.5-7B-Instruct")
    stub.on("chat", chat({"x": 2}))
    assert gw.complete_json("retain", MSGS, SCHEMA).value == {"x": 2}
    (req,) = stub.chat_requests()
    assert req.path == "/v1/chat/completions" and req.body["model"] == "Qwen/Qwen2.5-7B-Instruct"
    assert req.body["response_format"]["json_schema"]["schema"] == SCHEMA


def test_a_served_requests_deadline_bounds_every_model_call(stub, gateway):
    from mneme import deadline
    from mneme.errors import Cancelled, DeadlineExceeded
    stub.on("chat", chat({"x": 1}), delay(3.0, chat({"x": 1})))
    gateway.complete("reflect", MSGS)  # litellm imported, connection made
    with deadline.bind(deadline.Deadline.after(0.5)):
        with pytest.raises(DeadlineExceeded):  # the attempt's timeout is what was left
            gateway.complete("reflect", MSGS)
    before = len(stub.chat_requests())
    assert before == 2  # one attempt, no retry once the caller's time is up
    with deadline.bind(deadline.Deadline(None, lambda: False)):  # the caller has gone
        with pytest.raises(Cancelled):
            gateway.complete("reflect", MSGS)
    assert len(stub.chat_requests()) == before  # no attempt was made
