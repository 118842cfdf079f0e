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


@pytest.mark.parametrize("args", [["generations", "list"], ["generations", "drop", "1"],
                                  ["replay"], ["log", "recover"]])
def test_a_command_reading_a_data_dir_that_does_not_exist_refuses_and_creates_nothing(
        args, tmp_path):
    none = tmp_path / "none"
    out = CliRunner().invoke(app, [*args, "-d", str(none)])
    assert out.exit_code == 1 and "no data dir" in out.output, out.output
    assert not none.exists()


@pytest.mark.parametrize("address", ["127.0.0.1:99999", "127.0.0.1", "", "host:port"])
def test_an_address_that_is_not_host_and_port_is_refused(address, tmp_path):
    """gRPC would take port 99999 as 34463; the client and the server's settings refuse
    it, as one line and exit 1, not a traceback."""
    from mneme.client import MnemeClient
    from mneme.config import Settings
    with pytest.raises(ValueError):
        MnemeClient(address)
    with pytest.raises(ValueError):
        Settings(grpc_address=address or "x", data_dir=tmp_path)
    out = CliRunner().invoke(app, ["banks", "list", "-a", address])
    assert out.exit_code == 1 and "HOST:PORT" in out.output and "Traceback" not in out.output
    out = CliRunner().invoke(app, ["up", "--data-dir", str(tmp_path), "--address", address or "x"])
    assert out.exit_code == 1 and "HOST:PORT" in out.output, out.output
    for fine in ("[::1]:0", "dns:///mneme-ingest:50051"):
        MnemeClient(fine).close()


def test_an_error_a_command_did_not_expect_is_one_line(tmp_path):
    out = CliRunner().invoke(app, ["import-locomo", str(tmp_path / "none.json"), "-a", "h:1"])
    assert out.exit_code == 1 and "Traceback" not in out.output
    assert out.output.startswith("error: FileNotFoundError:") and "none.json" in out.output


@pytest.mark.parametrize("args", [
    ["banks", "update", "b", "--set", "skepticism=99999999999"],
    ["banks", "update", "b", "--set", "auto_consolidate=maybe"],
    ["banks", "get", "b", "--skepticism", "5"],
    ["banks", "delete", "b", "--name", "x"],
])
def test_a_bank_setting_that_cannot_apply_is_a_usage_error(args):
    """Out of an int32's range, a boolean that is neither true nor false, or config given
    to a command that takes none: exit 2 before any call (it used to be a traceback, a
    silent false, or ignored)."""
    out = CliRunner().invoke(app, [*args, "-a", "127.0.0.1:1"], env={"COLUMNS": "200"})
    assert out.exit_code == 2 and "UNAVAILABLE" not in out.output, out.output


def test_a_closed_pipe_ends_quietly_as_click_ends_it():
    """`mneme … | head -1`: the reader goes away while the command writes; click's own
    handling (a quiet exit 1), not an "error: BrokenPipeError" line."""
    import typer

    from mneme.cli import _Commands
    app = typer.Typer(cls=_Commands)

    @app.command()
    def spill():
        raise BrokenPipeError(32, "Broken pipe")

    @app.command()
    def other():
        pass

    r = CliRunner().invoke(app, ["spill"])
    assert r.exit_code == 1 and "error" not in r.output.lower(), r.output
