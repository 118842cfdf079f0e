"""The Python SDK refuses arguments it would otherwise send as something else, naming
the argument, before any call: no server is needed (the channel is never used)."""

from __future__ import annotations

from datetime import datetime, timezone

import pytest

from mneme.client import MnemeClient

T0 = datetime(2024, 5, 20, 12, tzinfo=timezone.utc)


@pytest.fixture
def m():
    with MnemeClient("127.0.0.1:9", timeout=1) as c:  # nothing listens: no call may be made
        yield c


@pytest.mark.parametrize("item, named", [
    ({"contnet": "Alice likes tea."}, r"items\[0\]: unknown key 'contnet'"),
    ({"content": "a", "timestmap": T0}, r"items\[0\]: unknown key 'timestmap'"),
    ({"context": "c"}, r"items\[0\]\.content: required"),
    ({"content": "a", "timestamp": "2024-01-01"}, r"items\[0\]\.timestamp: a datetime"),
    ({"content": "a", "timestamp": 1_700_000_000}, r"items\[0\]\.timestamp: a datetime"),
    ({"content": "a", "tags": "music"}, r"items\[0\]\.tags: a list of strings"),
    ({"content": "a", "metadata": [("k", "v")]}, r"items\[0\]\.metadata: a mapping"),
])
def test_a_retain_item_that_would_be_sent_as_something_else_is_refused(m, item, named):
    """A misspelt key was dropped (the item stored without its timestamp or document), a
    string timestamp was dropped (the item dated "now"), a string of tags became one tag
    per character, and a missing content was a bare KeyError."""
    with pytest.raises((ValueError, TypeError), match=named):
        m.retain("b", [{"content": "fine", "timestamp": T0}, item][1:])


@pytest.mark.parametrize("call, named", [
    (lambda m: m.recall("b", "q", budget="huge"), r"budget: 'huge' is not one of low, mid, high"),
    (lambda m: m.recall("b", "q", types=["facts"]), r"types\[0\]: 'facts' is not one of world"),
    (lambda m: m.recall("b", "q", tags_match="some"), r"tags_match: 'some' is not one of any"),
    (lambda m: m.recall("b", "q", tags="music"), r"tags: a list of strings"),
    (lambda m: m.recall("b", "q", query_timestamp="yesterday"), r"query_timestamp: a datetime"),
    (lambda m: m.reflect("b", "q", budget="max"), r"budget: 'max' is not one of"),
    (lambda m: m.reflect("b", "q", tags="music"), r"tags: a list of strings"),
    (lambda m: m.create_directive("b", "Be brief.", tags="x"), r"tags: a list of strings"),
    (lambda m: list(m.list_observations("b", scope="work")), r"scope: a list of strings"),
    (lambda m: list(m.list_mental_models("b", tags_match="most")), r"tags_match: .most. is not"),
    (lambda m: m.batch_get_data_keys("b", "d:doc#1"), r"key_ids: a list of strings"),
    (lambda m: m.split_entity("b", "e", "Liz", aliases="liz"), r"aliases: a list of strings"),
])
def test_sdk_arguments_of_the_wrong_kind_are_refused_naming_them(m, call, named):
    with pytest.raises((ValueError, TypeError), match=named):
        call(m)
