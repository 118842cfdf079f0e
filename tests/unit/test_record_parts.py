"""Events that grow with their request go out in parts when they do not fit one Kafka
record: a retain's FactsExtracted (:func:`services.extraction.handlers.split_facts`) and
consolidation's ObservationsChanged (:func:`services.consolidation.handlers.split_change`).
Each part fits, search ends the operation on the last part (with every fact id), and
every consumer holds the same state after the parts as after the whole."""

from __future__ import annotations

import random
from mneme.events.v1 import events_pb2 as ev
from services.consolidation.handlers import on_memory_restore, split_change
from services.extraction import handlers as extraction
from services.extraction.handlers import split_facts
from services.extraction.resolver import EntityResolver
from services.search import handlers as search
from tests.fakes import FakeEmbedder, FakeExtractor, fake_projections
from tests.unit.test_handlers import Consolidation, item, meta, pb_fact, retain

BUDGET = 4 * 1024


def whole(n: int = 120, seed: int = 7, scopes: str = "combined") -> ev.FactsExtracted:
    rnd = random.Random(seed)
    facts = []
    for i in range(n):
        e = [rnd.uniform(-1, 1) for _ in range(32)]
        norm = sum(x * x for x in e) ** 0.5
        facts.append(pb_fact(f"f{i:03}", f"Fact {i}: Alice bought {rnd.randint(1, 99)} sardines "
                             f"at stall {i % 9} of the Porto market.", doc=f"d{i % 3}",
                             tags=[f"t{i % 4}"], emb=[x / norm for x in e],
                             entities=["Alice"] if i % 2 else ()))
    return ev.FactsExtracted(
        bank_id="b", operation_id="op-big", facts=facts, embedding_model="fake",
        replaced_document_ids=["d0", "d1"], items_total=n + 2, no_fact_items=[n],
        failures=[ev.ItemFailure(item_index=n + 1, error="boom", reason="x")],
        llm_usage=ev.LlmUsage(model="m", calls=3), observation_scopes=ev.ObservationScopes(
            mode=scopes))


def test_a_record_that_fits_stays_one_record():
    m = whole(5)
    assert split_facts(m, BUDGET) == [m] and m.part == m.parts == 0


def test_parts_fit_keep_every_fact_in_order_and_share_the_retains_fields():
    m = whole()
    parts = split_facts(m, BUDGET)
    n = len(parts)
    assert n > 3 and [(p.part, p.parts) for p in parts] == [(k, n) for k in range(1, n + 1)]
    assert all(p.ByteSize() <= BUDGET + 200 for p in parts)  # + the retain's own fields
    assert [f for p in parts for f in p.facts] == list(m.facts)
    for p in parts:
        assert (p.bank_id, p.operation_id, p.embedding_model, p.items_total) == (
            "b", "op-big", "fake", m.items_total)
        # "combined" needs the tags of every fact: sent as the one explicit scope
        assert p.observation_scopes == ev.ObservationScopes(
            mode="explicit", scopes=[ev.ScopeTags(tags=["t0", "t1", "t2", "t3"])])
    first, last = parts[0], parts[-1]
    assert list(first.replaced_document_ids) == ["d0", "d1"]
    assert not any(p.replaced_document_ids for p in parts[1:])
    assert (list(last.failures), list(last.no_fact_items), last.llm_usage) == (
        list(m.failures), list(m.no_fact_items), m.llm_usage)
    assert list(last.earlier_fact_ids) == [f.id for p in parts[:-1] for f in p.facts]
    for p in parts[:-1]:
        assert not (p.failures or p.no_fact_items or p.HasField("llm_usage")
                    or p.earlier_fact_ids or p.cancelled)
    assert split_facts(m, BUDGET) == parts  # a redelivery splits alike


