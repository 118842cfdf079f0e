"""OpenTelemetry for mneme: one setup per process, spans, metrics and trace context in
CloudEvents headers.

:func:`setup` (called once by ``mneme up`` and ``mneme serve``)
installs the SDK's TracerProvider and MeterProvider for a service name
(``OTEL_SERVICE_NAME`` wins when set), exports both by OTLP when
``OTEL_EXPORTER_OTLP_ENDPOINT`` is set (the exporter reads the other ``OTEL_EXPORTER_OTLP_*``
variables), and serves a Prometheus scrape endpoint on ``MNEME_METRICS_PORT`` (default
9464; 0 turns it off). Without :func:`setup` every span and instrument here is the API's
no-op, but trace context still propagates (a record's ``traceparent`` is passed on).

Traces: the gRPC server interceptor (:class:`TracingInterceptor`) starts a SERVER span per
call (parent: the caller's ``traceparent`` metadata); events appended inside a span carry
that span's context in their ``traceparent`` header (:func:`mneme.bus.codec.encode` asks
:func:`current_traceparent`); the consumer starts a CONSUMER span per record with the
record's ``traceparent`` as parent (:func:`consume_span`), so the events a handler produces
continue the same trace on the next hop. search wraps its store writes, the LLM gateway
its calls and the embedder its batches in spans.

Metrics (OpenTelemetry names; Prometheus turns dots into underscores and adds units and
``_total``):

- ``rpc.server.duration`` (ms) {rpc.system, rpc.service, rpc.method, rpc.grpc.status_code}
- ``mneme.retain.duration``, ``mneme.recall.duration``, ``mneme.reflect.duration`` (s)
  {rpc.grpc.status_code} — the Retain, Recall and Reflect/StreamReflect calls;
- ``mneme.retain.documents`` {outcome: succeeded|no_facts|failed} — retained items, counted
  by extraction (offline and LLM alike);
- ``mneme.consumer.lag`` {messaging.consumer.group.name, messaging.destination.name,
  messaging.destination.partition.id} — records not yet committed (observable gauge over
  :meth:`mneme.bus.consumer.Consumer.lag` of the consumers running in this process);
- ``mneme.dlq.records`` {messaging.consumer.group.name, messaging.destination.name} —
  records dead-lettered;
- ``mneme.auth.requests`` {outcome: allowed|unauthenticated|permission_denied}.
- the LLM counters of :mod:`mneme.llm.metrics` (``mneme.llm.requests``, ``mneme.llm.tokens``
  {operation, model, direction}, ``mneme.llm.cost``, ``mneme.llm.retries``, …), observed
  from its in-process counters.
"""

from __future__ import annotations

import contextlib
import logging
import os
import threading
import time
import weakref
from typing import Iterator

from opentelemetry import metrics, trace
from opentelemetry.trace import SpanKind, Status, StatusCode
from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

log = logging.getLogger(__name__)

_PROPAGATOR = TraceContextTextMapPropagator()
_SCOPE = "mneme"
_lock = threading.Lock()
_state: dict = {}
_consumers: "weakref.WeakSet" = weakref.WeakSet()

#: The LLM counters bridged from :data:`mneme.llm.metrics.METRICS` (their in-process
#: ``mneme.retain.documents`` is left out: extraction counts every item itself).
_BRIDGED = ("mneme.llm.requests", "mneme.llm.retries", "mneme.llm.tokens", "mneme.llm.cost",
            "mneme.llm.output_errors", "mneme.llm.breaker.opened",
            "mneme.llm.breaker.rejected", "mneme.reflect.invalid_citations",
            "mneme.rerank.requests")


def tracer() -> trace.Tracer:
    return trace.get_tracer(_SCOPE)


def meter() -> metrics.Meter:
    return metrics.get_meter(_SCOPE)


# ---- setup ------------------------------------------------------------------------------


