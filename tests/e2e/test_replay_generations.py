"""Replay while serving (issue 15, item 3) against a real ``mneme up``: the search stores
are rebuilt from the log into a new generation while recall keeps answering and retains
keep arriving; the switch happens after the check; results are the same after it; a
cancelled replay and one whose check fails leave the live generation serving unchanged;
old generations are dropped on command (or after the grace); a restart keeps the
generation that was live."""

from __future__ import annotations

import json
import threading
import time
from datetime import datetime, timezone
from pathlib import Path

import grpc
import pytest

from mneme import locomo
from mneme.v1 import generations_pb2
from tests.e2e.server import Server, conversation_file

pytestmark = pytest.mark.slow

NOW = datetime(2024, 1, 1, tzinfo=timezone.utc)
BANK, OTHER = "conv-26", "during"
QUERIES = ["When did Melanie run a charity race?", "What is Caroline's identity?",
           "What did Melanie paint?", "Where did Caroline move from?",
           "What books has Melanie read?"]
G = generations_pb2.Generation


def _results(m, bank: str = BANK) -> dict:
    return {q: [(x.memory.id, round(x.scores.final, 6)) for x in
                m.recall(bank, q, max_tokens=2048, query_timestamp=NOW).results]
            for q in QUERIES}


def _settle(m, bank: str = BANK, timeout: float = 300) -> None:
    """Wait until every group has handled the bank's records (consolidation goes on
    after a sync retain returns, and its observations change recall's scores)."""
    end = time.monotonic() + timeout
    while m.bank_stats(bank).pending_records and time.monotonic() < end:
        time.sleep(0.2)
    assert not m.bank_stats(bank).pending_records


def _state(data_dir: Path) -> dict:
    return json.loads((data_dir / "generations.json").read_text())


def _consolidation(path: Path, bank: str = BANK) -> tuple[tuple, list[bytes]]:
    """consolidation's projection in one generation's file, read beside the server:
    (facts, consolidated, observation states) and every observation state's bytes."""
    from mneme.stores.observations_sqlite import SqliteObservationStore
    assert path.exists(), path
    s = SqliteObservationStore(str(path))  # SQLite in WAL mode: a reader beside the writer
    try:
        return s.counts(bank), s.dump(bank)
    finally:
        s.close()


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    data = tmp_path_factory.mktemp("gen") / "data"
    # retired generations stay until dropped by command here (deleted after the grace
    # otherwise: tests/e2e/test_erasure.py)
    s = Server(data, env={"MNEME_RETIRE_GRACE_S": "3600"}).start()
    conv = next(c for c in locomo.load(conversation_file()) if c["sample_id"] == BANK)
    with s.client() as m:
        m.upsert_bank(BANK)
        m.upsert_bank(OTHER)
        for sess in locomo.sessions(conv)[:6]:
            assert m.retain(BANK, sess.items).operation.state == 3
        _settle(m)
    yield s
    s.stop()


def _during(server, work, *tasks) -> None:
    """Run ``work()`` while each of ``tasks(stop)`` runs in a thread of its own."""
    stop = threading.Event()
    threads = [threading.Thread(target=t, args=(stop,)) for t in tasks]
    for t in threads:
        t.start()
    try:
        time.sleep(1.0)
        work()
        time.sleep(1.0)
    finally:
        stop.set()
        for t in threads:
            t.join(120)


