"""Store generations on the server adapters (DESIGN §4 stand-ins: qdrant-client local
mode, a real ``noida-db`` server for OpenSearch, a real FalkorDB server): generation *n*
of a configured URL is a collection / index / graph of its own, independent of the
others, and dropping it deletes it on the server while the live one is untouched."""

from __future__ import annotations

import pytest

from .corpus import DIM, corpus
from .graph_suite import chain
from .servers import falkordb_server, noida_server
from .test_production_stores import name_of
from .text_suite import fact
from mneme.generations import drop_stores, versioned_url
from mneme.stores import open_graph_store, open_text_store, open_vector_store


@pytest.fixture(scope="module")
def servers(tmp_path_factory):
    with noida_server(str(tmp_path_factory.mktemp("noida"))) as noida, \
            falkordb_server(str(tmp_path_factory.mktemp("falkordb"))) as falkor:
        yield noida, falkor


class _Stores:
    def __init__(self, vectors, text, graph) -> None:
        self.vectors, self.text, self.graph = vectors, text, graph

    def all(self):
        return (self.vectors, self.text, self.graph)


def _open(urls):
    return _Stores(open_vector_store(urls["vector"], DIM), open_text_store(urls["text"]),
                   open_graph_store(urls["graph"]))


def test_a_generation_is_its_own_collection_index_and_graph_and_drops_for_good(
        servers, tmp_path):
    noida, falkor = servers
    base = {"vector": f"qdrant-local://{tmp_path}/qdrant",
            "text": f"{noida.url}?index={name_of(tmp_path, 'mneme-g-')}",
            "graph": f"{falkor.url}?graph={name_of(tmp_path, 'g')}"}
    g2 = {k: versioned_url(k, u, 2) for k, u in base.items()}
    assert g2["text"].endswith(f"index={name_of(tmp_path, 'mneme-g-')}_g2")
    assert g2["graph"].endswith(f"graph={name_of(tmp_path, 'g')}_g2")
    assert g2["vector"] == f"qdrant-local://{tmp_path}/qdrant.g2"

    live = _open(base)
    try:
        live.vectors.upsert(corpus(n=5))
        live.text.upsert([fact(1, "She paints landscapes")])
        live.graph.upsert(chain())
        new = _open(g2)
        assert (new.vectors.count("a"), new.text.count("a"), new.graph.count("a")) == (0, 0, 0)
        new.vectors.upsert(corpus(n=3))
        new.text.upsert([fact(2, "He rows on the river"), fact(3, "They sing")])
        text_client, index = new.text.client, new.text.index
        drop_stores(new, g2)  # closes them too
        assert not text_client.indices.exists(index=index)
        assert not text_client.indices.exists_index_template(name=index)
        assert (live.vectors.count("a"), live.text.count("a"), live.graph.count("a")) == (5, 1, 5)
        # Opened again, generation 2 starts empty: nothing of the dropped one is left.
        again = _open(g2)
        try:
            assert (again.vectors.count("a"), again.text.count("a"), again.graph.count("a")) == (
                0, 0, 0)
        finally:
            drop_stores(again, g2)
    finally:
        for s in live.all():
            s.close()
