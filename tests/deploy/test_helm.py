"""helm/mneme: `helm lint --strict`, `helm template` and `kubernetes-validate --strict`
pass for the default and the full values (scripts/helm_check.py, `make helm-check`), the
rendered objects have the shape the services need (many replicas per service, rolled out
with none down, a PDB, an HPA when asked, anti-affinity, a data dir of each pod's own), the
replay Job (every consolidation replica's own replay through its headless Service; local
stores: `mneme replay --each` through search's headless Service, run
against a real server; shared store servers: `mneme replay` in the Job with the search pods'
settings, storeGeneration in every service's config, the drop Job) and Kafka TLS/SASL in every pod (the topics Job over a TLS listener), the values
schema rejects misspelled keys and wrong types, and broken manifests fail."""

from __future__ import annotations

import base64
import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from tests.e2e.server import inherited
from tests.integration.conftest import KAFKA_TEST_ENV, fresh_tansu, mneme_bin  # noqa: F401
from tests.integration.test_kafka_tls import tls_kafka  # noqa: F401

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
    assert "MNEME_VECTOR_URL" not in cm          # in the Secret: it may carry an API key
    assert cm["MNEME_GRPC_ADDRESS"] == "0.0.0.0:50051"
    assert cm["MNEME_METRICS_PORT"] == "9464"
    assert cm["MNEME_DATA_DIR"] == "/var/lib/mneme"
    assert cm["MNEME_STORE_GENERATION"] == "1"
    secret = default[("Secret", "mneme")]["stringData"]
    assert secret["MNEME_GRAPH_URL"] == "bolt://neo4j:7687"
    assert secret["MNEME_TEXT_URL"] == "http://opensearch:9200"
    assert secret["MNEME_VECTOR_URL"] == "http://qdrant:6333"
    assert {n for k, n in default if k == "Service"} == {
        "mneme-ingest", "mneme-search", "mneme-reflect", "mneme-search-headless",
        "mneme-consolidation-headless"}
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
    # the replay Job: the generation switch on every search replica (its own stores)
    replay = full[("Job", "mneme-replay-ci")]["spec"]["template"]["spec"]
    assert [c["args"] for c in replay["containers"]] == [
        ["replay", "--address", "mneme-search-headless:50051", "--each", "--force"],
        ["replay", "--address", "mneme-consolidation-headless:50051", "--each", "--force"]]
    assert {"name": "data", "emptyDir": {}} in replay["volumes"]
    assert _env(_pod(full, "search")["containers"][0])["MNEME_VECTOR_URL"]["value"].startswith("edge:")
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
    (["replay.hok=post-upgrade"], "hok"),
    (["replay.activeDeadline=60"], "activeDeadline"),
    (["replay.apiKeySecret.nme=k"], "nme"),
    (["externalKafka.tls.secretname=k"], "secretname"),
    (["externalKafka.tls.caFile=ca.pem"], "caFile"),
    (["externalKafka.sasl.user=u"], "user"),
    (["externalKafka.sasl.passwordSecret.secret=p"], "secret"),
    (["replay.dropGeneraton=1"], "dropGeneraton"),
    (["externalNeo4j.db=mneme"], "db"),
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
    (["searchStores=own"], "searchStores"),
    (["replay.hook=pre-upgrade"], "replay.hook"),
    (["replay.activeDeadlineSeconds=0"], "activeDeadlineSeconds"),
    (["replay.force=yes"], "replay.force"),
    (["externalKafka.sasl.mechanism=SCRAM"], "mechanism"),
    (["externalKafka.tls.checkHostname=no"], "checkHostname"),
    (["storeGeneration=0"], "storeGeneration"),
    (["storeGeneration=two"], "storeGeneration"),
    (["storeGeneration=1.5"], "storeGeneration"),
    (["replay.dropGeneration=-1"], "dropGeneration"),
    (["externalNeo4j.database=my_db"], "database"),
    # the settings in config (and extraEnv) that the server would refuse at start
    (["config.MNEME_PARTITIONS=-3"], "MNEME_PARTITIONS"),
    (["config.MNEME_PARTITIONS=0"], "MNEME_PARTITIONS"),
    (["config.MNEME_PARTITIONS=twelve"], "MNEME_PARTITIONS"),
    (["extraEnv.MNEME_PARTITIONS=1.5"], "MNEME_PARTITIONS"),
    (["config.MNEME_KAFKA_REPLICATION_FACTOR=0"], "MNEME_KAFKA_REPLICATION_FACTOR"),
    (["config.MNEME_SHUTDOWN_GRACE_S=abc"], "MNEME_SHUTDOWN_GRACE_S"),
    (["config.MNEME_SHUTDOWN_GRACE_S=-1"], "MNEME_SHUTDOWN_GRACE_S"),
    (["config.MNEME_HEALTH_INTERVAL_S=0"], "MNEME_HEALTH_INTERVAL_S"),
    (["config.MNEME_LOG_LEVEL=debug"], "MNEME_LOG_LEVEL"),
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
    env = {**inherited(), **default[("ConfigMap", "mneme")]["data"], **KAFKA_TEST_ENV,
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


# ---- the replay Job (the generation switch), the headless Service, local search stores ----

REPLAY = ["replay.enabled=true", "searchStores=local"]


def _job_pod(objs, name: str) -> dict:
    return objs[("Job", name)]["spec"]["template"]["spec"]


def test_the_headless_service_resolves_to_every_search_pod(default):
    svc = default[("Service", "mneme-search-headless")]["spec"]
    assert svc["clusterIP"] == "None"                 # DNS lists the pods, no virtual IP
    assert not svc.get("publishNotReadyAddresses")    # only replicas that are serving
    dep = default[("Deployment", "mneme-search")]["spec"]
    assert svc["selector"] == dep["selector"]["matchLabels"]
    port, = svc["ports"]
    assert (port["name"], port["port"], port["targetPort"]) == ("grpc", 50051, "grpc")
    grpc_port, = [p for p in dep["template"]["spec"]["containers"][0]["ports"] if p["name"] == "grpc"]
    assert grpc_port["containerPort"] == 50051
    off = _objects(hc.template(sets=["services.search.enabled=false"]))
    assert ("Service", "mneme-search-headless") not in off


def test_the_replay_job_replays_each_search_replica_through_the_headless_service():
    objs = _objects(hc.check_chart(sets=REPLAY))
    job = objs[("Job", "mneme-replay-1")]
    assert "annotations" not in job["metadata"]       # a plain Job unless replay.hook
    spec = job["spec"]
    assert (spec["backoffLimit"], spec["activeDeadlineSeconds"], spec["ttlSecondsAfterFinished"]) \
        == (0, 3600, 86400)
    pod = spec["template"]["spec"]
    assert pod["restartPolicy"] == "Never"
    c, cons = pod["containers"]
    assert c["args"] == ["replay", "--address", "mneme-search-headless:50051", "--each"]
    # beside it, each consolidation replica replays its own observation projection
    assert cons["args"] == ["replay", "--address", "mneme-consolidation-headless:50051", "--each"]
    for x, service in ((c, "search"), (cons, "consolidation")):
        host, port = x["args"][2].rsplit(":", 1)
        headless = objs[("Service", host)]["spec"]
        assert headless["clusterIP"] == "None" and headless["ports"][0]["port"] == int(port)
        pods = objs[("Deployment", f"mneme-{service}")]["spec"]["selector"]["matchLabels"]
        assert headless["selector"] == pods
    assert cons["envFrom"] == c["envFrom"] and cons["resources"] == c["resources"]
    off = _objects(hc.template(sets=[*REPLAY, "services.consolidation.enabled=false"]))
    assert len(_job_pod(off, "mneme-replay-1")["containers"]) == 1
    assert ("Service", "mneme-consolidation-headless") not in off
    # the same image, settings and mounts as the services' containers
    search = _pod(objs, "search")["containers"][0]
    assert (c["image"], c["envFrom"]) == (search["image"], search["envFrom"])
    assert c["resources"] == {"requests": {"cpu": "50m", "memory": "128Mi"}, "limits": {"memory": "256Mi"}}
    assert c["securityContext"]["readOnlyRootFilesystem"] is True
    forced = _objects(hc.template(sets=[*REPLAY, "replay.force=true", "replay.runId=r2",
                                        "replay.activeDeadlineSeconds=600"]))
    job = forced[("Job", "mneme-replay-r2")]
    assert job["spec"]["template"]["spec"]["containers"][0]["args"][-2:] == ["--each", "--force"]
    assert job["spec"]["activeDeadlineSeconds"] == 600


def test_the_replay_job_as_a_hook_runs_after_the_topics_job():
    objs = _objects(hc.check_chart(sets=[*REPLAY, "replay.hook=post-upgrade"]))
    job = objs[("Job", "mneme-replay")]                # a hook replaces its previous run
    ann = job["metadata"]["annotations"]
    assert ann["helm.sh/hook"] == "post-upgrade"
    assert ann["helm.sh/hook-delete-policy"] == "before-hook-creation"
    topics = objs[("Job", "mneme-topics")]["metadata"]["annotations"]
    assert int(ann["helm.sh/hook-weight"]) > int(topics["helm.sh/hook-weight"])


def test_the_replay_job_authenticates_like_the_charts_other_clients():
    """API key from a Secret; with tls.secretName the pods' certificate as client
    certificate, trusting ca.crt and expecting the search Service's name (the name the
    certificate already has: --each dials pod IPs)."""
    objs = _objects(hc.check_chart(sets=[*REPLAY, "auth.mode=mtls", "tls.secretName=mneme-tls",
                                         "replay.apiKeySecret.name=replay-key"]))
    pod = _job_pod(objs, "mneme-replay-1")
    c, cons = pod["containers"]
    env = _env(c)
    assert {k: v for k, v in _env(cons).items() if k != "OTEL_SERVICE_NAME"} == \
        {k: v for k, v in env.items() if k != "OTEL_SERVICE_NAME"}
    assert env["MNEME_API_KEY"]["valueFrom"] == {"secretKeyRef": {"name": "replay-key", "key": "api-key"}}
    assert env["MNEME_CLIENT_TLS_SERVER_NAME"]["value"] == "mneme-search"
    assert ("Service", "mneme-search") in objs
    cm = objs[("ConfigMap", "mneme")]["data"]
    assert (cm["MNEME_CLIENT_TLS_CA"], cm["MNEME_CLIENT_TLS_CERT"], cm["MNEME_CLIENT_TLS_KEY"]) == (
        "/etc/mneme/tls/ca.crt", "/etc/mneme/tls/tls.crt", "/etc/mneme/tls/tls.key")
    assert {"name": "tls", "mountPath": "/etc/mneme/tls", "readOnly": True} in c["volumeMounts"]
    assert {"name": "tls", "secret": {"secretName": "mneme-tls"}} in pod["volumes"]
    # an explicit tls.serverName (in the ConfigMap) is every client's, the Job's too
    named = _objects(hc.template(sets=[*REPLAY, "tls.secretName=mneme-tls", "tls.serverName=mneme.internal"]))
    assert "MNEME_CLIENT_TLS_SERVER_NAME" not in _env(_job_pod(named, "mneme-replay-1")["containers"][0])
    assert named[("ConfigMap", "mneme")]["data"]["MNEME_CLIENT_TLS_SERVER_NAME"] == "mneme.internal"
    plain = _objects(hc.template(sets=REPLAY))
    assert set(_env(_job_pod(plain, "mneme-replay-1")["containers"][0])) == {"OTEL_SERVICE_NAME"}


def test_local_search_stores_are_each_replicas_own_files(tmp_path):
    """searchStores=local: search's container overrides the shared servers' URLs with
    files in its data dir, which mneme takes as stores of its own (so the replica serves
    GenerationService and a new generation gets files next to the live one); the other
    services keep the shared settings."""
    from mneme.config import Settings
    from mneme.generations import local_path, versioned_url
    from mneme.stores import is_local

    objs = _objects(hc.check_chart(sets=["searchStores=local"]))
    base = {**objs[("ConfigMap", "mneme")]["data"], **objs[("Secret", "mneme")]["stringData"]}
    for s in SERVICES:
        c = _pod(objs, s)["containers"][0]
        own = {k: e["value"] for k, e in _env(c).items() if "value" in e}
        settings = Settings(**{k[len("MNEME_"):].lower(): v for k, v in {**base, **own}.items()
                               if k in ("MNEME_VECTOR_URL", "MNEME_TEXT_URL", "MNEME_GRAPH_URL")})
        local = [is_local(settings.url(k)) for k in ("vector", "text", "graph")]
        assert local == ([True] * 3 if s == "search" else [False] * 3), s
        if s == "search":
            for k in ("vector", "text", "graph"):
                path = local_path(versioned_url(k, settings.url(k), 2))
                assert path.parent.as_posix() == "/var/lib/mneme", path   # the pod's data dir
    shared = _objects(hc.template())
    assert "MNEME_VECTOR_URL" not in _env(_pod(shared, "search")["containers"][0])


@pytest.mark.parametrize("sets,match", [
    ([*REPLAY, "services.search.enabled=false"], "services.search.enabled"),
    (["replay.enabled=true", "services.search.enabled=false", "externalNeo4j.database=mneme"],
     "services.search.enabled"),
    # shared stores: generation 2 on Neo4j is a database of its own
    (["replay.enabled=true"], "set externalNeo4j.database"),
    (["replay.enabled=true", "neo4j.enabled=true"], "bundled Neo4j"),
    (["replay.enabled=true", "externalNeo4j.database=mneme", "replay.hook=post-upgrade"],
     "replay.hook needs searchStores=local"),
    (["replay.dropGeneration=1"], "generation 1 is the live one"),
    ([*REPLAY, "replay.dropGeneration=1"], "dropGeneration needs searchStores shared"),
], ids=["no-search", "shared-no-search", "shared-neo4j-no-database", "shared-bundled-neo4j",
        "shared-hook", "drop-live", "drop-local"])
def test_a_replay_job_that_cannot_work_fails_the_render(sets, match):
    with pytest.raises(hc.CheckFailed, match=match):
        hc.template(sets=sets)


def test_the_replay_jobs_command_switches_a_running_servers_generation(tmp_path):
    """The Job's container command and settings, run against a real `mneme up` in api_key
    mode (the headless Service's name replaced by the server's address): with the key
    from replay.apiKeySecret every replica's replay goes LIVE and it exits 0; without a
    key it exits 1."""
    from mneme.auth import KeyStore
    from tests.e2e.server import Server

    objs = _objects(hc.template(sets=[*REPLAY, "auth.mode=api_key", "replay.apiKeySecret.name=k",
                                      "auth.reflectApiKeySecret.name=rk"]))
    c, _ = _job_pod(objs, "mneme-replay-1")["containers"]
    assert "MNEME_API_KEY" in _env(c)
    data = tmp_path / "d"
    data.mkdir()
    _, key = KeyStore(data / "api_keys.json").add(["*"], "write")
    server = Server(data, env={"MNEME_AUTH_MODE": "api_key"}).start()
    try:
        args = [f"127.0.0.1:{server.port}" if a == "mneme-search-headless:50051" else a
                for a in c["args"]]
        env = {**inherited(), **objs[("ConfigMap", "mneme")]["data"], "HF_HUB_OFFLINE": "1",
               "MNEME_DATA_DIR": str(tmp_path / "job"), "MNEME_METRICS_PORT": "0"}
        env.pop("MNEME_API_KEY", None)
        run = lambda e: subprocess.run([mneme_bin(), *args], env=e, capture_output=True,  # noqa: E731
                                       text=True, timeout=300)
        out = run({**env, "MNEME_API_KEY": key})
        assert out.returncode == 0, out.stdout + out.stderr
        assert "generation 2: LIVE" in out.stdout + out.stderr
        denied = run(env)
        assert denied.returncode == 1, denied.stdout + denied.stderr
        assert "UNAUTHENTICATED" in denied.stdout + denied.stderr
        from mneme.client import MnemeClient
        from mneme.v1 import generations_pb2
        with MnemeClient(server.address, api_key=key) as m:   # the server's own record
            live = [g.generation for g in m.list_generations()
                    if g.state == generations_pb2.Generation.LIVE]
        assert live == [2]
    finally:
        server.stop()


# ---- store generations on the shared servers: storeGeneration, the replay and drop Jobs ----

DB = "externalNeo4j.database=mneme"
SHARED = ["replay.enabled=true", DB]


def _settings(objs, container: dict):
    """mneme's Settings as ``container`` reads them: the rendered ConfigMap and Secret
    (envFrom) under the container's own env values."""
    from mneme.config import Settings

    env = {**objs[("ConfigMap", "mneme")]["data"], **objs[("Secret", "mneme")]["stringData"],
           **{k: e["value"] for k, e in _env(container).items() if "value" in e}}
    fields = set(Settings.model_fields)
    return Settings(**{k[len("MNEME_"):].lower(): v for k, v in env.items()
                       if k.startswith("MNEME_") and k[len("MNEME_"):].lower() in fields})


def test_store_generation_is_every_services_setting_and_rolls_their_pods():
    """storeGeneration is MNEME_STORE_GENERATION in the ConfigMap every service reads
    (ingest's bank stats name the live search group too), so a change rolls every
    Deployment (checksum/config); mneme reads it as the generation its stores and its
    search group are named after."""
    from mneme.generations import generation_group, versioned_url

    one = _objects(hc.template(sets=[DB]))
    three = _objects(hc.check_chart(sets=["storeGeneration=3", DB, "externalNeo4j.password=pw"]))
    assert three[("ConfigMap", "mneme")]["data"]["MNEME_STORE_GENERATION"] == "3"
    assert three[("Secret", "mneme")]["stringData"]["MNEME_GRAPH_URL"] == "bolt://neo4j:pw@neo4j:7687/mneme"
    for s in SERVICES:
        pod = three[("Deployment", f"mneme-{s}")]["spec"]["template"]
        c, = pod["spec"]["containers"]
        assert {"configMapRef": {"name": "mneme"}} in c["envFrom"], s
        settings = _settings(three, c)
        assert settings.store_generation == 3, s
        before = one[("Deployment", f"mneme-{s}")]["spec"]["template"]["metadata"]["annotations"]
        assert pod["metadata"]["annotations"]["checksum/config"] != before["checksum/config"], s
    search = _settings(three, _pod(three, "search")["containers"][0])
    assert generation_group("search", search.store_generation) == "search@g3"
    assert versioned_url("graph", search.url("graph"), 3) == "bolt://neo4j:pw@neo4j:7687/mneme-g3"
    assert versioned_url("vector", search.url("vector"), 3).endswith("collection=mneme_facts_g3")
    assert "MNEME_STORE_GENERATION" not in _env(_pod(three, "search")["containers"][0])
    with pytest.raises(hc.CheckFailed, match="set storeGeneration, not MNEME_STORE_GENERATION"):
        hc.template(sets=["extraEnv.MNEME_STORE_GENERATION=2"])   # services would disagree


def test_the_shared_store_replay_job_replays_in_the_job_with_the_search_pods_settings():
    """searchStores=shared: the Job runs `mneme replay` itself (no --address: the replicas
    serve on, nothing stops) with the search pods' image, ConfigMap, Secret, Kafka
    credentials and mounts, so it reaches the same store servers and brokers, and builds
    storeGeneration+1 in a data dir (emptyDir) of its own, with search's resources."""
    from mneme.generations import versioned_url

    objs = _objects(hc.check_chart(sets=[*SHARED, "storeGeneration=2", *KAFKA_SECURE,
                                         "replay.apiKeySecret.name=unused"]))
    job = objs[("Job", "mneme-replay-1")]
    assert "annotations" not in job["metadata"]
    pod = job["spec"]["template"]["spec"]
    assert pod["restartPolicy"] == "Never" and job["spec"]["backoffLimit"] == 0
    c, cons = pod["containers"]
    assert c["args"] == ["replay"]
    # consolidation's replicas replay their own projection (their state is never shared)
    assert cons["args"] == ["replay", "--address", "mneme-consolidation-headless:50051", "--each"]
    assert _env(cons)["MNEME_API_KEY"]["valueFrom"]["secretKeyRef"]["name"] == "unused"
    search_pod = _pod(objs, "search")
    search = search_pod["containers"][0]
    assert (c["image"], c["envFrom"], c["volumeMounts"]) == (
        search["image"], search["envFrom"], search["volumeMounts"])
    # the Kafka password, as the search pods get it; no client key (it calls no server)
    assert set(_env(c)) == {"OTEL_SERVICE_NAME", "MNEME_KAFKA_SASL_PASSWORD"}
    assert _env(c)["MNEME_KAFKA_SASL_PASSWORD"] == _env(search)["MNEME_KAFKA_SASL_PASSWORD"]
    assert [v for v in pod["volumes"] if v["name"] != "data"] == \
        [v for v in search_pod["volumes"] if v["name"] != "data"]
    assert {"name": "data", "emptyDir": {}} in pod["volumes"]
    job_settings, search_settings = _settings(objs, c), _settings(objs, search)
    assert job_settings.data_dir.as_posix() == "/var/lib/mneme"   # the emptyDir's mount
    assert {"name": "data", "mountPath": "/var/lib/mneme"} in c["volumeMounts"]
    for k in ("vector", "text", "graph"):
        assert job_settings.url(k) == search_settings.url(k), k
        # generation 3 (storeGeneration + 1) has names of its own on those servers
        assert versioned_url(k, job_settings.url(k), 3) != job_settings.url(k), k
    assert job_settings.store_generation == search_settings.store_generation == 2
    assert job_settings.bus_url == search_settings.bus_url
    assert c["resources"] == search["resources"]     # it does search's work
    assert c["securityContext"]["readOnlyRootFilesystem"] is True
    forced = _objects(hc.template(sets=[*SHARED, "replay.force=true", "replay.runId=r2",
                                        "replay.buildResources.requests.cpu=2"]))
    c, cons = _job_pod(forced, "mneme-replay-r2")["containers"]
    assert c["args"] == ["replay", "--force"] and cons["args"][-1] == "--force"
    assert c["resources"] == {"requests": {"cpu": 2}}


def test_the_local_store_replay_job_is_unchanged_by_store_generations():
    """searchStores=local keeps `--address <headless>:<port> --each`, the polling
    resources and the client settings, whatever the shared-store values say."""
    objs = _objects(hc.check_chart(sets=[*REPLAY, DB, "replay.buildResources.requests.cpu=2",
                                         "replay.apiKeySecret.name=replay-key"]))
    c, _ = _job_pod(objs, "mneme-replay-1")["containers"]
    assert c["args"] == ["replay", "--address", "mneme-search-headless:50051", "--each"]
    assert c["resources"] == {"requests": {"cpu": "50m", "memory": "128Mi"}, "limits": {"memory": "256Mi"}}
    assert set(_env(c)) == {"OTEL_SERVICE_NAME", "MNEME_API_KEY"}
    assert objs[("ConfigMap", "mneme")]["data"]["MNEME_STORE_GENERATION"] == "1"
    assert not any(k == "Job" and n.startswith("mneme-drop") for k, n in objs)
    with pytest.raises(hc.CheckFailed, match="searchStores=local each replica records its own"):
        hc.template(sets=[*REPLAY, "storeGeneration=2"])


def test_the_drop_job_deletes_an_old_generation_with_the_search_pods_settings():
    objs = _objects(hc.check_chart(sets=["storeGeneration=2", DB, "replay.dropGeneration=1"]))
    assert not any(k == "Job" and n.startswith("mneme-replay") for k, n in objs)
    pod = _job_pod(objs, "mneme-drop-g1")
    c, = pod["containers"]
    assert c["args"] == ["generations", "drop", "1"]
    search = _pod(objs, "search")["containers"][0]
    assert (c["image"], c["envFrom"], c["resources"]) == (search["image"], search["envFrom"], search["resources"])
    assert pod["restartPolicy"] == "Never"
    assert {"name": "data", "emptyDir": {}} in pod["volumes"]   # not the server's data dir


# ---- Kafka TLS and SASL: certificate files and credentials in every mneme pod -------------

KAFKA_SECURE = ["externalKafka.tls.secretName=kafka-certs",
                "externalKafka.sasl.mechanism=SCRAM-SHA-512", "externalKafka.sasl.username=mneme",
                "externalKafka.sasl.passwordSecret.name=kafka-user"]


def _every_mneme_pod(objs) -> dict[str, dict]:
    pods = {f"Deployment/{s}": _pod(objs, s) for s in SERVICES}
    pods.update({f"Job/{n}": _job_pod(objs, n) for k, n in objs if k == "Job"})
    return pods


def test_kafka_certificates_and_credentials_reach_every_deployment_and_job():
    objs = _objects(hc.check_chart(sets=[*KAFKA_SECURE, *REPLAY]))
    cm = objs[("ConfigMap", "mneme")]["data"]
    assert cm["MNEME_KAFKA_SECURITY_PROTOCOL"] == "SASL_SSL"
    assert (cm["MNEME_KAFKA_SSL_CAFILE"], cm["MNEME_KAFKA_SSL_CERTFILE"], cm["MNEME_KAFKA_SSL_KEYFILE"]) \
        == ("/etc/mneme/kafka-tls/ca.crt", "/etc/mneme/kafka-tls/tls.crt", "/etc/mneme/kafka-tls/tls.key")
    assert (cm["MNEME_KAFKA_SASL_MECHANISM"], cm["MNEME_KAFKA_SASL_USERNAME"]) == ("SCRAM-SHA-512", "mneme")
    assert "MNEME_KAFKA_SASL_PASSWORD" not in cm and "MNEME_KAFKA_SSL_CHECK_HOSTNAME" not in cm
    pods = _every_mneme_pod(objs)
    assert set(pods) >= {"Job/mneme-topics", "Job/mneme-replay-1", "Deployment/search"}
    for where, pod in pods.items():
        assert {"name": "kafka-tls", "secret": {"secretName": "kafka-certs"}} in pod["volumes"], where
        for c in pod["containers"]:
            assert {"name": "kafka-tls", "mountPath": "/etc/mneme/kafka-tls", "readOnly": True} \
                in c["volumeMounts"], where
            assert {"configMapRef": {"name": "mneme"}} in c["envFrom"], where
            assert _env(c)["MNEME_KAFKA_SASL_PASSWORD"]["valueFrom"] == {
                "secretKeyRef": {"name": "kafka-user", "key": "password"}}, where


@pytest.mark.parametrize("sets,expected", [
    (["externalKafka.tls.enabled=true"], {"MNEME_KAFKA_SECURITY_PROTOCOL": "SSL"}),  # system CAs
    (["externalKafka.tls.secretName=k", "externalKafka.tls.caKey=ca.pem", "externalKafka.tls.certKey=",
      "externalKafka.tls.checkHostname=false"],
     {"MNEME_KAFKA_SECURITY_PROTOCOL": "SSL", "MNEME_KAFKA_SSL_CAFILE": "/etc/mneme/kafka-tls/ca.pem",
      "MNEME_KAFKA_SSL_CHECK_HOSTNAME": "false"}),                                 # CA only
    (["externalKafka.sasl.mechanism=PLAIN", "externalKafka.sasl.username=u",
      "externalKafka.sasl.passwordSecret.name=p", "externalKafka.sasl.passwordSecret.key=pw"],
     {"MNEME_KAFKA_SECURITY_PROTOCOL": "SASL_PLAINTEXT", "MNEME_KAFKA_SASL_MECHANISM": "PLAIN",
      "MNEME_KAFKA_SASL_USERNAME": "u"}),
    ([], {}),                                                                       # the default
], ids=["tls-system-cas", "tls-ca-only", "sasl-plaintext", "plaintext"])
def test_kafka_security_settings_are_ones_mneme_accepts(sets, expected, tmp_path):
    """The rendered MNEME_KAFKA_* settings (the mount at a directory holding the Secret's
    files), read as a service reads them: mneme's own KafkaSecurity takes them."""
    from mneme.bus.security import KafkaSecurity
    from mneme.config import Settings
    from tests.e2e.certs import HAVE_OPENSSL, make_ca

    objs = _objects(hc.check_chart(sets=sets))
    cm = objs[("ConfigMap", "mneme")]["data"]
    kafka = {k: v for k, v in cm.items() if k.startswith("MNEME_KAFKA_") and k != "MNEME_KAFKA_REPLICATION_FACTOR"}
    assert kafka == expected
    c = _pod(objs, "ingest")["containers"][0]
    secret = _env(c).get("MNEME_KAFKA_SASL_PASSWORD")
    if "SASL" in expected.get("MNEME_KAFKA_SECURITY_PROTOCOL", ""):
        assert secret["valueFrom"]["secretKeyRef"]["name"] == "p"
        kafka["MNEME_KAFKA_SASL_PASSWORD"] = "from-the-secret"
    else:
        assert secret is None
    if "MNEME_KAFKA_SSL_CAFILE" in kafka:
        if not HAVE_OPENSSL:
            pytest.skip("no openssl")
        (tmp_path / "ca.pem").write_bytes(make_ca(tmp_path / "gen").read_bytes())
        kafka = {k: v.replace("/etc/mneme/kafka-tls", str(tmp_path)) for k, v in kafka.items()}
    sec = KafkaSecurity.from_settings(Settings(**{k[len("MNEME_"):].lower(): v for k, v in kafka.items()}))
    assert sec.protocol == expected.get("MNEME_KAFKA_SECURITY_PROTOCOL", "PLAINTEXT")
    assert set(sec.client_kwargs()) >= {"security_protocol"}


@pytest.mark.parametrize("sets,match", [
    (["kafka.enabled=true", "externalKafka.tls.enabled=true"], "plaintext only"),
    (["kafka.enabled=true", "externalKafka.sasl.mechanism=PLAIN", "externalKafka.sasl.username=u",
      "externalKafka.sasl.passwordSecret.name=p"], "plaintext only"),
    (["externalKafka.sasl.mechanism=PLAIN", "externalKafka.sasl.username=u"], "passwordSecret.name"),
    (["externalKafka.sasl.mechanism=PLAIN", "externalKafka.sasl.passwordSecret.name=p"], "sasl.username"),
], ids=["tls-bundled", "sasl-bundled", "sasl-no-password", "sasl-no-user"])
def test_kafka_security_that_cannot_work_fails_the_render(sets, match):
    with pytest.raises(hc.CheckFailed, match=match):
        hc.template(sets=sets)


def test_the_topics_job_creates_the_topics_over_kafka_tls_with_the_mounted_files(tmp_path, tls_kafka):
    """The topics Job's command with the rendered Kafka TLS settings, the Secret's files
    (ca.crt, tls.crt, tls.key) where the chart mounts them (a directory here): it creates
    the topics through the TLS listener."""
    from tests.e2e.certs import issue

    proxy, bootstrap, ca = tls_kafka
    objs = _objects(hc.template(sets=["externalKafka.tls.secretName=kafka-certs"]))
    c, = _job_pod(objs, "mneme-topics")["containers"]
    mount, = [m["mountPath"] for m in c["volumeMounts"] if m["name"] == "kafka-tls"]
    certs = tmp_path / "kafka-certs"
    certs.mkdir()
    (certs / "ca.crt").write_bytes(Path(ca).read_bytes())
    # a client certificate of the brokers' CA (the proxy does not ask for one; mneme loads it)
    gen = Path(ca).parent
    cert, key = issue(gen, f"client-{os.getpid()}", "mneme")
    (certs / "tls.crt").write_bytes(cert.read_bytes())
    (certs / "tls.key").write_bytes(key.read_bytes())
    cm = {k: v.replace(mount, str(certs)) for k, v in objs[("ConfigMap", "mneme")]["data"].items()}
    assert cm["MNEME_KAFKA_SECURITY_PROTOCOL"] == "SSL"
    env = {**inherited(), **cm, **KAFKA_TEST_ENV, "MNEME_BUS_URL": f"kafka://{bootstrap}",
           "MNEME_DATA_DIR": str(tmp_path / "d"), "MNEME_METRICS_PORT": "0"}
    before = proxy.handshakes
    out = subprocess.run([mneme_bin(), *c["args"]], env=env, capture_output=True, text=True, timeout=180)
    assert out.returncode == 0, out.stdout + out.stderr
    assert "mneme.intake.v1\t12 partitions" in out.stdout
    assert proxy.handshakes > before


def test_every_service_gets_one_kept_master_key(default):
    """Crypto-shredding's master key: made at install (32 random bytes), kept on
    uninstall, in every pod's environment; a given value or a Secret of one's own wins."""
    secret = default[("Secret", "mneme-master-key")]
    assert secret["metadata"]["annotations"]["helm.sh/resource-policy"] == "keep"
    key = base64.b64decode(base64.b64decode(secret["data"]["MNEME_MASTER_KEY"]))
    assert len(key) == 32
    for s in SERVICES:
        refs = _pod(default, s)["containers"][0]["envFrom"]
        assert {"secretRef": {"name": "mneme-master-key"}} in refs
    mine = base64.b64encode(bytes(range(32))).decode()
    given = _objects(hc.check_chart(sets=[f"masterKey.value={mine}"]))
    assert base64.b64decode(given[("Secret", "mneme-master-key")]["data"]
                            ["MNEME_MASTER_KEY"]).decode() == mine
    own = _objects(hc.check_chart(sets=["masterKey.existingSecret=vault-master"]))
    assert ("Secret", "mneme-master-key") not in own
    assert {"secretRef": {"name": "vault-master"}} in \
        _pod(own, "ingest")["containers"][0]["envFrom"]
    with pytest.raises(Exception):
        hc.check_chart(sets=["masterKey.value=short"])


def test_opensearch_per_bank_puts_an_index_per_bank_in_the_text_url():
    """``opensearch.perBank`` asks the bundled OpenSearch for an index per bank (each
    bank's own BM25 statistics); off by default."""
    on = _objects(hc.check_chart(values=[hc.FULL_VALUES], sets=["opensearch.perBank=true"]))
    assert on[("Secret", "mneme")]["stringData"]["MNEME_TEXT_URL"] == (
        "http://mneme-opensearch:9200?per_bank=1")
    off = _objects(hc.check_chart(values=[hc.FULL_VALUES]))
    assert off[("Secret", "mneme")]["stringData"]["MNEME_TEXT_URL"] == (
        "http://mneme-opensearch:9200")


def test_credentials_never_reach_the_configmap():
    """A Qdrant API key travels in MNEME_VECTOR_URL (``https://<key>@host`` or
    ``?api_key=``), as Qdrant Cloud needs: the URL is in the chart's Secret, like the text
    and graph URLs, never in the ConfigMap (readable by anyone who may read ConfigMaps)."""
    url = "https://qd-secret-key@qdrant.example.com:6333"
    objs = _objects(hc.check_chart(sets=[f"externalQdrant.url={url}"]))
    assert "qd-secret-key" not in json.dumps(objs[("ConfigMap", "mneme")])
    assert objs[("Secret", "mneme")]["stringData"]["MNEME_VECTOR_URL"] == url
    bundled = _objects(hc.check_chart(values=[hc.FULL_VALUES]))
    assert bundled[("Secret", "mneme")]["stringData"]["MNEME_VECTOR_URL"] == "http://mneme-qdrant:6333"
    # with a Secret of one's own the URL stays in the ConfigMap (that Secret may lack it;
    # a MNEME_VECTOR_URL in it wins: secretRef comes after configMapRef) -- so one with a
    # key is refused there
    own = _objects(hc.check_chart(sets=["existingSecret=mine"]))
    assert own[("ConfigMap", "mneme")]["data"]["MNEME_VECTOR_URL"] == "http://qdrant:6333"
    refs = _pod(own, "search")["containers"][0]["envFrom"]
    assert refs.index({"configMapRef": {"name": "mneme"}}) < refs.index({"secretRef": {"name": "mine"}})
    for bad in (url, "http://qdrant:6333?api_key=k"):
        with pytest.raises(hc.CheckFailed, match="externalQdrant.url.*existingSecret"):
            hc.template(sets=["existingSecret=mine", f"externalQdrant.url={bad}"])


@pytest.mark.parametrize("sets,match", [
    (["extraEnv.MNEME_LLM_API_KEY=sk-1"], "extraEnv.MNEME_LLM_API_KEY"),
    (["extraEnv.MNEME_RERANK_API_KEY=sk-1"], "extraEnv.MNEME_RERANK_API_KEY"),
    (["config.MNEME_KAFKA_SASL_PASSWORD=pw"], "config.MNEME_KAFKA_SASL_PASSWORD"),
    (["extraEnv.MNEME_MASTER_KEY=AAAA"], "extraEnv.MNEME_MASTER_KEY"),
    (["extraEnv.MNEME_GRAPH_URL=bolt://neo4j:pw@neo4j:7687"], "extraEnv.MNEME_GRAPH_URL"),
    (["extraEnv.MNEME_VECTOR_URL=http://q:6333?api_key=k"], "extraEnv.MNEME_VECTOR_URL"),
], ids=lambda v: v if isinstance(v, str) else v[0].split("=")[0])
def test_a_credential_in_the_configmaps_values_fails_the_render(sets, match):
    """extraEnv and config are rendered into the ConfigMap: a key, a password or a URL
    with credentials there is refused with a message pointing at secretEnv."""
    with pytest.raises(hc.CheckFailed, match=f"{match}.*secretEnv"):
        hc.template(sets=sets)
    key = sets[0].split("=", 1)[0].split(".", 1)[1]
    if not key.endswith("_URL"):  # the store URLs are the chart's (externalNeo4j.*, ...)
        fine = _objects(hc.check_chart(sets=[f"secretEnv.{key}={sets[0].split('=', 1)[1]}"]))
        assert key in fine[("Secret", "mneme")]["stringData"]
    # file paths of keys are not keys
    ok = _objects(hc.template(sets=["extraEnv.MNEME_CLIENT_TLS_KEY=/etc/k.pem",
                                    "extraEnv.MNEME_API_KEYS_FILE=/etc/keys.json"]))
    assert ok[("ConfigMap", "mneme")]["data"]["MNEME_CLIENT_TLS_KEY"] == "/etc/k.pem"


def _drain_s(shutdown_grace_s: float) -> float:
    """How long `mneme serve` may take from SIGTERM to exit (ServiceProcess.stop): the
    gRPC grace, then the consumers' stop (KafkaRunner.stop's default timeout)."""
    import inspect

    from mneme.runtime.kafka import KafkaRunner
    consumers = inspect.signature(KafkaRunner.stop).parameters["timeout"].default
    return shutdown_grace_s + consumers


@pytest.mark.parametrize("grace", ["10", "60", "7.5"])
def test_the_pods_grace_period_covers_the_drain_after_the_prestop_pause(grace):
    """Kubernetes SIGKILLs a pod terminationGracePeriodSeconds after it starts stopping
    it, preStop included: that must cover the preStop pause (endpoints drop the pod while
    it still serves) plus the drain of MNEME_SHUTDOWN_GRACE_S and the consumers' stop, so
    a longer MNEME_SHUTDOWN_GRACE_S lengthens it."""
    objs = _objects(hc.check_chart(sets=[f"config.MNEME_SHUTDOWN_GRACE_S={grace}"]))
    for s in SERVICES:
        pod = _pod(objs, s)
        c = pod["containers"][0]
        pause = int(c["lifecycle"]["preStop"]["exec"]["command"][-1])
        assert pause > 0
        assert pod["terminationGracePeriodSeconds"] >= pause + _drain_s(float(grace)) + 5, s
    off = _objects(hc.template(sets=["preStopSleepSeconds=0"]))
    assert "lifecycle" not in _pod(off, "search")["containers"][0]
    assert _pod(off, "search")["terminationGracePeriodSeconds"] >= _drain_s(10.0) + 5


def test_the_probes_ask_what_the_server_answers_while_a_replica_catches_up(tmp_path, monkeypatch):
    """The chart's probes against a real `mneme serve` process whose readiness check does
    not pass yet (a fresh replica still rebuilding its copies): readiness fails, so the
    pod gets no calls, but startup and liveness pass, so it is not restarted in the middle
    of a long catch-up; the same with TLS through deploy/healthcheck.py's arguments."""
    import threading

    from mneme.config import Settings
    from mneme.runtime import process
    from tests.ports import free_port

    caught_up = threading.Event()
    real = process.BUILDERS["consolidation"]

    def builder(root):
        parts = real(root)
        parts.checks.append(caught_up.is_set)
        return parts
    monkeypatch.setitem(process.BUILDERS, "consolidation", builder)
    port = free_port()
    proc = process.ServiceProcess("consolidation", Settings(
        data_dir=tmp_path / "d", grpc_address=f"127.0.0.1:{port}", health_interval_s=0.05,
        shutdown_grace_s=0.1, metrics_port=0))
    plain = _pod(_objects(hc.template()), "consolidation")["containers"][0]
    tls = _pod(_objects(hc.template(sets=["tls.secretName=certs"])), "consolidation")["containers"][0]
    env = {**inherited(), "MNEME_GRPC_ADDRESS": f"0.0.0.0:{port}", "PYTHONPATH": f"{ROOT / 'libs'}:{ROOT}"}

    def exec_probe(probe: str) -> int:
        cmd = tls[probe]["exec"]["command"]
        assert cmd[:2] == ["python", "/usr/local/lib/mneme/healthcheck.py"]
        return subprocess.run([sys.executable, str(ROOT / "deploy" / "healthcheck.py"), *cmd[2:]],
                              env=env, capture_output=True, timeout=60).returncode

    def grpc_probe(probe: str) -> bool:
        import grpc
        from grpc_health.v1 import health_pb2, health_pb2_grpc
        spec = plain[probe]["grpc"]
        assert spec["port"] == 50051   # the chart's grpcPort; this process listens on port
        with grpc.insecure_channel(f"127.0.0.1:{port}") as ch:
            return health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(
                service=spec.get("service", "")), timeout=5).status == health_pb2.HealthCheckResponse.SERVING

    proc.bind()
    try:
        proc.start()
        assert proc.ready.is_set()
        for probe, passes in (("startupProbe", True), ("livenessProbe", True), ("readinessProbe", False)):
            assert grpc_probe(probe) is passes, probe
            assert (exec_probe(probe) == 0) is passes, probe
        caught_up.set()
        for _ in range(600):
            if grpc_probe("readinessProbe"):
                break
            proc._stop.wait(0.05)
        assert grpc_probe("readinessProbe") and exec_probe("readinessProbe") == 0
    finally:
        proc.stop()


