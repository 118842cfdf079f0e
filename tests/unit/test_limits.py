"""The request limits walker, page tokens, deadlines and time tolerance (issue 9)."""

from __future__ import annotations

import base64
import time
from datetime import datetime, timezone

import pytest
from google.protobuf import json_format, struct_pb2, timestamp_pb2

from mneme import paging
from mneme.bus import codec
from mneme.deadline import Deadline
from mneme.domain import MAX_TIME, RecallQuery, from_epoch, to_epoch
from mneme.errors import Cancelled, DeadlineExceeded, InvalidArgument
from mneme.events.v1 import events_pb2 as ev
from mneme.grpc_util import dt_to_ts, ts_to_dt
from mneme.limits import Limits, check, split_items
from mneme.v1 import banks_pb2, memory_pb2, recall_pb2, reflect_pb2, resources_pb2


def paths(msg, **limits) -> set[str]:
    return {p for p, _ in check(msg, Limits(**limits))}


def test_every_field_kind_is_bounded_and_named():
    req = memory_pb2.RetainRequest(parent="banks/b", request_id="r\n", items=[
        memory_pb2.RetainItem(content="ok"),
        memory_pb2.RetainItem(content="x" * 11, tags=["a", "b\x00"], metadata={"k": "v" * 9}),
        memory_pb2.RetainItem(content="fine", document_id="d\x7f",
                              timestamp=timestamp_pb2.Timestamp(seconds=10**12)),
    ])
    got = paths(req, content_chars=10, metadata_value_chars=8)
    assert got == {"request_id", "items[1].content", "items[1].tags[1]", "items[1].metadata['k']",
                   "items[2].document_id", "items[2].timestamp"}
    request_level, per_item = split_items(check(req, Limits(content_chars=10,
                                                            metadata_value_chars=8)))
    assert [p for p, _ in request_level] == ["request_id"]
    assert sorted(per_item) == [1, 2]


def test_counts_enums_numbers_and_schemas():
    assert paths(memory_pb2.RetainRequest(items=[memory_pb2.RetainItem(content="a")] * 3),
                 items=2) == {"items"}
    assert paths(recall_pb2.RecallRequest(query="q", budget=9, tags_match=3,
                                          types=[resources_pb2.WORLD, 42])) == {"budget", "types[1]"}
    assert paths(recall_pb2.RecallRequest(query="q", max_tokens=-5)) == {"max_tokens"}
    assert paths(banks_pb2.ListBanksRequest(page_size=-1)) == {"page_size"}
    assert paths(banks_pb2.ListBanksRequest(page_size=5000)) == set()  # coerced (AIP-158)
    schema = struct_pb2.Struct()
    json_format.ParseDict({"type": "object", "description": "d" * 2000}, schema)
    assert paths(reflect_pb2.ReflectRequest(query="q", response_schema=schema),
                 schema_bytes=1000) == {"response_schema"}
    # Unknown string fields get the generic bound, not none.
    assert paths(banks_pb2.UpsertBankRequest(bank=resources_pb2.Bank(
        name="banks/b", display_name="n" * 5000))) == {"bank.display_name"}
    # Text keeps newlines and tabs; identifiers do not.
    assert paths(recall_pb2.RecallRequest(query="a\nb\tc", parent="banks/b")) == set()
    assert paths(recall_pb2.RecallRequest(query="q", parent="banks/b\n")) == {"parent"}



def test_time_zones_are_checked_where_they_are_given():
    def zone(z: str) -> set[str]:
        return paths(memory_pb2.RetainRequest(items=[memory_pb2.RetainItem(content="a", time_zone=z)]))
    for ok in ("", "UTC", "Z", "America/New_York", "Asia/Kolkata", "+05:30", "-0800", "UTC+01:00"):
        assert zone(ok) == set(), ok
    for bad in ("Mars/Olympus", "../etc/passwd", "/etc/localtime", "America", "+24:00",
                "+05:60", "a" * 300, "Europe/Paris\n", "x\x00"):
        assert zone(bad) == {"items[0].time_zone"}, bad
    assert paths(recall_pb2.RecallRequest(query="q", time_zone="Nowhere")) == {"time_zone"}
    assert paths(reflect_pb2.ReflectRequest(query="q", time_zone="+99:00")) == {"time_zone"}


def _b64(raw: bytes) -> str:
    return base64.urlsafe_b64encode(raw).decode().rstrip("=")


