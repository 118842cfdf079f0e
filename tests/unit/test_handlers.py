"""Every handler of every ``services/<name>/routes.py``: protobuf in, protobuf out, over
in-memory fakes (no ONNX, no spaCy, no FalkorDB, no broker).

Part 1 calls the handlers directly with an :class:`EventMeta`; part 2 runs them through
:class:`mneme.router.Router` as the runtimes do: bound with the dependencies the
composition root gives (:mod:`mneme.bootstrap`), outputs of declared types only,
deterministic ids on redelivery and replay, and one retain end to end.
"""

from __future__ import annotations

import inspect
import time
from dataclasses import replace
from datetime import datetime, timedelta, timezone

import pytest

from mneme import bank_catalog, bootstrap
from mneme.bus import PART_BYTES, codec
from mneme.domain import BankConfig, Directive, EventMeta, RetainItem, derive_id
from mneme.errors import Cancelled, DeadlineExceeded, NotFound
from mneme.events.v1 import events_pb2 as ev
from mneme.llm.fake import FakeLlm
from mneme.llm.gateway import Usage
from mneme.ports import Record
from mneme.router import Group, Router, Service
from mneme.slots import WaitSlots
from mneme.stores.entities_sqlite import SqliteEntityStore
from mneme.stores.memory import (MemoryCatalog, MemoryDocumentStore, MemoryEntityStore,
                                 MemoryObservationStore)
from services.consolidation.handlers import Consolidator, on_memory_event, on_memory_restore
from services.extraction import handlers as extraction
from services.extraction.handlers import CancelWatch
from services.extraction.resolver import EntityResolver
from services.ingest import handlers as ingest
from services.search import handlers as search
from services.reflect.opinions import OpinionFormer
from tests.fakes import FakeEmbedder, FakeExtractor, fake_projections

T0 = datetime(2024, 5, 1, 12, tzinfo=timezone.utc)
T_ITEM = datetime(2023, 3, 4, 9, tzinfo=timezone.utc)


def meta(n: int = 1, at: datetime = T0) -> EventMeta:
    return EventMeta(derive_id("test-event", n), at)


def item(content: str, *, ts: datetime | None = T_ITEM, doc: str = "", tags=()) -> ev.RetainItem:
    pb = codec.retain_item_to_pb(RetainItem(content, ts, document_id=doc, tags=tuple(tags)))
    if ts is None:
        pb.ClearField("timestamp")
    return pb


def retain(*items: ev.RetainItem, op: str = "op-r", rejected=()) -> ev.RetainRequested:
    return ev.RetainRequested(bank_id="b", operation_id=op, items=list(items),
                              rejected_items=list(rejected))


def vec(*xs: float) -> list[float]:
    n = sum(x * x for x in xs) ** 0.5
    return [x / n for x in xs]


def pb_fact(fid: str, text: str, *, doc: str = "", tags=(), emb=None, at: datetime = T_ITEM,
            entities=()) -> ev.Fact:
    f = ev.Fact(id=fid, text=text, fact_type="world", document_id=doc, tags=list(tags),
                embedding=emb or vec(1, 0, 0, 0),
                entities=[ev.Entity(id=f"e-{e}", name=e, label="PERSON") for e in entities])
    f.mentioned_at.FromDatetime(at)
    f.occurred_start.FromDatetime(at)
    f.occurred_end.FromDatetime(at)
    return f


# ==== ingest: the catalog of operations ====================================================


@pytest.mark.parametrize("msg,kind,total", [
    (retain(item("a"), item("b"), item("c"), op="op-1"), "retain", 3),
    (ev.DocumentDeleteRequested(bank_id="b", operation_id="op-1", document_id="d"),
     "delete_document", 0),
    (ev.MemoryDeleteRequested(bank_id="b", operation_id="op-1", memory_id="m"),
     "delete_memory", 0),
    (ev.ConsolidationRequested(bank_id="b", operation_id="op-1", action="clear"),
     "consolidate", 0),
])
def test_request_becomes_a_pending_operation_with_its_item_count(msg, kind, total):
    catalog = MemoryCatalog()
    assert ingest.on_operation_requested(msg, meta(), catalog=catalog) == []
    op = catalog.get_operation("op-1")
    assert (op.bank_id, op.kind, op.state, op.items_total) == ("b", kind, "pending", total)
    assert op.created_at == op.updated_at == T0.timestamp()
    # redelivered later: idempotent, the first record stays
    ingest.on_operation_requested(msg, meta(2, T0 + timedelta(hours=1)), catalog=catalog)
    assert catalog.get_operation("op-1") == op


def test_progress_updates_the_operation_and_its_first_terminal_state_is_final():
    catalog = MemoryCatalog()
    ingest.on_operation_requested(retain(item("a"), item("b")), meta(1), catalog=catalog)
    t1, t2 = T0 + timedelta(seconds=5), T0 + timedelta(seconds=9)
    assert ingest.on_operation_progress(ev.OperationProgress(
        bank_id="b", operation_id="op-r", kind="retain", state="running", items_total=2,
        items_done=1), meta(2, t1), catalog=catalog) == []
    op = catalog.get_operation("op-r")
    assert (op.state, op.items_done, op.created_at, op.updated_at) == (
        "running", 1, T0.timestamp(), t1.timestamp())
    ingest.on_operation_progress(ev.OperationProgress(
        bank_id="b", operation_id="op-r", kind="retain", state="succeeded", items_total=2,
        items_done=2, facts=3, memory_ids=["m1", "m2", "m3"], error="items[1]: boom",
        failures=[ev.ItemFailure(item_index=1, field="items[1].content", error="boom")]),
        meta(3, t2), catalog=catalog)
    done = catalog.get_operation("op-r")
    assert (done.state, done.facts, done.memory_ids, done.error) == (
        "succeeded", 3, ["m1", "m2", "m3"], "items[1]: boom")
    assert done.item_errors == [(1, "items[1].content", "boom")]
    assert done.created_at == T0.timestamp() and done.updated_at == t2.timestamp()
    # a later failure (a dead letter of a secondary consumer) does not undo success
    ingest.on_operation_progress(ev.OperationProgress(
        bank_id="b", operation_id="op-r", kind="retain", state="failed", error="late"),
        meta(4, t2 + timedelta(seconds=1)), catalog=catalog)
    assert catalog.get_operation("op-r") == done


# ==== bank_catalog: banks, shared by every service's own catalog ===========================


def _upsert(catalog, n, **kw):
    return bank_catalog.on_bank_upserted(ev.BankUpserted(bank_id="b", **kw),
                                         meta(n, T0 + timedelta(minutes=n)), catalog=catalog)


def test_bank_upsert_replace_and_masked_update():
    catalog = MemoryCatalog()
    assert _upsert(catalog, 1, display_name="Bank", config=codec.bank_config_to_pb(
        BankConfig(skepticism=5, retain_mission="facts only", auto_consolidate=False))) == []
    bank = catalog.get_bank("b")
    assert (bank.display_name, bank.config.skepticism, bank.config.retain_mission,
            bank.config.auto_consolidate) == ("Bank", 5, "facts only", False)
    assert bank.created_at == T0 + timedelta(minutes=1)  # the event's time, not the clock
    # an update changes only the masked fields (the rest of the message is ignored)
    _upsert(catalog, 2, display_name="ignored", update_mask=["config.skepticism"],
            config=codec.bank_config_to_pb(BankConfig(skepticism=2, retain_mission="x")))
    bank = catalog.get_bank("b")
    assert (bank.display_name, bank.config.skepticism, bank.config.retain_mission) == (
        "Bank", 2, "facts only")
    assert bank.updated_at == T0 + timedelta(minutes=2)
    _upsert(catalog, 3, display_name="Renamed", update_mask=["display_name"])
    assert catalog.get_bank("b").display_name == "Renamed"
    assert catalog.get_bank("b").config.skepticism == 2
    # without a mask: a replace, and a missing config means the defaults
    _upsert(catalog, 4, display_name="Plain")
    assert catalog.get_bank("b").config == BankConfig()


def test_masked_update_of_an_unknown_bank_creates_nothing():
    catalog = MemoryCatalog()
    _upsert(catalog, 1, display_name="x", update_mask=["display_name"])
    assert catalog.get_bank("b") is None


def test_bank_delete_drops_the_bank_and_its_operations():
    catalog = MemoryCatalog()
    _upsert(catalog, 1, display_name="Bank")
    ingest.on_operation_requested(retain(item("a")), meta(2), catalog=catalog)
    assert bank_catalog.on_bank_deleted(ev.BankDeleted(bank_id="b"), meta(3),
                                        catalog=catalog) == []
    assert catalog.get_bank("b") is None and catalog.get_operation("op-r") is None
    bank_catalog.on_bank_deleted(ev.BankDeleted(bank_id="b"), meta(3), catalog=catalog)  # again


def test_a_repeated_bank_deletion_keeps_its_operation():
    """The same BankDeleted appended again (ingest completing a deletion it kept, whose
    first append had in fact landed) dropped the deletion's own operation with the bank's
    operations: GetOperation no longer found it. A repeat changes nothing."""
    catalog = MemoryCatalog()
    _upsert(catalog, 1, display_name="Bank")
    deleted = ev.BankDeleted(bank_id="b", operation_id="op-del")
    ingest.on_bank_deleted(deleted, meta(2), catalog=catalog)
    ingest.on_operation_progress(ev.OperationProgress(
        bank_id="b", operation_id="op-del", kind="delete_bank", state="succeeded"),
        meta(3), catalog=catalog)
    ingest.on_bank_deleted(deleted, meta(4), catalog=catalog)  # the repeat
    assert catalog.get_operation("op-del").state == "succeeded"
    assert catalog.get_bank("b") is None


def test_bank_events_without_a_catalog_do_nothing():
    assert bank_catalog.on_bank_upserted(ev.BankUpserted(bank_id="b"), meta()) == []
    assert bank_catalog.on_bank_deleted(ev.BankDeleted(bank_id="b"), meta()) == []


class _Log:
    """An event log that records what is appended (for the ingest command tests)."""

    def __init__(self) -> None:
        self.appended = []

    def append(self, records):
        self.appended += records
        return [Record(r.topic, 0, len(self.appended) - 1, r.key, r.value, r.headers, 0.0)
                for r in records]

    def committed(self, group, topic, partition):
        return len(self.appended)  # as if the catalog's consumer were current


def test_ingest_reads_catch_up_with_other_replicas_and_writes_only_when_needed():
    # Another ingest replica created bank "elsewhere": this replica's catalog copy holds it
    # only once it has caught up (the catch_up hook applies what the log holds by then).
    catalog, calls = MemoryCatalog(), []
    catalog.upsert_bank("here", "", BankConfig(), 0.0)

    def catch_up(bank_id):
        calls.append(bank_id)
        catalog.upsert_bank("elsewhere", "made by another replica", BankConfig(), 1.0)
        return True

    cmd = ingest.Ingest(_Log(), catalog, source="mneme/ingest", catch_up=catch_up)
    assert cmd.require_bank("elsewhere").display_name == "made by another replica"
    assert calls == ["elsewhere"]
    cmd.retain("here", [RetainItem(content="a", timestamp=T0)], wait=False)  # a known bank: no round trip
    cmd.delete_document("here", "d", wait=False)
    assert calls == ["elsewhere"]
    cmd.retain("here", [RetainItem(content="b", timestamp=T0)], wait=False, request_id="r1")
    assert calls[-1] == "here"  # a request id is looked up among every replica's operations
    with pytest.raises(NotFound):
        cmd.get_operation("op-unknown")
    assert calls[-1] is None  # an operation's bank is not in its name: every partition
    catalog.delete_bank("gone")
    with pytest.raises(NotFound):
        cmd.retain("gone", [RetainItem(content="c", timestamp=T0)], wait=False)
    assert calls[-1] == "gone"  # unknown here: caught up before NOT_FOUND


