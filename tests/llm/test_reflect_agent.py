"""Reflect's agentic loop over real HTTP against the stub: tools in order of distillation,
the recall fallback, citation validation, disposition and time in the prompt, structured
output, streaming, bounds, and the extractive fallback."""

from __future__ import annotations

import json
from datetime import datetime, timezone

from mneme.domain import BankConfig, Fact, RecallOutcome, Scored
from mneme.llm import METRICS
from services.reflect.agent import Done, Memory, ReflectAgent, TextDelta, ToolEvent
from tests.llm.conftest import make_gateway
from tests.llm.stub import chat, status

UTC = timezone.utc
NOW = datetime(2024, 6, 1, 12, 0, tzinfo=UTC)
INVENTED = "0b5c7a4e-1111-5222-8333-944455556666"
F1 = Fact(id="f-berlin", bank_id="bank", text="Caroline moved to Berlin in March 2021.",
          occurred_start=datetime(2021, 3, 1, tzinfo=UTC))
F2 = Fact(id="f-job", bank_id="bank", text="Caroline works as a counselor.",
          mentioned_at=datetime(2023, 5, 8, tzinfo=UTC))


class FakeRecall:
    def __init__(self, facts=(F1, F2)):
        self.facts, self.queries = list(facts), []

    def __call__(self, q):
        self.queries.append(q)
        return RecallOutcome([Scored(fact=f) for f in self.facts], 20)


def call(name, query):
    return {"name": name, "arguments": {"query": query}}


def agent(gw, recall=None, **kw):
    cfg = BankConfig(skepticism=5, literalism=1, empathy=4)
    return ReflectAgent(gw, recall or FakeRecall(), bank_config=lambda b: cfg, **kw)


def test_tools_run_in_order_and_an_invented_id_is_dropped(stub, gateway):
    stub.on("chat",
            chat(None, tool_calls=[call("search_mental_models", "where does Caroline live")]),
            chat(None, tool_calls=[call("search_observations", "Caroline home city")]),
            chat(None, tool_calls=[call("recall", "Caroline moved")]),
            chat(f"Caroline lives in Berlin [m1], since March 2021 [m1, m7]; she counsels [m2] "
                 f"and she is 34 [{INVENTED}] [sic]."))
    recall = FakeRecall()
    r = agent(gateway, recall)("bank", "Where does Caroline live?", "", "high", NOW)

    assert r.tools_called == ["search_mental_models", "search_observations", "recall"]
    assert r.based_on == ["f-berlin", "f-job"] and r.extractive is False
    assert r.dropped_citations == ["m7", INVENTED]
    assert r.text == ("Caroline lives in Berlin [1], since March 2021 [1]; she counsels [2] "
                      "and she is 34 [sic].")
    assert METRICS.get("mneme.reflect.invalid_citations") == 2
    assert r.iterations == 4 and r.memories_supplied == 2 and r.usage.calls == 4
    assert recall.queries[0].query == "Caroline moved" and recall.queries[0].budget == "high"
    assert recall.queries[0].query_timestamp == NOW

    reqs = stub.chat_requests()
    system = reqs[0].messages[0]["content"]
    assert "Current time: 2024-06-01T12:00:00Z (Saturday, 1 June 2024)" in system
    assert "skepticism 5/5" in system and "literalism 1/5" in system and "empathy 4/5" in system
    assert [t["function"]["name"] for t in reqs[0].body["tools"]] == [
        "search_mental_models", "search_observations", "recall"]
    tool_msgs = [m for m in reqs[3].messages if m["role"] == "tool"]
    assert tool_msgs[0]["content"].startswith("No mental model matches")
    assert tool_msgs[1]["content"].startswith("No observation matches")
    assert tool_msgs[2]["content"].splitlines() == [
        "[m1] 2021-03-01 · world · Caroline moved to Berlin in March 2021.",
        "[m2] 2023-05-08 · world · Caroline works as a counselor."]


def test_an_answer_before_any_memory_falls_back_to_recall(stub, gateway):
    stub.on("chat", chat("I don't know."), chat("Berlin [m1]."))
    recall = FakeRecall()
    events = list(agent(gateway, recall).stream("bank", "Where does Caroline live?", "", "mid", NOW))
    tools = [e for e in events if isinstance(e, ToolEvent)]
    assert [(t.name, t.forced, t.results) for t in tools] == [("recall", True, 2)]
    assert recall.queries[0].query == "Where does Caroline live?"
    deltas = "".join(e.text for e in events if isinstance(e, TextDelta))
    assert "know" not in deltas  # the discarded ungrounded reply was never streamed
    done = events[-1]
    assert isinstance(done, Done) and done.reflection.text == "Berlin [1]." == deltas
    assert done.reflection.based_on == ["f-berlin"]
    second = stub.chat_requests()[1].messages
    assert second[-1]["role"] == "tool" and "[m1]" in second[-1]["content"]


