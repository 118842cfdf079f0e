"""Contract of :class:`mneme.ports.TextStore` (BM25), written once; subclass per adapter
and implement ``make_store(path)`` (same path → same data, for reopen tests)."""

from __future__ import annotations

import dataclasses

import pytest

from .corpus import corpus, fid, filter_cases
from mneme.domain import Fact
from mneme.stores.filters import fact_matches


def fact(i, text, bank_id="a", **kw) -> Fact:
    return Fact(id=fid(bank_id, "text", i), bank_id=bank_id, text=text, **kw)


ODD_QUERIES = [
    'what\'s "up" (AND) OR: -x*', "AND", "OR NOT", "(", ")", '"', "title:foo", "a:b:c",
    "x^2 ~1 [1 TO 5] {a TO b}", "\\", "/regex/", "+-&&||!", "*", "?", "émigré café naïve",
    "🙂 emoji", "   ", "", "a" * 300, "NOT paints", "paints~2",
]


class TextStoreSuite:
    """Shared tests."""

    def make_store(self, path):  # pragma: no cover - abstract
        raise NotImplementedError

    @pytest.fixture
    def store(self, tmp_path):
        s = self.make_store(tmp_path)
        yield s
        s.close()

    def test_search_finds_by_words(self, store):
        store.upsert([fact(1, "Alice adopted a cat named Miso"),
                      fact(2, "Bob repaired the old bicycle")])
        [hit] = store.search("a", "bicycle", k=5)
        assert hit.id == fid("a", "text", 2) and hit.score > 0
        assert store.search("a", "submarine", k=5) == []

    def test_stemming_matches_word_forms(self, store):
        store.upsert([fact(1, "She paints landscapes every summer"),
                      fact(2, "He runs marathons")])
        assert [h.id for h in store.search("a", "painting", k=5)] == [fid("a", "text", 1)]
        assert [h.id for h in store.search("a", "Running", k=5)] == [fid("a", "text", 2)]

    def test_term_frequency_ranks_higher(self, store):
        store.upsert([fact(1, "garden tomato basil pepper onion"),
                      fact(2, "garden garden garden tomato basil"),
                      fact(3, "kitchen tomato basil pepper onion")])
        hits = store.search("a", "garden", k=5)
        assert [h.id for h in hits] == [fid("a", "text", 2), fid("a", "text", 1)]
        assert hits[0].score > hits[1].score

    def test_rare_terms_weigh_more(self, store):
        store.upsert([fact(i, f"common words here {'zebra' if i == 0 else 'plain'}")
                      for i in range(6)])
        hits = store.search("a", "common zebra", k=10)
        assert hits[0].id == fid("a", "text", 0) and len(hits) == 6

    @pytest.mark.parametrize("query", ODD_QUERIES)
    def test_odd_user_text_never_raises(self, store, query):
        store.upsert([fact(1, "what is up with the paints")])
        hits = store.search("a", query, k=5)
        assert all(h.id == fid("a", "text", 1) for h in hits)

    def test_stop_word_only_query_returns_nothing(self, store):
        store.upsert([fact(1, "the and of it is")])
        assert store.search("a", "the and of", k=5) == []
        assert store.search("a", "", k=5) == []

    def test_upsert_is_idempotent_and_replaces(self, store):
        f = fact(1, "original wording")
        store.upsert([f])
        store.upsert([f])
        assert store.count("a") == 1
        store.upsert([dataclasses.replace(f, text="replacement phrasing")])
        assert store.count("a") == 1
        assert store.search("a", "original", k=5) == []
        assert [h.id for h in store.search("a", "replacement", k=5)] == [f.id]

    def test_bank_isolation(self, store):
        store.upsert([fact(1, "shared secret words", "a"), fact(2, "shared secret words", "b"),
                      fact(3, "only in b", "b")])
        assert [h.id for h in store.search("a", "shared secret", k=10)] == [fid("a", "text", 1)]
        assert store.search("a", "only", k=10) == []
        assert (store.count("a"), store.count("b")) == (1, 2)
        store.delete("a", [fid("b", "text", 2)])
        store.delete_where("a")
        assert (store.count("a"), store.count("b")) == (0, 2)

    def test_delete_by_ids(self, store):
        store.upsert([fact(i, f"note {i} keyword") for i in range(4)])
        store.delete("a", [fid("a", "text", 1), fid("a", "text", 3), "unknown"])
        assert {h.id for h in store.search("a", "keyword", k=10)} == {
            fid("a", "text", 0), fid("a", "text", 2)}
        assert store.count("a") == 2

    def test_delete_where_document_and_bank(self, store):
        facts = corpus(n=9)
        store.upsert(facts + corpus("b", 2))
        store.delete_where("a", "d1")
        assert {h.id for h in store.search("a", "memory", k=50)} == {
            f.id for f in facts if f.document_id != "d1"}
        store.delete_where("a")
        assert store.count("a") == 0 and store.count("b") == 2

    def test_delete_where_rejects_empty_document_id(self, store):
        store.upsert(corpus(n=3))
        with pytest.raises(ValueError):
            store.delete_where("a", "")
        assert store.count("a") == 3

    def test_filters_match_reference_semantics(self, store):
        facts = corpus(n=24)
        store.upsert(facts + corpus("b", 6))
        for flt in filter_cases():
            expected = {f.id for f in facts if fact_matches(f, flt)}
            got = {h.id for h in store.search("a", "memory", k=100, filters=flt)}
            assert got == expected, flt

    def test_filters_do_not_change_bm25_scores(self, store):
        facts = corpus(n=12)
        store.upsert(facts)
        plain = {h.id: h.score for h in store.search("a", "memory topic1", k=50)}
        flt = filter_cases()[1]
        filtered = store.search("a", "memory topic1", k=50, filters=flt)
        assert filtered and all(h.score == pytest.approx(plain[h.id]) for h in filtered)

    def test_persists_across_reopen(self, tmp_path):
        s = self.make_store(tmp_path)
        s.upsert([fact(1, "durable words"), fact(2, "temporary words")])
        s.delete("a", [fid("a", "text", 2)])
        s.close()
        s2 = self.make_store(tmp_path)
        try:
            assert s2.count("a") == 1
            assert [h.id for h in s2.search("a", "words", k=5)] == [fid("a", "text", 1)]
            s2.upsert([fact(3, "more words")])  # writable after reopen
            assert s2.count("a") == 2
        finally:
            s2.close()

    def test_reset_drops_every_bank(self, store):
        store.upsert([fact(1, "alpha", "a"), fact(2, "beta", "b")])
        store.reset()
        assert store.count("a") == store.count("b") == 0
        assert store.search("b", "beta", k=5) == []
        store.upsert([fact(3, "gamma")])
        assert store.count("a") == 1

    # -- text without spaces (issue 9 item 9): CJK runs are indexed as character bigrams --

    CJK_FACTS = [
        (1, "我昨天在北京吃了烤鸭。"),
        (2, "他下周要去上海出差，然后回北京。"),
        (3, "東京で寿司を食べました。"),
        (4, "毎朝コーヒーを飲みます。"),
        (5, "나는 서울에서 김치를 먹었다."),
        (6, "I bought an iPhone在深圳, and she paints landscapes。"),
        (7, "An English sentence about Beijing duck."),
    ]

    @pytest.mark.parametrize("query, expected", [
        ("北京", [1, 2]), ("烤鸭", [1]), ("上海出差", [2]), ("吃了烤鸭", [1]),  # Chinese
        ("寿司", [3]), ("東京", [3]), ("コーヒー", [4]), ("飲みます", [4]),  # Japanese
        ("서울", [5]), ("김치", [5]), ("서울에서", [5]),  # Korean
        ("深圳", [6]), ("iPhone", [6]), ("painting", [6]),  # mixed CJK + Latin
        ("北京 duck", [1, 2, 7]),
        ("南京", []), ("大阪", []), ("부산", []),  # bigrams that occur nowhere
    ])
    def test_cjk_text_is_found_by_a_short_keyword(self, store, query, expected):
        store.upsert([fact(i, t) for i, t in self.CJK_FACTS])
        got = {h.id for h in store.search("a", query, k=10)}
        assert got == {fid("a", "text", i) for i in expected}, query

    def test_cjk_keyword_ranks_the_sentence_that_holds_it_first(self, store):
        store.upsert([fact(i, t) for i, t in self.CJK_FACTS])
        hits = store.search("a", "他下周去上海", k=10)
        assert hits and hits[0].id == fid("a", "text", 2)
        # full-width Latin is folded like the indexed text
        assert [h.id for h in store.search("a", "ｉＰｈｏｎｅ", k=5)] == [fid("a", "text", 6)]


