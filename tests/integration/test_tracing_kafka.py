"""One retain's trace across the Kafka hops: ingest, extraction and search as separate
ServiceProcesses (distributed topology, each with its own data dir) on a tansu broker,
in this process so an in-memory span exporter sees every span."""

from __future__ import annotations

import pytest
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from mneme import telemetry
from mneme.runtime.process import ServiceProcess
from mneme.bus import INTAKE, MEMORY, PROGRESS
from mneme.client import MnemeClient
from mneme.config import Settings
from tests.waits import hop_spans

EXPORTER = InMemorySpanExporter()


@pytest.fixture(scope="module")
def services(tansu, tmp_path_factory):
    telemetry.setup("mneme-test", metrics_port=0, span_processors=[SimpleSpanProcessor(EXPORTER)])
    root = tmp_path_factory.mktemp("kafka-trace")
    procs = {}
    try:
        for name in ("ingest", "extraction", "search"):
            st = Settings(data_dir=root / name, bus_url=tansu.url, grpc_address="127.0.0.1:0",
                          kafka_session_timeout_ms=2000, kafka_heartbeat_interval_ms=300,
                          kafka_enable_idempotence=False, kafka_connect_timeout_s=20.0,
                          health_interval_s=1.0, shutdown_grace_s=2.0)
            p = procs[name] = ServiceProcess(name, st)
            p.bind()
            p.start()
            assert p.ready.is_set()
        yield procs
    finally:
        for p in procs.values():
            p.stop()


def test_retain_trace_crosses_the_kafka_hops(services):
    with MnemeClient(f"127.0.0.1:{services['ingest'].port}", timeout=120) as m:
        m.upsert_bank("kafka-traced")
        EXPORTER.clear()
        r = m.retain("kafka-traced", [{"content": "Bob adopted a cat named Miso in 2022."}])
        assert r.memory_ids
    rpc = [s for s in EXPORTER.get_finished_spans() if s.name == "mneme.v1.MemoryService/Retain"]
    assert len(rpc) == 1
    hops = [("extraction", INTAKE, None), ("search", MEMORY, None), ("ingest", PROGRESS, None)]
    mine, found = hop_spans(EXPORTER, rpc[0].context.trace_id, hops)
    for (group, topic, _), spans in zip(hops, found):
        assert spans, f"no {group} span on {topic}: {sorted(s.name for s in mine)}"
    extraction, search, ingest = (spans[0] for spans in found)
    assert extraction.parent.span_id == rpc[0].context.span_id
    assert search.parent.span_id == extraction.context.span_id
    assert ingest.parent.span_id == search.context.span_id
    assert {"store.upsert vector", "store.upsert text", "store.upsert graph"} <= \
        {s.name for s in mine}
