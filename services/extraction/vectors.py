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


def embed_parts(embedder: Embedder, parts: Sequence[EmbeddingParts]) -> list[list[float]]:
    """One unit vector per entry of ``parts``, in order, all texts embedded in one
    ``embedder.embed`` call. An entry of one text and no context is that text's vector
    unchanged. Cosine against a sum is, up to the norm, the sum of the cosines: each
    sentence of a turn counts, and a little of the turn it follows. ValueError for an
    entry without texts or a context index outside ``parts``."""
    for k, p in enumerate(parts):
        if not p.texts or (p.context is not None and not 0 <= p.context < len(parts)):
            raise ValueError(f"parts[{k}]: needs texts and a context index in the list")
    flat = [t for p in parts for t in p.texts]
    if not flat:
        return []
    vectors = np.asarray(embedder.embed(flat), dtype=np.float32)
    own = np.empty((len(parts), vectors.shape[1]), dtype=np.float32)
    i = 0
    for k, p in enumerate(parts):
        n = len(p.texts)
        own[k] = vectors[i] if n == 1 else _unit(vectors[i:i + n].sum(axis=0))
        i += n
    return [(own[k] if p.context is None
             else _unit(own[k] + CONTEXT_WEIGHT * own[p.context])).tolist()
            for k, p in enumerate(parts)]


def _unit(v: np.ndarray) -> np.ndarray:
    norm = float(np.linalg.norm(v))
    return v / norm if norm > 0 else v


def unit_vectors(units: Sequence[Fact], embedder: Embedder, extractor=None, bank_id: str = "",
                 context: Callable[[list[str]], list[Fact]] | None = None) -> list[list[float]]:
    """The vector of each of ``units``, in order: facts as ``extractor`` (the bank's,
    :meth:`~services.extraction.llm.BankModeExtractor.for_bank`) embeds them at
    extraction (its ``embedding_parts(facts) -> list[EmbeddingParts]``; none: the fact's
    text), with the facts they follow at hand (``context(ids)``: the bank's units of
    those ids, asked for the targets of their temporal links when they are not among
    ``units``: a re-embed's batch); observations and opinions as their text."""
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
    return embed_parts(embedder, parts)[:len(units)]


__all__ = ["CONTEXT_WEIGHT", "DERIVED", "EmbeddingParts", "embed_parts", "unit_vectors"]
