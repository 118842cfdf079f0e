"""ListOperations' ``filter`` (an AIP-160 subset: ``state``/``kind`` equalities joined by
AND) through a real ``mneme up``: the store selects the operations, so every page is full
however few match among the newest; a page token holds its filter; anything else is
INVALID_ARGUMENT naming the field; the CLI's ``operations --filter``. The server's model
is the stub, unscripted: a retain extracted by it fails (FAILED), one of an offline bank
succeeds."""

from __future__ import annotations

import json

import grpc
import pytest
from typer.testing import CliRunner

from mneme.cli import app
from mneme.client import field_violations
from mneme.v1 import operations_pb2
from tests.e2e.server import Server
from tests.llm.conftest import MODEL
from tests.llm.stub import StubLLM

BANK, OTHER = "opf", "opf-other"
FAILED, SUCCEEDED = operations_pb2.FAILED, operations_pb2.SUCCEEDED


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    with StubLLM() as stub:
        s = Server(tmp_path_factory.mktemp("opf") / "data", env={
            "MNEME_LLM_MODEL": MODEL, "MNEME_LLM_BASE_URL": stub.base_url,
            "MNEME_LLM_API_KEY": "sk-test", "MNEME_LLM_TIMEOUT_S": "10",
            "MNEME_LLM_MAX_RETRIES": "0"}).start()
        yield s
        s.stop()


@pytest.fixture(scope="module")
def m(server):
    with server.client(timeout=120) as c:
        yield c


@pytest.fixture(scope="module")
def ops(m):
    """{label: operation name}: in bank BANK two FAILED retains first (the oldest: the
    model's extraction fails), then three that succeed (offline extraction) and a document
    deletion; in OTHER one FAILED retain."""
    out = {}
    for b in (BANK, OTHER):
        m.upsert_bank(b, extraction_mode="llm_only", auto_consolidate=False)
    for i in range(2):
        op = m.retain(BANK, [{"content": f"Dana lost key {i}."}]).operation
        assert op.state == FAILED
        out[f"failed{i}"] = op.name
    op = m.retain(OTHER, [{"content": "Eli lost a key."}]).operation
    assert op.state == FAILED
    out["other"] = op.name
    m.update_bank(BANK, extraction_mode="offline")
    for i in range(3):
        op = m.retain(BANK, [{"content": f"Dana planted tree {i}.", "document_id": f"d{i}"}]
                      ).operation
        assert op.state == SUCCEEDED
        out[f"ok{i}"] = op.name
    out["delete"] = m.delete_document(BANK, "d0").name
    return out


def listed(m, filter, parent=BANK, page_size=0):
    """Every page of the listing: [[names of each page]]."""
    req = operations_pb2.ListOperationsRequest(parent=f"banks/{parent}" if parent else "",
                                               filter=filter, page_size=page_size)
    out = []
    while True:
        r = m.operations.ListOperations(req)
        out.append([o.name for o in r.operations])
        if not r.next_page_token:
            return out
        req.page_token = r.next_page_token


def test_state_and_kind_filters_select_in_the_store(m, ops):
    # the two failed retains are the oldest: a page of the newest read, then filtered,
    # would be empty; the store's query fills every page
    assert listed(m, 'state = "FAILED"', page_size=1) == [[ops["failed1"]], [ops["failed0"]]]
    assert listed(m, 'status = failed', page_size=2) == [[ops["failed1"], ops["failed0"]]]
    assert listed(m, 'kind = "retain" AND state = "SUCCEEDED"', page_size=2) == [
        [ops["ok2"], ops["ok1"]], [ops["ok0"]]]
    assert listed(m, 'type = "delete_document"') == [[ops["delete"]]]
    assert listed(m, 'kind = delete_document AND status = "SUCCEEDED"') == [[ops["delete"]]]
    assert listed(m, 'kind = delete_document AND status = "FAILED"') == [[]]
    assert listed(m, 'state = "RUNNING"') == [[]]
    assert listed(m, 'kind = "merge_entities"') == [[]]
    # every bank
    assert listed(m, 'state = "FAILED"', parent="") == [
        [ops["other"], ops["failed1"], ops["failed0"]]]
    # no filter: every operation, as before
    assert len(listed(m, "")[0]) == 6
    # the client
    assert [o.name for o in m.list_operations(BANK, page_size=1, filter='state = "FAILED"')] \
        == [ops["failed1"], ops["failed0"]]


def refused(m, **kw) -> list[str]:
    with pytest.raises(grpc.RpcError) as e:
        m.operations.ListOperations(operations_pb2.ListOperationsRequest(
            parent=f"banks/{BANK}", **kw))
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    return [f for f, _ in field_violations(e.value)]


@pytest.mark.parametrize("bad", ['state = "DONE"', 'state = "FAILED" OR state = "RUNNING"',
                                 'bank_id = "opf"', 'state != "FAILED"', 'state = FAILED and '
                                 'kind = retain', 'NOT state = "FAILED"', '(state = "FAILED")',
                                 'state = "FAILED" AND', 'state = "FAILED" AND status = "RUNNING"',
                                 'kind = "reflect"', 'state = "FAILED'])
def test_anything_else_is_invalid_argument_naming_filter(m, ops, bad):
    assert refused(m, filter=bad) == ["filter"]


def test_a_page_token_holds_its_filter(m, ops):
    def first_token(filter):
        r = m.operations.ListOperations(operations_pb2.ListOperationsRequest(
            parent=f"banks/{BANK}", filter=filter, page_size=1))
        assert r.next_page_token
        return r.next_page_token
    failed = first_token('state = "FAILED"')
    assert refused(m, filter='kind = "retain"', page_token=failed) == ["page_token"]
    assert refused(m, filter="", page_token=failed) == ["page_token"]
    assert refused(m, filter='state = "FAILED"', page_token=first_token("")) == ["page_token"]
    # the same filter written otherwise is the same filter
    r = m.operations.ListOperations(operations_pb2.ListOperationsRequest(
        parent=f"banks/{BANK}", filter="status=failed", page_token=failed, page_size=1))
    assert [o.name for o in r.operations] == [ops["failed0"]]


def test_cli_filter(server, ops):
    run = CliRunner()
    out = run.invoke(app, ["operations", "--bank", BANK, "--filter", 'state = "FAILED"',
                           "--json", "-a", server.address])
    assert out.exit_code == 0, out.output
    assert [o["name"] for o in json.loads(out.stdout)] == [ops["failed1"], ops["failed0"]]
    out = run.invoke(app, ["operations", "--filter", 'state = "DONE"', "-a", server.address])
    assert out.exit_code == 2 and "filter" in out.output