def _data_keys(rendered: str, kind: str) -> list[str]:
    """The keys of the data/stringData of every ``kind`` in the rendered text, as written
    (a YAML loader keeps only the last of a duplicated key)."""
    keys, inside = [], False
    for line in rendered.splitlines():
        if line.startswith("kind: "):
            inside = line == f"kind: {kind}"
        elif inside and line.rstrip() in ("data:", "stringData:"):
            keys.append("---")
        elif inside and line.startswith("  ") and not line.startswith("   ") and keys:
            keys.append(line.strip().split(":", 1)[0])
        elif not line.startswith(" "):
            pass
    return keys


def test_config_and_extra_env_give_each_variable_one_value():
    """extraEnv is merged over config (one key, one value: extraEnv's); a variable the
    chart sets from its own values cannot be set again there (the ConfigMap would hold the
    key twice, and which value a pod got would be up to the YAML parser)."""
    rendered = hc.check_chart(sets=["extraEnv.MNEME_LOG_LEVEL=DEBUG", "config.MNEME_LLM_MODEL=a",
                                    "extraEnv.MNEME_LLM_MODEL=b"])
    keys = [k for k in _data_keys(rendered, "ConfigMap") if k != "---"]
    assert len(keys) == len(set(keys)), keys
    cm = _objects(rendered)[("ConfigMap", "mneme")]["data"]
    assert (cm["MNEME_LOG_LEVEL"], cm["MNEME_LLM_MODEL"]) == ("DEBUG", "b")
    for sets, match in ((["extraEnv.MNEME_BUS_URL=kafka://other:9092"], "MNEME_BUS_URL in extraEnv"),
                        (["config.MNEME_GRPC_ADDRESS=0.0.0.0:1"], "MNEME_GRPC_ADDRESS in config"),
                        (["extraEnv.MNEME_METRICS_PORT=1"], "MNEME_METRICS_PORT in extraEnv"),
                        (["secretEnv.MNEME_GRAPH_URL=bolt://x"], "MNEME_GRAPH_URL in secretEnv")):
        with pytest.raises(hc.CheckFailed, match=match):
            hc.template(sets=sets)