def test_page_tokens_round_trip_and_refuse_anything_else():
    t = paging.encode_token("banks", "alpha")
    assert paging.decode_token(t, "banks") == "alpha"
    assert paging.decode_token("", "banks") is None
    n = paging.encode_token("ops:b", 200)
    assert paging.decode_token(n, "ops:b", int) == 200
    assert paging.decode_token(paging.encode_token("ops:b", 2**63 - 1), "ops:b", int) == 2**63 - 1
    assert paging.decode_token(paging.encode_token("banks", "Zoë/../x y"), "banks") == "Zoë/../x y"
    # any id the limits take comes back: C1 characters and emoji included
    assert paging.decode_token(paging.encode_token("banks", "a\x85b\U0001f600"), "banks") == \
        "a\x85b\U0001f600"
    # positions of several parts, bound to a kind of several fields
    kind = ("operations", "b", ["x", "y"])
    pos = [1716206400.25, "0b7a6b8e-4f5c-5d7e-9a1b-2c3d4e5f6a7b"]
    assert paging.decode_token(paging.encode_token(kind, pos), kind, (float, str)) == pos
    assert paging.decode_token(paging.encode_token("s", ["a", "b"]), "s", [str]) == ["a", "b"]
    for bad, kind, typ in ((t, "ops:b", int), (n, "ops:c", int), (n, "ops:b", str),
                           ("garbage", "banks", str), ("MTA=", "banks", str),
                           (paging.encode_token("ops:b", -1), "ops:b", int), ("!!", "banks", str),
                           # forged: past a 64-bit offset, a float, ids with control characters
                           (paging.encode_token("ops:b", 2**63), "ops:b", int),
                           (paging.encode_token("ops:b", 1.0), "ops:b", int),
                           (paging.encode_token("banks", "a\x00b"), "banks", str),
                           (paging.encode_token("banks", "a\nb"), "banks", str),
                           (paging.encode_token("banks", "a\x7fb"), "banks", str),
                           # the same list with other filters (AIP-158)
                           (paging.encode_token(("m", "b", ["x"]), "a"), ("m", "b", ["y"]), str),
                           (paging.encode_token(("m", "b", ""), "a"), ("m", "b", "d"), str),
                           # shapes: not a pair, a non-finite float, a list with a number
                           (paging.encode_token("o", ["a"]), "o", (float, str)),
                           (_b64(b'["x","y"]'), "o", (float, str)),
                           (paging.encode_token("s", ["a", 1]), "s", [str]),
                           # a lone surrogate (JSON "\ud800"), an object of two keys, three items
                           (_b64(b'["banks","\\ud800"]'), "banks", str),
                           (_b64(b'{"banks":0,"x":0}'), "banks", str),
                           (_b64(b'["banks","a","b"]'), "banks", str)):
        with pytest.raises(InvalidArgument) as e:
            paging.decode_token(bad, kind, typ)
        assert e.value.violations[0][0] == "page_token"
    with pytest.raises(InvalidArgument) as e:  # NaN is JSON to Python's json module
        paging.decode_token(paging.encode_token("o", [float("nan"), "x"]), "o", (float, str))
    with pytest.raises(InvalidArgument):
        paging.page_size(-1)
    assert paging.page_size(0) == 100 and paging.page_size(10**6) == 1000


def test_every_page_token_the_server_can_issue_is_within_the_page_token_limit():
    """The costliest positions (ids of emoji or of characters JSON escapes, a scope of
    the most and longest tags) of lists bound to long filters pass the limits check."""
    from mneme.v1 import documents_pb2, observations_pb2
    lim = Limits()
    longest_kind = ("observations", "b" * 63, ["\U0001f600" * lim.tag_chars] * lim.tags)
    for ch in ("a", "\u4e2d", "\U0001f600", '"', "\\", "\x85"):
        for position in (ch * lim.id_chars, ch * lim.key_id_chars, ch * lim.tag_chars,
                         [ch * lim.tag_chars] * lim.tags,
                         [1716206400.123456, "0b7a6b8e-4f5c-5d7e-9a1b-2c3d4e5f6a7b"]):
            token = paging.encode_token(longest_kind, position)
            assert check(documents_pb2.ListDocumentsRequest(parent="banks/b", page_token=token),
                         lim) == []
            assert check(observations_pb2.ListObservationScopesRequest(
                parent="banks/b", page_token=token), lim) == []
    # the bound is a bound: one more character is refused, naming the field
    assert check(documents_pb2.ListDocumentsRequest(page_token="A" * (lim.page_token_chars + 1)),
                 lim)[0][0] == "page_token"


def test_times_from_any_store_or_log_are_read_without_error():
    # A float epoch that rounded past the end of 9999 (how one retain bricked a bank).
    assert from_epoch(253402300800.0) == from_epoch(to_epoch(MAX_TIME)) <= MAX_TIME
    assert from_epoch(-1e20).year == 1 and from_epoch(1e20).year == 9999
    assert from_epoch(float("nan")) is None and from_epoch("junk") is None
    # An event written by an older version with out-of-range times still decodes.
    for seconds, nanos in ((10**13, 0), (-10**13, 0), (5, -7), (5, 2_000_000_000)):
        t = codec.timestamp_from_pb(timestamp_pb2.Timestamp(seconds=seconds, nanos=nanos))
        assert 1 <= t.year <= 9999
        pb = ev.Fact(id="f", text="t", occurred_end=timestamp_pb2.Timestamp(seconds=seconds,
                                                                           nanos=nanos))
        fact = codec.fact_from_pb(pb, "b")
        assert dt_to_ts(fact.occurred_end) is not None  # and it serialises on the API
    with pytest.raises(InvalidArgument) as e:
        ts_to_dt(timestamp_pb2.Timestamp(seconds=10**12), "query_timestamp")
    assert e.value.violations[0][0] == "query_timestamp"


