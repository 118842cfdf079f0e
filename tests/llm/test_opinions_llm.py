"""Opinions through a real ``mneme up`` with the stub model: a reflection forms one (its
initial confidence from its evidence's count and age); new facts about its entity support,
support and contradict it (the stub answers for the facts it is shown), giving the
documented confidence path and a revised text with its history; recall returns it only when
asked for OPINION; replay rebuilds it without a model call; DeleteOpinion removes it (and
fails for an unknown one); ``mneme opinions`` round-trips."""

from __future__ import annotations

import json
import time
from datetime import datetime, timedelta, timezone

import grpc
import pytest
from typer.testing import CliRunner

from mneme.cli import app
from mneme.domain import initial_confidence, revise_confidence
from mneme.v1 import resources_pb2
from tests.llm.stub import OPINION_FORMATION, chat, computed

TS = datetime(2023, 5, 8, 13, 56, tzinfo=timezone.utc)
QUESTION = "What does Caroline want to do with her life?"
FORMED = "Caroline is committed to becoming a counselor."
REVISED = "Caroline has turned from counseling to painting."


def revision(relation: str, revised: str = ""):
    """The stub's answer to an opinion-revision request: ``relation`` for the first fact and
    opinion it was shown (ids read from the request)."""
    def answer(req):
        content = req.messages[1]["content"]
        shown = json.loads(content[content.index("{"):])["new_facts"][0]
        return chat({"updates": [{"opinion_id": shown["opinions"][0]["opinion_id"],
                                  "memory_id": shown["memory_id"], "relation": relation,
                                  "revised_text": revised, "reason": f"the fact {relation}s it"}]})
    return computed(answer)


def wait_for(fn, what: str, timeout: float = 60.0):
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        got = fn()
        if got:
            return got
        time.sleep(0.2)
    raise AssertionError(f"timed out waiting for {what}")


def test_an_opinion_is_formed_revised_recalled_replayed_and_deleted(stub, server):
    with server.client() as m:
        m.upsert_bank("op", auto_consolidate=False, extraction_mode="offline")
        r = m.retain("op", [{"content": "Caroline: I'm studying psychology to become a counselor.",
                             "timestamp": TS}])
        (first,) = r.memory_ids
        stub.on("chat", chat(None, tool_calls=[{"name": "recall",
                                                 "arguments": {"query": "Caroline counselor"}}]),
                chat("She wants to be a counselor [m1]."), match=QUESTION)
        stub.on("chat", chat({"opinions": [{"text": FORMED, "citations": [1],
                                            "entities": ["Caroline"]}]}),
                match=OPINION_FORMATION)
        a = m.reflect("op", QUESTION)
        assert not a.extractive and list(a.based_on) == [first]

        (o,) = wait_for(lambda: list(m.list_opinions("op")), "the opinion to be formed")
        assert o.text == FORMED and list(o.evidence) == [f"banks/op/memories/{first}"]
        assert [e.name for e in o.entities] == ["Caroline"]
        age = (o.create_time.ToDatetime(timezone.utc) - TS).total_seconds() / 86400
        assert o.confidence == pytest.approx(initial_confidence([age]), abs=1e-4)
        assert [(h.change, h.text) for h in o.history] == [("formed", FORMED)]
        formation = stub.chat_requests()[-1]
        assert OPINION_FORMATION in formation.raw and QUESTION in formation.text()

        # default recall leaves opinions out; asked for, it finds this one
        assert all(x.memory.id != o.id for x in m.recall("op", "Caroline counselor").results)
        got = m.recall("op", "Caroline counselor", types=["opinion"]).results
        assert [x.memory.id for x in got] == [o.id]
        assert got[0].memory.fact_type == resources_pb2.OPINION
        assert float(got[0].memory.metadata["confidence"]) == pytest.approx(o.confidence, abs=1e-4)

        # support, support, contradiction: each a fact about Caroline, judged by the stub
        turns = [("Caroline: I enrolled in a counseling course today.", "support", ""),
                 ("Caroline: My counseling mentor says I'm a natural.", "support", ""),
                 ("Caroline: I quit counseling; I paint full time now.", "contradict", REVISED)]
        path, ids = [round(o.confidence, 4)], []
        for n, (text, relation, revised) in enumerate(turns, 1):
            stub.on("chat", revision(relation, revised), match="Opinion updates")
            ids += m.retain("op", [{"content": text, "timestamp": TS + timedelta(days=n)}]).memory_ids
            cur = wait_for(lambda: (x := m.get_opinion("op", o.id)) and len(x.history) == n + 1
                           and x, f"revision {n}")
            path.append(revise_confidence(path[-1], relation))
        assert [round(h.confidence, 4) for h in cur.history] == path
        assert path[1] > path[0] and path[2] > path[1]
        assert path[2] - path[3] == pytest.approx(2 * 0.1 * path[2], abs=1e-3)  # double weight
        assert [h.change for h in cur.history] == ["formed", "reinforced", "reinforced",
                                                   "contradicted"]
        assert [h.memory.rsplit("/", 1)[-1] for h in cur.history[1:]] == ids
        assert cur.text == REVISED and cur.history[2].text == FORMED
        assert round(cur.confidence, 4) == path[-1]
        assert [e.rsplit("/", 1)[-1] for e in cur.evidence] == [first, *ids[:2]]
        # the bank's stats count facts, not the opinion beside them in the vector store
        assert m.bank_stats("op").facts == len(list(m.list_memories("op"))) == 4

    log = b"".join(p.read_bytes() for p in server.data_dir.glob("log.db*"))
    assert FORMED.encode() not in log and REVISED.encode() not in log  # sealed on the log
    calls = len(stub.chat_requests())
    server.replay()
    with server.client() as m:
        again = m.get_opinion("op", o.id)
        assert again == cur  # the recorded states alone: same text, confidence, history
        assert len(stub.chat_requests()) == calls  # replay asked no model

        run = CliRunner()
        out = run.invoke(app, ["opinions", "list", "op", "--json", "-a", server.address])
        assert out.exit_code == 0, out.output
        assert [x["id"] for x in json.loads(out.output)] == [o.id]
        out = run.invoke(app, ["opinions", "get", "op", o.id, "-a", server.address])
        assert out.exit_code == 0 and REVISED in out.output and "contradicted" in out.output
        assert o.id in out.output  # the full id
        out = run.invoke(app, ["opinions", "delete", "op", o.id, "-a", server.address])
        assert out.exit_code == 0 and "succeeded" in out.output, out.output
        with pytest.raises(grpc.RpcError) as e:
            m.get_opinion("op", o.id)
        assert e.value.code() == grpc.StatusCode.NOT_FOUND
        assert list(m.list_opinions("op")) == []
        gone = m.delete_opinion("op", o.id)  # nothing left to delete
        assert gone.state == 4 and "not found" in gone.error
        with pytest.raises(grpc.RpcError) as e:
            m.delete_opinion("op", "../x")
        assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT
