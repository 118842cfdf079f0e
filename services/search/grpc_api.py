"""search's gRPC servicers: RecallService (Recall, GetMemory, ListMemories),
ObservationService (ListObservationScopes, ListObservations, GetObservation). Where
this process owns its stores it also serves GenerationService
(:mod:`mneme.runtime.generations_api`)."""

from __future__ import annotations

from datetime import datetime, timezone
from typing import Callable

from mneme import apiconv
from mneme.domain import BUDGETS, Filters, RecallOutcome, RecallQuery
from mneme.errors import InvalidArgument, NotFound
from mneme.grpc_util import call_deadline, dt_to_ts, translate_errors, ts_to_dt
from mneme.names import bank_id_of, memory_of, observation_of
from mneme.ports import VectorStore
from mneme.v1 import (memory_pb2, observations_pb2, observations_pb2_grpc, recall_pb2,
                      recall_pb2_grpc)
from services.search import observations, reads

_ARMS = ("semantic", "keyword", "graph", "temporal", "rerank")


def scores_to_api(s) -> recall_pb2.ArmScores:
    kw = {}
    for arm in _ARMS:
        kw[arm] = s.scores.get(arm, 0.0)
        kw[f"{arm}_rank"] = s.ranks.get(arm, 0)
    return recall_pb2.ArmScores(rrf=s.rrf, boost=s.boost, final=s.final, **kw)


def outcome_to_api(o: RecallOutcome) -> recall_pb2.RecallResponse:
    resp = recall_pb2.RecallResponse(total_tokens=o.total_tokens, results=[
        recall_pb2.RecallResult(memory=apiconv.memory_to_api(s.fact), scores=scores_to_api(s),
                                tokens=s.tokens) for s in o.results])
    if o.time_window:
        resp.query_time_range.CopyFrom(memory_pb2.TimeRange(
            start=dt_to_ts(o.time_window.start), end=dt_to_ts(o.time_window.end)))
    return resp


class RecallServicer(recall_pb2_grpc.RecallServiceServicer):
    """``recall`` runs a RecallQuery; ``bank_exists`` answers NOT_FOUND for unknown banks."""

    def __init__(self, recall: Callable[[RecallQuery], RecallOutcome], vectors: VectorStore,
                 bank_exists: Callable[[str], bool]):
        self.recall, self.vectors, self.bank_exists = recall, vectors, bank_exists

    def _bank(self, name: str, field: str = "parent") -> str:
        bank_id = bank_id_of(name, field)
        if not self.bank_exists(bank_id):
            raise NotFound(f"bank {bank_id!r} not found")
        return bank_id

    @translate_errors
    def Recall(self, request, context):
        bank_id = self._bank(request.parent)
        if not request.query.strip():
            raise InvalidArgument("query", "must not be empty")
        if request.max_tokens < 0:
            raise InvalidArgument("max_tokens", "must not be negative")
        if request.budget not in apiconv.BUDGET:
            raise InvalidArgument("budget", "must be LOW, MID or HIGH")
        now = ts_to_dt(request.query_timestamp, "query_timestamp") or datetime.now(timezone.utc)
        q = RecallQuery(bank_id=bank_id, query=request.query, query_timestamp=now,
                        filters=apiconv.filters_from_recall(request),
                        budget=apiconv.BUDGET[request.budget], max_tokens=request.max_tokens or 4096,
                        deadline=call_deadline(context))
        assert q.budget in BUDGETS
        return outcome_to_api(self.recall(q))

    @translate_errors
    def GetMemory(self, request, context):
        bank_id, memory_id = memory_of(request.name)
        self._bank(f"banks/{bank_id}", "name")
        return apiconv.memory_to_api(reads.get_memory(self.vectors, bank_id, memory_id))

    @translate_errors
    def ListMemories(self, request, context):
        bank_id = self._bank(request.parent)
        filters = Filters(types=apiconv.types_from_api(request.types) or observations.DEFAULT_TYPES,
                          document_id=request.document_id)
        facts, token = reads.list_memories(self.vectors, bank_id, request.page_size,
                                           request.page_token, filters)
        return memory_pb2.ListMemoriesResponse(memories=[apiconv.memory_to_api(f) for f in facts],
                                               next_page_token=token)


class ObservationServicer(observations_pb2_grpc.ObservationServiceServicer):
    """Observation reads from the vector store (see :mod:`services.search.observations`)."""

    def __init__(self, recall_servicer: RecallServicer):
        self.rs = recall_servicer

    @translate_errors
    def ListObservationScopes(self, request, context):
        bank_id = self.rs._bank(request.parent)
        scopes, token = observations.list_scopes(self.rs.vectors, bank_id, request.page_size,
                                                 request.page_token)
        return observations_pb2.ListObservationScopesResponse(
            scopes=[observations_pb2.ObservationScope(tags=t, observations=n) for t, n in scopes],
            next_page_token=token)

    @translate_errors
    def ListObservations(self, request, context):
        bank_id = self.rs._bank(request.parent)
        obs, token = observations.list_observations(
            self.rs.vectors, bank_id, request.page_size, request.page_token,
            list(request.scope) if request.has_scope or request.scope else None)
        return observations_pb2.ListObservationsResponse(
            observations=[observations.to_api(o) for o in obs], next_page_token=token)

    @translate_errors
    def GetObservation(self, request, context):
        bank_id, observation_id = observation_of(request.name)
        self.rs._bank(f"banks/{bank_id}", "name")
        return observations.to_api(observations.get_observation(self.rs.vectors, bank_id,
                                                                observation_id))


def register(server, servicer: RecallServicer) -> list[str]:
    recall_pb2_grpc.add_RecallServiceServicer_to_server(servicer, server)
    observations_pb2_grpc.add_ObservationServiceServicer_to_server(
        ObservationServicer(servicer), server)
    return [recall_pb2.DESCRIPTOR.services_by_name["RecallService"].full_name,
            observations_pb2.DESCRIPTOR.services_by_name["ObservationService"].full_name]
