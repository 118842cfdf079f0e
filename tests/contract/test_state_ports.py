"""The state ports' adapters against their shared contracts: the SQLite adapters and the
in-memory fakes handler tests use (``mneme.stores.memory``) — Catalog, ObservationStore
and EntityStore — plus what is specific to SQLite: files reopen with their data, and
entities.db files of the first schema migrate with their ids."""

from __future__ import annotations

import os
import sqlite3

import pytest

# the suites are plain modules: have pytest explain their failing asserts too
pytest.register_assert_rewrite("tests.contract.catalog_suite", "tests.contract.entity_suite",
                               "tests.contract.observation_suite", "tests.contract.document_suite")

from .catalog_suite import T0, CatalogSuite, op
from .document_suite import DocumentStoreSuite, rev
from .entity_suite import ENTITIES_V1_SCHEMA, EntityStoreSuite, PersistentEntityStoreSuite
from .observation_suite import ObservationStoreSuite, changed, fact, obs
from mneme.domain import BankConfig, derive_id
from mneme.ports import Catalog, DocumentStore, EntityStore, ObservationStore, StoredEntity
from mneme.stores.catalog_sqlite import SqliteCatalog
from mneme.stores.documents_sqlite import SqliteDocumentStore
from mneme.stores.entities_sqlite import SqliteEntityStore
from mneme.stores.memory import (MemoryCatalog, MemoryDocumentStore, MemoryEntityStore,
                                 MemoryObservationStore)
from mneme.stores.observations_sqlite import SqliteObservationStore


# ---- catalog ------------------------------------------------------------------------------


class TestSqliteCatalog(CatalogSuite):
    def make_catalog(self, path):
        return SqliteCatalog(str(path / "catalog.db"))

    def test_pending_operations_are_counted_from_their_partial_index(self, tmp_path):
        # GetBankStats must not walk every operation of a large bank to find the few
        # pending ones: the count's condition must stay the index's
        from mneme.stores.catalog_sqlite import COUNT_OPERATIONS, COUNT_PENDING_OPERATIONS
        c = self.make_catalog(tmp_path)
        try:
            plan = c._db.execute("EXPLAIN QUERY PLAN " + COUNT_PENDING_OPERATIONS,
                                 ("a",)).fetchall()
            assert any("operations_pending" in str(row) for row in plan), plan
            plan = c._db.execute("EXPLAIN QUERY PLAN " + COUNT_OPERATIONS, ("a",)).fetchall()
            assert any("COVERING INDEX" in str(row) for row in plan), plan
        finally:
            c.close()

    def test_reopen_keeps_banks_generations_and_final_states(self, tmp_path):
        c = self.make_catalog(tmp_path)
        c.upsert_bank("a", "A", BankConfig(), T0)
        c.delete_bank("a")
        c.upsert_bank("a", "A", BankConfig(), T0)
        c.put_operation(op("o1", "a"))
        c.update_operation(op("o1", "a", "succeeded"))
        c.close()
        c = self.make_catalog(tmp_path)
        try:
            assert c.get_bank("a").incarnation == "2"
            c.update_operation(op("o1", "a", "failed"))
            assert c.get_operation("o1").state == "succeeded"
        finally:
            c.close()

    def test_an_older_file_gets_the_revision_mode_column(self, tmp_path):
        import sqlite3
        path = tmp_path / "catalog.db"
        db = sqlite3.connect(path)  # the revisions table as releases before the mode made it
        db.execute("CREATE TABLE mental_model_revisions (bank_id TEXT NOT NULL, model_id TEXT "
                   "NOT NULL, revision INTEGER NOT NULL, at REAL NOT NULL, content TEXT NOT NULL, "
                   "based_on TEXT NOT NULL, source TEXT NOT NULL, PRIMARY KEY (bank_id, model_id, "
                   "revision), UNIQUE (bank_id, model_id, at))")
        db.execute("INSERT INTO mental_model_revisions VALUES ('a', 'm1', 1, 1.0, 'x', '[]', 'user')")
        db.commit()
        db.close()
        c = self.make_catalog(tmp_path)
        try:
            assert [(r.content, r.mode) for r in c.mental_model_revisions("a", "m1")] == [("x", "")]
        finally:
            c.close()


