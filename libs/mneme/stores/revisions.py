"""Per-bank revisions of a store's state, for callers that keep a copy of it in memory
(:meth:`mneme.ports.ObservationStore.revision`)."""

from __future__ import annotations

import itertools

_INSTANCES = itertools.count(1)  # each store's revisions are its own


class Revisions:
    """(store instance, reset epoch, bank's change count): a value that moves with every
    :meth:`bump` of the bank and every :meth:`reset`, and that no other instance ever
    gives. Not durable, not thread-safe (the store's lock guards it)."""

    def __init__(self) -> None:
        self._uid = next(_INSTANCES)
        self._epoch = 0
        self._banks: dict[str, int] = {}

    def of(self, bank_id: str) -> tuple[int, int, int]:
        """The bank's current revision."""
        return self._uid, self._epoch, self._banks.get(bank_id, 0)

    def bump(self, bank_id: str) -> None:
        """The bank's state changed."""
        self._banks[bank_id] = self._banks.get(bank_id, 0) + 1

    def reset(self) -> None:
        """Every bank's state changed (the store was emptied)."""
        self._epoch += 1
