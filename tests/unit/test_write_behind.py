"""The replay builder's write-behind buffer (mneme.runtime.live_replay.WriteBehind):
writes wait for the consumer's flush, are applied in order, and reads see them."""

import pytest

from mneme.domain import Fact
from mneme.runtime.live_replay import WriteBehind
from tests.fakes import FakeStore


def fact(uid: str, text: str = "t", bank: str = "a", doc: str = "") -> Fact:
    return Fact(id=uid, bank_id=bank, text=text, document_id=doc)


def test_writes_wait_for_the_flush_and_upserts_in_a_row_are_one_call():
    store = FakeStore("text")
    wb = WriteBehind(store)
    for i in range(50):
        wb.upsert([fact(f"u{i}")])
    assert store.calls == [] and store.count("a") == 0
    wb.flush()
    assert [c[0] for c in store.calls] == ["upsert"]
    assert store.count("a") == 50


def test_order_is_kept_across_deletes_and_the_last_version_wins():
    store = FakeStore("vector")
    wb = WriteBehind(store)
    wb.upsert([fact("u1", "old", doc="d"), fact("u2")])
    wb.upsert([fact("u1", "new", doc="d")])      # same batch: the later version
    wb.delete("a", ["u2"])
    wb.upsert([fact("u2", "back")])
    wb.delete_where("a", "d")
    wb.upsert([fact("u3", bank="b")])
    wb.flush()
    assert [c[0] for c in store.calls] == ["upsert", "delete", "upsert", "delete_where", "upsert"]
    assert store.calls[0][2] == ["u1", "u2"]  # one upsert, each unit once
    assert store.ids("a") == {"u2"} and store.units["a"]["u2"].text == "back"
    assert store.ids("b") == {"u3"}


def test_a_read_flushes_first():
    store = FakeStore("vector")
    wb = WriteBehind(store)
    wb.upsert([fact("u1")])
    assert wb.count("a") == 1  # any other call sees the writes made before it
    assert store.calls[0][0] == "upsert"


def test_a_failed_flush_keeps_what_was_not_applied_and_the_next_flush_applies_it():
    store = FakeStore("graph", fail="delete")
    wb = WriteBehind(store)
    wb.upsert([fact("u1"), fact("u2")])
    wb.delete("a", ["u1"])
    wb.upsert([fact("u3")])
    with pytest.raises(RuntimeError):
        wb.flush()
    assert store.ids("a") == {"u1", "u2"}  # applied up to the failing write, no further
    store.fail = None
    wb.flush()
    assert store.ids("a") == {"u2", "u3"}


def test_the_buffer_is_bounded():
    store = FakeStore("text")
    wb = WriteBehind(store)
    wb.limit = 10
    for i in range(25):
        wb.upsert([fact(f"u{i}")])
    assert store.count("a") == 20  # flushed at 10 and 20 units
    wb.flush()
    assert store.count("a") == 25


def test_an_empty_document_id_is_refused_at_once():
    wb = WriteBehind(FakeStore("vector"))
    with pytest.raises(ValueError):
        wb.delete_where("a", "")


def test_on_an_empty_store_deletes_of_what_was_never_written_are_dropped():
    store = FakeStore("text")
    wb = WriteBehind(store, empty=True)
    for i in range(5):  # a replayed retain deletes its document's old units first
        wb.delete_where("a", f"d{i}")
        wb.upsert([fact(f"u{i}", doc=f"d{i}")])
    wb.delete("a", ["nope"])
    wb.delete_where("b", None)
    wb.flush()
    assert [c[0] for c in store.calls] == ["upsert"] and store.count("a") == 5
    store.calls.clear()
    wb.delete_where("a", "d1")      # written here: a real delete, in order
    wb.upsert([fact("u1b", doc="d1")])
    wb.delete("a", ["u2", "zz"])
    wb.delete_where("a", None)
    wb.flush()
    assert [c[0] for c in store.calls] == ["delete_where", "upsert", "delete", "delete_where"]
    assert store.count("a") == 0


def test_without_empty_every_delete_reaches_the_store():
    store = FakeStore("text")
    wb = WriteBehind(store)
    wb.delete_where("a", "d0")
    wb.delete("a", ["x"])
    wb.flush()
    assert [c[0] for c in store.calls] == ["delete_where", "delete"]


def test_in_the_background_a_flush_hands_the_batch_over_and_wait_sees_it_written():
    store = FakeStore("vector")
    wb = WriteBehind(store, background=True)
    wb.upsert([fact("u1"), fact("u2")])
    wb.flush()
    wb.upsert([fact("u3")])  # the next batch is buffered meanwhile
    wb.wait()
    assert store.ids("a") == {"u1", "u2"} and len(store.calls) == 1
    wb.flush()
    assert wb.count("a") == 3  # a read waits for the batch in flight, then flushes


def test_in_the_background_an_error_is_raised_by_the_next_flush_and_nothing_is_lost():
    store = FakeStore("graph", fail="delete")
    wb = WriteBehind(store, background=True)
    wb.upsert([fact("u1"), fact("u2")])
    wb.delete("a", ["u1"])
    wb.upsert([fact("u3")])
    wb.flush()  # returns at once; the write fails in its thread
    wb.upsert([fact("u4")])
    with pytest.raises(RuntimeError):
        wb.flush()
    assert store.ids("a") == {"u1", "u2"}  # applied up to the failing write, no further
    store.fail = None
    wb.flush()
    wb.wait()
    assert store.ids("a") == {"u2", "u3", "u4"}
    assert [c[0] for c in store.calls][-3:] == ["delete", "upsert", "upsert"]
