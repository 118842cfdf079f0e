"""Contract of :class:`mneme.ports.EventLog`, written once and run against every adapter
(the embedded SQLite log, Kafka on tansu). Subclass :class:`EventLogSuite` per adapter:

* a ``place`` fixture: where the log lives (a file path, a broker URL); two logs made on
  the same place see the same records and group offsets (reopen / second process);
* ``make_log(place)``: a new adapter instance on ``place``;
* ``ATOMIC_COMMIT`` and ``crash_after_outputs(log, monkeypatch)``: see
  :meth:`EventLogSuite.test_crash_between_outputs_and_offsets`.

Only the port's methods are used (append, read, partitions, end_offset, committed,
commit, reset_group, ensure_topic, close); every test names its own topics and groups,
so the suite also runs on a broker shared by the whole session.
"""

from __future__ import annotations

import uuid

import pytest

from mneme.bus import StaleCommitError, partition_for
from mneme.ports import EventLog, OutRecord, Record


def _name(kind: str) -> str:
    return f"contract.{kind}.{uuid.uuid4().hex[:8]}"


def rec(topic: str, key: str, value: str, **headers: str) -> OutRecord:
    return OutRecord(topic, key, value.encode(), {"ce_id": f"{key}:{value}", **headers})


def read_all(log: EventLog, topic: str, partition: int, offset: int = 0) -> list[Record]:
    """Every record of (topic, partition) from ``offset`` to the end, in small pages (so
    paging by the returned offsets is exercised too)."""
    out: list[Record] = []
    while True:
        page = log.read(topic, partition, offset, limit=3)
        if not page:
            return out
        out.extend(page)
        offset = page[-1].offset + 1


def same(r: Record, o: OutRecord) -> bool:
    return (r.topic, r.key, r.value, r.headers) == (o.topic, o.key, o.value, o.headers)


def essence(r: Record) -> tuple:
    """What a re-read must reproduce exactly (the timestamp too: it is the append's)."""
    return (r.topic, r.partition, r.offset, r.key, r.value, r.headers, r.timestamp)


