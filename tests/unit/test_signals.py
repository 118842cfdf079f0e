"""A SIGTERM the kernel hands to a thread other than the main one still stops
``mneme up`` / ``mneme serve`` (mneme.runtime.signals)."""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

LIBS = str(Path(__file__).resolve().parents[2] / "libs")

SCRIPT = textwrap.dedent("""
    import signal, sys, threading, time
    sys.path.insert(0, sys.argv[1])
    from mneme.runtime import signals
    stop = signals.stop_on_signals()
    def worker():
        time.sleep(0.3)  # the main thread is blocked in wait() by now
        # a process-directed signal may land on any thread; send it to this one
        signal.pthread_kill(threading.get_ident(), signal.SIGTERM)
        time.sleep(30)
    threading.Thread(target=worker, daemon=True).start()
    t0 = time.monotonic()
    signals.wait(stop)
    print(f"stopped after {time.monotonic() - t0:.2f}s", flush=True)
""")


def test_sigterm_delivered_to_another_thread_stops_the_wait():
    out = subprocess.run([sys.executable, "-c", SCRIPT, LIBS], capture_output=True,
                         text=True, timeout=20)
    assert out.returncode == 0, out.stderr
    assert out.stdout.startswith("stopped after"), out.stdout


def test_wait_returns_when_the_event_is_set_from_code():
    import threading
    from mneme.runtime import signals

    stop = threading.Event()
    threading.Timer(0.1, stop.set).start()
    signals.wait(stop, poll_s=0.05)
    assert stop.is_set()
