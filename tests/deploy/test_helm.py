"""helm/mneme: `helm lint --strict`, `helm template` and `kubernetes-validate --strict`
pass for the default and the full values (scripts/helm_check.py, `make helm-check`), the
rendered objects have the shape the services need (many replicas per service, rolled out
with none down, a PDB, an HPA when asked, anti-affinity, a data dir of each pod's own), the
values schema rejects misspelled keys and wrong types, and broken manifests fail."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from tests.integration.conftest import KAFKA_TEST_ENV, fresh_tansu, mneme_bin  # noqa: F401

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


def _pod(objs, name: str) -> dict:
    return objs[("Deployment", f"mneme-{name}")]["spec"]["template"]["spec"]


def _env(container: dict) -> dict:
    return {e["name"]: e for e in container.get("env", [])}


@pytest.fixture(scope="module")
def default():
    return _objects(hc.check_chart())


@pytest.fixture(scope="module")
def full():
    return _objects(hc.check_chart(values=[hc.FULL_VALUES]))


def test_default_values_render_the_five_services_against_external_stores(default):
    kinds = {k for k, _ in default}
    assert "StatefulSet" not in kinds          # bundled dependencies are off by default
    assert "PersistentVolumeClaim" not in kinds  # no data dir is a claim shared by pods
    assert ("Job", "mneme-topics") in default
    assert not any(k == "Job" and n.startswith("mneme-replay") for k, n in default)
    for s in SERVICES:
        dep = default[("Deployment", f"mneme-{s}")]
        c = dep["spec"]["template"]["spec"]["containers"][0]
        assert c["args"] == ["serve", s]
        for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
            assert c[probe]["grpc"]["port"] == 50051
        assert {p["name"] for p in c["ports"]} == {"grpc", "metrics"}
        # HA by default: two replicas (reflect: its HPA, min 2), rolled out with none down
        assert dep["spec"].get("replicas", 2) == 2
        assert dep["spec"]["strategy"] == {"type": "RollingUpdate",
                                           "rollingUpdate": {"maxSurge": 1, "maxUnavailable": 0}}
        pdb = default[("PodDisruptionBudget", f"mneme-{s}")]["spec"]
        assert pdb["maxUnavailable"] == 1
        assert pdb["selector"]["matchLabels"]["app.kubernetes.io/component"] == s
        assert _env(c)["MNEME_REPLICA_ID"]["valueFrom"] == {"fieldRef": {"fieldPath": "metadata.name"}}
        data = next(v for v in dep["spec"]["template"]["spec"]["volumes"] if v["name"] == "data")
        assert set(data) == {"name", "emptyDir"} and data["emptyDir"]["sizeLimit"]
        assert {"name": "data", "mountPath": "/var/lib/mneme"} in c["volumeMounts"]
    assert default[("Deployment", "mneme-ingest")]["spec"]["replicas"] == 2
    assert "replicas" not in default[("Deployment", "mneme-reflect")]["spec"]  # the HPA's
    cm = default[("ConfigMap", "mneme")]["data"]
    assert cm["MNEME_BUS_URL"] == "kafka://kafka:9092"
    assert cm["MNEME_VECTOR_URL"] == "http://qdrant:6333"
    assert cm["MNEME_GRPC_ADDRESS"] == "0.0.0.0:50051"
    assert cm["MNEME_METRICS_PORT"] == "9464"
    assert cm["MNEME_DATA_DIR"] == "/var/lib/mneme"
    secret = default[("Secret", "mneme")]["stringData"]
    assert secret["MNEME_GRAPH_URL"] == "bolt://neo4j:7687"
    assert secret["MNEME_TEXT_URL"] == "http://opensearch:9200"
    assert {n for k, n in default if k == "Service"} == {"mneme-ingest", "mneme-search", "mneme-reflect"}
    assert {n for k, n in default if k == "HorizontalPodAutoscaler"} == {"mneme-reflect"}
    reflect = _pod(default, "reflect")["containers"][0]
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
    # the replay Job is as before (no generation switch yet), minus search's old PVC
    replay = full[("Job", "mneme-replay-ci")]["spec"]["template"]["spec"]
    assert replay["containers"][0]["args"] == ["replay"]
    assert {"name": "data", "emptyDir": {}} in replay["volumes"]
    assert "PersistentVolumeClaim" not in {k for k, _ in full}
    # ingest: a generic ephemeral volume per pod (a claim of its own, deleted with the pod)
    data = next(v for v in _pod(full, "ingest")["volumes"] if v["name"] == "data")
    claim = data["ephemeral"]["volumeClaimTemplate"]["spec"]
    assert claim["storageClassName"] == "standard" and claim["resources"]["requests"]["storage"] == "2Gi"
    assert full[("PodDisruptionBudget", "mneme-search")]["spec"] == {
        "minAvailable": 2, "selector": full[("PodDisruptionBudget", "mneme-search")]["spec"]["selector"]}
    for s in ("extraction", "reflect", "consolidation"):
        assert ("HorizontalPodAutoscaler", f"mneme-{s}") in full
        assert "replicas" not in full[("Deployment", f"mneme-{s}")]["spec"]
    # required anti-affinity, merged with the values' own node affinity
    aff = _pod(full, "search")["affinity"]
    assert aff["nodeAffinity"]["requiredDuringSchedulingIgnoredDuringExecution"]
    term, = aff["podAntiAffinity"]["requiredDuringSchedulingIgnoredDuringExecution"]
    assert term["labelSelector"]["matchLabels"]["app.kubernetes.io/component"] == "search"
    topics = full[("Job", "mneme-topics")]["spec"]["template"]["spec"]
    assert "podAntiAffinity" not in topics["affinity"] and "nodeAffinity" in topics["affinity"]


def _sets(**per_service) -> list[str]:
    return [f"services.{s}.{k}={v}" for s in SERVICES for k, v in per_service.items()]


def test_three_replicas_roll_out_with_none_down_with_a_pdb_and_anti_affinity():
    objs = _objects(hc.check_chart(sets=_sets(replicas=3, **{"autoscaling.enabled": "false"})))
    assert "HorizontalPodAutoscaler" not in {k for k, _ in objs}
    for s in SERVICES:
        spec = objs[("Deployment", f"mneme-{s}")]["spec"]
        assert spec["replicas"] == 3
        assert spec["strategy"] == {"type": "RollingUpdate",
                                    "rollingUpdate": {"maxSurge": 1, "maxUnavailable": 0}}
        pdb = objs[("PodDisruptionBudget", f"mneme-{s}")]["spec"]
        assert pdb["maxUnavailable"] == 1
        assert pdb["selector"] == spec["selector"]
        pref, = spec["template"]["spec"]["affinity"]["podAntiAffinity"][
            "preferredDuringSchedulingIgnoredDuringExecution"]
        assert pref["weight"] == 100
        assert pref["podAffinityTerm"] == {"topologyKey": "kubernetes.io/hostname",
                                           "labelSelector": {"matchLabels": spec["selector"]["matchLabels"]}}


def test_autoscaling_renders_an_hpa_per_service_and_leaves_the_count_to_it():
    objs = _objects(hc.check_chart(sets=_sets(**{
        "autoscaling.enabled": "true", "autoscaling.minReplicas": 3,
        "autoscaling.maxReplicas": 6, "autoscaling.targetCPUUtilizationPercentage": 60})))
    for s in SERVICES:
        hpa = objs[("HorizontalPodAutoscaler", f"mneme-{s}")]
        assert hpa["apiVersion"] == "autoscaling/v2"
        assert hpa["spec"]["scaleTargetRef"] == {"apiVersion": "apps/v1", "kind": "Deployment",
                                                 "name": f"mneme-{s}"}
        assert (hpa["spec"]["minReplicas"], hpa["spec"]["maxReplicas"]) == (3, 6)
        assert hpa["spec"]["metrics"] == [{"type": "Resource", "resource": {
            "name": "cpu", "target": {"type": "Utilization", "averageUtilization": 60}}}]
        assert "replicas" not in objs[("Deployment", f"mneme-{s}")]["spec"]
        assert ("PodDisruptionBudget", f"mneme-{s}") in objs


def test_a_single_replica_has_no_pdb_and_anti_affinity_can_be_off():
    objs = _objects(hc.check_chart(sets=["services.search.replicas=1", "podAntiAffinity.mode=none",
                                         "services.reflect.autoscaling.minReplicas=1"]))
    assert ("PodDisruptionBudget", "mneme-search") not in objs   # it would block every drain
    assert ("PodDisruptionBudget", "mneme-reflect") not in objs  # the HPA may run one
    assert ("PodDisruptionBudget", "mneme-ingest") in objs
    assert "affinity" not in _pod(objs, "search")


def test_autoscaling_with_min_above_max_fails_the_render():
    with pytest.raises(hc.CheckFailed, match="minReplicas .* exceeds maxReplicas"):
        hc.template(sets=["services.search.autoscaling.enabled=true",
                          "services.search.autoscaling.minReplicas=5",
                          "services.search.autoscaling.maxReplicas=3"])


@pytest.mark.parametrize("sets,match", [
    (["services.ingest.replicaCount=3"], "replicaCount"),
    (["auth.mod=open"], "mod"),
    (["services.search.resources.request.cpu=1"], "request"),
    (["services.search.dataDir.sizelimit=1Gi"], "sizelimit"),
    (["services.search.persistence.enabled=true"], "persistence"),   # the old values
    (["probes.readiness.periodSecond=5"], "periodSecond"),
    (["podAntiAffinity.topologykey=zone"], "topologykey"),
    (["topicsJob.backofLimit=2"], "backofLimit"),
    (["securityContext.readOnlyRootFileSystem=false"], "readOnlyRootFileSystem"),
], ids=lambda v: v if isinstance(v, str) else v[0].split("=")[0])
def test_a_misspelled_value_fails_lint_and_template(sets, match):
    with pytest.raises(hc.CheckFailed, match=f"Additional property {match} is not allowed"):
        hc.lint(sets=sets)
    with pytest.raises(hc.CheckFailed, match=match):
        hc.template(sets=sets)


def test_a_misspelled_key_in_a_values_file_fails_lint(tmp_path):
    values = tmp_path / "values.yaml"
    values.write_text("services:\n  search:\n    replicaCount: 3\n")
    with pytest.raises(hc.CheckFailed, match="services.search: Additional property replicaCount"):
        hc.lint(values=[values])


@pytest.mark.parametrize("sets,match", [
    (["services.ingest.replicas=three"], "services.ingest.replicas"),        # a string
    (["services.ingest.replicas=-1"], "services.ingest.replicas"),           # below 0
    (["services.search.autoscaling.maxReplicas=0"], "maxReplicas"),
    (["services.search.pdb.maxUnavailable=many"], "maxUnavailable"),
    (["services.search.dataDir.type=pvc"], "dataDir.type"),
    (["podAntiAffinity.mode=sometimes"], "podAntiAffinity.mode"),
    (["podAntiAffinity.weight=101"], "podAntiAffinity.weight"),
    (["grpcPort=0"], "grpcPort"),
    (["serviceType=Ingress"], "serviceType"),
    (["services.search.enabled=maybe"], "services.search.enabled"),
], ids=lambda v: v if isinstance(v, str) else v[0])
def test_a_wrong_type_or_value_fails_lint(sets, match):
    with pytest.raises(hc.CheckFailed, match=match):
        hc.lint(sets=sets)


def _schema_at(schema: dict, root: dict, path: list[str]) -> dict:
    node = schema
    for key in path:
        while "$ref" in node:
            node = root["definitions"][node["$ref"].rsplit("/", 1)[1]]
        if key in node.get("properties", {}):
            node = node["properties"][key]
        elif isinstance(node.get("additionalProperties"), dict):
            node = node["additionalProperties"]
        else:
            raise AssertionError(f"values.schema.json has no {'.'.join(path)}")
    return node


def test_the_schema_covers_every_value_and_closes_every_object():
    schema = json.loads((hc.CHART / "values.schema.json").read_text())
    assert schema["$schema"] == "http://json-schema.org/draft-07/schema#"
    values = yaml.safe_load((hc.CHART / "values.yaml").read_text())

    def leaves(v, path):
        if isinstance(v, dict) and v:
            for k, sub in v.items():
                yield from leaves(sub, [*path, k])
        else:
            yield path
    for path in leaves(values, []):
        _schema_at(schema, schema, path)

    def closed(node, where):
        if isinstance(node, dict):
            if node.get("type") == "object" and "properties" in node:
                assert node.get("additionalProperties") is False, where
            for k, sub in node.items():
                closed(sub, f"{where}/{k}")
        elif isinstance(node, list):
            for i, sub in enumerate(node):
                closed(sub, f"{where}/{i}")
    closed(schema, "#")
    auth_mode = _schema_at(schema, schema, ["auth", "mode"])
    assert auth_mode["enum"] == ["", "open", "api_key", "mtls"]


@pytest.mark.parametrize("edit,match", [
    (("replicas: 2", 'replicas: "two"'), "replicas"),                   # wrong type
    (("requests:", "request:"), "request"),                              # unknown field
    (("kind: Deployment", "kind: Deployment\nbogusField: 1"), "bogusField"),
], ids=["bad-type", "unknown-resources-field", "unknown-top-level-field"])
def test_a_broken_manifest_fails_validation(edit, match):
    rendered = hc.template()
    broken = rendered.replace(*edit, 1)
    assert broken != rendered
    hc.validate(rendered)
    with pytest.raises(hc.CheckFailed, match=match):
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
    with pytest.raises(hc.CheckFailed, match="auth.mode"):                 # the schema's enum
        hc.template(sets=[f"auth.mode={mode}"])
    with pytest.raises(hc.CheckFailed, match="not a mode the server accepts"):  # the template's
        hc.template(sets=[f"auth.mode={mode}"], extra=["--skip-schema-validation"])


def _run_topics_job(default, broker, tmp_path) -> subprocess.CompletedProcess:
    """The topics Job's container command, run as the Job would: the rendered ConfigMap's
    variables (the broker's URL for the chart's Kafka address)."""
    job = default[("Job", "mneme-topics")]
    c, = job["spec"]["template"]["spec"]["containers"]
    env = {**os.environ, **default[("ConfigMap", "mneme")]["data"], **KAFKA_TEST_ENV,
           "MNEME_BUS_URL": broker.url, "MNEME_DATA_DIR": str(tmp_path / "d"),
           "MNEME_METRICS_PORT": "0"}
    return subprocess.run([mneme_bin(), *c["args"]], env=env, capture_output=True, text=True,
                          timeout=120)


def test_the_topics_job_creates_the_topics_with_the_charts_partitions(default, fresh_tansu, tmp_path):
    job = default[("Job", "mneme-topics")]
    assert job["spec"]["template"]["spec"]["containers"][0]["args"] == ["topics", "create"]
    assert job["metadata"]["annotations"]["helm.sh/hook"] == "post-install,post-upgrade"
    assert job["spec"]["activeDeadlineSeconds"] == 600
    out = _run_topics_job(default, fresh_tansu, tmp_path)
    assert out.returncode == 0, out.stdout + out.stderr
    partitions = default[("ConfigMap", "mneme")]["data"]["MNEME_PARTITIONS"]
    assert f"mneme.intake.v1\t{partitions} partitions" in out.stdout


def test_the_topics_job_fails_when_a_history_topic_would_lose_records(default, fresh_tansu, tmp_path):
    from tests.integration.test_topics import _make_intake_expiring
    _make_intake_expiring(fresh_tansu)
    out = _run_topics_job(default, fresh_tansu, tmp_path)
    assert out.returncode != 0, out.stdout + out.stderr   # the hook fails the release
    assert "retention.ms=604800000" in out.stdout + out.stderr
