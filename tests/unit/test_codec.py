"""Event codec: CloudEvents Kafka binding headers, payload round trips, domain <-> proto."""

from __future__ import annotations

import re
import uuid
from datetime import datetime, timedelta, timezone

import pytest
from google.protobuf import json_format
from google.protobuf.message import DecodeError

from mneme.bus import AUDIT, INTAKE, MEMORY, PROGRESS, REFLECT
from mneme.bus import codec
from mneme.domain import BankConfig, EntityRef, Fact, Link, RetainItem, derive_id
from mneme.events.v1 import events_pb2 as ev
from mneme.ports import OutRecord, Record

T0 = datetime(2024, 5, 1, 12, 30, 45, 123456, tzinfo=timezone.utc)
RFC3339 = re.compile(r"^\d{4}-\d{2}-\d{2}T\d{2}:\d{2}:\d{2}(\.\d+)?(Z|[+-]\d{2}:\d{2})$")
TRACEPARENT = "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01"


def as_record(out: OutRecord, partition: int = 0, offset: int = 0) -> Record:
    return Record(out.topic, partition, offset, out.key, out.value, dict(out.headers), 1.0)


def full_fact(bank: str = "bank-1") -> Fact:
    return Fact(
        id=derive_id("evt", 0, 0), bank_id=bank, text="Alice moved to Paris in 2015.",
        fact_type="experience", context="chat about moving",
        occurred_start=datetime(2015, 1, 1, tzinfo=timezone.utc),
        occurred_end=datetime(2015, 12, 31, 23, 59, 59, 999999, tzinfo=timezone.utc),
        mentioned_at=T0, tags=("user:alice", "travel"), metadata={"k": "v", "lang": "en"},
        document_id="doc-7", chunk_id="doc-7#3",
        entities=[EntityRef("e1", "Alice", "PERSON"), EntityRef("e2", "Paris", "GPE")],
        embedding=codec.to_float32([0.1 * i - 0.5 for i in range(384)]),
        links=[Link("u2", "causal", codec.to_float32([0.73])[0]), Link("u3", "entity", 1.0)],
        item_index=4,
    )


