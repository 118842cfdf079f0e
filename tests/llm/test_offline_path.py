"""With no model configured nothing imports litellm (it is slow and wants the network)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]

SCRIPT = r"""
import sys
from datetime import datetime, timezone
from mneme.domain import Fact, Scored
from mneme.llm import LlmGateway, LlmSettings
from mneme.llm.rerank import Reranker, rerank
from services.extraction.llm import LlmExtractor
from services.reflect.agent import ReflectAgent

gw = LlmGateway(LlmSettings(_env_file=None))
assert not any(gw.configured(op) for op in ("retain", "reflect", "consolidation", "rerank"))
results = [Scored(fact=Fact(id="a", bank_id="b", text="x")), Scored(fact=Fact(id="c", bank_id="b", text="y"))]
assert rerank("q", results, gw) == results and Reranker(gw)("q", results) == results
assert [c.ok for c in gw.check(("retain",))] == [False]
LlmExtractor(gw); ReflectAgent(gw, recall=lambda q: None)
assert "litellm" not in sys.modules, "litellm was imported"
print("ok")
"""


def test_nothing_imports_litellm_without_a_model():
    env = {k: v for k, v in os.environ.items() if not k.startswith("MNEME_")}
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), str(ROOT / "libs")])
    out = subprocess.run([sys.executable, "-c", SCRIPT], cwd=ROOT, env=env, capture_output=True,
                         text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip() == "ok"
