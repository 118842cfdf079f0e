"""The whole path with a language model configured: a real ``mneme up`` process talks
over HTTP to the local OpenAI-compatible stub. Retain → LLM extraction → facts with the
model's times; Reflect → the tool loop through search's recall, an invented id dropped;
StreamReflect; CheckLlm."""

from __future__ import annotations

from datetime import datetime, timezone

import grpc
import pytest

from mneme.client import field_violations
from tests.e2e.server import Server
from tests.llm.stub import chat, rerank_reply

TS = datetime(2023, 5, 8, 13, 56, tzinfo=timezone.utc)


def call(name, query):
    return {"name": name, "arguments": {"query": query}}


def test_retain_and_reflect_through_a_model(stub, server):
    stub.on("chat", chat({"facts": [
        {"text": "Caroline went to an LGBTQ support group on 7 May 2023.", "fact_type": "world",
         "occurred_start": "2023-05-07", "occurred_end": "2023-05-07",
         "entities": [{"name": "Caroline", "type": "person"}], "caused_by": []},
        {"text": "Caroline moved from Sweden in 2015.", "fact_type": "world",
         "occurred_start": "2015", "occurred_end": "2015",
         "entities": [{"name": "Caroline", "type": "person"},
                      {"name": "Sweden", "type": "place"}], "caused_by": []}]}),
        match="support group yesterday")
    with server.client() as m:
        # no observations: the scripted citation [m1] must be the fact recall shows;
        # the model's facts alone (test_offline_facts_beside_the_models has both)
        m.upsert_bank("llm", auto_consolidate=False, extraction_mode="llm_only")
        r = m.retain("llm", [{"content": "Caroline: I went to a LGBTQ support group yesterday. "
                                         "I moved from Sweden in 2015.", "timestamp": TS}])
        assert r.operation.state == 3 and r.operation.facts == 2
        mems = {x.text: x for x in m.list_memories("llm")}
        sweden = mems["Caroline moved from Sweden in 2015."]
        assert sweden.occurred_start.ToDatetime().date().isoformat() == "2015-01-01"
        assert sweden.occurred_end.ToDatetime().date().isoformat() == "2015-12-31"
        assert "Sweden" in {e.name for e in sweden.entities}
        prompt = stub.chat_requests()[0].messages
        assert any("2023-05-08" in str(msg.get("content")) for msg in prompt)

        stub.on("chat", chat(None, tool_calls=[call("search_mental_models", "Caroline origin")]),
                chat(None, tool_calls=[call("search_observations", "Caroline origin")]),
                chat(None, tool_calls=[call("recall", "Caroline moved from")]),
                chat("Caroline moved from Sweden in 2015 [m1] and is 34 [m9]."),
                match="Where did Caroline")
        a = m.reflect("llm", "Where did Caroline move from?")
        assert not a.extractive
        assert sweden.id in a.based_on and len(a.based_on) == 1
        assert "[m9]" not in a.text and list(a.dropped_citations) == ["m9"]

        stub.on("chat", chat(None, tool_calls=[call("recall", "support group")]),
                chat("She went on 7 May 2023 [m1]."), match="When did Caroline")
        events = list(m.stream_reflect("llm", "When did Caroline go to the support group?"))
        kinds = [e.WhichOneof("event") for e in events]
        assert kinds[0] == "tool_call" and kinds[-1] == "done"
        assert events[0].tool_call.name == "recall"
        assert "7 May 2023" in events[-1].done.text

        stub.on("chat", chat("OK"), match="single word OK")
        check = m.check_llm("llm")
        assert check.extraction == "llm"
        assert [c.operation for c in check.checks][:1] == ["retain"] and check.checks[0].ok


