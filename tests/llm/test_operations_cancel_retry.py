"""CancelOperation and RetryOperation end to end, on a real ``mneme up`` whose extraction
model is the stub (LLM extraction asks the model item by item, so a cancel lands between
items): a running async retain is cancelled while the stub holds its first model calls;
it ends FAILED and cancelled with the items extracted before the cancel stored and
readable; cancelling it again is refused; a retry extracts exactly the items it did not,
as a new operation naming the old one; a retain whose extraction failed for one item is
retried for that item (and its document's other items); ``mneme replay`` keeps every
state. The CLI's ``mneme operations cancel/retry --json`` speak for the same RPCs."""

from __future__ import annotations

import json
import threading
import time
from datetime import datetime, timezone

import grpc
import pytest
from typer.testing import CliRunner

from mneme.cli import app
from mneme.v1 import operations_pb2
from tests.llm.stub import chat, gate

pytestmark = pytest.mark.slow

TS = datetime(2024, 5, 1, 12, tzinfo=timezone.utc)
FAILED, SUCCEEDED = operations_pb2.FAILED, operations_pb2.SUCCEEDED
N = 12  # items; the server makes at most 4 model calls at once (MNEME_LLM_MAX_CONCURRENCY)


def facts(text: str):
    return chat({"facts": [{"text": text, "fact_type": "world", "entities": [],
                            "caused_by": []}]})


def until(check, what: str, limit_s: float = 120):
    """``check()``'s first truthy value, polled; fails after ``limit_s`` (a hang, not a
    timing assertion)."""
    end = time.monotonic() + limit_s
    while not (got := check()):
        assert time.monotonic() < end, f"{what} did not happen"
        time.sleep(0.05)
    return got


def ended(m, name: str):
    return until(lambda: (op := m.get_operation(name)).state in (SUCCEEDED, FAILED) and op,
                 f"{name} ending")


def refused(call) -> str:
    with pytest.raises(grpc.RpcError) as e:
        call()
    assert e.value.code() == grpc.StatusCode.FAILED_PRECONDITION, e.value
    return e.value.details()


def cli(server, *args) -> dict:
    r = CliRunner().invoke(app, ["operations", *args, "--json", "-a", server.address])
    assert r.exit_code == 0, r.output
    return json.loads(r.output)


def test_cancel_stops_a_running_retain_and_retry_finishes_it(stub, server):
    held = threading.Event()
    for k in range(N):  # each item's first call is held until the test lets it go
        stub.on("chat", gate(held, facts(f"Alice keeps fact number {k}.")),
                facts(f"Alice keeps fact number {k}."), match=f"ITEM-{k:02d} ")
    try:
        with server.client(timeout=60) as m:
            # the model's facts alone: the test counts one fact per extracted item
            m.upsert_bank("ops", auto_consolidate=False, extraction_mode="llm_only")
            r = m.retain("ops", [{"content": f"ITEM-{k:02d} Alice told me fact number {k}.",
                                  "timestamp": TS} for k in range(N)], async_=True)
            name = r.operation.name
            until(stub.chat_requests, "the first model call")  # extraction is running
            op = cli(server, "cancel", name)
            assert op["name"] == name and op["cancel_requested"] is True
        held.set()  # the calls in flight finish; the items not started stop
        with server.client(timeout=60) as m:
            op = ended(m, name)
            assert op.state == FAILED and op.cancelled and op.cancel_requested, op
            assert op.error.startswith("cancelled: "), op.error
            skipped = sorted(e.item_index for e in op.item_errors)
            assert all(e.error.startswith("cancelled: ") for e in op.item_errors)
            assert 0 < op.items_done < N and len(skipped) == N - op.items_done
            texts = sorted(x.text for x in m.list_memories("ops"))  # stored and readable
            assert len(texts) == op.facts == op.items_done
            assert refused(lambda: m.cancel_operation(name)).find("has ended") >= 0

            retry = m.retry_operation(name)
            assert retry.retry_of == name and retry.items_total == len(skipped)
            assert not retry.name.endswith(name.split("/")[1])  # a new operation
            done = ended(m, retry.name)
            assert done.state == SUCCEEDED and done.facts == len(skipped), done
            assert sorted(x.text for x in m.list_memories("ops")) == sorted(
                f"Alice keeps fact number {k}." for k in range(N))
            assert m.retry_operation(name).name == retry.name  # the same retry again
            assert "nothing to retry" in refused(lambda: m.retry_operation(retry.name))
            before = {o.name: (o.state, o.cancelled, o.retry_of, o.items_done, o.facts)
                      for o in m.list_operations("ops")}
    finally:
        held.set()
    server.replay()  # every state is a projection of the log
    with server.client(timeout=60) as m:
        after = {o.name: (o.state, o.cancelled, o.retry_of, o.items_done, o.facts)
                 for o in m.list_operations("ops")}
        assert after == before
        assert len(list(m.list_memories("ops"))) == N


def test_retry_reruns_the_items_whose_extraction_failed(stub, server):
    stub.on("chat", facts("Bob keeps bees."), match="ITEM-A ")
    stub.on("chat", facts("Carol paints."), facts("Carol paints."), match="ITEM-C ")
    # ITEM-B: no reply scripted yet -> the stub answers 500, retried, the item fails
    with server.client(timeout=60) as m:
        m.upsert_bank("partly", auto_consolidate=False, extraction_mode="llm_only")
        r = m.retain("partly", [
            {"content": "ITEM-A Bob keeps bees.", "timestamp": TS, "document_id": "d1"},
            {"content": "ITEM-B Dan sails.", "timestamp": TS, "document_id": "d2"},
            {"content": "ITEM-C Carol paints.", "timestamp": TS, "document_id": "d2"}])
        op = r.operation
        assert op.state == SUCCEEDED and [e.item_index for e in op.item_errors] == [1], op
        stub.on("chat", facts("Dan sails."), match="ITEM-B ")
        retry = cli(server, "retry", op.name)
        assert retry["retry_of"] == op.name and retry["items_total"] == 2  # B and its doc's C
        done = ended(m, retry["name"])
        assert done.state == SUCCEEDED and not done.item_errors and done.facts == 2
        assert sorted(x.text for x in m.list_memories("partly")) == [
            "Bob keeps bees.", "Carol paints.", "Dan sails."]
        # cancelling an ended operation is refused, by the CLI too (exit 2, the reason)
        r = CliRunner().invoke(app, ["operations", "cancel", op.name, "-a", server.address])
        assert r.exit_code != 0 and "FAILED_PRECONDITION" in r.output, r.output
