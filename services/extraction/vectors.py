"""How a unit becomes its one vector: the texts an extractor embeds it as
(:class:`EmbeddingParts`: a long chat turn as its sentences, a short reply with the turn
it answers, and the turn before as context) combined into one unit vector.

Extraction calls :func:`unit_vectors` once per request, ``mneme reembed`` once per batch;
the vectors travel in the events, so replay calls no model (DESIGN: derived events carry
what projections need).
"""

from __future__ import annotations

from typing import Callable, NamedTuple, Sequence

import numpy as np

from mneme.domain import Fact
from mneme.ports import Embedder

#: fact_type values of the units that are not facts (search's observation and opinion
#: units): embedded as their text.
DERIVED = ("observation", "opinion")
#: Weight of the context unit's vector (the turn before) beside a unit's own unit-norm
#: vector. Measured on the LoCoMo dev split (README, Benchmark): with the sentences,
#: evidence recall@10 0.761 → 0.783 (single-hop 0.847 → 0.873); in a semantic-arm-only
#: sweep 0.2 beat 0.3 and 0.5 (0.5 cost temporal and open-domain).
CONTEXT_WEIGHT = 0.2


class EmbeddingParts(NamedTuple):
    """How one unit is embedded: its own vector is the L2-normalised sum of the vectors
    of ``texts`` (one or more); ``context`` is the index, in the same list, of the unit
    whose own vector is added with :data:`CONTEXT_WEIGHT` before normalising again (or
    None)."""

    texts: tuple[str, ...]
    context: int | None = None


def embed_parts(embedder: Embedder, parts: Sequence[EmbeddingParts],
                stop: Callable[[], bool] | None = None) -> list[list[float]]:
    """One unit vector per entry of ``parts``, in order. An entry of one text and no
    context is that text's vector unchanged. Cosine against a sum is, up to the norm, the
    sum of the cosines: each sentence of a turn counts, and a little of the turn it
    follows. ValueError for an entry without texts or a context index outside ``parts``.

    All texts go to ``embedder.embed`` in one call; with ``stop`` (the operation can be
    cancelled) in calls of about :data:`SLICE_TEXTS` texts, whole entries each, and
    ``stop()`` is asked before each: once it is true the vectors of the entries embedded
    so far are returned (a prefix of ``parts``, possibly empty). (When an entry's context
    comes after it, ``stop`` is not asked: a prefix could lack a context it needs.)"""
    for k, p in enumerate(parts):
        if not p.texts or (p.context is not None and not 0 <= p.context < len(parts)):
            raise ValueError(f"parts[{k}]: needs texts and a context index in the list")
    if stop is not None and any(p.context is not None and p.context >= k
                                for k, p in enumerate(parts)):
        stop = None  # a prefix would lack a context it needs: embed them all
    flat = [t for p in parts for t in p.texts]
    if not flat:
        return []
    vectors = _embed(embedder, parts, stop)
    done = _whole(parts, len(vectors))
    if not done:
        return []
    own = np.empty((done, vectors.shape[1]), dtype=np.float32)
    i = 0
    for k, p in enumerate(parts[:done]):
        n = len(p.texts)
        own[k] = vectors[i] if n == 1 else _unit(vectors[i:i + n].sum(axis=0))
        i += n
    return [(own[k] if p.context is None
             else _unit(own[k] + CONTEXT_WEIGHT * own[p.context])).tolist()
            for k, p in enumerate(parts[:done])]


#: Texts per embedding call when a request can be cancelled (``embed_parts``' ``stop``):
#: a cancel stops a large retain within one call's work (about a second on two cores).
SLICE_TEXTS = 128


def _embed(embedder: Embedder, parts: Sequence[EmbeddingParts],
           stop: Callable[[], bool] | None) -> np.ndarray:
    """The vectors of the texts of ``parts`` in order (texts × dim): all, or with ``stop``
    those of the whole entries embedded before ``stop()`` turned true."""
    if stop is None:
        return np.asarray(embedder.embed([t for p in parts for t in p.texts]),
                          dtype=np.float32)
    out: list[np.ndarray] = []
    k = 0
    while k < len(parts):
        if stop():
            break
        batch: list[str] = []
        while k < len(parts) and (not batch or len(batch) + len(parts[k].texts) <= SLICE_TEXTS):
            batch.extend(parts[k].texts)
            k += 1
        out.append(np.asarray(embedder.embed(batch), dtype=np.float32))
    return np.concatenate(out) if out else np.empty((0, 0), dtype=np.float32)


def _whole(parts: Sequence[EmbeddingParts], texts: int) -> int:
    """How many leading entries of ``parts`` the first ``texts`` texts cover."""
    k = 0
    while k < len(parts) and texts >= len(parts[k].texts):
        texts -= len(parts[k].texts)
        k += 1
    return k


def _unit(v: np.ndarray) -> np.ndarray:
    norm = float(np.linalg.norm(v))
    return v / norm if norm > 0 else v


def unit_vectors(units: Sequence[Fact], embedder: Embedder, extractor=None, bank_id: str = "",
                 context: Callable[[list[str]], list[Fact]] | None = None,
                 stop: Callable[[], bool] | None = None) -> list[list[float]]:
    """The vector of each of ``units``, in order: facts as ``extractor`` (the bank's,
    :meth:`~services.extraction.llm.BankModeExtractor.for_bank`) embeds them at
    extraction (its ``embedding_parts(facts) -> list[EmbeddingParts]``; none: the fact's
    text), with the facts they follow at hand (``context(ids)``: the bank's units of
    those ids, asked for the targets of their temporal links when they are not among
    ``units``: a re-embed's batch); observations and opinions as their text. With
    ``stop`` (:func:`embed_parts`), a prefix of the vectors once it turns true."""
    facts = [u for u in units if u.fact_type not in DERIVED]
    parts = [EmbeddingParts((u.text,)) for u in units]
    used = extractor.for_bank(bank_id) if hasattr(extractor, "for_bank") else extractor
    rule = getattr(used, "embedding_parts", None)
    if facts and rule is not None:
        at = {u.id: k for k, u in enumerate(units)}
        # the rule looks at the turn a fact follows (its temporal links); entity links
        # are many per fact and never read by it
        linked = sorted({lk.target_id for f in facts for lk in f.links
                         if lk.kind == "temporal"} - at.keys())
        extra = [x for x in (context(linked) if context and linked else [])
                 if x.fact_type not in DERIVED]
        given = facts + extra
        # the rule's indexes are into ``given``; the extra units go after ``units``
        where = [at[f.id] for f in facts] + list(range(len(units), len(units) + len(extra)))
        parts += [EmbeddingParts((x.text,)) for x in extra]
        for k, p in enumerate(rule(given)):
            parts[where[k]] = EmbeddingParts(
                tuple(p.texts), None if p.context is None else where[p.context])
    if len(parts) > len(units):
        stop = None  # a re-embed's context units come last: its batch is embedded whole
    return embed_parts(embedder, parts, stop)[:len(units)]


__all__ = ["CONTEXT_WEIGHT", "DERIVED", "SLICE_TEXTS", "EmbeddingParts", "embed_parts",
           "unit_vectors"]
