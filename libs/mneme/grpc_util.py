"""gRPC transport helpers: map mneme errors to statuses with google.rpc details,
convert times between protobuf Timestamps and aware datetimes, and client channels with
TLS whose certificate files are re-read when they change (:class:`ClientTLS`,
:func:`secure_channel`)."""

from __future__ import annotations

import functools
import logging
import os
import threading
import time
from datetime import datetime, timezone
from pathlib import Path

import grpc
from google.protobuf import timestamp_pb2
from google.rpc import error_details_pb2, status_pb2
from grpc_status import rpc_status

from mneme.domain import clamp_time
from mneme.errors import (AlreadyExists, Cancelled, DeadlineExceeded, FailedPrecondition,
                          InvalidArgument, NotFound, RecordTooLarge, ResourceExhausted,
                          Unavailable)

log = logging.getLogger(__name__)


#: ``google.rpc.ErrorInfo.domain`` of every error mneme answers (AIP-193).
ERROR_DOMAIN = "mneme"


def abort_with(context: grpc.ServicerContext, grpc_code: grpc.StatusCode, message: str,
               reason: str, metadata: dict[str, str] | None = None, details=None):
    """Abort the call with ``grpc_code`` and a ``google.rpc.Status`` whose details hold
    ``details`` (e.g. a BadRequest; first, where clients of older servers look) and a
    ``google.rpc.ErrorInfo`` (AIP-193: every error has one) of ``reason`` (UPPER_SNAKE_CASE),
    :data:`ERROR_DOMAIN` and ``metadata``. Never returns."""
    status = status_pb2.Status(code=grpc_code.value[0], message=message)
    if details is not None:
        status.details.add().Pack(details)
    status.details.add().Pack(error_details_pb2.ErrorInfo(
        reason=reason, domain=ERROR_DOMAIN, metadata=metadata or {}))
    context.abort_with_status(rpc_status.to_status(status))


def translate_errors(method):
    """Decorator for servicer methods: InvalidArgument → INVALID_ARGUMENT with a
    BadRequest listing the field violations; NotFound → NOT_FOUND; AlreadyExists →
    ALREADY_EXISTS; FailedPrecondition →
    FAILED_PRECONDITION; DeadlineExceeded →
    DEADLINE_EXCEEDED; Cancelled → CANCELLED; Unavailable → UNAVAILABLE; RecordTooLarge
    (as a request over the size limit) and ResourceExhausted → RESOURCE_EXHAUSTED;
    anything else →
    UNKNOWN (logged by gRPC). The call's deadline is :func:`mneme.deadline.current` while
    the method runs."""

    @functools.wraps(method)
    def wrapper(self, request, context):
        from mneme import deadline
        try:
            with deadline.bind(call_deadline(context)):  # deadline.current() in the work
                return method(self, request, context)
        except (InvalidArgument, NotFound, AlreadyExists, FailedPrecondition, DeadlineExceeded,
                Cancelled, Unavailable, RecordTooLarge, ResourceExhausted) as e:
            abort_for(context, e)

    return wrapper


#: The status of each mneme error other than InvalidArgument (RecordTooLarge: a request
#: over the size limit).
_STATUS = {NotFound: grpc.StatusCode.NOT_FOUND, AlreadyExists: grpc.StatusCode.ALREADY_EXISTS,
           DeadlineExceeded: grpc.StatusCode.DEADLINE_EXCEEDED,
           FailedPrecondition: grpc.StatusCode.FAILED_PRECONDITION,
           Cancelled: grpc.StatusCode.CANCELLED, Unavailable: grpc.StatusCode.UNAVAILABLE,
           RecordTooLarge: grpc.StatusCode.RESOURCE_EXHAUSTED,
           ResourceExhausted: grpc.StatusCode.RESOURCE_EXHAUSTED}


def abort_for(context: grpc.ServicerContext, e: Exception) -> None:
    """Abort the call with the status of mneme error ``e`` (see :func:`translate_errors`);
    re-raises anything that is not a mneme request error."""
    if isinstance(e, InvalidArgument):
        br = error_details_pb2.BadRequest()
        for f, d in e.violations:
            br.field_violations.add(field=f, description=d)
        abort_with(context, grpc.StatusCode.INVALID_ARGUMENT, str(e), e.reason,
                   {"field": e.violations[0][0]}, br)
    else:
        code = next((c for cls, c in _STATUS.items() if isinstance(e, cls)), None)
        if code is None:
            raise e
        abort_with(context, code, str(e), e.reason)


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
    # what Timestamp.FromDatetime computes, without its per-call overhead (recall
    # converts three times per result): whole seconds since the epoch, nanos >= 0
    delta = clamp_time(dt) - _EPOCH
    return timestamp_pb2.Timestamp(seconds=delta.days * 86_400 + delta.seconds,
                                   nanos=delta.microseconds * 1000)