def test_metrics_disabled_turns_the_endpoint_off():
    """metrics.enabled=false: no port on the pods, and the servers do not listen either
    (MNEME_METRICS_PORT=0; unset, the server's default 9464 would still serve)."""
    from mneme.config import Settings

    objs = _objects(hc.check_chart(sets=["metrics.enabled=false"]))
    cm = objs[("ConfigMap", "mneme")]["data"]
    assert Settings(metrics_port=cm.get("MNEME_METRICS_PORT", Settings().metrics_port)).metrics_port == 0
    assert {p["name"] for p in _pod(objs, "search")["containers"][0]["ports"]} == {"grpc"}


def test_reflect_gets_its_key_for_search_when_search_checks_keys():
    """With auth.mode api_key search asks every caller for a key, reflect too (it recalls
    through search with MNEME_API_KEY, mneme.client.api_channel). Without one reflect
    reports ready (its check only dials search) and every Reflect fails: the render
    refuses that; auth.reflectApiKeySecret gives reflect alone the key (a '*' read key)."""
    pod = _pod
    with pytest.raises(hc.CheckFailed, match="auth.reflectApiKeySecret"):
        hc.template(sets=["auth.mode=api_key", "auth.existingSecret=keys"])
    objs = _objects(hc.check_chart(values=[hc.FULL_VALUES]))
    assert objs[("ConfigMap", "mneme")]["data"]["MNEME_AUTH_MODE"] == "api_key"
    reflect = _env(pod(objs, "reflect")["containers"][0])
    assert reflect["MNEME_API_KEY"]["valueFrom"] == {
        "secretKeyRef": {"name": "mneme-reflect-key", "key": "api-key"}}
    for s in ("ingest", "extraction", "search", "consolidation"):
        assert "MNEME_API_KEY" not in _env(pod(objs, s)["containers"][0]), s
    # a key for every pod (secretEnv), or a Secret of one's own (may hold it): accepted
    hc.template(sets=["auth.mode=api_key", "secretEnv.MNEME_API_KEY=k"])
    hc.template(sets=["auth.mode=api_key", "existingSecret=mine"])
    hc.template(sets=["auth.mode=api_key", "services.reflect.enabled=false"])


