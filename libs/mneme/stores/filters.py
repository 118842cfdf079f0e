"""Recall/list filters (:class:`mneme.domain.Filters`) as pure predicates.

Adapters push filters down to their store where they can; these functions are the
reference semantics (the contract tests compare every adapter against them) and the
post-filter for whatever a store cannot express.
"""

from __future__ import annotations

from typing import Iterable

from mneme.domain import Fact, Filters

#: The tag-matching modes of ``Filters.tags_match``.
TAGS_MATCH_MODES = ("any", "all", "any_strict", "all_strict", "exact")


def tags_match(unit_tags: Iterable[str], tags: Iterable[str], mode: str = "any") -> bool:
    """Whether a unit with ``unit_tags`` (U) passes a tag filter ``tags`` (T) in ``mode``.

    - ``any``: U∩T≠∅, or U is empty (untagged units are shared by every scope)
    - ``all``: T⊆U, or U is empty
    - ``any_strict``: U∩T≠∅
    - ``all_strict``: T⊆U
    - ``exact``: set(U) == set(T)

    An empty T means "no tag filter" (always True), except in ``exact`` mode, where it
    selects units without tags. Raises ValueError for an unknown ``mode``.
    """
    if mode not in TAGS_MATCH_MODES:
        raise ValueError(f"unknown tags_match mode {mode!r}; expected one of {TAGS_MATCH_MODES}")
    u, t = set(unit_tags), set(tags)
    if mode == "exact":
        return u == t
    if not t:
        return True
    if mode == "any":
        return not u or bool(u & t)
    if mode == "all":
        return not u or t <= u
    if mode == "any_strict":
        return bool(u & t)
    return t <= u  # all_strict


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
