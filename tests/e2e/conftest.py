"""Fixtures shared by the e2e modules that need one plain ``mneme up`` for the module: a
module that needs settings, seeded data or checks of its own defines its own ``server``."""

from __future__ import annotations

import pytest

from tests.e2e.server import Server


@pytest.fixture(scope="module")
def server(request, tmp_path_factory):
    """A ``mneme up`` on embedded defaults, on a data dir of its own, for the module."""
    s = Server(tmp_path_factory.mktemp(request.module.__name__.rsplit(".", 1)[-1])
               / "data").start()
    yield s
    s.stop()


@pytest.fixture(scope="module")
def m(server):
    """A client of :func:`server` (120 s per call)."""
    with server.client(timeout=120) as c:
        yield c
