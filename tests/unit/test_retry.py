"""mneme.retry: the shared tenacity waits and stop conditions, through tenacity.Retrying."""

from __future__ import annotations

import pytest
import tenacity

from mneme import retry
from mneme.deadline import Deadline


def run(policy: dict, failures: int) -> tuple[list[float], int]:
    """Call a function failing ``failures`` times under ``policy``; (sleeps, calls)."""
    sleeps: list[float] = []
    calls = 0

    def fn():
        nonlocal calls
        calls += 1
        if calls <= failures:
            raise OSError(f"failure {calls}")
        return "ok"

    try:
        tenacity.Retrying(sleep=sleeps.append, reraise=True, **policy)(fn)
    except OSError:
        pass
    return sleeps, calls


def test_backoff_doubles_up_to_the_cap():
    sleeps, calls = run({"wait": retry.backoff(0.5, 3.0),
                         "stop": tenacity.stop_after_attempt(6)}, failures=5)
    assert sleeps == [0.5, 1.0, 2.0, 3.0, 3.0] and calls == 6


def test_backoff_jitter_stays_within_its_band():
    seen = []
    w = retry.backoff(1.0, 30.0, jitter=0.2, uniform=lambda a, b: seen.append((a, b)) or b)
    assert w.delay(3) == pytest.approx(4.8) and seen == [(0.8, 1.2)]
    with pytest.raises(ValueError):
        retry.backoff(1.0, 2.0, jitter=1.5)


def test_a_hint_raises_the_wait_but_not_past_the_cap():
    hints = iter([5.0, None, 60.0])
    sleeps, _ = run({"wait": retry.at_least_hint(retry.backoff(1.0, 8.0), lambda e: next(hints), 8.0),
                     "stop": tenacity.stop_after_attempt(4)}, failures=3)
    assert sleeps == [5.0, 2.0, 8.0]


def test_waits_are_cut_to_the_deadline_and_stop_once_it_passed():
    sleeps, _ = run({"wait": retry.within_deadline(retry.backoff(10.0, 10.0), Deadline.after(0.0)),
                     "stop": tenacity.stop_after_attempt(2)}, failures=1)
    assert sleeps == [0.0]
    _, calls = run({"stop": retry.stop_on_deadline(Deadline.after(0.0))}, failures=5)
    assert calls == 1
    _, calls = run({"stop": retry.stop_on_deadline(Deadline(None, lambda: False))}, failures=5)
    assert calls == 1  # the caller went away
    _, calls = run({"stop": retry.stop_on_deadline(Deadline())}, failures=3)
    assert calls == 4  # no deadline: retried until it succeeds
