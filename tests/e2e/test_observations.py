"""Observations end to end through gRPC on a real ``mneme up`` (offline consolidation):
LoCoMo sessions → observations with verbatim evidence, evolving evidence keeps history,
no invented counts, document deletion invalidates observations (and recall never returns
them), scopes (per-tag, shared, exact filtering), and replay reproduces the observation
set byte for byte."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from mneme import locomo
from mneme.client import observation_scopes
from tests.e2e.server import Server, conversation_file
from tests.waits import drained

pytestmark = pytest.mark.slow

CONV = "conv-26"
SESSIONS = 3


def _conv() -> dict:
    for c in locomo.load(conversation_file()):
        if c["sample_id"] == CONV:
            return c
    pytest.skip(f"{CONV} not in {conversation_file()}")


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    data = tmp_path_factory.mktemp("obs") / "data"
    s = Server(data).start()
    with s.client() as m:
        m.upsert_bank("loco")
        for sess in locomo.sessions(_conv())[:SESSIONS]:
            r = m.retain("loco", sess.items)
            assert r.operation.state == 3
        assert m.consolidate("loco").state == 3  # ordered after the retains: all consolidated
    yield s
    s.stop()


def _memories(m, bank):
    return {x.id: x for x in m.list_memories(bank)}


def _check_evidence(m, bank):
    mems = _memories(m, bank)
    obs = list(m.list_observations(bank))
    for o in obs:
        assert o.proof_count == len({e.memory_id for e in o.evidence}) >= 1
        for e in o.evidence:
            assert e.memory_id in mems, f"{o.text!r} cites a memory that is gone"
            assert e.quote and e.quote in mems[e.memory_id].text
    return obs


def test_locomo_observations_have_verbatim_evidence(server):
    with server.client() as m:
        obs = _check_evidence(m, "loco")
        assert len(obs) >= 20
        assert any(o.proof_count >= 2 for o in obs)
        # listing memories and default recall leave observations out; types selects them
        assert all(x.fact_type != 3 for x in m.list_memories("loco"))
        r = m.recall("loco", "Caroline LGBTQ support group", max_tokens=2048)
        assert r.results and all(x.memory.fact_type != 3 for x in r.results)
        r = m.recall("loco", "Caroline LGBTQ support group", types=["observation"], max_tokens=2048)
        assert r.results and all(x.memory.fact_type == 3 for x in r.results)
        assert all("proof_count" in x.memory.metadata for x in r.results)
        scopes = m.list_observation_scopes("loco")
        assert sum(s.observations for s in scopes) == len(obs)


def test_evolving_evidence_keeps_history_and_never_counts(server):
    with server.client() as m:
        m.upsert_bank("evolve")
        m.retain("evolve", [{"content": "Alice likes coffee."}])
        m.retain("evolve", [{"content": "Alice prefers tea now, not coffee."}])
        m.retain("evolve", [{"content": "I have 2 dogs."}])
        m.retain("evolve", [{"content": "I have a dog named Rex."}])
        m.consolidate("evolve")
        obs = _check_evidence(m, "evolve")
        assert not any("3" in o.text or "three" in o.text.lower() for o in obs)
        tea = [o for o in obs if "tea" in o.text]
        assert tea, [o.text for o in obs]
        full = m.get_observation("evolve", tea[0].id)
        assert [h.text for h in full.history] == ["Alice likes coffee."]
        assert full.proof_count == 2


def test_delete_document_invalidates_observations(server):
    with server.client() as m:
        doc = f"{CONV}/session_2"
        gone = {x.id for x in m.list_memories("loco", document_id=doc)}
        assert gone
        cited = [o for o in m.list_observations("loco") if {e.memory_id for e in o.evidence} & gone]
        assert cited
        assert m.delete_document("loco", doc).state == 3
        assert m.consolidate("loco").state == 3
        obs = _check_evidence(m, "loco")
        assert not gone & {e.memory_id for o in obs for e in o.evidence}
        for q in ["Melanie charity race", "Caroline identity", "painting"]:
            r = m.recall("loco", q, types=["observation"], max_tokens=8192, budget="high")
            for x in r.results:
                full = m.get_observation("loco", x.memory.id)
                assert not gone & {e.memory_id for e in full.evidence}


def test_scopes_per_tag_shared_and_exact(server):
    with server.client() as m:
        m.upsert_bank("scopes")
        m.retain("scopes", [{"content": "Alice adopted a grey cat called Miso.",
                             "tags": ["alice", "pets"]}],
                 observation_scopes=observation_scopes("per_tag"))
        m.retain("scopes", [{"content": "Bob plays the cello in an orchestra.", "tags": ["bob"]}],
                 observation_scopes=observation_scopes("shared"))
        m.retain("scopes", [{"content": "Carol runs a bakery in Lisbon.", "tags": ["carol"]}])
        m.consolidate("scopes")
        scopes = {tuple(s.tags): s.observations for s in m.list_observation_scopes("scopes")}
        assert scopes == {(): 1, ("alice",): 1, ("carol",): 1, ("pets",): 1}
        r = m.recall("scopes", "who plays music", types=["observation"], tags=[], tags_match="exact")
        assert [x.memory.text for x in r.results] == ["Bob plays the cello in an orchestra."]
        r = m.recall("scopes", "cat", types=["observation"], tags=["pets"], tags_match="exact")
        assert [list(x.memory.tags) for x in r.results] == [["pets"]]
        assert [o.text for o in m.list_observations("scopes", scope=["carol"])] == \
            ["Carol runs a bakery in Lisbon."]
        # the facts keep their tags
        assert {tuple(x.tags) for x in m.list_memories("scopes")} == \
            {("alice", "pets"), ("bob",), ("carol",)}


def test_clear_reconsolidate_and_auto_consolidate_off(server, tmp_path):
    with server.client() as m:
        m.upsert_bank("life")
        r = m.retain("life", [{"content": "Alice loves hiking in the mountains."},
                              {"content": "Alice really enjoys mountain hiking."},
                              {"content": "Bob repaired his old bicycle on Sunday."}])
        m.consolidate("life")
        obs = list(m.list_observations("life"))
        assert sorted(o.proof_count for o in obs) == [1, 2]
        hike = next(o for o in obs if o.proof_count == 2)
        # clear one memory's observations: re-derived from all their sources, new ids
        m.clear_observations("life", hike.evidence[0].memory_id)
        again = {o.text: o for o in m.list_observations("life")}
        assert len(again) == 2 and hike.id not in {o.id for o in again.values()}
        assert max(o.proof_count for o in again.values()) == 2
        # clear all, then the pending facts are consolidated on request
        m.clear_observations("life")
        assert list(m.list_observations("life")) == []
        m.consolidate("life")
        assert len(list(m.list_observations("life"))) == 2
        # reconsolidate through the CLI: new events supersede the old observations
        before = {o.id for o in m.list_observations("life")}
        out = subprocess.run([str(Path(sys.executable).with_name("mneme")), "reconsolidate", "life",
                              "--address", server.address], capture_output=True, text=True)
        assert out.returncode == 0, out.stderr
        after = list(m.list_observations("life"))
        assert len(after) == 2 and not before & {o.id for o in after}
        # auto_consolidate off: new facts leave the scope's observations stale
        m.upsert_bank("life", auto_consolidate=False)
        m.retain("life", [{"content": "Alice hikes in the Alps every summer."}])
        # consolidation marks them stale after the retain returns (its own group)
        drained(m, "life")
        r = m.recall("life", "hiking", types=["observation"])
        assert r.results and all(x.memory.metadata["stale"] == "true" for x in r.results)
        assert all(o.stale for o in m.list_observations("life"))
        m.consolidate("life")
        assert not any(o.stale for o in m.list_observations("life"))


def test_replay_reproduces_observations_byte_for_byte(server):
    with server.client() as m:
        banks = ["loco", "evolve", "scopes", "life"]
        before = {b: [o.SerializeToString(deterministic=True) for o in m.list_observations(b)]
                  for b in banks}
    server.replay()
    with server.client() as m:
        after = {b: [o.SerializeToString(deterministic=True) for o in m.list_observations(b)]
                 for b in banks}
        assert after == before
        # the consolidation projection was rebuilt too: a new fact reinforces, no duplicate
        n = len(before["evolve"])
        m.retain("evolve", [{"content": "Alice prefers tea now, not coffee."}])
        m.consolidate("evolve")
        assert len(list(m.list_observations("evolve"))) == n


def test_distributed_reflects_remote_recall_finds_observations(server):
    """reflect → search over gRPC (the distributed reflect's recall, RemoteRecall) passes
    the types and tag scope it is asked for, so its search_observations port finds the
    bank's observations as the embedded one does."""
    from datetime import datetime, timezone

    from mneme.domain import Filters, RecallQuery
    from services.reflect.remote import RemoteRecall
    from services.search.observations import observation_search
    now = datetime.now(timezone.utc)
    remote = RemoteRecall(server.address)
    try:
        with server.client() as m:
            obs = {o.id for o in m.list_observations("loco")}
        assert obs
        out = remote(RecallQuery("loco", "Caroline support group", now,
                                 Filters(types=("observation",))))
        assert out.results and {s.fact.id for s in out.results} <= obs
        assert all(s.fact.fact_type == "observation" for s in out.results)
        found = observation_search(remote)("loco", "Caroline support group", now, 5)
        assert found and all(x.kind == "observation" and x.id in obs for x in found)
        facts = remote(RecallQuery("loco", "Caroline support group", now))
        assert facts.results and not {s.fact.id for s in facts.results} & obs
        none = remote(RecallQuery("loco", "Caroline support group", now,
                                  Filters(tags=("no-such-tag",), tags_match="all_strict")))
        assert none.results == []
    finally:
        remote.close()
