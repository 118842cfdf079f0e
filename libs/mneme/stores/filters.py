"""Recall/list filters (:class:`mneme.domain.Filters`) as pure predicates.

Adapters push filters down to their store where they can; these functions are the
reference semantics (the contract tests compare every adapter against them) and the
post-filter for whatever a store cannot express.
"""

from __future__ import annotations

from mneme.domain import TAGS_MATCH_MODES, Fact, Filters, tags_match

# tags_match is the domain's (mental models and opinions filter by it too)
__all__ = ["TAGS_MATCH_MODES", "fact_matches", "tags_match"]


def fact_matches(fact: Fact, filters: Filters | None) -> bool:
    """Whether ``fact`` passes every condition of ``filters`` (None passes everything).

    ``types``: fact_type in types (empty = any); ``document_id``: equal (empty = any);
    ``tags``/``tags_match``: see :func:`tags_match`; ``time_range``: the fact's
    [occurred_start, occurred_end] overlaps the window (a fact without times never
    matches a time range; one missing end is taken as an instant at the other).
    """
    if filters is None:
        return True
    if filters.types and fact.fact_type not in filters.types:
        return False
    if filters.document_id and fact.document_id != filters.document_id:
        return False
    if not tags_match(fact.tags, filters.tags, filters.tags_match):
        return False
    if filters.time_range is not None and not filters.time_range.overlaps(
            fact.occurred_start, fact.occurred_end):
        return False
    return True


def check_document_id(document_id: str | None) -> None:
    """Guard of ``delete_where``: None means the whole bank, so an empty string (a
    missing id that slipped through) must not silently widen to it. ValueError for ""."""
    if document_id is not None and not document_id:
        raise ValueError("document_id must be non-empty, or None for the whole bank")