@pytest.mark.parametrize("sets", [
    ["config.MNEME_PARTITIONS=24"], ["config.MNEME_KAFKA_REPLICATION_FACTOR=3"],
    ["config.MNEME_SHUTDOWN_GRACE_S=7.5"], ["config.MNEME_HEALTH_INTERVAL_S=0.5"],
    ["config.MNEME_HEALTH_INTERVAL_S=1.0"], ["extraEnv.MNEME_LOG_LEVEL=DEBUG"],
], ids=lambda v: v[0])
def test_settings_the_server_takes_pass_lint(sets):
    """The schema's checks of config's settings refuse only what the server refuses: what
    it accepts (Settings) passes lint."""
    from mneme.config import Settings

    hc.lint(sets=sets)
    name, value = sets[0].split(".", 1)[1].split("=", 1)
    if name != "MNEME_LOG_LEVEL":
        Settings(**{name[len("MNEME_"):].lower(): value.strip('"')})


@pytest.mark.parametrize("sets,match", [
    (["metrics.port=50051"], "metrics.port"),
    (["grpcPort=9464"], "metrics.port"),
    (["services.search.pdb.minAvailable=2"], "services.search.pdb"),           # 2 replicas
    (["services.ingest.pdb.maxUnavailable=0"], "services.ingest.pdb"),
    (["services.ingest.pdb.maxUnavailable=0%"], "services.ingest.pdb"),
    (["services.ingest.pdb.minAvailable=100%"], "services.ingest.pdb"),
    (["services.reflect.pdb.minAvailable=2"], "services.reflect.pdb"),         # HPA min 2
], ids=lambda v: v if isinstance(v, str) else v[0])
def test_values_that_cannot_work_on_a_cluster_fail_the_render(sets, match):
    """The metrics port on the gRPC port (the second bind fails, the pod never starts), or a
    PodDisruptionBudget no eviction can satisfy (every node drain blocks on it)."""
    with pytest.raises(hc.CheckFailed, match=match):
        hc.template(sets=sets)