_EPOCH = datetime(1970, 1, 1, tzinfo=timezone.utc)


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


def check_first(handler, check):
    """:func:`wrap_handler` with ``check(request, context)`` called before the behaviour
    (it aborts the call to refuse the request)."""
    def wrap(behaviour, streaming):
        if streaming:
            def checked_stream(request, context):
                check(request, context)
                yield from behaviour(request, context)
            return checked_stream

        def checked(request, context):
            check(request, context)
            return behaviour(request, context)
        return checked

    return wrap_handler(handler, wrap)


class _Undecodable:
    """A request whose bytes did not parse (``error``: why)."""

    def __init__(self, error: Exception) -> None:
        self.error = error


class DecodeInterceptor(grpc.ServerInterceptor):
    """Request bytes that do not parse as the method's message (corrupt wire format,
    invalid UTF-8 in a string field, nesting past protobuf's recursion limit) are
    INVALID_ARGUMENT naming ``request``, before any other interceptor or the servicer
    sees them; grpcio's own answer would be INTERNAL ("Exception deserializing
    request!") with a traceback logged per call. Only ``mneme.v1`` methods."""

    def intercept_service(self, continuation, handler_call_details):
        handler = continuation(handler_call_details)
        if (handler is None or not handler_call_details.method.startswith("/mneme.v1.")
                or handler.request_deserializer is None):
            return handler
        parse = handler.request_deserializer
        message = handler_call_details.method.rsplit("/", 1)[-1]

        def lenient(raw: bytes):
            try:
                return parse(raw)
            except Exception as e:  # noqa: BLE001 - any parse failure is the client's input
                return _Undecodable(e)

        def refuse(request, context) -> None:
            if isinstance(request, _Undecodable):
                abort_for(context, InvalidArgument(
                    "request", f"the bytes of this {message} request do not parse as its "
                    f"message (corrupt, a string field not UTF-8, or nested too deep): "
                    f"{request.error}"))

        wrapped = check_first(handler, refuse)
        return wrapped._replace(request_deserializer=lenient) if wrapped is not handler else handler


class ValidationInterceptor(grpc.ServerInterceptor):
    """Checks every call of a ``mneme.v1`` method before the servicer runs. A call whose
    deadline has passed, or whose caller has gone, by the time a worker takes it up ends
    with DEADLINE_EXCEEDED / CANCELLED and does nothing (the client has its answer
    already; a write done anyway would be done again by its retry). Its request is
    checked against :mod:`mneme.limits`: violations → INVALID_ARGUMENT with a
    ``BadRequest`` naming each field. Requests in :data:`mneme.limits.PER_ITEM` pass
    the limits unchecked: their method runs the same check once and fails bad items
    alone. A call that fails because the server ran out of disk space or open files
    (:func:`mneme.errors.resource_shortage`) is RESOURCE_EXHAUSTED saying which, and one
    whose store server does not answer is UNAVAILABLE, not UNKNOWN. Other services (health, reflection) pass unchecked."""

    def intercept_service(self, continuation, handler_call_details):
        handler = continuation(handler_call_details)
        if handler is None or not handler_call_details.method.startswith("/mneme.v1."):
            return handler
        from mneme import limits
        method = handler_call_details.method.rsplit("/", 1)[-1]

        def refuse_invalid(request, context) -> None:
            try:
                call_deadline(context).check(method)
            except (DeadlineExceeded, Cancelled) as e:
                abort_for(context, e)
            if request.DESCRIPTOR.full_name not in limits.PER_ITEM:
                found = limits.check(request)
                if found:
                    abort_for(context, InvalidArgument(*found[0], *found[1:]))

        return wrap_handler(check_first(handler, refuse_invalid), _short_of_resources)


