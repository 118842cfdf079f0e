"""Mental models: named, user-curated standing answers of a bank, kept by reflect.

Every change is a ``MentalModelChanged`` event on ``mneme.intake.v1`` (keyed by bank, so in
order with the bank's creation and deletion). Every bank catalog projects it, and
:mod:`mneme.bank_catalog` keeps each content change as a revision.

- **Refresh.** A refresh runs reflect on the model's ``source_query`` within its tags: the
  reflect model's agent, or the extractive answer without one. The event records the
  answer and the memory ids it cites, so replay rebuilds models and history without a model
  call.
- **Staleness** is read from the log. The event records where the bank's partition of
  ``mneme.memory.v1`` ended when the content was made. A model is stale once a later record
  of that partition changes a fact or observation of its bank in its scope: untagged models
  see every change, tagged ones those on untagged units or units sharing a tag, and any
  retraction. Replay rebuilds the same offsets, so staleness survives it.
- **Scheduled refreshes.** The group ``reflect-refresh`` follows ``mneme.memory.v1`` and
  refreshes the models whose policy is due (:meth:`refresh_due`). It is not a projection:
  replay does not run it, and the refreshes it made are on the log already.
- **Reflect.** These models feed reflect's ``search_mental_models`` tool (:meth:`search`).
  Offline, a fresh model whose query covers the question answers it
  (:meth:`answer_offline`).
"""

from __future__ import annotations

import logging
import uuid
from dataclasses import dataclass, replace
from datetime import datetime
from typing import Callable, Iterable, Sequence

from mneme.domain import (MENTAL_MODEL_FIELDS, REFRESH_POLICIES, MentalModel, MentalModelRevision,
                          Memory, from_epoch)
from mneme.errors import InvalidArgument, NotFound
from mneme.events.v1 import events_pb2 as ev
from mneme.ports import Catalog, Record
from services.reflect.handlers import Reflection, content_terms

log = logging.getLogger(__name__)

#: Records of the bank's memory partition a staleness check reads at most; beyond it the
#: model counts as stale (many changes since its refresh in any case).
STALE_SCAN = 10_000
#: A model's content when ``max_tokens`` is 0, in tokens (~4 characters each).
DEFAULT_MAX_TOKENS = 2_048
#: Share of a question's content words a fresh model's name and query must cover for the
#: offline reflect to answer with it.
OFFLINE_COVERAGE = 0.6


