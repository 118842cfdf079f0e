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
