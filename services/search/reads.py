"""search's read API: memories and tags (from the vector store's payloads and its keyword
indexes), documents (the document projection, with their memories from the vector
store), entities (from the graph)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from mneme import paging

from mneme.domain import (EXPERIENCE, WORLD, DocumentRevision, EntityInfo, Fact, Filters,
                          StoredDocument, tags_filter_set)
from mneme.errors import InvalidArgument, NotFound
from mneme.ports import DocumentStore, GraphStore, VectorStore

MAX_PAGE = 1000
#: Most entities a tag-scoped ListEntities examines per call (:func:`list_entities`).
ENTITY_SCAN = 1000
#: Most distinct documents (or tags) of one bank the lists page through: they are counted
#: by the store at each call, then paged in value order.
MAX_VALUES = 100_000
#: Most memories GetDocument returns.
DOCUMENT_MEMORIES = 1000
#: Most revisions GetDocument returns (the latest ones).
DOCUMENT_REVISIONS = 100
#: Facts, not observations: what the document and tag counts count.
FACT_TYPES = (WORLD, EXPERIENCE)


def get_memory(vectors: VectorStore, bank_id: str, memory_id: str,
               fact_type: str | None = None) -> Fact:
    """The memory unit, or NotFound; with ``fact_type`` (the collection its name was
    in: "observation", "opinion") NotFound also for a unit of another type."""
    got = vectors.get(bank_id, [memory_id])
    if not got or (fact_type is not None and got[0].fact_type != fact_type):
        raise NotFound(f"{fact_type or 'memory'} {memory_id!r} not found in bank {bank_id!r}")
    return got[0]


def list_memories(vectors: VectorStore, bank_id: str, page_size: int, page_token: str,
                  filters: Filters | None = None) -> tuple[list[Fact], str]:
    """One page of the bank's memories matching ``filters`` (its ``types`` and
    ``document_id``) in a stable order and the next page token ('' at the end), bound to
    those filters. ``page_size`` 0 means 100; at most 1000. InvalidArgument naming
    ``page_token`` for a token of another list or other filters."""
    size = paging.page_size(page_size, maximum=MAX_PAGE)
    f = filters or Filters()
    kind = ("memories", bank_id, f.document_id, list(f.types))
    after = paging.decode_token(page_token, kind)
    try:
        facts, nxt = vectors.scroll(bank_id, size, after, filters)
    except ValueError:
        if after is None:  # not the token's fault: never blame a field the caller left empty
            raise
        # a well-formed token the store did not issue
        raise InvalidArgument("page_token", "not a token this API returned") from None
    return facts, paging.encode_token(kind, nxt) if nxt else ""


def _page_of_values(pairs: list[tuple[str, int]], page_size: int, page_token: str,
                    kind: tuple) -> tuple[list[tuple[str, int]], str]:
    """One page of (value, count) pairs in value order after the token's value."""
    size = paging.page_size(page_size, maximum=MAX_PAGE)
    after = paging.decode_token(page_token, kind)
    rest = sorted(p for p in pairs if after is None or p[0] > after)
    page = rest[:size]
    return page, paging.encode_token(kind, page[-1][0]) if len(rest) > size else ""


def list_documents(documents: DocumentStore, vectors: VectorStore, bank_id: str,
                   page_size: int, page_token: str
                   ) -> tuple[list[tuple[StoredDocument, int]], str]:
    """One page of the bank's documents (without text) in document id order, each with
    the facts extracted from it (counted by the vector store), and the next page token
    ('' at the end). ``page_size`` 0 means 100, at most 1000; InvalidArgument for a token
    this list did not issue."""
    size = paging.page_size(page_size, maximum=MAX_PAGE)
    kind = ("documents", bank_id)
    after = paging.decode_token(page_token, kind) or ""
    got = documents.list(bank_id, size + 1, after)
    page = got[:size]
    out = [(d, vectors.count(bank_id, Filters(types=FACT_TYPES, document_id=d.document_id)))
           for d in page]
    return out, paging.encode_token(kind, page[-1].document_id) if len(got) > size else ""


@dataclass(frozen=True)
class DocumentView:
    """What GetDocument shows of a document: the projection's record (None when only the
    vector store knows it, e.g. units of a retain the projection has not reached), its
    latest :data:`DOCUMENT_REVISIONS` revisions, its first :data:`DOCUMENT_MEMORIES` facts
    in item order and how many it has."""

    stored: StoredDocument | None
    history: list[DocumentRevision]
    facts: list[Fact]
    memory_count: int


