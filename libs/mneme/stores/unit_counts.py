"""Per-bank unit counts by fact type, kept by a store as it writes (GetBankStats).

An exact count in the vector store walks the bank's points: ~16 ms for 60k facts on
this machine, linear in the bank. A store whose files are its own process's (Qdrant
Edge's shard) passes every write through here instead, so a bank's counts cost a dict
lookup at any size.

The counts are saved in a file beside the store's data when the store flushes, stamped
with the store's point total then. They are trusted on open only when that stamp still
matches, and the file is removed at the first change after a save: a crash between two
flushes leaves no file, so the next process counts each bank once again (``load``)
rather than trust figures that may miss the lost writes.
"""

from __future__ import annotations

import json
import logging
import os
from typing import Callable, Iterable, Mapping

log = logging.getLogger(__name__)

#: The file's name inside the store's directory.
COUNTS_FILE = "mneme_unit_counts.json"
_VERSION = 1

#: The key of units stored without a fact type (counted in a bank's total only).
UNTYPED = ""


class UnitCounts:
    """bank → fact type → number of units, for the banks counted so far.

    ``path`` is the file (see the module docstring); ``points`` the store's point total
    now, compared with the saved stamp. ``load(bank_id) -> {fact type: units}`` counts a
    bank the counts do not know yet (exactly, in the store: linear, once per bank). Not
    thread-safe: the store calls it under its own lock."""

    def __init__(self, path: str, points: int,
                 load: Callable[[str], Mapping[str, int]]) -> None:
        self.path = path
        self._load = load
        self._banks: dict[str, dict[str, int]] = {}
        self._on_disk = False  # the file holds exactly self._banks
        try:
            with open(path, encoding="utf-8") as fh:
                data = json.load(fh)
            if data.get("version") == _VERSION and data.get("points") == points:
                self._banks = {str(b): {str(t): int(n) for t, n in types.items()}
                               for b, types in data["banks"].items()}
                self._on_disk = True
            else:
                log.info("unit counts at %s are stale (%s points saved, %d now): each "
                         "bank is counted again", path, data.get("points"), points)
        except FileNotFoundError:
            pass
        except (OSError, ValueError, KeyError, TypeError, AttributeError) as e:
            log.warning("unit counts at %s unreadable (%s): each bank is counted again",
                        path, e)

    def of(self, bank_id: str) -> dict[str, int]:
        """The bank's counts by fact type (counted by ``load`` on first use); the dict is
        the live one, so callers must not change it."""
        counts = self._banks.get(bank_id)
        if counts is None:
            counts = self._banks[bank_id] = {t: int(n) for t, n in
                                             self._load(bank_id).items() if n}
            self._changed()
        return counts

    def total(self, bank_id: str, types: Iterable[str] = ()) -> int:
        """Units of the bank of any of ``types`` (all of them, untyped too, when empty)."""
        counts = self.of(bank_id)
        types = tuple(types)
        if not types:
            return sum(counts.values())
        return sum(counts.get(t, 0) for t in set(types))

    def add(self, bank_id: str, fact_type: str, n: int) -> None:
        """Count ``n`` more (or, negative, fewer) units of the type in the bank. The bank
        is counted first (``load``) when not yet known, so call this *before* the write
        it accounts for reaches the store, or :meth:`forget` the bank after it."""
        if not n:
            return
        counts = self.of(bank_id)
        left = counts.get(fact_type, 0) + n
        if left > 0:
            counts[fact_type] = left
        else:  # (below zero only if the store and the counts disagreed: recount)
            counts.pop(fact_type, None)
            if left < 0:
                log.warning("unit counts of bank %s went below zero for %r: recounted",
                            bank_id, fact_type)
                self.forget(bank_id)
                return
        self._changed()

    def forget(self, bank_id: str | None = None) -> None:
        """Drop the counts of ``bank_id`` (of every bank when None): counted again on
        next use. For writes whose effect is not known (an update that failed midway)."""
        if bank_id is None:
            self._banks.clear()
        else:
            self._banks.pop(bank_id, None)
        self._changed()

    @property
    def saved(self) -> bool:
        """Whether the file holds the counts as they are."""
        return self._on_disk

    def save(self, points: int) -> None:
        """Write the counts (stamped with the store's ``points`` after its flush) unless
        the file already holds them. Atomic (a temporary file renamed over it); a
        failure is logged, not raised (the counts are then made again after a restart)."""
        if self._on_disk:
            return
        tmp = self.path + ".tmp"
        try:
            with open(tmp, "w", encoding="utf-8") as fh:
                json.dump({"version": _VERSION, "points": int(points),
                           "banks": self._banks}, fh, separators=(",", ":"))
            os.replace(tmp, self.path)
            self._on_disk = True
        except OSError as e:
            log.warning("unit counts not saved at %s: %s", self.path, e)

    def _changed(self) -> None:
        if self._on_disk:  # the file no longer holds what a reopened store would have
            try:
                os.unlink(self.path)
            except FileNotFoundError:
                pass
            except OSError as e:  # left in place: its stamp still guards a reopen
                log.warning("stale unit counts not removed at %s: %s", self.path, e)
            self._on_disk = False
