"""Mental models with the stub reflect model through a real ``mneme up``: a refresh runs the
agent (without the mental-model tool: a model must not answer from itself) and stores its
cited answer; reflect's search_mental_models shows the fresh model, an answer citing it
lists it in ``sources.mental_models``, and reflect stops there (no recall); once stale, the
model is marked so and reflect must recall the facts before answering; a delta refresh
gives the model the current content and only the new memories, and keeps the prior
citations; replay keeps the model's answers without a model."""

from __future__ import annotations

from datetime import datetime, timezone

from mneme.v1 import mental_models_pb2
from tests.llm.stub import OPINION_FORMATION, chat

TS = datetime(2023, 5, 8, 13, 56, tzinfo=timezone.utc)


def tool(name: str, query: str) -> dict:
    return {"name": name, "arguments": {"query": query}}


def tools_called(request) -> list[str]:
    """The tool calls in the conversation a chat request carries, in order."""
    return [tc["function"]["name"] for msg in request.messages
            for tc in msg.get("tool_calls") or []]


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

        # fresh: the model answers from it and reflect stops early (no recall, two turns)
        stub.on("chat", chat(None, tool_calls=[tool("search_mental_models", "Caroline origin")]),
                chat("She is from Sweden [m1]."), match="Which country")
        a = m.reflect("mm", "Which country does Caroline come from?")
        turns = [q for q in stub.chat_requests(without=OPINION_FORMATION) if "Which country" in q.text()]
        shown = turns[-1].text()
        assert "Origin (fresh" in shown and got.content in shown
        assert len(turns) == 2 and tools_called(turns[-1]) == ["search_mental_models"]
        assert list(a.sources.mental_models) == [made.id] and not a.sources.facts
        assert list(a.based_on) == [made.id] and not a.extractive

        # a related retain makes it stale: marked so, and an answer from it alone is not
        # accepted: reflect recalls the facts first
        r2 = m.retain("mm", [{"content": "Caroline: I live in Stockholm now.",
                              "timestamp": datetime(2023, 9, 1, tzinfo=timezone.utc)}])
        new = r2.memory_ids[0]
        assert m.get_mental_model("mm", made.id).is_stale
        stub.on("chat", chat(None, tool_calls=[tool("search_mental_models", "Caroline home")]),
                chat("She is from Sweden [m1]."),
                chat("She is from Sweden [m1] and lives in Stockholm now [m2] [m3]."),
                match="live now")
        a = m.reflect("mm", "Where does Caroline live now?")
        turns = [q for q in stub.chat_requests(without=OPINION_FORMATION) if "live now" in q.text()]
        assert len(turns) == 3 and tools_called(turns[-1]) == ["search_mental_models", "recall"]
        assert "STALE: verify it" in turns[1].text()
        assert "I live in Stockholm now" in turns[-1].text()  # the forced recall's result
        assert list(a.sources.mental_models) == [made.id] and new in a.sources.facts

        # delta: the model is given the current content (its citations as references) and
        # only what changed since; the kept citation stays, the new one is added
        stub.on("chat", chat("Caroline is from Sweden; she moved in 2015 [m1]. She lives in "
                             "Stockholm now [m2]."), match="Update the answer")
        delta = m.refresh_mental_model("mm", made.id, mode="delta")
        req = stub.chat_requests(without=OPINION_FORMATION)[-1]
        prompt = req.messages[-1]["content"]
        assert "Caroline is from Sweden; she moved in 2015 [m1]." in prompt
        assert "[m2]" in prompt and "I live in Stockholm now" in prompt
        assert "moved from Sweden" not in prompt  # the prior memory is cited, not shown again
        assert not req.body.get("tools")  # one turn, no tools
        assert delta.content == ("Caroline is from Sweden; she moved in 2015 [1]. She lives in "
                                 "Stockholm now [2].")
        assert list(delta.based_on) == [f"banks/mm/memories/{fact}", f"banks/mm/memories/{new}"]
        assert not delta.is_stale
        history = m.mental_model_revisions("mm", made.id)
        assert [(h.revision, h.source, h.mode) for h in history] == [
            (1, "refresh", mental_models_pb2.FULL), (2, "refresh", mental_models_pb2.DELTA)]
        calls = len(stub.chat_requests(without=OPINION_FORMATION))

    server.stop()
    server.replay()
    with server.client() as m:
        again = m.get_mental_model("mm", made.id)
        assert (again.content, list(again.based_on), again.revision, again.is_stale) == (
            delta.content, list(delta.based_on), 2, False)
        assert [h.content for h in m.mental_model_revisions("mm", made.id)] == [
            got.content, delta.content]
    assert len(stub.chat_requests(without=OPINION_FORMATION)) == calls  # replay called no model


def test_delta_refresh_falls_back_to_the_extractive_merge_when_the_model_fails(stub, server):
    with server.client() as m:
        m.upsert_bank("mf", auto_consolidate=False, extraction_mode="offline")
        m.retain("mf", [{"content": "Caroline: I paint sunsets.", "timestamp": TS}])
        made = m.create_mental_model("mf", "Painting", "What does Caroline paint?",
                                     content="Caroline paints sunsets.")
        added = m.retain("mf", [{"content": "Caroline: I paint lakes too.", "timestamp": TS}])
        # no scripted reply: the stub answers 500, the agent falls back offline
        delta = m.refresh_mental_model("mf", made.id, mode="delta")
        assert delta.content.startswith("Caroline paints sunsets.")  # the user's text is kept
        assert "I paint lakes too" in delta.content and delta.content.rstrip().endswith("[1]")
        assert list(delta.based_on) == [f"banks/mf/memories/{added.memory_ids[0]}"]
        assert [(h.source, h.mode) for h in m.mental_model_revisions("mf", made.id)] == [
            ("user", mental_models_pb2.REFRESH_MODE_UNSPECIFIED),
            ("refresh_offline", mental_models_pb2.DELTA)]


def test_deleting_the_document_erases_a_content_the_model_failed_to_write(stub, server):
    """A full refresh whose model fails falls back to the extractive answer: that content
    quotes the document's facts, so deleting the document erases it (API and files) as it
    does a model-written one."""
    secret = "ZEBRA-SECRET-4711"
    with server.client() as m:
        m.upsert_bank("mfd", auto_consolidate=False, extraction_mode="offline")
        m.retain("mfd", [{"content": f"Caroline: my locker code is {secret}.",
                          "document_id": "chat", "timestamp": TS}])
        made = m.create_mental_model("mfd", "Locker", "What is Caroline's locker code?")
        # no scripted reply: the stub answers 500, the agent falls back offline
        refreshed = m.refresh_mental_model("mfd", made.id)
        assert secret in refreshed.content and "reflect model failed" in refreshed.content
        assert m.delete_document("mfd", "chat").state == 3
        after = m.get_mental_model("mfd", made.id)
        assert secret not in after.content and after.is_stale
        assert all(secret not in r.content for r in m.mental_model_revisions("mfd", made.id))
    files = [p for p in server.data_dir.glob("catalog.db*") if p.is_file()]
    assert files and not [p.name for p in files if secret.encode() in p.read_bytes()]