def setup(service_name: str, metrics_port: int | None = None, metrics_host: str = "",
          span_processors=()) -> dict:
    """Install the SDK providers for this process (once; later calls only add
    ``span_processors``). ``metrics_port``: Prometheus endpoint (None: ``MNEME_METRICS_PORT``
    or 9464; 0: none) on ``metrics_host`` (default all interfaces). A port already in use
    is logged, not fatal. Returns {"metrics_port": bound port or 0, "otlp": bool}."""
    from opentelemetry.sdk.metrics import MeterProvider
    from opentelemetry.sdk.resources import Resource
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import BatchSpanProcessor

    with _lock:
        if _state:
            for p in span_processors:
                _state["tracer_provider"].add_span_processor(p)
            return _state["info"]
        attrs = {} if os.environ.get("OTEL_SERVICE_NAME") else {"service.name": service_name}
        resource = Resource.create(attrs)
        tp = TracerProvider(resource=resource)
        for p in span_processors:
            tp.add_span_processor(p)
        readers = []
        otlp = bool(os.environ.get("OTEL_EXPORTER_OTLP_ENDPOINT")
                    or os.environ.get("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT"))
        if otlp:
            from opentelemetry.exporter.otlp.proto.grpc.metric_exporter import OTLPMetricExporter
            from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter
            from opentelemetry.sdk.metrics.export import PeriodicExportingMetricReader
            tp.add_span_processor(BatchSpanProcessor(OTLPSpanExporter()))
            readers.append(PeriodicExportingMetricReader(OTLPMetricExporter()))
        if metrics_port is None:
            metrics_port = int(os.environ.get("MNEME_METRICS_PORT", "9464") or 0)
        bound = 0
        if metrics_port:
            from opentelemetry.exporter.prometheus import PrometheusMetricReader
            from prometheus_client import start_http_server
            try:
                server, _ = start_http_server(metrics_port, addr=metrics_host or "0.0.0.0")
                bound = server.server_address[1]
                readers.append(PrometheusMetricReader())
            except OSError as exc:
                log.warning("metrics: cannot serve Prometheus on port %s (%s); "
                            "set MNEME_METRICS_PORT", metrics_port, exc)
        trace.set_tracer_provider(tp)
        metrics.set_meter_provider(MeterProvider(resource=resource, metric_readers=readers))
        info = {"metrics_port": bound, "otlp": otlp}
        _state.update(tracer_provider=tp, info=info)
    _cache.clear()
    _register_observables()
    if bound:
        log.info("metrics: Prometheus endpoint on port %d (/metrics)", bound)
    return info


def shutdown() -> None:
    """Flush and stop the exporters (at process exit)."""
    tp = _state.get("tracer_provider")
    if tp is not None:
        tp.shutdown()
    mp = metrics.get_meter_provider()
    if hasattr(mp, "shutdown"):
        mp.shutdown()


# ---- instruments ------------------------------------------------------------------------


class _Instruments:
    def __init__(self) -> None:
        m = meter()
        self.rpc_duration = m.create_histogram(
            "rpc.server.duration", unit="ms", description="Duration of inbound gRPC calls")
        self.op_duration = {
            name: m.create_histogram(f"mneme.{name}.duration", unit="s",
                                     description=f"Duration of {name} calls")
            for name in ("retain", "recall", "reflect")}
        self.retain_documents = m.create_counter(
            "mneme.retain.documents", description="Retained items by extraction outcome")
        self.dlq = m.create_counter("mneme.dlq.records", description="Records dead-lettered")
        self.auth = m.create_counter("mneme.auth.requests",
                                     description="gRPC calls by authentication outcome")
        self.stale_reads = m.create_counter(
            "mneme.reads.stale",
            description="Reads served from this replica's copies while they were still "
                        "behind the log after the read-your-writes wait")
        self.erased = m.create_counter(
            "mneme.erased.contents",
            description="Sealed contents read whose key was destroyed (skipped, not errors)")


_cache: dict = {}


def _instruments() -> _Instruments:
    inst = _cache.get("i")
    if inst is None:
        inst = _cache["i"] = _Instruments()
    return inst