def test_a_sync_wait_is_woken_by_the_catalog_write_that_finishes_it():
    # poll_s is longer than the deadline: only the write's wake-up can end the wait in time
    import threading

    from mneme.domain import Operation
    catalog = ingest.CatalogChanges(MemoryCatalog())
    catalog.upsert_bank("b", "", BankConfig(), 0.0)
    cmd = ingest.Ingest(_Log(), catalog, source="mneme/ingest", poll_s=120.0)
    op = cmd.retain("b", [RetainItem(content="a", timestamp=T0)], wait=False)

    def progress():  # ingest's group projects the retain's progress a moment later
        time.sleep(0.2)
        ingest.on_operation_requested(ev.RetainRequested(bank_id="b", operation_id=op.operation_id,
                                                         items=[ev.RetainItem()]),
                                      meta(1), catalog=catalog)
        catalog.update_operation(Operation(op.operation_id, "b", "retain", "succeeded", 1, 1))
    threading.Thread(target=progress, daemon=True).start()
    done = cmd._finish(op.operation_id, None, "b", "retain", 1, True, 30.0)
    assert done.state == "succeeded"


# ==== extraction ===========================================================================


def _extract(m, extractor=None, embedder=None, n=1):
    extractor = extractor or FakeExtractor()
    embedder = embedder or FakeEmbedder()
    (out,) = extraction.on_retain_requested(m, meta(n), extractor=extractor, embedder=embedder,
                                            resolver=EntityResolver())
    assert isinstance(out, ev.FactsExtracted)
    return out


def test_retain_yields_facts_with_ids_from_the_operation_and_their_embeddings():
    extractor, embedder = FakeExtractor(), FakeEmbedder(dim=4, model_name="tiny")
    m = retain(item("Alice moved to Lisbon.", doc="d2", tags=["t"]),
               item("Bob likes tea.", doc="d1"), item("No document here."))
    m.observation_scopes.CopyFrom(ev.ObservationScopes(
        mode="explicit", scopes=[ev.ScopeTags(tags=["t", "u"])]))
    out = _extract(m, extractor, embedder)
    assert (out.bank_id, out.operation_id, out.items_total) == ("b", "op-r", 3)
    # the extractor is asked once, with the operation as the source of fact ids
    (call,) = extractor.calls
    assert call[0] == "extract_many" and call[3] == "op-r"
    assert [f.id for f in out.facts] == [derive_id("op-r", i, 0) for i in range(3)]
    assert [f.text for f in out.facts] == ["Alice moved to Lisbon.", "Bob likes tea.",
                                           "No document here."]
    assert [f.item_index for f in out.facts] == [0, 1, 2]
    assert out.embedding_model == "tiny"
    assert embedder.calls == [[f.text for f in out.facts]]
    for f, v in zip(out.facts, FakeEmbedder().embed([f.text for f in out.facts])):
        assert list(f.embedding) == pytest.approx(v, abs=1e-6)
    assert list(out.replaced_document_ids) == ["d1", "d2"]
    assert out.observation_scopes == m.observation_scopes
    assert not out.failures and not out.no_fact_items and not out.HasField("llm_usage")
    # redelivery: the same ids (and the same event)
    assert _extract(m, embedder=FakeEmbedder(dim=4, model_name="tiny")) == out


def test_retain_without_scopes_leaves_them_unset_and_dates_undated_items_by_the_event():
    extractor = FakeExtractor()
    out = _extract(retain(item("Undated statement here.", ts=None)), extractor)
    assert not out.HasField("observation_scopes")
    given = extractor.calls[0][2][0]
    assert given.timestamp == T0  # the event's time, not the wall clock


def test_rejected_items_are_not_extracted_and_fail_with_ingests_error():
    extractor = FakeExtractor()
    m = retain(item("Kept zero."), ev.RetainItem(), item("Kept two."), rejected=[
        ev.ItemFailure(item_index=1, field="items[1].content", error="must not be empty",
                       reason="rejected")])
    out = _extract(m, extractor)
    assert [it.content for it in extractor.calls[0][2]] == ["Kept zero.", "Kept two."]
    assert [(f.text, f.item_index) for f in out.facts] == [("Kept zero.", 0), ("Kept two.", 2)]
    assert [(f.item_index, f.field, f.error, f.reason) for f in out.failures] == [
        (1, "items[1].content", "must not be empty", "rejected")]
    assert out.items_total == 3


def test_all_items_rejected_calls_no_extractor_and_no_embedder():
    extractor, embedder = FakeExtractor(), FakeEmbedder()
    out = _extract(retain(ev.RetainItem(), rejected=[ev.ItemFailure(
        item_index=0, field="items[0].content", error="too long")]), extractor, embedder)
    assert extractor.calls == [] and embedder.calls == []
    assert not out.facts and [(f.item_index, f.reason) for f in out.failures] == [(0, "rejected")]


def test_extraction_incomplete_maps_failures_back_to_request_indexes_without_a_second_pass():
    # local indexes 0, 1, 2 are request items 0, 2, 3 (item 1 was rejected by ingest)
    extractor = FakeExtractor(incomplete=[1])
    m = retain(item("Item zero here."), ev.RetainItem(), item("Item two here."),
               item("Item three here."),
               rejected=[ev.ItemFailure(item_index=1, field="items[1].content", error="bad")])
    out = _extract(m, extractor)
    assert [c[0] for c in extractor.calls] == ["extract_many"]  # outcomes known: no retry
    assert [(f.text, f.item_index) for f in out.facts] == [("Item zero here.", 0),
                                                           ("Item three here.", 3)]
    assert [(f.item_index, f.reason) for f in out.failures] == [(1, "rejected"),
                                                                (2, "invalid_output")]
    assert out.failures[1].error == "ItemExtractionFailed: invalid_output: item 1 unparseable"


def test_a_failing_batch_is_retried_item_by_item_and_one_bad_item_fails_alone():
    extractor = FakeExtractor(batch_error=RuntimeError("batch broke"),
                              item_errors={1: ValueError("item broke")})
    m = retain(item("First item text."), ev.RetainItem(), item("Second item text."),
               item("Third item text."),
               rejected=[ev.ItemFailure(item_index=1, field="items[1].content", error="bad")])
    out = _extract(m, extractor)
    assert [c[0] for c in extractor.calls] == ["extract_many", "extract", "extract", "extract"]
    assert [c[3] for c in extractor.calls[1:]] == [0, 1, 2]  # local indexes, in order
    assert [(f.text, f.item_index) for f in out.facts] == [("First item text.", 0),
                                                           ("Third item text.", 3)]
    assert [(f.item_index, f.error) for f in out.failures] == [
        (1, "bad"), (2, "ValueError: item broke")]
    # the ids do not depend on the path taken: per item they are the batch's ids
    assert out.facts[0].id == derive_id("op-r", 0, 0)


@pytest.mark.parametrize("where", ["batch", "item"])
def test_cancellation_is_never_swallowed(where):
    extractor = (FakeExtractor(batch_error=Cancelled("stopping")) if where == "batch" else
                 FakeExtractor(batch_error=RuntimeError("x"), item_errors={0: Cancelled("stop")}))
    with pytest.raises(Cancelled):
        _extract(retain(item("Some item text.")), extractor)


@pytest.mark.parametrize("where", ["batch", "item"])
def test_a_full_disk_is_no_item_s_failure(where):
    """The entity store on a full disk failed the batch, then each item: every item was
    recorded as failed ("OperationalError: database or disk is full") and its facts
    were lost for good, though the same retain succeeds once there is room. The error
    goes up, so the consumer handles the event again later."""
    import sqlite3
    full = sqlite3.OperationalError("database or disk is full")
    extractor = (FakeExtractor(batch_error=full) if where == "batch" else
                 FakeExtractor(batch_error=RuntimeError("x"), item_errors={0: full}))
    with pytest.raises(sqlite3.OperationalError):
        _extract(retain(item("Some item text."), item("Other item text.")), extractor)


def test_the_extractors_report_gives_no_fact_items_and_usage():
    extractor = FakeExtractor(no_facts=[1], reporting=True, usage=Usage(
        model="m", calls=2, failed_calls=1, input_tokens=10, output_tokens=5, cost_usd=0.25))
    m = retain(ev.RetainItem(), item("Has a fact."), item("Says nothing."),
               rejected=[ev.ItemFailure(item_index=0, error="bad")])
    out = _extract(m, extractor)
    assert list(out.no_fact_items) == [2]  # local 1 → request 2
    assert [f.item_index for f in out.facts] == [1]
    u = out.llm_usage
    assert (u.model, u.calls, u.failed_calls, u.input_tokens, u.output_tokens, u.cost_usd) == (
        "m", 2, 1, 10, 5, 0.25)


def test_the_bank_s_extractor_chooses_the_texts_embedded():
    class WithContext(FakeExtractor):
        def embedding_parts(self, facts):
            from services.extraction.vectors import EmbeddingParts
            return [EmbeddingParts((f"ctx: {f.text}",)) for f in facts]

    class PerBank(FakeExtractor):
        def __init__(self):
            super().__init__()
            self.used = WithContext()

        def for_bank(self, bank_id):
            return self.used

    embedder = FakeEmbedder()
    out = _extract(retain(item("Short reply.")), PerBank(), embedder)
    assert embedder.calls == [["ctx: Short reply."]]
    assert out.facts[0].text == "Short reply."


def test_deletions_become_retractions():
    (d,) = extraction.on_document_delete_requested(ev.DocumentDeleteRequested(
        bank_id="b", operation_id="op-d", document_id="doc"), meta(),
        resolver=EntityResolver(MemoryEntityStore()))
    assert d == ev.FactsRetracted(bank_id="b", operation_id="op-d", document_id="doc")
    (m,) = extraction.on_memory_delete_requested(ev.MemoryDeleteRequested(
        bank_id="b", operation_id="op-m", memory_id="m1"), meta(),
        resolver=EntityResolver(MemoryEntityStore()))
    assert m == ev.FactsRetracted(bank_id="b", operation_id="op-m", memory_ids=["m1"])


def test_a_merge_into_a_survivor_merged_away_meanwhile_goes_on_merging_nothing():
    """Two merges checked at once reach the log as Beth-into-Liz, then Liz-into-Beth.
    The second's survivor is gone when it applies: entity resolution leaves it, and it
    goes on to the projections naming no merged entity, so that none of them (the graph,
    consolidation's opinions about Liz) moves anything to Beth, who no longer exists."""
    from services.consolidation.opinions import merge_entities
    r = EntityResolver(MemoryEntityStore())
    liz, beth = (ref for [ref] in r.resolve_many("b", [[("Liz", "PERSON")],
                                                     [("Beth", "PERSON")]]))
    (first,) = extraction.on_entity_merge_requested(ev.EntityMergeRequested(
        bank_id="b", operation_id="op-1", survivor_id=liz.id, merged_ids=[beth.id]),
        meta(), resolver=r)
    assert list(first.merged_ids) == [beth.id]
    (late,) = extraction.on_entity_merge_requested(ev.EntityMergeRequested(
        bank_id="b", operation_id="op-2", survivor_id=beth.id, merged_ids=[liz.id],
        display_name="Beth B."), meta(2), resolver=r)
    assert (late.survivor_id, list(late.merged_ids), late.display_name) == (beth.id, [], "")
    assert [e.id for e in r.entities("b")] == [liz.id]
    assert r.resolve("b", [("Beth", "PERSON")])[0].id == liz.id
    assert merge_entities(None, "b", late.survivor_id, late.merged_ids, late.display_name,
                          T0) is None  # no opinion is looked up, none moves


