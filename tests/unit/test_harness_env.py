"""The test harness's own MNEME_* knobs never reach a mneme process a test starts:
``mneme up``/``serve`` refuse an MNEME_* variable that is not a setting, so a knob such
as MNEME_TORTURE_SEED (documented to rerun a seed) made the test fail at its start."""

from __future__ import annotations

import re
from pathlib import Path

from mneme.config import check_environment, known_variables
from tests.e2e import server

TESTS = Path(__file__).resolve().parents[1]


def _knobs() -> set[str]:
    """MNEME_* names the tests read from their own environment that are not settings."""
    names = set()
    for f in TESTS.rglob("*.py"):
        names |= set(re.findall(r"environ\.get\(\s*[\"'](MNEME_[A-Z0-9_]+)", f.read_text()))
    return names - known_variables()


def test_every_harness_knob_is_left_out_of_a_servers_environment(monkeypatch):
    knobs = _knobs()
    assert {"MNEME_TORTURE_SEED", "MNEME_FUZZ_SEED"} <= knobs
    for k in knobs:
        monkeypatch.setenv(k, "1")
    env = server.inherited()
    assert not knobs & set(env)
    check_environment({k: v for k, v in env.items() if k.startswith("MNEME_")})


def test_no_test_starts_a_process_on_the_whole_environment():
    """A process started on ``os.environ`` itself gets the knobs: every test starts from
    :func:`tests.e2e.server.inherited`."""
    offenders = [f"{f.relative_to(TESTS)}:{n}" for f in TESTS.rglob("*.py")
                 for n, line in enumerate(f.read_text().splitlines(), 1)
                 if re.search(r"\*\*os\.environ\b|os\.environ\.copy\(\)|dict\(os\.environ\)",
                              line)]
    assert offenders == []
