"""Physical erasure in the SQLite stores (catalog, observations, entities).

A SQLite ``DELETE`` only unlinks rows: their bytes stay in the freed cells and pages of
the database file, and in WAL mode the frames that wrote them stay in the ``-wal`` file
until it is overwritten. Two library mechanisms drop them:

* ``PRAGMA secure_delete=ON`` (per connection): deleted content is overwritten with
  zeros in the pages it occupied -- cheap, as those pages are being written anyway;
* ``PRAGMA wal_checkpoint(TRUNCATE)`` after a transaction that deleted something: the
  zeroed pages are copied into the database file and the WAL is cut to 0 bytes, so no
  older frame keeps the deleted rows (one checkpoint per deleting call, not per row).
"""

from __future__ import annotations

import logging
import sqlite3

log = logging.getLogger(__name__)


def secure(db: sqlite3.Connection) -> None:
    """Turn on ``secure_delete`` for ``db`` (a per-connection setting)."""
    db.execute("PRAGMA secure_delete=ON")


def truncate_wal(db: sqlite3.Connection) -> bool:
    """Checkpoint ``db``'s WAL into the database file and truncate it to 0 bytes; call it
    after a committed transaction that deleted user content. Returns False (and logs)
    when another connection's reader kept the checkpoint from completing (the old
    frames then stay until the next truncation); a no-op True outside WAL mode."""
    busy, _, _ = db.execute("PRAGMA wal_checkpoint(TRUNCATE)").fetchone()
    if busy:
        log.warning("sqlite: a reader kept the WAL checkpoint from completing; deleted "
                    "rows stay in the -wal file until the next one")
    return not busy
