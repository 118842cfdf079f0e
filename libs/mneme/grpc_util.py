"""gRPC transport helpers: map mneme errors to statuses with google.rpc details, and
convert times between protobuf Timestamps and aware datetimes."""

from __future__ import annotations

import functools
import logging
from datetime import datetime, timezone

import grpc
from google.protobuf import timestamp_pb2
from google.rpc import code_pb2, error_details_pb2, status_pb2
from grpc_status import rpc_status

from mneme.domain import clamp_time
from mneme.errors import Cancelled, DeadlineExceeded, InvalidArgument, NotFound, Unavailable

log = logging.getLogger(__name__)


def _abort(context: grpc.ServicerContext, code: int, grpc_code: grpc.StatusCode,
           message: str, details=None):
    status = status_pb2.Status(code=code, message=message)
    if details is not None:
        status.details.add().Pack(details)
    context.abort_with_status(rpc_status.to_status(status))


def translate_errors(method):
    """Decorator for servicer methods: InvalidArgument → INVALID_ARGUMENT with a
    BadRequest listing the field violations; NotFound → NOT_FOUND; DeadlineExceeded →
    DEADLINE_EXCEEDED; Cancelled → CANCELLED; Unavailable → UNAVAILABLE; anything else →
    UNKNOWN (logged by gRPC). The call's deadline is :func:`mneme.deadline.current` while
    the method runs."""

    @functools.wraps(method)
    def wrapper(self, request, context):
        from mneme import deadline
        try:
            with deadline.bind(call_deadline(context)):  # deadline.current() in the work
                return method(self, request, context)
        except (InvalidArgument, NotFound, DeadlineExceeded, Cancelled, Unavailable) as e:
            abort_for(context, e)

    return wrapper


def abort_for(context: grpc.ServicerContext, e: Exception) -> None:
    """Abort the call with the status of mneme error ``e`` (see :func:`translate_errors`);
    re-raises anything that is not a mneme request error."""
    if isinstance(e, InvalidArgument):
        br = error_details_pb2.BadRequest()
        for f, d in e.violations:
            br.field_violations.add(field=f, description=d)
        _abort(context, code_pb2.INVALID_ARGUMENT, grpc.StatusCode.INVALID_ARGUMENT, str(e), br)
    elif isinstance(e, NotFound):
        _abort(context, code_pb2.NOT_FOUND, grpc.StatusCode.NOT_FOUND, str(e))
    elif isinstance(e, DeadlineExceeded):
        _abort(context, code_pb2.DEADLINE_EXCEEDED, grpc.StatusCode.DEADLINE_EXCEEDED, str(e))
    elif isinstance(e, Cancelled):
        _abort(context, code_pb2.CANCELLED, grpc.StatusCode.CANCELLED, str(e))
    elif isinstance(e, Unavailable):
        _abort(context, code_pb2.UNAVAILABLE, grpc.StatusCode.UNAVAILABLE, str(e))
    else:
        raise e


def ts_to_dt(ts: timestamp_pb2.Timestamp | None, field: str = "timestamp") -> datetime | None:
    """Protobuf Timestamp → aware UTC datetime; an unset (zero) Timestamp → None.
    Raises InvalidArgument naming ``field`` for a value outside 0001-01-01 … 9999-12-31
    or with nanos outside [0, 1e9) (see :func:`mneme.limits.timestamp_violation`)."""
    if ts is None or (ts.seconds == 0 and ts.nanos == 0):
        return None
    from mneme.limits import timestamp_violation
    problem = timestamp_violation(ts)
    if problem:
        raise InvalidArgument(field, problem)
    return ts.ToDatetime(tzinfo=timezone.utc)


def dt_to_ts(dt: datetime | None) -> timestamp_pb2.Timestamp | None:
    """Aware datetime → protobuf Timestamp (None stays None), clamped into the
    representable range so a response never fails to serialise."""
    if dt is None:
        return None
    ts = timestamp_pb2.Timestamp()
    ts.FromDatetime(clamp_time(dt))
    return ts


def call_deadline(context: grpc.ServicerContext):
    """The call's :class:`mneme.deadline.Deadline`: the client's deadline (if any) and
    cancellation (``context.is_active``)."""
    from mneme.deadline import Deadline
    left = context.time_remaining()
    # gRPC reports "no deadline" as an enormous number of seconds.
    return Deadline.after(left if left is not None and left < 1e7 else None, context.is_active)


def remaining(context: grpc.ServicerContext, default: float) -> float:
    """Seconds left before the client's deadline, capped by ``default``."""
    left = context.time_remaining()
    return default if left is None else max(0.0, min(default, left))


def wrap_handler(handler, wrap):
    """Return a copy of a unary-unary or unary-stream RPC method handler whose behaviour
    is ``wrap(behaviour, streaming)`` (a function of ``(request, context)``; a generator
    when ``streaming``). Other handler kinds (unused by mneme's APIs) pass unchanged.
    Shared by the server interceptors (tracing, auth)."""
    if handler.unary_unary is not None:
        return grpc.unary_unary_rpc_method_handler(
            wrap(handler.unary_unary, False), request_deserializer=handler.request_deserializer,
            response_serializer=handler.response_serializer)
    if handler.unary_stream is not None:
        return grpc.unary_stream_rpc_method_handler(
            wrap(handler.unary_stream, True), request_deserializer=handler.request_deserializer,
            response_serializer=handler.response_serializer)
    return handler


class ValidationInterceptor(grpc.ServerInterceptor):
    """Checks every request of a ``mneme.v1`` method against :mod:`mneme.limits` before
    the servicer runs: violations → INVALID_ARGUMENT with a ``BadRequest`` naming each
    field. Requests in :data:`mneme.limits.PER_ITEM` pass unchecked: their method runs
    the same check once and fails bad items alone. Other services (health, reflection)
    pass unchecked."""

    def intercept_service(self, continuation, handler_call_details):
        handler = continuation(handler_call_details)
        if handler is None or not handler_call_details.method.startswith("/mneme.v1."):
            return handler
        from mneme import limits

        def refuse_invalid(request, context) -> None:
            if request.DESCRIPTOR.full_name not in limits.PER_ITEM:
                found = limits.check(request)
                if found:
                    abort_for(context, InvalidArgument(*found[0], *found[1:]))

        def wrap(behaviour, streaming):
            if streaming:
                def checked_stream(request, context):
                    refuse_invalid(request, context)
                    yield from behaviour(request, context)
                return checked_stream

            def checked(request, context):
                refuse_invalid(request, context)
                return behaviour(request, context)
            return checked

        return wrap_handler(handler, wrap)
