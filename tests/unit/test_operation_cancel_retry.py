"""CancelOperation and RetryOperation, handler by handler: extraction's CancelWatch reads the
bank's intake partition after the retain; a cancelled retain stops before its next item and
its progress fails it as cancelled; the catalog keeps cancel_requested, retry_of and the
request's position through progress; Ingest refuses what cannot be cancelled or retried and
re-appends exactly the failed items (with their documents' other items) of a failed retain."""

from __future__ import annotations

from datetime import datetime, timedelta, timezone

import numpy as np
import pytest

from mneme.bus import INTAKE, codec
from mneme.bus.sqlite_log import SqliteEventLog
from mneme.domain import EventMeta, Operation, RetainItem, derive_id
from mneme.errors import FailedPrecondition
from mneme.events.v1 import events_pb2 as ev
from mneme.router import meta_of
from mneme.stores.catalog_sqlite import SqliteCatalog
from mneme.stores.memory import MemoryCatalog, MemoryEntityStore
from services.extraction import handlers as extraction
from services.extraction.handlers import CancelWatch
from services.extraction.llm import CANCELLED, ExtractionIncomplete
from services.extraction.offline import SLICE_ITEMS, OfflineExtractor
from services.extraction.resolver import EntityResolver
from services.extraction.vectors import SLICE_TEXTS, EmbeddingParts, embed_parts
from services.ingest import handlers as ingest
from services.ingest.handlers import Ingest
from services.search import handlers as search
from tests.fakes import FakeEmbedder, FakeExtractor, fake_projections
from tests.unit.test_handlers import item, meta

OP = "11111111-1111-4111-8111-111111111111"
OTHER = "22222222-2222-4222-8222-222222222222"


@pytest.fixture
def log(tmp_path):
    lg = SqliteEventLog(tmp_path / "log.db")
    lg.ensure_topic(INTAKE, 1)
    yield lg
    lg.close()


def append(log, msg):
    return log.append([codec.encode(msg, bank_id=msg.bank_id, source="mneme/test")])[0]


def retain_msg(*items, op=OP, rejected=()):
    return ev.RetainRequested(bank_id="b", operation_id=op, items=list(items),
                              rejected_items=list(rejected))


def position_meta(rec) -> EventMeta:
    return meta_of(codec.decode(rec), rec)


# ---- extraction ---------------------------------------------------------------------------


def test_cancel_watch_sees_only_its_operations_cancel_after_the_retain(log):
    rec = append(log, retain_msg(item("Alice swims.")))
    cancelled = CancelWatch(log).watch(OP, position_meta(rec))
    assert not cancelled()
    append(log, ev.OperationCancelRequested(bank_id="b", operation_id=OTHER))
    append(log, retain_msg(item("Bob runs."), op=OTHER))
    assert not cancelled()  # another operation's cancel is not this one's
    append(log, ev.OperationCancelRequested(bank_id="b", operation_id=OP))
    assert cancelled() and cancelled()  # once seen, stays seen


def test_an_event_from_no_log_position_is_never_cancelled(log):
    assert not CancelWatch(log).watch(OP, meta())()


def _run_retain(m, cancels, extractor=None):
    extractor = extractor or FakeExtractor()
    out = extraction.on_retain_requested(
        m, meta(), extractor=extractor, embedder=FakeEmbedder(),
        resolver=EntityResolver(MemoryEntityStore()), cancels=cancels)
    return extractor, [o for o in out if isinstance(o, ev.FactsExtracted)][0]


class _CancelAfter:
    """A CancelWatch whose ``cancelled()`` turns true at its ``n``-th ask."""

    def __init__(self, n: int):
        self.n, self.asked = n, 0

    def watch(self, operation_id, meta):
        def cancelled():
            self.asked += 1
            return self.asked >= self.n
        return cancelled


def test_a_cancel_during_extraction_stops_before_the_next_item():
    m = retain_msg(item("Alice swims."), item("Bob runs."), item("Carol reads."))
    # ask 1: before extraction; ask 2: before item 0; ask 3 (true): before item 1
    _, out = _run_retain(m, _CancelAfter(3))
    assert out.cancelled
    assert [f.item_index for f in out.facts] == [0]
    assert [(f.item_index, f.reason) for f in out.failures] == [(1, "cancelled"),
                                                                (2, "cancelled")]
    assert all(f.error.startswith("cancelled: ") for f in out.failures)


