"""One retain's trace, in one process (embedded topology, the real gRPC server and
client): the gRPC SERVER span, the consumer spans of extraction and search across the
log hops (trace context in the records' ``traceparent``), the extraction, embedding and
store-write spans, all with one trace id."""

from __future__ import annotations

from datetime import datetime, timezone

import pytest
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.trace import SpanKind

from mneme import telemetry
from mneme.runtime.embedded import bootstrap
from mneme.bus import INTAKE, MEMORY, PROGRESS
from mneme.client import MnemeClient
from mneme.config import Settings
from tests.waits import hop_spans

EXPORTER = InMemorySpanExporter()


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    telemetry.setup("mneme-test", metrics_port=0, span_processors=[SimpleSpanProcessor(EXPORTER)])
    node = bootstrap(Settings(data_dir=tmp_path_factory.mktemp("trace")))
    node.start()
    port = node.serve("127.0.0.1:0")
    yield f"127.0.0.1:{port}"
    node.close()


def _hex(i: int) -> str:
    return format(i, "032x")


def test_retain_trace_crosses_every_hop(server):
    with MnemeClient(server, timeout=120) as m:
        m.upsert_bank("traced")
        EXPORTER.clear()
        r = m.retain("traced", [{"content": "Alice moved to Lisbon in May 2023.",
                                 "timestamp": datetime(2024, 3, 1, tzinfo=timezone.utc)}])
        assert r.memory_ids
    rpc = [s for s in EXPORTER.get_finished_spans() if s.name == "mneme.v1.MemoryService/Retain"]
    assert len(rpc) == 1 and rpc[0].kind == SpanKind.SERVER
    assert rpc[0].attributes["rpc.grpc.status_code"] == "OK"
    trace_id = rpc[0].context.trace_id
    hops = [("extraction", INTAKE, "RetainRequested"), ("search", MEMORY, "FactsExtracted"),
            ("ingest", PROGRESS, "OperationProgress")]
    mine, found = hop_spans(EXPORTER, trace_id, hops)
    for (group, topic, event_type), spans in zip(hops, found):
        assert spans, f"no {event_type} span of group {group} on {topic} in {_hex(trace_id)}"
    by_id = {s.context.span_id: s for s in mine}

    # (extraction's EntitiesResolved goes to search too, which has nothing to do with it)
    extraction, search, progress = (spans[0] for spans in found)
    # The chain: gRPC span → extraction (intake record) → search (memory record) → ingest.
    assert extraction.parent.span_id == rpc[0].context.span_id
    assert search.parent.span_id == extraction.context.span_id
    assert progress.parent.span_id == search.context.span_id

    def under(span, ancestor) -> bool:
        while span.parent is not None:
            if span.parent.span_id == ancestor.context.span_id:
                return True
            span = by_id.get(span.parent.span_id)
            if span is None:
                return False
        return False

    names = {s.name for s in mine}
    assert {"extraction.extract", "embedding", "store.upsert vector", "store.upsert text",
            "store.upsert graph"} <= names, names
    assert all(under(s, extraction) for s in mine if s.name in ("extraction.extract", "embedding"))
    assert all(under(s, search) for s in mine if s.name.startswith("store.upsert"))


def test_recall_has_a_server_span_and_caller_context(server):
    from opentelemetry import trace
    EXPORTER.clear()
    with trace.get_tracer("test").start_as_current_span("caller") as caller:
        with MnemeClient(server, timeout=60) as m:
            m.recall("traced", "Where does Alice live?")
    spans = EXPORTER.get_finished_spans()
    rpc = [s for s in spans if s.name == "mneme.v1.RecallService/Recall"]
    assert rpc and rpc[0].context.trace_id == caller.get_span_context().trace_id
    assert rpc[0].parent.span_id == caller.get_span_context().span_id
