"""The production (server) adapters against the same contract suites as their embedded
twins, on what runs here (DESIGN §4, "test stand-in here"):

- QdrantVectorStore  — qdrant-client local mode (``qdrant-local://``), no Qdrant server;
- OpenSearchTextStore — a real ``noida-db`` server (Elasticsearch REST API) via opensearch-py;
- FalkorServerGraphStore — a real FalkorDB server (redis-server + module) over ``redis://``;
- Neo4jGraphStore — no Neo4j server: its sessions/transactions run through a Bolt driver
  double that forwards the shared Cypher to the FalkorDB server.

Servers start once per module on 127.0.0.1 at free ports; each test gets its own
index / graph (named after its tmp_path), so tests stay independent.
"""

from __future__ import annotations

import hashlib
import re
import threading

import pytest

from .bolt_double import BoltDriverDouble
from .corpus import DIM, corpus, fid
from .graph_suite import GraphStoreSuite, chain, unit
from .servers import falkordb_server, noida_server
from .text_suite import PerBankStatistics, TextStoreSuite, fact
from .vector_suite import VectorStoreSuite
from mneme.domain import EntityRef, Filters
from mneme.stores import cypher, open_graph_store, open_text_store, open_vector_store
from mneme.stores.graph_falkor import FalkorServerGraphStore
from mneme.stores.graph_neo4j import Neo4jGraphStore
from mneme.stores.text_opensearch import OpenSearchTextStore
from mneme.stores.vector_qdrant import QdrantVectorStore


def name_of(path, prefix: str) -> str:
    """A per-test, lowercase name (OpenSearch index names must be lowercase)."""
    return prefix + hashlib.sha1(str(path).encode()).hexdigest()[:12]


@pytest.fixture(scope="module")
def noida(tmp_path_factory):
    with noida_server(str(tmp_path_factory.mktemp("noida"))) as server:
        yield server


@pytest.fixture(scope="module")
def falkordb(tmp_path_factory):
    with falkordb_server(str(tmp_path_factory.mktemp("falkordb"))) as server:
        yield server


# ---- vectors: Qdrant (local mode) ------------------------------------------------------------


