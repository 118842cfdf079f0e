"""Observation decisions with a model (``LlmGateway`` operation "consolidation").

One call per (batch of new facts, scope): the model sees the facts (id + text) and the
scope's nearest existing observations (id + text) and answers create / update / delete
actions (:data:`SCHEMA`). The rules (:data:`DEFAULT_RULES`) are: prefer update over
create, preserve history ("was …, now …"), no computation, conservative deletes; the
bank's ``observations_mission`` replaces the default rule of what is worth keeping.

The answer is checked, not trusted: memory ids must be among the facts shown or the
observation's evidence, quotes must be verbatim substrings of their memory (else the
memory's first sentence is used), a text stating a number no source states or longer
than :func:`max_text_chars` is refused (the evidence is still appended), a delete is
applied only when it cites one of the new facts (a delete nothing grounds is a model's
junk or an order injected into a retained text), and ``proof_count`` is always counted
by us.
"""

from __future__ import annotations

import json
from datetime import datetime
from typing import Sequence

from mneme.events.v1 import events_pb2 as ev
from mneme.llm.types import as_list
from mneme.ports import Llm
from services.consolidation import engine

MAX_OBSERVATIONS_SHOWN = 12

DEFAULT_RULES = """Keep durable knowledge about people, their preferences, relationships, \
plans, habits and the state of things; skip small talk and one-off chatter."""

SYSTEM = """You maintain a memory bank's observations: consolidated beliefs, each backed \
by evidence from memories. Given NEW FACTS and EXISTING OBSERVATIONS of one scope, decide:
- update: a fact supports, refines or changes an existing observation. PREFER UPDATE OVER \
CREATE whenever a fact is about the same thing.
- create: a fact states something worth keeping that no observation covers.
- delete: only when a new fact shows an observation plainly wrong and no longer supported \
(be conservative); cite that fact as the evidence.
- facts you do not mention are left alone.
Rules:
- Preserve history: when a fact changes a state, write the new text as "was ..., now ..." \
(or "used to ..., now ..."); never silently overwrite.
- No computation: never add up, derive or adjust counts or numbers; only state numbers a \
fact states verbatim.
- Each evidence quote must be an exact substring of that memory's text.
What is worth keeping:
{rules}
Reply with JSON only."""

SCHEMA = {
    "type": "object",
    "properties": {"actions": {"type": "array", "items": {
        "type": "object",
        "properties": {
            "action": {"type": "string", "enum": ["create", "update", "delete"]},
            "observation_id": {"type": "string"},
            "text": {"type": "string"},
            "evidence": {"type": "array", "items": {
                "type": "object",
                "properties": {"memory_id": {"type": "string"}, "quote": {"type": "string"}},
                "required": ["memory_id", "quote"], "additionalProperties": False}},
            "reason": {"type": "string"},
        },
        "required": ["action", "observation_id", "text", "evidence", "reason"],
        "additionalProperties": False}}},
    "required": ["actions"], "additionalProperties": False,
}
_CHECK = {"type": "object", "required": ["actions"],
          "properties": {"actions": {"type": "array", "items": {
              "type": "object", "required": ["action"]}}}}


def _str(value: object) -> str:
    """``value`` stripped when it is a string, else "" (a model may give a number or null
    where the schema asks for a string)."""
    return value.strip() if isinstance(value, str) else ""


def max_text_chars(sources: Sequence[str]) -> int:
    """The longest observation text kept for ``sources`` (its evidence and the text it
    revises): twice their length plus 500 characters. An observation restates its
    sources; a longer text is a model's runaway output, refused like a computed count."""
    return 2 * sum(len(t) for t in sources) + 500


def messages(facts: Sequence[ev.Fact], current: Sequence[ev.Observation], mission: str) -> list[dict]:
    """The chat messages of one decision."""
    user = {"new_facts": [{"memory_id": f.id, "text": f.text} for f in facts],
            "existing_observations": [{"observation_id": o.id, "text": o.text,
                                       "proof_count": o.proof_count} for o in current]}
    return [{"role": "system", "content": SYSTEM.format(rules=mission.strip() or DEFAULT_RULES)},
            {"role": "user", "content": json.dumps(user, ensure_ascii=False)}]