class _ResolvingExtractor(FakeExtractor):
    """A FakeExtractor whose facts name the capitalised words of their item, resolved
    through ``resolver`` (as the offline and LLM extractors resolve mentions)."""

    def __init__(self, resolver: EntityResolver) -> None:
        super().__init__()
        self.resolver = resolver

    def _fact(self, bank_id, item, i, source_id):
        f = super()._fact(bank_id, item, i, source_id)
        names = [(w.strip(".,"), "PERSON") for w in item.content.split() if w[:1].isupper()]
        return replace(f, entities=self.resolver.resolve(bank_id, names))


def _retain_named(op: str, *contents: str) -> ev.RetainRequested:
    return ev.RetainRequested(bank_id="b", operation_id=op, items=[
        ev.RetainItem(content=c) for c in contents])


def test_retain_publishes_its_resolution_decisions_before_its_facts():
    resolver = EntityResolver(MemoryEntityStore())
    extractor = _ResolvingExtractor(resolver)
    resolved, facts = extraction.on_retain_requested(
        _retain_named("op1", "Melanie paints.", "Mel and Caroline swim."), meta(),
        extractor=extractor, embedder=FakeEmbedder(), resolver=resolver)
    assert isinstance(resolved, ev.EntitiesResolved) and isinstance(facts, ev.FactsExtracted)
    assert (resolved.bank_id, resolved.operation_id) == ("b", "op1")
    assert [e.name for e in resolved.entities] == ["Melanie", "Caroline"]
    assert [(a.alias, a.entity_id) for a in resolved.aliases] == [
        ("mel", resolved.entities[0].id)]
    # decisions are published once: a retain that decides nothing new publishes none
    (only,) = extraction.on_retain_requested(_retain_named("op2", "Melanie again."), meta(2),
                                             extractor=extractor, embedder=FakeEmbedder(),
                                             resolver=resolver)
    assert isinstance(only, ev.FactsExtracted)


def test_a_deleted_document_takes_the_entities_only_it_named_with_it():
    store = MemoryEntityStore()
    resolver = EntityResolver(store)
    extractor = _ResolvingExtractor(resolver)

    def retain(op, doc, content):
        return extraction.on_retain_requested(ev.RetainRequested(
            bank_id="b", operation_id=op, items=[ev.RetainItem(content=content,
                                                               document_id=doc)]),
            meta(), extractor=extractor, embedder=FakeEmbedder(), resolver=resolver)
    retain("op1", "d1", "Zorblat and Caroline swim.")
    retain("op2", "d2", "Caroline paints.")
    names = {e.name for e in resolver.entities("b")}
    assert {"Zorblat", "Caroline"} <= names
    extraction.on_document_delete_requested(ev.DocumentDeleteRequested(
        bank_id="b", operation_id="op-d", document_id="d1"), meta(), resolver=resolver)
    names = {e.name for e in resolver.entities("b")}
    assert "Zorblat" not in names and "Caroline" in names  # d2 still names her
    assert "Zorblat" not in {e.name for e in store.load("b")[0]}
    assert resolver.lookup("b", ["Zorblat"]) == []
    # named again later: made again, with the id it had
    (resolved, _) = retain("op3", "d3", "Zorblat returns.")
    assert [e.name for e in resolved.entities] == ["Zorblat"]


@pytest.mark.parametrize("store", [MemoryEntityStore, lambda: SqliteEntityStore(":memory:")])
def test_a_deleted_memory_takes_the_entities_only_it_named_with_it(store):
    # "Melanie Smith" is named by one memory only: deleted, a later "Melanie" is not
    # resolved to (nor named after) her, as a replay, which never sees it, would not
    store = store()
    resolver = EntityResolver(store)
    extractor = _ResolvingExtractor(resolver)

    def retain(op, *contents):
        return extraction.on_retain_requested(_retain_named(op, *contents), meta(),
                                              extractor=extractor, embedder=FakeEmbedder(),
                                              resolver=resolver)[-1]
    facts = retain("op1", "Melanie Smith paints.", "Caroline swims.")
    retain("op2", "Caroline paints.")
    [melanie] = [f for f in facts.facts if "Melanie" in f.text]
    extraction.on_memory_delete_requested(ev.MemoryDeleteRequested(
        bank_id="b", operation_id="op-m", memory_id=melanie.id), meta(), resolver=resolver)
    names = {e.name for e in resolver.entities("b")}
    assert "Melanie Smith" not in names and "Caroline" in names
    assert "Melanie Smith" not in {e.name for e in store.load("b")[0]}
    assert resolver.lookup("b", ["Melanie Smith", "Melanie"]) == []
    later = retain("op3", "Melanie dances.")
    assert [e.name for f in later.facts for e in f.entities] == ["Melanie"]
    # Caroline: the memory of op1 naming her is deleted, op2's still names her
    [caroline] = [f for f in facts.facts if "Caroline" in f.text]
    extraction.on_memory_delete_requested(ev.MemoryDeleteRequested(
        bank_id="b", operation_id="op-m2", memory_id=caroline.id), meta(), resolver=resolver)
    assert "Caroline" in {e.name for e in resolver.entities("b")}


def test_a_replica_restored_from_the_changelog_resolves_like_the_one_that_decided():
    # Replica A extracts two retains; replica B restores A's decisions from the log and
    # takes the bank over: its next retain resolves exactly as A's would have.
    a, b = EntityResolver(MemoryEntityStore()), EntityResolver(MemoryEntityStore())
    log = []
    for n, contents in enumerate([("Melanie paints.", "Caroline swims."), ("Mel runs.",)]):
        log += extraction.on_retain_requested(_retain_named(f"op{n}", *contents), meta(n),
                                              extractor=_ResolvingExtractor(a),
                                              embedder=FakeEmbedder(), resolver=a)
    for m in log:
        if isinstance(m, ev.EntitiesResolved):
            assert extraction.on_entities_resolved(m, meta(), resolver=b) == []
            extraction.on_entities_resolved(m, meta(), resolver=b)  # redelivered: idempotent
    assert b.entities("b") == a.entities("b") and b.aliases("b") == a.aliases("b")
    nxt = _retain_named("op9", "Mel met Caroline and Melissa.")
    (_, fa), (_, fb) = (extraction.on_retain_requested(
        nxt, meta(9), extractor=_ResolvingExtractor(r), embedder=FakeEmbedder(), resolver=r)
        for r in (a, b))
    assert [e.id for f in fb.facts for e in f.entities] == [
        e.id for f in fa.facts for e in f.entities]
    # a deleted bank's retraction on the log makes the restored replica forget it
    assert extraction.on_facts_retracted(ev.FactsRetracted(bank_id="b", memory_ids=["x"]),
                                        meta(), resolver=b) == []
    assert b.entities("b")
    extraction.on_facts_retracted(ev.FactsRetracted(bank_id="b", bank_deleted=True), meta(),
                                 resolver=b)
    assert b.entities("b") == []


@pytest.mark.parametrize("own_catalog", [False, True])
def test_bank_delete_forgets_its_entities_and_retracts_everything(own_catalog):
    store = MemoryEntityStore()
    resolver = EntityResolver(store)
    resolver.resolve("b", [("Alice", "PERSON")])
    resolver.resolve("other", [("Bob", "PERSON")])
    catalog = MemoryCatalog()
    catalog.upsert_bank("b", "B", BankConfig(), 0.0)
    kw = {"catalog": catalog} if own_catalog else {}
    (out,) = extraction.on_bank_deleted(ev.BankDeleted(bank_id="b"), meta(), resolver=resolver,
                                        **kw)
    assert out == ev.FactsRetracted(bank_id="b", bank_deleted=True)  # not an operation
    assert resolver.entities("b") == [] and store.load("b") == ([], [])
    assert [e.name for e in resolver.entities("other")] == ["Bob"]
    assert (catalog.get_bank("b") is None) == own_catalog


def test_consolidation_request_is_scheduled_with_a_copy_of_its_scopes():
    scopes = ev.ObservationScopes(mode="explicit", scopes=[ev.ScopeTags(tags=["a"])])
    m = ev.ConsolidationRequested(bank_id="b", operation_id="op-c", action="clear_memory",
                                  memory_id="m1", observation_scopes=scopes)
    (out,) = extraction.on_consolidation_requested(m, meta())
    assert out == ev.ConsolidationScheduled(bank_id="b", operation_id="op-c",
                                            action="clear_memory", memory_id="m1",
                                            observation_scopes=scopes)
    (plain,) = extraction.on_consolidation_requested(ev.ConsolidationRequested(
        bank_id="b", operation_id="op-c", action="consolidate"), meta())
    assert not plain.HasField("observation_scopes") and plain.action == "consolidate"


# ==== search ===============================================================================


def _facts_extracted(*facts, op="op-r", total=None, failures=(), no_facts=(), replaced=()):
    return ev.FactsExtracted(bank_id="b", operation_id=op, facts=list(facts),
                             items_total=len(facts) if total is None else total,
                             failures=list(failures), no_fact_items=list(no_facts),
                             replaced_document_ids=list(replaced), embedding_model="fake")


def test_facts_go_into_every_store_and_the_retain_succeeds():
    stores = fake_projections()
    m = _facts_extracted(pb_fact("f1", "Alice moved to Lisbon.", doc="d"),
                         pb_fact("f2", "Bob likes tea."), total=4, no_facts=[2],
                         failures=[ev.ItemFailure(item_index=3, error="boom", reason="x")])
    (p,) = search.on_facts_extracted(m, meta(), stores=stores)
    assert [s.ids("b") for s in stores.all()] == [{"f1", "f2"}] * 3
    stored = stores.text.units["b"]["f1"]
    assert (stored.text, stored.document_id, stored.mentioned_at) == (
        "Alice moved to Lisbon.", "d", T_ITEM)
    assert p == ev.OperationProgress(
        bank_id="b", operation_id="op-r", kind="retain", state="succeeded", items_total=4,
        items_done=4, facts=2, memory_ids=["f1", "f2"], items_no_facts=1,
        error="items[3]: boom", failures=m.failures)
    # redelivery: the same progress, the same units
    assert search.on_facts_extracted(m, meta(), stores=stores) == [p]
    assert [s.count("b") for s in stores.all()] == [2, 2, 2]


def test_a_correction_whose_entity_went_meanwhile_fails_and_changes_nothing():
    """Merges of the same entities requested at once are each checked against the graph
    as it was, then reach the log in some order: one whose survivor (or a split whose
    entity) was merged away before it applies must end FAILED and leave the graph alone,
    as entity resolution does, not bring the entity back."""
    stores = fake_projections()
    search.on_facts_extracted(_facts_extracted(
        pb_fact("f1", "Liz adopted a puppy.", entities=["Liz"]),
        pb_fact("f2", "Beth went to Paris.", entities=["Beth"])), meta(), stores=stores)
    (ok,) = search.on_entities_merged(ev.EntitiesMerged(
        bank_id="b", operation_id="op-1", survivor_id="e-Liz", merged_ids=["e-Beth"]),
        meta(2), stores=stores)
    assert ok.state == "succeeded"
    calls = list(stores.graph.calls)
    stores.graph.units["b"]["f2"] = replace(  # the merge as the graph applies it
        stores.graph.units["b"]["f2"], entities=stores.graph.units["b"]["f1"].entities)
    (late,) = search.on_entities_merged(ev.EntitiesMerged(
        bank_id="b", operation_id="op-2", survivor_id="e-Beth", merged_ids=["e-Liz"]),
        meta(3), stores=stores)
    (split,) = search.on_entity_split(ev.EntitySplit(
        bank_id="b", operation_id="op-3", entity_id="e-Beth", new_entity_id="e-B",
        aliases=["beth"], display_name="B"), meta(4), stores=stores)
    for p, kind in ((late, "merge_entities"), (split, "split_entity")):
        assert (p.operation_id, p.kind, p.state) == (p.operation_id, kind, "failed")
        assert "'e-Beth' was merged into another or deleted" in p.error
    assert stores.graph.calls == calls  # neither touched the graph