def test_a_document_the_cancel_kept_the_retain_from_keeps_its_facts():
    """Only documents the retain reached replace their facts: a document whose every item
    was cancelled keeps the facts an earlier retain stored."""
    m = retain_msg(item("Alice swims.", doc="a"), item("Bob runs.", doc="a"),
                   item("Carol reads.", doc="b"), item("Dan sings.", doc="b"))
    _, out = _run_retain(m, _CancelAfter(3))  # item 0 extracted, then cancelled
    assert list(out.replaced_document_ids) == ["a"]
    _, none = _run_retain(m, _CancelAfter(1))  # cancelled before it started
    assert list(none.replaced_document_ids) == [] and list(none.facts) == []


def test_a_retain_cancelled_before_it_starts_extracts_nothing(log):
    m = retain_msg(item("Alice swims."), item("Bob runs."))
    rec = append(log, m)
    append(log, ev.OperationCancelRequested(bank_id="b", operation_id=OP))
    extractor = FakeExtractor()
    out = extraction.on_retain_requested(
        m, position_meta(rec), extractor=extractor, embedder=FakeEmbedder(),
        resolver=EntityResolver(MemoryEntityStore()), cancels=CancelWatch(log))[-1]
    assert extractor.calls == [] and list(out.facts) == [] and out.cancelled
    assert {f.item_index for f in out.failures} == {0, 1}


def test_an_uncancelled_retain_is_not_marked(log):
    m = retain_msg(item("Alice swims."), item("Bob runs."))
    rec = append(log, m)
    out = extraction.on_retain_requested(
        m, position_meta(rec), extractor=FakeExtractor(), embedder=FakeEmbedder(),
        resolver=EntityResolver(MemoryEntityStore()), cancels=CancelWatch(log))[-1]
    assert not out.cancelled and len(out.facts) == 2 and not out.failures


# ---- a large offline retain stops within a slice of its work ---------------------------


def _turns(n: int) -> list[RetainItem]:
    """``n`` chat turns of one conversation, two speakers in turn, a minute apart."""
    t0 = datetime(2024, 5, 8, 13, 56, tzinfo=timezone.utc)
    return [RetainItem(f"{'Ada' if k % 2 else 'Ben'}: On day {k} I walked {k} miles along "
                       f"the river to the old mill and painted it.", t0 + timedelta(minutes=k),
                       document_id="chat") for k in range(n)]


def _asks(true_from: int):
    """``stop()`` that is false for its first ``true_from - 1`` asks, then true."""
    asked = []

    def stop() -> bool:
        asked.append(1)
        return len(asked) >= true_from
    return stop


def test_offline_extraction_stops_between_slices_of_items():
    items = _turns(SLICE_ITEMS * 2 + 10)
    with pytest.raises(ExtractionIncomplete) as e:
        OfflineExtractor().extract_many("b", items, "op", stop=_asks(1))
    done = {f.item_index for f in e.value.facts}
    assert done == set(range(SLICE_ITEMS))  # the first slice, asked after it
    assert sorted(e.value.failures) == list(range(SLICE_ITEMS, len(items)))
    assert {f.reason for f in e.value.failures.values()} == {CANCELLED}
    assert all(f.entities for f in e.value.facts)  # the slice's facts are whole


def test_sliced_offline_extraction_equals_one_batch():
    """Slices change nothing: ids, texts, times, links (the reply link across a slice's
    edge too) and entities are those of one batch."""
    items = _turns(SLICE_ITEMS * 2 + 10)
    whole = OfflineExtractor().extract_many("b", items, "op")
    sliced = OfflineExtractor().extract_many("b", items, "op", stop=lambda: False)

    def view(facts):
        return [(f.id, f.text, f.occurred_start, f.item_index, [(x.target_id, x.kind, x.weight)
                 for x in f.links], [x.id for x in f.entities]) for f in facts]
    assert view(sliced) == view(whole)
    first_of_next = next(f for f in sliced if f.item_index == SLICE_ITEMS)
    assert any(x.kind == "temporal" for x in first_of_next.links)


def test_embedding_stops_between_slices_and_returns_whole_units():
    parts = [EmbeddingParts(tuple(f"unit {k} sentence {j}" for j in range(1 + k % 3)),
                            k - 1 if k else None) for k in range(200)]
    whole = embed_parts(FakeEmbedder(), parts)
    emb = FakeEmbedder()
    got = embed_parts(emb, parts, stop=_asks(3))  # two calls, then stopped
    assert len(emb.calls) == 2
    covered = sum(len(c) for c in emb.calls)
    assert 0 < len(got) < len(parts)
    assert sum(len(p.texts) for p in parts[:len(got)]) == covered  # whole units only
    assert np.allclose(got, whole[:len(got)])
    assert all(len(c) <= SLICE_TEXTS for c in emb.calls)
    assert embed_parts(FakeEmbedder(), parts, stop=_asks(1)) == []


