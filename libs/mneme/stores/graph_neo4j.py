"""Graph store over Neo4j (the ``neo4j`` driver): the shared query set of
:mod:`mneme.stores.cypher` run by :class:`mneme.stores.graph_cypher.CypherGraphStore`.

Every unit of work is a managed transaction in a fresh session (``execute_write`` /
``execute_read``), so the driver retries it on transient errors (leader switch, deadlock)
and the queries of one upsert or one spreading activation see one consistent state;
the work functions only read and write through the transaction, so a retry is safe.
Schema (constraints, indexes: :data:`mneme.stores.cypher.NEO4J_INDEXES`) runs in
auto-commit transactions, as Neo4j requires.

URLs: ``bolt://``, ``bolt+s://``, ``bolt+ssc://``, ``neo4j://``, ``neo4j+s://``,
``neo4j+ssc://`` ``[user:password@]host[:7687][/database][?routing context]``.
"""

from __future__ import annotations

import contextlib
import functools
from typing import Any, Callable, TypeVar
from urllib.parse import unquote, urlsplit, urlunsplit

from mneme.stores import cypher
from mneme.stores.graph_cypher import DELETE_BATCH, FANOUT, CypherGraphStore, Run, deleted
from mneme.stores.storable import storable_value

T = TypeVar("T")

SCHEMES = ("bolt", "bolt+s", "bolt+ssc", "neo4j", "neo4j+s", "neo4j+ssc")


def parse_neo4j_url(url: str) -> tuple[str, tuple[str, str] | None, str | None]:
    """``scheme://[user:password@]host[:port][/database][?context]`` → (driver URI without
    user info and path, (user, password) or None, database name or None for the server's
    default). ValueError for another scheme or no host."""
    parts = urlsplit(url)
    scheme = parts.scheme.lower()
    if scheme not in SCHEMES or not parts.hostname:
        raise ValueError(f"not a Neo4j URL ({'/'.join(SCHEMES)}://host:7687): {url!r}")
    host = f"[{parts.hostname}]" if ":" in parts.hostname else parts.hostname
    netloc = f"{host}:{parts.port or 7687}"
    auth = ((unquote(parts.username), unquote(parts.password or ""))
            if parts.username else None)
    database = unquote(parts.path.strip("/")) or None
    # the query is the driver's routing context (neo4j:// only; the driver checks it)
    return urlunsplit((scheme, netloc, "", parts.query, "")), auth, database


#: The query set in Neo4j's dialect: subqueries with the variable scope clause (the query
#: set is a few dozen constants, so the cache holds each once).
_in_neo4j_dialect = functools.lru_cache(maxsize=256)(cypher.scope_clause)


def _runner(tx: Any) -> Run:
    return lambda q, p: _values(tx.run(_in_neo4j_dialect(q), storable_value(p)))


def _values(records: Any) -> list[list[Any]]:
    # consume inside the transaction: a Result is lazy and dies with its transaction
    return [list(r.values()) for r in records]


class Neo4jGraphStore(CypherGraphStore):
    """:class:`mneme.ports.GraphStore` over Neo4j 5+ (Community or Enterprise).

    ``uri`` and ``auth`` go to ``neo4j.GraphDatabase.driver`` (or pass a ready
    ``driver``, e.g. a test double: anything with ``session(database=…)`` returning a
    context manager with ``run``, ``execute_read`` and ``execute_write``, and ``close``).
    ``database`` None uses the server's default database. Opening runs the schema DDL,
    so an unreachable server raises ``neo4j.exceptions.ServiceUnavailable`` and bad
    credentials ``neo4j.exceptions.AuthError``. Thread-safe without a lock: the driver
    pools connections and each call uses its own session and transaction.

    Not exercised against a Neo4j server in this repository's tests (none runs here): the
    query set is contract-tested on FalkorDB and this adapter's plumbing with a driver
    double that forwards to FalkorDB.
    """

    def __init__(self, uri: str | None = None, auth: tuple[str, str] | None = None,
                 database: str | None = None, fanout: int = FANOUT,
                 driver: Any = None) -> None:
        super().__init__(fanout=fanout, lock=contextlib.nullcontext())
        if (uri is None) == (driver is None):
            raise ValueError("give exactly one of uri or driver")
        if driver is None:
            from neo4j import GraphDatabase
            driver = GraphDatabase.driver(uri, auth=auth)
        self._driver: Any = driver
        self.database = database
        try:
            self._ensure_schema()
            self._check_unit_tags()
        except BaseException:
            self.close()
            raise

    @classmethod
    def from_url(cls, url: str, driver: Any = None) -> "Neo4jGraphStore":
        """The store for a URL of :func:`parse_neo4j_url`'s form (``driver`` replaces the
        real one, for tests; it then receives nothing of the URL but the database)."""
        uri, auth, database = parse_neo4j_url(url)
        if driver is not None:
            return cls(database=database, driver=driver)
        return cls(uri, auth=auth, database=database)

    @property
    def driver(self) -> Any:
        if self._driver is None:
            raise RuntimeError("Neo4jGraphStore is closed")
        return self._driver

    def _session(self) -> Any:
        return self.driver.session(database=self.database)

    def _read(self, work: Callable[[Run], T]) -> T:
        with self._session() as session:
            return session.execute_read(lambda tx: work(_runner(tx)))

    def _write(self, work: Callable[[Run], T]) -> T:
        with self._session() as session:
            return session.execute_write(lambda tx: work(_runner(tx)))

    def _ensure_schema(self) -> None:
        with self._session() as session:
            for ddl in cypher.NEO4J_INDEXES:
                session.run(ddl).consume()

    def reset(self) -> None:
        """Delete every bank's units and entities (in transactions of
        :data:`mneme.stores.graph_cypher.DELETE_BATCH` nodes); the schema stays."""
        while self._write(lambda run: deleted(run(
                cypher.DELETE_ALL, {"limit": DELETE_BATCH}))) >= DELETE_BATCH:
            pass

    def close(self) -> None:
        """Close the driver (its connection pool); further calls raise RuntimeError.
        Idempotent."""
        if self._driver is not None:
            driver, self._driver = self._driver, None
            driver.close()

    def flush(self) -> None:
        """No-op: every write is a committed transaction (durable) on return."""
