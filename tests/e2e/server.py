"""Start and stop a real ``mneme up`` process for end-to-end tests."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

from mneme.client import MnemeClient
from tests.ports import free_port  # noqa: F401 - re-exported for the e2e tests


#: Prefixes of the test harness's own MNEME_* knobs (MNEME_FUZZ_SEED, MNEME_TORTURE_SEED,
#: ...): not mneme settings, so a mneme process started with them refuses to start.
HARNESS_KNOBS = ("MNEME_FUZZ_", "MNEME_TORTURE_", "MNEME_REPLAYPROP_")


def inherited() -> dict[str, str]:
    """This process's environment without the test harness's own knobs
    (:data:`HARNESS_KNOBS`): the base environment of every mneme process a test starts."""
    return {k: v for k, v in os.environ.items() if not k.startswith(HARNESS_KNOBS)}

ROOT = Path(__file__).resolve().parents[2]



def conversation_file() -> Path:
    """The shared LoCoMo dev split if present, else the conversation shipped in examples/."""
    shared = ROOT.parent / "shared" / "data" / "locomo" / "locomo_dev.json"
    return shared if shared.exists() else ROOT / "examples" / "locomo" / "conv-26.json"


def _listening(port: int) -> bool:
    """Whether something accepts TCP connections on 127.0.0.1:``port``."""
    try:
        socket.create_connection(("127.0.0.1", port), timeout=0.5).close()
        return True
    except OSError:
        return False


class Server:
    """A ``mneme up`` subprocess on ``data_dir``; ``address`` is host:port."""

    def __init__(self, data_dir: Path, port: int | None = None, env: dict | None = None):
        self.data_dir = data_dir
        # No Prometheus endpoint unless a test asks for one (parallel servers, one port).
        self.env = {"MNEME_METRICS_PORT": "0", **(env or {})}
        self.port = port or free_port()
        self.address = f"127.0.0.1:{self.port}"
        self.proc: subprocess.Popen | None = None
        self.log = data_dir.parent / f"{data_dir.name}-server.log"

    def start(self, timeout: float = 180) -> "Server":
        mneme = Path(sys.executable).with_name("mneme")
        out = open(self.log, "ab")
        self.proc = subprocess.Popen(
            [str(mneme), "up", "--data-dir", str(self.data_dir), "--address", self.address],
            stdout=out, stderr=subprocess.STDOUT, env={**inherited(), "HF_HUB_OFFLINE": "1", **self.env})
        deadline = time.monotonic() + timeout
        try:
            # Poll the port ourselves: a gRPC channel that found it closed backs off
            # (1 s, 1.6 s, 2.6 s, ...) and saw a server up in 1.5 s only after ~3 s.
            while not _listening(self.port):
                if self.proc.poll() is not None:
                    raise RuntimeError(f"exited with {self.proc.returncode}")
                if time.monotonic() > deadline:
                    raise TimeoutError(f"not listening within {timeout} s")
                time.sleep(0.05)
            with MnemeClient(self.address) as m:
                m.wait_ready(timeout=max(1.0, deadline - time.monotonic()))
        except Exception as e:
            self.stop()
            raise RuntimeError(f"server did not start ({e}):\n{self.log.read_text()[-3000:]}")
        return self

    def client(self, timeout: float = 600) -> MnemeClient:
        return MnemeClient(self.address, timeout=timeout)

    def stop(self, timeout: float = 60) -> None:
        if self.proc and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout=timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self.proc = None

    def replay(self, start: bool = True) -> None:
        """Stop the server, run ``mneme replay`` on its data dir (asserting success), and
        start it again (unless ``start`` is False)."""
        self.stop()
        mneme = Path(sys.executable).with_name("mneme")
        out = subprocess.run([str(mneme), "replay", "--data-dir", str(self.data_dir)],
                             capture_output=True, text=True,
                             env={**inherited(), "HF_HUB_OFFLINE": "1", **self.env})
        assert out.returncode == 0, out.stderr
        if start:
            self.start()

    def kill(self) -> None:
        """SIGKILL: no shutdown code runs."""
        if self.proc:
            os.kill(self.proc.pid, signal.SIGKILL)
            self.proc.wait()
        self.proc = None


def up_refuses(data_dir: Path) -> str:
    """Run ``mneme up`` on ``data_dir``: it must exit non-zero by itself (a data dir it
    refuses to serve); returns its output, whitespace folded (rich wraps long lines)."""
    p = subprocess.run([str(Path(sys.executable).with_name("mneme")), "up", "--data-dir",
                        str(data_dir), "--address", f"127.0.0.1:{free_port()}"],
                       env={**inherited(), "HF_HUB_OFFLINE": "1", "MNEME_METRICS_PORT": "0"},
                       capture_output=True, text=True, timeout=180)
    assert p.returncode != 0, p.stdout + p.stderr
    return " ".join((p.stdout + p.stderr).split())
