"""Opinions formed after a reflection: reflect's side of the bank's beliefs.

Group ``reflect-opinions`` follows ``mneme.reflect.v1``. For each reflection a model
answered (an extractive answer concludes nothing, so offline no opinion is ever formed) that
cites facts, the reflect model is asked for the answer's *conclusive* statements -- what the
bank now believes, beyond what any single memory says -- each with the citations that
support it and the entities it is about. Each becomes an opinion (``ev.Opinion``) whose
initial confidence follows from its evidence's count and recency and the bank's skepticism
(:func:`mneme.domain.initial_confidence`). The result is one ``OpinionsChanged`` (trigger
"formed") on ``mneme.memory.v1``, carrying the full states with their embeddings, so search
projects them and consolidation revises them later without calling any model again.

Formation is a by-product: a model failure is logged and forms nothing; it never touches
the reflection, which was answered already.
"""

from __future__ import annotations

import logging
from typing import Callable

from mneme.domain import BankConfig, EventMeta, derive_id, initial_confidence
from mneme.errors import Cancelled
from mneme.events.v1 import events_pb2 as ev
from mneme.llm.types import as_list

log = logging.getLogger(__name__)

#: Opinions one reflection forms at most.
MAX_OPINIONS = 5
#: Characters an opinion's text keeps.
MAX_TEXT = 1000
#: Entities an opinion is about at most.
MAX_ENTITIES = 10

SYSTEM = """Form opinions from a reflection. You are shown a question, the answer the
memory bank gave, and the memories the answer cites ([1], [2], ...) with the entities they
mention. List the answer's conclusive statements: judgements or conclusions the bank now
holds (for example "Caroline is committed to becoming a counselor"), not restatements of a
single memory and not hedges. For each give one self-contained sentence (names, not
pronouns), the numbers of the citations that support it, and the names of the entities it
is about (from those listed). List none when the answer concludes nothing. Answer as JSON."""

SCHEMA = {
    "type": "object",
    "properties": {"opinions": {"type": "array", "items": {
        "type": "object",
        "properties": {"text": {"type": "string"},
                       "citations": {"type": "array", "items": {"type": "integer"}},
                       "entities": {"type": "array", "items": {"type": "string"}}},
        "required": ["text", "citations", "entities"], "additionalProperties": False}}},
    "required": ["opinions"], "additionalProperties": False,
}
_CHECK = {"type": "object", "required": ["opinions"],
          "properties": {"opinions": {"type": "array", "items": {
              "type": "object", "required": ["text"]}}}}


def messages(m: ev.ReflectionRecorded) -> list[dict]:
    """The chat messages asking for the opinions of reflection ``m``."""
    cited = {e.memory_id: e for e in m.evidence}
    lines = []
    for n, mid in enumerate(m.based_on, 1):
        e = cited.get(mid)
        if e is not None:
            names = ", ".join(x.name for x in e.entities) or "(none)"
            lines.append(f"[{n}] entities: {names}")
    user = (f"Question: {m.query}\n\nAnswer: {m.answer}\n\nCited memories:\n"
            + "\n".join(lines))
    return [{"role": "system", "content": SYSTEM}, {"role": "user", "content": user}]


class OpinionFormer:
    """Forms the opinions of reflections. ``llm`` (None: offline, forms none) answers
    operation "reflect"; ``embedder`` embeds their texts (``model_name`` is recorded);
    ``bank_config(bank_id)`` → BankConfig or None (its skepticism lowers confidence)."""

    def __init__(self, llm, embedder, bank_config: Callable[[str], BankConfig | None]):
        self.llm, self.embedder, self.bank_config = llm, embedder, bank_config

    def form(self, m: ev.ReflectionRecorded, meta: EventMeta) -> list[ev.OpinionsChanged]:
        """[OpinionsChanged] of the opinions reflection ``m`` forms ([] when none: an
        extractive answer, no cited facts, no model, or the model failed or found none).
        Ids derive from the reflection's event id, so a redelivery forms the same ones."""
        if (m.extractive or not m.evidence or self.llm is None
                or not self.llm.configured("reflect")):
            return []
        try:
            res = self.llm.complete_json("reflect", messages(m), SCHEMA, check_schema=_CHECK,
                                         schema_name="opinions")
        except Cancelled:
            raise
        except Exception as e:  # noqa: BLE001 - a by-product: logged, the reflection stands
            log.warning("opinion formation failed for bank %s (%r): none formed", m.bank_id, e)
            return []
        cited = {e.memory_id: e for e in m.evidence}
        cfg = self.bank_config(m.bank_id) or BankConfig()
        change = ev.OpinionsChanged(bank_id=m.bank_id, trigger="formed", decided_by="llm")
        drafts = []
        for o in (res.value.get("opinions") or [])[:MAX_OPINIONS]:
            text = " ".join(str(o.get("text") or "").split())[:MAX_TEXT]
            ids = []
            for n in as_list(o.get("citations")):
                if isinstance(n, int) and 1 <= n <= len(m.based_on):
                    mid = m.based_on[n - 1]
                    if mid in cited and mid not in ids:
                        ids.append(mid)
            if not text or not ids:  # an opinion rests on what the answer cited
                continue
            drafts.append((text, ids, self._entities(as_list(o.get("entities")),
                                                     [cited[i] for i in ids])))
        if not drafts:
            return []
        vectors = self.embedder.embed([t for t, _, _ in drafts])
        at = meta.time
        for n, ((text, ids, entities), vector) in enumerate(zip(drafts, vectors)):
            ages = [(at - cited[i].mentioned_at.ToDatetime(tzinfo=at.tzinfo)).total_seconds()
                    / 86400 if cited[i].HasField("mentioned_at") else 0.0 for i in ids]
            c = initial_confidence(ages, cfg.skepticism)
            o = change.opinions.add(id=derive_id(meta.id, "opinion", n), text=text,
                                    confidence=c, entities=entities, evidence_ids=ids,
                                    tags=list(m.tags), embedding=vector,
                                    embedding_model=getattr(self.embedder, "model_name", ""),
                                    version=1, reflection_id=meta.id)
            o.created_at.FromDatetime(at)
            o.updated_at.FromDatetime(at)
            o.history.add(change="formed", text=text, confidence=c, at=o.created_at)
        u = res.usage
        change.llm_usage.CopyFrom(ev.LlmUsage(model=u.model, calls=u.calls,
                                              failed_calls=u.failed_calls,
                                              input_tokens=u.input_tokens,
                                              output_tokens=u.output_tokens,
                                              cost_usd=u.cost_usd))
        return [change]

    @staticmethod
    def _entities(names, evidence) -> list[ev.Entity]:
        """The evidence's entities the model named (case-insensitive); all of the
        evidence's entities when it named none of them. At most :data:`MAX_ENTITIES`."""
        known: dict[str, ev.Entity] = {}
        for e in evidence:
            for x in e.entities:
                known.setdefault(x.id, x)
        wanted = {str(n).strip().lower() for n in names}
        chosen = [x for x in known.values() if x.name.lower() in wanted] or list(known.values())
        return [ev.Entity(id=x.id, name=x.name, label=x.label) for x in chosen[:MAX_ENTITIES]]

