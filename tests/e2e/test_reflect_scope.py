"""Reflect's ``tags_match`` and ``max_tokens`` through a real ``mneme up`` without a
model (the extractive answer): a reflect matching ALL of its tags reads and cites no fact,
and answers from no mental model, that carries only one of them; the answer keeps within
``max_tokens`` by recall's tokenizer; bad values are INVALID_ARGUMENT naming the field."""

from __future__ import annotations

import grpc
import pytest

from mneme.client import field_violations
from mneme.embedding import default_token_counter
from mneme.limits import limits
from mneme.v1 import reflect_pb2

CAT = "Alice's cat is called Miso."
LAPTOP = "Alice's work laptop is a ThinkPad called Pixel."
SHARED = "A cat is called a kitten while it is young."


@pytest.fixture(scope="module")
def banks(m):
    """Bank "facts": the three facts (CAT tagged alice only, LAPTOP alice and work, SHARED
    untagged); bank "models": CAT and a mental model answering about the cat, tagged
    alice only. Returns {text: memory id} of "facts" and the model's id."""
    m.upsert_bank("facts")
    r = m.retain("facts", [{"content": CAT, "tags": ["alice"]},
                           {"content": LAPTOP, "tags": ["alice", "work"]},
                           {"content": SHARED}])
    assert r.operation.state == 3
    ids = {x.text: x.id for x in m.list_memories("facts")}
    assert set(ids) == {CAT, LAPTOP, SHARED}
    m.upsert_bank("models")
    assert m.retain("models", [{"content": CAT, "tags": ["alice"]}]).operation.state == 3
    model = m.create_mental_model("models", "Alice's cat", "What is Alice's cat called?",
                                  content="Alice's cat is called Miso.", tags=["alice"])
    return ids, model.id


def cited(m, bank, query, tags, mode, **kw):
    return list(m.reflect(bank, query, tags=tags, tags_match=mode, **kw).based_on)


def test_tags_match_scopes_the_facts_reflect_reads(m, banks):
    ids, _ = banks
    q = "What is the cat called?"
    # the default (ANY) reads the fact tagged alice alone: the question does reach it
    assert ids[CAT] in cited(m, "facts", q, ["alice", "work"], "any")
    every = cited(m, "facts", q, ["alice", "work"], "all")
    assert ids[CAT] not in every and ids[SHARED] in every  # untagged facts are shared
    assert cited(m, "facts", q, ["alice", "work"], "all_strict") == [ids[LAPTOP]]
    assert cited(m, "facts", q, [], "exact") == [ids[SHARED]]  # the untagged scope
    assert cited(m, "facts", q, ["alice"], "exact") == [ids[CAT]]
    # streamed the same
    [done] = [e.done for e in m.stream_reflect("facts", q, tags=["alice", "work"],
                                                tags_match="all_strict")]
    assert list(done.based_on) == [ids[LAPTOP]]


def test_tags_match_scopes_the_mental_models_reflect_answers_from(m, banks):
    ids, model_id = banks
    q = "What is Alice's cat called?"
    assert cited(m, "models", q, ["alice", "work"], "any") == [model_id]
    # ALL: the model (and the fact) tagged alice alone are out of scope
    r = m.reflect("models", q, tags=["alice", "work"], tags_match="all")
    assert model_id not in r.based_on and not r.sources.mental_models
    assert "Miso" not in r.text
    assert cited(m, "models", q, ["alice"], "all") == [model_id]


def refused(call) -> list[tuple[str, str]]:
    with pytest.raises(grpc.RpcError) as e:
        call()
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    return field_violations(e.value)


def test_bad_tags_match_and_max_tokens_are_refused(m, banks):
    def reflect(**kw):
        return m.reflect_stub.Reflect(reflect_pb2.ReflectRequest(
            parent="banks/facts", query="What is the cat called?", **kw))
    assert [f for f, _ in refused(lambda: reflect(tags_match=9))] == ["tags_match"]
    assert [f for f, _ in refused(lambda: reflect(max_tokens=-1))] == ["max_tokens"]
    assert [f for f, _ in refused(lambda: reflect(max_tokens=limits().max_tokens + 1))] \
        == ["max_tokens"]
    assert [f for f, _ in refused(lambda: list(m.reflect_stub.StreamReflect(
        reflect_pb2.ReflectRequest(parent="banks/facts", query="cat", max_tokens=-5))))] \
        == ["max_tokens"]


def test_max_tokens_bounds_the_extractive_answer(m, banks):
    ids, _ = banks
    count = default_token_counter().count
    q = "What is the cat called?"
    full = m.reflect("facts", q)  # 0: the server's default
    lines = full.text.split("\n")
    assert len(lines) == 4 and len(full.based_on) == 3
    # exactly the header and the first quote: the others are left out, and not cited
    two = "\n".join(lines[:2])
    r = m.reflect("facts", q, max_tokens=count(two))
    assert r.text == two and list(r.based_on) == list(full.based_on[:1])
    # one token short of it: the first quote is cut within, and still cited
    r = m.reflect("facts", q, max_tokens=count(two) - 1)
    assert two.startswith(r.text) and len(r.text) > len(lines[0]) + 1
    assert count(r.text) <= count(two) - 1 and list(r.based_on) == list(full.based_on[:1])
    # not even the header fits: cut within it, nothing cited
    r = m.reflect("facts", q, max_tokens=3)
    assert count(r.text) <= 3 and r.text and lines[0].startswith(r.text)
    assert list(r.based_on) == []
    # over the cap (MNEME_LLM_MAX_OUTPUT_TOKENS) is the cap: the whole answer
    assert m.reflect("facts", q, max_tokens=limits().max_tokens).text == full.text
    # a mental model's answer is cut too
    r = m.reflect("models", "What is Alice's cat called?", max_tokens=4)
    assert 0 < count(r.text) <= 4


def test_cli_tags_match_and_max_tokens(server, banks):
    import json

    from typer.testing import CliRunner

    from mneme.cli import app
    ids, _ = banks
    run = CliRunner()
    out = run.invoke(app, ["reflect", "facts", "What is the cat called?", "--tag", "alice",
                           "--tag", "work", "--tags-match", "all_strict", "--max-tokens", "500",
                           "--json", "-a", server.address])
    assert out.exit_code == 0, out.output
    assert json.loads(out.stdout)["based_on"] == [ids[LAPTOP]]
    out = run.invoke(app, ["reflect", "facts", "cat", "--tags-match", "most", "-a",
                           server.address])
    assert out.exit_code == 2 and "all_strict" in out.output
    out = run.invoke(app, ["reflect", "facts", "cat", "--max-tokens", "-1", "-a",
                           server.address])
    assert out.exit_code == 2
