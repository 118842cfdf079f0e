"""One bound on the calls a server lets wait for the event log's consumers at once.

A call that waits for a projection (a sync Retain or deletion for its operation, an entity
merge or split for the graph, a mental-model write for the catalog) holds a gRPC worker
thread for as long as the consumers take, which is minutes behind a large retain; a
reflection with a model waits on the model as long. Every such wait in a process holds one
:class:`WaitSlots` slot (``MNEME_SYNC_CALLS``; by default
the workers less four), whichever service it belongs to, so a burst of them is refused
with RESOURCE_EXHAUSTED before it writes anything, and reads and health checks keep threads
to run on.

A server for many tenants can let one tenant hold at most ``MNEME_SYNC_CALLS_PER_TENANT``
of them, so a burst from one agent leaves the rest to every other tenant (by default a
tenant may take them all: a server with one application keeps every slot for it). The tenant is the caller's API key or certificate
when it is limited to some banks (that is what a per-tenant key looks like), else the
bank the call is for: a ``*`` key of a platform team, or an open server, serves many
agents, one bank each.
"""

from __future__ import annotations

import collections
import contextlib
import threading

from mneme import auth
from mneme.errors import ResourceExhausted


def tenant(bank_id: str) -> str:
    """Whose share a call on ``bank_id`` ("" when the call names none) counts against:
    ``key:<id>`` / ``cert:<CN>`` for a principal limited to some banks, else
    ``bank:<bank_id>``."""
    principal = auth.current()
    if principal.banks is not None:
        return principal.name
    return f"bank:{bank_id}"


class WaitSlots:
    """At most ``size`` holders at once (``size`` 0: no bound), at most ``share`` of them
    for one tenant (:func:`tenant`; 0 or None: ``size``, no share). Thread-safe."""

    def __init__(self, size: int = 0, share: int | None = None) -> None:
        self.size = size
        self.share = min(share, size) if share else size
        self._lock = threading.Lock()
        self.waiting = 0  # holders now
        self._held: collections.Counter[str] = collections.Counter()  # tenant → holders

    @contextlib.contextmanager
    def hold(self, bank_id: str = ""):
        """A slot for the duration of the block, counted against the share of
        :func:`tenant` (``bank_id``); ResourceExhausted (nothing held) when all ``size``
        are taken or the tenant holds its ``share``."""
        if not self.size:
            yield
            return
        who = tenant(bank_id)
        self._take(who)
        try:
            yield
        finally:
            self._give(who)

    @contextlib.contextmanager
    def try_hold(self, who: str):
        """As :meth:`hold` for the tenant ``who`` (a name of the caller's choosing, e.g.
        one for every best-effort wait, so those never take a bank's share), but yields
        False instead of raising when no slot is free (the caller then skips what it
        would have waited for), True while it holds one."""
        if not self.size:
            yield True
            return
        try:
            self._take(who)
        except ResourceExhausted:
            yield False
            return
        try:
            yield True
        finally:
            self._give(who)

    def _take(self, who: str) -> None:
        with self._lock:
            if self.waiting >= self.size:
                raise ResourceExhausted(
                    f"{self.size} calls are waiting for their operations already "
                    "(MNEME_SYNC_CALLS): retry later, or send the call async and poll "
                    "GetOperation")
            if self._held[who] >= self.share:
                raise ResourceExhausted(
                    f"{self.share} calls of this caller are waiting for their operations "
                    "already (MNEME_SYNC_CALLS_PER_TENANT, so other callers keep the rest "
                    f"of MNEME_SYNC_CALLS={self.size}): retry later, or send the call async "
                    "and poll GetOperation")
            self.waiting += 1
            self._held[who] += 1

    def _give(self, who: str) -> None:
        with self._lock:
            self.waiting -= 1
            self._held[who] -= 1
            if not self._held[who]:
                del self._held[who]