def test_a_retain_fails_only_when_every_item_failed():
    stores = fake_projections()
    m = _facts_extracted(total=2, failures=[ev.ItemFailure(item_index=0, error="a"),
                                            ev.ItemFailure(item_index=1, error="b")])
    (p,) = search.on_facts_extracted(m, meta(), stores=stores)
    assert (p.state, p.facts, p.error) == ("failed", 0, "items[0]: a; items[1]: b")
    assert all(s.calls == [] for s in stores.all())  # nothing to write


def test_a_replaced_document_leaves_every_store_before_its_new_facts_arrive():
    stores = fake_projections()
    search.on_facts_extracted(_facts_extracted(pb_fact("old", "Old text of d.", doc="d"),
                                               pb_fact("keep", "Other doc.", doc="e")),
                              meta(1), stores=stores)
    search.on_facts_extracted(_facts_extracted(pb_fact("new", "New text of d.", doc="d"),
                                               replaced=["d"], op="op-2"), meta(2), stores=stores)
    for s in stores.all():
        assert s.ids("b") == {"keep", "new"}
        assert [c[0] for c in s.calls] == ["upsert", "delete_where", "upsert"]


@pytest.mark.parametrize("failing", ["vector", "text", "graph"])
def test_a_failing_store_leaves_the_facts_in_none(failing):
    stores = fake_projections({failing: "upsert"})
    with pytest.raises(RuntimeError, match=f"{failing} store"):
        search.on_facts_extracted(_facts_extracted(pb_fact("f1", "A fact here."),
                                                   pb_fact("f2", "Another fact.")),
                                  meta(), stores=stores)
    assert [s.count("b") for s in stores.all()] == [0, 0, 0]
    kinds = ("vector", "text", "graph")
    written = kinds[:kinds.index(failing) + 1]
    for s in stores.all():  # the stores after the failing one were never written
        assert [c[0] for c in s.calls] == (["upsert", "delete"] if s.kind in written else [])


def test_undo_goes_on_when_a_store_cannot_delete():
    stores = fake_projections({"vector": "delete", "graph": "upsert"})
    with pytest.raises(RuntimeError, match="graph store"):
        search.on_facts_extracted(_facts_extracted(pb_fact("f1", "A fact here.")), meta(),
                                  stores=stores)
    assert stores.text.count("b") == 0 and stores.graph.count("b") == 0


def _seed(stores):
    search.on_facts_extracted(_facts_extracted(
        pb_fact("f1", "In doc d.", doc="d"), pb_fact("f2", "Also in d.", doc="d"),
        pb_fact("f3", "Not in a doc.")), meta(1), stores=stores)
    stores.vectors.upsert([codec.fact_from_pb(pb_fact("f9", "Other bank."), "other")])


def test_retractions_and_their_progress():
    stores = fake_projections()
    _seed(stores)
    (p,) = search.on_facts_retracted(ev.FactsRetracted(bank_id="b", operation_id="op-d",
                                                       document_id="d"), meta(2), stores=stores)
    assert p == ev.OperationProgress(bank_id="b", operation_id="op-d", kind="delete_document",
                                     state="succeeded")
    assert [s.ids("b") for s in stores.all()] == [{"f3"}] * 3
    (p,) = search.on_facts_retracted(ev.FactsRetracted(bank_id="b", operation_id="op-m",
                                                       memory_ids=["f3"]), meta(3), stores=stores)
    assert (p.kind, p.state) == ("delete_memory", "succeeded")
    assert [s.count("b") for s in stores.all()] == [0, 0, 0]
    assert stores.vectors.ids("other") == {"f9"}
    # deleted already, or held by another bank: the deletion fails, nothing else goes
    for bank, memory in (("b", "f3"), ("b", "f9"), ("other", "f1")):
        (p,) = search.on_facts_retracted(ev.FactsRetracted(bank_id=bank, operation_id="op-x",
                                                           memory_ids=[memory]), meta(4),
                                         stores=stores)
        assert (p.kind, p.state, p.error) == ("delete_memory", "failed", "memory not found")
    assert stores.vectors.ids("other") == {"f9"}
    # an observation or opinion unit is consolidation's: refused, and it stays
    for unit, fact_type in (("o1", "observation"), ("p1", "opinion")):
        stores.vectors.upsert([replace(codec.fact_from_pb(pb_fact(unit, "A unit."), "b"),
                                       fact_type=fact_type)])
        (p,) = search.on_facts_retracted(ev.FactsRetracted(bank_id="b", operation_id="op-o",
                                                           memory_ids=[unit]), meta(5),
                                         stores=stores)
        assert (p.state, p.error.split(",")[0]) == ("failed", f"an {fact_type}")
        assert unit in stores.vectors.ids("b")


def test_a_deletion_retried_after_a_store_failed_finishes_and_succeeds():
    """The vector store is deleted last, so a retry (the consumer retries a handler that
    raised) still finds the memory, or the document's units, and finishes the deletion
    in every store instead of answering "memory not found"."""
    for kind in ("text", "graph"):
        stores = fake_projections({kind: "delete"})
        _seed(stores)
        retracted = ev.FactsRetracted(bank_id="b", operation_id="op-m", memory_ids=["f3"])
        with pytest.raises(RuntimeError):
            search.on_facts_retracted(retracted, meta(2), stores=stores)
        stores.all()[("vector", "text", "graph").index(kind)].fail = None
        (p,) = search.on_facts_retracted(retracted, meta(2), stores=stores)
        assert (p.state, p.error) == ("succeeded", "")
        assert all("f3" not in s.ids("b") for s in stores.all()), kind
        stores.text.fail = stores.graph.fail = "delete_where"
        by_doc = ev.FactsRetracted(bank_id="b", operation_id="op-d", document_id="d")
        with pytest.raises(RuntimeError):
            search.on_facts_retracted(by_doc, meta(3), stores=stores)
        stores.text.fail = stores.graph.fail = None
        (p,) = search.on_facts_retracted(by_doc, meta(3), stores=stores)
        assert p.state == "succeeded" and all(s.ids("b") == set() for s in stores.all())


def test_a_deleted_bank_leaves_every_store_without_progress():
    stores = fake_projections()
    _seed(stores)
    assert search.on_facts_retracted(ev.FactsRetracted(bank_id="b", bank_deleted=True), meta(2),
                                     stores=stores) == []
    assert [s.count("b") for s in stores.all()] == [0, 0, 0]
    assert stores.vectors.ids("other") == {"f9"}


def _obs(oid: str, text: str, *, deleted=False, scope=("t",), version=1) -> ev.Observation:
    o = ev.Observation(id=oid, text=text, scope=list(scope), proof_count=1, deleted=deleted,
                       version=version, embedding=vec(0, 1, 0, 0),
                       evidence=[ev.Evidence(memory_id="f1", quote=text)])
    o.updated_at.FromDatetime(T0)
    return o


@pytest.mark.parametrize("trigger,op,progress", [
    ("consolidate", "op-c", True), ("reconsolidate", "op-c", True), ("clear", "op-c", True),
    ("clear_memory", "op-c", True), ("auto", "op-r", False), ("retract", "op-d", False),
    ("consolidate", "", False),
])
def test_observations_go_into_the_vector_store_only_with_progress_for_requests(trigger, op,
                                                                             progress):
    stores = fake_projections()
    stores.vectors.upsert([codec.fact_from_pb(pb_fact("o-gone", "Gone."), "b")])
    m = ev.ObservationsChanged(bank_id="b", operation_id=op, trigger=trigger, observations=[
        _obs("o-live", "Alice likes hiking."), _obs("o-gone", "Gone.", deleted=True)])
    out = search.on_observations_changed(m, meta(), stores=stores)
    assert out == ([ev.OperationProgress(bank_id="b", operation_id=op, kind="consolidate",
                                         state="succeeded")] if progress else [])
    assert stores.vectors.ids("b") == {"o-live"}
    unit = stores.vectors.units["b"]["o-live"]
    assert (unit.fact_type, unit.tags, unit.metadata["proof_count"]) == (
        "observation", ("t",), "1")
    assert stores.text.calls == [] and stores.graph.calls == []


# ==== consolidation (offline rules: the vectors travel in the events) ======================


class Consolidation:
    """A Consolidator over the in-memory ObservationStore, fed as the memory topic would
    be: each ObservationsChanged it emits comes back to it."""

    def __init__(self, config: BankConfig | None = None, llm=None):
        self.config = config or BankConfig()
        self.store = MemoryObservationStore()
        self.c = Consolidator(self.store, lambda bank_id: self.config,
                              embedder=FakeEmbedder(), llm=llm)
        self.n = 0

    def send(self, msg, decide: bool = True) -> list:
        self.n += 1
        out = on_memory_event(msg, meta(self.n, T0 + timedelta(minutes=self.n)),
                              consolidator=self.c, decide=decide)
        for o in out:
            assert on_memory_event(o, meta(1000 + self.n), consolidator=self.c) == []
        return out

    def live(self):
        return list(self.store.observations("b").values())


HIKING = "Alice loves hiking in the mountains."
HIKING2 = "Alice loves hiking in the high mountains."
TEA = "Bob drinks green tea every morning."


def test_a_new_fact_creates_an_observation_and_a_paraphrase_reinforces_it():
    h = Consolidation()
    (ch,) = h.send(_facts_extracted(pb_fact("f1", HIKING, tags=["t"], entities=["Alice"])))
    assert (ch.bank_id, ch.operation_id, ch.trigger, ch.decided_by) == ("b", "op-r", "auto",
                                                                       "offline")
    assert list(ch.consolidated_memory_ids) == ["f1"]
    (o,) = ch.observations
    assert (o.text, list(o.scope), o.proof_count, o.version) == (HIKING, ["t"], 1, 1)
    assert [(e.memory_id, e.quote) for e in o.evidence] == [("f1", HIKING)]
    assert o.embedding_model == "fake-embedder"
    (ch2,) = h.send(_facts_extracted(pb_fact("f2", HIKING2, tags=["t"], entities=["Alice"]),
                                     op="op-2"))
    (o2,) = ch2.observations
    assert o2.id == o.id and o2.proof_count == 2 and o2.version == 2
    assert {e.memory_id for e in o2.evidence} == {"f1", "f2"}
    # a different statement (orthogonal vector) is an observation of its own
    (ch3,) = h.send(_facts_extracted(pb_fact("f3", TEA, tags=["t"], emb=vec(0, 0, 1, 0),
                                             entities=["Bob"]), op="op-3"))
    assert len(h.live()) == 2 and ch3.observations[0].id != o.id


def test_the_same_input_decides_the_same_observation_ids():
    a, b = Consolidation(), Consolidation()
    m = _facts_extracted(pb_fact("f1", HIKING, tags=["t"]))
    assert a.send(m) == b.send(m)