def nearest(facts: Sequence[ev.Fact], current: dict[str, ev.Observation]) -> list[ev.Observation]:
    """The scope's observations most similar to any of ``facts`` (at most
    :data:`MAX_OBSERVATIONS_SHOWN`), in id order."""
    best = engine.ScopeIndex(current).best_of([f.embedding for f in facts])
    scored = sorted(current.values(), key=lambda o: (-best.get(o.id, 0.0), o.id))
    return sorted(scored[:MAX_OBSERVATIONS_SHOWN], key=lambda o: o.id)


def decide(gateway: Llm, facts: Sequence[ev.Fact], scope: list[str], current: dict[str, ev.Observation],
           texts: dict[str, str], at: datetime, cause: str, embed, model: str, mission: str
           ) -> tuple[list[ev.Observation], object]:
    """Ask the model and turn its actions into new observation states. ``texts`` maps
    memory ids (the facts and the shown observations' sources) to their text; ``embed``
    embeds a list of texts. Returns (changed states, usage). LlmError propagates (the
    caller falls back to the offline decision)."""
    shown = nearest(facts, current)
    res = gateway.complete_json("consolidation", messages(facts, shown, mission), SCHEMA,
                                check_schema=_CHECK, schema_name="observations")
    by_fact = {f.id: f for f in facts}
    out: dict[str, ev.Observation] = {}
    for n, a in enumerate(res.value.get("actions", [])):
        kind, oid, text = a.get("action"), _str(a.get("observation_id")), _str(a.get("text"))
        base = out.get(oid) or current.get(oid)
        ev_pairs = []
        for e in as_list(a.get("evidence")):
            mid = _str(e.get("memory_id")) if isinstance(e, dict) else ""
            if mid not in texts:
                continue  # the model cited a memory it was never shown
            q = _str(e.get("quote"))
            ev_pairs.append((mid, q if q and q in texts[mid] else engine.quote_of(texts[mid])))
        sources = [texts[m] for m, _ in ev_pairs] + ([base.text] if base is not None else [])
        if text and (engine.invented_numbers(text, sources)
                     or len(text) > max_text_chars(sources)):
            text = ""  # a computed count or a runaway text: keep the evidence, refuse the text
        if kind == "delete" and not any(m in by_fact for m, _ in ev_pairs):
            continue  # no new fact shows it wrong: a model's junk or an injected order
        if kind == "delete" and base is not None:
            new = engine.next_state(base, at)
            new.deleted = True
            new.history.add(text=base.text, at=new.updated_at,
                            reason=_str(a.get("reason")) or "deleted")
        elif kind == "update" and base is not None:
            new = engine.next_state(base, at)
            if text and text != base.text:
                engine.revise(new, text, at,
                              _str(a.get("reason")) or f"was: {base.text} — now: {text}")
                new.embedding[:] = embed([text])[0]
            for mid, q in ev_pairs:
                engine.add_evidence(new, mid, q)
                if mid in by_fact:
                    engine.add_entities(new, by_fact[mid].entities)
        elif kind in ("create", "update"):
            first = next((by_fact[m] for m, _ in ev_pairs if m in by_fact), None)
            if first is None:
                continue
            text = text or first.text
            new = engine.create(first, scope, at, f"{cause}/{n}", model, text=text,
                                embedding=embed([text])[0])
            for mid, q in ev_pairs:
                engine.add_evidence(new, mid, q)
                if mid in by_fact:
                    engine.add_entities(new, by_fact[mid].entities)
            # create() quoted the first sentence; keep only the model's (valid) quotes
            del new.evidence[:]
            for mid, q in ev_pairs:
                engine.add_evidence(new, mid, q)
        else:
            continue
        out[new.id] = new
    return [out[k] for k in sorted(out)], res.usage