def test_edge_vector_store_reads_a_unit_at_the_end_of_time(tmp_path):
    from mneme.domain import Fact
    from mneme.stores.vector_edge import EdgeVectorStore
    store = EdgeVectorStore(str(tmp_path / "v"), dim=4)
    end = datetime(9999, 12, 31, 23, 59, 59, 999999, tzinfo=timezone.utc)
    store.upsert([Fact(id="0b7a6b8e-4f5c-5d7e-9a1b-2c3d4e5f6a7b", bank_id="b", text="far",
                       occurred_start=end, occurred_end=end, embedding=[1, 0, 0, 0])])
    got = store.get("b", ["0b7a6b8e-4f5c-5d7e-9a1b-2c3d4e5f6a7b"])
    assert got and got[0].occurred_end.year == 9999
    store.close()


class _Refuse:
    """A store/model that must not be called."""

    def __getattr__(self, name):
        raise AssertionError(f"called {name} after the deadline")


def test_recall_stops_at_the_deadline_and_on_cancellation():
    from services.search.recall import recall
    deps = dict(vectors=_Refuse(), text=_Refuse(), graph=_Refuse(), embedder=_Refuse(),
                analyzer=_Refuse(), tokens=_Refuse())
    now = datetime(2024, 1, 1, tzinfo=timezone.utc)
    gone = Deadline(time.monotonic() - 1)
    with pytest.raises(DeadlineExceeded):
        recall(RecallQuery("b", "q", now, deadline=gone), **deps)
    with pytest.raises(Cancelled):
        recall(RecallQuery("b", "q", now, deadline=Deadline(None, lambda: False)), **deps)


def test_deadline_reports_time_left():
    d = Deadline.after(30)
    assert 29 < d.remaining() <= 30 and not d.cancelled()
    d.check()
    assert Deadline.after(None).remaining() is None


def test_dt_to_ts_equals_protobufs_own_conversion():
    """dt_to_ts computes seconds and nanos itself: the same as Timestamp.FromDatetime of
    the clamped time, at the edges, before the epoch, in other zones and at random."""
    import random
    from datetime import datetime, timedelta, timezone

    from google.protobuf import timestamp_pb2

    from mneme.domain import MAX_TIME, MIN_TIME, clamp_time
    from mneme.grpc_util import dt_to_ts

    rng = random.Random(7)
    span = int((MAX_TIME - MIN_TIME).total_seconds())
    cases = [MIN_TIME, MAX_TIME, datetime(1969, 12, 31, 23, 59, 59, 999999, tzinfo=timezone.utc),
             datetime(1970, 1, 1, tzinfo=timezone.utc),
             datetime(2020, 5, 5, 12, 0, 0, 123456, tzinfo=timezone(timedelta(hours=-7))),
             datetime(9999, 12, 31, 23, 59, 59, 999999, tzinfo=timezone.utc),
             # outside the range once in UTC: the range's ends, not an OverflowError
             datetime(1, 1, 1, tzinfo=timezone(timedelta(hours=14))),
             datetime(9999, 12, 31, 23, 59, tzinfo=timezone(timedelta(hours=-12)))]
    cases += [MIN_TIME + timedelta(seconds=rng.randrange(span), microseconds=rng.randrange(10**6))
              for _ in range(2000)]
    for c in cases:
        want = timestamp_pb2.Timestamp()
        want.FromDatetime(clamp_time(c))
        got = dt_to_ts(c)
        assert (got.seconds, got.nanos) == (want.seconds, want.nanos), c
    assert dt_to_ts(None) is None
    assert clamp_time(cases[-2002]) == MIN_TIME and clamp_time(cases[-2001]) == MAX_TIME


def test_a_refused_items_field_on_the_log_does_not_quote_its_metadata_key():
    """An item refused for a metadata value over the limit travels as a placeholder whose
    ItemFailure.field named the entry, ``items[1].metadata['<key>']``: the key, sealed
    content everywhere else, stood in the clear on the intake, memory and progress topics
    and stayed there after DeleteDocument (found reading the topics from offset 0)."""
    from services.ingest.handlers import _retain_requested
    from mneme import apiconv
    secret = "diagnosis-of-Quillonia"
    req = memory_pb2.RetainRequest(parent="banks/b", items=[
        memory_pb2.RetainItem(content="fine", document_id="d"),
        memory_pb2.RetainItem(content="refused", document_id="d",
                              metadata={secret: "x" * 9000, "ok": "y"})])
    invalid, rejected = split_items(check(req))
    assert not invalid and secret in rejected[1][0][0]  # the caller's own error names it
    items = apiconv.retain_items_from_api(req.items, datetime.now(timezone.utc))
    logged = _retain_requested("op", "b", items, rejected, None)
    assert [(f.item_index, f.field, f.reason) for f in logged.rejected_items] == [
        (1, "items[1].metadata", "rejected")]
    assert secret.encode() not in logged.SerializeToString()
