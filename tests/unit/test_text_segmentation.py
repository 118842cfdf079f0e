"""mneme.cjk: CJK segmentation shared by both text stores, and how the Tantivy adapter
treats an index written before it (issue 9 item 9)."""

from __future__ import annotations

import logging
import os

from mneme.cjk import cjk_bigrams, has_cjk, has_unspaced_script, segment
from mneme.domain import Fact


def test_cjk_runs_become_bigrams_and_other_text_is_unchanged():
    assert segment("我在北京") == " 我在 在北 北京 "
    assert segment("東京で") == " 東京 京で "
    assert segment("서울에서 김치") == " 서울 울에 에서   김치 "
    assert segment("一") == " 一 "  # a lone character is a unigram
    assert segment("iPhone在深圳") == "iPhone 在深 深圳 "
    assert segment("She paints, doesn't she?") == "She paints, doesn't she?"
    assert segment("ＡＢＣ１２３") == "ABC123"  # full-width folded (cjk_width)
    assert cjk_bigrams("") == [] and cjk_bigrams("北京烤鸭") == ["北京", "京烤", "烤鸭"]
    assert has_cjk("x 京") and not has_cjk("émigré")
    assert has_unspaced_script("ฉันชอบ") and has_unspaced_script("한국") and not has_unspaced_script("abc")


def test_a_shared_tantivy_index_from_before_segmentation_is_split_and_segmented(tmp_path,
                                                                                caplog):
    """A data dir from before per-bank indexes and CJK segmentation (one index of every
    bank, CJK text indexed as whole runs, no version file) opens split per bank, with its
    CJK text segmented, so it is found by keyword without a replay, and no warning."""
    from tantivy import Document

    from mneme.stores.text_tantivy import VERSION_FILE, TantivyTextStore, _Index

    path = tmp_path / "text"
    old = _Index(str(path))
    old.upsert([Fact(id="f1", bank_id="a", text="durable words")])
    old.add_documents([Document.from_dict(  # as the earlier version indexed it
        {"key": ["a\x1ff2"], "id": ["f2"], "bank_id": ["a"], "text": ["我昨天在北京吃了烤鸭。"],
         "fact_type": ["world"], "document_id": [""], "n_tags": [0]}, old._schema)])
    assert old.search("a", ["北京"], 5, None) == [], "the check can fail: a whole run"
    old.close()
    os.remove(path / VERSION_FILE)
    with caplog.at_level(logging.WARNING, logger="mneme.stores.text_tantivy"):
        s = TantivyTextStore(str(path))
    try:
        assert "mneme replay" not in caplog.text
        assert [h.id for h in s.search("a", "words", k=5)] == ["f1"]
        assert [h.id for h in s.search("a", "北京", k=5)] == ["f2"]  # segmented now
        s.upsert([Fact(id="f3", bank_id="a", text="上海的烤鸭")])
        assert {h.id for h in s.search("a", "烤鸭", k=5)} == {"f2", "f3"}
    finally:
        s.close()
    assert (path / "banks" / "a" / VERSION_FILE).read_text().strip() == "2"
    assert sorted(os.listdir(path)) == [".mneme-text.lock", "banks"]  # old files gone