def test_replay_while_serving_switches_to_an_equal_generation(server):
    with server.client() as m:
        before = _results(m)
        errors, recalls, retained, out = [], [0], [], {}

        def read(stop) -> None:  # recall must answer throughout, the switch included
            with server.client(timeout=60) as c:
                while not stop.is_set():
                    try:
                        assert c.recall(BANK, QUERIES[0], query_timestamp=NOW).results
                        recalls[0] += 1
                    except Exception as e:  # noqa: BLE001 - every failure is a finding
                        errors.append(repr(e))

        def write(stop) -> None:  # writes during a replay land in the generation that wins
            with server.client(timeout=120) as c:
                n = 0
                while not stop.is_set():
                    r = c.retain(OTHER, [{"content": f"Visitor {n} came to Lisbon on day {n}."}])
                    assert r.operation.state == 3
                    retained.append(n)
                    n += 1

        _during(server, lambda: out.setdefault(2, m.replay(poll_s=0.2)), read)
        g = out[2]
        assert g.state == G.LIVE, g
        assert g.generation == 2 and not g.check.problems
        assert g.check.banks == 2 and g.check.recalls > 0 and g.check.agreement >= 0.8
        assert errors == [] and recalls[0] > 5
        assert _results(m) == before
        # consolidation's projection is part of the generation: rebuilt from the recorded
        # decisions into its own file, the same state byte for byte
        d = server.data_dir
        counts, states = _consolidation(d / "observations.g2.db")
        assert counts[0] > 0 and counts[2] > 0 and states
        assert _consolidation(d / "observations.db") == (counts, states)

        # With retains arriving throughout, every one acknowledged before, during and after
        # the switch is in the live generation exactly once (the live group went on from
        # its own offsets). (BM25's statistics span banks, so the new bank's texts move
        # the other bank's scores: the comparisons below start from here.)
        _during(server, lambda: out.setdefault(3, m.replay(poll_s=0.2)), read, write)
        g = out[3]
        assert g.state == G.LIVE and g.generation == 3 and not g.check.problems, g
        assert errors == [] and retained
        texts = [x.text for x in m.list_memories(OTHER)]
        assert sorted(texts) == sorted(f"Visitor {n} came to Lisbon on day {n}." for n in retained)
        before = _results(m)
        gens = {x.generation: x.state for x in m.list_generations()}
        assert gens == {1: G.RETIRED, 2: G.RETIRED, 3: G.LIVE}
        assert _state(server.data_dir)["live"] == 3
        assert (server.data_dir / "vectors.g3").is_dir() and any(server.data_dir.glob("graph.g3.db*"))
        _settle(m, OTHER)
        assert _consolidation(d / "observations.g3.db", OTHER)[0][0] == len(retained)

        # The live generation cannot be dropped; the retired ones can, and they are gone.
        with pytest.raises(grpc.RpcError) as e:
            m.delete_generation(3)
        assert e.value.code() == grpc.StatusCode.FAILED_PRECONDITION
        m.delete_generation(1)
        m.delete_generation(2)
        assert not (server.data_dir / "vectors").exists()
        assert not (server.data_dir / "text").exists() and not any(server.data_dir.glob("graph.db*"))
        assert not (server.data_dir / "vectors.g2").exists()
        assert not any(server.data_dir.glob("graph.g2.db*"))
        assert not any(d.glob("observations.db*")) and not any(d.glob("observations.g2.db*"))
        assert [x.generation for x in m.list_generations()] == [3]
        assert _results(m) == before
        with pytest.raises(grpc.RpcError) as e:
            m.get_generation(1)
        assert e.value.code() == grpc.StatusCode.NOT_FOUND
        with pytest.raises(grpc.RpcError) as e:
            m.generations.GetGeneration(generations_pb2.GetGenerationRequest(name="generation/x"))
        assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "name" in e.value.details()

    # A restart opens the generation that was live, consolidation's projection included,
    # and consolidation goes on deciding into it.
    consolidated = _consolidation(d / "observations.g3.db")
    server.stop()
    server.start()
    with server.client() as m:
        assert _results(m) == before
        r = m.retain(BANK, [{"content": "Melanie adopted a grey cat named Pixel in 2024."}])
        assert any("Pixel" in x.memory.text for x in
                   m.recall(BANK, "What is the name of Melanie's cat?").results)
        _settle(m)
        before = _results(m)
        (facts, done, _), _ = _consolidation(d / "observations.g3.db")
        assert facts == consolidated[0][0] + len(r.memory_ids)
        assert done - consolidated[0][1] == len(r.memory_ids)  # decided in generation 3
        assert not (d / "observations.db").exists()

    # An offline replay (server stopped) builds generation 4 the same way; nothing reads
    # the generation it retires, so its files are deleted when the replay ends.
    server.replay()
    with server.client() as m:
        assert _results(m) == before
        assert {x.generation: x.state for x in m.list_generations()} == {4: G.LIVE}
    assert not (d / "vectors.g3").exists() and not any(d.glob("observations.g3.db*"))
    assert (d / "vectors.g4").is_dir() and (d / "observations.g4.db").exists()


