"""A user's corrections of entity resolution (EntityService.MergeEntities, SplitEntity).

search serves them because it holds what they are checked against (the graph: which
entities exist, their aliases and memories; the vector store: the memories' text). A
checked correction is appended to ``mneme.intake.v1`` (``EntityMergeRequested`` /
``EntitySplitRequested``, keyed by bank, names sealed under the bank's key); extraction
applies it to its resolver (later mentions of the names resolve to the corrected entity)
and passes it on to ``mneme.memory.v1`` in order with the facts, where search's graph
projection applies it. The call returns once this process's graph holds it, so the
answer is read after the change (read-your-writes); replay applies it again from the log.

Ids: the operation id is new per call; the entity a split creates has an id derived from
it (``derive_id("entity-split", bank, operation)``), so redelivery and replay give it the
same id.
"""

from __future__ import annotations

import contextlib
import uuid
from dataclasses import dataclass
from typing import Callable, ContextManager, Sequence

from mneme.domain import EntityInfo, derive_id, entity_key
from mneme.errors import InvalidArgument, NotFound
from mneme.events.v1 import events_pb2 as ev
from mneme.ports import GraphStore, Record, VectorStore

#: Most entities one merge names.
MAX_MERGE = 100
#: Most aliases, and memories, one split moves (memories: the API's bound of any list,
#: ``MNEME_LIMIT_LIST_ENTRIES``, refuses more before this; kept for other callers).
MAX_ALIASES = 100
MAX_MEMORIES = 256
#: Longest display name (characters).
MAX_NAME = 200
#: Most memories of one entity a split looks at (for those naming a moved alias).
SPLIT_SCAN = 10_000
_GET_BATCH = 500


def _check_name(name: str, field: str, required: bool) -> str:
    name = " ".join((name or "").split())
    if not name:
        if required:
            raise InvalidArgument(field, "required")
        return ""
    if len(name) > MAX_NAME:
        raise InvalidArgument(field, f"at most {MAX_NAME} characters")
    if not entity_key(name):
        raise InvalidArgument(field, "must contain a letter or digit")
    return name


def _require(graph: GraphStore, bank_id: str, entity_id: str, units: int = 0) -> EntityInfo:
    got = graph.entity(bank_id, entity_id, units=units, neighbours=0)
    if got is None:
        raise NotFound(f"entity {entity_id!r} not found in bank {bank_id!r}")
    return got


def _names(text: str, key: str) -> bool:
    """True when ``text`` names ``key`` (an entity key) as whole words."""
    return f" {key} " in f" {entity_key(text)} "


