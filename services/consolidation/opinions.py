"""Opinions revised by new facts: consolidation's side of the bank's beliefs.

An opinion (``ev.Opinion``) is formed by reflect, after a reflection, with a model. Here,
each new fact that mentions one of an opinion's entities is shown to the consolidation
model with that opinion; the model says whether the fact **supports**, **weakens** or
**contradicts** it (or is unrelated). The confidence moves by
:func:`mneme.domain.revise_confidence` (a contradiction weighs twice a weakening) and a
contradiction revises the text. Every change is a full opinion state in an
``OpinionsChanged`` event, so replay applies the recorded states and calls no model.

Offline (no consolidation model) nothing is revised: whether a fact bears on a belief is
a judgement, and a wrong guess would move confidences for no reason. Deleting an opinion
(``DeleteOpinion`` → ``ConsolidationScheduled`` action "delete_opinion") and deleting the
opinions whose memories are retracted are decided here too, in the bank's partition order, so a revision can never
bring back a deleted opinion.
"""

from __future__ import annotations

import json
import logging
from datetime import datetime
from typing import Sequence

from mneme.bus import codec
from mneme.domain import OPINION_RELATIONS, revise_confidence
from mneme.errors import Cancelled
from mneme.events.v1 import events_pb2 as ev
from mneme.keys import fact_key_id
from mneme.ports import ObservationStore

log = logging.getLogger(__name__)

#: Facts of one event shown to the model with the opinions they may bear on.
MAX_FACTS = 20
#: Opinions shown per fact (those sharing the most entities with it first).
MAX_OPINIONS_PER_FACT = 5
#: Evidence ids an opinion keeps (the newest).
MAX_EVIDENCE = 50

SYSTEM = """You keep the opinions (beliefs) of a memory bank honest. For each new fact you
are shown with the opinions that share an entity with it, say how the fact bears on each
opinion: "support" (it is further evidence for it), "weaken" (it makes it less likely
without refuting it), "contradict" (it shows it is wrong) or "unrelated". For a
contradiction give the opinion's revised text: what the bank should now believe, in one
sentence. Judge only from the fact's text. Answer as JSON."""

SCHEMA = {
    "type": "object",
    "properties": {"updates": {"type": "array", "items": {
        "type": "object",
        "properties": {
            "opinion_id": {"type": "string"}, "memory_id": {"type": "string"},
            "relation": {"type": "string",
                         "enum": ["support", "weaken", "contradict", "unrelated"]},
            "revised_text": {"type": "string"}, "reason": {"type": "string"}},
        "required": ["opinion_id", "memory_id", "relation", "revised_text", "reason"],
        "additionalProperties": False}}},
    "required": ["updates"], "additionalProperties": False,
}
_CHECK = {"type": "object", "required": ["updates"],
          "properties": {"updates": {"type": "array", "items": {
              "type": "object", "required": ["opinion_id", "memory_id", "relation"]}}}}


def next_opinion(o: ev.Opinion, at: datetime) -> ev.Opinion:
    """A copy of ``o`` as the next version, updated at ``at`` (its seal keys dropped: the
    new state names its own)."""
    new = ev.Opinion()
    new.CopyFrom(o)
    new.version = o.version + 1
    new.updated_at.FromDatetime(at)
    new.ClearField("seal")
    return new


def seal_keys(o: ev.Opinion, facts: dict[str, ev.Fact]) -> None:
    """Name ``o``'s seal keys: those of its evidence facts known here (deleting any of
    their documents makes the state unreadable on the log), the facts' own keys otherwise."""
    keys: list[str] = []
    for i in o.evidence_ids:
        f = facts.get(i)
        for k in (f.seal.keys if f is not None else [fact_key_id(i)]):
            if k not in keys:
                keys.append(k)
    o.seal.ClearField("keys")
    o.seal.keys.extend(keys)


def candidates(store: ObservationStore, bank_id: str, facts: Sequence[ev.Fact]
               ) -> list[tuple[ev.Fact, list[ev.Opinion]]]:
    """(fact, the opinions about its entities) for the first :data:`MAX_FACTS` facts that
    have any, at most :data:`MAX_OPINIONS_PER_FACT` each (most shared entities first).
    Facts an opinion already cites are not shown with it."""
    out = []
    for f in facts:
        ents = {e.id for e in f.entities if e.id}
        if not ents:
            continue
        found = store.opinions(bank_id, entity_ids=sorted(ents), limit=200)
        mine = [o for o in found.values() if f.id not in o.evidence_ids]
        if not mine:
            continue
        mine.sort(key=lambda o: (-len(ents & {e.id for e in o.entities}), o.id))
        out.append((f, mine[:MAX_OPINIONS_PER_FACT]))
        if len(out) >= MAX_FACTS:
            break
    return out


def messages(pairs: Sequence[tuple[ev.Fact, list[ev.Opinion]]]) -> list[dict]:
    """The chat messages of one revision call."""
    user = {"new_facts": [{"memory_id": f.id, "text": f.text,
                           "opinions": [{"opinion_id": o.id, "text": o.text,
                                         "confidence": round(o.confidence, 2)} for o in ops]}
                          for f, ops in pairs]}
    return [{"role": "system", "content": SYSTEM},
            {"role": "user", "content": "Opinion updates for these facts:\n"
             + json.dumps(user, ensure_ascii=False)}]