class TestMemoryCatalog(CatalogSuite):
    def make_catalog(self, path):
        return MemoryCatalog()


# ---- observations -------------------------------------------------------------------------


class TestSqliteObservationStore(ObservationStoreSuite):
    def make_observations(self, path):
        return SqliteObservationStore(str(path / "observations.db"))

    def test_a_build_store_syncs_at_flush_and_reopens_whole(self, tmp_path):
        """durable=False (a replay's build): no sync per write until flush(), which
        checkpoints the WAL into the file; reopened, the store holds every write."""
        path = str(tmp_path / "observations.g2.db")
        s = SqliteObservationStore(path, durable=False)
        assert s._db.execute("PRAGMA synchronous").fetchone()[0] == 0  # OFF
        s.add_facts("a", [(fact("f1"), [[]])])
        s.apply(changed(observations=[obs("o1", 1)], consolidated=["f1"]))
        s.flush()
        assert s._db.execute("PRAGMA synchronous").fetchone()[0] == 2  # FULL from here
        assert os.path.getsize(path + "-wal") == 0  # checkpointed into the file
        s.add_facts("a", [(fact("f2"), [[]])])
        s.close()
        s = SqliteObservationStore(path)
        try:
            assert [f.id for f, _ in s.facts("a")] == ["f1", "f2"]
            assert s.counts("a") == (2, 1, 1)
        finally:
            s.close()

    def test_deleted_facts_and_observations_leave_no_bytes_in_the_files(self, tmp_path):
        """SQLite leaves a deleted row's bytes in freed pages and in the WAL: with
        secure_delete and the WAL truncated after a delete, neither file holds them,
        while the store is open and after it closes."""
        marker = "Zanzibarina's phone is +44 7700 900123"
        s = self.make_observations(tmp_path)
        s.add_facts("a", [(fact("f1", text=marker), [[]]), (fact("f2"), [[]])])
        s.apply(changed(observations=[obs("o1", 1, text=marker)], consolidated=["f1"]))
        # consolidation's record of that decision quotes it too
        s.record_decision("a", "e1", [changed(observations=[obs("o1", 1, text=marker)])])
        s.delete_facts("a", ["f1"])
        s.apply(changed(observations=[obs("o1", 2, text=marker, deleted=True)]))

        def leftovers() -> list[str]:
            return [p.name for p in tmp_path.iterdir()
                    if p.is_file() and marker.encode() in p.read_bytes()]
        try:
            assert leftovers() == [] and s.counts("a") == (1, 0, 1)
        finally:
            s.close()
        assert leftovers() == []

    def test_reopen_keeps_facts_states_and_order(self, tmp_path):
        s = self.make_observations(tmp_path)
        s.add_facts("a", [(fact("f2"), [["x"]]), (fact("f1"), [[]])])
        s.apply(changed(observations=[obs("o1", 2, ["x"])], consolidated=["f2"]))
        dump = s.dump("a")
        s.close()
        s = self.make_observations(tmp_path)
        try:
            assert s.dump("a") == dump
            assert [f.id for f, _ in s.facts("a", pending=True)] == ["f1"]
            s.add_facts("a", [(fact("f0"), [[]])])  # arrival order continues
            assert [f.id for f, _ in s.facts("a")] == ["f2", "f1", "f0"]
        finally:
            s.close()


class TestMemoryObservationStore(ObservationStoreSuite):
    def make_observations(self, path):
        return MemoryObservationStore()


# ---- entities -----------------------------------------------------------------------------


