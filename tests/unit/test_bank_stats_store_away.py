"""``mneme banks stats BANK`` is the Runbook's first inspection: it must answer while a
store does not, with that store's count unknown (-1, printed n/a) and the consumer lag,
which is what shows the work held back."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import redis.exceptions

from services.ingest.stats import bank_stats


class _Log:
    def partitions(self, topic):
        return 1

    def end_offset(self, topic, p):
        return 7

    def committed(self, group, topic, p):
        return 5


class _Catalog:
    def count_operations(self, bank_id):
        return 3, 2


class _Vectors:
    def count(self, bank_id, filters):
        return 4


class _GraphAway:
    def count_entities(self, bank_id):
        raise redis.exceptions.TimeoutError("Timeout reading from socket")


def test_stats_answer_with_the_lag_while_the_graph_store_does_not():
    """With the embedded graph server stopped, GetBankStats failed as a whole (UNKNOWN,
    then UNAVAILABLE): the operator lost the lag that shows the search group held back."""
    stores = SimpleNamespace(vectors=_Vectors(), graph=_GraphAway())
    stats = bank_stats("b1", log=_Log(), catalog=_Catalog(),
                       groups={"search": ["mneme.memory.v1"]}, stores=stores)
    assert stats["entities"] == -1
    assert stats["facts"] == 4 and stats["pending_operations"] == 2
    assert stats["lag"] == [("search", "mneme.memory.v1", 0, 2)]


def test_any_other_store_failure_still_fails_the_call():
    class _Broken:
        def count_entities(self, bank_id):
            raise RuntimeError("a bug")
    stores = SimpleNamespace(vectors=_Vectors(), graph=_Broken())
    with pytest.raises(RuntimeError):
        bank_stats("b1", log=_Log(), catalog=_Catalog(), groups={}, stores=stores)
