"""Stop on SIGTERM/SIGINT: the one way ``mneme up`` and ``mneme serve`` wait for a signal.

Python runs a signal's handler in the main thread, between bytecodes. The kernel may
deliver a process-directed signal to any thread (gRPC's, ONNX Runtime's, a consumer's);
then only a flag is set, and a main thread blocked in ``Event.wait()`` with no timeout
never runs the handler: the SIGTERM is lost until another signal happens to interrupt the
main thread (seen under recall load: Kubernetes would then SIGKILL the pod after its
grace period, with no drain). Waiting in short slices lets the main thread run pending
handlers within :data:`POLL_S`.
"""

from __future__ import annotations

import signal
import threading

#: Seconds between the main thread's checks for a pending signal handler.
POLL_S = 0.2


def stop_on_signals(signals: tuple[int, ...] = (signal.SIGINT, signal.SIGTERM)) -> threading.Event:
    """An event set by any of ``signals`` (installs their handlers; call from the main
    thread, as :func:`signal.signal` requires)."""
    stop = threading.Event()
    for sig in signals:
        signal.signal(sig, lambda *_: stop.set())
    return stop


def wait(stop: threading.Event, poll_s: float = POLL_S) -> None:
    """Block until ``stop`` is set, waking every ``poll_s`` seconds so a signal delivered to
    another thread still runs its handler in this (the main) thread."""
    while not stop.wait(poll_s):
        pass
