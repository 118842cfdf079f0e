"""services.search.include over stand-in ports: the order, ownership and budget of the
entities' observations, and document truncation."""

from __future__ import annotations

from mneme.domain import (DocumentRevision, EntityRef, Fact, Filters, Hit, Scored,
                          StoredDocument)
from services.search import include

A, B = EntityRef("a", "Ann", "PERSON"), EntityRef("b", "Bo", "PERSON")


class Words:
    """One token a word."""

    def count(self, text: str) -> int:
        return len(text.split())


class Vectors:
    def __init__(self, facts):
        self.facts = {f.id: f for f in facts}

    def search(self, bank_id, vector, k, filters):
        return [Hit(f.id, 1.0 - n / 100) for n, f in enumerate(self.facts.values())
                if f.fact_type in filters.types][:k]

    def get(self, bank_id, ids, with_vectors=False):
        return [self.facts[i] for i in ids if i in self.facts]

    def scroll(self, bank_id, limit, after=None, filters=None):
        return [f for f in self.facts.values()
                if f.document_id == filters.document_id][:limit], None


def obs(oid, text, entities, tags=()):
    return Fact(id=oid, bank_id="k", text=text, fact_type="observation",
                entities=list(entities), tags=tuple(tags))


def scored(fid, entities, document_id="", tags=()):
    return Scored(fact=Fact(id=fid, bank_id="k", text="x", entities=list(entities),
                            document_id=document_id, tags=tuple(tags)))


def test_an_observation_of_two_entities_goes_under_the_first_returned():
    vectors = Vectors([obs("o1", "Bo and Ann met", [B, A]), obs("o2", "Bo sings", [B])])
    got = include.entities([scored("f1", [A]), scored("f2", [B])], 100, bank_id="k",
                           filters=Filters(), vectors=vectors, query_vector=[1.0],
                           tokens=Words())
    assert [(e.ref.id, [o.id for o in e.observations], e.tokens) for e in got] == [
        ("a", ["o1"], 1 + 4), ("b", ["o2"], 1 + 2)]


def test_names_first_then_observations_while_they_fit_and_never_another_scope():
    vectors = Vectors([obs("o1", "Ann runs far every day", [A], ["bob"]),
                       obs("o2", "Ann swims", [A], ["ann"]), obs("o3", "Ann dives deep now", [A])])
    got = include.entities([scored("f1", [A, B])], 4, bank_id="k",
                           filters=Filters(tags=("ann",), tags_match="any"), vectors=vectors,
                           query_vector=[1.0], tokens=Words())
    # 2 names, then o2 (2 tokens); o1 is of another scope, o3 (4 tokens) does not fit
    assert [(e.ref.id, [o.id for o in e.observations]) for e in got] == [("a", ["o2"]), ("b", [])]
    assert sum(e.tokens for e in got) == 4


class Docs:
    def __init__(self, docs):
        self.docs = docs

    def get(self, bank_id, document_id):
        return self.docs.get(document_id)


def doc(document_id, text, items=1, tags=()):
    rev = DocumentRevision(revision=1, operation_id="op", at=0.0, items=items, content_hash="",
                           chars=len(text), tags=tuple(tags), text_stored=True)
    return StoredDocument("k", document_id, 0.0, 0.0, rev, 1, text)


def test_documents_whole_while_they_fit_then_one_truncated():
    store = Docs({"d1": doc("d1", "one two three"), "d2": doc("d2", "four five six seven"),
                  "d3": doc("d3", "eight")})
    results = [scored("f1", [], "d1"), scored("f2", [], "d2"), scored("f3", [], "d1"),
               scored("f4", [], "d3")]
    got = include.documents(results, 5, bank_id="k", filters=Filters(), store=store,
                            vectors=Vectors([]), tokens=Words())
    assert [(d.document_id, d.text, d.truncated, d.tokens, d.memory_ids) for d in got] == [
        ("d1", "one two three", False, 3, ["f1", "f3"]), ("d2", "four five ", True, 2, ["f2"])]


def test_a_document_with_an_item_outside_the_tag_filter_is_left_out():
    mixed = doc("d1", "a\n\nb", items=2, tags=("ann", "bob"))
    facts = [Fact(id="f1", bank_id="k", text="a", document_id="d1", tags=("ann",), item_index=0),
             Fact(id="f2", bank_id="k", text="b", document_id="d1", tags=("bob",), item_index=1)]
    kw = dict(bank_id="k", store=Docs({"d1": mixed}), vectors=Vectors(facts), tokens=Words())
    results = [scored("f1", [], "d1", ("ann",))]
    assert include.documents(results, 50, filters=Filters(tags=("ann",)), **kw) == []
    assert [d.document_id for d in include.documents(results, 50, filters=Filters(), **kw)] == ["d1"]
    # an item without a fact to judge it by: left out too
    one = Vectors(facts[:1])
    assert include.documents(results, 50, filters=Filters(tags=("ann",)), bank_id="k",
                             store=Docs({"d1": mixed}), vectors=one, tokens=Words()) == []


def test_a_replaced_documents_new_text_is_not_judged_by_the_old_versions_facts():
    """A retain replacing a document stores the new text at once (the document
    projection reads the intake topic), while the vector store keeps the replaced
    version's facts until the new ones are extracted. A recall scoped to "ann" returned
    the new text, whose second item is "bob"'s only, judged by the old version's facts
    (both "ann"). Facts that cannot be the latest revision's (their items or tags differ
    from it) leave the document out."""
    new = doc("d1", "Ann's note\n\nBob's salary note", items=2, tags=("ann", "bob"))
    old = [Fact(id="f1", bank_id="k", text="a", document_id="d1", tags=("ann",), item_index=0),
           Fact(id="f2", bank_id="k", text="a2", document_id="d1", tags=("ann",), item_index=1),
           Fact(id="f3", bank_id="k", text="a3", document_id="d1", tags=("ann",), item_index=2)]
    results = [scored("f1", [], "d1", ("ann",))]
    for facts in (old[:2], old):  # the old version had as many items, or more
        for mode in ("any", "any_strict"):
            assert include.documents(results, 50, bank_id="k",
                                     filters=Filters(tags=("ann",), tags_match=mode),
                                     store=Docs({"d1": new}), vectors=Vectors(facts),
                                     tokens=Words()) == [], (len(facts), mode)
    # the new version's own facts, once extracted, judge it (still out: bob's item)
    mine = [Fact(id="n1", bank_id="k", text="a", document_id="d1", tags=("ann",), item_index=0),
            Fact(id="n2", bank_id="k", text="b", document_id="d1", tags=("ann", "bob"),
                 item_index=1)]
    both = doc("d1", "Ann's note\n\nBob's and Ann's note", items=2, tags=("ann", "bob"))
    got = include.documents(results, 50, bank_id="k",
                            filters=Filters(tags=("ann",), tags_match="any_strict"),
                            store=Docs({"d1": both}), vectors=Vectors(mine), tokens=Words())
    assert [d.document_id for d in got] == ["d1"]