def sample_events() -> list:
    cfg = ev.BankConfig(retain_mission="remember the user", observations_mission="beliefs",
                        skepticism=4, literalism=2, empathy=5, auto_consolidate=True,
                        dedup_threshold=0.95, extraction_mode="llm")
    return [
        ev.BankUpserted(bank_id="b1", display_name="Bank One", config=cfg),
        ev.BankDeleted(bank_id="b1"),
        ev.RetainRequested(bank_id="b1", operation_id="op1", items=[
            codec.retain_item_to_pb(RetainItem("hello", T0, "ctx", "d1", ("t",), {"a": "b"},
                                              "Europe/Paris"))]),
        ev.DocumentDeleteRequested(bank_id="b1", operation_id="op2", document_id="d1"),
        ev.MemoryDeleteRequested(bank_id="b1", operation_id="op3", memory_id="m1"),
        ev.FactsExtracted(bank_id="b1", operation_id="op1",
                          facts=[codec.fact_to_pb(full_fact("b1"))],
                          embedding_model="all-MiniLM-L6-v2", replaced_document_ids=["d0"],
                          items_total=2, failures=[ev.ItemFailure(item_index=1, error="boom")]),
        ev.FactsRetracted(bank_id="b1", operation_id="op2", memory_ids=["m1", "m2"],
                          document_id="d1", bank_deleted=True),
        ev.OperationProgress(bank_id="b1", operation_id="op1", state="succeeded", kind="retain",
                             items_total=2, items_done=2, facts=5, error="",
                             memory_ids=["m1"]),
        ev.ReflectionRecorded(bank_id="b1", query="why?", answer="because", based_on=["m1"],
                              extractive=True, tags=["t"], evidence=[ev.ReflectionEvidence(
                                  memory_id="m1", entities=[ev.Entity(id="e1", name="Alice")])]),
        ev.OpinionsChanged(bank_id="b1", trigger="formed", decided_by="llm", opinions=[
            ev.Opinion(id="p1", text="Alice is a tea person", confidence=0.6,
                       entities=[ev.Entity(id="e1", name="Alice", label="PERSON")],
                       evidence_ids=["m1"], version=1, embedding=[0.5, 0.25],
                       history=[ev.OpinionRevision(change="formed", text="Alice is a tea person",
                                                   confidence=0.6)])]),
        ev.AuditRecorded(method="/mneme.v1.BankService/DeleteBank", bank_id="b1",
                         principal="key:k1", access="write", outcome="allowed", status="OK",
                         peer="ipv4:127.0.0.1:5000"),
        ev.ConsolidationRequested(bank_id="b1", operation_id="op4", action="consolidate",
                                  observation_scopes=ev.ObservationScopes(
                                      mode="explicit", scopes=[ev.ScopeTags(tags=["a"])])),
        ev.OperationCancelRequested(bank_id="b1", operation_id="op1"),
        ev.ConsolidationScheduled(bank_id="b1", operation_id="op4", action="clear_memory",
                                  memory_id="m1"),
        ev.ObservationsChanged(bank_id="b1", operation_id="op4", trigger="consolidate",
                               consolidated_memory_ids=["m1"], observations=[ev.Observation(
                                   id="o1", text="Alice likes tea", scope=["a"], proof_count=1,
                                   evidence=[ev.Evidence(memory_id="m1", quote="likes tea")],
                                   embedding=[0.5, 0.25], version=2)]),
        ev.EntityMergeRequested(bank_id="b1", operation_id="op5", survivor_id="e1",
                                merged_ids=["e2", "e3"], display_name="Alice Smith"),
        ev.EntitiesMerged(bank_id="b1", operation_id="op5", survivor_id="e1",
                          merged_ids=["e2", "e3"], display_name="Alice Smith"),
        ev.EntitySplitRequested(bank_id="b1", operation_id="op6", entity_id="e1",
                                new_entity_id="e4", aliases=["ally"], memory_ids=["m1"],
                                display_name="Ally"),
        ev.EntitySplit(bank_id="b1", operation_id="op6", entity_id="e1", new_entity_id="e4",
                       aliases=["ally"], memory_ids=["m1"], display_name="Ally"),
        ev.VectorsReplaced(bank_id="b1", embedding_model="paraphrase-MiniLM-L3-v2-onnx",
                           previous_model="all-MiniLM-L6-v2-onnx-int8", batch=0, batches=1,
                           units=[ev.UnitVector(id="m1", fact_type="world",
                                                vector=[0.5, 0.25])]),
    ]


EXPECTED_TOPIC = {
    "BankUpserted": INTAKE, "BankDeleted": INTAKE, "DirectiveChanged": INTAKE,
    "MentalModelChanged": INTAKE,
    "RetainRequested": INTAKE,
    "DocumentDeleteRequested": INTAKE, "MemoryDeleteRequested": INTAKE,
    "FactsExtracted": MEMORY, "FactsRetracted": MEMORY,
    "OperationProgress": PROGRESS, "ReflectionRecorded": REFLECT,
    "AuditRecorded": AUDIT,
    "ConsolidationRequested": INTAKE, "ConsolidationScheduled": MEMORY,
    "OperationCancelRequested": INTAKE,
    "ObservationsChanged": MEMORY, "EntitiesResolved": MEMORY, "OpinionsChanged": MEMORY,
    "EntityMergeRequested": INTAKE, "EntitySplitRequested": INTAKE,
    "EntitiesMerged": MEMORY, "EntitySplit": MEMORY, "VectorsReplaced": MEMORY,
}


@pytest.mark.parametrize("msg", sample_events(), ids=lambda m: m.DESCRIPTOR.name)
def test_every_event_type_round_trips(msg):
    out = codec.encode(msg, bank_id="b1", source="mneme/test", time=T0,
                       traceparent=TRACEPARENT)
    assert out.topic == EXPECTED_TOPIC[msg.DESCRIPTOR.name]
    assert out.key == "b1"
    assert out.value == msg.SerializeToString()
    env = codec.decode(as_record(out))
    assert type(env.message) is type(msg)
    assert env.message == msg
    assert env.type == f"mneme.events.v1.{msg.DESCRIPTOR.name}"
    assert env.source == "mneme/test"
    assert env.time == T0
    assert env.subject == "b1"
    assert env.traceparent == TRACEPARENT
    assert env.specversion == "1.0"