def _short_of_resources(behaviour, streaming):
    """``behaviour`` with a failure for want of disk space or open files answered
    RESOURCE_EXHAUSTED naming the shortage (the client may retry once room is made), and
    one of a store server that does not answer (:func:`mneme.errors.store_unavailable`)
    UNAVAILABLE with the store client's error; any other error passes unchanged."""
    from mneme.errors import resource_shortage, store_unavailable

    def refuse(context, e: Exception) -> None:
        what = resource_shortage(e)
        if what is None:
            down = store_unavailable(e)
            if down is not None:  # retryable; a bug's UNKNOWN would not be retried
                log.warning("a call failed: a store does not answer: %s", down)
                abort_with(context, grpc.StatusCode.UNAVAILABLE,
                           f"a store of the server does not answer ({down}); retry later",
                           "STORE_UNAVAILABLE")
            return
        log.warning("a call failed for want of %s: %s", what, e)
        abort_with(context, grpc.StatusCode.RESOURCE_EXHAUSTED,
                   f"the server is out of {what}; retry once its operator has made room "
                   "(the server's log names the store)", "SERVER_OUT_OF_RESOURCES",
                   {"resource": what.replace(" ", "_")})

    if streaming:
        def guarded_stream(request, context):
            try:
                yield from behaviour(request, context)
            except Exception as e:
                refuse(context, e)
                raise
        return guarded_stream

    def guarded(request, context):
        try:
            return behaviour(request, context)
        except Exception as e:
            refuse(context, e)
            raise
    return guarded


# ---- client TLS (SDK, CLI, reflect → search) -------------------------------------

class ClientTLS:
    """TLS for a gRPC client: ``ca`` (PEM file of the CA that signs the server's
    certificate; empty: the system's trust store), ``cert``/``key`` (PEM files of the
    client certificate and its key, for an mtls server; both or neither),
    ``server_name`` (the name expected in the server's certificate instead of the
    address's host). ``check_every_s``: seconds between checks of the files' mtimes —
    a channel made by :func:`secure_channel` is rebuilt from the new files after one
    changed. Raises ValueError for a cert without a key or the other way round."""

    def __init__(self, ca: str = "", cert: str = "", key: str = "", server_name: str = "",
                 check_every_s: float = 2.0) -> None:
        if bool(cert) != bool(key):
            raise ValueError("a client certificate needs its key and the other way round "
                             "(MNEME_CLIENT_TLS_CERT and MNEME_CLIENT_TLS_KEY)")
        self.ca, self.cert, self.key = str(ca or ""), str(cert or ""), str(key or "")
        self.server_name, self.check_every_s = server_name, check_every_s

    @classmethod
    def from_settings(cls, settings) -> "ClientTLS | None":
        """The ``client_tls_*`` fields of :class:`mneme.config.Settings`
        (``MNEME_CLIENT_TLS_CA``/``_CERT``/``_KEY``/``_SERVER_NAME``); None when none is
        set (plaintext)."""
        fields = (settings.client_tls_ca, settings.client_tls_cert, settings.client_tls_key,
                  settings.client_tls_server_name)
        return cls(*fields) if any(fields) else None

    @classmethod
    def from_env(cls) -> "ClientTLS | None":
        """:meth:`from_settings` of the process's ``MNEME_*`` environment."""
        from mneme.config import Settings
        return cls.from_settings(Settings())

    def files(self) -> tuple[str, ...]:
        """The certificate files this TLS reads (the ones that are set)."""
        return tuple(p for p in (self.ca, self.cert, self.key) if p)

    def credentials(self) -> grpc.ChannelCredentials:
        """Channel credentials from the files as they are now (OSError if one is
        missing)."""
        return grpc.ssl_channel_credentials(root_certificates=read_pem(self.ca),
                                            private_key=read_pem(self.key),
                                            certificate_chain=read_pem(self.cert))

    def options(self) -> list[tuple[str, str]]:
        """Channel options: the server name override, when set."""
        return [("grpc.ssl_target_name_override", self.server_name)] if self.server_name else []

    def __repr__(self) -> str:
        return (f"ClientTLS(ca={self.ca!r}, cert={self.cert!r}, key={self.key!r}, "
                f"server_name={self.server_name!r})")


def read_pem(path: str) -> bytes | None:
    """The bytes of the PEM file ``path``; None for an empty path (not configured).
    OSError when it cannot be read."""
    return Path(path).read_bytes() if path else None


def file_signature(paths) -> tuple:
    """What changes when a file is rewritten or replaced: (mtime ns, size, inode) of each
    path, None for one that cannot be read."""
    out = []
    for p in paths:
        try:
            st = os.stat(p)
            out.append((st.st_mtime_ns, st.st_size, st.st_ino))
        except OSError:
            out.append(None)
    return tuple(out)


