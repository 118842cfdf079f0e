"""helm/mneme: `helm lint --strict`, `helm template` and `kubernetes-validate --strict`
pass for the default and the full values (scripts/helm_check.py, `make helm-check`), the
rendered objects have the shape the services need, and broken values or manifests fail."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[2]
SERVICES = ("ingest", "extraction", "search", "reflect", "consolidation")


def _load():
    spec = importlib.util.spec_from_file_location("helm_check", ROOT / "scripts" / "helm_check.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules["helm_check"] = module
    spec.loader.exec_module(module)
    return module


hc = _load()


def _objects(rendered: str) -> dict[tuple[str, str], dict]:
    return {(o["kind"], o["metadata"]["name"]): o for o in yaml.safe_load_all(rendered) if o}


@pytest.fixture(scope="module")
def default():
    return _objects(hc.check_chart())


@pytest.fixture(scope="module")
def full():
    return _objects(hc.check_chart(values=[hc.FULL_VALUES]))


def test_default_values_render_the_five_services_against_external_stores(default):
    kinds = {k for k, _ in default}
    assert "StatefulSet" not in kinds          # bundled dependencies are off by default
    assert ("Job", "mneme-topics") in default
    assert not any(k == "Job" and n.startswith("mneme-replay") for k, n in default)
    for s in SERVICES:
        dep = default[("Deployment", f"mneme-{s}")]
        c = dep["spec"]["template"]["spec"]["containers"][0]
        assert c["args"] == ["serve", s]
        for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
            assert c[probe]["grpc"]["port"] == 50051
        assert {p["name"] for p in c["ports"]} == {"grpc", "metrics"}
        assert ("PodDisruptionBudget", f"mneme-{s}") in default
    cm = default[("ConfigMap", "mneme")]["data"]
    assert cm["MNEME_BUS_URL"] == "kafka://kafka:9092"
    assert cm["MNEME_VECTOR_URL"] == "http://qdrant:6333"
    assert cm["MNEME_GRPC_ADDRESS"] == "0.0.0.0:50051"
    assert cm["MNEME_METRICS_PORT"] == "9464"
    secret = default[("Secret", "mneme")]["stringData"]
    assert secret["MNEME_GRAPH_URL"] == "bolt://neo4j:7687"
    assert secret["MNEME_TEXT_URL"] == "http://opensearch:9200"
    assert {n for k, n in default if k == "Service"} == {"mneme-ingest", "mneme-search", "mneme-reflect"}
    # only stateless services autoscale
    assert {n for k, n in default if k == "HorizontalPodAutoscaler"} == {"mneme-reflect"}
    reflect = default[("Deployment", "mneme-reflect")]["spec"]["template"]["spec"]["containers"][0]
    assert {"name": "MNEME_SEARCH_ADDRESS", "value": "mneme-search:50051"} in reflect["env"]


def test_full_values_enable_bundled_stores_auth_otel_and_replay(full):
    for dep in ("kafka", "qdrant", "opensearch", "neo4j"):
        assert ("StatefulSet", f"mneme-{dep}") in full
    cm = full[("ConfigMap", "mneme")]["data"]
    assert cm["MNEME_BUS_URL"] == "kafka://mneme-kafka:9092"
    assert cm["MNEME_AUTH_MODE"] == "api_key"
    assert cm["MNEME_API_KEYS_FILE"] == "/etc/mneme/auth/api-keys.json"
    assert cm["OTEL_EXPORTER_OTLP_ENDPOINT"] == "http://otel-collector:4317"
    secret = full[("Secret", "mneme")]["stringData"]
    assert secret["MNEME_GRAPH_URL"].startswith("bolt://neo4j:") and "@mneme-neo4j:7687" in secret["MNEME_GRAPH_URL"]
    assert secret["MNEME_LLM_API_KEY"] == "sk-test"
    assert "api-keys.json" in full[("Secret", "mneme-auth")]["stringData"]
    replay = full[("Job", "mneme-replay-ci")]["spec"]["template"]["spec"]
    assert replay["containers"][0]["args"] == ["replay"]
    assert {"name": "data", "persistentVolumeClaim": {"claimName": "mneme-search-data"}} in replay["volumes"]
    assert ("HorizontalPodAutoscaler", "mneme-consolidation") in full


@pytest.mark.parametrize("sets,match", [
    (["services.ingest.replicas=two"], "replicas"),                      # wrong type
    (["services.search.resources.request.cpu=1"], "request"),           # unknown field
    (["probes.readiness.periodSecond=5"], "periodSecond"),              # unknown probe field
], ids=["bad-type", "unknown-resources-field", "unknown-probe-field"])
def test_invalid_manifests_fail_validation(sets, match):
    rendered = hc.template(sets=sets)          # helm renders it …
    with pytest.raises(hc.CheckFailed, match=match):
        hc.validate(rendered)                  # … kubernetes-validate --strict rejects it


def test_broken_manifest_copy_fails_validation():
    rendered = hc.template()
    broken = rendered.replace("kind: Deployment", "kind: Deployment\nbogusField: 1", 1)
    assert broken != rendered
    with pytest.raises(hc.CheckFailed, match="bogusField"):
        hc.validate(broken)


def test_lint_rejects_a_broken_template(tmp_path):
    import shutil
    chart = tmp_path / "mneme"
    shutil.copytree(hc.CHART, chart)
    cm = chart / "templates" / "configmap.yaml"
    cm.write_text(cm.read_text().replace("{{ include \"mneme.kafkaUrl\" . | quote }}",
                                         "{{ include \"mneme.kafkaUrl\" . | quote }"))
    with pytest.raises(hc.CheckFailed):
        hc.lint(chart)


def test_autoscaling_a_stateful_service_is_refused():
    with pytest.raises(hc.CheckFailed, match="per-process state"):
        hc.template(sets=["services.search.autoscaling.enabled=true"])


def test_the_rendered_auth_settings_are_ones_the_server_accepts(full, tmp_path):
    """The chart's MNEME_AUTH_MODE and keys file, as a service reads them: the server's own
    interceptor takes the mode, and its key store reads the mounted file."""
    from mneme import auth

    cm = full[("ConfigMap", "mneme")]["data"]
    name = cm["MNEME_API_KEYS_FILE"].rsplit("/", 1)[1]
    path = tmp_path / name
    path.write_text(full[("Secret", "mneme-auth")]["stringData"][name])
    keys = auth.KeyStore(path)
    assert [e["id"] for e in keys.entries()] == ["ci"]
    guard = auth.AuthInterceptor(cm["MNEME_AUTH_MODE"], keys)
    assert guard.mode == "api_key"


@pytest.mark.parametrize("mode", ["api-key", "mTLS", "none"])
def test_an_auth_mode_the_server_does_not_accept_fails_the_render(mode):
    with pytest.raises(hc.CheckFailed, match="auth.mode"):
        hc.template(sets=[f"auth.mode={mode}"])
