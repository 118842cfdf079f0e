"""A full disk in the SQLite stores: the write fails with SQLite's own error, and the
store writes again once there is room.

SQLite rolls the whole transaction back by itself on some errors (SQLITE_FULL, an I/O
error): a store that then sent ROLLBACK got "cannot rollback - no transaction is
active" instead of "database or disk is full" (the cause was lost, and gRPC answered
it as UNKNOWN). ``PRAGMA max_page_count`` stands in for the full disk: SQLite answers
SQLITE_FULL when a write needs a page beyond it, and rolls the transaction back."""

from __future__ import annotations

import sqlite3

import pytest

from mneme.domain import DocumentRevision
from mneme.stores.catalog_sqlite import SqliteCatalog
from mneme.stores.documents_sqlite import SqliteDocumentStore
from mneme.stores.keys_sqlite import SqliteKeyStore
from mneme.stores.observations_sqlite import SqliteObservationStore

BIG = b"x" * 200_000  # more pages than the file has


def _full(db: sqlite3.Connection) -> None:
    """No page beyond those the file has now."""
    n = db.execute("PRAGMA page_count").fetchone()[0]
    db.execute(f"PRAGMA max_page_count={n}")


def _room(db: sqlite3.Connection) -> None:
    db.execute("PRAGMA max_page_count=4294967294")


def _is_full(err: pytest.ExceptionInfo) -> None:
    assert err.value.sqlite_errorcode == sqlite3.SQLITE_FULL, err.value


def test_key_store_transaction(tmp_path):
    s = SqliteKeyStore(str(tmp_path / "keys.db"))
    _full(s._db)
    with pytest.raises(sqlite3.OperationalError) as err:
        s.add_many("b", [(f"k{i}", "s", BIG) for i in range(3)])
    _is_full(err)
    assert not s._db.in_transaction
    _room(s._db)
    assert set(s.add_many("b", [("k0", "s", b"key")])) == {"k0"}
    assert s.get("b", "k1") is None  # (nothing of the failed write)


def test_document_store_transaction(tmp_path):
    s = SqliteDocumentStore(str(tmp_path / "documents.db"))
    _full(s._db)
    text = BIG.decode()
    with pytest.raises(sqlite3.OperationalError) as err:
        s.add_revisions("b", [("d", DocumentRevision(0, "o1", 1.0), text)])
    _is_full(err)
    _room(s._db)
    assert s.add_revisions("b", [("d", DocumentRevision(0, "o1", 1.0), "small")]) == 1


def test_observation_store_transaction(tmp_path):
    s = SqliteObservationStore(str(tmp_path / "observations.db"))
    from mneme.events.v1 import events_pb2 as ev
    big = ev.FactsRetracted(bank_id="b", memory_ids=["m" * 1000] * 200)
    _full(s._db)
    with pytest.raises(sqlite3.OperationalError) as err:
        s.record_decision("b", "cause-1", [big])
    _is_full(err)
    _room(s._db)
    s.record_decision("b", "cause-2", [ev.FactsRetracted(bank_id="b")])
    assert s.decision("cause-2") is not None
    assert s.decision("cause-1") is None


def test_catalog_mental_model_transaction(tmp_path):
    from mneme.domain import BankConfig, MentalModel
    s = SqliteCatalog(str(tmp_path / "catalog.db"))
    s.upsert_bank("b", "", BankConfig(), at=1.0)
    _full(s._db)
    with pytest.raises(sqlite3.OperationalError) as err:
        s.upsert_mental_model(MentalModel(id="m1", bank_id="b", display_name="m",
                                          source_query="q", content=BIG.decode()))
    _is_full(err)
    _room(s._db)
    s.upsert_mental_model(MentalModel(id="m1", bank_id="b", display_name="m",
                                      source_query="q", content="small"))
    assert s.get_mental_model("b", "m1").content == "small"

