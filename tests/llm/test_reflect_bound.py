"""Reflections waiting on a slow model, many at once, against a real ``mneme up`` whose
reflect model is the local stub: they are bounded like every other call that waits
(MNEME_SYNC_CALLS), so health checks and reads keep gRPC worker threads."""

from __future__ import annotations

import threading
import time

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from mneme.v1 import reflect_pb2
from tests.e2e.server import Server
from tests.llm.conftest import MODEL
from tests.llm.stub import chat, gate


def test_reflections_held_by_a_slow_model_leave_threads_for_other_calls(stub, tmp_path):
    """With 6 gRPC workers (so 2 waiting calls) and 6 reflections whose model does not
    answer yet: 2 reach the model, 4 are RESOURCE_EXHAUSTED at once, and a health check
    and a GetBank are served meanwhile; once the model answers, the 2 succeed. Before,
    the 6 reflections took every worker, and the health check (a liveness probe) and every
    other call queued behind a model that may take minutes."""
    held = threading.Event()
    stub.on("chat", gate(held, then=chat("Ann lives in Oslo.")), forever=True)
    s = Server(tmp_path / "data", env={
        "MNEME_LLM_MODEL": MODEL, "MNEME_LLM_BASE_URL": stub.base_url,
        "MNEME_LLM_API_KEY": "sk-test", "MNEME_LLM_TIMEOUT_S": "120",
        "MNEME_LLM_MAX_RETRIES": "0", "MNEME_GRPC_WORKERS": "6"}).start()
    try:
        with s.client(timeout=120) as m:
            m.upsert_bank("slow", auto_consolidate=False, extraction_mode="offline")
            m.retain("slow", [{"content": "Ann lives in Oslo."}])
            calls = [m.reflect_stub.Reflect.future(reflect_pb2.ReflectRequest(
                parent="banks/slow", query="Where does Ann live?"), timeout=120)
                for _ in range(6)]
            # two reflections are at the model, and the others answered (or, before the
            # bound, still waiting for a worker after 20 s)
            end = time.monotonic() + 20
            while len(stub.chat_requests()) < 2 or (
                    sum(c.done() for c in calls) < 4 and time.monotonic() < end):
                time.sleep(0.05)
            health = health_pb2_grpc.HealthStub(m.channel)
            assert health.Check(health_pb2.HealthCheckRequest(), timeout=30).status == \
                health_pb2.HealthCheckResponse.SERVING
            assert m.get_bank("slow").name == "banks/slow"
            done = [c for c in calls if c.done()]
            assert [c.code() for c in done] == [grpc.StatusCode.RESOURCE_EXHAUSTED] * 4
            assert "MNEME_SYNC_CALLS" in done[0].details()
            held.set()
            answers = [c.result(timeout=120) for c in calls if c not in done]
            assert len(answers) == 2 and all("Oslo" in a.text for a in answers)
    finally:
        held.set()
        s.stop()


def test_one_banks_reflections_leave_slots_for_another_bank(stub, tmp_path):
    """With 8 gRPC workers (so 4 waiting calls), MNEME_SYNC_CALLS_PER_TENANT 2 and 6
    reflections in one bank whose model does not answer yet: 2 reach the model and 4 are
    RESOURCE_EXHAUSTED naming MNEME_SYNC_CALLS_PER_TENANT, and a reflection in another
    bank still reaches the model. Before, the first bank's burst took every slot and the
    other bank's call was refused."""
    held = threading.Event()
    stub.on("chat", gate(held, then=chat("Ann lives in Oslo.")), forever=True)
    s = Server(tmp_path / "data", env={
        "MNEME_LLM_MODEL": MODEL, "MNEME_LLM_BASE_URL": stub.base_url,
        "MNEME_LLM_API_KEY": "sk-test", "MNEME_LLM_TIMEOUT_S": "120",
        "MNEME_LLM_MAX_RETRIES": "0", "MNEME_GRPC_WORKERS": "8",
        "MNEME_SYNC_CALLS_PER_TENANT": "2"}).start()
    try:
        with s.client(timeout=120) as m:
            for bank in ("hog", "quiet"):
                m.upsert_bank(bank, auto_consolidate=False, extraction_mode="offline")
                m.retain(bank, [{"content": "Ann lives in Oslo."}])

            def reflect(bank):
                return m.reflect_stub.Reflect.future(reflect_pb2.ReflectRequest(
                    parent=f"banks/{bank}", query="Where does Ann live?"), timeout=120)
            hog = [reflect("hog") for _ in range(6)]
            end = time.monotonic() + 60
            while (len(stub.chat_requests()) < 2 or sum(c.done() for c in hog) < 4) \
                    and time.monotonic() < end:
                time.sleep(0.05)
            refused = [c for c in hog if c.done()]
            assert [c.code() for c in refused] == [grpc.StatusCode.RESOURCE_EXHAUSTED] * 4
            assert "MNEME_SYNC_CALLS_PER_TENANT" in refused[0].details()
            quiet = reflect("quiet")
            while len(stub.chat_requests()) < 3 and not quiet.done() \
                    and time.monotonic() < end:
                time.sleep(0.05)
            assert not quiet.done(), quiet.exception()  # waiting at the model, not refused
            assert len(stub.chat_requests()) == 3
            held.set()
            assert "Oslo" in quiet.result(timeout=120).text
            assert all("Oslo" in c.result(timeout=120).text for c in hog if c not in refused)
    finally:
        held.set()
        s.stop()