_OP_OF_METHOD = {"Retain": "retain", "Recall": "recall", "Reflect": "reflect",
                 "StreamReflect": "reflect"}


def record_rpc(service: str, method: str, code: str, seconds: float) -> None:
    i = _instruments()
    i.rpc_duration.record(seconds * 1000.0, {
        "rpc.system": "grpc", "rpc.service": service, "rpc.method": method,
        "rpc.grpc.status_code": code})
    op = _OP_OF_METHOD.get(method)
    if op and service.startswith("mneme."):
        i.op_duration[op].record(seconds, {"rpc.grpc.status_code": code})


def count_retain_documents(succeeded: int, no_facts: int, failed: int) -> None:
    c = _instruments().retain_documents
    for outcome, n in (("succeeded", succeeded), ("no_facts", no_facts), ("failed", failed)):
        if n:
            c.add(n, {"outcome": outcome})


def count_dead_letter(group: str, topic: str) -> None:
    _instruments().dlq.add(1, {"messaging.consumer.group.name": group,
                               "messaging.destination.name": topic})


def count_erased(topic: str, n: int) -> None:
    """``n`` sealed contents of a record on ``topic`` could not be opened: their key was
    destroyed by a deletion (crypto-shredding), so they were skipped."""
    if n:
        _instruments().erased.add(n, {"messaging.destination.name": topic})


def count_stale_read(service: str) -> None:
    """A read of ``service`` (ingest, search) served from copies still behind the log."""
    _instruments().stale_reads.add(1, {"mneme.service": service})


def count_auth(outcome: str) -> None:
    _instruments().auth.add(1, {"outcome": outcome})


def track_consumer(consumer) -> None:
    """Report ``consumer``'s lag (while it runs) in ``mneme.consumer.lag``."""
    _consumers.add(consumer)


def _observe_lag(options):
    from opentelemetry.metrics import Observation
    out = []
    for c in list(_consumers):
        if not getattr(c, "running", False):
            continue
        # Read by the consumer's own thread: a scrape thread opens no log connection.
        snapshot = getattr(c, "lag_snapshot", None)
        lag = snapshot() if snapshot is not None else c.lag()
        for (topic, partition), n in lag.items():
            out.append(Observation(n, {"messaging.consumer.group.name": c.group,
                                       "messaging.destination.name": topic,
                                       "messaging.destination.partition.id": str(partition)}))
    return out


def _observe_llm(name: str):
    def callback(options):
        from opentelemetry.metrics import Observation
        from mneme.llm.metrics import METRICS
        return [Observation(v, dict(attrs)) for (n, attrs), v in METRICS.snapshot().items()
                if n == name]
    return callback


def _register_observables() -> None:
    m = meter()
    m.create_observable_gauge("mneme.consumer.lag", callbacks=[_observe_lag],
                              description="Records of a partition not yet committed by "
                                          "the consumer group")
    for name in _BRIDGED:
        m.create_observable_counter(name, callbacks=[_observe_llm(name)])


# ---- trace context ----------------------------------------------------------------------


def current_traceparent() -> str | None:
    """The W3C ``traceparent`` of the current span, or None outside a valid span."""
    carrier: dict[str, str] = {}
    _PROPAGATOR.inject(carrier)
    return carrier.get("traceparent")


def context_from(traceparent: str | None, tracestate: str | None = None):
    """An OTel context whose parent is ``traceparent`` (None: the current context)."""
    if not traceparent:
        return None
    carrier = {"traceparent": traceparent}
    if tracestate:
        carrier["tracestate"] = tracestate
    return _PROPAGATOR.extract(carrier)


def inject(headers: dict) -> dict:
    """Add the current span's ``traceparent`` (and ``tracestate``) to ``headers``."""
    _PROPAGATOR.inject(headers)
    return headers


