"""End to end through gRPC against a real ``mneme up`` process on the embedded stores:
retain a LoCoMo conversation, recall with a real floor on evidence recall@10, bank
isolation, delete document (gone from all three stores), replay (same results)."""

from __future__ import annotations

import statistics
import subprocess
import sys
from datetime import datetime, timezone
from pathlib import Path

import grpc
import pytest

from mneme import locomo
from mneme.client import field_violations
from tests.e2e.server import Server, conversation_file

pytestmark = pytest.mark.slow

CONV = "conv-26"
# conv-26 alone: BM25 over raw turns gives 0.540 evidence recall@10 (data README); the
# floor sits below what mneme measures (see README) and above BM25's.
RECALL10_FLOOR = 0.55
# A fixed "now": the recency boost depends on it, so comparisons across runs pin it.
NOW = datetime(2024, 1, 1, tzinfo=timezone.utc)


def _conv(sample_id: str) -> dict:
    for c in locomo.load(conversation_file()):
        if c["sample_id"] == sample_id:
            return c
    pytest.skip(f"{sample_id} not in {conversation_file()}")  # only conv-26 ships in examples/


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    data = tmp_path_factory.mktemp("e2e") / "data"
    s = Server(data).start()
    with s.client() as m:
        c = _conv(CONV)
        m.upsert_bank(CONV, display_name="LoCoMo conv-26")
        for sess in locomo.sessions(c):
            r = m.retain(CONV, sess.items)
            assert r.operation.state == 3, r.operation  # SUCCEEDED
            assert len(r.memory_ids) >= len(sess.items)
    yield s
    s.stop()


def _evidence_recall(m, conv: dict, k: int = 10) -> tuple[float, dict]:
    per_cat: dict[int, list[float]] = {}
    for q in locomo.questions(conv):
        if not q.get("evidence"):
            continue
        r = m.recall(conv["sample_id"], q["question"], max_tokens=8192)
        per_cat.setdefault(q["category"], []).append(
            locomo.recall_at(locomo.dia_ids(r.results), q["evidence"], k))
    allv = [v for vs in per_cat.values() for v in vs]
    return statistics.fmean(allv), {c: statistics.fmean(v) for c, v in per_cat.items()}


def test_every_turn_is_retained_with_its_dia_id(server):
    with server.client() as m:
        turns = {i["metadata"]["dia_id"] for s in locomo.sessions(_conv(CONV)) for i in s.items}
        mems = list(m.list_memories(CONV))
        got = {d for mem in mems for d in mem.metadata["dia_id"].split(",")}
        assert got == turns
        # session date as mentioned_at, entities resolved, speaker kept
        first = next(mem for mem in mems if mem.metadata["dia_id"] == "D1:3")
        assert first.mentioned_at.ToDatetime().date().isoformat() == "2023-05-08"
        assert "Caroline" in {e.name for e in first.entities}


def test_recall_at_10_beats_the_floor(server):
    with server.client() as m:
        overall, per_cat = _evidence_recall(m, _conv(CONV))
    print(f"conv-26 evidence recall@10 overall {overall:.3f} per category {per_cat}")
    assert overall >= RECALL10_FLOOR


def test_results_carry_per_arm_scores_and_fit_the_budget(server):
    with server.client() as m:
        r = m.recall(CONV, "When did Caroline go to the LGBTQ support group?", max_tokens=300)
    assert r.results and r.total_tokens <= 300
    assert sum(x.tokens for x in r.results) == r.total_tokens
    top = r.results[0].scores
    assert top.rrf > 0 and top.final >= top.rrf
    assert any(x.scores.semantic_rank for x in r.results)
    assert any(x.scores.keyword_rank for x in r.results)
    assert any(x.scores.graph_rank for x in r.results)


def test_temporal_arm_uses_query_timestamp(server):
    with server.client() as m:
        # session 1 is 8 May 2023; "yesterday" relative to 9 May 2023 is the 8th
        r = m.recall(CONV, "What did Caroline talk about yesterday?",
                     query_timestamp=datetime(2023, 5, 9, 12, tzinfo=timezone.utc))
    assert r.query_time_range.start.ToDatetime().date().isoformat() == "2023-05-08"
    temporal = [x for x in r.results if x.scores.temporal_rank]
    assert any(x.memory.metadata["session"] == "1" for x in temporal)
    for x in temporal:  # every temporal hit happened (at least partly) on 8 May 2023
        start = (x.memory.occurred_start if x.memory.HasField("occurred_start") else x.memory.mentioned_at)
        end = x.memory.occurred_end if x.memory.HasField("occurred_end") else start
        assert start.ToDatetime().date().isoformat() <= "2023-05-08" <= end.ToDatetime().date().isoformat()


