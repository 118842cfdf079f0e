"""Fixtures of the deploy checks: the validators of scripts/deploy_check.py."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def _load_checks():
    spec = importlib.util.spec_from_file_location("deploy_check",
                                                  ROOT / "scripts" / "deploy_check.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules["deploy_check"] = module
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="session")
def checks():
    """The scripts/deploy_check.py module (its ``check_*`` functions raise
    ``CheckFailed`` with the validator's output)."""
    return _load_checks()