def test_a_cancelled_replay_leaves_the_live_generation_serving(server):
    with server.client() as m:
        before = _results(m)
        live = _state(server.data_dir)["live"]
        g = m.replay(wait=False)
        assert g.state == G.BUILDING
        # A second replay is refused while one runs.
        with pytest.raises(grpc.RpcError) as e:
            m.replay(wait=False)
        assert e.value.code() == grpc.StatusCode.FAILED_PRECONDITION
        m.delete_generation(g.generation)  # cancels it halfway
        assert _results(m) == before
        assert _state(server.data_dir)["live"] == live
        assert g.generation not in {x.generation for x in m.list_generations()}
        assert not (server.data_dir / f"vectors.g{g.generation}").exists()
        assert not any(server.data_dir.glob(f"graph.g{g.generation}.db*"))


@pytest.fixture
def node(tmp_path):
    """An embedded node in this process (its stores can be damaged or made to fail)."""
    from mneme.client import MnemeClient
    from mneme.config import Settings
    from mneme.runtime.embedded import bootstrap
    n = bootstrap(Settings(data_dir=tmp_path / "data"))
    n.start()
    port = n.serve("127.0.0.1:0")
    n.client = m = MnemeClient(f"127.0.0.1:{port}", timeout=120)
    m.upsert_bank("b")
    m.retain("b", [{"content": f"Alice met friend number {i} in Porto in May 2023."}
                   for i in range(30)])
    _settle(m, "b")
    yield n
    n.client.close()
    n.close()


def _ids(m) -> list[list[str]]:
    return [[x.memory.id for x in m.recall("b", q, query_timestamp=NOW).results]
            for q in ("Who did Alice meet?", "Where was Alice in May 2023?")]


def test_a_replay_that_would_lose_units_does_not_switch_unless_forced(node):
    """A unit the live generation holds but the log does not (written to the store
    behind mneme's back) would be lost by the switch: the check refuses it and the live
    generation stays; forced, the switch happens and the stray unit is gone."""
    import dataclasses
    m, live = node.client, node.stores.vectors
    n = live.count("b")
    (first,), _ = live.scroll("b", 1)
    (full,) = live.get("b", [first.id], with_vectors=True)
    stray = dataclasses.replace(full, id="00000000-0000-4000-8000-000000000001")
    live.target.upsert([stray])
    before = _ids(m)
    g = m.replay()
    assert g.state == G.FAILED, g
    assert f"vector store has {n} units, live {n + 1}" in g.error
    assert list(g.check.problems) and live.count("b") == n + 1 and _ids(m) == before
    assert _state(node.settings.data_dir)["live"] == 1
    assert not (node.settings.data_dir / "vectors.g2").exists()
    g = m.replay(force=True)
    assert g.state == G.LIVE and g.generation == 3, g
    assert live.count("b") == n and not live.get("b", [stray.id])


def test_a_replay_repairs_what_the_live_generation_lost(node):
    """Units the live generation lost (or never projected: dead letters) are on the log:
    the new generation has them back, the check counts the bank as gained, not as a
    problem, and the switch happens."""
    m, live = node.client, node.stores.vectors
    n = live.count("b")
    (first,), _ = live.scroll("b", 1)
    live.target.delete("b", [first.id])  # damage the live generation's vector store
    g = m.replay()
    assert g.state == G.LIVE and not g.check.problems and g.check.gained == 1, g
    assert live.count("b") == n and live.get("b", [first.id])


def _observation_store(node):
    return next(p for p in node.parts if p.name == "consolidation").api["observations"]