def test_topic_map_covers_every_top_level_event():
    nested = {"BankConfig", "RetainItem", "Entity", "Link", "Fact", "ItemFailure", "LlmUsage",
              "ObservationScopes", "ScopeTags", "Evidence", "ObservationRevision", "Observation",
              "ResolvedEntity", "EntityAlias", "Seal", "MentalModelRefresh", "ReflectionEvidence",
              "Opinion", "OpinionRevision", "UnitVector"}
    names = set(ev.DESCRIPTOR.message_types_by_name) - nested
    assert {t.removeprefix(codec.TYPE_PREFIX) for t in codec.TOPIC_OF_TYPE} == names
    assert set(EXPECTED_TOPIC) == names


def test_cloudevents_headers_are_present_and_well_formed():
    out = codec.encode(ev.BankDeleted(bank_id="b1"), bank_id="b1", source="mneme/ingest")
    h = out.headers
    assert h["ce_specversion"] == "1.0"
    assert uuid.UUID(h["ce_id"]).version == 4
    assert h["ce_type"] == "mneme.events.v1.BankDeleted"
    assert h["ce_source"] == "mneme/ingest"
    assert h["ce_subject"] == "b1"
    assert h["content-type"] == "application/protobuf"
    assert RFC3339.match(h["ce_time"]), h["ce_time"]
    t = datetime.fromisoformat(h["ce_time"])
    assert t.tzinfo is not None
    assert abs(datetime.now(timezone.utc) - t) < timedelta(seconds=5)
    assert "traceparent" not in h  # only when given
    # Every header is a str (Kafka headers are bytes; adapters encode UTF-8).
    assert all(isinstance(k, str) and isinstance(v, str) for k, v in h.items())
    # Two events get two ids.
    other = codec.encode(ev.BankDeleted(bank_id="b1"), bank_id="b1", source="mneme/ingest")
    assert other.headers["ce_id"] != h["ce_id"]


def test_deterministic_id_and_naive_time_taken_as_utc():
    eid = derive_id("cause", 1, 2)
    out = codec.encode(ev.BankDeleted(bank_id="b1"), bank_id="b1", source="s", event_id=eid,
                       time=datetime(2020, 2, 29, 23, 0, 0))
    assert out.headers["ce_id"] == eid
    assert out.headers["ce_time"] == "2020-02-29T23:00:00.000000Z"
    assert codec.decode(as_record(out)).id == eid


def test_unknown_or_missing_ce_type_decodes_to_none():
    base = {"ce_specversion": "1.0", "ce_id": "x", "ce_source": "s", "ce_subject": "b1",
            "content-type": "application/protobuf", "ce_time": "2024-01-01T00:00:00Z"}
    for ce_type in ("mneme.events.v1.SomethingNew", "com.example.Other",
                    "mneme.events.v2.BankDeleted"):
        env = codec.decode(Record("t", 0, 0, "b1", b"\x08\x01garbage",
                                  {**base, "ce_type": ce_type}))
        assert env.message is None
        assert env.type == ce_type
        assert env.time == datetime(2024, 1, 1, tzinfo=timezone.utc)
    env = codec.decode(Record("t", 0, 0, "b1", b"", {}))
    assert env.message is None and env.type == "" and env.subject == "b1"


def test_corrupt_payload_and_unsupported_content_type_raise():
    out = codec.encode(ev.BankDeleted(bank_id="b1"), bank_id="b1", source="s")
    with pytest.raises(DecodeError):
        codec.decode(Record(out.topic, 0, 0, "b1", b"\xff\xff\xff", dict(out.headers)))
    with pytest.raises(ValueError, match="content-type"):
        codec.decode(Record(out.topic, 0, 0, "b1", out.value,
                            {**out.headers, "content-type": "text/plain"}))


def test_json_content_type_is_accepted():
    msg = ev.MemoryDeleteRequested(bank_id="b1", operation_id="o", memory_id="m")
    out = codec.encode(msg, bank_id="b1", source="s")
    rec = Record(out.topic, 0, 0, "b1", json_format.MessageToJson(msg).encode(),
                 {**out.headers, "content-type": "application/json; charset=utf-8"})
    assert codec.decode(rec).message == msg


