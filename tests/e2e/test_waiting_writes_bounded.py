"""Writes that wait for the catalog to project them (UpsertBank, UpdateBank, directive
and mental-model writes) hold a gRPC worker thread while they wait. They hold one of the
process's waiting-call slots (``MNEME_SYNC_CALLS``, :class:`mneme.slots.WaitSlots`)
like sync retains and entity corrections: beyond the bound a call is refused with
RESOURCE_EXHAUSTED before it writes anything, health checks and reads keep threads to
run on, and a caller that goes away frees its slot at once. (Found: they waited
unbounded -- mental-model writes 30 s, cancelled or not -- and a burst of them behind a
slow projection took every worker.)"""

from __future__ import annotations

import time

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from mneme.config import Settings
from mneme.v1 import banks_pb2, directives_pb2, mental_models_pb2, resources_pb2

BANK = "busy"


@pytest.fixture
def node(tmp_path):
    """An embedded node with 6 gRPC workers (so 2 waiting calls), its catalog writable."""
    from mneme.client import MnemeClient
    from mneme.runtime.embedded import bootstrap
    n = bootstrap(Settings(data_dir=tmp_path / "data", grpc_workers=6))
    n.start()
    port = n.serve("127.0.0.1:0")
    n.client = MnemeClient(f"127.0.0.1:{port}", timeout=120)
    n.client.upsert_bank(BANK)
    yield n
    n.client.close()
    n.close()


def _writes(m, model_id: str):
    """A call per kind of write that waits for the catalog: each ``w(i)`` sends one and
    returns its future."""
    def future(method, request):
        return method.future(request, timeout=300)

    def create_model(i):
        return future(m.mental_models.CreateMentalModel, mental_models_pb2.CreateMentalModelRequest(
            parent=f"banks/{BANK}", mental_model=mental_models_pb2.MentalModel(
                display_name=f"model {i}", source_query=f"what about {i}?")))

    def update_model(i):
        return future(m.mental_models.UpdateMentalModel, mental_models_pb2.UpdateMentalModelRequest(
            mental_model=mental_models_pb2.MentalModel(
                name=f"banks/{BANK}/mental-models/{model_id}", display_name=f"model {i}"),
            update_mask={"paths": ["display_name"]}))

    def delete_model(i):
        return future(m.mental_models.DeleteMentalModel, mental_models_pb2.DeleteMentalModelRequest(
            name=f"banks/{BANK}/mental-models/{model_id}"))

    def upsert_bank(i):
        return future(m.banks.UpsertBank, banks_pb2.UpsertBankRequest(
            bank=resources_pb2.Bank(name=f"banks/new-{i}")))

    def update_bank(i):
        return future(m.banks.UpdateBank, banks_pb2.UpdateBankRequest(
            bank=resources_pb2.Bank(name=f"banks/{BANK}", display_name=f"busy {i}"),
            update_mask={"paths": ["display_name"]}))

    def directive(i):
        return future(m.directives.CreateDirective, directives_pb2.CreateDirectiveRequest(
            parent=f"banks/{BANK}", directive=directives_pb2.Directive(text=f"rule {i}")))
    return create_model, update_model, delete_model, upsert_bank, update_bank, directive


def _code(call) -> str:
    return call.code().name if call.exception() else "OK"


def _until(what: str, done, seconds: float = 60) -> None:
    end = time.monotonic() + seconds
    while not done():
        assert time.monotonic() < end, what
        time.sleep(0.02)


def test_catalog_writes_waiting_behind_a_held_projection_leave_threads_for_other_calls(node):
    """With the catalog's projection held: two mental-model writes wait (the 2 slots of 6
    workers); UpsertBank, UpdateBank, CreateDirective and mental-model writes sent
    meanwhile are RESOURCE_EXHAUSTED at once; a health check and a GetBank are answered;
    when the waiting callers cancel, their slots are free again (well before the 30 s a
    mental-model write waits for the catalog); once the projection goes on, a write that
    got a slot succeeds."""
    m, slots = node.client, node.root.wait_slots
    made = m.mental_models.CreateMentalModel(mental_models_pb2.CreateMentalModelRequest(
        parent=f"banks/{BANK}", mental_model=mental_models_pb2.MentalModel(
            display_name="model", source_query="what about it?")), timeout=60)
    create_model, update_model, delete_model, upsert_bank, update_bank, directive = \
        _writes(m, made.id)
    ingest = next(p for p in node.parts if p.name == "ingest").routers["ingest"]
    with ingest.paused():  # the catalog projects nothing until the block ends
        waiting = [create_model(0), update_model(1)]
        _until("two writes waiting", lambda: slots.waiting == 2)
        refused = [w(i) for i, w in enumerate(
            [upsert_bank, update_bank, directive, create_model, update_model, delete_model,
             upsert_bank, directive], start=2)]
        for c in refused:
            c.exception(timeout=60)
        assert [_code(c) for c in refused] == ["RESOURCE_EXHAUSTED"] * len(refused)
        health = health_pb2_grpc.HealthStub(m.channel)
        assert health.Check(health_pb2.HealthCheckRequest(), timeout=30).status == \
            health_pb2.HealthCheckResponse.SERVING
        assert m.get_bank(BANK).name == f"banks/{BANK}"
        assert not any(c.done() for c in waiting)
        for c in waiting:  # their callers go away: their threads and slots are free again
            c.cancel()
        _until("cancelled writes still hold their slots", lambda: slots.waiting == 0, 20)
        again = upsert_bank(99)
        _until("a write after them gets a slot", lambda: slots.waiting == 1)
    assert again.result(timeout=120).name == "banks/new-99"  # projected now
    assert not [b for b in m.list_banks() if b.name == "banks/new-2"]  # refused: not written
