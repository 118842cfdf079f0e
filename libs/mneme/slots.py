"""One bound on the calls a server lets wait for the event log's consumers at once.

A call that waits for a projection (a sync Retain or deletion for its operation, an entity
merge or split for the graph, a mental-model write for the catalog) holds a gRPC worker
thread for as long as the consumers take, which is minutes behind a large retain; a
reflection with a model waits on the model as long. Every such wait in a process holds one
:class:`WaitSlots` slot (``MNEME_SYNC_CALLS``; by default
the workers less four), whichever service it belongs to, so a burst of them is refused
with RESOURCE_EXHAUSTED before it writes anything, and reads and health checks keep threads
to run on.
"""

from __future__ import annotations

import contextlib
import threading

from mneme.errors import ResourceExhausted


class WaitSlots:
    """At most ``size`` holders at once (``size`` 0: no bound). Thread-safe."""

    def __init__(self, size: int = 0) -> None:
        self.size = size
        self._lock = threading.Lock()
        self.waiting = 0  # holders now

    @contextlib.contextmanager
    def hold(self):
        """A slot for the duration of the block; ResourceExhausted (nothing held) when
        all ``size`` are taken."""
        if not self.size:
            yield
            return
        with self._lock:
            if self.waiting >= self.size:
                raise ResourceExhausted(
                    f"{self.size} calls are waiting for their operations already "
                    "(MNEME_SYNC_CALLS): retry later, or send the call async and poll "
                    "GetOperation")
            self.waiting += 1
        try:
            yield
        finally:
            with self._lock:
                self.waiting -= 1
