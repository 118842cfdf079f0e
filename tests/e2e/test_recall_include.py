"""Recall's include options (Hindsight's recall ``include``) through a real ``mneme up``:
the entities the results mention with observations about them, and the stored text of the
documents they come from; off by default, within their own budgets, validated, and never
reaching outside the request's tag filter."""

from __future__ import annotations

import json
from datetime import datetime, timezone

import grpc
import pytest
from typer.testing import CliRunner

from mneme.cli import app
from mneme.client import field_violations, observation_scopes
from mneme.v1.resources_pb2 import OBSERVATION

T0 = datetime(2024, 3, 2, 9, 0, tzinfo=timezone.utc)


@pytest.fixture(scope="module")
def inc(m):
    """A bank of two scopes (tags alice, bob), one document each, a document whose two
    items are one of each, and an untagged document; consolidated per tag."""
    bank = "inc"
    m.upsert_bank(bank)
    r = m.retain(bank, [
        {"content": "Liz adopted a puppy named Biscuit.", "timestamp": T0,
         "document_id": "d-alice", "tags": ["alice"]},
        {"content": "Liz bought a red kayak in Lisbon.", "timestamp": T0,
         "document_id": "d-bob", "tags": ["bob"]},
        {"content": "Liz learned to sail on the Tagus.", "timestamp": T0,
         "document_id": "d-mixed", "tags": ["alice"]},
        {"content": "Liz keeps her sailing log secret from Biscuit's vet.", "timestamp": T0,
         "document_id": "d-mixed", "tags": ["bob"]},
        {"content": "Liz plays chess with Marco on Sundays.", "timestamp": T0,
         "document_id": "d-open"},
    ], observation_scopes=observation_scopes("per_tag"))
    assert r.operation.state == 3, r
    assert m.consolidate(bank).state == 3
    assert list(m.list_observations(bank)), "offline consolidation made no observations"
    return bank


def test_recall_returns_no_extras_unless_asked(m, inc):
    r = m.recall(inc, "What did Liz do?")
    assert r.results
    assert not r.entities and not r.documents


def test_include_entities_lists_the_results_entities_with_their_observations(m, inc):
    r = m.recall(inc, "What did Liz do?", include_entities=0)
    mentioned = [e.name for x in r.results for e in x.memory.entities]
    assert r.entities, r
    names = [e.display_name for e in r.entities]
    assert names[0] == mentioned[0] and "Liz" in names
    assert len(names) == len(set(names))
    liz = next(e for e in r.entities if e.display_name == "Liz")
    assert liz.entity.startswith(f"banks/{inc}/entities/") and liz.kind
    assert liz.observations, "the bank's observations about Liz"
    for e in r.entities:
        for o in e.observations:
            assert o.fact_type == OBSERVATION
            assert any(x.id == e.entity.rsplit("/", 1)[-1] for x in o.entities)
    assert sum(e.tokens for e in r.entities) <= 500


def test_include_entities_within_their_own_budget(m, inc):
    small = m.recall(inc, "What did Liz do?", include_entities=3)
    assert sum(e.tokens for e in small.entities) <= 3
    assert not any(e.observations for e in small.entities)
    # the results' own budget is apart from it
    assert [x.memory.id for x in small.results] == \
        [x.memory.id for x in m.recall(inc, "What did Liz do?").results]


@pytest.mark.parametrize("tag,other", [("alice", "bob"), ("bob", "alice")])
def test_tag_scoped_recall_returns_no_observation_or_document_of_another_scope(m, inc, tag, other):
    r = m.recall(inc, "What did Liz do?", tags=[tag], tags_match="any_strict",
                 include_entities=2000, include_documents=4000)
    assert r.results and all(tag in x.memory.tags for x in r.results)
    seen = [o for e in r.entities for o in e.observations]
    assert seen, r.entities
    assert all(tag in o.tags and other not in o.tags for o in seen), [(o.text, o.tags) for o in seen]
    docs = {d.document_id for d in r.documents}
    # d-mixed has an item of the other scope: its text is never shown to this one
    assert docs == {f"d-{tag}"}, docs


def test_tag_scoped_recall_in_any_mode_adds_only_untagged_ones(m, inc):
    # ANY lets untagged units through (shared by every scope): the untagged document may
    # come, the other scope's and the mixed one never
    r = m.recall(inc, "What did Liz do?", tags=["alice"], include_entities=2000,
                 include_documents=4000)
    assert {d.document_id for d in r.documents} == {"d-alice", "d-open"}
    seen = [o for e in r.entities for o in e.observations]
    assert seen and all("bob" not in o.tags for o in seen), [(o.text, o.tags) for o in seen]


def test_include_documents_returns_the_stored_text_of_the_results_documents(m, inc):
    r = m.recall(inc, "What did Liz do?", include_documents=0)
    by_id = {d.document_id: d for d in r.documents}
    from_results = {x.memory.document_id for x in r.results}
    assert set(by_id) == from_results == {"d-alice", "d-bob", "d-mixed", "d-open"}
    for d in r.documents:
        assert not d.truncated
        assert d.text == m.get_document(inc, d.document_id).original_text
        assert d.document == f"banks/{inc}/documents/{d.document_id}"
        assert set(d.memories) == {x.memory.name for x in r.results
                                   if x.memory.document_id == d.document_id}
    assert by_id["d-mixed"].text == ("Liz learned to sail on the Tagus.\n\n"
                                     "Liz keeps her sailing log secret from Biscuit's vet.")
    # no tag filter: every document; a small budget cuts the first and stops
    r = m.recall(inc, "What did Liz do?", include_documents=4)
    assert len(r.documents) == 1 and r.documents[0].truncated
    assert 0 < r.documents[0].tokens <= 4
    full = m.get_document(inc, r.documents[0].document_id).original_text
    assert full.startswith(r.documents[0].text) and len(r.documents[0].text) < len(full)


def test_include_documents_skips_documents_whose_text_is_not_stored(m):
    bank = "nodocs"
    m.upsert_bank(bank, store_documents=False)
    r = m.retain(bank, [{"content": "Liz adopted a puppy named Biscuit.", "timestamp": T0,
                         "document_id": "d1"}])
    assert r.operation.state == 3
    r = m.recall(bank, "Liz puppy", include_documents=0)
    assert r.results and not r.documents


@pytest.mark.parametrize("kw,field", [
    ({"include_entities": -1}, "include.entities.max_tokens"),
    ({"include_documents": -5}, "include.documents.max_tokens"),
    ({"include_entities": 8193}, "include.entities.max_tokens"),
    ({"include_documents": 65537}, "include.documents.max_tokens"),
])
def test_bad_include_budgets_are_invalid_argument_naming_the_field(m, inc, kw, field):
    with pytest.raises(grpc.RpcError) as e:
        m.recall(inc, "Liz", **kw)
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert [v[0] for v in field_violations(e.value)] == [field]


def test_cli_recall_includes(server, inc):
    out = CliRunner().invoke(app, ["recall", inc, "What did Liz do?", "--include-entities", "0",
                                   "--include-documents", "0", "--json", "-a", server.address])
    assert out.exit_code == 0, out.output
    got = json.loads(out.stdout)
    assert got["entities"] and got["documents"]
    out = CliRunner().invoke(app, ["recall", inc, "What did Liz do?", "--include-entities", "-1",
                                   "-a", server.address])
    assert out.exit_code != 0