def _scores(store, bank_id, query):
    return [(h.id, round(h.score, 6)) for h in store.search(bank_id, query, k=20)]


class PerBankStatistics:
    """For a store whose BM25 statistics are per bank (Tantivy; OpenSearch ``per_bank``)."""

    def test_bm25_statistics_are_the_banks_own(self, store):
        """Another bank's writes change neither a bank's keyword ranking nor its scores:
        in one shared index "violin" would become common (lower IDF) and "sunrise" stay
        rare, flipping the order, and a bank's scores would tell how common a word is in
        other banks."""
        store.upsert([Fact(id="f1", bank_id="a", text="practised violin at sunrise today"),
                      Fact(id="f2", bank_id="a", text="violin lesson"),
                      Fact(id="f3", bank_id="a", text="painted the sunrise"),
                      Fact(id="f4", bank_id="a", text="walked the dog")])
        before = _scores(store, "a", "violin")
        both = _scores(store, "a", "violin sunrise")
        store.upsert([Fact(id=f"g{i}", bank_id="b", text=f"violin concert number {i}")
                      for i in range(60)])
        assert _scores(store, "a", "violin") == before
        assert _scores(store, "a", "violin sunrise") == both
        # the other bank scores by its own statistics: "violin" is in all of its documents
        assert max(s for _, s in _scores(store, "b", "violin")) < before[0][1]
