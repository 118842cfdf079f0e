"""search's read API: get and list memories (from the vector store's payloads)."""

from __future__ import annotations

from mneme import paging
from mneme.domain import Fact, Filters
from mneme.errors import InvalidArgument, NotFound
from mneme.ports import VectorStore

MAX_PAGE = 1000


def get_memory(vectors: VectorStore, bank_id: str, memory_id: str) -> Fact:
    """The memory, or NotFound."""
    got = vectors.get(bank_id, [memory_id])
    if not got:
        raise NotFound(f"memory {memory_id!r} not found in bank {bank_id!r}")
    return got[0]


def list_memories(vectors: VectorStore, bank_id: str, page_size: int, page_token: str,
                  filters: Filters | None = None) -> tuple[list[Fact], str]:
    """One page of the bank's memories in a stable order and the next page token
    ('' at the end). ``page_size`` 0 means 100; at most 1000."""
    size = paging.page_size(page_size, maximum=MAX_PAGE)
    kind = f"memories:{bank_id}"
    after = paging.decode_token(page_token, kind)
    try:
        facts, nxt = vectors.scroll(bank_id, size, after, filters)
    except ValueError:
        if after is None:  # not the token's fault: never blame a field the caller left empty
            raise
        # a well-formed token the store did not issue
        raise InvalidArgument("page_token", "not a token this API returned") from None
    return facts, paging.encode_token(kind, nxt) if nxt else ""
