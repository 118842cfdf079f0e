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


def test_tantivy_index_from_before_segmentation_opens_and_records_the_version(tmp_path, caplog):
    from mneme.stores.text_tantivy import VERSION_FILE, TantivyTextStore

    path = tmp_path / "text"
    s = TantivyTextStore(str(path))
    s.upsert([Fact(id="f1", bank_id="a", text="durable words")])
    s.close()
    os.remove(path / VERSION_FILE)  # as an index written by the earlier version
    with caplog.at_level(logging.WARNING, logger="mneme.stores.text_tantivy"):
        s = TantivyTextStore(str(path))
    try:
        assert "mneme replay" in caplog.text
        assert [h.id for h in s.search("a", "words", k=5)] == ["f1"]  # old text still found
        s.upsert([Fact(id="f2", bank_id="a", text="我昨天在北京吃了烤鸭。")])
        assert [h.id for h in s.search("a", "北京", k=5)] == ["f2"]  # new text segmented
    finally:
        s.close()
    assert (path / VERSION_FILE).read_text().strip() == "2"
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="mneme.stores.text_tantivy"):
        TantivyTextStore(str(path)).close()
    assert "mneme replay" not in caplog.text  # warned once
