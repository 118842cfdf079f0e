"""Kafka transport security: the ``MNEME_KAFKA_SECURITY_PROTOCOL`` / ``MNEME_KAFKA_SSL_*``
/ ``MNEME_KAFKA_SASL_*`` settings as one checked value, and the arguments both Kafka
clients mneme uses take from it.

* :meth:`KafkaSecurity.client_kwargs` — the keyword arguments of every aiokafka client
  (producer, consumers, admin, metadata client): ``security_protocol``, ``ssl_context``,
  ``sasl_mechanism``, ``sasl_plain_username``, ``sasl_plain_password``;
* :meth:`KafkaSecurity.faststream` — the ``faststream.security`` object for
  ``KafkaBroker(security=...)``, which FastStream turns into the same arguments.

Protocols are Kafka's: PLAINTEXT, SSL, SASL_PLAINTEXT, SASL_SSL; mechanisms PLAIN,
SCRAM-SHA-256, SCRAM-SHA-512. Certificates are read when a client is made (each new
client, e.g. after a restart, sees the files as they are then).
"""

from __future__ import annotations

import os
import ssl
from dataclasses import dataclass, field
from typing import Any

from mneme.errors import ConfigurationError

PROTOCOLS = ("PLAINTEXT", "SSL", "SASL_PLAINTEXT", "SASL_SSL")
MECHANISMS = ("PLAIN", "SCRAM-SHA-256", "SCRAM-SHA-512")


class KafkaSecurityError(ConfigurationError):
    """A Kafka security setting that cannot work (named in the message by its
    ``MNEME_KAFKA_*`` variable); raised when the settings are read, at start."""


def _readable(var: str, path: str) -> None:
    if not os.path.isfile(path) or not os.access(path, os.R_OK):
        raise KafkaSecurityError(f"{var}={path!r} is not a readable file")


