"""The extractive reflect answer keeps within ``max_tokens`` by recall's tokenizer, also
for text with more tokens than characters (Hangul: a syllable is several WordPiece
tokens)."""

from __future__ import annotations

from datetime import datetime, timezone

from mneme.domain import Fact, RecallOutcome, Scored
from mneme.embedding import default_token_counter
from services.reflect.handlers import cut_to_tokens, fits, reflect_offline

NOW = datetime(2024, 6, 1, tzinfo=timezone.utc)
KOREAN = "민지는 서울에서 고양이 두 마리와 함께 산다"


def test_a_text_of_fewer_characters_than_tokens_is_counted():
    count = default_token_counter().count
    assert count(KOREAN) > len(KOREAN)  # what the bound must not assume away
    assert not fits(KOREAN, len(KOREAN), count)
    cut = cut_to_tokens(KOREAN, len(KOREAN), count)
    assert KOREAN.startswith(cut) and cut and count(cut) <= len(KOREAN)


def test_the_extractive_answer_keeps_within_max_tokens():
    count = default_token_counter().count
    fact = Fact(id="f1", bank_id="b", text=" ".join(["한국어"] * 40), mentioned_at=NOW)
    recall = lambda q: RecallOutcome([Scored(fact=fact)], 10)  # noqa: E731
    whole = reflect_offline("b", "고양이", "", "mid", NOW, recall, count=count)
    assert count(whole.text) > len(whole.text)
    for bound in (3, 10, len(whole.text), count(whole.text) - 1):
        r = reflect_offline("b", "고양이", "", "mid", NOW, recall, count=count, max_tokens=bound)
        assert count(r.text) <= bound, (bound, r.text)
        assert whole.text.startswith(r.text)


def test_a_structured_answer_cut_off_by_max_tokens_is_the_requests_fault_not_unavailable():
    """A Reflect with a response_schema and a max_tokens too small for the JSON answer:
    the model's reply was cut off at every try (LlmOutputError, reason "truncated") and
    the call answered UNAVAILABLE, which clients retry, the same way for ever. It is
    INVALID_ARGUMENT naming max_tokens; with no max_tokens of the caller's (the server's
    cap cut it), FAILED_PRECONDITION: asking again fails the same way."""
    import pytest

    from mneme.errors import FailedPrecondition, InvalidArgument, Unavailable
    from mneme.llm.types import LlmOutputError, LlmUnavailable
    from services.reflect.handlers import Reflector

    def agent_failing(error):
        def agent(*a, **kw):
            raise error
        agent.stream = lambda *a, **kw: (_ for _ in ()).throw(error)
        return agent

    cut = LlmOutputError("reflect: reply cut off at the 20-token limit", "truncated")
    schema = {"type": "object", "properties": {"a": {"type": "string"}}}
    r = Reflector(agent_failing(cut), recall=None, record=lambda m: None)
    with pytest.raises(InvalidArgument) as e:
        r.reflect("b", "q", "", "mid", NOW, schema, max_tokens=10)
    assert [f for f, _ in e.value.violations] == ["max_tokens"]
    with pytest.raises(InvalidArgument):
        list(r.stream("b", "q", "", "mid", NOW, schema, max_tokens=10))
    for server_cap in (0, r.answer_cap, r.answer_cap + 1):  # the server's cap cut it
        with pytest.raises(FailedPrecondition):
            r.reflect("b", "q", "", "mid", NOW, schema, max_tokens=server_cap)
    down = Reflector(agent_failing(LlmUnavailable("reflect: 503", "unavailable")),
                     recall=None, record=lambda m: None)
    with pytest.raises(Unavailable):  # a model away stays UNAVAILABLE
        down.reflect("b", "q", "", "mid", NOW, schema, max_tokens=10)