def test_parts_keep_room_for_the_scopes_every_part_carries():
    """The observation scopes go with every part: a part's facts leave room for them."""
    m = whole(scopes="explicit")
    m.observation_scopes.scopes.extend(
        ev.ScopeTags(tags=[f"scope-{n}-tag-{k}" for k in range(8)]) for n in range(12))
    assert m.observation_scopes.ByteSize() > BUDGET // 4
    parts = split_facts(m, BUDGET)
    assert len(parts) > 1 and all(p.ByteSize() <= BUDGET for p in parts), [
        p.ByteSize() for p in parts]
    assert all(p.observation_scopes == m.observation_scopes for p in parts)


def test_a_fact_larger_than_the_budget_goes_alone():
    m = whole(4)
    m.facts[1].text = "x" * (2 * BUDGET)
    parts = split_facts(m, BUDGET)
    assert [[f.id for f in p.facts] for p in parts] == [["f000"], ["f001"], ["f002", "f003"]]


def test_search_holds_the_same_and_ends_the_operation_on_the_last_part():
    m = whole()
    one, many = fake_projections(), fake_projections()
    expected = search.on_facts_extracted(m, meta(), stores=one)
    parts = split_facts(m, BUDGET)
    got = [search.on_facts_extracted(p, meta(k), stores=many) for k, p in enumerate(parts, 1)]
    assert got[:-1] == [[]] * (len(parts) - 1)
    assert got[-1] == expected
    assert len(expected[0].memory_ids) == len(m.facts) == expected[0].facts
    for a, b in zip(one.all(), many.all()):
        assert a.ids("b") == b.ids("b")


def test_a_cancelled_retain_in_parts_fails_on_its_last_part():
    m = whole()
    m.cancelled = True
    m.failures.append(ev.ItemFailure(item_index=m.items_total - 1, reason="cancelled"))
    parts = split_facts(m, BUDGET)
    stores = fake_projections()
    *early, last = [search.on_facts_extracted(p, meta(), stores=stores) for p in parts]
    assert early == [[]] * len(early)
    (p,) = last
    assert p.state == "failed" and p.cancelled and p.facts == len(m.facts)


def test_consolidation_over_the_parts_derives_what_the_whole_does():
    for mode in ("combined", "exact", "per_tag"):
        m = whole(60, seed=3, scopes=mode)
        a, b = Consolidation(), Consolidation()
        a.send(m)
        for p in split_facts(m, BUDGET):
            b.send(p)
        key = lambda o: (o.text, tuple(o.scope), tuple(sorted(e.memory_id for e in o.evidence)))
        assert sorted(map(key, a.live())) == sorted(map(key, b.live())), mode
        assert len(a.live()) > 1


def test_extraction_sends_a_large_retain_in_parts():
    m = retain(*(item(f"Alice bought {i} sardines at the Porto market.", doc="big")
                 for i in range(40)), op="op-x")
    out = extraction.on_retain_requested(m, meta(), extractor=FakeExtractor(),
                                         embedder=FakeEmbedder(), resolver=EntityResolver(),
                                         part_bytes=2048)
    parts = [o for o in out if isinstance(o, ev.FactsExtracted)]
    assert len(parts) > 1 and {p.parts for p in parts} == {len(parts)}
    assert sum(len(p.facts) for p in parts) == 40
    assert all(f.seal.keys == m.items[f.item_index].seal.keys for p in parts for f in p.facts)


def consolidated(n: int = 80, part_bytes: int | None = None) -> Consolidation:
    """A bank of ``n`` distinct facts, consolidated one retain at a time (changes over
    ``part_bytes`` in parts)."""
    h = Consolidation()
    if part_bytes is not None:
        h.c.part_bytes = part_bytes
    for k, f in enumerate(whole(n, seed=11, scopes="exact").facts):
        h.send(ev.FactsExtracted(bank_id="b", operation_id=f"op-{k}", facts=[f],
                                 items_total=1, embedding_model="fake"))
    return h


def marks(h: Consolidation) -> tuple:
    return (sorted(f.id for f, _ in h.store.facts("b")),
            sorted(f.id for f, _ in h.store.facts("b", pending=True)))


def live(h: Consolidation) -> list:
    return sorted((o.id, o.version, o.text, o.deleted) for o in
                  h.store.observations("b", include_deleted=True).values())


