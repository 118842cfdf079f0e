"""What a recall returns beside its results when asked (``RecallRequest.include``, as
Hindsight's recall ``include``): the entities the results mention, with observations
about them, and the stored text of the documents the results come from. Each within a
token budget of its own; neither is computed unless asked for, so a plain recall does
no more work than before.

Scope: everything returned is of the recall's bank; observations pass the recall's tag
filter as a recall of observations would; a document's text is returned under a tag
filter only when every item of the document passes it (its text holds every item).
"""

from __future__ import annotations

from typing import Sequence

from mneme.domain import Filters, IncludedDocument, IncludedEntity, Scored, tags_match
from mneme.errors import InvalidArgument
from mneme.ports import DocumentStore, TokenCounter, VectorStore

OBSERVATION = "observation"

#: Default and largest token budget of ``include.entities``.
ENTITY_TOKENS, MAX_ENTITY_TOKENS = 500, 8192
#: Default and largest token budget of ``include.documents``.
DOCUMENT_TOKENS, MAX_DOCUMENT_TOKENS = 8192, 65536
#: Most entities returned (a budget of one-token names would otherwise list hundreds).
MAX_ENTITIES = 100
#: Most documents looked at (read, and checked against a tag filter) for one recall.
MAX_DOCUMENTS = 50
#: How many observations nearest the query are read to find those about the entities.
OBSERVATION_CANDIDATES = 64
#: Most facts of one document read to check its items against a tag filter (as many as
#: GetDocument lists); a document with more is left out under a tag filter.
DOCUMENT_FACTS = 1000
#: A token spans at most this many characters in practice: only this many characters
#: per token of budget are counted, so a huge document costs no more than its share.
CHARS_PER_TOKEN = 16


def check_budget(value: int, field: str, maximum: int) -> None:
    """InvalidArgument (a ValueError, "<field>: ...") for a negative budget or one over
    ``maximum``."""
    if value < 0:
        raise InvalidArgument(field, "must be >= 0")
    if value > maximum:
        raise InvalidArgument(field, f"must be at most {maximum}")


def entities(results: Sequence[Scored], budget: int, *, bank_id: str, filters: Filters,
             vectors: VectorStore, query_vector: Sequence[float] | None,
             tokens: TokenCounter) -> list[IncludedEntity]:
    """The entities ``results`` mention, in the order of the first result mentioning each
    (at most :data:`MAX_ENTITIES`), with their observations, within ``budget`` tokens.

    Names first: each entity whose display name (as the result mentions it) fits in what
    is left is kept. Then observations: of the :data:`OBSERVATION_CANDIDATES` observations
    nearest ``query_vector`` that pass ``filters``' tags (None: no vector, none read),
    each that mentions a kept entity goes, nearest first, under the first of them in the
    returned order, while its text fits. An observation result itself contributes its entities too."""
    order: dict[str, IncludedEntity] = {}
    for s in results:
        for ref in s.fact.entities:
            if ref.id not in order and len(order) < MAX_ENTITIES:
                order[ref.id] = IncludedEntity(ref=ref)
    kept: list[IncludedEntity] = []
    left = budget
    for e in order.values():
        n = tokens.count(e.ref.name)
        if 0 < n <= left:
            e.tokens, left = n, left - n
            kept.append(e)
    if not kept or left <= 0 or not query_vector:
        return kept
    scope = Filters(types=(OBSERVATION,), tags=filters.tags,
                    tags_match=filters.tags_match or "any")
    hits = vectors.search(bank_id, query_vector, OBSERVATION_CANDIDATES, scope)
    found = {f.id: f for f in vectors.get(bank_id, [h.id for h in hits])} if hits else {}
    by_id = {e.ref.id: e for e in kept}
    rank = {e.ref.id: i for i, e in enumerate(kept)}
    for h in hits:
        o = found.get(h.id)
        # The payload is the final word on scope (a store may not push every filter down).
        if o is None or o.bank_id != bank_id or o.fact_type != OBSERVATION or not tags_match(
                o.tags, scope.tags, scope.tags_match):
            continue
        mine = [r.id for r in o.entities if r.id in by_id]
        if not mine:
            continue
        owner = by_id[min(mine, key=rank.__getitem__)]  # the first in the response
        n = tokens.count(o.text)
        if n <= left:
            owner.observations.append(o)
            owner.tokens += n
            left -= n
        if left <= 0:
            break
    return kept