def test_a_replica_restored_from_the_memory_topic_decides_on_like_the_previous_owner():
    # Owner A decides f1 and f2, and f1 only is committed before it dies: the memory topic
    # holds f1, A's decision, f2, A's decision. Replica B restores the whole partition
    # (nothing decided), then handles from A's committed offset: f2 again is no new
    # decision, and the next fact is decided exactly as A would have.
    a = Consolidation()
    f1 = _facts_extracted(pb_fact("f1", HIKING, tags=["t"], entities=["Alice"]))
    f2 = _facts_extracted(pb_fact("f2", TEA, tags=["t"], emb=vec(0, 0, 1, 0)), op="op-2")
    f3 = _facts_extracted(pb_fact("f3", HIKING2, tags=["t"], entities=["Alice"]), op="op-3")
    log = [f1, *a.send(f1), f2, *a.send(f2)]
    b = Consolidation()
    for n, m in enumerate(log):
        assert on_memory_restore(m, meta(50 + n), consolidator=b.c) == []
    assert b.live() == a.live()
    b.n = 1  # the same event times as A's (decisions record them)
    assert b.send(f2) == []  # redelivered after the takeover: already decided
    assert b.send(f3) == a.send(f3)


def test_a_retracted_memory_deletes_the_observations_it_supported():
    h = Consolidation()
    h.send(_facts_extracted(pb_fact("f1", HIKING, entities=["Alice"])))
    (ch,) = h.send(ev.FactsRetracted(bank_id="b", operation_id="op-m", memory_ids=["f1"]))
    assert ch.trigger == "retract" and ch.operation_id == "op-m"
    (o,) = ch.observations
    # the deletion carries none of the content: it stays readable once its keys are gone
    assert o.deleted and o.id and o.version == 2
    assert not (o.text or o.evidence or o.history or o.embedding or o.entities or o.seal.keys)
    assert h.live() == [] and h.store.facts("b") == []


def test_a_retracted_document_takes_its_facts_and_observations_with_it():
    h = Consolidation()
    h.send(_facts_extracted(pb_fact("f1", HIKING, doc="d"), pb_fact(
        "f2", TEA, emb=vec(0, 0, 1, 0))))
    (ch,) = h.send(ev.FactsRetracted(bank_id="b", operation_id="op-d", document_id="d"))
    assert [o.deleted for o in ch.observations] == [True]
    assert [f.id for f, _ in h.store.facts("b")] == ["f2"] and len(h.live()) == 1


def test_a_deleted_bank_empties_the_projection_and_emits_nothing():
    h = Consolidation()
    h.send(_facts_extracted(pb_fact("f1", HIKING)))
    assert h.send(ev.FactsRetracted(bank_id="b", bank_deleted=True)) == []
    assert h.live() == [] and h.store.facts("b") == []


def test_replay_rebuilds_the_projection_and_decides_nothing():
    live = Consolidation()
    facts = _facts_extracted(pb_fact("f1", HIKING, tags=["t"]))
    (ch,) = live.send(facts)
    replay = Consolidation()
    assert replay.send(facts, decide=False) == []
    assert replay.send(ch, decide=False) == []
    assert replay.send(ev.ConsolidationScheduled(bank_id="b", operation_id="c",
                                                 action="reconsolidate"), decide=False) == []
    assert replay.store.dump("b") == live.store.dump("b")
    assert replay.store.facts("b", pending=True) == []


def test_with_auto_consolidate_off_facts_wait_and_observations_go_stale_until_a_request():
    h = Consolidation()
    h.send(_facts_extracted(pb_fact("f1", HIKING, tags=["t"], entities=["Alice"])))
    h.config = BankConfig(auto_consolidate=False)
    (ch,) = h.send(_facts_extracted(pb_fact("f2", HIKING2, tags=["t"], entities=["Alice"]),
                                    op="op-2"))
    assert [o.stale for o in ch.observations] == [True] and not ch.consolidated_memory_ids
    assert [f.id for f, _ in h.store.facts("b", pending=True)] == ["f2"]
    (done,) = h.send(ev.ConsolidationScheduled(bank_id="b", operation_id="op-c",
                                               action="consolidate"))
    assert (done.trigger, done.operation_id, list(done.consolidated_memory_ids)) == (
        "consolidate", "op-c", ["f2"])
    (o,) = h.live()
    assert not o.stale and o.proof_count == 2


def test_a_request_with_nothing_to_do_still_reports_its_trigger():
    # search completes the Consolidate operation on this event, so it must come
    (ch,) = Consolidation().send(ev.ConsolidationScheduled(bank_id="b", operation_id="op-c",
                                                           action="consolidate"))
    assert (ch.trigger, ch.operation_id, list(ch.observations)) == ("consolidate", "op-c", [])


def test_clear_deletes_every_observation_and_resets_the_facts():
    h = Consolidation()
    h.send(_facts_extracted(pb_fact("f1", HIKING)))
    (ch,) = h.send(ev.ConsolidationScheduled(bank_id="b", operation_id="op-c", action="clear"))
    assert [o.deleted for o in ch.observations] == [True]
    assert list(ch.reset_memory_ids) == ["f1"] and h.live() == []
    assert [f.id for f, _ in h.store.facts("b", pending=True)] == ["f1"]


def test_a_failing_model_falls_back_to_the_offline_rules():
    llm = FakeLlm(("consolidation",))  # unscripted: every call raises LlmUnavailable
    h = Consolidation(llm=llm)
    (ch,) = h.send(_facts_extracted(pb_fact("f1", HIKING)))
    assert ch.decided_by == "offline" and [o.text for o in ch.observations] == [HIKING]
    assert llm.calls  # it was asked


# ==== through the Router, as the runtimes run them ========================================


def _fake_root(tmp_path, distributed: bool):
    """A :class:`bootstrap.Root` whose adapters are the in-memory fakes (nothing opened)."""
    from mneme.config import Settings
    root = bootstrap.Root.__new__(bootstrap.Root)
    root.settings = Settings(data_dir=tmp_path, bus_url="kafka://127.0.0.1:1" if distributed
                             else "", search_address="127.0.0.1:1")
    root.data_dir, root._lock_fd, root._closers = tmp_path, None, []
    root.reembedding = root.rebuilding = False
    root.__dict__.update(log=object(), raw_log=object(), catalog=MemoryCatalog(),
                         documents=MemoryDocumentStore(),
                         embedder=FakeEmbedder(),
                         stores=fake_projections(), resolver=EntityResolver(MemoryEntityStore()),
                         llm=FakeLlm(()), keyring=_memory_keyring())
    return root


def _memory_keyring():
    from mneme.keys import Keyring, LocalKms
    from mneme.stores.keys_sqlite import SqliteKeyStore
    return Keyring(SqliteKeyStore(":memory:"), LocalKms(bytes(32)))


def _root_deps(tmp_path, monkeypatch, distributed: bool) -> dict[str, dict]:
    """service → the deps the composition root binds its routers with (every builder run
    over a fake Root)."""
    seen: dict[str, dict] = {}
    real = bootstrap._routers

    def recording(root, name, **deps):
        seen[name] = deps
        return real(root, name, **deps)

    monkeypatch.setattr(bootstrap, "_routers", recording)
    root = _fake_root(tmp_path, distributed)
    try:
        for name, build in bootstrap.BUILDERS.items():
            kw = {"recall": lambda q: None, "bank_exists": lambda b: True} \
                if name == "reflect" else {}
            parts = build(root, **kw)
            want = [g.name for g in bootstrap.services()[name].groups
                    if distributed or not g.distributed_only]
            assert list(parts.routers) == want
            assert all(isinstance(r, Router) for r in parts.routers.values())
    finally:
        root.close()
    return seen


def _handlers():
    """(service, group, event type, handler) of every route."""
    return [(s, g, t, fn) for s in bootstrap.services().values() for g in s.groups
            for topic in g.consumes.values() for t, fn in topic.items()]


@pytest.mark.parametrize("distributed", [False, True], ids=["embedded", "distributed"])
def test_every_handler_binds_with_the_composition_roots_deps(tmp_path, monkeypatch,
                                                            distributed):
    deps = _root_deps(tmp_path, monkeypatch, distributed)
    for s, g, t, fn in _handlers():
        if g.distributed_only and not distributed:
            continue
        for p in inspect.signature(fn).parameters.values():
            if p.kind is not p.KEYWORD_ONLY:
                continue
            # a defaulted dependency may be absent only where the process shares it
            # (the embedded catalog); otherwise a misspelt name would go unbound silently
            assert p.name in deps[s.name] or (not distributed and p.name == "catalog"), (
                f"{s.name}/{g.name} {t.DESCRIPTOR.name}: {fn.__qualname__} gets no "
                f"{p.name!r} from bootstrap.build_{s.name}")


class _NoModelsDue:
    """reflect's mental models with none due for a refresh."""

    def refresh_due(self, bank_id, consolidated, now):
        return []


class _EmptyLog:
    """An event log with nothing after the record handled (no cancellation)."""

    def end_offset(self, topic, partition):
        return 0

    def read(self, topic, partition, offset, limit=100):
        return []


def fake_deps(service: str) -> dict:
    """The deps of ``service``'s routers in the distributed topology, as fakes (the names
    are checked against the composition root's below)."""
    catalog, keyring = MemoryCatalog(), _memory_keyring()
    return {
        "ingest": lambda: {"catalog": catalog, "keyring": keyring},
        "extraction": lambda: {"extractor": FakeExtractor(), "embedder": FakeEmbedder(),
                               "resolver": EntityResolver(MemoryEntityStore()),
                               "catalog": catalog, "keyring": keyring,
                               "cancels": CancelWatch(_EmptyLog()), "part_bytes": PART_BYTES},
        "search": lambda: {"stores": fake_projections(), "catalog": catalog, "keyring": keyring,
                           "documents": MemoryDocumentStore()},
        "reflect": lambda: {"catalog": catalog, "keyring": keyring,
                            "mental_models": _NoModelsDue(),
                            "opinions": OpinionFormer(None, None, lambda bank_id: None)},
        "consolidation": lambda: {"consolidator": Consolidator(
            MemoryObservationStore(), lambda bank_id: None, embedder=FakeEmbedder()),
            "decide": True, "catalog": catalog, "keyring": keyring},
    }[service]()


def test_the_fake_deps_name_what_the_root_gives(tmp_path, monkeypatch):
    deps = _root_deps(tmp_path, monkeypatch, distributed=True)
    for name in bootstrap.SERVICES:
        assert set(fake_deps(name)) == set(deps.get(name, {})), name


