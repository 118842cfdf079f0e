"""reflect's gRPC servicer."""

from __future__ import annotations

from datetime import datetime, timezone
from typing import Callable

from mneme import apiconv
from mneme.errors import InvalidArgument, NotFound
from mneme.grpc_util import translate_errors
from mneme.names import bank_id_of
from mneme.v1 import reflect_pb2, reflect_pb2_grpc
from services.reflect.handlers import Reflection


class ReflectServicer(reflect_pb2_grpc.ReflectServiceServicer):
    """``reflect(bank_id, query, context, budget, now) -> Reflection``."""

    def __init__(self, reflect: Callable[..., Reflection], bank_exists: Callable[[str], bool]):
        self.reflect, self.bank_exists = reflect, bank_exists

    @translate_errors
    def Reflect(self, request, context):
        bank_id = bank_id_of(request.parent)
        if not self.bank_exists(bank_id):
            raise NotFound(f"bank {bank_id!r} not found")
        if not request.query.strip():
            raise InvalidArgument("query", "must not be empty")
        if request.budget not in apiconv.BUDGET:
            raise InvalidArgument("budget", "must be LOW, MID or HIGH")
        r = self.reflect(bank_id, request.query, request.context, apiconv.BUDGET[request.budget],
                         datetime.now(timezone.utc))
        return reflect_pb2.ReflectResponse(text=r.text, based_on=r.based_on, extractive=r.extractive)


def register(server, servicer: ReflectServicer) -> list[str]:
    reflect_pb2_grpc.add_ReflectServiceServicer_to_server(servicer, server)
    return [reflect_pb2.DESCRIPTOR.services_by_name["ReflectService"].full_name]