def get_document(documents: DocumentStore, vectors: VectorStore, bank_id: str,
                 document_id: str) -> DocumentView:
    """The document with its text, history and facts; NotFound when neither the
    projection nor the vector store knows it, InvalidArgument naming ``document_id``
    when empty."""
    if not document_id:
        raise InvalidArgument("document_id", "required")
    filters = Filters(types=FACT_TYPES, document_id=document_id)
    facts: list[Fact] = []
    after = None
    while len(facts) < DOCUMENT_MEMORIES:
        page, after = vectors.scroll(bank_id, min(MAX_PAGE, DOCUMENT_MEMORIES - len(facts)),
                                     after, filters)
        facts.extend(page)
        if after is None:
            break
    stored = documents.get(bank_id, document_id)
    if stored is None and not facts:
        raise NotFound(f"document {document_id!r} not found in bank {bank_id!r}")
    count = len(facts) if after is None else vectors.count(bank_id, filters)
    history = documents.revisions(bank_id, document_id, DOCUMENT_REVISIONS) if stored else []
    return DocumentView(stored, history, sorted(facts, key=lambda f: (f.item_index, f.chunk_id, f.id)),
                        count)


def list_tags(vectors: VectorStore, bank_id: str, page_size: int, page_token: str
              ) -> tuple[list[tuple[str, int]], str]:
    """One page of the tags on the bank's facts as (tag, facts carrying it) in tag
    order, and the next page token ('' at the end); sizes and errors as
    :func:`list_documents`."""
    return _page_of_values(vectors.facet(bank_id, "tags", MAX_VALUES, Filters(types=FACT_TYPES)),
                           page_size, page_token, ("tags", bank_id))


def list_entities(graph: GraphStore, bank_id: str, page_size: int, page_token: str,
                  tags: Sequence[str] = (), tags_match: str = "any"
                  ) -> tuple[list[EntityInfo], str]:
    """One page of the bank's entities in id order (with mention counts) and the next
    page token ('' at the end); sizes and errors as :func:`list_documents`.

    With a tag filter (``tags`` in ``tags_match`` mode, as recall's, checked by the
    caller): only the entities a matching live memory mentions, counted and dated over
    those memories. Each call examines at most :data:`ENTITY_SCAN` entities (or the page
    size + 1, if larger) in id order, so a scope mentioning few of a large bank's
    entities costs bounded work per call: the page then holds those found (maybe none)
    and the token resumes after the last entity examined (AIP-158 lets a page be short
    before the end). The token is bound to the filter (tags as a set, and the mode): a
    token from another filter is InvalidArgument naming ``page_token``."""
    size = paging.page_size(page_size, maximum=MAX_PAGE)
    if not tags_filter_set(tags, tags_match):
        kind: tuple = ("entities", bank_id)
        after = paging.decode_token(page_token, kind)
        got = graph.entities(bank_id, size + 1, after or "")
        page = got[:size]
        return page, paging.encode_token(kind, page[-1].id) if len(got) > size else ""
    kind = ("entities", bank_id, sorted(set(tags)), tags_match)
    after = paging.decode_token(page_token, kind)
    scan = max(size + 1, ENTITY_SCAN)
    got = graph.entities(bank_id, scan, after or "", tags, tags_match)
    found = [e for e in got if e.mentions > 0]
    if len(found) > size:
        return found[:size], paging.encode_token(kind, found[size - 1].id)
    return found, paging.encode_token(kind, got[-1].id) if len(got) == scan else ""


def get_entity(graph: GraphStore, bank_id: str, entity_id: str, tags: Sequence[str] = (),
               tags_match: str = "any") -> EntityInfo:
    """The entity with its (at most 100) most recent units and 20 most co-mentioned
    neighbours; NotFound when the bank has no such entity. With a tag filter (as
    :func:`list_entities`) over the matching live memories only, and NotFound (the same
    answer as for an unknown id) when none of them mentions it."""
    got = graph.entity(bank_id, entity_id, units=100, neighbours=20, tags=tags,
                       tags_match=tags_match)
    if got is None or tags_filter_set(tags, tags_match) and got.mentions == 0:
        raise NotFound(f"entity {entity_id!r} not found in bank {bank_id!r}")
    return got
