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
