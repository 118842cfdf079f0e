"""Narrow in-memory fakes for handler tests: an embedder, an extractor and the three
search projections (vector, text, graph).

The store fakes keep units in dicts and record every write, enough for the projection
handlers (upsert, delete, delete_where, get, count); they do not search. The complete
state-port fakes (catalog, observations, entities) are :mod:`mneme.stores.memory`.
"""

from __future__ import annotations

import copy
import hashlib
from dataclasses import replace
from typing import Sequence

from mneme.domain import EntityInfo, Fact, RetainItem, derive_id
from services.search.handlers import Projections


class FakeEmbedder:
    """:class:`mneme.ports.Embedder`: a deterministic unit vector of ``dim`` floats per
    text (from its SHA-256), so equal texts embed equally. ``calls`` records each batch."""

    def __init__(self, dim: int = 4, model_name: str = "fake-embedder") -> None:
        self.dim, self.model_name = dim, model_name
        self.calls: list[list[str]] = []

    def embed(self, texts: Sequence[str]) -> list[list[float]]:
        self.calls.append(list(texts))
        out = []
        for t in texts:
            h = hashlib.sha256(t.encode()).digest()
            v = [b / 255.0 + 0.01 for b in h[:self.dim]]
            n = sum(x * x for x in v) ** 0.5
            out.append([x / n for x in v])
        return out


class FakeExtractor:
    """An extractor (``extract_many`` / ``extract``) yielding one fact per item, its text
    the item's content, id ``derive_id(source_id, item_index, 0)`` (as the offline
    extractor derives them), ``item_index`` local to the items it is given.

    ``incomplete``: item indexes (local) that fail inside ``extract_many`` with an
    ``ExtractionIncomplete``; ``batch_error``: an exception ``extract_many`` raises (the
    handler then asks item by item); ``item_errors``: local index → exception ``extract``
    raises; ``no_facts``: local indexes that yield nothing (reported by :meth:`report`
    when ``reporting``). Every call is recorded in ``calls``."""

    def __init__(self, *, incomplete: Sequence[int] = (), batch_error: Exception | None = None,
                 item_errors: dict[int, Exception] | None = None, no_facts: Sequence[int] = (),
                 reporting: bool = False, usage=None) -> None:
        self.incomplete, self.batch_error = set(incomplete), batch_error
        self.item_errors = dict(item_errors or {})
        self.no_facts, self.reporting, self.usage = set(no_facts), reporting, usage
        self.calls: list[tuple] = []

    def _fact(self, bank_id: str, item: RetainItem, i: int, source_id: str) -> Fact:
        return Fact(id=derive_id(source_id, i, 0), bank_id=bank_id, text=item.content,
                    mentioned_at=item.timestamp, tags=item.tags, document_id=item.document_id,
                    item_index=i)

    def extract_many(self, bank_id: str, items: Sequence[RetainItem], source_id: str,
                     first_index: int = 0, stop=None) -> list[Fact]:
        """As the LLM extractor: ``stop()`` is asked before each item; once true, the
        items left fail with reason "cancelled"."""
        from services.extraction.llm import CANCELLED, ExtractionIncomplete, ItemExtractionFailed
        self.calls.append(("extract_many", bank_id, list(items), source_id))
        if self.batch_error is not None:
            raise self.batch_error
        failures, facts = {}, []
        for i, it in enumerate(items):
            if stop is not None and stop():
                failures[i] = ItemExtractionFailed(i, CANCELLED, "cancelled")
            elif i in self.incomplete:
                failures[i] = ItemExtractionFailed(i, "invalid_output", f"item {i} unparseable")
            elif i not in self.no_facts:
                facts.append(self._fact(bank_id, it, first_index + i, source_id))
        if failures:
            raise ExtractionIncomplete(facts, failures)
        return facts

    def extract(self, bank_id: str, item: RetainItem, item_index: int,
                source_id: str) -> list[Fact]:
        self.calls.append(("extract", bank_id, item, item_index, source_id))
        if item_index in self.item_errors:
            raise self.item_errors[item_index]
        return [] if item_index in self.no_facts else [
            self._fact(bank_id, item, item_index, source_id)]

    def report(self, source_id: str):
        """An ExtractionReport of the last request (None unless ``reporting``)."""
        if not self.reporting:
            return None
        from mneme.llm.gateway import Usage
        from services.extraction.llm import ExtractionReport
        return ExtractionReport(no_fact_items=sorted(self.no_facts),
                                usage=self.usage or Usage())


