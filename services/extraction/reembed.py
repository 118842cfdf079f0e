"""Re-embedding (``mneme reembed``): a bank's units (facts, observations, opinions) embedded
again with another model, as :class:`~mneme.events.v1.events_pb2.VectorsReplaced` events.

The model is called here, once; the events carry the vectors and the model's name, so a
replay under the new model applies them and calls no model (DESIGN: derived events carry
what projections need). A fact embeds as extraction embedded it (its extractor's
``embedding_parts``: a short reply with the turn it answers, a long turn with its
sentences; :func:`embed_parts`); an observation or opinion embeds its text (as
consolidation and reflect embed model-written texts).
"""

from __future__ import annotations

import json
from typing import Callable, Sequence

import numpy as np

from mneme.domain import Fact
from mneme.events.v1 import events_pb2 as ev
from mneme.keys import fact_key_id
from mneme.ports import Embedder

#: Units per VectorsReplaced event: 384 floats each (about 1.6 KB sealed), so an event
#: stays near 400 KB, well under the log's record limit.
BATCH = 256
#: fact_type values of the units that are not facts (search's observation and opinion
#: units; their ``metadata["evidence"]`` names the facts they rest on).
DERIVED = ("observation", "opinion")


def seal_keys(unit: Fact) -> list[str]:
    """The keys ``unit``'s new vector is sealed with (:mod:`mneme.bus.sealing`): a fact's
    own ``f:<id>`` (destroyed with the fact or its document); an observation's or opinion's
    evidence facts' own keys (destroyed when any of them goes, as its text's are). None
    known: [] (the bank's key)."""
    if unit.fact_type not in DERIVED:
        return [fact_key_id(unit.id)]
    try:
        evidence = json.loads(unit.metadata.get("evidence") or "[]")
    except ValueError:
        return []
    ids = [e.get("memory_id", "") if isinstance(e, dict) else str(e) for e in evidence]
    return list(dict.fromkeys(fact_key_id(i) for i in ids if i))


def embedding_parts(units: Sequence[Fact], extractor=None, bank_id: str = "",
                    context: Callable[[list[str]], list[Fact]] | None = None
                    ) -> list[list[str]]:
    """The texts to embed for each of ``units``, in order (:func:`embed_parts` makes one
    vector of them): facts as ``extractor`` (the bank's,
    :meth:`~services.extraction.llm.BankModeExtractor.for_bank`) embeds them at
    extraction (its ``embedding_parts``; none: the fact's text), with the facts they
    follow (``context(ids)``: the bank's units of those ids, asked for the targets of
    their temporal links) at hand; observations and opinions their text."""
    facts = [u for u in units if u.fact_type not in DERIVED]
    parts = {u.id: [u.text] for u in units}
    used = extractor.for_bank(bank_id) if hasattr(extractor, "for_bank") else extractor
    rule = getattr(used, "embedding_parts", None)
    if facts and rule is not None:
        have = {f.id for f in facts}
        # the rule looks at the turn a fact follows (its temporal links); entity links
        # are many per fact and never read by it
        linked = sorted({lk.target_id for f in facts for lk in f.links
                         if lk.kind == "temporal"} - have)
        extra = [x for x in (context(linked) if context and linked else [])
                 if x.fact_type not in DERIVED]
        for f, p in zip(facts + extra, rule(facts + extra)):
            if f.id in have:
                parts[f.id] = list(p)
    return [parts[u.id] for u in units]


def embed_parts(embedder: Embedder, parts: Sequence[Sequence[str]]) -> list[list[float]]:
    """One vector per entry of ``parts`` (each a non-empty list of texts): the L2-normalised
    sum of its texts' vectors, all texts embedded in one ``embedder.embed`` call. An entry
    of one text is that text's vector unchanged. Cosine against the sum is, up to the
    norm, the sum of the cosines: the whole text and each sentence of it count."""
    flat = [t for p in parts for t in p]
    if not flat:
        return []
    vectors = embedder.embed(flat)
    out: list[list[float]] = []
    i = 0
    for p in parts:
        if len(p) == 1:
            out.append(list(vectors[i]))
        else:
            total = np.sum(np.asarray(vectors[i:i + len(p)], dtype=np.float32), axis=0)
            norm = float(np.linalg.norm(total))
            out.append((total / norm if norm > 0 else total).tolist())
        i += len(p)
    return out


def reembed_batch(bank_id: str, units: Sequence[Fact], embedder: Embedder, previous_model: str,
                  batch: int, batches: int, extractor=None,
                  context: Callable[[list[str]], list[Fact]] | None = None
                  ) -> ev.VectorsReplaced:
    """One VectorsReplaced of ``bank_id``: ``units`` (at most :data:`BATCH`) embedded with
    ``embedder`` (its ``model_name`` recorded), each vector sealed with
    :func:`seal_keys`; ``batch`` of ``batches`` of this re-embed. ValueError for more than
    :data:`BATCH` units."""
    if len(units) > BATCH:
        raise ValueError(f"at most {BATCH} units per VectorsReplaced, got {len(units)}")
    vectors = embed_parts(embedder, embedding_parts(units, extractor, bank_id, context))
    out = ev.VectorsReplaced(bank_id=bank_id, embedding_model=embedder.model_name,
                             previous_model=previous_model, batch=batch, batches=batches)
    for u, v in zip(units, vectors):
        unit = out.units.add(id=u.id, fact_type=u.fact_type, vector=list(v))
        unit.seal.keys.extend(seal_keys(u))
    return out


__all__ = ["BATCH", "DERIVED", "embed_parts", "embedding_parts", "reembed_batch", "seal_keys"]
