"""reflect's gRPC servicer: Reflect and StreamReflect."""

from __future__ import annotations

from datetime import datetime, timezone
from typing import Callable, Iterator

from google.protobuf import json_format, struct_pb2

from mneme import apiconv, deadline
from mneme.errors import InvalidArgument, MnemeError, NotFound
from mneme.grpc_util import abort_for, call_deadline, translate_errors, ts_to_dt
from mneme.names import bank_id_of
from mneme.v1 import reflect_pb2, reflect_pb2_grpc
from services.reflect.handlers import Reflection


def response_to_api(r: Reflection) -> reflect_pb2.ReflectResponse:
    """A Reflection (offline or agent) → ReflectResponse."""
    kinds = r.kinds
    resp = reflect_pb2.ReflectResponse(
        text=r.text, based_on=r.based_on, extractive=r.extractive,
        dropped_citations=getattr(r, "dropped_citations", []),
        sources=reflect_pb2.ReflectSources(
            facts=[i for i in r.based_on if i not in kinds],
            observations=[i for i in r.based_on if kinds.get(i) == "observation"],
            mental_models=[i for i in r.based_on if kinds.get(i) == "mental_model"],
            directives=r.directives))
    structured = getattr(r, "structured", None)
    if structured is not None:
        v = struct_pb2.Value()
        json_format.ParseDict(structured, v)
        resp.structured.CopyFrom(v)
    return resp


class ReflectServicer(reflect_pb2_grpc.ReflectServiceServicer):
    """``reflect(bank_id, query, context, budget, now, response_schema, tags) -> Reflection``;
    ``stream(...)`` yields the agent's ToolEvent / TextDelta / Done events."""

    def __init__(self, reflect: Callable[..., Reflection], bank_exists: Callable[[str], bool],
                 stream: Callable[..., Iterator] | None = None):
        self.reflect, self.bank_exists, self.stream = reflect, bank_exists, stream

    def _args(self, request) -> tuple:
        bank_id = bank_id_of(request.parent)
        if not self.bank_exists(bank_id):
            raise NotFound(f"bank {bank_id!r} not found")
        if not request.query.strip():
            raise InvalidArgument("query", "must not be empty")
        if request.budget not in apiconv.BUDGET:
            raise InvalidArgument("budget", "must be LOW, MID or HIGH")
        schema = (json_format.MessageToDict(request.response_schema)
                  if request.HasField("response_schema") else None)
        if schema is not None and not schema:
            raise InvalidArgument("response_schema", "must be a non-empty JSON schema")
        now = (ts_to_dt(request.query_timestamp, "query_timestamp")
               if request.HasField("query_timestamp") else None)
        for i, t in enumerate(request.tags):
            if not t.strip():
                raise InvalidArgument(f"tags[{i}]", "must not be empty")
        return (bank_id, request.query, request.context, apiconv.BUDGET[request.budget],
                now or datetime.now(timezone.utc), schema, tuple(request.tags))

    @translate_errors
    def Reflect(self, request, context):
        with deadline.bind(call_deadline(context)):
            return response_to_api(self.reflect(*self._args(request)))

    def StreamReflect(self, request, context):
        from services.reflect.agent import Done, TextDelta, ToolEvent
        try:
            with deadline.bind(call_deadline(context)):
                args = self._args(request)
                events = (self.stream or (lambda *a: iter([Done(self.reflect(*a))])))(*args)
                for e in events:
                    if not context.is_active():
                        return
                    if isinstance(e, ToolEvent):
                        yield reflect_pb2.ReflectEvent(tool_call=reflect_pb2.ReflectToolCall(
                            name=e.name, query=str(e.arguments.get("query", "")),
                            results=e.results, forced=e.forced))
                    elif isinstance(e, TextDelta):
                        yield reflect_pb2.ReflectEvent(text_delta=e.text)
                    elif isinstance(e, Done):
                        yield reflect_pb2.ReflectEvent(done=response_to_api(e.reflection))
        except MnemeError as err:  # the same statuses as the unary call
            abort_for(context, err)


def register(server, servicer: ReflectServicer) -> list[str]:
    reflect_pb2_grpc.add_ReflectServiceServicer_to_server(servicer, server)
    return [reflect_pb2.DESCRIPTOR.services_by_name["ReflectService"].full_name]
