"""Kafka TLS/SASL settings (mneme.bus.security): what is refused at start, the aiokafka
arguments every client of the log gets, and the FastStream security object of the
broker — which FastStream turns into the very same arguments."""

from __future__ import annotations

import ssl

import pytest
from faststream.kafka.security import parse_security
from faststream.security import BaseSecurity, SASLPlaintext, SASLScram256, SASLScram512

from mneme.bus.kafka_log import KafkaOptions
from mneme.bus.security import KafkaSecurity, KafkaSecurityError
from mneme.config import Settings
from tests.e2e.certs import HAVE_OPENSSL, make_ca


@pytest.fixture(scope="module")
def ca(tmp_path_factory):
    if not HAVE_OPENSSL:
        pytest.skip("no openssl")
    return str(make_ca(tmp_path_factory.mktemp("kafka-ca")))


def test_plaintext_by_default():
    sec = Settings().kafka_options()["security"]
    assert sec == KafkaSecurity()
    assert sec.client_kwargs() == {"security_protocol": "PLAINTEXT"}
    assert sec.faststream() is None
    assert KafkaOptions().security == KafkaSecurity()


@pytest.mark.parametrize("kwargs, names", [
    (dict(protocol="TLS"), "MNEME_KAFKA_SECURITY_PROTOCOL"),
    (dict(protocol="SASL_SSL"), "MNEME_KAFKA_SASL_USERNAME"),
    (dict(protocol="SASL_PLAINTEXT", sasl_mechanism="SCRAM-SHA-256", sasl_username="u"),
     "MNEME_KAFKA_SASL_PASSWORD"),
    (dict(protocol="SASL_PLAINTEXT", sasl_mechanism="GSSAPI", sasl_username="u",
          sasl_password="p"), "MNEME_KAFKA_SASL_MECHANISM"),
    (dict(sasl_mechanism="PLAIN", sasl_username="u", sasl_password="p"), "SASL_PLAINTEXT"),
    (dict(protocol="SSL", ssl_cafile="/nonexistent/ca.pem"), "MNEME_KAFKA_SSL_CAFILE"),
    (dict(ssl_cafile="/nonexistent/ca.pem"), "use SSL"),
    (dict(protocol="SSL", ssl_keyfile="/nonexistent/k.pem"), "MNEME_KAFKA_SSL_CERTFILE"),
])
def test_bad_combinations_are_refused(kwargs, names):
    with pytest.raises(KafkaSecurityError, match=names):
        KafkaSecurity(**kwargs)


def test_settings_from_environment_fail_at_start(monkeypatch):
    monkeypatch.setenv("MNEME_KAFKA_SECURITY_PROTOCOL", "SASL_SSL")
    monkeypatch.setenv("MNEME_KAFKA_SASL_MECHANISM", "scram-sha-512")
    with pytest.raises(ValueError, match="MNEME_KAFKA_SASL_USERNAME"):
        Settings().kafka_options()
    monkeypatch.setenv("MNEME_KAFKA_SASL_USERNAME", "mneme")
    monkeypatch.setenv("MNEME_KAFKA_SASL_PASSWORD", "s3cret")
    sec = Settings().kafka_options()["security"]
    assert (sec.protocol, sec.sasl_mechanism, sec.sasl_username) == ("SASL_SSL",
                                                                    "SCRAM-SHA-512", "mneme")
    assert "s3cret" not in repr(sec)


def test_ssl_context_trusts_the_named_ca(ca):
    sec = KafkaSecurity(protocol="ssl", ssl_cafile=ca)
    kw = sec.client_kwargs()
    assert kw["security_protocol"] == "SSL"
    ctx = kw["ssl_context"]
    assert isinstance(ctx, ssl.SSLContext) and ctx.verify_mode == ssl.CERT_REQUIRED
    assert ctx.check_hostname
    assert any(dict(x[0] for x in c["subject"]).get("commonName") == "test-ca"
               for c in ctx.get_ca_certs())
    assert isinstance(sec.faststream(), BaseSecurity) and sec.faststream().use_ssl


@pytest.mark.parametrize("protocol", ["SASL_PLAINTEXT", "SASL_SSL"])
@pytest.mark.parametrize("mechanism, kind", [("PLAIN", SASLPlaintext),
                                             ("SCRAM-SHA-256", SASLScram256),
                                             ("SCRAM-SHA-512", SASLScram512)])
def test_sasl_maps_to_aiokafka_and_faststream_alike(ca, protocol, mechanism, kind):
    sec = KafkaSecurity(protocol=protocol, sasl_mechanism=mechanism, sasl_username="mneme",
                        sasl_password="s3cret", ssl_cafile=ca if protocol == "SASL_SSL" else "")
    kw = sec.client_kwargs()
    assert {k: kw[k] for k in ("security_protocol", "sasl_mechanism", "sasl_plain_username",
                               "sasl_plain_password")} == {
        "security_protocol": protocol, "sasl_mechanism": mechanism,
        "sasl_plain_username": "mneme", "sasl_plain_password": "s3cret"}
    assert (kw.get("ssl_context") is not None) == (protocol == "SASL_SSL")
    fs = sec.faststream()
    assert type(fs) is kind
    parsed = parse_security(fs)  # what KafkaBroker passes to its aiokafka clients
    assert {k: v for k, v in parsed.items() if k != "ssl_context"} == {
        k: v for k, v in kw.items() if k != "ssl_context"}
    assert (parsed["ssl_context"] is not None) == (protocol == "SASL_SSL")


def test_sasl_defaults_to_plain():
    sec = KafkaSecurity(protocol="SASL_PLAINTEXT", sasl_username="u", sasl_password="p")
    assert sec.client_kwargs()["sasl_mechanism"] == "PLAIN"


def test_the_broker_connects_with_the_logs_security():
    """build_broker (the services' FastStream broker) takes the security of the log's
    KafkaOptions: its connection arguments are the log clients' ones."""
    from mneme.runtime.kafka import build_broker
    sec = KafkaSecurity(protocol="SASL_PLAINTEXT", sasl_mechanism="SCRAM-SHA-256",
                        sasl_username="mneme", sasl_password="s3cret")
    broker = build_broker([], options=KafkaOptions(security=sec))
    conn = broker._connection_kwargs  # what FastStream hands aiokafka on connect
    for k, v in sec.client_kwargs().items():
        assert conn[k] == v