#: One input of every type some group consumes.
SAMPLES = {
    ev.BankUpserted: ev.BankUpserted(bank_id="b", display_name="B",
                                     config=codec.bank_config_to_pb(BankConfig())),
    ev.BankDeleted: ev.BankDeleted(bank_id="b"),
    ev.DirectiveChanged: ev.DirectiveChanged(bank_id="b", id="d1", text="Answer in German.",
                                             active=True, tags=["travel"]),
    ev.MentalModelChanged: ev.MentalModelChanged(bank_id="b", id="m1", display_name="Home",
                                                 source_query="Where does Alice live?"),
    ev.RetainRequested: retain(item("Alice moved to Lisbon."), item("Bob likes tea.")),
    ev.DocumentDeleteRequested: ev.DocumentDeleteRequested(bank_id="b", operation_id="op-d",
                                                           document_id="d"),
    ev.MemoryDeleteRequested: ev.MemoryDeleteRequested(bank_id="b", operation_id="op-m",
                                                       memory_id="f1"),
    ev.ConsolidationRequested: ev.ConsolidationRequested(bank_id="b", operation_id="op-c",
                                                         action="consolidate"),
    ev.OperationCancelRequested: ev.OperationCancelRequested(bank_id="b", operation_id="op-r"),
    ev.OperationProgress: ev.OperationProgress(bank_id="b", operation_id="op-r", kind="retain",
                                               state="succeeded", items_total=1, items_done=1),
    ev.FactsExtracted: _facts_extracted(pb_fact("f1", HIKING), pb_fact("f2", TEA,
                                                                         emb=vec(0, 0, 1, 0))),
    ev.FactsRetracted: ev.FactsRetracted(bank_id="b", operation_id="op-m", memory_ids=["f1"]),
    ev.ConsolidationScheduled: ev.ConsolidationScheduled(bank_id="b", operation_id="op-c",
                                                         action="consolidate"),
    ev.ObservationsChanged: ev.ObservationsChanged(
        bank_id="b", operation_id="op-c", trigger="consolidate",
        observations=[_obs("o1", HIKING)]),
    ev.ReflectionRecorded: ev.ReflectionRecorded(bank_id="b", query="Why?", answer="Because.",
                                                 based_on=["f1"], extractive=True),
    ev.OpinionsChanged: ev.OpinionsChanged(
        bank_id="b", operation_id="op-o", trigger="delete_opinion",
        opinions=[ev.Opinion(id="p1", version=2, deleted=True)]),
    ev.EntityMergeRequested: ev.EntityMergeRequested(
        bank_id="b", operation_id="op-em", survivor_id="e1", merged_ids=["e2"],
        display_name="Alice Smith"),
    ev.EntitySplitRequested: ev.EntitySplitRequested(
        bank_id="b", operation_id="op-es", entity_id="e1", new_entity_id="e3",
        aliases=["ally"], memory_ids=["f1"], display_name="Ally"),
    ev.EntitiesMerged: ev.EntitiesMerged(bank_id="b", operation_id="op-em", survivor_id="e1",
                                         merged_ids=["e2"], display_name="Alice Smith"),
    ev.EntitySplit: ev.EntitySplit(bank_id="b", operation_id="op-es", entity_id="e1",
                                   new_entity_id="e3", aliases=["ally"], memory_ids=["f1"],
                                   display_name="Ally"),
    ev.VectorsReplaced: ev.VectorsReplaced(
        bank_id="b", embedding_model="fake", previous_model="older",
        units=[ev.UnitVector(id="f1", fact_type="world", vector=vec(0, 1, 0, 0))]),
}

#: What each route yields for its sample on fresh state (output type names, in order).
EXPECTED = {
    ("extraction", ev.BankDeleted): ["FactsRetracted"],
    ("extraction", ev.RetainRequested): ["FactsExtracted"],
    ("extraction", ev.DocumentDeleteRequested): ["FactsRetracted"],
    ("extraction", ev.MemoryDeleteRequested): ["FactsRetracted"],
    ("extraction", ev.ConsolidationRequested): ["ConsolidationScheduled"],
    ("extraction", ev.EntityMergeRequested): ["EntitiesMerged"],
    ("extraction", ev.EntitySplitRequested): ["EntitySplit"],
    ("search", ev.EntitiesMerged): ["OperationProgress"],
    ("search", ev.EntitySplit): ["OperationProgress"],
    ("search", ev.FactsExtracted): ["OperationProgress"],
    ("search", ev.FactsRetracted): ["OperationProgress"],
    ("search", ev.ObservationsChanged): ["OperationProgress"],
    ("search", ev.OpinionsChanged): ["OperationProgress"],
    ("consolidation", ev.FactsExtracted): ["ObservationsChanged"],
    ("consolidation", ev.ConsolidationScheduled): ["ObservationsChanged"],
}  # every other route is a projection that produces nothing

TRACEPARENT = "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01"


def record(msg, event_id: str, offset: int = 0, traceparent: str | None = TRACEPARENT) -> Record:
    """``msg`` as a consumer reads it from the log."""
    out = codec.encode(msg, bank_id=msg.bank_id, source="mneme/test", event_id=event_id,
                       time=T0, traceparent=traceparent)
    return Record(out.topic, 0, offset, out.key, out.value, out.headers, T0.timestamp())


def deliver(router: Router, msg, event_id: str = "in-1") -> list:
    rec = record(msg, event_id)
    return router(codec.decode(rec), rec)


def decoded(out) -> list:
    return [codec.decode(Record(o.topic, 0, 0, o.key, o.value, o.headers)).message for o in out]


def _stable(out) -> list:
    return [(o.topic, o.key, o.value, {k: v for k, v in o.headers.items() if k != "ce_time"})
            for o in out]


ROUTES = [(s.name, g.name, t) for s, g, t, _ in _handlers()]


@pytest.mark.parametrize("service,group,etype", ROUTES,
                         ids=[f"{s}/{g}/{t.DESCRIPTOR.name}" for s, g, t in ROUTES])
def test_each_route_outputs_declared_types_with_ids_derived_from_its_input(service, group,
                                                                           etype):
    svc = bootstrap.services()[service]
    msg = SAMPLES[etype]  # a KeyError here: a new route needs a sample
    router = Router(svc, group, fake_deps(service))
    assert router.handles(msg)
    out = deliver(router, msg)
    assert [type(m).__name__ for m in decoded(out)] == EXPECTED.get((service, etype), [])
    for n, (o, m) in enumerate(zip(out, decoded(out))):
        assert type(m) in svc.produces[o.topic]
        assert o.key == m.bank_id == "b"
        assert o.headers["ce_source"] == f"mneme/{service}"
        assert o.headers["ce_type"] == codec.event_type(m)
        assert o.headers["traceparent"] == TRACEPARENT
        same_type = [x for x in decoded(out)[:n] if type(x) is type(m)]
        assert o.headers["ce_id"] == derive_id("in-1", group, m.DESCRIPTOR.name, len(same_type))
    # replay on fresh state: the very same records
    assert _stable(deliver(Router(svc, group, fake_deps(service)), msg)) == _stable(out)


@pytest.mark.parametrize("service,group,etype", ROUTES,
                         ids=[f"{s}/{g}/{t.DESCRIPTOR.name}" for s, g, t in ROUTES])
def test_redelivery_on_the_same_state_repeats_the_ids(service, group, etype):
    svc = bootstrap.services()[service]
    router = Router(svc, group, fake_deps(service))
    first = {o.headers["ce_id"] for o in deliver(router, SAMPLES[etype])}
    again = {o.headers["ce_id"] for o in deliver(router, SAMPLES[etype])}
    assert again <= first  # idempotent handlers may have nothing left to say


def test_a_missing_dependency_fails_when_the_router_is_built():
    svc = bootstrap.services()["extraction"]
    deps = fake_deps("extraction")
    del deps["embedder"]
    with pytest.raises(ValueError, match="embedder"):
        Router(svc, "extraction", deps)


def test_an_undeclared_output_is_refused_and_unhandled_types_yield_nothing():
    svc = Service("probe", groups=(Group("probe", {"mneme.intake.v1": {
        ev.BankDeleted: lambda m, meta: [ev.OperationProgress(bank_id=m.bank_id)]}}),),
        produces={"mneme.memory.v1": (ev.FactsRetracted,)})
    router = Router(svc, "probe", {})
    with pytest.raises(TypeError, match="does not declare"):
        deliver(router, ev.BankDeleted(bank_id="b"))
    assert deliver(router, ev.BankUpserted(bank_id="b")) == []
    rec = replace(record(ev.BankDeleted(bank_id="b"), "x"),
                  headers={**record(ev.BankDeleted(bank_id="b"), "x").headers,
                           "ce_type": "mneme.events.v1.FromTheFuture"})
    assert router(codec.decode(rec), rec) == []


def test_events_without_a_ce_id_get_distinct_output_ids_that_redelivery_keeps():
    # Hand-written external events may lack ce_id: their position stands in for it.
    router = Router(bootstrap.services()["extraction"], "extraction", fake_deps("extraction"))
    ids = []
    for offset in (7, 8, 7):
        msg = ev.DocumentDeleteRequested(bank_id="b", operation_id="op", document_id="d")
        base = record(msg, "x")
        rec = Record(base.topic, 0, offset, base.key, base.value,
                     {k: v for k, v in base.headers.items() if k != "ce_id"}, T0.timestamp())
        [out] = router(codec.decode(rec), rec)
        ids.append(out.headers["ce_id"])
    assert ids[0] != ids[1] and ids[0] == ids[2]


def test_a_retain_end_to_end_through_the_routers():
    """RetainRequested → ingest (pending) → extraction → search and consolidation →
    progress → ingest (succeeded), each hop an encoded record, as on the log."""
    services = bootstrap.services()
    deps = {n: fake_deps(n) for n in bootstrap.SERVICES}
    catalog = deps["ingest"]["catalog"]
    stores = deps["search"]["stores"]
    r = {n: Router(services[n], n, deps[n])
         for n in ("ingest", "extraction", "search", "consolidation")}

    def hop(router, out_record, offset):
        rec = Record(out_record.topic, 0, offset, out_record.key, out_record.value,
                     out_record.headers, T0.timestamp())
        return router(codec.decode(rec), rec)

    request = codec.encode(retain(item("Alice loves hiking in the mountains.", tags=["t"]),
                                  item("Bob drinks green tea every morning.")),
                           bank_id="b", source="mneme/ingest", time=T0)
    assert hop(r["ingest"], request, 0) == []
    assert catalog.get_operation("op-r").state == "pending"
    (facts,) = hop(r["extraction"], request, 0)
    (progress,) = hop(r["search"], facts, 0)
    assert [s.count("b") for s in stores.all()] == [2, 2, 2]
    assert hop(r["ingest"], progress, 0) == []
    op = catalog.get_operation("op-r")
    assert (op.state, op.items_total, op.facts) == ("succeeded", 2, 2)
    assert sorted(op.memory_ids) == sorted(stores.text.ids("b"))
    (change,) = hop(r["consolidation"], facts, 0)
    assert hop(r["consolidation"], change, 1) == []  # its own decision comes back: no-op
    assert hop(r["search"], change, 1) == []  # trigger "auto": no operation to finish
    observations = [f for f in stores.vectors.units["b"].values()
                    if f.fact_type == "observation"]
    assert sorted(o.text for o in observations) == sorted(f.text for f in decoded([facts])[0].facts)
    assert stores.text.count("b") == 2  # observations are not in the text store


def test_no_write_is_appended_after_a_bank_deletion_whose_wait_ran_out():
    """A DeleteBank whose catalog wait runs out (a stalled catalog consumer) still bars
    writes to the bank until the catalog has dropped it: a retain appended after the
    BankDeleted would be stored into no bank, and show up in the bank made again."""
    from mneme.errors import DeadlineExceeded

    class Stalled(_Log):
        projected = 0  # how many records the catalog's consumer has committed

        def committed(self, group, topic, partition):
            return self.projected

    log, catalog = Stalled(), MemoryCatalog()
    catalog.upsert_bank("b", "", BankConfig(), 0.0)
    cmd = ingest.Ingest(log, catalog, source="mneme/ingest", poll_s=0.01)
    with pytest.raises(DeadlineExceeded):
        cmd.delete_bank("b", timeout=0.05)
    assert catalog.get_bank("b") is not None  # not projected yet
    with pytest.raises(NotFound, match="being deleted"):
        cmd.retain("b", [RetainItem(content="late", timestamp=T0)], wait=False)
    with pytest.raises(NotFound, match="being deleted"):
        cmd.update_bank("b", "", BankConfig(retain_mission="m"), ["config.retain_mission"])
    assert [codec.decode(r).message.DESCRIPTOR.name for r in log.appended] == ["BankDeleted"]
    log.projected = len(log.appended)  # the catalog catches up and drops the bank
    catalog.delete_bank("b")
    with pytest.raises(NotFound, match="not found"):
        cmd.retain("b", [RetainItem(content="late", timestamp=T0)], wait=False)
    assert len(log.appended) == 1


