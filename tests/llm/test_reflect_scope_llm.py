"""Reflect's ``tags_match`` and ``max_tokens`` on the model's path: a real ``mneme up``
whose reflect model is the stub. The bank (facts, observations, a mental model) is made
offline first, on the same data dir, so its observations come from offline
consolidation. A reflect matching ALL of its tags shows the model nothing (facts,
observations, mental models) that carries only one of them, and cites none of it; the
request's ``max_tokens`` is the model's max tokens, capped by MNEME_LLM_MAX_OUTPUT_TOKENS."""

from __future__ import annotations

import pytest

from tests.e2e.server import Server
from tests.llm.conftest import MODEL
from tests.llm.stub import OPINION_FORMATION, chat

CAT = "Alice's cat is called Miso."
LAPTOP = "Alice's work laptop is a ThinkPad called Pixel."
BANK = "scope"


def call(name, query):
    return {"name": name, "arguments": {"query": query}}


@pytest.fixture
def served(stub, tmp_path):
    """(the stub-model server, {text: id} of the facts, of the observations, the mental
    model's id)."""
    data = tmp_path / "data"
    offline = Server(data).start()
    try:
        with offline.client() as m:
            m.upsert_bank(BANK)
            assert m.retain(BANK, [{"content": CAT, "tags": ["alice"]},
                                   {"content": LAPTOP, "tags": ["alice", "work"]}]
                            ).operation.state == 3
            assert m.consolidate(BANK).state == 3
            facts = {x.text: x.id for x in m.list_memories(BANK)}
            observations = {o.text: o.id for o in m.list_observations(BANK)}
            assert set(facts) == set(observations) == {CAT, LAPTOP}
            model = m.create_mental_model(BANK, "Alice's cat", "What is Alice's cat called?",
                                          content=CAT, tags=["alice"])
    finally:
        offline.stop()
    s = Server(data, env={"MNEME_LLM_MODEL": MODEL, "MNEME_LLM_BASE_URL": stub.base_url,
                          "MNEME_LLM_API_KEY": "sk-test", "MNEME_LLM_TIMEOUT_S": "10",
                          "MNEME_LLM_MAX_RETRIES": "0"}).start()
    # the opinions each reflection forms afterwards: none (and no scripted reply used up)
    stub.on("chat", chat({"opinions": []}), match=OPINION_FORMATION, forever=True)
    yield s, facts, observations, model.id
    s.stop()


def script(stub, question):
    """Every tool once, then an answer citing each memory shown (m1..m6)."""
    stub.on("chat", chat(None, tool_calls=[call("search_mental_models", "cat name")]),
            chat(None, tool_calls=[call("search_observations", "cat called")]),
            chat(None, tool_calls=[call("recall", "cat called")]),
            chat("It is called [m1] [m2] [m3] [m4] [m5] [m6]."), match=question)


def shown(stub, question) -> str:
    """What the tools showed the model for ``question`` (the last turn's messages)."""
    asked = [r for r in stub.chat_requests(without=OPINION_FORMATION) if question in r.raw]
    return "\n".join(str(msg.get("content")) for msg in asked[-1].messages
                     if msg["role"] == "tool")


def test_all_tags_reflect_reads_and_cites_nothing_tagged_with_one(stub, served):
    s, facts, observations, model_id = served
    with s.client() as m:
        # ANY (the default): the cat's fact, observation and model are all read and cited
        q_any = "What is Alice's cat called, any?"
        script(stub, q_any)
        r = m.reflect(BANK, q_any, tags=["alice", "work"])
        assert not r.extractive
        assert {facts[CAT], observations[CAT], model_id} <= set(r.based_on)
        assert "Miso" in shown(stub, q_any)

        q_all = "What is Alice's cat called, all?"
        script(stub, q_all)
        r = m.reflect(BANK, q_all, tags=["alice", "work"], tags_match="all")
        assert not r.extractive
        assert "Miso" not in shown(stub, q_all)  # no tool showed it to the model
        assert set(r.based_on) == {facts[LAPTOP], observations[LAPTOP]}
        assert list(r.sources.mental_models) == []

        q_stream = "What is Alice's cat called, streamed?"
        script(stub, q_stream)
        [done] = [e.done for e in m.stream_reflect(BANK, q_stream, tags=["alice", "work"],
                                                    tags_match="all_strict")
                  if e.WhichOneof("event") == "done"]
        assert "Miso" not in shown(stub, q_stream)
        assert set(done.based_on) == {facts[LAPTOP], observations[LAPTOP]}


def test_max_tokens_is_the_models_max_tokens(stub, served):
    s, *_ = served
    with s.client() as m:
        for asked, sent in ((0, 4096), (37, 37), (10**6, 4096)):
            q = f"What does Alice use at work ({asked})?"
            stub.on("chat", chat(None, tool_calls=[call("recall", "work laptop")]),
                    chat("A ThinkPad [m1]."), match=q)
            r = m.reflect(BANK, q, max_tokens=asked)
            assert r.text == "A ThinkPad [1]."
            turns = [x for x in stub.chat_requests(without=OPINION_FORMATION) if q in x.raw]
            assert [x.body["max_tokens"] for x in turns] == [sent, sent]
