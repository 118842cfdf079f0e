"""ingest as its own process (``mneme serve ingest``) on a Kafka-protocol broker (tansu)
that goes away (stopped, never restarted: tansu keeps nothing): reads answer from the
replica's own catalog within the read-your-writes bound, writes answer UNAVAILABLE --
neither waits out the caller's deadline nor fails as UNKNOWN."""

from __future__ import annotations

import collections
import re

import grpc
import pytest

from mneme.client import MnemeClient
from tests.integration.cluster import Cluster

pytestmark = pytest.mark.slow


def test_ingest_with_the_broker_gone_reads_its_copy_and_refuses_writes(fresh_tansu, tmp_path):
    cluster = Cluster(tmp_path / "cluster", fresh_tansu.url)
    (tmp_path / "cluster").mkdir()
    cluster.start("ingest")
    try:
        with MnemeClient(cluster.address["ingest"], timeout=60) as m:
            m.upsert_bank("away", display_name="before")
            fresh_tansu.stop()
            # the catch-up before a read is bounded (5 s), then the copy answers; it used
            # to wait for the brokers' fetch (about 80 s), past this deadline
            with MnemeClient(cluster.address["ingest"], timeout=20) as quick:
                assert quick.get_bank("away").display_name == "before"
            with pytest.raises(grpc.RpcError) as refused:
                m.upsert_bank("away", display_name="after")
            assert refused.value.code() == grpc.StatusCode.UNAVAILABLE, refused.value
            assert "did not take the records" in refused.value.details()
        # aiokafka logs every reconnect of each of the process's clients (~100 lines a
        # second with the broker away); each of its messages is logged once per 30 s,
        # then with the count of those dropped
        said = [line.split(" ", 4)[-1] for line in cluster.log("ingest").splitlines()
                if " ERROR ingest aiokafka" in line or " WARNING ingest aiokafka" in line]
        templates = collections.Counter(re.sub(r"\d+", "N", line) for line in said)
        assert templates and max(templates.values()) <= 3, templates.most_common(3)
    finally:
        cluster.stop()
