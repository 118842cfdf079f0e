"""mneme.embedding: all-MiniLM-L6-v2 int8 ONNX embeddings and token counting, offline."""

from __future__ import annotations

import threading

import numpy as np
import pytest

from mneme.embedding import (DIM, MiniLMTokenCounter, OnnxEmbedder, default_embedder,
                             default_token_counter)

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def emb() -> OnnxEmbedder:
    return default_embedder()


def cos(a, b) -> float:
    return float(np.dot(a, b))


def test_shape_and_name(emb):
    assert emb.model_name == "all-MiniLM-L6-v2-onnx-int8"
    assert emb.dim == DIM == 384
    v = emb.embed(["Caroline went to a LGBTQ support group."])
    assert len(v) == 1 and len(v[0]) == 384
    assert all(isinstance(x, float) for x in v[0])
    assert emb.embed([]) == []


def test_vectors_are_unit_length(emb):
    for v in emb.embed(["hello", "A much longer sentence about painting a sunrise over a lake.", ""]):
        assert abs(np.linalg.norm(v) - 1.0) < 1e-4


def test_paraphrase_is_nearer_than_an_unrelated_sentence(emb):
    a, b, c = emb.embed(["A man is playing a guitar.", "Someone plays the guitar.",
                         "The stock market fell sharply today."])
    assert cos(a, b) > 0.6
    assert cos(a, b) > cos(a, c) + 0.4
    q, hit, miss = emb.embed(["When did Caroline go to the LGBTQ support group?",
                              "Caroline: I went to a LGBTQ support group yesterday.",
                              "Melanie: I'm swamped with the kids & work."])
    assert cos(q, hit) > cos(q, miss)


def test_batch_equals_single(emb):
    texts = ["short", "a somewhat longer text about camping with the kids last weekend",
             "Melanie: I painted that lake sunrise last year! It's special to me.", "x " * 50]
    batch = np.array(emb.embed(texts))
    single = np.array([emb.embed([t])[0] for t in texts])
    assert np.abs(batch - single).max() < 1e-5
    small = OnnxEmbedder(batch_size=1)
    assert np.abs(np.array(small.embed(texts)) - batch).max() < 1e-5


def test_long_texts_are_truncated_not_rejected(emb):
    long = "word " * 2000
    v = emb.embed([long, long + "tail"])
    assert np.allclose(v[0], v[1], atol=1e-6)  # only the first 256 tokens count


def test_thread_safe(emb):
    texts = [f"sentence number {i} about art" for i in range(8)]
    want = emb.embed(texts)
    got: list = [None] * 4
    errors: list = []

    def run(k):
        try:
            got[k] = emb.embed(texts)
        except Exception as e:  # pragma: no cover - reported below
            errors.append(e)

    ts = [threading.Thread(target=run, args=(k,)) for k in range(4)]
    for t in ts:
        t.start()
    for t in ts:
        t.join()
    assert not errors
    for g in got:
        assert np.abs(np.array(g) - np.array(want)).max() < 1e-5


def test_singletons():
    assert default_embedder() is default_embedder()
    assert default_token_counter() is default_token_counter()


def test_token_counter():
    tc = MiniLMTokenCounter()
    assert tc.count("") == 0
    assert tc.count("hello world") == 2  # no [CLS]/[SEP]
    assert tc.count("Caroline went to the LGBTQ support group") > 7
    assert tc.count("word " * 600) == 600  # no truncation when counting
    assert tc.count_many(["hello world", ""]) == [2, 0]


def test_token_counts_are_kept_for_texts_counted_again():
    from mneme.embedding import MiniLMTokenCounter
    c = MiniLMTokenCounter()
    text = "Melanie ran a charity race for mental health in May 2023."
    n = c.count(text)
    assert n == len(c._load().encode(text, add_special_tokens=False).ids) > 0
    assert c.count(text) == n and c._cached.cache_info().hits == 1
    assert c.count("") == 0 and c.count_many([text, "a b"]) == [n, 2]


def test_forward_batches_cover_every_text_once_and_bound_padding():
    import random
    from mneme.embedding import PAD_SLACK, forward_batches

    rng = random.Random(7)
    for n in (0, 1, 5, 100, 333):
        lengths = [rng.choice([rng.randint(3, 12), rng.randint(20, 90)]) for _ in range(n)]
        groups = forward_batches(lengths, 16)
        assert sorted(i for g in groups for i in g) == list(range(n))
        for g in groups:
            assert 1 <= len(g) <= 16
            widest = max(lengths[i] for i in g)
            real = sum(lengths[i] for i in g)
            # a pass of one text never pads; otherwise the bound held when its last text joined
            assert len(g) == 1 or widest * len(g) <= PAD_SLACK * real + 1e-9
        # passes go from short to long texts, so each pass pads to similar lengths
        widths = [max(lengths[i] for i in g) for g in groups]
        assert widths == sorted(widths)


def test_forward_batches_pad_less_than_fixed_batches():
    from mneme.embedding import forward_batches

    lengths = [5, 40, 6, 41, 7, 42, 8, 43] * 4
    padded = sum(max(lengths[i] for i in g) * len(g) for g in forward_batches(lengths, 16))
    fixed = sum(max(lengths[b:b + 16]) * len(lengths[b:b + 16]) for b in range(0, 32, 16))
    assert padded <= 1.15 * sum(lengths) < fixed


def test_mixed_lengths_keep_input_order(emb):
    texts = ["x " * k + f"item {k}" for k in (40, 1, 25, 3, 60, 2, 17, 9)] * 3
    got = np.array(emb.embed(texts))
    single = np.array([emb.embed([t])[0] for t in texts])
    assert np.abs(got - single).max() < 1e-5


def test_forward_batches_split_only_where_needed():
    """Each pass ends only where the next text would break the size or the padding bound:
    passes are never smaller than they have to be (fewer passes, less per-pass cost)."""
    import random
    from mneme.embedding import PAD_SLACK, forward_batches

    assert [len(g) for g in forward_batches([7] * 40, 16)] == [16, 16, 8]
    rng = random.Random(3)
    lengths = [rng.randint(3, 90) for _ in range(300)]
    groups = forward_batches(lengths, 16)
    for g, nxt in zip(groups, groups[1:]):
        n = lengths[nxt[0]]
        real = sum(lengths[i] for i in g) + n
        assert len(g) == 16 or n * (len(g) + 1) > PAD_SLACK * real


def test_a_cancelled_call_stops_between_tokenizer_slices(emb, monkeypatch):
    from mneme import embedding
    from mneme.deadline import Cancelled, Deadline, bind

    emb.embed(["load the session"])
    sess, tok = emb._load()
    calls = []
    real = tok.encode_batch

    class Counting:
        def encode_batch(self, texts):
            calls.append(len(texts))
            return real(texts)

    monkeypatch.setattr(emb, "_tokenizer", Counting())
    monkeypatch.setattr(embedding, "TOKENIZE_SLICE", 4)
    gone = iter([True, True, False])  # the caller leaves after two slices
    with bind(Deadline(active=lambda: next(gone, False))), pytest.raises(Cancelled):
        emb.embed([f"text number {i}" for i in range(40)])
    assert calls == [4, 4]
