"""A replica assigned a partition restores its previous owner's decisions that lie
after the committed offset (:meth:`mneme.runtime.kafka.GroupRun.restore_steps`), found
by their derived ids. It looked for 8 outputs of each type per event only, so of a
consolidation change sent in more parts (split_change: one reconsolidation of a big
bank) the later parts were left out: the new owner decided on from half the change."""

from __future__ import annotations

from mneme.bus import MEMORY, codec
from mneme.events.v1 import events_pb2 as ev
from mneme.ports import Record
from mneme.router import Group, Router, Service
from mneme.runtime.kafka import Checkpoints, Delivery, GroupRun


class _Log:
    """One partition of ``records`` (OutRecords, offsets in order), committed up to
    ``committed``."""

    def __init__(self, records, committed: int):
        self.records = [Record(r.topic, 0, i, r.key, bytes(r.value), dict(r.headers))
                        for i, r in enumerate(records)]
        self._committed = committed

    def end_offset(self, topic, partition):
        return len(self.records)

    def committed(self, group, topic, partition):
        return self._committed

    def read(self, topic, partition, offset, limit=100):
        return self.records[offset:offset + limit]


def test_a_restore_applies_every_part_of_a_decision_after_the_committed_offset():
    seen: list = []

    def restore(m, meta, *, seen):
        seen.append((type(m).__name__, m.part))
        return []

    kinds = (ev.FactsExtracted, ev.ObservationsChanged)
    svc = Service("loop", groups=(Group(
        "loop", {MEMORY: dict.fromkeys(kinds, restore)},
        restore={MEMORY: dict.fromkeys(kinds, restore)}),),
        produces={MEMORY: (ev.ObservationsChanged,)})
    router = Router(svc, "loop", {"seen": seen})
    cause = codec.encode(ev.FactsExtracted(bank_id="b", operation_id="f1"), bank_id="b",
                         source="mneme/extraction")
    parts = 12
    decided = router.encode([ev.ObservationsChanged(bank_id="b", operation_id="f1", part=k,
                                                    parts=parts)
                             for k in range(1, parts + 1)], cause.headers["ce_id"])
    other = router.encode([ev.ObservationsChanged(bank_id="b", operation_id="x")], "else")
    log = _Log([cause, *decided, *other], committed=1)
    run = GroupRun(router, Delivery(), Router(svc, "loop", {"seen": seen}, restore=True),
                   log, Checkpoints())
    assert run.restore([0]) == 1 + parts
    assert seen == [("FactsExtracted", 0), *(("ObservationsChanged", k)
                                             for k in range(1, parts + 1))]
