"""Contract of :class:`mneme.ports.VectorStore`, written once; subclass per adapter and
implement ``make_store(path)`` (same path → same data, for reopen tests)."""

from __future__ import annotations

import dataclasses
import math

import pytest

from .corpus import basis, corpus, fid, filter_cases, full_fact, rand_vec, unit
from mneme.domain import Fact, Filters
from mneme.stores.filters import fact_matches


class VectorStoreSuite:
    """Shared tests; vectors have ``DIM`` dimensions. ``vector_tolerance``: how far a
    stored vector's components may come back from the normalised ones written."""

    vector_tolerance = 1e-6

    def make_store(self, path):  # pragma: no cover - abstract
        raise NotImplementedError

    @pytest.fixture
    def store(self, tmp_path):
        s = self.make_store(tmp_path)
        yield s
        s.close()

    def _all(self, store, bank_id, filters=None, limit=7):
        out, cursor = [], None
        while True:
            page, cursor = store.scroll(bank_id, limit, after=cursor, filters=filters)
            out.extend(page)
            if cursor is None:
                return out

    # -- writes and reads --

    def test_roundtrip_every_field(self, store):
        f = full_fact()
        store.upsert([f])
        [got] = store.get("a", [f.id], with_vectors=True)
        assert dataclasses.replace(got, embedding=[]) == dataclasses.replace(f, embedding=[])
        assert got.embedding == pytest.approx(f.embedding, abs=self.vector_tolerance)
        [plain] = store.get("a", [f.id])
        assert plain.embedding == []
        assert plain.occurred_end == f.occurred_end  # microseconds survive
        assert plain.occurred_start.tzinfo is not None

    def test_get_keeps_order_and_skips_missing(self, store):
        facts = corpus(n=5)
        store.upsert(facts)
        ids = [facts[3].id, fid("missing"), facts[0].id]
        assert [f.id for f in store.get("a", ids)] == [facts[3].id, facts[0].id]
        assert store.get("a", []) == []

    def test_upsert_is_idempotent_and_replaces(self, store):
        f = corpus(n=1)[0]
        store.upsert([f])
        store.upsert([f])
        assert store.count("a") == 1
        store.upsert([dataclasses.replace(f, text="changed", tags=("new",))])
        assert store.count("a") == 1
        [got] = store.get("a", [f.id])
        assert (got.text, got.tags) == ("changed", ("new",))

    def test_get_after_each_write_sees_the_write(self, store):
        """Reads right after a replace, a delete by id, a delete by document and a reset
        see them (an adapter that keeps hydrated units must drop what a write touched),
        repeats of one id come back once, and a returned fact is the caller's own."""
        facts = [dataclasses.replace(f, document_id=f"d{i % 2}")
                 for i, f in enumerate(corpus(n=6))]
        store.upsert(facts)
        ids = [f.id for f in facts]
        assert [f.id for f in store.get("a", ids + ids[:2])] == ids  # hydrated once...
        got = store.get("a", ids)  # ...and again
        got[0].text = "changed by a caller"
        got[0].tags = ("caller",)
        [again] = store.get("a", ids[:1])
        assert (again.text, again.tags) == (facts[0].text, facts[0].tags)
        store.upsert([dataclasses.replace(facts[1], text="replaced")])
        assert store.get("a", [ids[1]])[0].text == "replaced"
        store.delete("a", [ids[2]])
        assert [f.id for f in store.get("a", ids)] == [i for i in ids if i != ids[2]]
        gone = set(store.delete_where("a", document_id="d1"))
        assert gone == {f.id for f in facts if f.document_id == "d1"}
        assert [f.id for f in store.get("a", ids)] == [
            f.id for f in facts if f.document_id == "d0" and f.id != ids[2]]
        store.reset()
        assert store.get("a", ids) == []
        store.upsert(facts[:1])
        assert [f.text for f in store.get("a", ids)] == [facts[0].text]

    def test_wrong_dimension_is_rejected(self, store):
        f = dataclasses.replace(corpus(n=1)[0], embedding=[1.0, 0.0])
        with pytest.raises(ValueError):
            store.upsert([f])
        assert store.count("a") == 0

    def test_count(self, store):
        store.upsert(corpus("a", 6) + corpus("b", 4))
        assert (store.count("a"), store.count("b"), store.count("zzz")) == (6, 4, 0)

    def test_count_with_filters_counts_what_fact_matches_keeps(self, store):
        facts = corpus("a", 24) + corpus("b", 5)
        store.upsert(facts)
        for flt in filter_cases():
            want = sum(1 for f in facts if f.bank_id == "a" and fact_matches(f, flt))
            assert store.count("a", flt) == want, flt

    def test_facet_counts_tags_and_documents_per_bank_under_filters(self, store):
        from collections import Counter
        facts = corpus("a", 24) + corpus("b", 5)
        store.upsert(facts)
        for key in ("tags", "document_id"):
            for flt in [None, *filter_cases()]:
                want = Counter()
                for f in facts:
                    if f.bank_id == "a" and (flt is None or fact_matches(f, flt)):
                        want.update(f.tags if key == "tags" else [f.document_id] if f.document_id else [])
                got = store.facet("a", key, 100, flt)
                assert got == sorted(want.items(), key=lambda p: (-p[1], p[0])), (key, flt)
        top = store.facet("a", "tags", 1)
        assert len(top) == 1 and top[0] == store.facet("a", "tags", 100)[0]
        assert store.facet("zzz", "tags", 10) == []
        with pytest.raises(ValueError):
            store.facet("a", "text", 10)
        with pytest.raises(ValueError):
            store.facet("a", "tags", 0)

    # -- kNN --

    def test_knn_nearest_first_with_cosine_scores(self, store):
        facts = [Fact(id=fid("knn", i), bank_id="a", text=f"f{i}", embedding=basis(i))
                 for i in range(4)]
        store.upsert(facts)
        q = unit([0.9, 0.4, 0.1, 0.0, 0, 0, 0, 0])
        hits = store.search("a", q, k=3)
        assert [h.id for h in hits] == [facts[0].id, facts[1].id, facts[2].id]
        assert hits[0].score == pytest.approx(q[0], abs=max(1e-4, self.vector_tolerance))
        assert [h.score for h in hits] == sorted((h.score for h in hits), reverse=True)
        assert store.search("a", q, k=0) == []

    def test_search_respects_k(self, store):
        store.upsert(corpus(n=10))
        assert len(store.search("a", rand_vec("q"), k=4)) == 4

    # -- isolation --

    def test_bank_isolation(self, store):
        a, b = corpus("a", 8), corpus("b", 8)
        store.upsert(a + b)
        a_ids = {f.id for f in a}
        probe = b[0].embedding
        assert {h.id for h in store.search("a", probe, k=50)} <= a_ids
        assert {f.id for f in self._all(store, "a")} == a_ids
        assert store.get("a", [f.id for f in b]) == []
        assert store.search("nobody", probe, k=5) == []
        store.delete("a", [f.id for f in b])            # ids of another bank: no effect
        assert store.count("b") == 8
        assert store.delete_where("a", None) and store.count("b") == 8

    # -- deletes --

    def test_delete_by_ids(self, store):
        facts = corpus(n=5)
        store.upsert(facts)
        store.delete("a", [facts[1].id, facts[3].id, fid("unknown")])
        assert {f.id for f in self._all(store, "a")} == {facts[i].id for i in (0, 2, 4)}
        store.delete("a", [])
        assert store.count("a") == 3

    def test_delete_where_document_and_bank(self, store):
        facts = corpus(n=9)
        store.upsert(facts + corpus("b", 3))
        gone = store.delete_where("a", "d1")
        assert sorted(gone) == sorted(f.id for f in facts if f.document_id == "d1")
        assert {f.id for f in self._all(store, "a")} == {
            f.id for f in facts if f.document_id != "d1"}
        assert store.delete_where("a", "d1") == []
        rest = store.delete_where("a")
        assert len(rest) == 6 and store.count("a") == 0 and store.count("b") == 3

    def test_delete_where_rejects_empty_document_id(self, store):
        store.upsert(corpus(n=3))
        with pytest.raises(ValueError):
            store.delete_where("a", "")
        assert store.count("a") == 3

    # -- filters --

    def test_filters_match_reference_semantics(self, store):
        facts = corpus(n=24)
        store.upsert(facts + corpus("b", 6))
        for flt in filter_cases():
            expected = {f.id for f in facts if fact_matches(f, flt)}
            scrolled = {f.id for f in self._all(store, "a", flt)}
            searched = {h.id for h in store.search("a", rand_vec("q"), k=100, filters=flt)}
            assert scrolled == expected, flt
            assert searched == expected, flt

    # -- scroll --

    def test_scroll_pages_cover_every_fact_once(self, store):
        facts = corpus(n=23)
        store.upsert(facts)
        seen, cursor, pages = [], None, 0
        while True:
            page, cursor = store.scroll("a", 5, after=cursor)
            assert len(page) <= 5
            seen.extend(f.id for f in page)
            pages += 1
            if cursor is None:
                break
            assert isinstance(cursor, str)
        assert sorted(seen) == sorted(f.id for f in facts) and pages == 5
        # a second pass gives the same order (stable)
        assert [f.id for f in self._all(store, "a", limit=5)] == seen

    def test_scroll_with_filters_and_empty_bank(self, store):
        facts = corpus(n=12)
        store.upsert(facts)
        flt = Filters(types=("world",))
        assert sorted(f.id for f in self._all(store, "a", flt, limit=2)) == sorted(
            f.id for f in facts if f.fact_type == "world")
        assert store.scroll("empty", 10) == ([], None)

    # -- lifecycle --

    def test_persists_across_reopen(self, tmp_path):
        s = self.make_store(tmp_path)
        f = full_fact()
        s.upsert([f] + corpus(n=4))
        s.delete("a", [corpus(n=4)[0].id])
        s.close()
        s2 = self.make_store(tmp_path)
        try:
            assert s2.count("a") == 4
            [got] = s2.get("a", [f.id])
            assert got.text == f.text and got.links == f.links
            assert s2.search("a", f.embedding, k=1)[0].id == f.id
        finally:
            s2.close()

    def test_reset_drops_every_bank(self, store):
        store.upsert(corpus("a", 3) + corpus("b", 3))
        store.reset()
        assert store.count("a") == store.count("b") == 0
        store.upsert(corpus("a", 2))  # usable after reset
        assert store.count("a") == 2
        assert math.isclose(store.search("a", corpus("a", 2)[1].embedding, 1)[0].score, 1.0,
                            abs_tol=max(1e-4, self.vector_tolerance))
