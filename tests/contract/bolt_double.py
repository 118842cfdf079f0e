"""A stand-in for ``neo4j.Driver`` (no Neo4j server runs here): sessions and managed
transactions with the driver's call shapes, which record every query and check what a
real Bolt driver and a Neo4j cluster would reject, and optionally forward the queries to
another Cypher engine (a FalkorDB graph) so the adapter runs end to end."""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Any, Callable

WRITE_CLAUSE = re.compile(r"\b(CREATE|MERGE|DELETE|SET|REMOVE)\b", re.IGNORECASE)
SCHEMA = re.compile(r"^\s*(CREATE|DROP)\s+(INDEX|CONSTRAINT)\b", re.IGNORECASE)


def check_packable(value: Any, where: str = "$") -> None:
    """Raise TypeError unless ``value`` is something Bolt's PackStream carries as a plain
    value (None, bool, int in 64 bits, float, str, list/tuple, dict with str keys)."""
    if value is None or isinstance(value, (bool, float, str)):
        return
    if isinstance(value, int):
        if not -2**63 <= value < 2**63:
            raise TypeError(f"{where}: integer out of 64-bit range")
        return
    if isinstance(value, (list, tuple)):
        for i, v in enumerate(value):
            check_packable(v, f"{where}[{i}]")
        return
    if isinstance(value, dict):
        for k, v in value.items():
            if not isinstance(k, str):
                raise TypeError(f"{where}: non-string map key {k!r}")
            check_packable(v, f"{where}.{k}")
        return
    raise TypeError(f"{where}: {type(value).__name__} cannot be sent over Bolt")


@dataclass
class Call:
    mode: str  # "auto" (session.run), "read" or "write" (managed transactions)
    query: str
    params: dict[str, Any]
    database: str | None


class Record:
    def __init__(self, values: list[Any]) -> None:
        self._values = values

    def values(self) -> list[Any]:
        return list(self._values)


class Result:
    def __init__(self, rows: list[list[Any]]) -> None:
        self._rows = rows

    def __iter__(self):
        return iter(Record(r) for r in self._rows)

    def consume(self) -> None:
        self._rows = []


class Transaction:
    def __init__(self, session: "Session", mode: str) -> None:
        self._session, self._mode = session, mode

    def run(self, query: str, parameters: dict[str, Any] | None = None) -> Result:
        if self._mode == "read" and WRITE_CLAUSE.search(query):
            # a cluster routes read transactions to followers, which refuse writes
            raise AssertionError(f"write clause in a read transaction: {query.strip()}")
        if SCHEMA.search(query):
            raise AssertionError("schema DDL inside a transaction function")
        return self._session._execute(self._mode, query, parameters)


class Session:
    def __init__(self, driver: "BoltDriverDouble", database: str | None) -> None:
        self._driver, self._database = driver, database
        self.open = True

    def __enter__(self) -> "Session":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.open = False

    def _execute(self, mode: str, query: str, parameters: dict[str, Any] | None) -> Result:
        assert self.open, "session used after close"
        params = dict(parameters or {})
        check_packable(params)
        self._driver.calls.append(Call(mode, query, params, self._database))
        return Result(self._driver.execute(query, params))

    def run(self, query: str, parameters: dict[str, Any] | None = None) -> Result:
        return self._execute("auto", query, parameters)

    def execute_read(self, work: Callable[[Transaction], Any]) -> Any:
        return work(Transaction(self, "read"))

    def execute_write(self, work: Callable[[Transaction], Any]) -> Any:
        return work(Transaction(self, "write"))


@dataclass
class BoltDriverDouble:
    """``execute(query, params)`` answers each non-DDL query (rows as lists); by default
    every query returns no rows. Schema DDL is recorded, never forwarded (the engine
    behind may not speak Neo4j's DDL)."""

    execute_fn: Callable[[str, dict[str, Any]], list[list[Any]]] | None = None
    calls: list[Call] = field(default_factory=list)
    closed: bool = False

    def session(self, database: str | None = None, **config: Any) -> Session:
        assert not self.closed, "driver used after close"
        return Session(self, database)

    def execute(self, query: str, params: dict[str, Any]) -> list[list[Any]]:
        if SCHEMA.search(query) or self.execute_fn is None:
            return []
        return self.execute_fn(query, params)

    def close(self) -> None:
        self.closed = True
