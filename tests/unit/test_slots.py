"""mneme.slots.WaitSlots: the process's bound on waiting calls, and one tenant's share."""

from __future__ import annotations

import contextlib

import pytest

from mneme import auth
from mneme.errors import ResourceExhausted
from mneme.slots import WaitSlots


@contextlib.contextmanager
def _as(principal: auth.Principal):
    token = auth._current.set(principal)
    try:
        yield
    finally:
        auth._current.reset(token)


def test_one_bank_takes_at_most_its_share_and_other_banks_get_the_rest():
    slots = WaitSlots(4, share=2)
    with contextlib.ExitStack() as held:
        held.enter_context(slots.hold("a"))
        held.enter_context(slots.hold("a"))
        with pytest.raises(ResourceExhausted, match="MNEME_SYNC_CALLS_PER_TENANT"):
            held.enter_context(slots.hold("a"))
        held.enter_context(slots.hold("b"))
        held.enter_context(slots.hold("c"))
        with pytest.raises(ResourceExhausted, match=r"4 calls .*\(MNEME_SYNC_CALLS\)"):
            held.enter_context(slots.hold("d"))  # all four taken
        assert slots.waiting == 4
    assert slots.waiting == 0
    with slots.hold("a"), slots.hold("a"):  # given back: a's share again
        pass


def test_a_key_limited_to_some_banks_is_one_tenant_across_its_banks():
    """A per-tenant key owns several banks: its share counts all of them. A ``*`` key (a
    platform team's, serving many agents) is shared per bank instead."""
    slots = WaitSlots(4, share=2)
    tenant = auth.Principal("key:t1", frozenset({"a", "b", "c"}), True)
    platform = auth.Principal("key:all", None, True)
    with contextlib.ExitStack() as held, _as(tenant):
        held.enter_context(slots.hold("a"))
        held.enter_context(slots.hold("b"))
        with pytest.raises(ResourceExhausted, match="MNEME_SYNC_CALLS_PER_TENANT"):
            held.enter_context(slots.hold("c"))
        with _as(platform):
            held.enter_context(slots.hold("a"))
            held.enter_context(slots.hold("x"))
        assert slots.waiting == 4


@pytest.mark.parametrize("size, share, expected", [
    (1, None, 1), (2, None, 2), (12, None, 12), (12, 0, 12), (12, 6, 6), (4, 9, 4), (0, None, 0)])
def test_without_a_share_a_tenant_may_take_every_slot_and_a_share_never_exceeds_the_size(
        size, share, expected):
    assert WaitSlots(size, share).share == expected


def test_by_default_one_bank_may_take_every_slot():
    """A server with one application keeps every slot for it: no share unless set."""
    slots = WaitSlots(3)
    with slots.hold("a"), slots.hold("a"), slots.hold("a"):
        with pytest.raises(ResourceExhausted, match=r"\(MNEME_SYNC_CALLS\)"):
            with slots.hold("b"):
                pass


def test_no_bound_holds_nothing():
    slots = WaitSlots(0)
    with slots.hold("a"), slots.hold("a"), slots.hold("a"):
        assert slots.waiting == 0


def test_try_hold_yields_false_instead_of_refusing_and_counts_for_its_own_tenant():
    """A best-effort wait (an async write's) takes a slot as a tenant of its own: it never
    takes a bank's share, and yields False when none is free."""
    slots = WaitSlots(3, share=1)
    with slots.hold("a"):  # bank a's share is taken
        with slots.try_hold("async-waits") as first:
            assert first and slots.waiting == 2
            with slots.try_hold("async-waits") as second:  # that tenant's share is taken
                assert not second and slots.waiting == 2
            with slots.hold("b"):  # bank b still gets its slot
                assert slots.waiting == 3
                with slots.try_hold("other") as full:  # none free
                    assert not full
    assert slots.waiting == 0