def test_offline_facts_beside_the_models(stub, server):
    """By default a bank keeps each item's offline facts beside the model's: a turn the
    model found nothing in is still recalled; ``llm_only`` keeps the model's facts alone."""
    skip = chat({"facts": []})
    bowl = chat({"facts": [
        {"text": "Melanie painted a pottery bowl in 2022.", "fact_type": "world",
         "occurred_start": "2022", "occurred_end": "2022",
         "entities": [{"name": "Melanie", "type": "person"}], "caused_by": []}]})
    stub.on("chat", bowl, bowl, match="pottery bowl")
    stub.on("chat", skip, skip, match="kayak")
    items = [{"content": "Melanie: Yeah, I painted that pottery bowl last year!", "timestamp": TS,
              "document_id": "c", "metadata": {"speaker": "Melanie"}},
             {"content": "Caroline: we took the red kayak out at dawn", "timestamp": TS,
              "document_id": "c", "metadata": {"speaker": "Caroline"}}]
    with server.client() as m:
        m.upsert_bank("both", auto_consolidate=False)
        r = m.retain("both", items)
        assert r.operation.state == 3 and r.operation.facts == 3
        mems = list(m.list_memories("both"))
        kinds = sorted((x.metadata.get("extracted_by"), x.text.split(":")[0]) for x in mems)
        assert kinds == [("offline", "Caroline"), ("offline", "Melanie"),
                         ("openai/stub-model", "Melanie painted a pottery bowl in 2022.")]
        hits = [x.memory.text for x in m.recall("both", "red kayak at dawn").results]
        assert hits and hits[0].startswith("Caroline: we took the red kayak")

        m.upsert_bank("only", auto_consolidate=False, extraction_mode="llm_only")
        r = m.retain("only", items)
        assert r.operation.state == 3 and r.operation.facts == 1
        assert [x.text for x in m.list_memories("only")] == ["Melanie painted a pottery bowl in 2022."]
        assert not any("kayak" in x.memory.text for x in m.recall("only", "red kayak at dawn").results)


def test_model_failure_is_recorded_not_lost(stub, server):
    # no scripted reply: the stub answers 500 → retried, then the item is a failure
    with server.client() as m:
        m.upsert_bank("broken")
        r = m.retain("broken", [{"content": "Bob: I adopted a cat.", "timestamp": TS}])
        assert r.operation.state == 4  # FAILED, with the reason
        assert "items[0]" in r.operation.error
        ops = m.get_operation(r.operation.name.split("/", 1)[1])
        assert ops.state == 4 and ops.items_total == 1


def test_response_schema_needs_a_model(tmp_path):
    s = Server(tmp_path / "offline").start()
    try:
        with s.client() as m:
            m.upsert_bank("b")
            with pytest.raises(grpc.RpcError) as e:
                m.reflect("b", "anything", response_schema={"type": "object"})
            assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT
            assert field_violations(e.value)[0][0] == "response_schema"
            # no JSON holds a NaN or an Infinity: refused before anything else
            for bad in (float("nan"), float("inf")):
                with pytest.raises(grpc.RpcError) as e:
                    m.reflect("b", "anything", response_schema={
                        "type": "object", "properties": {"n": {"type": "number", "maximum": bad}}})
                assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT
                assert field_violations(e.value)[0][0] == "response_schema"
                assert "finite" in e.value.details()
    finally:
        s.stop()


def test_recall_reranks_the_fused_head(stub, tmp_path):
    """With MNEME_RERANK_MODEL set, Recall reorders the fused head by the cross-encoder's
    scores and reports its rank; offline extraction keeps the test to one HTTP route."""
    s = Server(tmp_path / "rr", env={
        "MNEME_RERANK_MODEL": "hosted_vllm/stub-reranker", "MNEME_RERANK_BASE_URL": stub.root_url,
        "MNEME_RERANK_HEAD": "3", "MNEME_LLM_MAX_RETRIES": "0"}).start()
    try:
        with s.client() as m:
            m.upsert_bank("rr", auto_consolidate=False)
            m.retain("rr", [{"content": f"Ann: my {pet} is called {name}.", "timestamp": TS,
                             "document_id": name}
                            for pet, name in (("dog", "Rex"), ("cat", "Tom"), ("fish", "Bubbles"))])
            # unscripted, the stub answers 500: the fusion order stands
            first = m.recall("rr", "what is the pet called", budget="low").results
            plain = [x.memory.text for x in first]
            assert len(plain) == 3 and not any(x.scores.rerank_rank for x in first)
            stub.on("rerank", rerank_reply([0.1, 0.2, 0.9]))  # the fused third is best
            r = m.recall("rr", "what is the pet called", budget="low")
            assert [x.memory.text for x in r.results] == [plain[2], plain[1], plain[0]]
            assert r.results[0].scores.rerank_rank == 1 and r.results[0].scores.rerank == 0.9
            req = [q for q in stub.requests if "rerank" in q.path][-1]
            assert req.body["documents"] == plain
    finally:
        s.stop()