def test_mental_models_answer_without_recall(stub, gateway):
    mm = lambda bank_id, query, now, limit, tags=(), tags_match="any": [
        Memory("mm-1", "Caroline lives in Berlin.", "mental_model")]
    stub.on("chat", chat(None, tool_calls=[call("search_mental_models", "home")]),
            chat("In Berlin [m1]."))
    recall = FakeRecall()
    r = agent(gateway, recall, mental_models=mm)("bank", "Where does Caroline live?", "", "mid", NOW)
    assert r.based_on == ["mm-1"] and r.tools_called == ["search_mental_models"]
    assert recall.queries == []
    assert "mental model · Caroline lives in Berlin." in stub.chat_requests()[1].text()


def test_a_stale_mental_model_alone_does_not_ground_an_answer(stub, gateway):
    from services.reflect.handlers import STALE_MARK
    seen = []

    def mm(bank_id, query, now, limit, tags=(), tags_match="any"):
        seen.append(tags)
        return [Memory("mm-1", f"Home ({STALE_MARK}; answers \"Where?\"): Caroline lives in "
                       "Paris.", "mental_model")]
    stub.on("chat", chat(None, tool_calls=[call("search_mental_models", "home")]),
            chat("In Paris [m1]."), chat("In Berlin since March 2021 [m2]; the model said "
                                         "Paris [m1]."))
    recall = FakeRecall()
    events = list(agent(gateway, recall, mental_models=mm).stream(
        "bank", "Where does Caroline live?", "", "low", NOW, tags=("home",)))
    tools = [(e.name, e.forced) for e in events if isinstance(e, ToolEvent)]
    assert tools == [("search_mental_models", False), ("recall", True)]
    assert seen == [("home",)]  # the request's tags scope the model search
    deltas = "".join(e.text for e in events if isinstance(e, TextDelta))
    assert "In Paris" not in deltas  # the discarded reply from the stale model was not streamed
    r = events[-1].reflection
    assert r.based_on == ["f-berlin", "mm-1"] and r.kinds == {"mm-1": "mental_model"}
    assert [q.query for q in recall.queries] == ["Where does Caroline live?"]


def test_streaming_forwards_tool_events_and_text_deltas(stub, gateway):
    stub.on("chat", chat(None, tool_calls=[call("recall", "Caroline city")]),
            chat("Caroline lives in Berlin [m1] and works as a counselor [m2][m9]."))
    events = list(agent(gateway).stream("bank", "Tell me about Caroline", "", "mid", NOW))
    assert isinstance(events[0], ToolEvent) and events[0].name == "recall"
    deltas = [e.text for e in events if isinstance(e, TextDelta)]
    assert len(deltas) > 3
    done = events[-1].reflection
    assert "".join(deltas) == done.text == \
        "Caroline lives in Berlin [1] and works as a counselor [2]."
    assert done.dropped_citations == ["m9"]
    assert stub.chat_requests()[1].body.get("stream") is True


def test_response_schema_gives_structured_output(stub, gateway):
    schema = {"type": "object", "required": ["city"], "properties": {"city": {"type": "string"}}}
    stub.on("chat", chat(None, tool_calls=[call("recall", "city")]),
            chat("Sure: " + json.dumps({"answer": {"city": "Berlin"}, "memory_ids": ["m1", "m9"]})))
    r = agent(gateway)("bank", "Which city?", "", "mid", NOW, response_schema=schema)
    assert r.structured == {"city": "Berlin"} and json.loads(r.text) == {"city": "Berlin"}
    assert r.based_on == ["f-berlin"] and r.dropped_citations == ["m9"]
    assert '"city"' in stub.chat_requests()[0].messages[0]["content"]


def test_response_schema_is_enforced_when_the_reply_does_not_match(stub, gateway):
    schema = {"type": "object", "required": ["city"], "properties": {"city": {"type": "string"}}}
    stub.on("chat", chat(None, tool_calls=[call("recall", "city")]), chat("Berlin, I think [m1]."),
            chat({"answer": {"city": "Berlin"}, "memory_ids": ["m1"]}))
    r = agent(gateway)("bank", "Which city?", "", "mid", NOW, response_schema=schema)
    assert r.structured == {"city": "Berlin"} and r.based_on == ["f-berlin"]
    last = stub.chat_requests()[2].body
    assert last["response_format"]["json_schema"]["schema"]["properties"]["answer"] == schema
    assert "tools" not in last