def test_a_pdb_that_allows_an_eviction_renders():
    objs = _objects(hc.check_chart(sets=["services.search.replicas=3", "services.search.pdb.minAvailable=2",
                                         "services.ingest.pdb.maxUnavailable=50%",
                                         "services.extraction.pdb.minAvailable=50%",
                                         "metrics.enabled=false", "metrics.port=50051"]))
    assert objs[("PodDisruptionBudget", "mneme-search")]["spec"]["minAvailable"] == 2


@pytest.mark.parametrize("sets", [
    ["existingSecret=mine", "secretEnv.MNEME_LLM_API_KEY=sk-1"],
    ["existingSecret=mine", "externalNeo4j.password=pw"],
], ids=["secretEnv", "neo4j-password"])
def test_values_that_existing_secret_would_drop_fail_the_render(sets):
    """With existingSecret the chart renders no Secret of its own, so secretEnv and the
    Neo4j password had nowhere to go: they were dropped without a word (the LLM key
    missing, the graph URL without credentials). The render now says so."""
    with pytest.raises(hc.CheckFailed, match=sets[1].split("=")[0].split(".")[0] + ".*existingSecret"):
        hc.template(sets=sets)


@pytest.mark.parametrize("scheme", ["bolt", "bolt+s", "neo4j", "neo4j+s", "neo4j+ssc"])
def test_the_neo4j_url_takes_every_scheme_mneme_speaks(scheme):
    """A Neo4j cluster needs neo4j:// (routing: bolt:// talks to one server, whose writes
    fail on a follower), Aura neo4j+s:// (TLS); mneme's adapter takes all six schemes,
    and externalNeo4j.scheme picks one (the chart wrote bolt:// always)."""
    from mneme.stores.graph_neo4j import parse_neo4j_url

    objs = _objects(hc.check_chart(sets=[f"externalNeo4j.scheme={scheme}", "externalNeo4j.host=db.example.com",
                                         "externalNeo4j.password=p@ss", "externalNeo4j.database=mneme"]))
    url = objs[("Secret", "mneme")]["stringData"]["MNEME_GRAPH_URL"]
    uri, auth, database = parse_neo4j_url(url)
    assert uri == f"{scheme}://db.example.com:7687"
    assert auth == ("neo4j", "p@ss") and database == "mneme"
    no_password = _objects(hc.template(sets=[f"externalNeo4j.scheme={scheme}"]))
    assert parse_neo4j_url(no_password[("Secret", "mneme")]["stringData"]["MNEME_GRAPH_URL"])[0] \
        == f"{scheme}://neo4j:7687"


