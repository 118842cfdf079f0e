"""A data dir written by an earlier mneme, served by this one (an operator's in-place
upgrade: stop the server, start the new version on the same data dir). The old formats
are made from a data dir of this version (an old release is not run here)."""

from __future__ import annotations

import sqlite3
from pathlib import Path

import pytest

from mneme.v1 import operations_pb2
from tests.e2e.server import Server

pytestmark = pytest.mark.slow


def _to_mentions_without_facts(path: Path) -> None:
    """entities.db as mneme wrote it before mentions per memory (``mentions``: one row
    per entity and scope, no fact id), the version it upgrades from."""
    db = sqlite3.connect(path)
    db.executescript("""
        PRAGMA secure_delete = ON;
        CREATE TABLE mentions (bank_id TEXT NOT NULL, id TEXT NOT NULL, scope TEXT NOT NULL,
                               PRIMARY KEY (bank_id, id, scope));
        INSERT OR IGNORE INTO mentions SELECT bank_id, id, scope FROM mentions_v2;
        DROP TABLE mentions_v2; DROP TABLE decisions; DROP TABLE decided;
        PRAGMA user_version = 0;
        VACUUM;""")
    db.close()


def _to_no_mentions(path: Path) -> None:
    """entities.db as mneme wrote it before it recorded mentions at all (entities and
    aliases only)."""
    db = sqlite3.connect(path)
    db.executescript("""
        PRAGMA secure_delete = ON;
        DROP TABLE mentions_v2; DROP TABLE decisions; DROP TABLE decided;
        PRAGMA user_version = 0;
        VACUUM;""")
    db.close()


def _entity_files(data: Path, needle: bytes) -> list[str]:
    return [p.name for p in data.glob("entities.db*") if needle in p.read_bytes()]


def test_memory_retained_before_mentions_per_memory_is_erased_by_delete_memory(tmp_path):
    """Before the upgrade entities.db knew which document named an entity, not which
    memory: a DeleteMemory after the upgrade left the names only the deleted memory gave
    (user content) in entities.db and in entity resolution for good. The first start
    takes the memories behind each mention from the log."""
    data = tmp_path / "data"
    server = Server(data).start()
    try:
        with server.client(timeout=120) as m:
            m.upsert_bank("b")
            op = m.retain("b", [{"content": text, "document_id": "d"} for text in (
                "Yolanda Quibbleworth lent Melanie a kayak.",
                "Melanie painted a sunrise over Lake Tahoe.")]).operation
            assert op.state == operations_pb2.SUCCEEDED, op
        server.stop()
        assert _entity_files(data, b"Quibbleworth")  # the check can fail
        _to_mentions_without_facts(data / "entities.db")
        server.start()
        with server.client(timeout=120) as m:
            kayak = [x for x in m.list_memories("b") if "kayak" in x.text]
            assert len(kayak) == 1
            op = m.delete_memory("b", kayak[0].name.rsplit("/", 1)[-1])
            assert op.state == operations_pb2.SUCCEEDED, op
            names = [e.display_name for e in m.list_entities("b")]
            assert "Melanie" in names and not any("Quibble" in n for n in names)
        server.stop()
        assert _entity_files(data, b"Quibbleworth") == []
        assert _entity_files(data, b"Tahoe")  # the other memory's entities are kept
        server.start()  # and a second start changes nothing
        with server.client(timeout=120) as m:
            assert "Melanie" in [e.display_name for e in m.list_entities("b")]
    finally:
        server.stop()


def test_document_retained_before_mentions_is_erased_by_delete_document(tmp_path):
    """Before mentions were recorded entities.db had no record of what named an entity:
    a DeleteDocument after the upgrade left the names only that document gave in
    entities.db. The first start records them from the log."""
    data = tmp_path / "data"
    server = Server(data).start()
    try:
        with server.client(timeout=120) as m:
            m.upsert_bank("b")
            for doc, text in (("secret", "Quentin Zebrowski told Caroline the vault phrase."),
                              ("keep", "Caroline painted a sunrise over Lake Tahoe.")):
                op = m.retain("b", [{"content": text, "document_id": doc}]).operation
                assert op.state == operations_pb2.SUCCEEDED, op
        server.stop()
        assert _entity_files(data, b"Zebrowski")  # the check can fail
        _to_no_mentions(data / "entities.db")
        server.start()
        with server.client(timeout=120) as m:
            assert m.delete_document("b", "secret").state == operations_pb2.SUCCEEDED
        server.stop()
        assert _entity_files(data, b"Zebrowski") == []
        assert _entity_files(data, b"Tahoe")  # the other document's entities are kept
    finally:
        server.stop()


def test_graph_written_before_units_kept_tags_scopes_safely_until_a_replay(tmp_path):
    """The graph's memory nodes had no tags before the tag-scoped entity reads: on such a
    data dir a scoped ListEntities must show none of the other user's entities (it shows
    nothing scoped; unscoped reads are as before), the store warns to replay, and
    `mneme replay` makes the scoped reads right."""
    from mneme.stores.graph_falkor import FalkorGraphStore
    from mneme.v1 import generations_pb2

    data = tmp_path / "data"
    server = Server(data).start()
    try:
        with server.client(timeout=120) as m:
            m.upsert_bank("b")
            for text, tag in (("Liz bought a red kayak.", "user:alice"),
                              ("Maya adopted a puppy.", "user:bob")):
                op = m.retain("b", [{"content": text, "tags": [tag]}]).operation
                assert op.state == operations_pb2.SUCCEEDED, op
            before = sorted((e.display_name, e.mention_count) for e in m.list_entities("b"))
        server.stop()
        g = FalkorGraphStore(str(data / "graph.db"))
        try:  # the nodes as the release before wrote them
            g._write(lambda run: run("MATCH (n:Unit) SET n.tags = null", {}))
        finally:
            g.close()
        start = server.log.stat().st_size
        server.start()
        with server.client(timeout=120) as m:
            assert "until `mneme replay` rebuilds the graph" in server.log.read_text()[start:]
            assert sorted((e.display_name, e.mention_count)
                          for e in m.list_entities("b")) == before
            for mode in ("any", "any_strict", "exact"):
                assert list(m.list_entities("b", tags=["user:alice"], tags_match=mode)) == []
            assert list(m.list_entities("b", tags_match="exact")) == []
            g = m.replay(poll_s=0.2)
            assert g.state == generations_pb2.Generation.LIVE, g
            alice = [e.display_name for e in m.list_entities("b", tags=["user:alice"])]
            assert "Liz" in alice and "Maya" not in alice
    finally:
        server.stop()
