"""CLI options that fill proto int32 fields or count things are bounded: a value out of
range is a usage error (exit 2, the option named) before any call, never a traceback."""

from __future__ import annotations

import pytest
from typer.testing import CliRunner

from mneme.cli import app

HUGE = str(2**31)  # one past int32


@pytest.mark.parametrize("args, option", [
    (["recall", "b", "q", "--max-tokens", HUGE], "--max-tokens"),
    (["directives", "create", "b", "text", "--priority", HUGE], "--priority"),
    (["directives", "update", "b", "d", "--priority", "-" + str(2**31 + 1)], "--priority"),
    (["mental-models", "create", "b", "name", "q", "--max-tokens", HUGE], "--max-tokens"),
    (["mental-models", "update", "b", "m", "--refresh-every", HUGE], "--refresh-every"),
    (["memories", "list", "b", "--limit", "-1"], "--limit"),
    (["documents", "list", "b", "--limit", "-1"], "--limit"),
])
def test_an_out_of_range_number_is_a_usage_error(args, option):
    out = CliRunner().invoke(app, [*args, "-a", "127.0.0.1:1"], env={"COLUMNS": "200"})
    assert out.exit_code == 2 and isinstance(out.exception, SystemExit), out.output
    assert option in out.output


def test_generations_of_a_data_dir_that_does_not_exist_is_an_error(tmp_path):
    out = CliRunner().invoke(app, ["generations", "list", "-d", str(tmp_path / "none")])
    assert out.exit_code == 1 and "no data dir" in out.output
    assert not (tmp_path / "none").exists()
