"""Reference semantics of recall filters (mneme.stores.filters)."""

from datetime import datetime, timezone

import pytest

from mneme.domain import EXPERIENCE, WORLD, Fact, Filters, TimeWindow
from mneme.stores.filters import fact_matches, tags_match


def d(y, m=1, day=1):
    return datetime(y, m, day, tzinfo=timezone.utc)


@pytest.mark.parametrize("unit, tags, mode, expected", [
    # any: overlap, or unit untagged
    (["a", "b"], ["b", "c"], "any", True),
    (["a"], ["c"], "any", False),
    ([], ["c"], "any", True),
    # all: tags ⊆ unit, or unit untagged
    (["a", "b", "c"], ["a", "c"], "all", True),
    (["a"], ["a", "c"], "all", False),
    ([], ["a", "c"], "all", True),
    # strict variants exclude untagged units
    ([], ["a"], "any_strict", False),
    (["x", "a"], ["a", "z"], "any_strict", True),
    ([], ["a"], "all_strict", False),
    (["a", "b"], ["a", "b"], "all_strict", True),
    (["a"], ["a", "b"], "all_strict", False),
    # exact: same set, order and repeats ignored
    (["b", "a", "a"], ["a", "b"], "exact", True),
    (["a", "b", "c"], ["a", "b"], "exact", False),
    (["a"], ["a", "b"], "exact", False),
    # empty T: no filter, except exact selects untagged units
    (["a"], [], "any", True),
    (["a"], [], "all_strict", True),
    ([], [], "any_strict", True),
    ([], [], "exact", True),
    (["a"], [], "exact", False),
])
def test_tags_match_modes(unit, tags, mode, expected):
    assert tags_match(unit, tags, mode) is expected


def test_unknown_mode_is_rejected():
    with pytest.raises(ValueError, match="bogus"):
        tags_match(["a"], ["a"], "bogus")


def _fact(**kw):
    return Fact(id="f", bank_id="b", text="t", **kw)


def test_none_and_empty_filters_pass_everything():
    f = _fact(tags=("x",))
    assert fact_matches(f, None)
    assert fact_matches(f, Filters())


def test_types_and_document():
    f = _fact(fact_type=EXPERIENCE, document_id="doc1")
    assert fact_matches(f, Filters(types=(EXPERIENCE,)))
    assert not fact_matches(f, Filters(types=(WORLD,)))
    assert fact_matches(f, Filters(types=(WORLD, EXPERIENCE), document_id="doc1"))
    assert not fact_matches(f, Filters(document_id="doc2"))


def test_tags_through_filters():
    f = _fact(tags=("work",))
    assert fact_matches(f, Filters(tags=("work", "home"), tags_match="any_strict"))
    assert not fact_matches(f, Filters(tags=("work", "home"), tags_match="all_strict"))
    assert fact_matches(_fact(), Filters(tags=("work",), tags_match="all"))
    assert not fact_matches(_fact(), Filters(tags=("work",), tags_match="all_strict"))


def test_time_range_overlap():
    window = Filters(time_range=TimeWindow(d(2020), d(2020, 12, 31)))
    assert fact_matches(_fact(occurred_start=d(2019), occurred_end=d(2020, 2)), window)
    assert fact_matches(_fact(occurred_start=d(2020, 6)), window)            # instant
    assert fact_matches(_fact(occurred_end=d(2020, 6)), window)              # end only
    assert not fact_matches(_fact(occurred_start=d(2018), occurred_end=d(2019)), window)
    assert not fact_matches(_fact(occurred_start=d(2021, 1, 2)), window)
    assert not fact_matches(_fact(), window)                                 # no times
    # boundaries are inclusive; open-ended windows
    assert fact_matches(_fact(occurred_start=d(2020, 12, 31)), window)
    assert fact_matches(_fact(occurred_start=d(1990)),
                        Filters(time_range=TimeWindow(end=d(2000))))
    assert not fact_matches(_fact(occurred_start=d(1990)),
                            Filters(time_range=TimeWindow(start=d(2000))))
