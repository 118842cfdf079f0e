"""A retain on a real ``mneme up`` whose extraction model never answers: once the
endpoint's circuit breaker opens (MNEME_LLM_BREAKER_FAILURES consecutive timeouts), the
remaining items fail at once with reason unavailable and the retain ends FAILED, having
sent the model a handful of requests instead of every item's attempts (before: each item
spent its timeout on every retry, ~10 minutes per item with the defaults). CheckLlm shows
the open breaker; after the cool-down a healthy model's answer closes it and
RetryOperation extracts every item."""

from __future__ import annotations

import threading
from datetime import datetime, timezone

import pytest

from mneme.v1 import operations_pb2
from tests.e2e.server import Server
from tests.llm.conftest import MODEL
from tests.llm.stub import chat, computed, gate
from tests.llm.test_operations_cancel_retry import ended, facts, until

pytestmark = pytest.mark.slow

TS = datetime(2024, 5, 1, 12, tzinfo=timezone.utc)
FAILED, SUCCEEDED = operations_pb2.FAILED, operations_pb2.SUCCEEDED
N = 40  # items
CONCURRENCY = 4  # model calls at once (MNEME_LLM_MAX_CONCURRENCY's default)
RETRIES = 1
FAILURES = 3  # MNEME_LLM_BREAKER_FAILURES


def test_a_model_that_never_answers_fails_a_retain_fast_and_retry_succeeds_once_healthy(
        stub, tmp_path):
    held, healthy = threading.Event(), threading.Event()

    def reply(r):
        if not healthy.is_set():
            return gate(held)  # held past the client's timeout
        text = r.text()
        k = next((k for k in range(N) if f"ITEM-{k:02d} " in text), None)
        return chat("OK") if k is None else facts(f"Alice keeps fact number {k}.")
    stub.on("chat", computed(reply), forever=True)
    server = Server(tmp_path / "data", env={
        "MNEME_LLM_MODEL": MODEL, "MNEME_LLM_BASE_URL": stub.base_url,
        "MNEME_LLM_API_KEY": "sk-test", "MNEME_LLM_TIMEOUT_S": "0.5",
        "MNEME_LLM_MAX_RETRIES": str(RETRIES), "MNEME_LLM_BACKOFF_S": "0.05",
        "MNEME_LLM_MAX_CONCURRENCY": str(CONCURRENCY),
        "MNEME_LLM_BREAKER_FAILURES": str(FAILURES), "MNEME_LLM_BREAKER_COOLDOWN_S": "5"}).start()

    def item_requests():
        return [r for r in stub.chat_requests() if "ITEM-" in r.raw]
    try:
        with server.client(timeout=60) as m:
            m.upsert_bank("down", auto_consolidate=False, extraction_mode="llm_only")
            r = m.retain("down", [{"content": f"ITEM-{k:02d} Alice told me fact number {k}.",
                                   "timestamp": TS} for k in range(N)], async_=True)
            op = ended(m, r.operation.name)
            assert op.state == FAILED and len(op.item_errors) == N, op
            sent = len(item_requests())
            # at most the calls under way when it opened and their retries; without the
            # breaker every item's every attempt: N * (RETRIES + 1) = 80
            assert FAILURES <= sent <= CONCURRENCY * (RETRIES + 1) + 1, sent
            # the items whose calls were never made failed at once as unavailable
            fast = [e for e in op.item_errors
                    if e.error.startswith("ItemExtractionFailed: unavailable: ")]
            assert len(fast) >= N - sent and "circuit open" in fast[-1].error, op.item_errors

            check = m.check_llm("down")  # an operator sees why
            (retain,) = [c for c in check.checks if c.operation == "retain"]
            assert not retain.ok and "circuit open" in retain.error, retain

            healthy.set()
            held.set()
            # the cool-down passes (the probe goes past the breaker and answers at once)
            until(lambda: all(c.ok for c in m.check_llm("down").checks), "the cool-down")
            retry = m.retry_operation(op.name)
            assert retry.items_total == N
            done = ended(m, retry.name)
            assert done.state == SUCCEEDED and not done.item_errors and done.facts == N, done
            assert len(list(m.list_memories("down"))) == N
    finally:
        held.set()
        server.stop()