class FakeStore:
    """One projection (vector, text or graph) in a dict: bank → id → Fact.

    ``fail``: an operation name ("upsert", "delete", "delete_where") that raises
    RuntimeError — after writing, for "upsert", as a store that wrote a batch before
    failing. ``calls`` records (operation, bank_id, ids or document_id)."""

    def __init__(self, kind: str, fail: str | None = None) -> None:
        self.kind, self.fail = kind, fail
        self.units: dict[str, dict[str, Fact]] = {}
        self.calls: list[tuple] = []

    def _maybe_fail(self, op: str) -> None:
        if self.fail == op:
            raise RuntimeError(f"{self.kind} store: {op} failed")

    def upsert(self, facts: Sequence[Fact]) -> None:
        self.calls.append(("upsert", tuple(f.bank_id for f in facts), [f.id for f in facts]))
        for f in facts:
            self.units.setdefault(f.bank_id, {})[f.id] = copy.deepcopy(f)
        self._maybe_fail("upsert")

    def delete(self, bank_id: str, ids: Sequence[str]) -> None:
        self.calls.append(("delete", bank_id, list(ids)))
        self._maybe_fail("delete")
        for i in ids:
            self.units.get(bank_id, {}).pop(i, None)

    def delete_where(self, bank_id: str, document_id: str | None = None) -> list[str]:
        self.calls.append(("delete_where", bank_id, document_id))
        self._maybe_fail("delete_where")
        bank = self.units.get(bank_id, {})
        gone = [i for i, f in bank.items() if document_id is None or f.document_id == document_id]
        for i in gone:
            del bank[i]
        return gone

    def get(self, bank_id: str, ids: Sequence[str], with_vectors: bool = False) -> list[Fact]:
        bank = self.units.get(bank_id, {})
        return [copy.deepcopy(bank[i]) if with_vectors else replace(bank[i], embedding=[])
                for i in ids if i in bank]

    def ids(self, bank_id: str) -> set[str]:
        return set(self.units.get(bank_id, {}))

    def scroll(self, bank_id: str, limit: int, after: str | None = None, filters=None
               ) -> tuple[list[Fact], str | None]:
        """The bank's units by id after ``after``, ``limit`` at a time (as the ports say)."""
        from mneme.stores.filters import fact_matches
        ids = sorted(i for i, f in self.units.get(bank_id, {}).items()
                     if (after is None or i > after)
                     and (filters is None or fact_matches(f, filters)))
        page = [replace(self.units[bank_id][i], embedding=[]) for i in ids[:limit]]
        return page, (page[-1].id if len(ids) > limit else None)

    def count(self, bank_id: str, filters=None) -> int:
        from mneme.stores.filters import fact_matches
        return sum(1 for f in self.units.get(bank_id, {}).values()
                   if filters is None or fact_matches(f, filters))

    def count_entities(self, bank_id: str) -> int:
        return len({e.id for f in self.units.get(bank_id, {}).values() for e in f.entities})

    def entity(self, bank_id: str, entity_id: str, units: int = 100,
               neighbours: int = 20) -> EntityInfo | None:
        """The entity as its units name it (no aliases, no neighbours), or None when no
        unit of the bank mentions it."""
        ids = [f.id for f in self.units.get(bank_id, {}).values()
               if any(e.id == entity_id for e in f.entities)]
        if not ids:
            return None
        name = next(e.name for f in self.units[bank_id].values() for e in f.entities
                    if e.id == entity_id)
        return EntityInfo(entity_id, name, mentions=len(ids), units=tuple(ids[:units]))

    def merge_entities(self, bank_id: str, survivor_id: str, merged_ids, display_name="") -> None:
        """Recorded in ``calls``: the graph's part of an entity merge."""
        self.calls.append(("merge_entities", bank_id, survivor_id, tuple(merged_ids)))

    def split_entity(self, bank_id: str, entity_id: str, new_id: str, aliases, display_name,
                     unit_ids) -> None:
        """Recorded in ``calls``: the graph's part of an entity split."""
        self.calls.append(("split_entity", bank_id, entity_id, new_id, tuple(unit_ids)))

    def reset(self) -> None:
        self.units.clear()

    def flush(self) -> None:
        self.flushes = getattr(self, "flushes", 0) + 1  # not in ``calls``: runners flush

    def close(self) -> None:
        pass


def fake_projections(fail: dict[str, str] | None = None) -> Projections:
    """search's :class:`Projections` over three :class:`FakeStore`; ``fail`` maps a kind
    ("vector", "text", "graph") to the operation that fails in it."""
    fail = fail or {}
    return Projections(*(FakeStore(k, fail.get(k)) for k in ("vector", "text", "graph")))


__all__ = ["FakeEmbedder", "FakeExtractor", "FakeStore", "fake_projections"]
