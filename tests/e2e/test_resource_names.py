"""Resource names through a real ``mneme up`` (AIP-122): a resource has one name, the same
in every response that returns it, and every request that takes a name accepts the names
the API returns. An observation is ``banks/{bank}/observations/{id}`` whether
ObservationService, Recall or ListMemories returns it."""

from __future__ import annotations

from datetime import datetime, timezone

import grpc
import pytest

from mneme.client import field_violations
from mneme.v1 import memory_pb2, observations_pb2, operations_pb2, recall_pb2, resources_pb2

T0 = datetime(2024, 5, 20, 12, tzinfo=timezone.utc)
OBSERVATION = resources_pb2.OBSERVATION


@pytest.fixture(scope="module")
def bank(m):
    m.upsert_bank("names")
    m.retain("names", [{"content": "Dana adopted a cat named Miso.", "timestamp": T0,
                        "tags": ["home"]}])
    op = m.memory.Consolidate(memory_pb2.ConsolidateRequest(parent="banks/names"))
    assert op.state == operations_pb2.SUCCEEDED, op
    return "names"


def test_an_observation_has_one_name_in_every_read(m, bank):
    listed = m.observations.ListObservations(
        observations_pb2.ListObservationsRequest(parent=f"banks/{bank}")).observations
    assert listed
    canonical = {o.id: o.name for o in listed}
    assert all(n == f"banks/{bank}/observations/{i}" for i, n in canonical.items())

    recalled = [r.memory for r in m.recall_stub.Recall(recall_pb2.RecallRequest(
        parent=f"banks/{bank}", query="Dana cat", types=[OBSERVATION])).results]
    in_list = m.recall_stub.ListMemories(memory_pb2.ListMemoriesRequest(
        parent=f"banks/{bank}", types=[OBSERVATION])).memories
    for mem in [*recalled, *in_list]:
        assert mem.fact_type == OBSERVATION
        assert mem.name == canonical[mem.id]
        # the name a read returned is taken back: by ObservationService and by GetMemory
        assert m.observations.GetObservation(
            observations_pb2.GetObservationRequest(name=mem.name)).id == mem.id
        assert m.recall_stub.GetMemory(memory_pb2.GetMemoryRequest(name=mem.name)) == mem
    assert recalled and in_list


def test_get_memory_keeps_each_kind_to_its_own_collection(m, bank):
    fact = next(iter(m.list_memories(bank)))
    assert fact.name == f"banks/{bank}/memories/{fact.id}"
    obs = m.observations.ListObservations(
        observations_pb2.ListObservationsRequest(parent=f"banks/{bank}")).observations[0]
    # a fact is not an observation, nor an observation an opinion: NOT_FOUND as for any
    # id the collection does not hold
    for name in (f"banks/{bank}/observations/{fact.id}", f"banks/{bank}/opinions/{obs.id}"):
        with pytest.raises(grpc.RpcError) as e:
            m.recall_stub.GetMemory(memory_pb2.GetMemoryRequest(name=name))
        assert e.value.code() == grpc.StatusCode.NOT_FOUND, (name, e.value.details())
    # the memories collection still answers for any unit (names issued before)
    assert m.recall_stub.GetMemory(memory_pb2.GetMemoryRequest(
        name=f"banks/{bank}/memories/{obs.id}")).name == obs.name
    with pytest.raises(grpc.RpcError) as e:
        m.recall_stub.GetMemory(memory_pb2.GetMemoryRequest(
            name=f"banks/{bank}/entities/{obs.id}"))
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert [f for f, _ in field_violations(e.value)] == ["name"]


def test_delete_memory_takes_the_names_recall_returns(m, bank):
    """DeleteMemory is given what Recall handed out: an observation's or opinion's name is
    refused naming ``name`` with what deletes it instead (before: "must be
    'banks/{bank_id}/memories/{memory_id}'", though Recall had just returned that name),
    and nothing is deleted."""
    obs = m.observations.ListObservations(
        observations_pb2.ListObservationsRequest(parent=f"banks/{bank}")).observations[0]
    for name, hint in ((obs.name, "ClearObservations"),
                       (f"banks/{bank}/opinions/{obs.id}", "DeleteOpinion")):
        with pytest.raises(grpc.RpcError) as e:
            m.memory.DeleteMemory(memory_pb2.DeleteMemoryRequest(name=name))
        assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT, e.value.details()
        assert [f for f, _ in field_violations(e.value)] == ["name"]
        assert hint in e.value.details()
    assert m.observations.GetObservation(
        observations_pb2.GetObservationRequest(name=obs.name)).id == obs.id
