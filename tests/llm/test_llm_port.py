"""The :class:`mneme.ports.Llm` contract, written once and run against the gateway over
real HTTP (the stub server) and against the scripted fake (``mneme.llm.fake.FakeLlm``):
the same script must give the same results, so handler tests on the fake mean what they
say about production."""

from __future__ import annotations

import pytest

from mneme.llm import LlmNotConfigured, LlmOutputError, LlmUnavailable
from mneme.llm.fake import FakeLlm, reply, scores
from mneme.llm.gateway import Completion, Connectivity, JsonResult, Usage
from mneme.ports import Llm
from tests.llm.conftest import MODEL, make_gateway
from tests.llm.stub import chat, rerank_reply

SCHEMA = {"type": "object", "required": ["x"], "additionalProperties": False,
          "properties": {"x": {"type": "integer"}}}
MSGS = [{"role": "user", "content": "give x"}]


class GatewayHarness:
    """The gateway against the stub: chat operations configured, rerank too."""

    def __init__(self, stub):
        self.stub = stub
        self.llm: Llm = make_gateway(stub, llm_max_retries=0, rerank_model="hosted_vllm/rr",
                                     rerank_base_url=stub.root_url)
        self.model = MODEL

    def chat(self, *replies):
        self.stub.on("chat", *[chat(r.text, tool_calls=r.tool_calls, finish_reason=r.finish_reason,
                                    prompt_tokens=r.prompt_tokens,
                                    completion_tokens=r.completion_tokens) for r in replies])

    def rerank(self, values):
        self.stub.on("rerank", rerank_reply(values))

    def sent(self) -> list[list[dict]]:
        return [r.messages for r in self.stub.chat_requests()]


class FakeHarness:
    def __init__(self, stub):
        self.llm: Llm = FakeLlm(("retain", "reflect", "consolidation", "rerank"), model="fake/m")
        self.model = "fake/m"

    def chat(self, *replies):
        # one queue for every chat operation, as the stub has one chat route
        queue = list(replies)
        for op in ("retain", "reflect", "consolidation"):
            self.llm.on(op, *[lambda call, q=queue: q.pop(0) if q else None] * len(replies))

    def rerank(self, values):
        self.llm.on("rerank", scores(values))

    def sent(self) -> list[list[dict]]:
        return [c.messages for c in self.llm.requests() if c.method != "rerank"]


@pytest.fixture(params=["gateway", "fake"])
def h(request, stub):
    return (GatewayHarness if request.param == "gateway" else FakeHarness)(stub)


def test_configuration(h):
    assert h.llm.configured("retain") and h.llm.configured("rerank")
    assert h.llm.endpoint("reflect").model == h.model
    with pytest.raises(ValueError):
        h.llm.endpoint("dance")
    assert h.llm.settings.rerank_head >= 1 and h.llm.settings.retain_llm_chunk_chars >= 500


def test_complete_returns_text_and_usage(h):
    h.chat(reply("hello there", prompt_tokens=11, completion_tokens=4))
    c = h.llm.complete("reflect", MSGS)
    assert isinstance(c, Completion) and (c.text, c.finish_reason, c.tool_calls) == ("hello there", "stop", [])
    assert isinstance(c.usage, Usage) and c.usage.model == h.model
    assert (c.usage.calls, c.usage.input_tokens, c.usage.output_tokens) == (1, 11, 4)
    assert h.sent() == [MSGS]


def test_tool_calls(h):
    h.chat(reply(None, tool_calls=[{"name": "recall", "arguments": {"query": "dogs"}}]))
    c = h.llm.complete("reflect", MSGS, tools=[{"type": "function", "function": {"name": "recall"}}])
    assert c.finish_reason == "tool_calls" and c.text == ""
    (t,) = c.tool_calls
    assert t.name == "recall" and t.args() == {"query": "dogs"} and t.id
    assert c.message()["tool_calls"][0]["function"]["name"] == "recall"


def test_stream_yields_deltas_then_the_completion(h):
    h.chat(reply("a streamed answer"))
    parts = list(h.llm.stream("reflect", MSGS))
    *deltas, last = parts
    assert deltas and all(isinstance(d, str) for d in deltas)
    assert isinstance(last, Completion) and "".join(deltas) == last.text == "a streamed answer"


def test_complete_json_re_asks_until_valid(h):
    h.chat(reply("not json at all"), reply({"x": "seven"}), reply({"x": 7}))
    res = h.llm.complete_json("retain", MSGS, SCHEMA)
    assert isinstance(res, JsonResult) and res.value == {"x": 7}
    assert res.attempts == 3 and res.usage.calls == 3
    sent = h.sent()
    assert sent[1][-2] == {"role": "assistant", "content": "not json at all"}
    assert "not usable" in sent[1][-1]["content"]


def test_complete_json_gives_up_with_output_error(h):
    h.chat(*[reply("{{{ nope")] * 3)
    with pytest.raises(LlmOutputError) as e:
        h.llm.complete_json("retain", MSGS, SCHEMA)
    assert e.value.reason == "malformed" and e.value.usage.calls == 3


def test_unanswered_call_is_unavailable(h):
    with pytest.raises(LlmUnavailable):
        h.llm.complete("retain", MSGS)


def test_rerank_best_first_and_top_n(h):
    h.rerank([0.1, 0.9, 0.5])
    ranked, usage = h.llm.rerank("which?", ["a", "b", "c"])
    assert [i for i, _ in ranked] == [1, 2, 0] and ranked[0][1] == pytest.approx(0.9)
    assert isinstance(usage, Usage) and usage.calls == 1


def test_check_probes_and_never_raises(h):
    h.chat(reply("OK"))
    ok, bad = h.llm.check(("retain", "reflect"))  # reflect: unscripted
    assert isinstance(ok, Connectivity) and ok.ok and ok.model == h.model
    assert not bad.ok and bad.error


@pytest.mark.parametrize("make", [lambda stub: FakeLlm(("retain",)), make_gateway],
                         ids=["fake", "gateway"])
def test_unconfigured_operation(stub, make):
    llm = make(stub)
    assert not llm.configured("rerank") and llm.endpoint("rerank") is None
    with pytest.raises(LlmNotConfigured):
        llm.rerank("q", ["a"])
    assert llm.check(("rerank",))[0].error == "no model configured"


def test_fake_records_calls_and_matches_scripts():
    fake = FakeLlm()
    fake.on("retain", reply("for dogs"), match="dogs").on("retain", reply("any"))
    assert fake.complete("retain", [{"role": "user", "content": "cats"}]).text == "any"
    assert fake.complete("retain", [{"role": "user", "content": "dogs"}]).text == "for dogs"
    assert [c.text() for c in fake.requests("retain")] == ["cats", "dogs"]
    assert fake.pending() == 0
    fake.on("reflect", LlmUnavailable("down", "timeout"))
    with pytest.raises(LlmUnavailable) as e:
        fake.complete("reflect", MSGS)
    assert e.value.reason == "timeout"
