"""``mneme dlq replay`` on a Kafka-protocol broker (tansu): dead letters go back to the
topic they came from, without their ``dlq_*`` headers; one copied without its value
(too large for the DLQ with its headers) gets its value from the original record."""

from __future__ import annotations

import subprocess

from mneme.bus import DLQ, INTAKE, codec
from mneme.bus.dead_letter import VALUE_OMITTED
from mneme.bus.logs import open_event_log
from mneme.bus.topics import ensure
from mneme.events.v1 import events_pb2 as ev
from mneme.ports import OutRecord
from tests.e2e.server import inherited
from tests.integration.conftest import KAFKA_TEST_ENV, KAFKA_TEST_OPTIONS, mneme_bin


def test_dlq_replay_republishes_a_dead_letter_copied_without_its_value(fresh_tansu, tmp_path):
    log = open_event_log(fresh_tansu.url, **KAFKA_TEST_OPTIONS)
    try:
        ensure(log)  # the topics as mneme creates them (the CLI checks them)
        bank = "dlq-bank"
        rec = codec.encode(ev.MemoryDeleteRequested(bank_id=bank, memory_id="m1",
                                                    operation_id="op"),
                           bank_id=bank, source="mneme/ingest")
        [original] = log.append([OutRecord(INTAKE, bank, rec.value, rec.headers)])
        dlq_headers = {"dlq_topic": INTAKE, "dlq_partition": str(original.partition),
                       "dlq_offset": str(original.offset), "dlq_group": "extraction",
                       "dlq_attempts": "1", "dlq_error": "RecordTooLarge: ..."}
        [dead] = log.append([OutRecord(DLQ, bank, b"", {**rec.headers, **dlq_headers,
                                                         VALUE_OMITTED: str(len(rec.value))})])
        env = {**inherited(), **KAFKA_TEST_ENV, "MNEME_BUS_URL": fresh_tansu.url,
               "MNEME_DATA_DIR": str(tmp_path / "d"), "MNEME_METRICS_PORT": "0"}
        out = subprocess.run([mneme_bin(), "dlq", "replay", "--offset", str(dead.offset)],
                             env=env, capture_output=True, text=True, timeout=120)
        assert out.returncode == 0, (out.stdout + out.stderr)[-3000:]
        assert "re-published 1 records" in out.stdout, out.stdout
        again = log.read(INTAKE, original.partition, original.offset + 1, 10)
        assert [(r.value, r.headers) for r in again] == [(rec.value, rec.headers)]
    finally:
        log.close()