def test_a_neo4j_host_with_a_scheme_fails_the_render():
    with pytest.raises(hc.CheckFailed, match="externalNeo4j.host"):
        hc.template(sets=["externalNeo4j.host=neo4j+s://db.example.com"])
    with pytest.raises(hc.CheckFailed, match="scheme"):
        hc.lint(sets=["externalNeo4j.scheme=http"])


def test_a_single_secret_key_reaches_every_pod_by_reference():
    """An LLM key kept in a Secret of its own (external-secrets, sealed-secrets) reaches
    every mneme container as a secretKeyRef (secretKeyRefs), without putting it in the
    values (secretEnv: the release record holds it) or moving every variable to
    existingSecret; it also answers reflect's need for a key under api_key."""
    objs = _objects(hc.check_chart(values=[hc.FULL_VALUES], sets=[
        "secretKeyRefs.MNEME_LLM_API_KEY.name=llm", "secretKeyRefs.MNEME_LLM_API_KEY.key=api-key",
        "secretEnv=null"]))
    assert "MNEME_LLM_API_KEY" not in json.dumps(objs[("Secret", "mneme")])
    pods = _every_mneme_pod(objs)
    assert set(pods) >= {"Job/mneme-topics", "Job/mneme-replay-ci", "Deployment/reflect"}
    for where, pod in pods.items():
        for c in pod["containers"]:
            assert _env(c)["MNEME_LLM_API_KEY"]["valueFrom"] == {
                "secretKeyRef": {"name": "llm", "key": "api-key"}}, where
    hc.template(sets=["auth.mode=api_key", "secretKeyRefs.MNEME_API_KEY.name=k",
                      "secretKeyRefs.MNEME_API_KEY.key=v"])
    for taken in ("MNEME_KAFKA_SASL_PASSWORD", "MNEME_REPLICA_ID", "MNEME_SEARCH_ADDRESS", "OTEL_SERVICE_NAME"):
        with pytest.raises(hc.CheckFailed, match=f"secretKeyRefs.{taken}"):
            hc.template(sets=[f"secretKeyRefs.{taken}.name=s", f"secretKeyRefs.{taken}.key=k"])
    with pytest.raises(hc.CheckFailed, match="secretKeyRefs.MNEME_LLM_API_KEY"):
        hc.lint(sets=["secretKeyRefs.MNEME_LLM_API_KEY.name=s"])      # no key
