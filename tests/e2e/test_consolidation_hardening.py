"""Issue 9 items 10 and 12 (observation half) end to end through gRPC on a real
``mneme up`` (offline, no LLM):

* contradictions of a single-valued attribute (name, home city, employer) leave ONE
  current observation with the newer value and the old one in its history — also when
  the older statement is retained after the newer one — and replay reproduces it;
* observations carry the occurred span of their evidence, so ``time_range`` and the
  temporal arm of Recall find them by when their facts happened."""

from __future__ import annotations

from datetime import datetime, timezone

import pytest

from mneme.grpc_util import dt_to_ts
from mneme.v1 import memory_pb2, recall_pb2, resources_pb2
from tests.e2e.server import Server

pytestmark = pytest.mark.slow


def _at(y, m, d):
    return datetime(y, m, d, 12, tzinfo=timezone.utc)


OLD = [("My name is Anna.", _at(2023, 1, 5)), ("I live in Berlin.", _at(2023, 1, 6)),
       ("I work at Google.", _at(2023, 1, 7))]
NEW = [("Call me Hanna, not Anna.", _at(2023, 6, 5)),
       ("I moved to Lisbon, I live in Lisbon now.", _at(2023, 6, 6)),
       ("I now work at Microsoft.", _at(2023, 6, 7))]
EXPECTED = {"Call me Hanna, not Anna.": "My name is Anna.",
            "I moved to Lisbon, I live in Lisbon now.": "I live in Berlin.",
            "I now work at Microsoft.": "I work at Google."}


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    s = Server(tmp_path_factory.mktemp("contra") / "data").start()
    with s.client() as m:
        for bank, items in (("inorder", OLD + NEW), ("late", NEW + OLD)):
            m.upsert_bank(bank)
            for content, when in items:  # one retain each: every fact is decided on its own
                assert m.retain(bank, [{"content": content, "timestamp": when}]).operation.state == 3
            assert m.consolidate(bank).state == 3
        m.upsert_bank("times")
        m.retain("times", [{"content": "Alice adopted a grey cat called Miso.",
                            "timestamp": _at(2021, 5, 10)}])
        assert m.consolidate("times").state == 3
    yield s
    s.stop()


def _recall(m, bank, query, start=None, end=None, now=None):
    req = recall_pb2.RecallRequest(parent=f"banks/{bank}", query=query, max_tokens=4096,
                                   types=[resources_pb2.OBSERVATION], budget=recall_pb2.HIGH,
                                   query_timestamp=dt_to_ts(now))
    if start is not None:
        req.time_range.CopyFrom(memory_pb2.TimeRange(start=dt_to_ts(start), end=dt_to_ts(end)))
    return m.recall_stub.Recall(req, timeout=60)


@pytest.mark.parametrize("bank", ["inorder", "late"])
def test_contradiction_leaves_one_current_observation_with_history(server, bank):
    with server.client() as m:
        obs = list(m.list_observations(bank))
        # one observation per attribute, stating the newer value whatever the retain order
        assert {o.text: [h.text for h in o.history] for o in obs} == \
            {new: [old] for new, old in EXPECTED.items()}
        mems = {x.text: x.id for x in m.list_memories(bank)}
        for o in obs:
            full = m.get_observation(bank, o.id)
            old = EXPECTED[o.text]
            assert full.history[0].reason.startswith(f"was: {old}")
            assert {e.memory_id for e in full.evidence} == {mems[o.text], mems[old]}
            assert full.proof_count == 2
            # the API carries the occurred span of both facts (January … June)
            assert full.occurred_start.ToDatetime().date() == \
                next(w for t, w in OLD if t == old).date()
            assert full.occurred_end.ToDatetime().date() == \
                next(w for t, w in NEW if t == o.text).date()
        # recall of observations shows the new value only, never the old as current
        texts = [x.memory.text for x in _recall(m, bank, "Where do I live?").results]
        assert "I moved to Lisbon, I live in Lisbon now." in texts
        assert "I live in Berlin." not in texts


def test_time_range_and_temporal_arm_find_observations_by_evidence_time(server):
    with server.client() as m:
        (o,) = m.list_observations("times")
        assert o.occurred_start.ToDatetime() == datetime(2021, 5, 10)
        assert o.occurred_end.ToDatetime().date() == datetime(2021, 5, 10).date()
        inside = _recall(m, "times", "cat", _at(2021, 5, 1), _at(2021, 5, 31))
        assert [x.memory.id for x in inside.results] == [o.id]
        assert inside.results[0].memory.occurred_start.ToDatetime() == datetime(2021, 5, 10)
        assert not _recall(m, "times", "cat", _at(2022, 1, 1), _at(2022, 12, 31)).results
        assert not _recall(m, "times", "cat", _at(2021, 5, 11), _at(2021, 6, 30)).results
        # the temporal arm: "last May" asked in September 2021
        r = _recall(m, "times", "what happened last May?", now=_at(2021, 9, 1))
        hit = next(x for x in r.results if x.memory.id == o.id)
        assert hit.scores.temporal_rank >= 1
        r = _recall(m, "times", "what happened last May?", now=_at(2023, 9, 1))
        assert all(x.scores.temporal_rank == 0 for x in r.results)
        # the contradiction bank's observations span January … June 2023
        r = _recall(m, "inorder", "work", _at(2023, 3, 1), _at(2023, 3, 31))
        assert "I now work at Microsoft." in [x.memory.text for x in r.results]
        assert not _recall(m, "inorder", "work", _at(2024, 1, 1), _at(2024, 12, 31)).results


def test_replay_reproduces_revisions_without_deciding_again(server):
    banks = ["inorder", "late", "times"]
    with server.client() as m:
        before = {b: [o.SerializeToString(deterministic=True) for o in m.list_observations(b)]
                  for b in banks}
    server.replay()
    with server.client() as m:
        assert {b: [o.SerializeToString(deterministic=True) for o in m.list_observations(b)]
                for b in banks} == before
        # the rebuilt projection still decides: an old statement told again stays history
        m.retain("inorder", [{"content": "I work at Google.", "timestamp": _at(2023, 2, 1)}])
        assert m.consolidate("inorder").state == 3
        (job,) = [o for o in m.list_observations("inorder") if "work" in o.text]
        assert job.text == "I now work at Microsoft."
        assert [h.text for h in job.history] == ["I work at Google."]
