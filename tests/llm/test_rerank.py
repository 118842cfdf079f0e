"""Recall's rerank hook over real HTTP against the stub: reorders the head when
``MNEME_RERANK_MODEL`` is set, keeps fusion order otherwise or when the reranker fails."""

from __future__ import annotations

from mneme.domain import Fact, Scored
from mneme.llm import LlmGateway, LlmSettings, METRICS
from mneme.llm.rerank import Reranker, rerank
from tests.llm.conftest import make_gateway
from tests.llm.stub import rerank_reply, status


def fused(n=4):
    return [Scored(fact=Fact(id=f"f{i}", bank_id="b", text=f"fact number {i}"), final=1.0 - i / 10)
            for i in range(n)]


def test_reorders_the_head_when_configured(stub):
    gw = make_gateway(stub, rerank_model="hosted_vllm/bge-reranker", rerank_base_url=stub.root_url,
                      rerank_head=3)
    stub.on("rerank", rerank_reply([0.1, 0.9, 0.5]))
    r = Reranker(gw)
    assert r.enabled
    out = r("which fact?", fused())
    assert [s.fact.id for s in out] == ["f1", "f2", "f0", "f3"]  # f3: the tail keeps its place
    assert out[0].scores["rerank"] == 0.9 and out[0].ranks["rerank"] == 1
    assert "rerank" not in out[3].scores
    (req,) = [q for q in stub.requests if "rerank" in q.path]
    assert req.path == "/rerank" and req.body["query"] == "which fact?"
    assert req.body["documents"] == ["fact number 0", "fact number 1", "fact number 2"]
    assert r.last_usage.input_tokens == 30
    assert METRICS.get("mneme.rerank.requests", outcome="ok") == 1


def test_cohere_provider_shape(stub):
    gw = make_gateway(stub, rerank_model="cohere/rerank-english-v3.0", rerank_base_url=stub.root_url,
                      rerank_api_key="co-test")
    stub.on("rerank", rerank_reply([0.2, 0.1, 0.3, 0.4]))
    assert [s.fact.id for s in rerank("q", fused(), gw)] == ["f3", "f2", "f0", "f1"]
    (req,) = [q for q in stub.requests if "rerank" in q.path]
    assert req.path == "/v2/rerank"


def test_a_missing_key_is_not_retried(stub):
    gw = make_gateway(stub, rerank_model="cohere/rerank-english-v3.0", rerank_base_url=stub.root_url)
    assert [s.fact.id for s in rerank("q", fused(), gw)] == ["f0", "f1", "f2", "f3"]
    assert gw.sleeps == []


def test_unchanged_without_a_rerank_model(stub, gateway):
    results = fused()
    assert not Reranker(gateway).enabled
    assert rerank("q", results, gateway) == results
    assert rerank("q", results, None) == results
    assert stub.requests == []


def test_failure_keeps_fusion_order(stub):
    gw = make_gateway(stub, rerank_model="hosted_vllm/bge", rerank_base_url=stub.root_url,
                      llm_max_retries=1)
    stub.on("rerank", status(503), status(503))
    results = fused()
    assert [s.fact.id for s in rerank("q", results, gw)] == ["f0", "f1", "f2", "f3"]
    assert METRICS.get("mneme.rerank.requests", outcome="error") == 1