class _StopWhileEmbedding:
    """A CancelWatch whose cancel arrives while the first slice of texts is embedded: an
    embedder wrapper flips it on its first call."""

    def __init__(self):
        self.seen = False
        self.embedder = FakeEmbedder()
        inner = self.embedder.embed

        def embed(texts):
            self.seen = True
            return inner(texts)
        self.embedder.embed = embed

    def watch(self, operation_id, meta):
        return lambda: self.seen


def test_a_cancel_while_embedding_fails_the_items_not_embedded():
    items = [codec.retain_item_to_pb(it) for it in _turns(150)]
    watch = _StopWhileEmbedding()
    out = [o for o in extraction.on_retain_requested(
        retain_msg(*items), meta(), extractor=OfflineExtractor(), embedder=watch.embedder,
        resolver=EntityResolver(MemoryEntityStore()), cancels=watch)
        if isinstance(o, ev.FactsExtracted)][0]
    assert out.cancelled
    kept = {f.item_index for f in out.facts}
    cancelled = {f.item_index for f in out.failures if f.reason == "cancelled"}
    assert kept and cancelled and not kept & cancelled
    assert kept | cancelled == set(range(150))
    assert max(kept) < min(cancelled)  # the first slice's items, whole
    assert all(len(f.embedding) == 4 for f in out.facts)
    (p,) = search.on_facts_extracted(out, meta(), stores=fake_projections())
    assert p.state == "failed" and p.cancelled and p.items_done == len(kept)


# ---- search: the progress of a cancelled retain ---------------------------------------


def test_a_cancelled_retain_ends_failed_with_what_was_done_stored():
    m = retain_msg(item("Alice swims."), item("Bob runs."), item("Carol reads."))
    _, out = _run_retain(m, _CancelAfter(3))
    stores = fake_projections()
    (p,) = search.on_facts_extracted(out, meta(), stores=stores)
    assert p.state == "failed" and p.cancelled
    assert p.error == "cancelled: 2 of 3 item(s) were not processed (CancelOperation)"
    assert (p.items_total, p.items_done, p.facts) == (3, 1, 1)
    assert len(p.memory_ids) == 1  # the fact extracted before the cancel is stored


# ---- the catalog projection -----------------------------------------------------------


@pytest.fixture(params=["memory", "sqlite"])
def catalog(request, tmp_path):
    return MemoryCatalog() if request.param == "memory" else SqliteCatalog(
        str(tmp_path / "catalog.db"))


def test_the_catalog_keeps_cancel_retry_and_position_through_progress(catalog):
    m = retain_msg(item("x"), item("y"))
    m.retry_of = OTHER
    ingest.on_operation_requested(m, EventMeta("e1", meta().time, (INTAKE, 0, 7)),
                                  catalog=catalog)
    op = catalog.get_operation(OP)
    assert (op.retry_of, op.source, op.cancel_requested) == (OTHER, f"{INTAKE}/0/7", False)
    ingest.on_operation_cancel_requested(ev.OperationCancelRequested(bank_id="b", operation_id=OP),
                                         meta(), catalog=catalog)
    assert catalog.get_operation(OP).cancel_requested
    ingest.on_operation_progress(ev.OperationProgress(
        bank_id="b", operation_id=OP, kind="retain", state="failed", items_total=2,
        items_done=1, error="cancelled: 1 of 2", cancelled=True), meta(), catalog=catalog)
    op = catalog.get_operation(OP)
    assert (op.state, op.cancelled, op.cancel_requested, op.retry_of, op.source) == (
        "failed", True, True, OTHER, f"{INTAKE}/0/7")


def test_a_cancel_of_an_ended_or_unknown_operation_changes_nothing(catalog):
    ingest.on_operation_requested(retain_msg(item("x")), meta(), catalog=catalog)
    ingest.on_operation_progress(ev.OperationProgress(
        bank_id="b", operation_id=OP, kind="retain", state="succeeded", items_total=1,
        items_done=1), meta(), catalog=catalog)
    for op_id in (OP, OTHER):
        ingest.on_operation_cancel_requested(
            ev.OperationCancelRequested(bank_id="b", operation_id=op_id), meta(), catalog=catalog)
    assert not catalog.get_operation(OP).cancel_requested
    assert catalog.get_operation(OTHER) is None


