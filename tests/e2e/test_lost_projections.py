"""Projection files lost, damaged or left behind, through the real ``mneme`` CLI (found
by a crash-consistency review): a catalog, document projection, entity resolver or live
store that is missing although the log says it was projected, or a catalog SQLite cannot
read, makes ``mneme up`` refuse with a message naming the file and ``mneme replay -d``,
which rebuilds it; a replay stopped by a crash leaves a FAILED generation whose files the next start
deletes (they held content later deletions never reach)."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from mneme.generations import Generations
from tests.e2e.server import Server, inherited, up_refuses

pytestmark = pytest.mark.slow

MNEME = str(Path(sys.executable).with_name("mneme"))
ENV = {**inherited(), "HF_HUB_OFFLINE": "1", "MNEME_METRICS_PORT": "0"}
MARKER = "QUOKKAZEBRA7731"
FACTS = [f"Maria said the vault code is {MARKER} and asked me to keep it.",
         "Bob adopted a grey cat called Pixel last spring."]


@pytest.fixture(scope="module")
def stopped_data(tmp_path_factory) -> Path:
    """A data dir with one bank holding FACTS (one document each), the server stopped:
    made once, never changed (each test damages a copy of it)."""
    data = tmp_path_factory.mktemp("lost-projections") / "data"
    server = Server(data).start()
    try:
        with server.client(timeout=60) as m:
            m.upsert_bank("b")
            for n, text in enumerate(FACTS):
                r = m.retain("b", [{"content": text, "document_id": f"d{n}"}])
                assert r.operation.state == 3
    finally:
        server.stop()
    return data


@pytest.fixture
def data(stopped_data, tmp_path) -> Path:
    """This test's own copy of :func:`stopped_data` (byte for byte: a stopped data dir
    holds no absolute path), which it may damage."""
    return Path(shutil.copytree(stopped_data, tmp_path / "data", symlinks=True))


def _up_refuses(data: Path) -> str:
    out = up_refuses(data)
    assert "Traceback" not in out, out
    return out


def _replay(data: Path) -> None:
    p = subprocess.run([MNEME, "replay", "--data-dir", str(data)], env=ENV,
                       capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, p.stdout + p.stderr


def _texts(m) -> list[str]:
    """The bank's memories, each by its fact's words (annotated dates left out)."""
    return sorted(x.text.split(" (")[0].rstrip(".") for x in m.list_memories("b"))


def _serves_everything(data: Path) -> None:
    server = Server(data).start()
    try:
        with server.client(timeout=60) as m:
            assert [b.name for b in m.list_banks()] == ["banks/b"]
            assert _texts(m) == sorted(f.rstrip(".") for f in FACTS)
            assert sorted(d.document_id for d in m.list_documents("b")) == ["d0", "d1"]
            hit = m.recall("b", "What is the vault code?").results[0]
            assert MARKER in hit.memory.text and hit.scores.keyword_rank == 1
    finally:
        server.stop()


def _remove(path: Path) -> None:
    for p in [path, *path.parent.glob(path.name + "-*")]:
        shutil.rmtree(p) if p.is_dir() else p.unlink()


@pytest.mark.parametrize("lost,named", [("catalog.db", "the catalog"),
                                        ("documents.db", "search's document projection"),
                                        ("entities.db", "extraction's entity resolver"),
                                        ("text", "search's store")])
def test_a_lost_projection_refuses_to_start_and_replay_rebuilds_it(data, lost, named):
    _remove(data / lost)
    out = _up_refuses(data)
    assert f"{named} " in out and f"{data.resolve()}/{lost}" in out, out
    assert "it is missing" in out and f"mneme replay -d {data.resolve()}" in out, out
    assert _up_refuses(data) == out  # a refused start leaves no empty file behind
    _replay(data)
    _serves_everything(data)


def test_a_damaged_catalog_refuses_to_start_and_replay_rebuilds_it(data):
    catalog = data / "catalog.db"
    os.truncate(catalog, catalog.stat().st_size // 2)
    out = _up_refuses(data)
    assert f"{data.resolve()}/catalog.db" in out and "damaged" in out, out
    assert f"mneme replay -d {data.resolve()}" in out, out
    _replay(data)
    _serves_everything(data)


def test_the_files_of_a_replay_a_crash_stopped_are_deleted_at_start(data):
    gens = Generations(data)
    building = gens.begin()  # what a replay killed mid-build leaves behind
    g = building.generation
    left = [data / f"vectors.g{g}", data / f"text.g{g}", data / f"graph.g{g}.db",
            data / f"observations.g{g}.db"]
    for p in left[:2]:
        p.mkdir()
        (p / "segment").write_text(MARKER)
    for p in left[2:]:
        p.write_text(MARKER)
    server = Server(data).start()
    try:
        rec = Generations(data).get(g)
        assert rec.state == "FAILED" and "stores are deleted" in rec.error, rec
        assert not any(p.exists() for p in left), [p for p in left if p.exists()]
        with server.client(timeout=60) as m:
            assert _texts(m) == sorted(f.rstrip(".") for f in FACTS)
    finally:
        server.stop()


def test_a_graph_store_kept_in_its_append_only_files_alone_starts(data):
    # FalkorDB writes graph.db only at a save point; after a hard stop before the first,
    # its data is in graph.db.aof alone, which is no loss
    assert (data / "graph.db.aof").is_dir()
    (data / "graph.db").unlink()
    _serves_everything(data)


def test_a_lost_key_file_refuses_to_start_naming_it(data):
    """keys.db and master.key are no projections: the log's content is sealed under their
    keys. Either lost made the server start as if nothing were wrong: a new master key
    was made that unwraps no bank key, or an empty key store that opens no record, so
    every write on the log was unreadable (a replay would erase it all). The start is
    refused, naming the file; back in place, everything serves."""
    for lost in ("master.key", "keys.db"):
        saved = data.parent / f"saved-{lost}"
        shutil.copytree(data, saved)  # the files as they were (with the -wal and -shm)
        _remove(data / lost)
        out = _up_refuses(data)
        assert f"{data.resolve()}/{lost} is missing" in out, out
        assert "restore it from a backup" in out, out
        assert not (data / lost).exists()  # a refused start makes no new key file
        shutil.rmtree(data)
        saved.rename(data)
    _serves_everything(data)
