"""Mental models with the stub reflect model through a real ``mneme up``: a refresh runs the
agent (without the mental-model tool: a model must not answer from itself) and stores its
cited answer; reflect's search_mental_models shows the fresh model, and an answer citing it
lists it in ``sources.mental_models``; replay keeps the model's answer without a model."""

from __future__ import annotations

from datetime import datetime, timezone

from tests.llm.stub import OPINION_FORMATION, chat

TS = datetime(2023, 5, 8, 13, 56, tzinfo=timezone.utc)


def tool(name: str, query: str) -> dict:
    return {"name": name, "arguments": {"query": query}}


def test_refresh_with_the_model_and_reflect_citing_it(stub, server):
    with server.client() as m:
        m.upsert_bank("mm", auto_consolidate=False, extraction_mode="offline")
        r = m.retain("mm", [{"content": "Caroline: I moved from Sweden in 2015.", "timestamp": TS}])
        assert r.operation.state == 3
        fact = r.memory_ids[0]
        made = m.create_mental_model("mm", "Origin", "Where is Caroline from?")

        stub.on("chat", chat(None, tool_calls=[tool("recall", "Caroline Sweden")]),
                chat("Caroline is from Sweden; she moved in 2015 [m1]."),
                match="Where is Caroline from?")
        got = m.refresh_mental_model("mm", made.id)
        assert got.content == "Caroline is from Sweden; she moved in 2015 [1]."
        assert list(got.based_on) == [f"banks/mm/memories/{fact}"] and got.revision == 1
        tools = [t["function"]["name"] for t in stub.chat_requests(without=OPINION_FORMATION)[-1].body.get("tools", [])]
        assert "search_mental_models" in tools  # offered, but finds nothing during a refresh
        history = m.mental_model_revisions("mm", made.id)
        assert [(h.revision, h.source) for h in history] == [(1, "refresh")]

        stub.on("chat", chat(None, tool_calls=[tool("search_mental_models", "Caroline origin")]),
                chat("She is from Sweden [m1]."), match="Which country")
        a = m.reflect("mm", "Which country does Caroline come from?")
        shown = stub.chat_requests(without=OPINION_FORMATION)[-1].text()
        assert "Origin (fresh" in shown and got.content in shown
        assert list(a.sources.mental_models) == [made.id] and not a.sources.facts
        assert list(a.based_on) == [made.id] and not a.extractive

    server.stop()
    server.replay()
    with server.client() as m:
        again = m.get_mental_model("mm", made.id)
        assert (again.content, list(again.based_on), again.revision) == (
            got.content, list(got.based_on), 1)
