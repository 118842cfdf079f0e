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