def test_iterations_are_bounded_and_the_last_turn_must_answer(stub):
    gw = make_gateway(stub, reflect_max_iterations=3)
    stub.on("chat", chat(None, tool_calls=[call("recall", "a")]),
            chat(None, tool_calls=[call("recall", "b")]), chat("Done [m2]."))
    r = agent(gw)("bank", "q?", "", "mid", NOW)
    assert r.iterations == 3 and r.text == "Done [1]." and r.based_on == ["f-job"]
    reqs = stub.chat_requests()
    assert "tools" in reqs[1].body and "tools" not in reqs[2].body


def test_context_budget_bounds_the_memories_shown(stub, gateway):
    stub.on("chat", chat(None, tool_calls=[call("recall", "a")]), chat("Only one [m1] [m2]."))
    # ~4 characters a token: the first memory's line (17) fits, both (32) do not
    r = agent(gateway, max_context_tokens=20)("bank", "q?", "", "mid", NOW)
    assert r.memories_supplied == 1 and r.based_on == ["f-berlin"] and r.dropped_citations == ["m2"]
    assert "context budget reached" in stub.chat_requests()[1].text()


def test_model_unreachable_falls_back_to_the_extractive_answer(stub):
    gw = make_gateway(stub, llm_max_retries=1)
    stub.on("chat", status(503), status(503))
    r = agent(gw)("bank", "Where does Caroline live?", "", "mid", NOW)
    assert r.extractive is True and "f-berlin" in r.based_on and r.usage.failed_calls == 2
    # a model is configured: the answer says it failed, not that there is none
    assert "reflect model failed" in r.text and "no language model configured" not in r.text


def test_the_extractive_fallback_keeps_the_documents_of_the_facts_it_quotes(stub):
    # a mental model refreshed from this answer records each cited fact's document, so
    # that deleting the document erases the content: the fallback must not lose them
    gw = make_gateway(stub, llm_max_retries=0)
    stub.on("chat", status(503))
    doc = Fact(id="f-doc", bank_id="bank", text="Caroline moved to Berlin in 2021.",
               document_id="chat-1")
    r = agent(gw, FakeRecall(facts=(doc,)))("bank", "Where does Caroline live?", "", "mid", NOW)
    assert r.extractive is True and r.based_on == ["f-doc"]
    assert r.documents == {"f-doc": "chat-1"}


def test_model_unreachable_and_no_memories_says_the_model_failed(stub):
    gw = make_gateway(stub, llm_max_retries=0)
    stub.on("chat", status(503))
    r = agent(gw, FakeRecall(facts=()))("bank", "Where does Caroline live?", "", "mid", NOW)
    assert r.extractive is True and r.based_on == []
    assert "reflect model failed" in r.text and "no language model configured" not in r.text


def test_a_tag_scoped_reflect_searches_only_the_observations_of_its_scope(stub, gateway):
    """search_observations keeps to the reflect's tags as recall does (observations of a
    scope sharing a tag, and global ones): a reflect for one user's tags must not read
    the observations consolidated from another user's facts."""
    from services.search.observations import observation_search
    stub.on("chat",
            chat(None, tool_calls=[call("search_observations", "Caroline home city")]),
            chat(None, tool_calls=[call("recall", "Caroline moved")]),
            chat("Caroline lives in Berlin [m1]."))
    searched = FakeRecall(facts=())
    recall = FakeRecall()
    agent(gateway, recall, observations=observation_search(searched))(
        "bank", "Where does Caroline live?", "", "mid", NOW, tags=["user_a"])
    [q] = searched.queries
    assert q.filters.types == ("observation",)
    assert (q.filters.tags, q.filters.tags_match) == (("user_a",), "any")
    assert recall.queries[0].filters.tags == ("user_a",)  # as the facts it recalls


def test_every_read_of_a_reflect_matches_its_tags_in_its_mode(stub, gateway):
    """The request's tags_match reaches every tool: recall's filters, the observation
    search's (through recall) and the mental-model port; EXACT with no tags is the
    untagged scope, not the whole bank."""
    from services.search.observations import observation_search
    for tags, mode in ((["user_a", "work"], "all"), ([], "exact")):
        stub.on("chat",
                chat(None, tool_calls=[call("search_mental_models", "home")]),
                chat(None, tool_calls=[call("search_observations", "home city")]),
                chat(None, tool_calls=[call("recall", "Caroline moved")]),
                chat("Caroline lives in Berlin [m1]."))
        models, searched, recall = [], FakeRecall(facts=()), FakeRecall()

        def mm(bank_id, query, now, limit, tags=(), tags_match="any"):
            models.append((tuple(tags), tags_match))
            return []
        agent(gateway, recall, observations=observation_search(searched), mental_models=mm)(
            "bank", "Where does Caroline live?", "", "mid", NOW, tags=tags, tags_match=mode)
        assert models == [(tuple(tags), mode)]
        assert [(q.filters.tags, q.filters.tags_match) for q in searched.queries + recall.queries] \
            == [(tuple(tags), mode)] * 2