@contextlib.contextmanager
def span(name: str, kind: SpanKind = SpanKind.INTERNAL, **attributes) -> Iterator:
    """A span as the current one; exceptions are recorded and set the status to ERROR."""
    attrs = {k.replace("__", "."): v for k, v in attributes.items() if v is not None}
    with tracer().start_as_current_span(name, kind=kind, attributes=attrs) as s:
        yield s


@contextlib.contextmanager
def consume_span(group: str, record, envelope) -> Iterator:
    """The CONSUMER span of one record, child of the record's ``traceparent``."""
    parent = context_from(getattr(envelope, "traceparent", None))
    attrs = {"messaging.system": "kafka", "messaging.operation.type": "process",
             "messaging.destination.name": record.topic,
             "messaging.consumer.group.name": group,
             "messaging.destination.partition.id": str(record.partition),
             "messaging.kafka.offset": record.offset,
             "messaging.message.id": getattr(envelope, "id", "") or "",
             "cloudevents.event_type": getattr(envelope, "type", "") or "",
             "mneme.bank_id": record.key or ""}
    with tracer().start_as_current_span(f"process {record.topic}", context=parent,
                                        kind=SpanKind.CONSUMER, attributes=attrs) as s:
        yield s


# ---- gRPC server interceptor ----------------------------------------------------------------


def _split(method: str) -> tuple[str, str]:
    parts = method.strip("/").split("/")
    return (parts[0], parts[1]) if len(parts) == 2 else (method, "")


def _code_name(context, exc: BaseException | None) -> str:
    code = None
    try:
        code = context.code()
    except Exception:
        pass
    if code is None:
        import grpc
        return "UNKNOWN" if exc is not None else grpc.StatusCode.OK.name
    return getattr(code, "name", str(code))


class TracingInterceptor:
    """gRPC server interceptor: a SERVER span per call (parent from the ``traceparent``
    metadata) and ``rpc.server.duration``. Health and reflection are measured too."""

    def __new__(cls):
        import grpc

        class _Impl(grpc.ServerInterceptor):
            def intercept_service(self, continuation, details):
                handler = continuation(details)
                if handler is None:
                    return None
                md = dict(details.invocation_metadata or ())
                service, method = _split(details.method)
                return _wrap(handler, details.method, service, method, md)

        return _Impl()


def _wrap(handler, full: str, service: str, method: str, md: dict):
    from mneme.grpc_util import wrap_handler

    def start():
        ctx = context_from(md.get("traceparent"), md.get("tracestate"))
        attrs = {"rpc.system": "grpc", "rpc.service": service, "rpc.method": method}
        return tracer().start_as_current_span(full.lstrip("/"), context=ctx,
                                              kind=SpanKind.SERVER, attributes=attrs,
                                              record_exception=False,
                                              set_status_on_exception=False)

    def finish(s, context, t0, exc):
        code = _code_name(context, exc)
        s.set_attribute("rpc.grpc.status_code", code)
        if code not in ("OK", "NOT_FOUND", "INVALID_ARGUMENT", "ALREADY_EXISTS",
                        "FAILED_PRECONDITION", "UNAUTHENTICATED", "PERMISSION_DENIED"):
            s.set_status(Status(StatusCode.ERROR, code))
        record_rpc(service, method, code, time.perf_counter() - t0)

    def wrap(inner, streaming: bool):
        def unary(request, context):
            t0, exc = time.perf_counter(), None
            with start() as s:
                try:
                    return inner(request, context)
                except BaseException as e:
                    exc = e
                    raise
                finally:
                    finish(s, context, t0, exc)

        def stream(request, context):
            t0, exc = time.perf_counter(), None
            with start() as s:
                try:
                    yield from inner(request, context)
                except BaseException as e:
                    exc = e
                    raise
                finally:
                    finish(s, context, t0, exc)

        return stream if streaming else unary

    return wrap_handler(handler, wrap)


__all__ = ["TracingInterceptor", "consume_span", "context_from", "count_auth",
           "count_dead_letter", "count_retain_documents", "current_traceparent", "inject",
           "meter", "record_rpc", "setup", "shutdown", "span", "track_consumer", "tracer"]
