"""Re-embedding (``mneme reembed``): a bank's units (facts, observations, opinions) embedded
again with another model, as :class:`~mneme.events.v1.events_pb2.VectorsReplaced` events.

The model is called here, once; the events carry the vectors and the model's name, so a
replay under the new model applies them and calls no model (DESIGN: derived events carry
what projections need). A fact embeds as extraction embedded it
(:func:`services.extraction.vectors.unit_vectors`); an observation or opinion embeds its
text (as consolidation and reflect embed model-written texts).
"""

from __future__ import annotations

import json
from typing import Callable, Sequence

from mneme.domain import Fact
from mneme.events.v1 import events_pb2 as ev
from mneme.keys import fact_key_id
from mneme.ports import Embedder
from services.extraction.vectors import DERIVED, unit_vectors

#: Units per VectorsReplaced event: 384 floats each (about 1.6 KB sealed), so an event
#: stays near 400 KB, well under the log's record limit.
BATCH = 256


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
    vectors = unit_vectors(units, embedder, extractor, bank_id, context)
    out = ev.VectorsReplaced(bank_id=bank_id, embedding_model=embedder.model_name,
                             previous_model=previous_model, batch=batch, batches=batches)
    for u, v in zip(units, vectors):
        unit = out.units.add(id=u.id, fact_type=u.fact_type, vector=list(v))
        unit.seal.keys.extend(seal_keys(u))
    return out


__all__ = ["BATCH", "DERIVED", "reembed_batch", "seal_keys"]