def revise(store: ObservationStore, llm, bank_id: str, facts: Sequence[ev.Fact],
           at: datetime) -> ev.OpinionsChanged | None:
    """The OpinionsChanged (trigger "revised") that ``facts`` cause, or None: no model, no
    opinion about their entities, or no update. Updates the model names for pairs it was
    not shown are ignored; a fact counts once per opinion. A model failure is logged and
    revises nothing (opinions are a by-product: the facts are stored regardless)."""
    if llm is None or not llm.configured("consolidation"):
        return None
    pairs = candidates(store, bank_id, facts)
    if not pairs:
        return None
    shown = {(f.id, o.id) for f, ops in pairs for o in ops}
    try:
        res = llm.complete_json("consolidation", messages(pairs), SCHEMA, check_schema=_CHECK,
                                schema_name="opinion_updates")
    except Cancelled:
        raise
    except Exception as e:  # noqa: BLE001 - logged; the facts stay stored either way
        log.warning("opinion revision failed for bank %s (%r): nothing revised", bank_id, e)
        return None
    states: dict[str, ev.Opinion] = {o.id: o for _, ops in pairs for o in ops}
    by_id = {f.id: f for f, _ in pairs}
    changed: dict[str, ev.Opinion] = {}
    seen: set[tuple[str, str]] = set()
    for u in res.value.get("updates") or []:
        key = (str(u.get("memory_id", "")), str(u.get("opinion_id", "")))
        relation = u.get("relation")
        if key not in shown or key in seen or relation not in OPINION_RELATIONS:
            continue
        seen.add(key)
        memory_id, opinion_id = key
        cur = changed.get(opinion_id) or states[opinion_id]
        new = next_opinion(cur, at)
        new.confidence = revise_confidence(cur.confidence, relation)
        text = str(u.get("revised_text") or "").strip()
        if relation == "contradict" and text:
            new.text = text[:2000]
        if relation == "support":
            new.evidence_ids.append(memory_id)
            del new.evidence_ids[:-MAX_EVIDENCE]
        new.history.add(change=OPINION_RELATIONS[relation], text=new.text,
                        confidence=new.confidence, memory_id=memory_id, at=new.updated_at,
                        reason=str(u.get("reason") or "")[:500])
        changed[opinion_id] = new
    if not changed:
        return None
    known = store.facts_by_id(bank_id, {i for o in changed.values() for i in o.evidence_ids})
    known.update(by_id)
    change = ev.OpinionsChanged(bank_id=bank_id, trigger="revised", decided_by="llm")
    u = res.usage
    change.llm_usage.CopyFrom(ev.LlmUsage(model=u.model, calls=u.calls,
                                          failed_calls=u.failed_calls,
                                          input_tokens=u.input_tokens,
                                          output_tokens=u.output_tokens, cost_usd=u.cost_usd))
    for oid in sorted(changed):
        o = changed[oid]
        seal_keys(o, known)
        change.opinions.append(o)
    return change


def delete(store: ObservationStore, bank_id: str, opinion_id: str, operation_id: str,
           at: datetime) -> ev.OpinionsChanged:
    """The OpinionsChanged (trigger "delete_opinion") of a DeleteOpinion request: the
    opinion's tombstone, or no opinion when the bank has none by that id (the operation then
    fails as not found)."""
    change = ev.OpinionsChanged(bank_id=bank_id, operation_id=operation_id,
                                trigger="delete_opinion", decided_by="offline")
    cur = store.opinions(bank_id, ids=[opinion_id]).get(opinion_id)
    if cur is not None:
        new = next_opinion(cur, at)
        new.deleted = True
        change.opinions.append(codec.opinion_tombstone(new))
    return change


def retract(store: ObservationStore, bank_id: str, memory_ids, at: datetime
            ) -> ev.OpinionsChanged | None:
    """Delete the opinions whose evidence cites any retracted ``memory_ids``, as
    observations are: their text was concluded from what is being deleted, so no state of
    them may outlive it. None when no opinion cites them. Reads every live opinion of the
    bank (opinions are few: one reflection forms at most a handful)."""
    gone = set(memory_ids)
    if not gone:
        return None
    change = ev.OpinionsChanged(bank_id=bank_id, trigger="retract", decided_by="offline")
    for o in store.opinions(bank_id, limit=1_000_000).values():
        if gone & set(o.evidence_ids):
            new = next_opinion(o, at)
            new.deleted = True
            change.opinions.append(codec.opinion_tombstone(new))
    return change if change.opinions else None


def merge_entities(store: ObservationStore, bank_id: str, survivor_id: str,
                   merged_ids: Sequence[str], display_name: str, at: datetime
                   ) -> ev.OpinionsChanged | None:
    """After a user's entity merge (``EntitiesMerged``), the opinions about a merged-away
    entity are about the survivor instead (trigger "entities_merged"): new facts name the
    survivor, and only facts about an opinion's entities revise it. Their belief,
    confidence and history are unchanged. None when no opinion is about those entities."""
    gone = set(merged_ids) - {survivor_id}
    if not gone:
        return None
    change = ev.OpinionsChanged(bank_id=bank_id, trigger="entities_merged", decided_by="offline")
    for o in store.opinions(bank_id, entity_ids=sorted(gone), limit=1_000_000).values():
        new = next_opinion(o, at)
        mine = next((e for e in o.entities if e.id == survivor_id), None)
        first = next(e for e in o.entities if e.id in gone)
        survivor = ev.Entity(id=survivor_id, name=display_name or (mine or first).name,
                             label=(mine or first).label)
        kept: list[ev.Entity] = []
        for e in o.entities:
            e = survivor if e.id in gone or e.id == survivor_id else e
            if all(k.id != e.id for k in kept):
                kept.append(e)
        del new.entities[:]
        new.entities.extend(kept)
        seal_keys(new, store.facts_by_id(bank_id, new.evidence_ids))
        change.opinions.append(new)
    return change if change.opinions else None