def test_encode_rejects_bad_input():
    with pytest.raises(ValueError, match="differs"):
        codec.encode(ev.BankDeleted(bank_id="a"), bank_id="b", source="s")
    with pytest.raises(ValueError, match="topic"):
        codec.encode(ev.Fact(id="x"), bank_id="b", source="s")
    with pytest.raises(ValueError, match="bank_id"):
        codec.encode(ev.BankDeleted(), bank_id="", source="s")
    with pytest.raises(ValueError, match="source"):
        codec.encode(ev.BankDeleted(bank_id="b"), bank_id="b", source="")


def test_fact_round_trip_every_field_exact():
    f = full_fact()
    pb = codec.fact_to_pb(f)
    for name in ev.Fact.DESCRIPTOR.fields_by_name:  # every proto field is populated
        v = getattr(pb, name)
        assert (pb.HasField(name) if name in ("occurred_start", "occurred_end",
                                              "mentioned_at") else bool(v)), name
    back = codec.fact_from_pb(ev.Fact.FromString(pb.SerializeToString()), "bank-1")
    assert back == f
    assert back.occurred_end.microsecond == 999999
    assert back.mentioned_at.tzinfo is not None


def test_fact_minimal_leaves_times_none_and_proto_side_is_exact():
    f = Fact(id="a", bank_id="b", text="t")
    pb = codec.fact_to_pb(f)
    assert not pb.HasField("occurred_start") and not pb.HasField("mentioned_at")
    assert codec.fact_from_pb(pb, "b") == f
    # Arbitrary doubles: float32 rounding within float32 precision; proto->domain->proto exact.
    g = Fact(id="a", bank_id="b", text="t", embedding=[0.1, 1 / 3, -2.7182818284],
             links=[Link("x", "semantic", 0.123456789)])
    pb = codec.fact_to_pb(g)
    back = codec.fact_from_pb(pb, "b")
    assert back.embedding == pytest.approx(g.embedding, rel=1e-7)
    assert back.links[0].weight == pytest.approx(0.123456789, rel=1e-7)
    assert codec.fact_to_pb(back) == pb


def test_timestamps_exact_including_before_epoch():
    for dt in (datetime(1969, 7, 20, 20, 17, 40, 500001, tzinfo=timezone.utc),
               datetime(1, 1, 1, tzinfo=timezone.utc), T0,
               datetime(2024, 5, 1, 14, 30, 45, 123456,
                        tzinfo=timezone(timedelta(hours=2)))):
        ts = codec.timestamp_to_pb(dt)
        assert 0 <= ts.nanos < 1_000_000_000
        assert codec.timestamp_from_pb(ts) == dt
    assert codec.timestamp_to_pb(T0).ToDatetime(tzinfo=timezone.utc) == T0


def test_retain_item_round_trip():
    item = RetainItem(content="I tried yoga yesterday", timestamp=T0, context="chat",
                      document_id="d1", tags=("a", "b"), metadata={"x": "1"})
    pb = codec.retain_item_to_pb(item)
    assert codec.retain_item_from_pb(ev.RetainItem.FromString(pb.SerializeToString())) == item
    assert codec.retain_item_from_pb(ev.RetainItem(content="x")).timestamp is None


def test_bank_config_round_trip_and_defaults():
    cfg = BankConfig(retain_mission="r", observations_mission="o", skepticism=5, literalism=1,
                     empathy=2, auto_consolidate=False, dedup_threshold=0.9123456789,
                     extraction_mode="llm")
    pb = codec.bank_config_to_pb(cfg)
    assert codec.bank_config_from_pb(ev.BankConfig.FromString(pb.SerializeToString())) == cfg
    assert codec.bank_config_from_pb(None) == BankConfig()
    partial = codec.bank_config_from_pb(ev.BankConfig(retain_mission="r", dedup_threshold=0.97,
                                                      auto_consolidate=True))
    assert partial == BankConfig(retain_mission="r")


def test_a_retain_items_time_zone_round_trips():
    item = RetainItem("hello", T0, "ctx", "d1", ("t",), {"a": "b"}, "America/New_York")
    assert codec.retain_item_from_pb(codec.retain_item_to_pb(item)) == item
    # events written before the field read as UTC
    old = codec.retain_item_to_pb(RetainItem("hello", T0))
    assert codec.retain_item_from_pb(old).time_zone == ""
