"""Settings that pick a default by topology, and the replica id a data dir keeps."""

from __future__ import annotations

import pytest
from pydantic import ValidationError

from mneme.config import Settings
from mneme.datadir import replica_id


def test_topics_get_enough_partitions_for_replicas_on_kafka_and_few_embedded(tmp_path):
    embedded = Settings(data_dir=tmp_path)
    kafka = Settings(data_dir=tmp_path, bus_url="kafka://kafka:9092")
    assert (embedded.topic_partitions(), kafka.topic_partitions()) == (4, 12)
    assert Settings(data_dir=tmp_path, bus_url="kafka://k:9092", partitions=6).topic_partitions() == 6
    with pytest.raises(ValidationError):
        Settings(partitions=0)


def test_a_data_dir_keeps_its_replica_id_and_a_fresh_one_gets_another(tmp_path):
    a, b = tmp_path / "a", tmp_path / "b"
    a.mkdir(), b.mkdir()
    first = replica_id(a, "search-7f9c")
    assert first.startswith("search-7f9c-") and replica_id(a, "renamed") == first
    assert replica_id(b, "search-7f9c") != first  # an empty dir rebuilds under a new group
    assert replica_id(b, "Pod_Name.With Dots!").startswith("search-7f9c-")  # kept
    odd = tmp_path / "c"
    odd.mkdir()
    rid = replica_id(odd, "Pod_Name.With Dots!")
    assert "." not in rid and rid.startswith("pod-name-with-dots-")


def test_the_groups_of_the_topology_as_the_log_names_them():
    from mneme.bootstrap import services
    from mneme.router import group_ids

    svcs = services().values()
    embedded = group_ids(svcs, distributed=False)
    assert "ingest" in embedded and "search" in embedded and "search-catalog" not in embedded
    known = ["ingest.pod-a-1234abcd", "ingest.pod-b-5678abcd", "search.pod-c-0000aaaa",
             "search-catalog.pod-c-0000aaaa", "consolidation", "unrelated.group",
             "ingest.x.y"]  # a name with a further dot is not a copy of ingest
    got = group_ids(svcs, distributed=True, known=known)
    assert {"ingest.pod-a-1234abcd", "ingest.pod-b-5678abcd", "search.pod-c-0000aaaa",
            "search-catalog.pod-c-0000aaaa", "extraction", "consolidation"} <= set(got)
    assert "ingest" not in got and "ingest.x.y" not in got and "unrelated.group" not in got
    # search with store servers: its replicas share the "search" group
    shared = group_ids(svcs, distributed=True, known=["search", "search-catalog.p-1"])
    assert "search" in shared and "search-catalog.p-1" in shared


def test_a_readiness_check_that_raises_makes_the_service_not_ready_and_the_monitor_goes_on(
        tmp_path):
    """The health monitor asks every check each interval; a check that raises (a broker
    read cancelled or failing) means NOT_SERVING for now, not a dead monitor thread that
    would leave the last status forever."""
    from types import SimpleNamespace
    from mneme.runtime.process import ServiceProcess
    p = ServiceProcess("search", Settings(data_dir=tmp_path))
    calls = []

    def flaky():
        calls.append(1)
        if len(calls) == 1:
            raise TimeoutError("broker away")
        return True
    p.root = SimpleNamespace(log=SimpleNamespace(ping=lambda: True))
    p.parts = SimpleNamespace(checks=[flaky])
    assert p._healthy() is False
    assert p._healthy() is True and len(calls) == 2