class TestSqliteEntityStore(PersistentEntityStoreSuite):
    def make_entities(self, path):
        return SqliteEntityStore(str(path / "entities.db"))

    def test_first_schema_is_migrated_with_ids_and_kinds(self, tmp_path):
        path = str(tmp_path / "entities.db")
        old = sqlite3.connect(path)
        old.executescript(ENTITIES_V1_SCHEMA)
        mel, paint = derive_id("entity", "b", "melanie"), derive_id("entity", "b", "painting")
        old.execute("INSERT INTO entities VALUES ('b', 'melanie', ?, 'Melanie', 'PERSON', 1)", (mel,))
        old.execute("INSERT INTO entities VALUES ('b', 'painting', ?, 'painting', 'CONCEPT', 2)",
                    (paint,))
        old.execute("INSERT INTO aliases VALUES ('b', 'mel', 'melanie')")
        old.commit()
        old.close()
        s = SqliteEntityStore(path)
        try:
            entities, aliases = s.load("b")
            assert [(e.id, e.key, e.label, e.kind) for e in entities] == [
                (mel, "melanie", "PERSON", "person"), (paint, "painting", "CONCEPT", "")]
            assert aliases == [("mel", mel)]
            tables = {r[0] for r in s._db.execute("SELECT name FROM sqlite_master WHERE type='table'")}
            assert tables == {"entities_v2", "aliases_v2", "mentions_v2", "decided",
                              "decisions", "sqlite_sequence"}  # the v1 tables are gone
        finally:
            s.close()

    def test_mentions_of_before_facts_were_recorded_are_migrated_per_scope(self, tmp_path):
        path = str(tmp_path / "entities.db")
        s = SqliteEntityStore(path)
        s.persist("b", entities=[StoredEntity("e1", "mel", "Mel", "PERSON", "person")])
        s.close()
        old = sqlite3.connect(path)  # the table as it was: mentions per entity and scope
        old.executescript("DROP TABLE mentions_v2; CREATE TABLE mentions (bank_id TEXT NOT "
                          "NULL, id TEXT NOT NULL, scope TEXT NOT NULL, PRIMARY KEY "
                          "(bank_id, id, scope)); INSERT INTO mentions VALUES ('b','e1','d:x');")
        old.close()
        s = SqliteEntityStore(path)
        try:
            assert s.drop_facts("b", ["f1"]) == []  # no fact known: a memory's deletion keeps it
            assert s.drop_scope("b", "d:x") == ["e1"] and s.load("b") == ([], [])
        finally:
            s.close()

    def test_mentions_of_before_facts_were_recorded_are_refined_once(self, tmp_path):
        """refine_mentions gives a migrated mention (no fact) the memories the log names:
        deleting them then forgets the entity; a mention nothing refines stays."""
        path = str(tmp_path / "entities.db")
        s = SqliteEntityStore(path)
        assert not s.unrefined_mentions()  # a new file has nothing to refine
        s.persist("b", entities=[StoredEntity("e1", "mel", "Mel", "PERSON", "person"),
                                 StoredEntity("e2", "tom", "Tom", "PERSON", "person")])
        s.close()
        old = sqlite3.connect(path)
        old.executescript("DROP TABLE mentions_v2; CREATE TABLE mentions (bank_id TEXT NOT "
                          "NULL, id TEXT NOT NULL, scope TEXT NOT NULL, PRIMARY KEY "
                          "(bank_id, id, scope)); INSERT INTO mentions VALUES ('b','e1','d:x');"
                          "INSERT INTO mentions VALUES ('b','e2','d:x'); PRAGMA user_version=0;")
        old.close()
        s = SqliteEntityStore(path)
        try:
            assert s.unrefined_mentions()
            # e1 by f1 and f2; e2 by no fact the log still has; a row of no migrated mention
            assert s.refine_mentions({"b": [("e1", "d:x", "f1"), ("e1", "d:x", "f2"),
                                            ("e9", "d:x", "f1")]}) == 1
            assert not s.unrefined_mentions()
            assert s.drop_facts("b", ["f1"]) == []
            assert s.drop_facts("b", ["f2"]) == ["e1"]
            assert [e.id for e in s.load("b")[0]] == ["e2"]  # kept as it was
        finally:
            s.close()
        s = SqliteEntityStore(path)
        try:
            assert not s.unrefined_mentions()  # once
        finally:
            s.close()

    def test_entities_of_before_mentions_were_recorded_get_them(self, tmp_path):
        """A file from before mentions were recorded (entities only): refined, a deleted
        document forgets the entities only it named."""
        path = str(tmp_path / "entities.db")
        s = SqliteEntityStore(path)
        s.persist("b", entities=[StoredEntity("e1", "mel", "Mel", "PERSON", "person")])
        s.close()
        old = sqlite3.connect(path)
        old.executescript("DROP TABLE mentions_v2; PRAGMA user_version=0;")
        old.close()
        s = SqliteEntityStore(path)
        try:
            assert s.unrefined_mentions()
            assert s.drop_scope("b", "d:x") == []  # nothing tells what named e1
            assert s.refine_mentions({"b": [("e1", "d:x", "f1")]}) == 0
            assert s.drop_scope("b", "d:x") == ["e1"] and s.load("b") == ([], [])
        finally:
            s.close()


