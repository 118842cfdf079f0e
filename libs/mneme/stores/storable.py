"""Text every store can hold: the one rule each adapter applies to what it writes.

The API accepts any Unicode string, and old logs may hold text that was accepted before
ingest refused control characters. FalkorDB cannot take NUL (U+0000) in a query
parameter (its parser stops at it), so every adapter — graph, text and vector, embedded and
production — writes NUL as U+FFFD (the replacement character) instead. All stores thus hold
the same text, a document id keeps matching itself across stores, and two ids that differ
only by a NUL do not merge (as they would if it were simply dropped).
"""

from __future__ import annotations

import dataclasses
import json
from typing import Any, Sequence

from mneme.domain import Fact

#: Characters no store may receive, with their stand-in.
REPLACEMENTS = {"\x00": "\ufffd"}


def storable(text: str | None) -> str | None:
    """``text`` with every character of :data:`REPLACEMENTS` replaced (None stays None);
    the same object when there is nothing to replace (cheap on the hot path)."""
    if not text:
        return text
    for bad, good in REPLACEMENTS.items():
        if bad in text:
            text = text.replace(bad, good)
    return text


#: How :data:`REPLACEMENTS`' characters look inside JSON (control characters are escaped).
_JSON_BAD = tuple(json.dumps(bad)[1:-1] for bad in REPLACEMENTS)


def storable_value(value: Any) -> Any:
    """:func:`storable` applied to every string inside ``value`` (dicts — keys too —,
    lists and tuples, recursively); other values unchanged. For query parameters.
    ``value`` itself when nothing needs replacing: found by one pass of the C JSON
    encoder over it, ~10x cheaper than walking a graph upsert's thousands of strings
    in Python (half of that upsert's time in this process)."""
    try:
        dumped = json.dumps(value, ensure_ascii=False)
    except (TypeError, ValueError):  # not JSON (e.g. bytes): walk it
        return _storable_value(value)
    if not any(bad in dumped for bad in _JSON_BAD):
        return value
    return _storable_value(value)


def _storable_value(value: Any) -> Any:
    if isinstance(value, str):
        return storable(value)
    if isinstance(value, dict):
        return {_storable_value(k): _storable_value(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return type(value)(_storable_value(v) for v in value)
    return value


def _has_bad(text: str) -> bool:
    return any(bad in text for bad in REPLACEMENTS)


def storable_fact(fact: Fact) -> Fact:
    """``fact`` with :func:`storable` text in every string field (text, context, ids,
    tags, metadata, entity names); the same object when it needs no change."""
    strings = [fact.text, fact.context, fact.document_id, fact.chunk_id, fact.id,
               *fact.tags, *fact.metadata, *fact.metadata.values(),
               *(e.name for e in fact.entities), *(e.id for e in fact.entities)]
    if not any(s and _has_bad(s) for s in strings):
        return fact
    return dataclasses.replace(
        fact, id=storable(fact.id), text=storable(fact.text), context=storable(fact.context),
        document_id=storable(fact.document_id), chunk_id=storable(fact.chunk_id),
        tags=tuple(storable(t) for t in fact.tags),
        metadata={storable(k): storable(v) for k, v in fact.metadata.items()},
        entities=[dataclasses.replace(e, id=storable(e.id), name=storable(e.name))
                  for e in fact.entities])


def storable_facts(facts: Sequence[Fact]) -> list[Fact]:
    """:func:`storable_fact` of each of ``facts``."""
    return [storable_fact(f) for f in facts]


__all__ = ["REPLACEMENTS", "storable", "storable_fact", "storable_facts", "storable_value"]