def test_a_second_bank_deletion_before_the_catalog_drops_the_bank_appends_nothing():
    """A DeleteBank repeated while the catalog still holds the bank (the first one's wait
    ran out) is NOT_FOUND "being deleted", as every other write then is: it neither
    destroys the bank's keys again nor appends a second BankDeleted (whose operation
    would report a deletion of nothing as done)."""
    from mneme.errors import DeadlineExceeded

    class Stalled(_Log):
        projected = 0

        def committed(self, group, topic, partition):
            return self.projected

    class Keys:
        destroyed: list = []

        def destroy_bank(self, bank_id, pending=None):
            self.destroyed.append(bank_id)

        def pending_deletions(self, bank_id=None):
            return []

        def clear_pending(self, bank_id, operation_id):
            pass

    log, catalog, keys = Stalled(), MemoryCatalog(), Keys()
    catalog.upsert_bank("b", "", BankConfig(), 0.0)
    cmd = ingest.Ingest(log, catalog, source="mneme/ingest", poll_s=0.01, keys=keys)
    with pytest.raises(DeadlineExceeded):
        cmd.delete_bank("b", timeout=0.05)
    with pytest.raises(NotFound, match="being deleted"):
        cmd.delete_bank("b", timeout=0.05)
    assert [codec.decode(r).message.DESCRIPTOR.name for r in log.appended] == ["BankDeleted"]
    assert keys.destroyed == ["b"]
    # once the catalog has dropped it, the bank is simply not found
    log.projected = len(log.appended)
    catalog.delete_bank("b")
    with pytest.raises(NotFound, match="not found"):
        cmd.delete_bank("b", timeout=0.05)
    assert len(log.appended) == 1 and keys.destroyed == ["b"]


def test_a_request_id_reused_for_other_items_is_refused_also_from_the_log():
    """A retain's request_id sent again with other items (a second process, or after a
    restart: only the catalog and the log know the first request) is InvalidArgument
    naming request_id; the exact repeat, also of items ingest stamped with their arrival
    time, answers the first operation; nothing more is appended."""
    from mneme.errors import InvalidArgument

    class Readable(_Log):
        def read(self, topic, partition, offset, limit):  # as opened: seal.keys kept
            out = []
            for i, r in enumerate(self.appended[offset:offset + limit], offset):
                msg = codec.decode(r).message
                for it in msg.items:
                    it.seal.keys.append("d:r-1#1")
                out.append(Record(r.topic, 0, i, r.key, msg.SerializeToString(), r.headers, 0.0))
            return out

    log, catalog = Readable(), MemoryCatalog()
    catalog.upsert_bank("b", "", BankConfig(), 0.0)
    first = [RetainItem(content="Ivy plays the cello.", timestamp=T0, tags=("music",)),
             RetainItem(content="Ivy lives in Graz.", timestamp=datetime.now(timezone.utc))]
    op = ingest.Ingest(log, catalog, source="mneme/ingest").retain(
        "b", first, wait=False, request_id="r-1")
    (rec,) = log.appended
    ingest.on_operation_requested(codec.decode(rec).message,
                                  replace(meta(1), position=(rec.topic, 0, 0)), catalog=catalog)
    later = ingest.Ingest(log, catalog, source="mneme/ingest")  # another process
    stamped_again = [first[0], replace(first[1], timestamp=datetime.now(timezone.utc))]
    assert later.retain("b", stamped_again, wait=False, request_id="r-1").operation_id == \
        op.operation_id
    for other in ([first[0]], [replace(first[0], content="Jon plays the drums."), first[1]],
                  [replace(first[0], tags=()), first[1]]):
        with pytest.raises(InvalidArgument) as e:
            later.retain("b", other, wait=False, request_id="r-1")
        assert [f for f, _ in e.value.violations] == ["request_id"]
    assert len(log.appended) == 1


def test_a_write_whose_caller_stopped_waiting_appends_nothing_and_destroys_no_key():
    """A write that reaches ingest after its caller's deadline passed (or the caller
    cancelled) was carried out although the caller had been told DEADLINE_EXCEEDED: a
    retry then created a second directive, or retained the items twice. Ingest checks
    the call before writing anything (the append, and a deletion's keys before it)."""
    import time as _time

    from mneme import deadline
    from mneme.domain import Directive
    from mneme.errors import DeadlineExceeded

    class Keys:
        destroyed: list = []

        def destroy_bank(self, bank_id, pending=None):
            self.destroyed.append(bank_id)

        destroy_scope = destroy = lambda self, *a: self.destroyed.append(a)

        def pending_deletions(self, bank_id=None):
            return []

    log, catalog, keys = _Log(), MemoryCatalog(), Keys()
    catalog.upsert_bank("b", "", BankConfig(), 0.0)
    cmd = ingest.Ingest(log, catalog, source="mneme/ingest", keys=keys)
    writes = [lambda: cmd.retain("b", [RetainItem(content="a", timestamp=T0)], wait=False),
              lambda: cmd.create_directive(Directive(id="", bank_id="b", text="Be brief.")),
              lambda: cmd.upsert_bank("c", "", BankConfig()),
              lambda: cmd.update_bank("b", "B", BankConfig(), ["display_name"]),
              lambda: cmd.delete_document("b", "d", wait=False),
              lambda: cmd.delete_memory("b", "m", wait=False),
              lambda: cmd.delete_bank("b"),
              lambda: cmd.consolidate("b", wait=False)]
    for expired in (deadline.Deadline(_time.monotonic() - 1),
                    deadline.Deadline(None, lambda: False)):  # the caller went away
        with deadline.bind(expired):
            for write in writes:
                with pytest.raises((DeadlineExceeded, Cancelled)):
                    write()
    assert log.appended == [] and Keys.destroyed == []


def test_sync_writes_beyond_the_bound_are_refused_before_they_write_anything():
    """Each sync write holds a gRPC worker thread while it waits for its operation: at
    most ``sync_calls`` wait at once, the next one is RESOURCE_EXHAUSTED before it
    appends (so reads keep threads); async writes and slots freed by ended waits go on."""
    import threading

    from mneme.errors import ResourceExhausted
    class Unprojected(_Log):  # the catalog's consumer never gets there: waits go on
        def committed(self, group, topic, partition):
            return 0

    catalog = ingest.CatalogChanges(MemoryCatalog())
    catalog.upsert_bank("b", "", BankConfig(), 0.0)
    log = Unprojected()
    cmd = ingest.Ingest(log, catalog, source="mneme/ingest", poll_s=0.01,
                        slots=WaitSlots(2))
    waiting = [threading.Thread(target=lambda: pytest.raises(
        DeadlineExceeded, cmd.retain, "b", [RetainItem(content="w", timestamp=T0)],
        timeout=1.5), daemon=True) for _ in range(2)]
    for t in waiting:
        t.start()
    while len(log.appended) < 2:  # both appended, now waiting (nothing ends them)
        time.sleep(0.01)
    for call in (lambda: cmd.retain("b", [RetainItem(content="x", timestamp=T0)]),
                 lambda: cmd.delete_document("b", "d"),
                 lambda: cmd.delete_memory("b", "m"),
                 lambda: cmd.consolidate("b"),
                 lambda: cmd.delete_bank("b")):
        with pytest.raises(ResourceExhausted, match="MNEME_SYNC_CALLS"):
            call()
    assert len(log.appended) == 2  # the refused ones wrote nothing
    cmd.retain("b", [RetainItem(content="async", timestamp=T0)], wait=False)
    assert len(log.appended) == 3
    for t in waiting:
        t.join(10)
    assert cmd.slots.waiting == 0  # the ended waits gave their slots back
    with pytest.raises(DeadlineExceeded):  # a slot again: it appends, then waits
        cmd.retain("b", [RetainItem(content="y", timestamp=T0)], timeout=0.2)
    assert len(log.appended) == 4


def test_an_async_write_waits_for_the_catalog_only_on_a_free_slot():
    """An async retain waits (up to ASYNC_PROJECTED_S) for the catalog to hold its
    operation, read-your-writes; with a stalled catalog that wait held a gRPC thread for
    5 s, bounded by nothing. It holds a slot now: with none free it does not wait at all
    (nor is it refused: the write is durable) and returns the pending operation."""
    from mneme.slots import WaitSlots
    class Unprojected(_Log):  # the catalog's consumer is stalled
        polls = 0

        def committed(self, group, topic, partition):
            Unprojected.polls += 1
            return 0

    catalog = ingest.CatalogChanges(MemoryCatalog())
    catalog.upsert_bank("b", "", BankConfig(), 0.0)
    log = Unprojected()
    slots = WaitSlots(1)
    cmd = ingest.Ingest(log, catalog, source="mneme/ingest", poll_s=0.01, slots=slots)
    with slots.hold("other"):  # every slot taken
        op = cmd.retain("b", [RetainItem(content="async", timestamp=T0)], wait=False)
    assert op.state == "pending" and len(log.appended) == 1
    assert Unprojected.polls == 0  # no wait on the catalog
    assert slots.waiting == 0
    from mneme import deadline
    with deadline.bind(deadline.Deadline(time.monotonic() + 0.3)):  # a free slot: it
        cmd.retain("b", [RetainItem(content="async 2", timestamp=T0)], wait=False)  # waits
    assert Unprojected.polls > 0 and slots.waiting == 0


def test_a_banks_sync_writes_take_its_share_of_the_slots_and_leave_the_rest():
    """Sync writes of one bank hold at most its share of the slots
    (MNEME_SYNC_CALLS_PER_TENANT): the next write to that bank is RESOURCE_EXHAUSTED naming
    MNEME_SYNC_CALLS_PER_TENANT before it appends, while a write to another bank
    (directives too, whose bank is on the directive) still gets a slot."""
    import threading

    from mneme.errors import ResourceExhausted
    class Unprojected(_Log):
        def committed(self, group, topic, partition):
            return 0

    catalog = ingest.CatalogChanges(MemoryCatalog())
    for b in ("b", "c"):
        catalog.upsert_bank(b, "", BankConfig(), 0.0)
    log = Unprojected()
    cmd = ingest.Ingest(log, catalog, source="mneme/ingest", poll_s=0.01,
                        slots=WaitSlots(4, share=2))
    waiting = [threading.Thread(target=lambda: pytest.raises(
        DeadlineExceeded, cmd.retain, "b", [RetainItem(content="w", timestamp=T0)],
        timeout=1.5), daemon=True) for _ in range(2)]
    for t in waiting:
        t.start()
    while len(log.appended) < 2:
        time.sleep(0.01)
    for call in (lambda: cmd.retain("b", [RetainItem(content="x", timestamp=T0)]),
                 lambda: cmd.delete_document("b", "d"),
                 lambda: cmd.create_directive(Directive(bank_id="b", id="", text="r"))):
        with pytest.raises(ResourceExhausted, match="MNEME_SYNC_CALLS_PER_TENANT"):
            call()
    assert len(log.appended) == 2
    with pytest.raises(DeadlineExceeded):  # bank c has its own share: it appends, waits
        cmd.retain("c", [RetainItem(content="y", timestamp=T0)], timeout=0.2)
    assert len(log.appended) == 3
    for t in waiting:
        t.join(10)
    assert cmd.slots.waiting == 0


@pytest.mark.parametrize("store", [None, MemoryEntityStore, lambda: SqliteEntityStore(":memory:")])
def test_a_redelivered_retain_publishes_the_resolution_decisions_it_took_again(store):
    # Killed after the resolver saved a retain's decisions and before its outputs were
    # on the log: the redelivered retain finds them made. It must still publish them
    # (the changelog a replica restores from), as its first delivery would have.
    resolver = EntityResolver(store() if store else None)
    extractor = _ResolvingExtractor(resolver)
    m = _retain_named("op1", "Melanie paints.", "Mel swims.")
    first = extraction.on_retain_requested(m, meta(), extractor=extractor,
                                           embedder=FakeEmbedder(), resolver=resolver)
    again = extraction.on_retain_requested(m, meta(), extractor=extractor,
                                           embedder=FakeEmbedder(), resolver=resolver)
    assert [type(o).__name__ for o in again] == ["EntitiesResolved", "FactsExtracted"]
    assert again == first
    # another retain that decides nothing new still publishes nothing
    (only,) = extraction.on_retain_requested(_retain_named("op2", "Melanie again."), meta(2),
                                             extractor=extractor, embedder=FakeEmbedder(),
                                             resolver=resolver)
    assert isinstance(only, ev.FactsExtracted)