def test_a_reconsolidation_too_large_for_a_record_goes_out_in_parts():
    """A reconsolidation rewrites every observation of the bank in one change; in parts,
    each fits, search reports the request done on the last part only, and a replica
    restored from the parts holds what one restored from the whole record holds."""
    request = ev.ConsolidationScheduled(bank_id="b", operation_id="op-re",
                                        action="reconsolidate")
    one = consolidated()
    (whole_change,) = [o for o in one.send(request) if isinstance(o, ev.ObservationsChanged)]
    assert whole_change.part == whole_change.parts == 0
    many = consolidated(part_bytes=4 * 1024)
    parts = [o for o in many.send(request) if isinstance(o, ev.ObservationsChanged)]
    n = len(parts)
    assert n > 3 and [(p.part, p.parts) for p in parts] == [(k, n) for k in range(1, n + 1)]
    assert all(p.ByteSize() <= 4 * 1024 + 100 for p in parts)
    assert all((p.operation_id, p.trigger) == ("op-re", "reconsolidate") for p in parts)
    assert live(one) == live(many) and marks(one) == marks(many)
    # a fact reset and consolidated again is listed once, as consolidated
    assert not {i for p in parts for i in p.reset_memory_ids} & {
        i for p in parts for i in p.consolidated_memory_ids}
    # replicas restored from the log: the whole record, or its parts in order
    a, b = Consolidation(), Consolidation()
    for h in (a, b):
        for k, f in enumerate(whole(80, seed=11, scopes="exact").facts):
            on_memory_restore(ev.FactsExtracted(bank_id="b", operation_id=f"op-{k}", facts=[f],
                                                items_total=1, embedding_model="fake"),
                              meta(k), consolidator=h.c)
    on_memory_restore(whole_change, meta(100), consolidator=a.c)
    for k, p in enumerate(parts):
        on_memory_restore(p, meta(100 + k), consolidator=b.c)
    assert live(a) == live(b) and marks(a) == marks(b)
    # search: the same units, and the request's progress once, on the last part
    s1, s2 = fake_projections(), fake_projections()
    expected = search.on_observations_changed(whole_change, meta(), stores=s1)
    got = [search.on_observations_changed(p, meta(), stores=s2) for p in parts]
    assert expected and got == [[]] * (n - 1) + [expected]
    assert s1.vectors.ids("b") == s2.vectors.ids("b")


def test_a_change_that_fits_stays_one_record():
    m = ev.ObservationsChanged(bank_id="b", operation_id="o", trigger="auto",
                               reset_memory_ids=["f1"], consolidated_memory_ids=["f1", "f2"])
    assert split_change(m) == [m]


class _Refreshes:
    """reflect's mental models, recording each scheduled-refresh check."""

    def __init__(self):
        self.calls = []

    def refresh_due(self, bank_id, consolidated, now):
        self.calls.append((bank_id, consolidated))
        return []


def test_mental_models_refresh_once_after_the_last_part():
    """A refresh on an earlier part would answer from half a change (a reconsolidation's
    first part deletes every observation) and refresh again on each later part: one
    model call per part. Parts before the last leave the policies alone."""
    from services.reflect import handlers as reflect
    models = _Refreshes()
    change = ev.ObservationsChanged(bank_id="b", operation_id="op", trigger="reconsolidate",
                                    observations=[ev.Observation(id=f"o{i}", text="x" * 400)
                                                  for i in range(40)])
    for parts in (split_change(change, BUDGET), split_facts(whole(), BUDGET)):
        assert len(parts) > 1
        models.calls.clear()
        for k, p in enumerate(parts):
            reflect.on_memory_changed(p, meta(f"e{k}"), mental_models=models)
        assert models.calls == [("b", isinstance(parts[0], ev.ObservationsChanged))]
    # a record in one part (part/parts unset) is checked as before
    models.calls.clear()
    reflect.on_memory_changed(whole(3), meta("e"), mental_models=models)
    assert models.calls == [("b", False)]
