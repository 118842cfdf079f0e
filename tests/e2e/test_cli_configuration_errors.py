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
    "unknown-bus-scheme": ({"MNEME_BUS_URL": "kafak://127.0.0.1:9"}, "MNEME_BUS_URL"),
    "kafka-without-host": ({"MNEME_BUS_URL": "kafka://"}, "MNEME_BUS_URL"),
}


def run(args: list[str], env: dict[str, str], tmp_path: Path) -> subprocess.CompletedProcess:
    base = {k: v for k, v in os.environ.items() if not k.startswith("MNEME_")}
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
