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
