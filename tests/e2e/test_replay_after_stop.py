"""``mneme replay`` of a data dir whose server stopped in the middle of consolidation.

consolidation writes each decision to its projection at once and commits the event's
offset with the decision's outputs (ObservationsChanged), which land at the log's end,
beyond that offset: a server stopped before consolidation has read its own outputs back
leaves a projection ahead of its group's offset. Nothing is damaged; the replay must
rebuild it (its outputs included) and switch without ``--force``. (Found: the replay
compared the projection built up to the offset, without those outputs, with the live
one and refused: "consolidation has (6595, 40, 40), live (6595, 6595, 41)".)"""

from __future__ import annotations

import threading

import pytest

from mneme.config import Settings

BANK = "stop"


def _stop_mid_consolidation(data_dir, monkeypatch, decided: int) -> None:
    """Run an embedded node; retain facts one retain at a time while consolidation is
    held; let it decide ``decided`` of them, and stop the node gracefully while it
    decides the last one."""
    from mneme.client import MnemeClient
    from mneme.events.v1 import events_pb2 as ev
    from mneme.runtime.embedded import bootstrap
    from services.consolidation.handlers import Consolidator

    handle, gate, calls, reached = Consolidator.handle, threading.Event(), [], threading.Event()

    def held(self, m, meta, decide=True):
        if decide and isinstance(m, ev.FactsExtracted):
            calls.append(meta.id)
            if len(calls) == decided:
                reached.set()
            if len(calls) >= decided:
                gate.wait(60)  # the stop is asked for while this event is decided
        return handle(self, m, meta, decide)

    monkeypatch.setattr(Consolidator, "handle", held)
    n = bootstrap(Settings(data_dir=data_dir))
    n.start()
    port = n.serve("127.0.0.1:0")
    with MnemeClient(f"127.0.0.1:{port}", timeout=120) as m:
        m.upsert_bank(BANK)
        for i in range(decided + 3):
            m.retain(BANK, [{"content": f"Alice met friend number {i} in Porto in May 2023."}])
        assert reached.wait(60)
    consumer = n.consumers["consolidation"]
    closing = threading.Thread(target=n.close)
    closing.start()
    while not consumer._stop.is_set():  # the stop is asked for: then the event ends
        closing.join(0.01)
    gate.set()
    closing.join(120)
    assert not closing.is_alive()
    monkeypatch.setattr(Consolidator, "handle", handle)
    return None


def test_replay_after_a_stop_in_the_middle_of_consolidation_switches(tmp_path, monkeypatch):
    """The stopped data dir's projection is ahead of consolidation's committed offset (its
    outputs are beyond it); the replay rebuilds the same projection and switches."""
    from mneme.bus import MEMORY
    from mneme.runtime.replay import replay
    from mneme.stores.observations_sqlite import SqliteObservationStore
    data = tmp_path / "data"
    _stop_mid_consolidation(data, monkeypatch, decided=3)
    live = SqliteObservationStore(str(data / "observations.db"))
    before = live.counts(BANK)
    live.close()
    assert before[1] == 3  # three facts decided before the stop
    # the state the defect needs: outputs of decided events beyond the group's offset
    from mneme.bootstrap import Root
    root = Root(Settings(data_dir=data))
    try:
        ends = {p: root.log.end_offset(MEMORY, p) for p in range(root.log.partitions(MEMORY))}
        behind = {p: ends[p] - root.log.committed("consolidation", MEMORY, p) for p in ends}
    finally:
        root.close()
    assert any(behind.values()), behind
    out = replay(Settings(data_dir=data))
    assert out["state"] == "LIVE", out
    after = SqliteObservationStore(str(data / f"observations.g{out['generation']}.db"))
    try:
        assert after.counts(BANK) == before
    finally:
        after.close()


def test_replay_after_a_kill_between_a_decision_and_its_commit_switches(tmp_path, monkeypatch):
    """A kill between consolidation's store transaction and the log's commit leaves the
    projection holding the decision of an event beyond its group's offset (the event
    comes again after a restart and gets the same decision): the replay switches, and a
    restart decides that event in the new generation."""
    from mneme.bus import MEMORY, partition_for
    from mneme.bus.codec import decode
    from mneme.bootstrap import Root
    from mneme.router import meta_of
    from mneme.runtime.replay import replay
    from mneme.stores.observations_sqlite import SqliteObservationStore
    from services.consolidation.handlers import Consolidator
    data = tmp_path / "data"
    _stop_mid_consolidation(data, monkeypatch, decided=3)
    root = Root(Settings(data_dir=data))
    try:
        p = partition_for(BANK, root.log.partitions(MEMORY))
        at = root.log.committed("consolidation", MEMORY, p)
        rec = next(r for r in root.log.read(MEMORY, p, at, limit=100)
                   if r.headers["ce_type"].endswith(".FactsExtracted"))
    finally:
        root.close()
    env = decode(rec)
    live = SqliteObservationStore(str(data / "observations.db"))
    try:  # what the killed process had done with it: decided, not committed on the log
        Consolidator(live, lambda b: None).handle(env.message, meta_of(env, rec))
        assert live.decision(meta_of(env, rec).id) is not None
        before = live.counts(BANK)
    finally:
        live.close()
    assert before[1] == 4
    out = replay(Settings(data_dir=data))
    assert out["state"] == "LIVE", out
    after = SqliteObservationStore(str(data / f"observations.g{out['generation']}.db"))
    try:
        assert after.counts(BANK)[1] == 3  # that decision is not on the log
    finally:
        after.close()


def test_replay_still_refuses_a_projection_the_log_does_not_hold(tmp_path, monkeypatch):
    """After the same stop, an observation written into the projection behind mneme's
    back is not explained by the log: the replay refuses to switch."""
    from mneme.events.v1 import events_pb2 as ev
    from mneme.runtime.replay import ReplayFailed, replay
    from mneme.stores.observations_sqlite import SqliteObservationStore
    data = tmp_path / "data"
    _stop_mid_consolidation(data, monkeypatch, decided=3)
    live = SqliteObservationStore(str(data / "observations.db"))
    try:
        live.apply(ev.ObservationsChanged(bank_id=BANK, observations=[ev.Observation(
            id="stray", version=1, text="written behind mneme's back")]))
    finally:
        live.close()
    with pytest.raises(ReplayFailed, match="consolidation has"):
        replay(Settings(data_dir=data))