class TestMemoryEntityStore(EntityStoreSuite):
    def make_entities(self, path):
        return MemoryEntityStore()


# ---- documents ----------------------------------------------------------------------------


class TestSqliteDocumentStore(DocumentStoreSuite):
    def make_documents(self, path):
        return SqliteDocumentStore(str(path / "documents.db"))

    def test_deleted_text_leaves_no_bytes_in_the_files(self, tmp_path):
        """A deleted document's text, and the text a later retain replaced, are not in
        the database or its WAL, while the store is open and after it closes."""
        gone, replaced = "Zanzibarina's phone is +44 7700 900123", "Quetzalina owes 40 EUR"
        s = self.make_documents(tmp_path)
        s.add_revisions("a", [("d", rev("o1", 1.0, gone, context=gone), gone)])
        s.add_revisions("a", [("e", rev("o2", 1.0, replaced), replaced)])
        s.add_revisions("a", [("e", rev("o3", 2.0, "now"), "now")])
        s.delete_document("a", "d")

        def leftovers() -> list[str]:
            return [f"{p.name}: {m}" for p in tmp_path.iterdir() if p.is_file()
                    for m in (gone, replaced) if m.encode() in p.read_bytes()]
        try:
            assert leftovers() == [] and s.get("a", "e").text == "now"
        finally:
            s.close()
        assert leftovers() == []

    def test_reopen_keeps_documents_and_settings(self, tmp_path):
        s = self.make_documents(tmp_path)
        s.add_revisions("a", [("d", rev("o1", 1.0, "x"), "x")])
        s.set_storage("a", False)
        dump = s.dump("a")
        s.close()
        s = self.make_documents(tmp_path)
        try:
            assert s.dump("a") == dump and s.storage("a") is False
        finally:
            s.close()


class TestMemoryDocumentStore(DocumentStoreSuite):
    def make_documents(self, path):
        return MemoryDocumentStore()


@pytest.mark.parametrize("adapter, port", [
    (MemoryCatalog, Catalog), (MemoryObservationStore, ObservationStore),
    (MemoryEntityStore, EntityStore), (MemoryDocumentStore, DocumentStore),
    (lambda: SqliteDocumentStore(":memory:"), DocumentStore),
    (lambda: SqliteCatalog(":memory:"), Catalog),
    (lambda: SqliteObservationStore(":memory:"), ObservationStore),
    (lambda: SqliteEntityStore(":memory:"), EntityStore),
])
def test_adapters_have_every_method_of_their_port(adapter, port):
    store = adapter()
    try:
        wanted = {n for n in vars(port) if not n.startswith("_")}
        missing = {n for n in wanted if not callable(getattr(store, n, None))}
        assert not missing
    finally:
        store.close()
