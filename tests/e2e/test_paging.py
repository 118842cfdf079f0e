"""Paging through a real ``mneme up``: every token the server issues is taken back, for
ids and tags of the longest lengths in any script; ListOperations serves each operation
once while operations come and go between pages (keyset paging); a token is bound to
the filters it was issued for (AIP-158)."""

from __future__ import annotations

from datetime import datetime, timezone

import grpc
import pytest

from mneme.client import field_violations
from mneme.limits import Limits
from mneme.v1 import (documents_pb2, memory_pb2, mental_models_pb2, operations_pb2, recall_pb2,
                      resources_pb2)

T0 = datetime(2024, 5, 20, 12, tzinfo=timezone.utc)


def pages(call, request) -> list:
    """Every response of a List RPC, page by page (each token taken back as issued)."""
    out = []
    while True:
        r = call(request)
        out.append(r)
        if not r.next_page_token:
            return out
        request.page_token = r.next_page_token


def refused_naming_page_token(call) -> None:
    with pytest.raises(grpc.RpcError) as e:
        call()
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT, e.value.details()
    assert [f for f, _ in field_violations(e.value)] == ["page_token"]


def test_tokens_of_the_longest_ids_and_tags_in_any_script_are_taken_back(m):
    lim = Limits()
    scripts = ("d", "\u4e2d", "\U0001f600")  # ASCII, CJK, emoji (4 bytes of UTF-8)
    ids = [c * (lim.id_chars - 1) + str(n) for c in scripts for n in range(2)]
    tags = [c * (lim.tag_chars - 1) + str(n) for c in scripts for n in range(2)]
    m.upsert_bank("long-ids")
    m.retain("long-ids", [{"content": f"Ana met Bo in Lisbon on day {i}.", "document_id": d,
                           "tags": [tags[i]], "timestamp": T0} for i, d in enumerate(ids)])
    docs = pages(m.documents.ListDocuments, documents_pb2.ListDocumentsRequest(
        parent="banks/long-ids", page_size=1))
    assert sorted(d.document_id for r in docs for d in r.documents) == sorted(ids)
    listed = pages(m.documents.ListTags, documents_pb2.ListTagsRequest(
        parent="banks/long-ids", page_size=1))
    assert sorted(t.tag for r in listed for t in r.tags) == sorted(tags)
    for d in (ids[1], ids[-1]):  # memories of the longest document ids, one per page
        mems = pages(m.recall_stub.ListMemories, memory_pb2.ListMemoriesRequest(
            parent="banks/long-ids", document_id=d, page_size=1))
        assert [x.document_id for r in mems for x in r.memories] and all(
            x.document_id == d for r in mems for x in r.memories)


def _names(r) -> list[str]:
    return [o.name for o in r.operations]


def test_operations_are_listed_once_while_others_come_and_go_between_pages(m):
    for b in ("ops-a", "ops-b"):
        m.upsert_bank(b)
    for i in range(4):
        m.retain("ops-a", [{"content": f"Ana read book {i}.", "timestamp": T0}])
    for i in range(2):
        m.retain("ops-b", [{"content": f"Bo read book {i}.", "timestamp": T0}])
    of_a = [o.name for o in m.list_operations("ops-a")]
    assert len(of_a) == 4

    # one bank: a retain between pages is listed first, and shifts nothing
    req = operations_pb2.ListOperationsRequest(parent="banks/ops-a", page_size=2)
    first = m.operations.ListOperations(req)
    m.retain("ops-a", [{"content": "Ana read one more book.", "timestamp": T0}])
    req.page_token = first.next_page_token
    seen = _names(first) + [n for r in pages(m.operations.ListOperations, req) for n in _names(r)]
    assert sorted(seen) == sorted(of_a)

    # every bank: the newest (ops-b's) on the first page, then ops-b deleted
    req = operations_pb2.ListOperationsRequest(page_size=2)
    first = m.operations.ListOperations(req)
    m.delete_bank("ops-b")
    req.page_token = first.next_page_token
    seen = _names(first) + [n for r in pages(m.operations.ListOperations, req) for n in _names(r)]
    assert len(seen) == len(set(seen)), seen
    assert set(of_a) <= set(seen)


def test_a_page_token_is_refused_with_other_filters(m):
    m.upsert_bank("filters")
    m.retain("filters", [{"content": f"Cleo planted tree {i} in the garden.", "timestamp": T0,
                          "document_id": "garden"} for i in range(3)])
    req = memory_pb2.ListMemoriesRequest(parent="banks/filters", page_size=1,
                                         document_id="garden")
    token = m.recall_stub.ListMemories(req).next_page_token
    assert token
    for other in (dict(document_id="orchard"),
                  dict(document_id="garden", types=[resources_pb2.WORLD])):
        refused_naming_page_token(lambda: m.recall_stub.ListMemories(
            memory_pb2.ListMemoriesRequest(parent="banks/filters", page_token=token, **other)))
    req.page_token = token
    assert m.recall_stub.ListMemories(req).memories  # the same filters: the next page

    for i in range(3):
        m.create_mental_model("filters", f"model {i}", f"What about tree {i}?", tags=["trees"])
    req = mental_models_pb2.ListMentalModelsRequest(parent="banks/filters", page_size=1,
                                                    tags=["trees"])
    token = m.mental_models.ListMentalModels(req).next_page_token
    assert token
    for other in (dict(tags=["bushes"]), dict(), dict(tags=["trees"], tags_match=recall_pb2.ALL)):
        refused_naming_page_token(lambda: m.mental_models.ListMentalModels(
            mental_models_pb2.ListMentalModelsRequest(parent="banks/filters", page_token=token,
                                                      **other)))
    req.page_token = token
    assert m.mental_models.ListMentalModels(req).mental_models
