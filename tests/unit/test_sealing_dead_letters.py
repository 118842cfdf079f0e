"""A dead letter of a corrupt record (its headers name an event type, its value is not
one) goes through the Sealer as it was read: sealing it raised, so the DLQ copy was never
produced and the poison record blocked its partition (found in the distributed test)."""

from __future__ import annotations

from mneme.bus import DLQ, codec
from mneme.bus.sealing import Sealer
from mneme.events.v1 import events_pb2 as ev
from mneme.keys import Keyring, LocalKms
from mneme.ports import OutRecord
from mneme.stores.keys_sqlite import SqliteKeyStore


def test_a_corrupt_records_dead_letter_is_produced_as_it_was_read():
    sealer = Sealer(Keyring(SqliteKeyStore(":memory:"), LocalKms(bytes(32))))
    good = codec.encode(ev.RetainRequested(bank_id="b", items=[ev.RetainItem(content="hi")]),
                        bank_id="b", source="test")
    dead = OutRecord(DLQ, "b", b"\xff\xfe\x00 not a protobuf", {**good.headers,
                                                                  "dlq_error": "DecodeError"})
    assert sealer.seal(dead) is dead
    sealed = sealer.seal(OutRecord(DLQ, "b", good.value, good.headers))  # a valid one: sealed
    assert b"hi" not in sealed.value and sealed.value != good.value


def test_a_dead_letter_never_repeats_an_error_that_quotes_the_events_content():
    """The DLQ copy's value is sealed, but its error headers and the failed operation's
    error are in the clear for good: an exception quoting the content it choked on (as
    Python's do) would keep that text past the deletion of its document."""
    from mneme.bus import PROGRESS, dead_letter
    from mneme.ports import Record
    secret = "my vault code is ZEBRA-SECRET-4711"
    out = codec.encode(ev.RetainRequested(bank_id="b", operation_id="op", items=[
        ev.RetainItem(content=f"Alice: {secret}.", metadata={"k": "v"})]),
        bank_id="b", source="test")
    rec = Record("mneme.intake.v1", 0, 7, out.key, out.value, out.headers)
    env = codec.decode(rec)

    def failed(message: str) -> dict:
        try:
            try:
                raise KeyError("inner")
            except KeyError as inner:
                raise ValueError(message) from inner
        except ValueError as e:
            dlq, progress = dead_letter.records(rec, e, 3, "extraction", env)
        assert dlq.topic == DLQ and progress.topic == PROGRESS
        error = codec.decode(Record(PROGRESS, 0, 0, progress.key, progress.value,
                                    progress.headers)).message.error
        return {"dlq_error": dlq.headers["dlq_error"], "traceback": dlq.headers["dlq_traceback"],
                "operation error": error}

    told = failed(f"could not parse {secret!r}")
    assert not [k for k, v in told.items() if "ZEBRA-SECRET-4711" in v or "vault" in v], told
    assert all("ValueError" in v for v in told.values())
    # an error that quotes nothing of the content is told whole
    told = failed("no room for item 0 (limit 3)")
    assert all("no room for item 0 (limit 3)" in v for v in told.values())
    assert "KeyError: 'inner'" in told["traceback"]


def test_an_error_quoting_a_short_text_of_the_event_whole_is_told_without_it():
    """A KeyError on an entity's name or a metadata value quotes it whole, and such texts
    are often shorter than the runs quotes() looked for (15 characters): "KeyError: 'Ann
    Smith'" went into the dead letter's headers and the failed operation in the clear."""
    from mneme.bus import dead_letter
    from mneme.errors import quotes
    from mneme.ports import Record
    assert quotes("KeyError: 'Ann Smith'", ["Ann Smith"])
    assert quotes('ValueError: bad value "caf\\u00e9 noir"', ["café noir"])  # JSON-escaped
    assert not quotes("ValueError: no room for item 0 (limit 3)", ["k", "v", "no"])  # too short to tell
    assert not quotes("ValueError: overlapping ranges", ["lapping"])  # inside a word: no quote
    assert not quotes("ValueError: bad type for field 'name'", ["type", "name"])  # common words
    out = codec.encode(ev.RetainRequested(bank_id="b", operation_id="op", items=[
        ev.RetainItem(content="Ann Smith", metadata={"team": "Blue Lynx"})]),
        bank_id="b", source="test")
    rec = Record("mneme.intake.v1", 0, 7, out.key, out.value, out.headers)
    env = codec.decode(rec)
    for said in ("Ann Smith", "Blue Lynx"):
        try:
            raise KeyError(said)
        except KeyError as e:
            dlq, progress = dead_letter.records(rec, e, 3, "extraction", env)
        assert said not in dlq.headers["dlq_error"] and said not in dlq.headers["dlq_traceback"]
        assert dlq.headers["dlq_error"].startswith("KeyError")
        assert said.encode() not in progress.value
