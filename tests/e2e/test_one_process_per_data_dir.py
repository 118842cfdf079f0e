"""A second ``mneme up`` or ``mneme serve`` on a data dir another mneme process serves is
refused at once, naming the data dir, and touches nothing of the first's: its stores and
graph server keep serving, and its data is intact."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from tests.e2e.server import Server, free_port, inherited, up_refuses
from tests.e2e.test_falkor_child import _retain_cello, _servers

pytestmark = pytest.mark.slow


def test_a_second_process_on_a_served_data_dir_is_refused(tmp_path):
    data = tmp_path / "data"
    server = Server(data).start()
    try:
        _retain_cello(server)
        graph = _servers(data)
        assert len(graph) == 1
        out = up_refuses(data)
        assert f"{data.resolve()} is in use by another mneme process" in out, out
        serve = subprocess.run(
            [str(Path(sys.executable).with_name("mneme")), "serve", "search", "--data-dir",
             str(data), "--address", f"127.0.0.1:{free_port()}"],
            env={**inherited(), "HF_HUB_OFFLINE": "1", "MNEME_METRICS_PORT": "0"},
            capture_output=True, text=True, timeout=180)
        said = " ".join((serve.stdout + serve.stderr).split())
        assert serve.returncode == 1 and "is in use by another mneme process" in said, said
        assert _servers(data) == graph  # no second graph server on the files
        with server.client(timeout=60) as m:
            assert any("cello" in x.text for x in m.list_memories("k"))
            assert m.retain("k", [{"content": "Tom sells bread in Braga."}]).operation.state == 3
            assert m.bank_stats("k").entities > 0
    finally:
        server.stop()
