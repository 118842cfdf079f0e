"""Per-bank unit counts by fact type, kept by a store as it writes (GetBankStats).

An exact count in the vector store walks the bank's points: ~16 ms for 60k facts on
this machine, linear in the bank. A store whose files are its own process's (Qdrant
Edge's shard) passes every write through here instead, so a bank's counts cost a dict
lookup at any size.

The counts are saved in a file beside the store's data when the store closes, with a
stamp of the store's files then (its point total and each segment's saved version).
Opening reads the file and removes it: the counts are trusted only when the stamp still
matches (no write since, by this code or any other: an older version after a rollback,
a restore), and a crash leaves no file. A bank without trusted counts is counted once
(``load``), when first written or asked for.
"""

from __future__ import annotations

import json
import logging
import os
from typing import Any, Callable, Iterable, Mapping

log = logging.getLogger(__name__)

#: The file's name inside the store's directory.
COUNTS_FILE = "mneme_unit_counts.json"
_VERSION = 2

#: The key of units stored without a fact type (counted in a bank's total only).
UNTYPED = ""


class UnitCounts:
    """bank → fact type → number of units, for the banks counted so far.

    ``path`` is the file (see the module docstring); ``stamp`` (any JSON value) describes
    the store's files now, compared with the saved one. ``load(bank_id) -> {fact type:
    units}`` counts a bank the counts do not know yet (exactly, in the store: linear,
    once per bank). Not thread-safe: the store calls it under its own lock."""

    def __init__(self, path: str, stamp: Any,
                 load: Callable[[str], Mapping[str, int]]) -> None:
        self.path = path
        self._load = load
        self._banks: dict[str, dict[str, int]] = {}
        try:
            with open(path, encoding="utf-8") as fh:
                data = json.load(fh)
            if data.get("version") == _VERSION and data.get("stamp") == _jsonable(stamp):
                self._banks = {str(b): {str(t): int(n) for t, n in types.items()}
                               for b, types in data["banks"].items()}
            else:
                log.info("unit counts at %s are stale (the store was written since they "
                         "were saved): each bank is counted again", path)
        except FileNotFoundError:
            return
        except (OSError, ValueError, KeyError, TypeError, AttributeError) as e:
            self._banks = {}
            log.warning("unit counts at %s unreadable (%s): each bank is counted again",
                        path, e)
        try:  # consumed: from now on only this process's close can vouch for them
            os.unlink(path)
        except OSError as e:  # left in place: its stamp still guards a reopen
            log.warning("unit counts not removed at %s: %s", path, e)

    def of(self, bank_id: str) -> dict[str, int]:
        """The bank's counts by fact type (counted by ``load`` on first use); the dict is
        the live one, so callers must not change it."""
        counts = self._banks.get(bank_id)
        if counts is None:
            counts = self._banks[bank_id] = {t: int(n) for t, n in
                                             self._load(bank_id).items() if n}
        return counts

    def total(self, bank_id: str, types: Iterable[str] = ()) -> int:
        """Units of the bank of any of ``types`` (all of them, untyped too, when empty)."""
        counts = self.of(bank_id)
        types = tuple(types)
        if not types:
            return sum(counts.values())
        return sum(counts.get(t, 0) for t in set(types))

    def apply(self, bank_id: str, changes: Mapping[str, int]) -> None:
        """A write's effect on a bank: fact type → units more (negative: fewer). Call
        it after the write, with the bank counted (:meth:`of`) *before* it; for a bank
        not counted it does nothing (counted later, write included). A change that would
        leave a type below zero means the counts and the store disagreed: the bank is
        dropped, to be counted again, and none of the change is applied."""
        counts = self._banks.get(bank_id)
        if counts is None:
            return
        new = dict(counts)
        for fact_type, n in changes.items():
            new[fact_type] = new.get(fact_type, 0) + n
        if any(n < 0 for n in new.values()):
            log.warning("unit counts of bank %s went below zero: counted again", bank_id)
            self.forget(bank_id)
            return
        self._banks[bank_id] = {t: n for t, n in new.items() if n}

    def forget(self, bank_id: str | None = None) -> None:
        """Drop the counts of ``bank_id`` (of every bank when None): counted again on
        next use. For writes whose effect is not known (an update that failed midway)."""
        if bank_id is None:
            self._banks.clear()
        else:
            self._banks.pop(bank_id, None)

    def save(self, stamp: Any) -> None:
        """Write the counts of the banks holding units with ``stamp`` (the store's, after
        its last write is durable), atomically and durably (a temporary file fsynced and
        renamed over the file, then the directory fsynced). A failure is logged, not
        raised: the banks are then counted again after the next open."""
        tmp = self.path + ".tmp"
        try:
            with open(tmp, "w", encoding="utf-8") as fh:
                json.dump({"version": _VERSION, "stamp": _jsonable(stamp),
                           "banks": {b: c for b, c in self._banks.items() if c}},
                          fh, separators=(",", ":"))
                fh.flush()
                os.fsync(fh.fileno())
            os.replace(tmp, self.path)
            fd = os.open(os.path.dirname(self.path) or ".", os.O_RDONLY)
            try:
                os.fsync(fd)
            finally:
                os.close(fd)
        except OSError as e:
            log.warning("unit counts not saved at %s: %s", self.path, e)


def _jsonable(value: Any) -> Any:
    """``value`` as it reads back from JSON (tuples become lists), for comparison."""
    return json.loads(json.dumps(value))