@dataclass
class EntityCorrections:
    """The write side of EntityService. ``append(message, bank_id)`` appends an event to
    the intake topic and returns its record; ``projected(record, bank_id, timeout)``
    returns once this process's graph has applied what the record caused (raises
    DeadlineExceeded after ``timeout`` seconds: the change is on the log and applies
    later)."""

    append: Callable[[object, str], Record]
    projected: Callable[[Record, str, float], None]
    #: ``slot(bank_id)``: a context manager held from the append to the end of the wait, one
    #: of the process's waiting calls (:meth:`mneme.slots.WaitSlots.hold`: raises
    #: ResourceExhausted, before anything is appended, when all are taken).
    slot: Callable[[str], ContextManager] = contextlib.nullcontext

    def _append_and_wait(self, msg, bank_id: str, timeout: float) -> None:
        with self.slot(bank_id):
            self.projected(self.append(msg, bank_id), bank_id, timeout)

    def merge(self, graph: GraphStore, bank_id: str, entity_ids: Sequence[str],
              display_name: str, timeout: float) -> EntityInfo:
        """Merge the entities ``entity_ids`` (from request field ``entities``, already
        parsed; the first survives) and rename the survivor to ``display_name`` (""
        keeps its name). Returns the survivor as read after the change. InvalidArgument
        naming ``entities``/``entities[i]``/``display_name``; NotFound for an unknown
        entity."""
        if len(entity_ids) < 2:
            raise InvalidArgument("entities", "name at least 2 entities to merge")
        if len(entity_ids) > MAX_MERGE:
            raise InvalidArgument("entities", f"at most {MAX_MERGE} entities per merge")
        seen: dict[str, int] = {}
        for i, e in enumerate(entity_ids):
            if e in seen:
                raise InvalidArgument(f"entities[{i}]", f"the same entity as entities[{seen[e]}]"
                                      " (an entity cannot be merged with itself)")
            seen[e] = i
        name = _check_name(display_name, "display_name", required=False)
        for e in entity_ids:
            _require(graph, bank_id, e)
        msg = ev.EntityMergeRequested(bank_id=bank_id, operation_id=str(uuid.uuid4()),
                                      survivor_id=entity_ids[0], merged_ids=entity_ids[1:],
                                      display_name=name)
        self._append_and_wait(msg, bank_id, timeout)
        return _require(graph, bank_id, entity_ids[0], units=100)

    def split(self, graph: GraphStore, vectors: VectorStore, bank_id: str, entity_id: str,
              aliases: Sequence[str], memory_ids: Sequence[tuple[str, str]],
              display_name: str, timeout: float) -> tuple[EntityInfo, EntityInfo]:
        """Split a new entity named ``display_name`` off ``entity_id``: it takes the
        ``aliases`` (names; normalised to keys) with the entity's memories whose text names
        a moved alias and no alias the entity keeps, and the memories ``memory_ids``
        ([(request field, memory id)]). Returns (the entity, the new entity) as read after
        the change. InvalidArgument naming ``aliases``/``aliases[i]``/``memories[i]``/
        ``display_name``; NotFound for an unknown entity."""
        name = _check_name(display_name, "display_name", required=True)
        if not aliases and not memory_ids:
            raise InvalidArgument("aliases", "give aliases or memories to move to the new entity")
        if len(aliases) > MAX_ALIASES:
            raise InvalidArgument("aliases", f"at most {MAX_ALIASES}")
        if len(memory_ids) > MAX_MEMORIES:
            raise InvalidArgument("memories", f"at most {MAX_MEMORIES}")
        e = _require(graph, bank_id, entity_id, units=SPLIT_SCAN)
        moved: list[str] = []
        for i, a in enumerate(aliases):
            k = entity_key(a or "")
            if not k:
                raise InvalidArgument(f"aliases[{i}]", "must contain a letter or digit")
            if k not in e.aliases:
                raise InvalidArgument(f"aliases[{i}]", f"{k!r} is not an alias of entity "
                                      f"{entity_id!r} (its aliases: {', '.join(e.aliases)})")
            if k not in moved:
                moved.append(k)
        kept = [a for a in e.aliases if a not in moved]
        if moved and not kept:
            raise InvalidArgument("aliases", "the entity must keep at least one of its aliases")
        units = set(e.units)
        chosen: list[str] = []
        for field, m in memory_ids:
            if m not in units:
                raise InvalidArgument(field, f"memory {m!r} does not mention entity {entity_id!r}")
            if m not in chosen:
                chosen.append(m)
        if moved:
            for i in range(0, len(e.units), _GET_BATCH):
                for f in vectors.get(bank_id, list(e.units[i:i + _GET_BATCH])):
                    if (f.id not in chosen and any(_names(f.text, k) for k in moved)
                            and not any(_names(f.text, k) for k in kept)):
                        chosen.append(f.id)
        op = str(uuid.uuid4())
        new_id = derive_id("entity-split", bank_id, op)
        msg = ev.EntitySplitRequested(bank_id=bank_id, operation_id=op, entity_id=entity_id,
                                      new_entity_id=new_id, aliases=moved, memory_ids=chosen,
                                      display_name=name)
        self._append_and_wait(msg, bank_id, timeout)
        return (_require(graph, bank_id, entity_id, units=100),
                _require(graph, bank_id, new_id, units=100))