def secure_channel(address: str, tls: "ClientTLS | None", options=()) -> grpc.Channel:
    """A channel to ``address``: plaintext when ``tls`` is None; else TLS with ``tls``'s
    credentials, rebuilt from the files when they change (checked at most every
    ``tls.check_every_s`` seconds, and at the next call after one ended UNAVAILABLE)."""
    options = list(options)
    if tls is None:
        return grpc.insecure_channel(address, options=options)
    if not tls.files():  # system trust store only: nothing to reload
        return grpc.secure_channel(address, tls.credentials(), options=options + tls.options())
    return _ReloadingChannel(
        lambda: grpc.secure_channel(address, tls.credentials(), options=options + tls.options()),
        tls.files(), tls.check_every_s)


class _ReloadingChannel(grpc.Channel):
    """A channel that hands every call to the current inner channel, and makes a new
    inner channel (``build()``) once the watched files changed. The replaced channel
    stays open until the next replacement or :meth:`close`, so calls in flight on it
    finish."""

    def __init__(self, build, files, check_every_s: float) -> None:
        self._build, self._files, self._every = build, tuple(files), check_every_s
        self._lock = threading.Lock()
        self._sig = file_signature(self._files)
        self._channel = build()
        self._retired: grpc.Channel | None = None
        self._checked = time.monotonic()

    def current(self) -> grpc.Channel:
        """The inner channel, rebuilt first when the files changed since it was made."""
        now = time.monotonic()
        if now - self._checked < self._every:
            return self._channel
        with self._lock:
            self._checked = now
            sig = file_signature(self._files)
            if sig != self._sig and None not in sig:  # a file being replaced: next time
                try:
                    fresh = self._build()
                except OSError as e:
                    log.warning("TLS files %s unreadable, keeping the old channel: %s",
                                self._files, e)
                else:
                    if self._retired is not None:
                        self._retired.close()
                    self._retired, self._channel, self._sig = self._channel, fresh, sig
                    log.info("TLS files changed (%s): new channel", ", ".join(self._files))
            return self._channel

    def recheck(self) -> None:
        """Check the files at the next call (after an UNAVAILABLE)."""
        self._checked = float("-inf")

    def _multi(self, kind: str, method, request_serializer, response_deserializer,
               registered: bool):
        return _ReloadingCallable(self, kind, method, request_serializer,
                                  response_deserializer, registered)

    def unary_unary(self, method, request_serializer=None, response_deserializer=None,
                    _registered_method=False):
        return self._multi("unary_unary", method, request_serializer, response_deserializer,
                           _registered_method)

    def unary_stream(self, method, request_serializer=None, response_deserializer=None,
                     _registered_method=False):
        return self._multi("unary_stream", method, request_serializer, response_deserializer,
                           _registered_method)

    def stream_unary(self, method, request_serializer=None, response_deserializer=None,
                     _registered_method=False):
        return self._multi("stream_unary", method, request_serializer, response_deserializer,
                           _registered_method)

    def stream_stream(self, method, request_serializer=None, response_deserializer=None,
                      _registered_method=False):
        return self._multi("stream_stream", method, request_serializer, response_deserializer,
                           _registered_method)

    def subscribe(self, callback, try_to_connect=False):
        self.current().subscribe(callback, try_to_connect=try_to_connect)

    def unsubscribe(self, callback):
        for ch in (self._channel, self._retired):
            if ch is not None:
                try:
                    ch.unsubscribe(callback)
                except (KeyError, ValueError):
                    pass

    def close(self):
        with self._lock:
            for ch in (self._channel, self._retired):
                if ch is not None:
                    ch.close()
            self._retired = None

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()
        return False


class _ReloadingCallable:
    """A multi-callable that resolves the inner channel's own at each call (cached per
    inner channel)."""

    def __init__(self, owner: _ReloadingChannel, kind: str, method, ser, deser,
                 registered: bool) -> None:
        self.owner, self.kind, self.method = owner, kind, method
        self.ser, self.deser, self.registered = ser, deser, registered
        self._for: tuple[grpc.Channel, object] | None = None

    def _inner(self):
        ch = self.owner.current()
        cached = self._for
        if cached is None or cached[0] is not ch:
            cached = (ch, getattr(ch, self.kind)(self.method, self.ser, self.deser,
                                                 _registered_method=self.registered))
            self._for = cached
        return cached[1]

    def _watch(self, fn, *args, **kwargs):
        try:
            return fn(*args, **kwargs)
        except grpc.RpcError as e:
            if e.code() == grpc.StatusCode.UNAVAILABLE:
                self.owner.recheck()
            raise

    def __call__(self, *args, **kwargs):
        return self._watch(self._inner(), *args, **kwargs)

    def with_call(self, *args, **kwargs):
        return self._watch(self._inner().with_call, *args, **kwargs)

    def future(self, *args, **kwargs):
        return self._inner().future(*args, **kwargs)
