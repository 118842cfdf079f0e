"""docker-compose.yml: valid for `docker compose config` and the compose-spec schema, and
shaped as the distributed topology needs; broken copies are rejected."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import yaml

from mneme.config import Settings

ROOT = Path(__file__).resolve().parents[2]
COMPOSE = ROOT / "docker-compose.yml"
SERVICES = ("ingest", "extraction", "search", "reflect", "consolidation")
INFRA = ("kafka", "qdrant", "opensearch", "neo4j")


@pytest.fixture(scope="module")
def rendered(checks):
    """The compose file as `docker compose config` resolves it (anchors, merges, defaults)."""
    import json

    return json.loads(checks._compose(COMPOSE, "config", "--format", "json"))


def test_shipped_compose_file_passes_every_check(checks):
    checks.check_compose(COMPOSE)


def _broken(tmp_path: Path, old: str, new: str) -> Path:
    text = COMPOSE.read_text(encoding="utf-8")
    assert old in text, old
    path = tmp_path / "docker-compose.yml"
    path.write_text(text.replace(old, new, 1), encoding="utf-8")
    # the copy's build context must resolve like the original's
    (tmp_path / "deploy").mkdir()
    (tmp_path / "deploy" / "Dockerfile").write_text("FROM scratch\n")
    return path


@pytest.mark.parametrize("old,new,rejected_by", [
    # a depends_on condition that does not exist: `compose config` lets it through (it
    # would fail only at `up`), the schema does not; hence both checks
    ("condition: service_healthy", "condition: service_ready", {"check_compose_schema"}),
    # a misspelt service key
    ("    command: [\"serve\", \"search\"]", "    comand: [\"serve\", \"search\"]",
     {"check_compose_config", "check_compose_schema"}),
    # a port that is not a port
    ("\"127.0.0.1:50051:50051\"", "[1, 2]",
     {"check_compose_config", "check_compose_schema"}),
], ids=["bad-condition", "unknown-key", "bad-port"])
def test_broken_compose_file_is_rejected(checks, tmp_path, old, new, rejected_by):
    path = _broken(tmp_path, old, new)
    for check in sorted(rejected_by):
        with pytest.raises(checks.CheckFailed):
            getattr(checks, check)(path)
    with pytest.raises(checks.CheckFailed):
        checks.check_compose(path)


def test_compose_config_rejects_unknown_dependency(checks, tmp_path):
    path = _broken(tmp_path, "      search:\n        condition: service_healthy",
                   "      serch:\n        condition: service_healthy")
    with pytest.raises(checks.CheckFailed, match="serch"):
        checks.check_compose_config(path)


def test_compose_config_rejects_invalid_yaml(checks, tmp_path):
    path = _broken(tmp_path, "services:\n", "services:\n  - [\n")
    with pytest.raises(checks.CheckFailed):
        checks.check_compose_config(path)


def test_every_image_is_pinned(rendered):
    for name, svc in rendered["services"].items():
        image = svc["image"]
        tag = image.rsplit(":", 1)[-1] if ":" in image.split("/")[-1] else ""
        assert tag and tag != "latest", f"{name}: image {image!r} is not pinned"
        assert re.search(r"\d", tag), f"{name}: tag {tag!r} has no version number"


def test_the_five_services_run_from_one_image(rendered):
    svcs = rendered["services"]
    assert set(SERVICES) | set(INFRA) == set(svcs)
    images = {svcs[s]["image"] for s in SERVICES}
    assert len(images) == 1
    for s in SERVICES:
        assert svcs[s]["command"] == ["serve", s]
        assert Path(svcs[s]["build"]["dockerfile"]).name == "Dockerfile"
        assert svcs[s]["build"]["dockerfile"].endswith("deploy/Dockerfile")
        env = svcs[s]["environment"]
        assert env["MNEME_BUS_URL"] == "kafka://kafka:9092"
        assert env["MNEME_GRPC_ADDRESS"] == "0.0.0.0:50051"
        assert svcs[s]["depends_on"]["kafka"]["condition"] == "service_healthy"


def test_store_urls_and_dependencies(rendered):
    svcs = rendered["services"]
    search = svcs["search"]
    assert search["environment"]["MNEME_VECTOR_URL"] == "http://qdrant:6333"
    assert search["environment"]["MNEME_TEXT_URL"] == "http://opensearch:9200"
    assert re.fullmatch(r"bolt://neo4j:[^@]+@neo4j:7687", search["environment"]["MNEME_GRAPH_URL"])
    for store in ("qdrant", "opensearch", "neo4j"):
        assert search["depends_on"][store]["condition"] == "service_healthy"
    assert svcs["reflect"]["environment"]["MNEME_SEARCH_ADDRESS"] == "search:50051"
    assert svcs["reflect"]["depends_on"]["search"]["condition"] == "service_healthy"


def test_grpc_ports_of_ingest_search_reflect(rendered):
    published = {s: {(p["published"], p["target"]) for p in rendered["services"][s].get("ports", [])}
                 for s in SERVICES}
    assert published["ingest"] == {("50051", 50051)}
    assert published["search"] == {("50052", 50051)}
    assert published["reflect"] == {("50053", 50051)}
    assert not published["extraction"] and not published["consolidation"]


def test_every_service_has_a_healthcheck_and_stores_have_volumes(rendered):
    svcs = rendered["services"]
    for name, svc in svcs.items():
        assert svc.get("healthcheck", {}).get("test"), f"{name} has no healthcheck"
    mounts = {name: {v["target"] for v in svc.get("volumes", []) if v["type"] == "volume"}
              for name, svc in svcs.items()}
    assert "/var/lib/kafka/data" in mounts["kafka"]
    assert "/qdrant/storage" in mounts["qdrant"]
    assert "/usr/share/opensearch/data" in mounts["opensearch"]
    assert "/data" in mounts["neo4j"]


def test_kafka_runs_kraft_single_node(rendered):
    env = rendered["services"]["kafka"]["environment"]
    assert rendered["services"]["kafka"]["image"].startswith("apache/kafka:")
    assert set(env["KAFKA_PROCESS_ROLES"].split(",")) == {"broker", "controller"}
    assert "PLAINTEXT://kafka:9092" in env["KAFKA_ADVERTISED_LISTENERS"]
    assert env["KAFKA_OFFSETS_TOPIC_REPLICATION_FACTOR"] == "1"


def test_opensearch_single_node_without_security_plugin(rendered):
    env = rendered["services"]["opensearch"]["environment"]
    assert env["discovery.type"] == "single-node"
    assert env["DISABLE_SECURITY_PLUGIN"] == "true"
    assert "security plugin" in COMPOSE.read_text().lower()  # documented in the file


def test_every_mneme_variable_is_a_setting(rendered):
    """The MNEME_* variables the compose file sets are ones mneme reads."""
    fields = {f"MNEME_{name.upper()}" for name in Settings.model_fields}
    used = {k for s in SERVICES for k in rendered["services"][s]["environment"]
            if k.startswith("MNEME_")}
    assert used <= fields, f"not settings of mneme.config.Settings: {sorted(used - fields)}"


def test_source_file_parses_as_yaml():
    data = yaml.safe_load(COMPOSE.read_text())
    assert "version" not in data  # obsolete in the compose spec


def test_the_stop_grace_period_covers_the_drain():
    """`docker compose stop` SIGKILLs a container stop_grace_period after SIGTERM: it must
    cover the gRPC drain (MNEME_SHUTDOWN_GRACE_S, default 10 s) and the consumers' stop
    after the records in hand (KafkaRunner.stop's timeout), else offsets go uncommitted."""
    import inspect

    from mneme.runtime.kafka import KafkaRunner
    consumers = inspect.signature(KafkaRunner.stop).parameters["timeout"].default
    compose = yaml.safe_load(COMPOSE.read_text(encoding="utf-8"))
    env = {**compose["x-mneme-env"]}
    grace = float(env.get("MNEME_SHUTDOWN_GRACE_S", Settings.model_fields["shutdown_grace_s"].default))
    for s in SERVICES:
        period = compose["services"][s]["stop_grace_period"]
        m = re.fullmatch(r"(\d+)s", period)
        assert m, period
        assert int(m.group(1)) >= grace + consumers + 5, s