def test_invalid_input_and_unknown_bank(server):
    with server.client() as m:
        with pytest.raises(grpc.RpcError) as e:
            m.recall(CONV, "   ")
        assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert ("query", "must not be empty") in field_violations(e.value)
        with pytest.raises(grpc.RpcError) as e:
            m.retain(CONV, [{"content": ""}])
        assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert field_violations(e.value)[0][0] == "items[0].content"
        with pytest.raises(grpc.RpcError) as e:
            m.upsert_bank("Not A Slug")
        assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert field_violations(e.value)[0][0] == "bank.name"
        with pytest.raises(grpc.RpcError) as e:
            m.recall("no-such-bank", "anything")
        assert e.value.code() == grpc.StatusCode.NOT_FOUND
        with pytest.raises(grpc.RpcError) as e:
            m.retain("no-such-bank", [{"content": "x"}])
        assert e.value.code() == grpc.StatusCode.NOT_FOUND
        # nothing stored was touched by the rejected requests
        assert sum(1 for _ in m.list_memories(CONV)) > 400


def test_reflect_is_extractive_and_cites_recalled_ids(server):
    with server.client() as m:
        a = m.reflect(CONV, "What did Caroline research?")
        assert a.extractive and a.based_on
        assert "no language model" in a.text
        for mid in a.based_on:
            assert m.get_memory(CONV, mid).id == mid


def test_bank_isolation(server):
    with server.client() as m:
        m.upsert_bank("isolated")
        m.retain("isolated", [{"content": "Bob: I adopted a greyhound named Pixel from the shelter.",
                               "metadata": {"dia_id": "X1"}}])
        a = m.recall(CONV, "greyhound named Pixel adopted from the shelter", max_tokens=8192)
        assert all(r.memory.metadata.get("dia_id") != "X1" for r in a.results)
        b = m.recall("isolated", "Caroline LGBTQ support group painting", max_tokens=8192)
        assert [r.memory.metadata["dia_id"] for r in b.results] == ["X1"]
        assert [x.metadata["dia_id"] for x in m.list_memories("isolated")] == ["X1"]


def test_delete_document_then_replay(server, tmp_path):
    """Delete a session: its memories are gone from every store; then replay the log
    into fresh projections and get the same recall results as before."""
    doc = f"{CONV}/session_2"
    queries = ["When did Melanie run a charity race?", "What is Caroline's identity?",
               "What did Melanie paint?", "Where did Caroline move from?"]
    with server.client() as m:
        before_doc = list(m.list_memories(CONV, document_id=doc))
        assert before_doc
        gone = {x.id for x in before_doc}
        op = m.delete_document(CONV, doc)
        assert op.state == 3
        assert list(m.list_memories(CONV, document_id=doc)) == []
        for q in queries + ["charity race for mental health"]:
            r = m.recall(CONV, q, max_tokens=8192, budget="high")
            assert not gone & {x.memory.id for x in r.results}
        before = {q: [(x.memory.id, x.scores.final) for x in
                      m.recall(CONV, q, max_tokens=2048, query_timestamp=NOW).results]
                  for q in queries}
    server.stop()

    # all three stores, read directly: nothing of the deleted document is left
    from mneme.config import Settings
    from mneme.stores import open_graph_store, open_text_store, open_vector_store
    st = Settings(data_dir=server.data_dir)
    vec = open_vector_store(st.url("vector"), dim=384)
    try:
        assert vec.get(CONV, list(gone)) == []
    finally:
        vec.close()
    txt = open_text_store(st.url("text"))
    try:
        hits = txt.search(CONV, "charity race mental health", 1000)
        assert not gone & {h.id for h in hits}
    finally:
        txt.close()
    g = open_graph_store(st.url("graph"))
    try:
        acts = g.spread(CONV, {i: 1.0 for i in gone}, [], 1000)
        assert not gone & {h.id for h in acts}
    finally:
        g.close()

    out = subprocess.run([str(Path(sys.executable).with_name("mneme")), "replay",
                          "--data-dir", str(server.data_dir)], capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    server.start()
    with server.client() as m:
        after = {q: [(x.memory.id, x.scores.final) for x in
                     m.recall(CONV, q, max_tokens=2048, query_timestamp=NOW).results]
                 for q in queries}
        assert list(m.list_memories(CONV, document_id=doc)) == []
    assert after == before
