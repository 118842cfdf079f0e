"""Listening ports for the servers the tests start.

A port found free by binding port 0 is in the kernel's ephemeral range, the range every
outgoing connection (a Kafka client's, a gRPC channel's) also takes its local port
from, and it is free again the moment the probe closes: a service started later could
find it taken, or two servers could be handed the same one. So ports here come from
below the ephemeral range, are probed by binding, and are never handed out twice in
one test process."""

from __future__ import annotations

import random
import socket

_given: set[int] = set()
_rng = random.Random()


def _ephemeral_range() -> tuple[int, int]:
    try:
        with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
            lo, hi = (int(x) for x in f.read().split())
        return lo, hi
    except (OSError, ValueError):
        return 32768, 60999  # Linux's default


def free_port() -> int:
    """A loopback TCP port no one listens on now, outside the ephemeral range when
    there is room below it, and not returned before by this process. RuntimeError when
    none is found in 500 tries."""
    lo, _ = _ephemeral_range()
    low, high = (10000, lo - 1) if lo > 11000 else (1024, 65535)
    for _ in range(500):
        port = _rng.randint(low, high)
        if port in _given:
            continue
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
        _given.add(port)
        return port
    raise RuntimeError(f"no free port in {low}-{high}")