def _cut(text: str, max_tokens: int) -> str:
    """``text`` cut to about ``max_tokens`` tokens (4 characters each) at a line or word."""
    limit = 4 * (max_tokens or DEFAULT_MAX_TOKENS)
    if len(text) <= limit:
        return text
    cut = text[:limit]
    at = max(cut.rfind("\n"), cut.rfind(" "))
    return (cut[:at] if at > limit // 2 else cut).rstrip() + " …"


@dataclass
class MentalModels:
    """The MentalModelService's operations over ports.

    ``catalog`` is this process's bank catalog. ``append(message, bank_id)`` appends an
    event and returns its record. ``projected(record, bank_id)`` waits until
    ``catalog`` has handled the record (read-your-writes). ``caught_up(bank_id)`` brings
    ``catalog`` up to the bank's partition before a read. ``reflect`` is
    :meth:`services.reflect.handlers.Reflector.reflect`. ``memory_end(bank_id)`` is the end
    offset of the bank's ``mneme.memory.v1`` partition, and ``memory_read(bank_id, start,
    limit)`` the (offset, decoded message) pairs of that partition from ``start``."""

    catalog: Catalog
    append: Callable[[object, str], Record]
    projected: Callable[[Record, str], None]
    caught_up: Callable[[str], object]
    reflect: Callable[..., Reflection]
    memory_end: Callable[[str], int]
    memory_read: Callable[[str, int, int], list[tuple[int, object]]]

    # ---- reads ----

    def require_bank(self, bank_id: str) -> None:
        """NotFound unless the bank exists (this catalog caught up with it first)."""
        self.caught_up(bank_id)
        if self.catalog.get_bank(bank_id) is None:
            raise NotFound(f"bank {bank_id!r} not found")

    def get(self, bank_id: str, model_id: str) -> MentalModel:
        """The model; NotFound for an unknown bank or model."""
        self.require_bank(bank_id)
        m = self.catalog.get_mental_model(bank_id, model_id)
        if m is None:
            raise NotFound(f"mental model {model_id!r} not found in bank {bank_id!r}")
        return m

    def list(self, bank_id: str, limit: int, after: str = "",
             tags: Sequence[str] = ()) -> list[MentalModel]:
        """Up to ``limit`` models with ids after ``after``, in id order; with ``tags``,
        those sharing one of them (untagged models too)."""
        self.require_bank(bank_id)
        out: list[MentalModel] = []
        while len(out) < limit:
            page = self.catalog.list_mental_models(bank_id, limit, after)
            out += [m for m in page if not tags or not m.tags or set(m.tags) & set(tags)]
            if len(page) < limit:
                break
            after = page[-1].id
        return out[:limit]

    def history(self, bank_id: str, model_id: str) -> list[MentalModelRevision]:
        """Every revision of the model's content, oldest first."""
        self.get(bank_id, model_id)
        return self.catalog.mental_model_revisions(bank_id, model_id)

    def is_stale(self, m: MentalModel) -> bool:
        """True when a fact or observation in the model's scope changed after its content
        was made (see the module docstring)."""
        return m.id in self.stale_ids([m])

    def stale_ids(self, models: Sequence[MentalModel]) -> set[str]:
        """The ids of the stale ones among ``models`` (all of one bank), from one read of
        the bank's memory partition (from the oldest of their offsets)."""
        if not models:
            return set()
        bank_id = models[0].bank_id
        end = self.memory_end(bank_id)
        pending = [m for m in models if m.memory_offset < end]
        out = {m.id for m in pending if end - m.memory_offset > STALE_SCAN}
        pending = [m for m in pending if m.id not in out]
        if not pending:
            return out
        start = min(m.memory_offset for m in pending)
        for offset, msg in self.memory_read(bank_id, start, end - start):
            if getattr(msg, "bank_id", None) != bank_id:
                continue
            for m in pending:
                if m.id not in out and offset >= m.memory_offset and _in_scope(msg, m.tags):
                    out.add(m.id)
            if len(out) == len(models):
                break
        return out

    # ---- writes ----

    def create(self, m: MentalModel, timeout: float) -> MentalModel:
        """A new model (the server picks its id). InvalidArgument naming
        ``mental_model.<field>`` for an empty name or query, a bad policy or a negative
        number."""
        self.require_bank(m.bank_id)
        _check(m, MENTAL_MODEL_FIELDS)
        m = replace(m, id=str(uuid.uuid4()))
        msg = _event(m, ())
        msg.memory_offset = self.memory_end(m.bank_id)
        self.projected(self.append(msg, m.bank_id), m.bank_id)
        return self.get(m.bank_id, m.id)

    def update(self, m: MentalModel, paths: Sequence[str], timeout: float) -> MentalModel:
        """Change the fields ``paths`` (some of :data:`~mneme.domain.MENTAL_MODEL_FIELDS`:
        :func:`mneme.apiconv.update_paths`); InvalidArgument naming
        ``mental_model.<field>`` for a bad value."""
        self.get(m.bank_id, m.id)
        paths = [p for p in MENTAL_MODEL_FIELDS if p in paths]
        _check(m, paths)
        self.projected(self.append(_event(m, paths), m.bank_id), m.bank_id)
        return self.get(m.bank_id, m.id)

    def delete(self, bank_id: str, model_id: str) -> None:
        """Delete the model and its history; NotFound when unknown."""
        self.get(bank_id, model_id)
        rec = self.append(ev.MentalModelChanged(bank_id=bank_id, id=model_id, deleted=True),
                          bank_id)
        self.projected(rec, bank_id)

    def refresh(self, bank_id: str, model_id: str, now: datetime, budget: str = "mid",
                dry_run: bool = False) -> tuple[MentalModel, Reflection]:
        """Answer the model's ``source_query`` again (within its tags) and store the answer
        as its new content (cut to ``max_tokens``) with the ids it cites; with
        ``dry_run`` store nothing. Returns (the model as it is, or would be, after it; the
        reflection)."""
        m = self.get(bank_id, model_id)
        start = self.memory_end(bank_id)  # changes while it runs count as after it
        r = self.reflect(bank_id, m.source_query, "", budget, now, None, m.tags,
                         mental_models=False)
        content = _cut(r.text, m.max_tokens)
        source = "refresh_offline" if r.extractive else "refresh"
        if dry_run:
            return replace(m, content=content, based_on=tuple(r.based_on)), r
        msg = ev.MentalModelChanged(bank_id=bank_id, id=model_id, content=content,
                                    update_mask=["content"], memory_offset=start,
                                    refresh=ev.MentalModelRefresh(based_on=r.based_on,
                                                                  source=source))
        self.projected(self.append(msg, bank_id), bank_id)
        return self.get(bank_id, model_id), r

    # ---- scheduled refreshes ----

    def new_facts(self, m: MentalModel, limit: int = STALE_SCAN) -> int:
        """Facts of the model's bank in its scope extracted since its content was made
        (counted on the bank's memory partition, at most ``limit`` records read)."""
        end = self.memory_end(m.bank_id)
        if end <= m.memory_offset:
            return 0
        wanted, n = set(m.tags), 0
        for _, msg in self.memory_read(m.bank_id, m.memory_offset,
                                       min(limit, end - m.memory_offset)):
            if isinstance(msg, ev.FactsExtracted) and msg.bank_id == m.bank_id:
                n += sum(1 for f in msg.facts
                         if not wanted or not f.tags or set(f.tags) & wanted)
        return n

    def refresh_due(self, bank_id: str, consolidated: bool, now: datetime) -> list[str]:
        """Refresh the bank's models whose policy is due: ``after_consolidation`` when
        ``consolidated`` (an observation changed) and the model is stale, ``every_n_facts``
        once ``refresh_every`` facts in its scope arrived since its content was made.
        Returns the ids refreshed. A model that fails to refresh is logged and left as it
        was (the next change tries again)."""
        done = []
        after = ""
        while True:
            page = self.catalog.list_mental_models(bank_id, 500, after)
            for m in page:
                due = ((m.refresh_policy == "after_consolidation" and consolidated
                        and self.is_stale(m))
                       or (m.refresh_policy == "every_n_facts" and m.refresh_every > 0
                           and self.new_facts(m) >= m.refresh_every))
                if not due:
                    continue
                try:
                    self.refresh(bank_id, m.id, now)
                    done.append(m.id)
                except Exception:  # noqa: BLE001 - one model's failure must not stop the rest
                    log.exception("mental model %s of bank %s: scheduled refresh failed",
                                  m.id, bank_id)
            if len(page) < 500:
                return done
            after = page[-1].id

    # ---- reflect's uses ----

    def _ranked(self, bank_id: str, query: str) -> list[tuple[float, MentalModel]]:
        self.caught_up(bank_id)
        q = content_terms(query)
        if not q:
            return []
        scored = []
        after = ""
        while True:
            page = self.catalog.list_mental_models(bank_id, 500, after)
            for m in page:
                if not m.content.strip():
                    continue
                head = content_terms(f"{m.display_name} {m.source_query}")
                body = content_terms(m.content)
                score = len(q & head) / len(q) + 0.5 * len(q & body) / len(q)
                if score > 0:
                    scored.append((score, m))
            if len(page) < 500:
                break
            after = page[-1].id
        scored.sort(key=lambda p: (-p[0], p[1].id))
        return scored

    def search(self, bank_id: str, query: str, now: datetime, limit: int) -> list[Memory]:
        """The agent's ``search_mental_models``: models whose name, query or content share
        words with ``query``, best first, each marked stale or fresh."""
        hits = [m for _, m in self._ranked(bank_id, query)[:limit]]
        stale = self.stale_ids(hits)
        out = []
        for m in hits:
            state = ("STALE: verify it against observations and facts" if m.id in stale
                     else "fresh")
            out.append(Memory(m.id, f"{m.display_name} ({state}; answers \"{m.source_query}\"): "
                              f"{m.content}", "mental_model",
                              from_epoch(m.refreshed_at or m.updated_at)))
        return out

    def answer_offline(self, bank_id: str, query: str, tags: Sequence[str] = ()
                       ) -> Reflection | None:
        """The extractive reflect's first step: a fresh model (in scope of ``tags``) whose
        name and query cover :data:`OFFLINE_COVERAGE` of the question's content words
        answers it, citing itself; None otherwise."""
        q = content_terms(query)
        if not q:
            return None
        for _, m in self._ranked(bank_id, query):
            if tags and m.tags and not set(m.tags) & set(tags):
                continue
            covered = len(q & content_terms(f"{m.display_name} {m.source_query}")) / len(q)
            if covered < OFFLINE_COVERAGE:
                return None  # ranked: the next ones cover less
            if self.is_stale(m):
                continue
            return Reflection(f"{m.content}\n(from the mental model \"{m.display_name}\", "
                              "extractive answer, no language model configured)",
                              [m.id], True, kinds={m.id: "mental_model"})
        return None


def _in_scope(msg, tags: Sequence[str]) -> bool:
    """True when memory event ``msg`` changes a unit in the scope ``tags`` (untagged: any
    scope; untagged units: every scope) or retracts any."""
    if isinstance(msg, ev.FactsRetracted):
        return True
    if isinstance(msg, ev.FactsExtracted):
        sets = [set(f.tags) for f in msg.facts]
    elif isinstance(msg, ev.ObservationsChanged):
        sets = [set(o.scope) for o in msg.observations]
    else:
        return False
    wanted = set(tags)
    return any(not wanted or not s or s & wanted for s in sets)


def _check(m: MentalModel, fields: Iterable[str]) -> None:
    fields = set(fields)
    if "display_name" in fields and not m.display_name.strip():
        raise InvalidArgument("mental_model.display_name", "required")
    if "source_query" in fields and not m.source_query.strip():
        raise InvalidArgument("mental_model.source_query", "required: the question it answers")
    if "tags" in fields:
        for i, t in enumerate(m.tags):
            if not t.strip():
                raise InvalidArgument(f"mental_model.tags[{i}]", "must not be empty")
    if "max_tokens" in fields and m.max_tokens < 0:
        raise InvalidArgument("mental_model.max_tokens", "must not be negative")
    if "refresh_policy" in fields and m.refresh_policy not in REFRESH_POLICIES:
        raise InvalidArgument("mental_model.refresh_policy",
                              f"one of {', '.join(REFRESH_POLICIES)}")
    if "refresh_every" in fields and m.refresh_every < 0:
        raise InvalidArgument("mental_model.refresh_every", "must not be negative")


def _event(m: MentalModel, mask: Sequence[str]) -> ev.MentalModelChanged:
    """The MentalModelChanged of creating ``m`` (empty ``mask``) or of changing its
    ``mask`` fields (only those are carried)."""
    msg = ev.MentalModelChanged(bank_id=m.bank_id, id=m.id, update_mask=list(mask))
    for f in mask or MENTAL_MODEL_FIELDS:
        value = getattr(m, f)
        if f == "tags":
            msg.tags.extend(dict.fromkeys(value))
        else:
            setattr(msg, f, value)
    return msg