class TestQdrantVectorStore(VectorStoreSuite):
    def make_store(self, path):
        return open_vector_store(f"qdrant-local://{path}/qdrant", DIM)

    def test_opened_by_url_is_qdrant(self, store):
        assert isinstance(store, QdrantVectorStore) and store.local

    def test_reopen_with_another_dimension_fails(self, tmp_path):
        self.make_store(tmp_path).close()
        with pytest.raises(ValueError, match="dim"):
            open_vector_store(f"qdrant-local://{tmp_path}/qdrant", DIM + 1)

    def test_bad_cursor_is_rejected(self, store):
        with pytest.raises(ValueError, match="cursor"):
            store.scroll("a", 5, after="not-a-cursor")

    def test_collection_is_cosine_with_configured_dim(self, store):
        info = store.client.get_collection(store.collection)
        assert info.config.params.vectors.size == DIM
        assert info.config.params.vectors.distance.value == "Cosine"

    def test_tenant_and_filter_indexes_are_requested(self, tmp_path):
        # local mode accepts and ignores index settings, so record what would reach a server
        from qdrant_client import QdrantClient
        client = QdrantClient(path=str(tmp_path / "q"))
        requested = {}
        create = client.create_payload_index

        def record(collection, field_name, field_schema=None, **kw):
            requested[field_name] = (field_schema, kw.get("wait"))
            return create(collection, field_name, field_schema=field_schema, **kw)

        client.create_payload_index = record
        store = QdrantVectorStore(DIM, client=client)
        try:
            assert store.local
            bank, wait = requested.pop("bank_id")
            assert bank.is_tenant and bank.type.value == "keyword" and wait
            assert set(requested) == {"fact_type", "tags", "document_id", "occurred_start",
                                      "occurred_end"}
            assert {s.type.value for s, _ in requested.values()} == {"keyword", "float"}
            assert not any(s.enable_hnsw for s, _ in requested.values())
        finally:
            store.close()

    def test_same_payloads_and_cursors_as_edge(self, store, tmp_path):
        edge = open_vector_store(f"edge://{tmp_path}/edge", DIM)
        try:
            facts = corpus(n=11)
            edge.upsert(facts)
            store.upsert(facts)
            flt = Filters(types=("world",))
            assert store.get("a", [f.id for f in facts]) == edge.get("a", [f.id for f in facts])
            assert store.scroll("a", 4, filters=flt) == edge.scroll("a", 4, filters=flt)
        finally:
            edge.close()

    def test_closed_store_raises(self, tmp_path):
        s = self.make_store(tmp_path)
        s.close()
        s.close()
        with pytest.raises(RuntimeError):
            s.count("a")

    def test_concurrent_upserts_and_searches(self, store):
        facts = corpus(n=40)
        errors = []

        def work(part):
            try:
                store.upsert(part)
                store.search("a", part[0].embedding, k=3)
            except Exception as e:  # pragma: no cover - reported below
                errors.append(e)

        threads = [threading.Thread(target=work, args=(facts[i::4],)) for i in range(4)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        assert not errors and store.count("a") == 40


# ---- text: OpenSearch API on noida-db ------------------------------------------------------


class TestOpenSearchTextStore(TextStoreSuite):
    @pytest.fixture(autouse=True)
    def _server(self, noida):
        self.server = noida

    def make_store(self, path):
        return open_text_store(f"{self.server.url}?index={name_of(path, 'mneme-t-')}")

    def test_opened_by_url_is_opensearch(self, store):
        assert isinstance(store, OpenSearchTextStore)

    def test_index_has_english_text_and_keyword_filters(self, store):
        mapping = store.client.indices.get_mapping(index=store.index)[store.index]["mappings"]
        props = mapping["properties"]
        assert props["text"] == {"type": "text", "analyzer": "mneme_text"}  # english + CJK bigrams
        assert {props[f]["type"] for f in ("bank_id", "fact_type", "document_id", "tags")} == {
            "keyword"}
        template = store.client.indices.get_index_template(name=store.index)
        assert template["index_templates"][0]["index_template"]["index_patterns"] == [
            store.index]

    def test_reset_recreates_the_mapping(self, store):
        store.upsert([fact(1, "She paints landscapes")])
        store.reset()
        assert [h.id for h in store.search("a", "painting", k=5)] == []
        store.upsert([fact(1, "She paints landscapes")])
        assert [h.id for h in store.search("a", "painting", k=5)] == [fid("a", "text", 1)]

    def test_long_queries_are_clipped_not_rejected(self, store):
        store.upsert([fact(1, "needle in a haystack")])
        query = "needle " + " ".join(f"w{i}" for i in range(3000))
        assert [h.id for h in store.search("a", query, k=5)] == [fid("a", "text", 1)]

    def test_ties_are_broken_by_id(self, store):
        store.upsert([fact(i, "identical words") for i in range(5)])
        hits = store.search("a", "identical", k=5)
        assert [h.id for h in hits] == sorted(h.id for h in hits)

    def test_concurrent_upserts(self, store):
        facts = corpus(n=20)
        threads = [threading.Thread(target=store.upsert, args=(facts[i::4],)) for i in range(4)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        assert store.count("a") == 20


class TestOpenSearchTextStorePerBank(TestOpenSearchTextStore, PerBankStatistics):
    """The same contract with an index per bank (``?per_bank=1``)."""

    def make_store(self, path):
        return open_text_store(f"{self.server.url}?index={name_of(path, 'mneme-t-')}"
                               "&per_bank=1")

    def test_index_has_english_text_and_keyword_filters(self, store):
        assert store.per_bank
        store.upsert([fact(1, "She paints landscapes")])
        index = store.index_of("a")
        assert index == f"{store.index}-a"
        props = store.client.indices.get_mapping(index=index)[index]["mappings"]["properties"]
        assert props["text"] == {"type": "text", "analyzer": "mneme_text"}
        assert props["bank_id"]["type"] == "keyword"
        template = store.client.indices.get_index_template(name=store.index)
        assert template["index_templates"][0]["index_template"]["index_patterns"] == [
            f"{store.index}-*"]

    def test_a_bank_has_its_index_from_its_first_write_until_deleted(self, store):
        exists = store.client.indices.exists
        # reads and deletions of a bank never written make no index
        assert store.search("a", "paints", k=5) == [] and store.count("a") == 0
        store.delete("a", ["x"])
        store.delete_where("a", "doc")
        store.delete_where("a")
        assert not exists(index=f"{store.index}-a")
        store.upsert([fact(1, "She paints landscapes"), fact(2, "paints too", bank_id="b")])
        assert exists(index=f"{store.index}-a") and exists(index=f"{store.index}-b")
        store.delete_where("a")
        assert not exists(index=f"{store.index}-a") and store.count("a") == 0
        assert store.count("b") == 1
        store.upsert([fact(3, "paints again")])  # written again: a new index
        assert [h.id for h in store.search("a", "paints", k=5)] == [fid("a", "text", 3)]
        store.reset()
        assert store.count("a") == 0 and store.count("b") == 0
        assert store._bank_indexes() == []

    def test_an_invalid_bank_id_is_refused_for_writes_and_empty_for_reads(self, store):
        with pytest.raises(ValueError, match="bank id"):
            store.upsert([fact(1, "x", bank_id="Not_A/Bank")])
        assert store.search("Not_A/Bank", "x", k=5) == [] and store.count("*") == 0

    def test_a_bank_deleted_by_another_replica_is_written_again(self, store, tmp_path):
        other = self.make_store(tmp_path)  # a second replica on the same indexes
        try:
            store.upsert([fact(1, "first words")])
            other.delete_where("a")
            store.upsert([fact(2, "second words")])
            assert [h.id for h in other.search("a", "words", k=5)] == [fid("a", "text", 2)]
        finally:
            other.close()

    def test_reset_deletes_an_index_left_from_the_shared_layout(self, store, tmp_path):
        shared = open_text_store(f"{self.server.url}?index={store.index}")
        try:
            shared.upsert([fact(1, "text of a bank deleted later")])
        finally:
            shared.close()
        store.upsert([fact(2, "words", bank_id="b")])
        store.reset()
        assert not store.client.indices.exists(index=store.index)
        assert store._bank_indexes() == []

    def test_drop_deletes_every_bank_index_and_the_template(self, store):
        store.upsert([fact(1, "a words"), fact(2, "b words", bank_id="b")])
        store.drop()
        assert store._bank_indexes() == []
        assert not store.client.indices.exists_index_template(name=store.index)


# ---- graph: FalkorDB server over redis:// ----------------------------------------------------


class TestFalkorServerGraphStore(GraphStoreSuite):
    @pytest.fixture(autouse=True)
    def _server(self, falkordb):
        self.server = falkordb

    def make_store(self, path):
        return open_graph_store(f"{self.server.url}?graph={name_of(path, 'g')}")

    def test_opened_by_url_is_falkor_server(self, store):
        assert isinstance(store, FalkorServerGraphStore)

    def test_close_leaves_the_server_and_data(self, tmp_path):
        s = self.make_store(tmp_path)
        s.upsert(chain())
        s.close()
        s.close()
        with pytest.raises(RuntimeError):
            s.count("a")
        s2 = self.make_store(tmp_path)
        try:
            assert s2.count("a") == 5
        finally:
            s2.close()

    def test_hub_fanout_is_capped(self, tmp_path):
        s = FalkorServerGraphStore(f"{self.server.url}?graph={name_of(tmp_path, 'h')}",
                                   fanout=5)
        try:
            hub = EntityRef("e-hub", "Paris", "GPE")
            s.upsert([unit(f"h{i:02d}", entities=[hub]) for i in range(20)])
            assert 1 < len(s.spread("a", {"h00": 1.0}, [], k=50, hops=1)) <= 1 + 5
            assert len(s.spread("a", {}, [hub.id], k=50, hops=0)) == 5
        finally:
            s.close()

    def test_bank_delete_runs_in_batches(self, store, monkeypatch):
        import mneme.stores.graph_cypher as gc
        monkeypatch.setattr(gc, "DELETE_BATCH", 3)
        store.upsert(chain("a") + chain("b"))
        store.delete_where("a")
        assert store.count("a") == 0 and store.find_entities("a", ["alice"]) == []
        assert store.count("b") == 5


# ---- graph: the Neo4j adapter, its Cypher executed by the FalkorDB server -----------------


def importing_with(query: str) -> str:
    """Neo4j's ``CALL (a) {`` (what the adapter sends, :func:`cypher.scope_clause`) as
    the importing ``WITH`` the FalkorDB engine behind the double parses."""
    return re.sub(r"CALL \(([\w, ]+)\) \{\n", r"CALL {\n  WITH \1\n", query)


class TestNeo4jAdapterOverFalkor(GraphStoreSuite):
    """Neo4jGraphStore with a Bolt driver double forwarding to FalkorDB: the adapter's
    sessions, managed transactions, parameters and record handling, end to end. Not a
    test of Neo4j itself (none runs here)."""

    @pytest.fixture(autouse=True)
    def _server(self, falkordb):
        from falkordb import FalkorDB
        self.db = FalkorDB(host="127.0.0.1", port=falkordb.port)
        yield
        self.db.close()

    def make_store(self, path):
        graph = self.db.select_graph(name_of(path, "n"))
        driver = BoltDriverDouble(
            lambda q, p: graph.query(importing_with(q), p or None).result_set)
        return Neo4jGraphStore.from_url("neo4j://user:pw@neo4j.invalid:7687/memory",
                                        driver=driver)

    def test_subqueries_reach_neo4j_with_the_variable_scope_clause(self, store):
        store.upsert(chain())
        store.spread("a", {"u2": 1.0}, ["e-bob"], k=5)
        sent = [c.query for c in store.driver.calls if "CALL" in c.query]
        assert sent and all("CALL (e) {" in q and "WITH e\n" not in q for q in sent)

    def test_every_write_runs_in_a_write_transaction(self, store):
        store.upsert(chain())
        store.delete("a", ["u1"])
        store.delete_where("a", "d1")
        store.spread("a", {"u2": 1.0}, ["e-bob"], k=5)
        store.find_entities("a", ["bob"])
        store.reset()
        calls = store.driver.calls
        assert {c.database for c in calls} == {"memory"}
        assert [c.query for c in calls if c.mode == "auto"] == list(cypher.NEO4J_INDEXES)
        writes = {c.query for c in calls if c.mode == "write"}
        assert {cypher.UPSERT_UNITS, cypher.MERGE_MENTIONS, cypher.MARK_STUBS,
                cypher.DELETE_ALL} <= writes
        assert {c.query for c in calls if c.mode == "read"} >= {cypher.scope_clause(q) for q in (
            cypher.ENTITY_UNITS, cypher.ENTITY_NEIGHBOURS, cypher.FIND_ENTITIES)}

    def test_close_closes_the_driver(self, tmp_path):
        s = self.make_store(tmp_path)
        driver = s.driver
        s.close()
        s.close()
        assert driver.closed
        with pytest.raises(RuntimeError):
            s.count("a")


class _NoAutoCreateClient:
    """An OpenSearch client double for the one path noida-db cannot show: a cluster with
    ``action.auto_create_index`` off, where a bulk write to a deleted index fails."""

    def __init__(self):
        self.docs: dict[str, dict] = {}
        outer = self

        class Indices:
            def put_index_template(self, **kw):
                pass

            def exists(self, index):
                return index in outer.docs

            def create(self, index, body):
                outer.docs.setdefault(index, {})

            def delete(self, index):
                outer.docs.pop(index)

            def get(self, index):
                return {i: {} for i in outer.docs if i.startswith(index.rstrip("*"))}

        self.indices = Indices()

    def bulk(self, body, refresh):
        items = []
        for op, doc in zip(body[::2], body[1::2]):
            meta = op["index"]
            if meta["_index"] not in self.docs:
                items.append({"index": {"_index": meta["_index"], "_id": meta["_id"],
                                        "status": 404,
                                        "error": {"type": "index_not_found_exception"}}})
            else:
                self.docs[meta["_index"]][meta["_id"]] = doc
                items.append({"index": {"_index": meta["_index"], "status": 201}})
        return {"errors": any(i["index"]["status"] >= 300 for i in items), "items": items}

    def close(self):
        pass


def test_per_bank_write_recreates_an_index_another_replica_deleted():
    client = _NoAutoCreateClient()
    a = OpenSearchTextStore(client=client, per_bank=True, index="m")
    b = OpenSearchTextStore(client=client, per_bank=True, index="m")
    a.upsert([fact(1, "first words")])
    b.delete_where("a")  # another replica deletes the bank; `a` still has it cached
    assert "m-a" not in client.docs
    a.upsert([fact(2, "second words")])
    assert list(client.docs["m-a"]) == [f"a:{fid('a', 'text', 2)}"]
