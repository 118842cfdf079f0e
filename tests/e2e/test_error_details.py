"""Error details through a real ``mneme up`` (AIP-193): every error carries a
``google.rpc.ErrorInfo`` (domain ``mneme``, an UPPER_SNAKE_CASE reason); an
INVALID_ARGUMENT keeps its ``BadRequest`` first and names the field in the ErrorInfo's
metadata too, whichever layer refused it (decoding, the limits, the servicer)."""

from __future__ import annotations

import re

import grpc
import pytest
from google.rpc import error_details_pb2
from grpc_status import rpc_status

from mneme.v1 import (banks_pb2, directives_pb2, memory_pb2, operations_pb2, recall_pb2,
                      resources_pb2)
from tests.e2e.server import Server

DIRECTIVE = "11111111-1111-4111-8111-111111111111"


@pytest.fixture(scope="module")
def m(tmp_path_factory):
    s = Server(tmp_path_factory.mktemp("errors") / "data").start()
    with s.client(timeout=120) as c:
        yield c
    s.stop()


def _details(call) -> tuple[grpc.StatusCode, list]:
    with pytest.raises(grpc.RpcError) as e:
        call()
    status = rpc_status.from_call(e.value)
    assert status is not None, (e.value.code(), e.value.details())
    return e.value.code(), list(status.details)


def _error_info(details) -> error_details_pb2.ErrorInfo:
    infos = [d for d in details if d.Is(error_details_pb2.ErrorInfo.DESCRIPTOR)]
    assert len(infos) == 1, details
    info = error_details_pb2.ErrorInfo()
    infos[0].Unpack(info)
    assert info.domain == "mneme"
    assert re.fullmatch(r"[A-Z][A-Z0-9_]{0,62}", info.reason), info.reason
    return info


def test_every_kind_of_refusal_carries_an_error_info(m):
    m.upsert_bank("errs")
    create = directives_pb2.CreateDirectiveRequest(
        parent="banks/errs", directive=directives_pb2.Directive(text="Be brief."),
        directive_id=DIRECTIVE)
    m.directives.CreateDirective(create)
    done = m.retain("errs", [{"content": "Ana met Bo in Lisbon."}]).operation.name
    refusals = {
        grpc.StatusCode.NOT_FOUND: lambda: m.banks.GetBank(
            banks_pb2.GetBankRequest(name="banks/nosuch")),
        grpc.StatusCode.ALREADY_EXISTS: lambda: m.directives.CreateDirective(create),
        grpc.StatusCode.FAILED_PRECONDITION: lambda: m.operations.CancelOperation(
            operations_pb2.CancelOperationRequest(name=done)),
    }
    reasons = {}
    for want, call in refusals.items():
        code, details = _details(call)
        assert code == want
        reasons[code] = _error_info(details).reason
    assert len(set(reasons.values())) == len(reasons), reasons  # one cause, one reason


@pytest.mark.parametrize("layer,call,field", [
    ("servicer", lambda m: m.banks.GetBank(banks_pb2.GetBankRequest(name="nosuch")), "name"),
    ("limits", lambda m: m.recall_stub.Recall(recall_pb2.RecallRequest(
        parent="banks/errs", query="x", max_tokens=-1)), "max_tokens"),
    ("limits", lambda m: m.recall_stub.Recall(recall_pb2.RecallRequest(
        parent="banks/errs", query="x", types=[resources_pb2.FACT_TYPE_UNSPECIFIED])),
     "types[0]"),
    ("decoding", lambda m: m.channel.unary_unary(
        "/mneme.v1.RecallService/GetMemory", request_serializer=lambda b: b,
        response_deserializer=lambda b: b)(b"\x0a\x02\xff\xfe", timeout=30), "request"),
    ("servicer", lambda m: m.memory.DeleteDocument(memory_pb2.DeleteDocumentRequest(
        parent="banks/errs")), "document_id"),
])
def test_an_invalid_argument_names_its_field_in_bad_request_and_error_info(m, layer, call,
                                                                          field):
    code, details = _details(lambda: call(m))
    assert code == grpc.StatusCode.INVALID_ARGUMENT, layer
    bad = error_details_pb2.BadRequest()
    assert details[0].Unpack(bad), details  # first, where earlier clients read it
    assert bad.field_violations[0].field == field
    info = _error_info(details)
    assert info.metadata["field"] == field
