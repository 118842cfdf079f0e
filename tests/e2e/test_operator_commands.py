"""Operator commands over gRPC: BankService.GetBankStats (`mneme banks stats`) and
`mneme operations`, against an embedded server in this process."""

from __future__ import annotations

import time
from datetime import datetime, timezone

import grpc
import pytest
from typer.testing import CliRunner

from mneme.bootstrap import services
from mneme.cli import app
from mneme.client import MnemeClient
from mneme.config import Settings
from mneme.router import groups_of
from mneme.runtime.embedded import bootstrap


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    node = bootstrap(Settings(data_dir=tmp_path_factory.mktemp("ops")))
    node.start()
    port = node.serve("127.0.0.1:0")
    yield f"127.0.0.1:{port}"
    node.close()


def test_bank_stats_and_operations(server):
    with MnemeClient(server, timeout=120) as m:
        m.upsert_bank("ops")
        r = m.retain("ops", [{"content": "Alice moved to Lisbon in May 2023. She works at Acme.",
                              "timestamp": datetime(2024, 3, 1, tzinfo=timezone.utc)}])
        s = m.bank_stats("ops")
        assert s.name == "banks/ops"
        assert s.facts == len(r.memory_ids) > 0
        assert s.observations >= 0 and s.entities > 0
        assert s.operations >= 1 and s.pending_operations == 0
        # every group that runs embedded, as the routes declare them, on its topics
        assert {(x.group, x.topic) for x in s.lag} == {
            (g, t) for g, ts in groups_of(services().values(), distributed=False).items()
            for t in ts}
        assert s.pending_records == sum(x.lag for x in s.lag)
        ops = list(m.list_operations("ops"))
        assert r.operation.name in {o.name for o in ops}
        assert s.operations == len(ops)
        end = time.monotonic() + 60  # consolidation done: its observations are counted
        while (s := m.bank_stats("ops")).pending_records and time.monotonic() < end:
            time.sleep(0.2)
        observed = list(m.list_observations("ops"))
        assert s.observations == len(observed) > 0
        with pytest.raises(grpc.RpcError) as e:
            m.bank_stats("nope")
        assert e.value.code() == grpc.StatusCode.NOT_FOUND

    runner = CliRunner()
    out = runner.invoke(app, ["banks", "stats", "ops", "-a", server])
    assert out.exit_code == 0, out.output
    assert "facts" in out.output and "pending records" in out.output
    out = runner.invoke(app, ["operations", "--bank", "ops", "-a", server])
    assert out.exit_code == 0, out.output
    assert "succeeded" in out.output
    assert r.operation.name.split("/")[-1] in out.output  # the full id, even at 80 columns


def test_retain_takes_a_json_lines_file_of_items_as_one_request(server, tmp_path):
    import json
    runner = CliRunner()
    lines = [{"content": f"Nora planted {n} tulips.", "document_id": "garden",
              "timestamp": "2024-04-0%dT10:00:00+00:00" % (n + 1), "tags": ["home"]}
             for n in range(3)]
    path = tmp_path / "items.jsonl"
    path.write_text("\n".join(json.dumps(x) for x in lines) + "\n\n")
    out = runner.invoke(app, ["retain", "garden", "--items", str(path), "-a", server])
    assert out.exit_code == 0, out.output
    assert "succeeded, 3 facts" in out.output, out.output
    with MnemeClient(server) as m:
        ops = [o for o in m.list_operations("garden")]
        assert len(ops) == 1 and ops[0].items_total == 3
        mems = list(m.list_memories("garden", document_id="garden"))
        assert {x.tags[0] for x in mems} == {"home"} and len(mems) == 3
    # one of CONTENT and --items; a bad line is named, nothing is sent
    for args, said in ((["retain", "garden", "x", "--items", str(path)], "one of them"),
                       (["retain", "garden"], "one of them"),
                       (["retain", "garden", "--items", str(path), "--tag", "x"], "each line")):
        out = runner.invoke(app, args + ["-a", server])
        assert out.exit_code == 2 and said in out.output, out.output
    for bad, said in (('{"content": 3}', "string 'content'"),
                      ('{"content": "a", "x": 1}', "unknown"),
                      ('{"content": "a", "metadata": {"n": 1}}', "object of strings"),
                      ('{"content": "a", "timestamp": "soon"}', "line 2"), ("[1]", "line 2")):
        path.write_text('{"content": "fine"}\n' + bad + "\n")
        out = runner.invoke(app, ["retain", "garden", "--items", str(path), "-a", server])
        assert out.exit_code == 2 and said in " ".join(out.output.split()), out.output
    with MnemeClient(server) as m:
        assert len(list(m.list_operations("garden"))) == 1
    # an item refused alone is named; the others are stored
    path.write_text('{"content": "Nora watered the tulips."}\n{"content": ""}\n')
    out = runner.invoke(app, ["retain", "garden", "--items", str(path), "-a", server])
    assert out.exit_code == 0, out.output
    assert "1 items failed" in out.output and "item 1 (items[1].content)" in out.output


def test_a_service_launcher_enters_the_composition_root(tmp_path):
    """`python -m services.<name>` runs `mneme serve <name>`: a configuration error (reflect
    without the search service's address) is fatal at once, exit status 1."""
    import subprocess
    import sys

    from tests.e2e.server import inherited

    env = {**inherited(), "MNEME_BUS_URL": "kafka://127.0.0.1:1", "MNEME_DATA_DIR": str(tmp_path),
           "MNEME_GRPC_ADDRESS": "127.0.0.1:0", "MNEME_METRICS_PORT": "0"}
    env.pop("MNEME_SEARCH_ADDRESS", None)
    p = subprocess.run([sys.executable, "-m", "services.reflect"], env=env, timeout=120,
                       capture_output=True, text=True)
    assert p.returncode == 1, p.stderr[-2000:]
    assert "MNEME_SEARCH_ADDRESS" in p.stderr


def test_a_refused_replay_wipes_nothing(tmp_path, monkeypatch):
    """Replay checks that it may rewind every group before it resets any projection: when
    the log refuses (Kafka: a group with live members), the stores and the catalog are
    as they were."""
    from mneme.bus import StaleCommitError
    from mneme.bus.sqlite_log import SqliteEventLog
    from mneme.runtime.replay import replay

    settings = Settings(data_dir=tmp_path)
    node = bootstrap(settings)
    node.start()
    port = node.serve("127.0.0.1:0")
    try:
        with MnemeClient(f"127.0.0.1:{port}", timeout=120) as m:
            m.upsert_bank("keep")
            m.retain("keep", [{"content": "Alice moved to Lisbon in May 2023."},
                              {"content": "Bob plays the cello in Porto."}])
            before = m.bank_stats("keep")
    finally:
        node.close()

    def refuse(self, group, offsets, produce=()):
        raise StaleCommitError(f"group {group!r} has live members")
    monkeypatch.setattr(SqliteEventLog, "commit", refuse)
    with pytest.raises(StaleCommitError):
        replay(settings)
    monkeypatch.undo()

    node = bootstrap(settings)
    node.start()
    port = node.serve("127.0.0.1:0")
    try:
        with MnemeClient(f"127.0.0.1:{port}", timeout=120) as m:
            after = m.bank_stats("keep")
            assert (after.facts, after.entities, after.operations) == (
                before.facts, before.entities, before.operations) and after.facts > 0
            hits = m.recall("keep", "Where did Alice move?")
            assert any("Lisbon" in r.memory.text for r in hits.results)
    finally:
        node.close()