def documents(results: Sequence[Scored], budget: int, *, bank_id: str, filters: Filters,
              store: DocumentStore | None, vectors: VectorStore,
              tokens: TokenCounter) -> list[IncludedDocument]:
    """The stored texts of the documents ``results`` come from, in the order of the first
    result of each (the first :data:`MAX_DOCUMENTS` of them), filled into ``budget``
    tokens: whole while they fit, then the next one cut to what is left (``truncated``),
    then no more. Documents whose text the bank does not store are skipped, and so, under a tag filter, are those with an item outside it
    (:func:`_in_scope`). ``store`` None (a server without the document projection): none."""
    if store is None or budget <= 0:
        return []
    memories: dict[str, list[str]] = {}
    for s in results:
        if s.fact.document_id:
            memories.setdefault(s.fact.document_id, []).append(s.fact.id)
    out: list[IncludedDocument] = []
    left = budget
    for document_id, ids in list(memories.items())[:MAX_DOCUMENTS]:
        doc = store.get(bank_id, document_id)
        if doc is None or not doc.text or not _in_scope(doc, filters, vectors):
            continue
        head = doc.text[:left * CHARS_PER_TOKEN]
        n = tokens.count(head)
        if len(head) == len(doc.text) and n <= left:
            out.append(IncludedDocument(document_id, doc.text, False, n, ids))
            left -= n
            continue
        cut = _prefix_within(head, left, tokens)
        if cut:
            out.append(IncludedDocument(document_id, cut, True, tokens.count(cut), ids))
        break
    return out


def _tag_filtered(filters: Filters) -> bool:
    return bool(filters.tags) or filters.tags_match == "exact"


def _in_scope(doc, filters: Filters, vectors: VectorStore) -> bool:
    """Whether every item of the document's latest retain passes the tag filter. Without
    one, yes. The store keeps the union of the items' tags: it decides when it is empty
    (every item untagged) or there was one item; otherwise each item is judged by its
    facts' tags (a fact carries its item's), and every item must have a fact to judge,
    else the document is left out rather than shown unjudged. The facts must also fit
    the latest revision -- as many items, the same union of tags -- or the document is
    left out: a retain that replaces it stores its new text at once, while the replaced
    version's facts stay until the new ones are extracted, and those would judge text
    they do not come from (facts carry no revision: two versions with the same item
    count and union of tags are not told apart)."""
    if not _tag_filtered(filters):
        return True
    mode = filters.tags_match or "any"
    rev = doc.latest
    if not rev.tags or rev.items <= 1:
        return tags_match(rev.tags, filters.tags, mode)
    facts, _ = vectors.scroll(doc.bank_id, DOCUMENT_FACTS, None,
                              Filters(document_id=doc.document_id))
    if len(facts) >= DOCUMENT_FACTS:
        return False
    items: dict[int, tuple[str, ...]] = {}
    union: set[str] = set()
    for f in facts:
        if f.fact_type == OBSERVATION:
            continue
        if not tags_match(f.tags, filters.tags, mode):
            return False
        items[f.item_index] = f.tags
        union.update(f.tags)
    return len(items) == rev.items and union == set(rev.tags)


def _prefix_within(text: str, budget: int, tokens: TokenCounter) -> str:
    """The longest prefix of ``text`` (cut at a character) of at most ``budget`` tokens,
    found by bisection (about log2(len) counts)."""
    lo, hi = 0, len(text)
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if tokens.count(text[:mid]) <= budget:
            lo = mid
        else:
            hi = mid - 1
    return text[:lo]