# ---- Ingest.cancel_operation / retry_operation ----------------------------------------


@pytest.fixture
def api(log):
    """An Ingest whose catalog projection runs inline on every append."""
    catalog = MemoryCatalog()
    routes = {ev.RetainRequested: ingest.on_operation_requested,
              ev.OperationCancelRequested: ingest.on_operation_cancel_requested,
              ev.ConsolidationRequested: ingest.on_operation_requested}

    def project(rec, timeout=None):
        env = codec.decode(rec)
        routes[type(env.message)](env.message, meta_of(env, rec), catalog=catalog)
    it = Ingest(log, catalog, source="mneme/ingest")
    it._wait_projected = project
    it.project = project
    return it


def logged(api, msg):
    rec = append(api.log, msg)
    api.project(rec)
    return rec


def fail(api, op_id, item_errors=(), cancelled=False):
    api.catalog.update_operation(Operation(op_id, "b", "retain", "failed",
                                           item_errors=list(item_errors), cancelled=cancelled))


def last_record(api):
    recs = api.log.read(INTAKE, 0, 0, 1000)
    return codec.decode(recs[-1]).message


def test_cancel_appends_once_and_shows_cancel_requested(api):
    logged(api, retain_msg(item("x")))
    op = api.cancel_operation(OP)
    assert op.cancel_requested and op.state == "pending"
    assert isinstance(last_record(api), ev.OperationCancelRequested)
    n = api.log.end_offset(INTAKE, 0)
    assert api.cancel_operation(OP).cancel_requested
    assert api.log.end_offset(INTAKE, 0) == n  # a second cancel appends nothing


def test_what_cannot_be_cancelled_is_a_failed_precondition(api):
    logged(api, retain_msg(item("x")))
    fail(api, OP)
    with pytest.raises(FailedPrecondition, match="has ended"):
        api.cancel_operation(OP)
    logged(api, ev.ConsolidationRequested(bank_id="b", operation_id=OTHER, action="consolidate"))
    with pytest.raises(FailedPrecondition, match="only a retain"):
        api.cancel_operation(OTHER)


def test_retry_reappends_the_failed_items_with_their_documents_others(api):
    items = [item("a", doc="d1"), item("b", doc="d2"), item("c", doc="d2"), item("e")]
    logged(api, retain_msg(*items))
    fail(api, OP, [(1, "", "ItemExtractionFailed: timeout"), (3, "", "cancelled: ...")])
    op = api.retry_operation(OP)
    assert op.operation_id == derive_id("retry", OP) and op.retry_of == OP
    assert (op.state, op.items_total) == ("pending", 3)
    again = last_record(api)
    assert isinstance(again, ev.RetainRequested) and again.retry_of == OP
    assert list(again.retried_item_indexes) == [1, 2, 3]  # item 2 shares item 1's document
    assert [i.content for i in again.items] == ["b", "c", "e"]
    n = api.log.end_offset(INTAKE, 0)
    assert api.retry_operation(OP).operation_id == op.operation_id  # the same retry again
    assert api.log.end_offset(INTAKE, 0) == n


def test_a_retain_that_failed_whole_is_retried_whole(api):
    logged(api, retain_msg(item("a"), item("b")))
    fail(api, OP)  # e.g. dead-lettered: no item errors
    api.retry_operation(OP)
    assert list(last_record(api).retried_item_indexes) == [0, 1]


def test_a_retain_that_succeeded_with_failed_items_retries_those(api):
    logged(api, retain_msg(item("a"), item("b"), item("c")))
    api.catalog.update_operation(Operation(OP, "b", "retain", "succeeded",
                                           item_errors=[(2, "", "ItemExtractionFailed: x")]))
    assert api.retry_operation(OP).items_total == 1
    assert list(last_record(api).retried_item_indexes) == [2]


def test_what_cannot_be_retried_is_a_failed_precondition(api):
    logged(api, retain_msg(item("a")))
    with pytest.raises(FailedPrecondition, match="PENDING"):
        api.retry_operation(OP)
    api.catalog.update_operation(Operation(OP, "b", "retain", "succeeded"))
    with pytest.raises(FailedPrecondition, match="SUCCEEDED with every item"):
        api.retry_operation(OP)
    logged(api, ev.ConsolidationRequested(bank_id="b", operation_id=OTHER, action="consolidate"))
    api.catalog.update_operation(Operation(OTHER, "b", "consolidate", "failed"))
    with pytest.raises(FailedPrecondition, match="only a retain"):
        api.retry_operation(OTHER)


