"""Generated protobuf code is reproducible from proto/."""

import filecmp
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_regenerating_gives_identical_files(tmp_path):
    subprocess.run([sys.executable, str(ROOT / "scripts" / "gen_proto.py"), str(tmp_path)],
                   check=True, cwd=ROOT)
    for sub in ("mneme/v1", "mneme/events/v1"):
        fresh = sorted(p.name for p in (tmp_path / sub).glob("*.py*"))
        assert fresh, sub
        _, mismatch, errors = filecmp.cmpfiles(ROOT / "libs" / sub, tmp_path / sub, fresh, shallow=False)
        assert not mismatch and not errors, (sub, mismatch, errors)
