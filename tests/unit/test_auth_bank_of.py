"""The bank an API key is checked against is found in every name a request may carry:
a name the servicer serves but the authorisation rule cannot parse would be served
unchecked (``bank_of`` None means "malformed: the servicer refuses it")."""

from __future__ import annotations

import pytest

from mneme.auth import RULES, bank_of
from mneme.v1 import memory_pb2

UNIT = "0b7a6b8e-4f5c-5d7e-9a1b-2c3d4e5f6a7b"


@pytest.mark.parametrize("collection", ["memories", "observations", "opinions"])
def test_get_memory_is_checked_against_the_bank_of_every_name_it_serves(collection):
    request = memory_pb2.GetMemoryRequest(name=f"banks/alice/{collection}/{UNIT}")
    _, how = RULES["/mneme.v1.RecallService/GetMemory"]
    assert bank_of(request, how) == "alice"


def test_a_name_no_servicer_takes_has_no_bank():
    request = memory_pb2.GetMemoryRequest(name=f"banks/alice/entities/{UNIT}")
    assert bank_of(request, RULES["/mneme.v1.RecallService/GetMemory"][1]) is None