def test_consolidation_state_the_log_does_not_hold_stops_the_switch_unless_forced(node):
    """consolidation's projection is checked like search's stores: an observation state
    written behind mneme's back would be lost by the switch, so the replay does not
    switch (naming consolidation); forced, it switches and the stray state is gone, and
    the new generation's file serves."""
    from mneme.events.v1 import events_pb2 as ev
    obs = _observation_store(node)
    counts = obs.counts("b")
    obs.target.apply(ev.ObservationsChanged(bank_id="b", observations=[ev.Observation(
        id="stray", version=1, text="written behind mneme's back")]))
    g = node.client.replay()
    assert g.state == G.FAILED and "consolidation has" in g.error, g
    assert obs.counts("b") == (counts[0], counts[1], counts[2] + 1)
    data = node.settings.data_dir
    assert not any(data.glob("observations.g2.db*")) and (data / "observations.db").exists()
    g = node.client.replay(force=True)
    assert g.state == G.LIVE and g.generation == 3, g
    assert obs.counts("b") == counts and "stray" not in obs.observations("b", include_deleted=True)
    assert obs.target is not None and Path(obs.target._db.execute(
        "PRAGMA database_list").fetchone()[2]) == data / "observations.g3.db"


def test_a_replay_repairs_what_consolidation_lost_and_it_decides_on(node):
    """Facts consolidation's live projection lost are on the log: the new generation has
    them back, and the facts retained after the switch are decided in it."""
    obs, m = _observation_store(node), node.client
    counts = obs.counts("b")
    lost = [f.id for f, _ in obs.facts("b")][:5]
    obs.target.delete_facts("b", lost)
    g = m.replay()
    assert g.state == G.LIVE and not g.check.problems, g
    assert obs.counts("b") == counts and len(obs.facts_by_id("b", lost)) == 5
    r = m.retain("b", [{"content": "Alice met friend number 99 in Braga in June 2023."}])
    _settle(m, "b")
    assert obs.counts("b")[:2] == (counts[0] + len(r.memory_ids), counts[1] + len(r.memory_ids))


def test_a_replay_failing_halfway_leaves_the_live_generation_serving(node, monkeypatch):
    """The new generation's vector store fails after a few writes (a full disk): the
    replay ends FAILED with the store's error, the live generation serves and keeps
    projecting as before, and a later replay succeeds."""
    from mneme.bootstrap import Root
    from mneme.runtime.live_replay import WriteBehind
    m = node.client
    m.retain("b", [{"content": f"Bob rowed boat number {i} on the Douro."} for i in range(12)])
    _settle(m, "b")
    before = _ids(m)
    opened = Root.open_stores

    class FullDisk:
        def __init__(self, store) -> None:
            self.store, self.writes = store, 0

        def __getattr__(self, name):
            return getattr(self.store, name)

        def upsert(self, *a, **k):
            self.writes += 1
            if self.writes > 1:
                raise OSError(28, "No space left on device")
            return self.store.upsert(*a, **k)

    def failing(self, generation):
        stores = opened(self, generation)
        stores.vectors = FullDisk(stores.vectors)
        return stores
    monkeypatch.setattr(Root, "open_stores", failing)
    # the builder buffers a batch's writes (WriteBehind): write every 2 units, so the
    # store sees several writes and fails in the middle of the log
    monkeypatch.setattr(WriteBehind, "limit", 2)
    g = m.replay()
    assert g.state == G.FAILED, g
    assert "No space left on device" in g.error
    assert _state(node.settings.data_dir)["live"] == 1 and _ids(m) == before
    # The live group was released: a write after the failed replay is projected at once.
    m.retain("b", [{"content": "Carol sang fado in Lisbon on 2023-06-01."}])
    assert "fado" in m.recall("b", "Who sang fado?").results[0].memory.text
    monkeypatch.undo()
    assert m.replay().state == G.LIVE
    assert "fado" in m.recall("b", "Who sang fado?").results[0].memory.text