def test_a_replica_restored_after_a_killed_retain_resolves_like_the_one_that_decided(
        tmp_path):
    # Replica A decides a retain ("Mel" an alias of Melanie) and is killed before its
    # outputs reach the log; restarted on its entities.db, it gets the retain again. B
    # restores from what A's redelivery put on the log, takes the bank over, and must
    # resolve the next "Mel" to Melanie as A does.
    path = str(tmp_path / "entities.db")
    m = _retain_named("op1", "Melanie paints.", "Mel swims.")
    killed = EntityResolver(SqliteEntityStore(path))
    extraction.on_retain_requested(m, meta(), extractor=_ResolvingExtractor(killed),
                                   embedder=FakeEmbedder(), resolver=killed)  # outputs lost
    killed.close()
    a = EntityResolver(SqliteEntityStore(path))
    log = extraction.on_retain_requested(m, meta(), extractor=_ResolvingExtractor(a),
                                         embedder=FakeEmbedder(), resolver=a)
    b = EntityResolver(MemoryEntityStore())
    for out in log:
        if isinstance(out, ev.EntitiesResolved):
            extraction.on_entities_resolved(out, meta(), resolver=b)
    assert b.entities("b") == a.entities("b") and b.aliases("b") == a.aliases("b")
    nxt = _retain_named("op2", "Mel runs.")
    (fa,), (fb,) = (extraction.on_retain_requested(
        nxt, meta(2), extractor=_ResolvingExtractor(r), embedder=FakeEmbedder(), resolver=r)
        for r in (a, b))
    assert [e.id for f in fb.facts for e in f.entities] == [
        e.id for f in fa.facts for e in f.entities]
    a.close()


def test_a_retain_killed_between_its_resolutions_publishes_all_of_them_when_redelivered():
    # The first delivery resolved its first item (one store transaction) and stopped
    # (the process is stopping): the redelivery publishes the first item's decisions
    # with the second's.
    resolver = EntityResolver(MemoryEntityStore())

    class Stopping(_ResolvingExtractor):
        def _fact(self, bank_id, item, i, source_id):
            if i == 1:
                raise Cancelled("stopping")
            return super()._fact(bank_id, item, i, source_id)

    m = _retain_named("op1", "Melanie paints.", "Caroline swims.")
    with pytest.raises(Cancelled):
        extraction.on_retain_requested(m, meta(), extractor=Stopping(resolver),
                                       embedder=FakeEmbedder(), resolver=resolver)
    restarted = EntityResolver(resolver._store)
    resolved, _ = extraction.on_retain_requested(
        m, meta(), extractor=_ResolvingExtractor(restarted), embedder=FakeEmbedder(),
        resolver=restarted)
    assert [e.name for e in resolved.entities] == ["Melanie", "Caroline"]


def _two_documents_on_replica_a():
    """(extraction's restore routes of the memory topic, resolver A, resolver B, A's
    outputs) after A extracted one retain of d1 ("Melanie paints.") and d2 ("Caroline
    swims."); B has restored nothing yet."""
    from mneme.bus import MEMORY
    from services.extraction.routes import SERVICE
    a, b = EntityResolver(MemoryEntityStore()), EntityResolver(MemoryEntityStore())
    log = extraction.on_retain_requested(ev.RetainRequested(bank_id="b", operation_id="op1", items=[
        ev.RetainItem(content="Melanie paints.", document_id="d1"),
        ev.RetainItem(content="Caroline swims.", document_id="d2")]), meta(1),
        extractor=_ResolvingExtractor(a), embedder=FakeEmbedder(), resolver=a)
    return SERVICE.groups[0].restore[MEMORY], a, b, log


@pytest.mark.parametrize("deletion", ["memory", "document"])
def test_a_replica_restored_after_a_deletion_resolves_like_the_one_that_deleted(deletion):
    # A forgets the entities only a deleted memory (document) named; B, restored from the
    # memory topic through extraction's restore routes, must forget them too, or the next
    # "Mel" is Melanie's alias on B and a new entity on A.
    restore, a, b, log = _two_documents_on_replica_a()
    [melanie] = [f for f in log[-1].facts if "Melanie" in f.text]
    if deletion == "memory":
        log += extraction.on_memory_delete_requested(ev.MemoryDeleteRequested(
            bank_id="b", operation_id="op-m", memory_id=melanie.id), meta(2), resolver=a)
    else:
        log += extraction.on_document_delete_requested(ev.DocumentDeleteRequested(
            bank_id="b", operation_id="op-d", document_id="d1"), meta(2), resolver=a)
    for m in log:
        if type(m) in restore:
            assert restore[type(m)](m, meta(), resolver=b) == []
    assert b.entities("b") == a.entities("b")
    nxt = _retain_named("op9", "Mel runs.")
    fa, fb = (extraction.on_retain_requested(
        nxt, meta(9), extractor=_ResolvingExtractor(r), embedder=FakeEmbedder(),
        resolver=r)[-1] for r in (a, b))
    assert [e.id for f in fb.facts for e in f.entities] == [
        e.id for f in fa.facts for e in f.entities]


@pytest.mark.parametrize("store", [MemoryEntityStore, lambda: SqliteEntityStore(":memory:")])
def test_a_replica_restored_from_a_sealed_log_forgets_what_a_memory_deletion_forgot(store):
    # On a sealed log a DeleteMemory destroys the fact's own key only: the restoring
    # replica still opens the EntitiesResolved (sealed with the item's key) and learns
    # Melanie, but cannot read the erased fact that named her, so it cannot tell that
    # the deletion took her. The retraction names what the deciding replica forgot.
    from mneme.bus import MEMORY
    from mneme.bus.sealing import Sealer
    from mneme.keys import Keyring, LocalKms, fact_key_id, retain_scope
    from mneme.stores.keys_sqlite import SqliteKeyStore
    from services.extraction.routes import SERVICE
    restore = SERVICE.groups[0].restore[MEMORY]
    keyring = Keyring(SqliteKeyStore(":memory:"), LocalKms(b"\x01" * 32))
    sealer = Sealer(keyring)
    m = _retain_named("op1", "Melanie paints.", "Caroline swims.")
    for it in m.items:
        it.seal.keys.append(keyring.current("b", retain_scope("op1")))
    a, b = EntityResolver(store()), EntityResolver(store())
    out = extraction.on_retain_requested(m, meta(1), extractor=_ResolvingExtractor(a),
                                         embedder=FakeEmbedder(), resolver=a)
    [melanie] = [f for f in out[-1].facts if "Melanie" in f.text]
    keyring.destroy("b", [fact_key_id(melanie.id)])  # what DeleteMemory destroys first
    out += extraction.on_memory_delete_requested(ev.MemoryDeleteRequested(
        bank_id="b", operation_id="op-m", memory_id=melanie.id), meta(2), resolver=a)
    assert [e.name for e in a.entities("b")] == ["Caroline"]
    for msg in out:
        sealed = sealer.seal(codec.encode(msg, bank_id="b", source="t"))
        opened = codec.decode(sealer.open(Record(
            topic=sealed.topic, partition=0, offset=0, key=sealed.key, value=sealed.value,
            headers=dict(sealed.headers)))).message
        if type(opened) in restore:
            restore[type(opened)](opened, meta(), resolver=b)
    assert b.entities("b") == a.entities("b")


def test_a_replica_that_took_a_bank_over_forgets_what_a_deletion_takes():
    # B restores A's log, then takes the bank over and handles a document deletion: the
    # entities only that document named go, as they would have on A.
    restore, a, b, log = _two_documents_on_replica_a()
    for m in log:
        if type(m) in restore:
            restore[type(m)](m, meta(), resolver=b)
    for r in (a, b):
        extraction.on_document_delete_requested(ev.DocumentDeleteRequested(
            bank_id="b", operation_id="op-d", document_id="d1"), meta(2), resolver=r)
    assert [e.name for e in b.entities("b")] == [e.name for e in a.entities("b")] == [
        "Caroline"]


def test_a_kept_deletion_is_appended_once_before_the_next_write_and_not_while_running():
    """A deletion whose append failed after its keys were destroyed is kept by the key
    store and appended (the same record) before the next write to its bank; a write
    while a deletion is being appended by this process does not append it a second
    time."""
    from mneme.errors import Unavailable

    class Faulty(_Log):
        def __init__(self) -> None:
            super().__init__()
            self.refuse, self.during = True, None

        def append(self, records):
            if codec.decode(records[0]).message.DESCRIPTOR.name == "DocumentDeleteRequested":
                if self.refuse:
                    raise Unavailable("injected")
                if self.during is not None:  # a write to the bank meanwhile
                    self.during, during = None, self.during
                    during()
            return super().append(records)

    def names(log):
        return [codec.decode(r).message.DESCRIPTOR.name for r in log.appended]

    log, catalog, keys = Faulty(), MemoryCatalog(), _memory_keyring()
    catalog.upsert_bank("b", "", BankConfig(), 0.0)
    cmd = ingest.Ingest(log, catalog, source="mneme/ingest", keys=keys, poll_s=0.01)
    key = keys.current("b", "d:d1")
    with pytest.raises(Unavailable):
        cmd.delete_document("b", "d1", wait=False)
    assert keys.key("b", key) is None and names(log) == []
    (kept,) = keys.pending_deletions()
    log.refuse = False
    cmd.retain("b", [RetainItem(content="again", document_id="d1", timestamp=T0)], wait=False)
    assert names(log) == ["DocumentDeleteRequested", "RetainRequested"]
    assert codec.decode(log.appended[0]).message.operation_id == kept.operation_id
    assert keys.pending_deletions() == []
    # a write while this process appends its own deletion leaves that deletion to it
    log.during = lambda: cmd.retain("b", [RetainItem(content="x", timestamp=T0)], wait=False)
    cmd.delete_document("b", "d2", wait=False)
    assert names(log)[2:] == ["RetainRequested", "DocumentDeleteRequested"]
    assert keys.pending_deletions() == []


def test_a_retry_of_an_operation_counts_against_its_banks_share():
    """RetryOperation names no bank, only the operation: its slot counted against the
    share of no bank (one share for every RetryOperation of every bank), so a bank whose
    share was full still got one, and retries of different banks refused each other. It
    counts against the share of the operation's bank."""
    from mneme.domain import Operation
    from mneme.errors import FailedPrecondition, ResourceExhausted
    catalog = ingest.CatalogChanges(MemoryCatalog())
    for b in ("b", "c"):
        catalog.upsert_bank(b, "", BankConfig(), 0.0)
    op_id = str(__import__("uuid").UUID(int=7))
    catalog.put_operation(Operation(op_id, "c", "retain"))  # running: not retryable yet
    slots = WaitSlots(4, share=1)
    cmd = ingest.Ingest(_Log(), catalog, source="mneme/ingest", poll_s=0.01, slots=slots)
    with slots.hold("b"):  # another bank's share is full: this one's slot is free
        with pytest.raises(FailedPrecondition):
            cmd.retry_operation(op_id)
    with slots.hold("c"):  # its bank's share is full
        with pytest.raises(ResourceExhausted, match="MNEME_SYNC_CALLS_PER_TENANT"):
            cmd.retry_operation(op_id)
