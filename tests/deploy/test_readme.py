"""The README documents `docker compose up` and every MNEME_* variable mneme reads."""

from __future__ import annotations

import re
from pathlib import Path

from mneme.config import Settings

ROOT = Path(__file__).resolve().parents[2]
README = (ROOT / "README.md").read_text(encoding="utf-8")

_ENV_READ = re.compile(r"""(?:environ(?:\.get)?\(?\[?|getenv\()\s*["'](MNEME_[A-Z0-9_]+)["']""")


def variables_read() -> set[str]:
    """Settings fields plus MNEME_* variables read through os.environ / os.getenv in the
    package, the services and deploy/, plus those the compose file interpolates."""
    names = {f"MNEME_{name.upper()}" for name in Settings.model_fields}
    for base in ("libs/mneme", "services", "deploy"):
        for path in (ROOT / base).rglob("*.py"):
            if "/v1/" in str(path):
                continue  # generated code
            names |= set(_ENV_READ.findall(path.read_text(encoding="utf-8")))
    compose = (ROOT / "docker-compose.yml").read_text(encoding="utf-8")
    names |= set(re.findall(r"\$\{(MNEME_[A-Z0-9_]+)", compose))
    return names


def test_every_variable_is_documented():
    missing = sorted(v for v in variables_read() if f"`{v}`" not in README)
    assert not missing, f"README lacks: {missing}"


def test_settings_are_in_the_configuration_table():
    table = README[README.index("## Configuration"):]
    for name in Settings.model_fields:
        assert re.search(rf"(?m)^\| `MNEME_{name.upper()}` \|", table), name


def test_distributed_topology_section():
    assert "## Distributed topology (docker compose)" in README
    assert "docker compose up" in README
    first = README.index("```sh")
    assert README[first:].splitlines()[1].startswith("make run")
    assert README[first:].splitlines()[2].startswith("make test")


def test_limits_are_in_the_limits_table():
    from mneme.limits import Limits
    table = README[README.index("## Limits"):]
    for name, field in Limits.model_fields.items():
        assert re.search(rf"(?m)^\| `MNEME_LIMIT_{name.upper()}` \| {field.default} \|", table), name


def test_the_services_table_matches_the_routes():
    """"What runs" lists, per service, the topics its groups consume and those it produces
    as services/<name>/routes.py declares them (reflect's input is gRPC)."""
    from mneme.bootstrap import services

    table = README[README.index("## What runs"):README.index("Stores (embedded defaults)")]
    rows = {m.group(1): (set(re.findall(r"`(mneme\.[a-z]+\.v1)`", m.group(2))),
                         set(re.findall(r"`(mneme\.[a-z]+\.v1)`", m.group(3))))
            for m in re.finditer(r"(?m)^\| (\w+) \| [^|]* \| ([^|]*) \| ([^|]*) \|$", table)}
    for name, svc in services().items():
        consumed = {t for g in svc.groups for t in g.topics}
        produced = {t for t in svc.produces if t != "mneme.audit.v1"}  # the audit trail: Security
        assert rows[name] == (consumed, produced), name


def test_the_retain_flow_names_files_that_exist():
    section = README[README.index("## How a retain flows"):README.index("## Distributed topology")]
    paths = set(re.findall(r"`((?:libs|services)/[\w/<>.]+)`", section))
    assert len(paths) >= 10
    for p in paths:
        if "<name>" not in p:
            assert (ROOT / p).exists(), p


def test_every_variable_read_is_known_to_the_start_check():
    """A server refuses MNEME_* variables it does not know (mneme.config.check_environment):
    every one the code, the deploy files and the README name must be known to it."""
    from mneme.config import unknown_variables
    documented = {v for v in re.findall(r"`(MNEME_[A-Z0-9_]*[A-Z0-9])`", README)
                  if not v.endswith(("_TLS", "_SSL", "_LIMIT", "_LLM"))}  # prefixes of a family
    assert unknown_variables(dict.fromkeys(variables_read() | documented, "")) == []