class EventLogSuite:
    #: The log knows consumer-group membership (Kafka), so ``groups(live_only=True)``
    #: leaves out groups without members.
    KNOWS_MEMBERS = False
    #: True when ``commit`` appends its outputs and moves the offsets in one transaction
    #: (exactly once); False when it produces first and commits after (at least once).
    ATOMIC_COMMIT: bool

    @pytest.fixture
    def place(self):  # pragma: no cover - abstract
        raise NotImplementedError

    def make_log(self, place) -> EventLog:  # pragma: no cover - abstract
        raise NotImplementedError

    def crash_after_outputs(self, log: EventLog, monkeypatch) -> None:  # pragma: no cover
        """Make ``log``'s next ``commit`` fail after writing its outputs and before moving
        the offsets, raising RuntimeError("simulated crash") (a process dying there)."""
        raise NotImplementedError

    @pytest.fixture
    def log(self, place):
        lg = self.make_log(place)
        yield lg
        lg.close()

    # -- ordering per key ----------------------------------------------------------

    def test_one_key_one_partition_in_append_order(self, log):
        t = _name("order")
        log.ensure_topic(t, 4)
        log.ensure_topic(t, 2)  # an existing topic keeps its partitions
        assert log.partitions(t) == 4
        keys = [f"bank-{i}" for i in range(8)]
        # interleaved keys, over several appends: order must hold per key across calls
        batches = [[rec(t, k, f"{k}/{n}", n=str(n)) for k in keys] for n in range(4)]
        appended = [r for b in batches for r in log.append(b)]
        sent = [o for b in batches for o in b]
        assert all(same(r, o) for r, o in zip(appended, sent)) and len(appended) == len(sent)
        for r in appended:
            assert r.partition == partition_for(r.key, 4), r
        for k in keys:
            mine = [r for r in appended if r.key == k]
            assert len({r.partition for r in mine}) == 1
            assert [r.offset for r in mine] == sorted(r.offset for r in mine)
        total = 0
        for p in range(4):
            got = read_all(log, t, p)
            expected = [r for r in appended if r.partition == p]
            # dense offsets from 0, in append order, each record as appended
            assert [r.offset for r in got] == list(range(len(got)))
            assert [(r.key, r.value, r.headers) for r in got] == \
                [(r.key, r.value, r.headers) for r in expected]
            assert [r.offset for r in got] == [r.offset for r in expected]
            assert log.end_offset(t, p) == len(got)
            for k in {r.key for r in got}:
                assert [r.value for r in got if r.key == k] == \
                    [f"{k}/{n}".encode() for n in range(4)]
            total += len(got)
        assert total == len(sent)
        # reading from the middle and past the end
        p = appended[0].partition
        assert [r.offset for r in log.read(t, p, 1, limit=2)] == [1, 2]
        assert log.read(t, p, log.end_offset(t, p)) == []

    # -- group offsets -------------------------------------------------------------

    def test_group_offsets_are_per_group_and_per_partition(self, log):
        t, g1, g2 = _name("groups"), _name("g1"), _name("g2")
        log.ensure_topic(t, 2)
        log.append([rec(t, f"k{i}", str(i)) for i in range(12)])
        assert all(log.end_offset(t, p) > 2 for p in range(2))
        assert log.committed(g1, t, 0) == 0 and log.committed(g1, t, 1) == 0
        assert log.committed(_name("never"), t, 0) == 0

        log.commit(g1, {(t, 0): 2, (t, 1): 1})
        log.commit(g2, {(t, 1): 3})
        assert (log.committed(g1, t, 0), log.committed(g1, t, 1)) == (2, 1)
        assert (log.committed(g2, t, 0), log.committed(g2, t, 1)) == (0, 3)
        log.commit(g1, {(t, 1): 2})  # moves one partition only
        assert (log.committed(g1, t, 0), log.committed(g1, t, 1)) == (2, 2)
        assert log.committed(g2, t, 1) == 3
        # the committed offset is the next to read
        assert log.read(t, 0, log.committed(g1, t, 0))[0].offset == 2
        # the log lists the groups that committed (a replica's stats find its peers)
        listed = log.groups()
        assert {g1, g2} <= set(listed) and listed == sorted(listed)
        assert _name("never") not in listed
        # no member of either group runs: neither is live where the log knows members
        live = log.groups(live_only=True)
        assert ({g1, g2} <= set(live)) == (not self.KNOWS_MEMBERS)

    # -- commit with outputs -------------------------------------------------------

    def test_commit_with_outputs(self, log):
        src, dst, g = _name("in"), _name("out"), _name("g")
        log.ensure_topic(src, 1)
        log.ensure_topic(dst, 3)
        log.append([rec(src, "bank-a", str(i)) for i in range(3)])
        handled = log.read(src, 0, 0, limit=2)
        outs = [rec(dst, "bank-a", "A", traceparent="00-" + "1" * 32 + "-" + "2" * 16 + "-01"),
                rec(dst, "bank-b", "B"), rec(dst, "bank-a", "A2")]
        made = log.commit(g, {(src, 0): handled[-1].offset + 1}, produce=outs)
        # on return: the offset is committed and every output is readable
        assert log.committed(g, src, 0) == 2
        assert len(made) == 3 and all(same(r, o) for r, o in zip(made, outs))
        for r, o in zip(made, outs):
            assert r.partition == partition_for(r.key, 3)
            [back] = log.read(dst, r.partition, r.offset, limit=1)
            assert same(back, o) and back.offset == r.offset
        a = [r for r in made if r.key == "bank-a"]
        assert a[0].partition == a[1].partition and a[1].offset == a[0].offset + 1
        assert sum(log.end_offset(dst, p) for p in range(3)) == 3
        # a commit without outputs produces nothing
        assert log.commit(g, {(src, 0): 3}) == []
        assert log.committed(g, src, 0) == 3
        assert sum(log.end_offset(dst, p) for p in range(3)) == 3

    # -- replay from 0 -------------------------------------------------------------

    def test_reset_group_replays_from_zero(self, log):
        t, other, g, g2 = _name("replay"), _name("keep"), _name("g"), _name("g2")
        log.ensure_topic(t, 2)
        log.ensure_topic(other, 1)
        sent = [rec(t, f"k{i % 3}", str(i), n=str(i)) for i in range(9)]
        log.append(sent)
        log.append([rec(other, "k", "x")])
        first = {p: read_all(log, t, p) for p in range(2)}
        assert sum(map(len, first.values())) == 9
        log.commit(g, {(t, p): len(first[p]) for p in range(2)} | {(other, 0): 1})
        log.commit(g2, {(t, 0): 1})
        assert all(log.read(t, p, log.committed(g, t, p)) == [] for p in range(2))

        log.reset_group(g, [t])
        assert [log.committed(g, t, p) for p in range(2)] == [0, 0]
        assert log.committed(g, other, 0) == 1   # only the topics named
        assert log.committed(g2, t, 0) == 1      # only the group named
        again = {p: read_all(log, t, p, log.committed(g, t, p)) for p in range(2)}
        assert {p: [essence(r) for r in rs] for p, rs in again.items()} == \
            {p: [essence(r) for r in rs] for p, rs in first.items()}
        replayed = sorted((r for rs in again.values() for r in rs),
                          key=lambda r: int(r.headers["n"]))
        assert [(r.key, r.value, r.headers) for r in replayed] == \
            [(o.key, o.value, o.headers) for o in sent]
        # after a reset the group commits forward from 0 again, outputs included
        log.commit(g, {(t, 0): 1}, produce=[rec(other, "k", "y")])
        assert log.committed(g, t, 0) == 1

    # -- stale-commit guard --------------------------------------------------------

    def test_stale_commit_is_refused_and_writes_nothing(self, log):
        src, dst, g = _name("in"), _name("out"), _name("g")
        log.ensure_topic(src, 2)
        log.ensure_topic(dst, 1)
        log.append([rec(src, f"k{i}", str(i)) for i in range(10)])
        log.commit(g, {(src, 0): 3}, produce=[rec(dst, "k", "first")])
        assert log.end_offset(dst, 0) == 1

        def unchanged() -> None:
            assert (log.committed(g, src, 0), log.committed(g, src, 1)) == (3, 0)
            assert log.end_offset(dst, 0) == 1
            assert [r.value for r in read_all(log, dst, 0)] == [b"first"]

        # the same offset again with outputs: those records were already handled and
        # their outputs produced, so producing again would duplicate them
        with pytest.raises(StaleCommitError):
            log.commit(g, {(src, 0): 3}, produce=[rec(dst, "k", "dup")])
        unchanged()
        with pytest.raises(StaleCommitError):  # below the stored offset, with outputs
            log.commit(g, {(src, 0): 2}, produce=[rec(dst, "k", "dup")])
        unchanged()
        with pytest.raises(StaleCommitError):  # below it without: offsets never go back
            log.commit(g, {(src, 0): 1})
        unchanged()
        # one stale partition refuses the whole commit: the fresh one does not move
        with pytest.raises(StaleCommitError):
            log.commit(g, {(src, 1): 4, (src, 0): 3}, produce=[rec(dst, "k", "dup")])
        unchanged()
        with pytest.raises(ValueError):
            log.commit(g, {(src, 0): -1})
        unchanged()
        # another group is not affected, and re-committing the same offset without
        # outputs is an idempotent no-op
        log.commit(_name("g2"), {(src, 0): 1}, produce=[rec(dst, "k", "other")])
        assert log.end_offset(dst, 0) == 2
        assert log.commit(g, {(src, 0): 3}) == []
        assert log.committed(g, src, 0) == 3
        # moving forward with outputs is fine; reset_group is the only way back
        log.commit(g, {(src, 0): 4, (src, 1): 1}, produce=[rec(dst, "k", "second")])
        assert (log.committed(g, src, 0), log.committed(g, src, 1)) == (4, 1)
        log.reset_group(g, [src])
        log.commit(g, {(src, 0): 1}, produce=[rec(dst, "k", "replayed")])
        assert log.committed(g, src, 0) == 1
        assert [r.value for r in read_all(log, dst, 0)] == \
            [b"first", b"other", b"second", b"replayed"]

    # -- redelivery after a crash ----------------------------------------------------

    def test_uncommitted_records_are_read_again_after_a_crash(self, place):
        src, dst, g = _name("in"), _name("out"), _name("g")
        a = self.make_log(place)
        try:
            a.ensure_topic(src, 2)
            a.ensure_topic(dst, 1)
            sent = [rec(src, "bank-a", str(i), n=str(i)) for i in range(6)]
            appended = a.append(sent)
            p = appended[0].partition
            start = a.committed(g, src, p)
            assert start == 0
            done = a.read(src, p, start, limit=2)
            a.commit(g, {(src, p): done[-1].offset + 1},
                     produce=[rec(dst, "bank-a", f"out-{r.value.decode()}") for r in done])
            in_hand = a.read(src, p, a.committed(g, src, p), limit=3)
            assert [r.offset for r in in_hand] == [2, 3, 4]
        finally:
            a.close()  # the process dies with records 2..4 handled but not committed

        b = self.make_log(place)
        try:
            assert b.committed(g, src, p) == 2
            again = read_all(b, src, p, b.committed(g, src, p))
            assert [essence(r) for r in again[:3]] == [essence(r) for r in in_hand]
            assert [r.offset for r in again] == [2, 3, 4, 5]
            assert all(same(r, o) for r, o in zip(again, sent[2:]))
            b.commit(g, {(src, p): again[-1].offset + 1},
                     produce=[rec(dst, "bank-a", f"out-{r.value.decode()}") for r in again])
            assert b.committed(g, src, p) == 6 and b.read(src, p, 6) == []
            # every input's output exactly once: the crash lost nothing committed
            assert [r.value for r in read_all(b, dst, 0)] == \
                [f"out-{i}".encode() for i in range(6)]
        finally:
            b.close()

    def test_crash_between_outputs_and_offsets(self, place, monkeypatch):
        """A process dying inside ``commit``, after its outputs are written and before
        the offsets move. The adapters honestly differ here, so the expectation is
        parametrized by ``ATOMIC_COMMIT``: the embedded log writes both in one SQLite
        transaction, so nothing of the commit survives and the redelivery produces the
        outputs once (exactly once); Kafka has no transactions on this path (and tansu
        none at all): the outputs are on the log, the offset is not committed, so the
        redelivery produces them a second time (at least once; consumers dedupe by the
        deterministic ``ce_id``)."""
        src, dst, g = _name("in"), _name("out"), _name("g")
        a = self.make_log(place)
        try:
            a.ensure_topic(src, 1)
            a.ensure_topic(dst, 1)
            a.append([rec(src, "bank-a", str(i)) for i in range(3)])
            got = a.read(src, 0, 0)
            outs = [rec(dst, "bank-a", f"out-{r.value.decode()}") for r in got]
            self.crash_after_outputs(a, monkeypatch)
            with pytest.raises(RuntimeError, match="simulated crash"):
                a.commit(g, {(src, 0): 3}, produce=outs)
            monkeypatch.undo()
        finally:
            a.close()

        b = self.make_log(place)
        try:
            assert b.committed(g, src, 0) == 0
            left = [r.headers["ce_id"] for r in read_all(b, dst, 0)]
            assert left == ([] if self.ATOMIC_COMMIT else [o.headers["ce_id"] for o in outs])
            redelivered = read_all(b, src, 0, b.committed(g, src, 0))
            assert [essence(r) for r in redelivered] == [essence(r) for r in got]
            b.commit(g, {(src, 0): 3},
                     produce=[rec(dst, "bank-a", f"out-{r.value.decode()}") for r in redelivered])
            ids = [r.headers["ce_id"] for r in read_all(b, dst, 0)]
            once = [o.headers["ce_id"] for o in outs]
            assert ids == (once if self.ATOMIC_COMMIT else once + once)
            assert b.committed(g, src, 0) == 3
        finally:
            b.close()