@dataclass(frozen=True)
class KafkaSecurity:
    """How mneme's Kafka clients connect. Empty strings mean "not set".

    ``protocol``: PLAINTEXT (default) | SSL | SASL_PLAINTEXT | SASL_SSL (case-insensitive).
    ``ssl_cafile``: CA bundle (PEM) that signs the brokers' certificates (default: the
    system's trust store); ``ssl_certfile``/``ssl_keyfile``: a client certificate and its
    key (PEM) for brokers that require one (the key may be inside the certificate file);
    ``ssl_check_hostname``: verify the broker's name against its certificate.
    ``sasl_mechanism``: PLAIN | SCRAM-SHA-256 | SCRAM-SHA-512 (default PLAIN for the
    SASL protocols); ``sasl_username``/``sasl_password``: its credentials.

    Raises :class:`KafkaSecurityError` for an unknown protocol or mechanism, a SASL
    protocol without credentials, SASL or SSL settings the protocol would ignore, and a
    named certificate file that is not readable."""

    protocol: str = "PLAINTEXT"
    ssl_cafile: str = ""
    ssl_certfile: str = ""
    ssl_keyfile: str = ""
    ssl_check_hostname: bool = True
    sasl_mechanism: str = ""
    sasl_username: str = ""
    sasl_password: str = field(default="", repr=False)

    def __post_init__(self) -> None:
        protocol = (self.protocol or "PLAINTEXT").strip().upper()
        if protocol not in PROTOCOLS:
            raise KafkaSecurityError(f"MNEME_KAFKA_SECURITY_PROTOCOL={self.protocol!r} is "
                                     f"not one of {', '.join(PROTOCOLS)}")
        object.__setattr__(self, "protocol", protocol)
        mechanism = self.sasl_mechanism.strip().upper()
        if self.sasl:
            mechanism = mechanism or "PLAIN"
            if mechanism not in MECHANISMS:
                raise KafkaSecurityError(f"MNEME_KAFKA_SASL_MECHANISM={self.sasl_mechanism!r} "
                                         f"is not one of {', '.join(MECHANISMS)}")
            if not (self.sasl_username and self.sasl_password):
                raise KafkaSecurityError(
                    f"MNEME_KAFKA_SECURITY_PROTOCOL={protocol} ({mechanism}) needs "
                    f"MNEME_KAFKA_SASL_USERNAME and MNEME_KAFKA_SASL_PASSWORD")
        elif mechanism or self.sasl_username or self.sasl_password:
            # Credentials a PLAINTEXT/SSL client would silently never send.
            raise KafkaSecurityError(
                f"MNEME_KAFKA_SASL_* is set but MNEME_KAFKA_SECURITY_PROTOCOL={protocol}; "
                f"use SASL_PLAINTEXT or SASL_SSL")
        object.__setattr__(self, "sasl_mechanism", mechanism)
        files = {"MNEME_KAFKA_SSL_CAFILE": self.ssl_cafile,
                 "MNEME_KAFKA_SSL_CERTFILE": self.ssl_certfile,
                 "MNEME_KAFKA_SSL_KEYFILE": self.ssl_keyfile}
        named = {k: v for k, v in files.items() if v}
        if named and not self.ssl:
            raise KafkaSecurityError(f"{', '.join(named)} set but "
                                     f"MNEME_KAFKA_SECURITY_PROTOCOL={protocol}; use SSL "
                                     f"or SASL_SSL")
        if self.ssl_keyfile and not self.ssl_certfile:
            raise KafkaSecurityError("MNEME_KAFKA_SSL_KEYFILE needs MNEME_KAFKA_SSL_CERTFILE")
        for var, path in named.items():
            _readable(var, path)

    @property
    def ssl(self) -> bool:
        """True when the connection is TLS (SSL, SASL_SSL)."""
        return self.protocol in ("SSL", "SASL_SSL")

    @property
    def sasl(self) -> bool:
        """True when the client authenticates with SASL (SASL_PLAINTEXT, SASL_SSL)."""
        return self.protocol.startswith("SASL_")

    @classmethod
    def from_settings(cls, settings: Any) -> "KafkaSecurity":
        """The ``kafka_security_protocol``, ``kafka_ssl_*`` and ``kafka_sasl_*`` fields of
        :class:`mneme.config.Settings` (raises :class:`KafkaSecurityError`)."""
        return cls(protocol=settings.kafka_security_protocol,
                   ssl_cafile=settings.kafka_ssl_cafile,
                   ssl_certfile=settings.kafka_ssl_certfile,
                   ssl_keyfile=settings.kafka_ssl_keyfile,
                   ssl_check_hostname=settings.kafka_ssl_check_hostname,
                   sasl_mechanism=settings.kafka_sasl_mechanism,
                   sasl_username=settings.kafka_sasl_username,
                   sasl_password=settings.kafka_sasl_password)

    def ssl_context(self) -> ssl.SSLContext | None:
        """A new client SSLContext from the files as they are now (None unless SSL);
        raises KafkaSecurityError when a file holds no usable certificate or key."""
        if not self.ssl:
            return None
        from aiokafka.helpers import create_ssl_context  # lazy: aiokafka only for Kafka
        try:
            ctx = create_ssl_context(cafile=self.ssl_cafile or None,
                                     certfile=self.ssl_certfile or None,
                                     keyfile=self.ssl_keyfile or None)
        except (ssl.SSLError, OSError) as e:
            raise KafkaSecurityError(f"Kafka TLS files unusable "
                                     f"(MNEME_KAFKA_SSL_CAFILE/CERTFILE/KEYFILE): {e}") from e
        ctx.check_hostname = self.ssl_check_hostname
        return ctx

    def client_kwargs(self) -> dict[str, Any]:
        """Keyword arguments for ``AIOKafkaProducer``/``AIOKafkaConsumer``/
        ``AIOKafkaAdminClient``/``AIOKafkaClient``: ``security_protocol`` always;
        ``ssl_context`` for SSL protocols; ``sasl_mechanism``, ``sasl_plain_username``,
        ``sasl_plain_password`` for SASL ones (aiokafka's names for every mechanism)."""
        out: dict[str, Any] = {"security_protocol": self.protocol}
        if self.ssl:
            out["ssl_context"] = self.ssl_context()
        if self.sasl:
            out.update(sasl_mechanism=self.sasl_mechanism,
                       sasl_plain_username=self.sasl_username,
                       sasl_plain_password=self.sasl_password)
        return out

    def faststream(self):
        """The ``faststream.security`` object for ``KafkaBroker(security=...)``: None for
        PLAINTEXT, ``BaseSecurity`` for SSL, ``SASLPlaintext`` / ``SASLScram256`` /
        ``SASLScram512`` (with ``use_ssl`` for SASL_SSL) for SASL."""
        if self.protocol == "PLAINTEXT":
            return None
        from faststream.security import (BaseSecurity, SASLPlaintext, SASLScram256,
                                         SASLScram512)
        ctx = self.ssl_context()
        if not self.sasl:
            return BaseSecurity(ssl_context=ctx, use_ssl=True)
        kind = {"PLAIN": SASLPlaintext, "SCRAM-SHA-256": SASLScram256,
                "SCRAM-SHA-512": SASLScram512}[self.sasl_mechanism]
        return kind(username=self.sasl_username, password=self.sasl_password,
                    ssl_context=ctx, use_ssl=self.ssl)


__all__ = ["KafkaSecurity", "KafkaSecurityError", "MECHANISMS", "PROTOCOLS"]