def test_items_refused_by_the_api_or_erased_cannot_be_retried(api):
    refused = ev.ItemFailure(item_index=1, field="items[1].content", error="too long",
                             reason="rejected")
    logged(api, retain_msg(item("a"), ev.RetainItem(), rejected=[refused]))
    fail(api, OP, [(1, "items[1].content", "too long")])
    with pytest.raises(FailedPrecondition, match="refused by the API"):
        api.retry_operation(OP)
    erased = ev.ItemFailure(item_index=0, error="erased: ...", reason="erased")
    logged(api, retain_msg(ev.RetainItem(), op=OTHER, rejected=[erased]))
    fail(api, OTHER, [(0, "", "ItemExtractionFailed: timeout")])
    with pytest.raises(FailedPrecondition, match="erased"):
        api.retry_operation(OTHER)


def test_a_request_not_found_on_the_log_cannot_be_retried(api):
    api.catalog.put_operation(Operation(OP, "b", "retain"))  # no position known
    fail(api, OP)
    with pytest.raises(FailedPrecondition, match="not found on the event log"):
        api.retry_operation(OP)


def test_progress_projected_before_its_request_keeps_what_only_the_request_knows(catalog):
    """A replica may read the progress topic ahead of the intake topic."""
    ingest.on_operation_progress(ev.OperationProgress(
        bank_id="b", operation_id=OP, kind="retain", state="failed", items_total=1,
        cancelled=True), meta(), catalog=catalog)
    m = retain_msg(item("x"))
    m.retry_of = OTHER
    ingest.on_operation_requested(m, EventMeta("e1", meta().time, (INTAKE, 0, 3)),
                                  catalog=catalog)
    op = catalog.get_operation(OP)
    assert (op.state, op.source, op.retry_of) == ("failed", f"{INTAKE}/0/3", OTHER)
    assert op.cancelled and op.cancel_requested


class _Watch:
    """A CancelWatch whose ``stop`` is the given function."""

    def __init__(self, stop):
        self.stop = stop

    def watch(self, operation_id, meta):
        return self.stop


@pytest.mark.parametrize("when", ["between slices", "while embedding"])
def test_names_only_a_cancelled_item_gave_go_with_its_document(when):
    """A cancelled item may be resolved before the cancel came (the offline extractor
    resolves every speaker first; an item cancelled while embedding was extracted whole):
    the entities only it named are in no stored fact, yet deleting its document forgets
    them like any other name it gave (they stayed in the entity store, user content)."""
    from mneme.keys import document_scope
    t = datetime(2024, 5, 9, tzinfo=timezone.utc)
    late = RetainItem("Zelda Quistorp: Yesterday I flew to Reykjavik with Obadiah Fenwick.", t,
                      document_id="late")
    items = [*_turns(SLICE_ITEMS), late] if when == "between slices" else [*_turns(149), late]
    store = MemoryEntityStore()
    resolver = EntityResolver(store)
    if when == "between slices":
        embedder, watch = FakeEmbedder(), _Watch(_asks(2))  # false before, true after slice 1
    else:
        watch = _StopWhileEmbedding()
        embedder = watch.embedder
    outs = extraction.on_retain_requested(
        retain_msg(*[codec.retain_item_to_pb(it) for it in items]), meta(),
        extractor=OfflineExtractor(resolver), embedder=embedder, resolver=resolver,
        cancels=watch)
    out = [o for o in outs if isinstance(o, ev.FactsExtracted)][0]
    assert len(items) - 1 in {f.item_index for f in out.failures if f.reason == CANCELLED}
    named = {e.id for f in out.facts for e in f.entities}
    made = {e.id: e.name for o in outs if isinstance(o, ev.EntitiesResolved)
            for e in o.entities}
    orphans = {i for i in made if i not in named}
    assert "Zelda Quistorp" in {made[i] for i in orphans}  # resolved, on no stored fact
    resolver.forget_scope(out.bank_id, document_scope("late"))
    assert not orphans & set(store._entities.get(out.bank_id, {}))
    assert named <= set(store._entities.get(out.bank_id, {}))  # the chat's names stay
