"""Directives through a real ``mneme up`` with the stub model: CRUD (AIP paths, field
violations), the rules in scope reach the reflect model's prompt in priority order and are
listed in ``sources.directives``, inactive and out-of-scope ones do not; their text is
sealed on the log; replay rebuilds them; ``mneme directives`` round-trips."""

from __future__ import annotations

import json
from datetime import datetime, timezone

import grpc
import pytest
from typer.testing import CliRunner

from mneme.cli import app
from mneme.client import field_violations
from mneme.v1 import directives_pb2
from tests.llm.stub import OPINION_FORMATION, chat

TS = datetime(2023, 5, 8, 13, 56, tzinfo=timezone.utc)
GERMAN = "Answer in German."
DOSAGE = "Never give a medical dosage."
FRENCH = "Answer in French."


def refused(call) -> grpc.RpcError:
    with pytest.raises(grpc.RpcError) as e:
        call()
    return e.value


def system_prompt(stub) -> str:
    return stub.chat_requests(without=OPINION_FORMATION)[-1].messages[0]["content"]


def reflect(stub, m, question: str, **kw):
    stub.on("chat", chat(None, tool_calls=[{"name": "recall",
                                             "arguments": {"query": "Caroline Sweden"}}]),
            chat("Caroline kam 2015 aus Schweden [m1]."), match=question)
    return m.reflect("dir", question, **kw)


def test_directives_in_scope_reach_the_model_and_survive_replay(stub, server):
    with server.client() as m:
        m.upsert_bank("dir", auto_consolidate=False, extraction_mode="offline")
        r = m.retain("dir", [{"content": "Caroline: I moved from Sweden in 2015.", "timestamp": TS}])
        assert r.operation.state == 3
        german = m.create_directive("dir", GERMAN, title="language", priority=1)
        dosage = m.create_directive("dir", DOSAGE, priority=5, tags=["health"])
        french = m.create_directive("dir", FRENCH, priority=9, active=False)
        assert german.name == f"banks/dir/directives/{german.id}" and german.active
        assert not french.active and list(dosage.tags) == ["health"]
        assert german.create_time.ToDatetime() == german.update_time.ToDatetime()
        assert {d.id for d in m.list_directives("dir")} == {german.id, dosage.id, french.id}
        assert [d.id for d in m.list_directives("dir", page_size=1)] == sorted(
            [german.id, dosage.id, french.id])

        m.update_bank("dir", reflect_mission="You help Caroline's biographer.")
        a = reflect(stub, m, "Where did Caroline come from?")
        prompt = system_prompt(stub)
        assert GERMAN in prompt and DOSAGE not in prompt and FRENCH not in prompt
        assert "You help Caroline's biographer." in prompt  # the bank's reflect mission
        assert list(a.sources.directives) == [german.id] and not a.extractive
        assert list(a.sources.facts) == list(a.based_on) and len(a.based_on) == 1

        a = reflect(stub, m, "Where did Caroline come from, health-wise?", tags=["health"])
        prompt = system_prompt(stub)
        assert prompt.index(DOSAGE) < prompt.index(GERMAN)  # priority 5 before 1
        assert list(a.sources.directives) == [dosage.id, german.id]

        changed = m.update_directive("dir", german.id, active=False)
        assert not changed.active and changed.text == GERMAN and changed.title == "language"
        assert changed.update_time.ToDatetime() >= changed.create_time.ToDatetime()
        a = reflect(stub, m, "Where did Caroline live before?")
        assert GERMAN not in system_prompt(stub) and list(a.sources.directives) == []

        m.delete_directive("dir", french.id)
        assert refused(lambda: m.get_directive("dir", french.id)).code() == grpc.StatusCode.NOT_FOUND
        before = sorted((d.id, d.text, d.priority, d.active, tuple(d.tags),
                         d.update_time.ToDatetime()) for d in m.list_directives("dir"))
        assert len(before) == 2

    server.stop()
    log = b"".join(p.read_bytes() for p in server.data_dir.glob("log.db*"))
    assert GERMAN.encode() not in log and DOSAGE.encode() not in log  # sealed on the log
    server.replay()
    with server.client() as m:
        after = sorted((d.id, d.text, d.priority, d.active, tuple(d.tags),
                        d.update_time.ToDatetime()) for d in m.list_directives("dir"))
        assert after == before
        m.delete_bank("dir")
        m.upsert_bank("dir")
        assert list(m.list_directives("dir")) == []  # gone with the bank


def test_directive_requests_are_validated(server):
    with server.client() as m:
        m.upsert_bank("v")
        d = m.create_directive("v", "Be brief.")
        cases = [
            (lambda: m.create_directive("v", "   "), grpc.StatusCode.INVALID_ARGUMENT,
             ["directive.text"]),
            (lambda: m.create_directive("v", "x", tags=["ok", ""]),
             grpc.StatusCode.INVALID_ARGUMENT, ["directive.tags[1]"]),
            (lambda: m.directives.CreateDirective(directives_pb2.CreateDirectiveRequest(
                parent="banks/v")), grpc.StatusCode.INVALID_ARGUMENT, ["directive"]),
            (lambda: m.create_directive("nope", "x"), grpc.StatusCode.NOT_FOUND, []),
            (lambda: m.get_directive("v", "not-a-uuid"), grpc.StatusCode.INVALID_ARGUMENT,
             ["name"]),
            (lambda: m.get_directive("v", "00000000-0000-0000-0000-000000000000"),
             grpc.StatusCode.NOT_FOUND, []),
        ]
        for call, code, fields in cases:
            err = refused(call)
            assert err.code() == code, (err.code(), err.details())
            assert [f for f, _ in field_violations(err)] == fields
        req = directives_pb2.UpdateDirectiveRequest(directive=directives_pb2.Directive(
            name=d.name, text="x"))
        req.update_mask.paths.extend(["text", "colour"])
        err = refused(lambda: m.directives.UpdateDirective(req))
        assert err.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert [f for f, _ in field_violations(err)] == ["update_mask.paths[1]"]
        assert m.get_directive("v", d.id).text == "Be brief."  # nothing changed
        err = refused(lambda: m.update_directive("v", d.id, text=""))
        assert [f for f, _ in field_violations(err)] == ["directive.text"]
        # an empty mask changes the fields populated in the request (AIP-134), keeps the rest
        m.update_directive("v", d.id, title="Brevity", tags=["style"])
        req = directives_pb2.UpdateDirectiveRequest(directive=directives_pb2.Directive(
            name=d.name, text="Be very brief.", priority=3))
        got = m.directives.UpdateDirective(req)
        assert (got.text, got.title, got.priority, got.active, list(got.tags)) == (
            "Be very brief.", "Brevity", 3, True, ["style"])


def test_directives_cli_round_trip(server):
    run = CliRunner()

    def cli(*args) -> str:
        out = run.invoke(app, [*args, "-a", server.address])
        assert out.exit_code == 0, out.output
        return out.stdout

    with server.client() as m:
        m.upsert_bank("c", retain_mission="Keep travel plans.")
    bank = json.loads(cli("banks", "update", "c", "--reflect-mission", "Advise travellers.",
                          "--skepticism", "5", "--no-auto-consolidate", "--json"))
    assert bank["config"]["reflect_mission"] == "Advise travellers."
    assert bank["config"]["skepticism"] == 5 and bank["config"]["auto_consolidate"] is False
    assert bank["config"]["retain_mission"] == "Keep travel plans."  # not named: kept
    assert json.loads(cli("banks", "get", "c", "--json")) == bank
    out = run.invoke(app, ["banks", "update", "c", "--skepticism", "9", "-a", server.address])
    assert out.exit_code == 2  # out of 1..5: a usage error, nothing sent
    out = run.invoke(app, ["banks", "update", "c", "-a", server.address])
    assert out.exit_code == 2 and "nothing to change" in out.output
    made = json.loads(cli("directives", "create", "c", GERMAN, "--priority", "2", "--tag",
                          "travel", "--title", "language", "--json"))
    assert made["text"] == GERMAN and made["priority"] == 2 and made["tags"] == ["travel"]
    assert made["create_time"].endswith("Z")  # ISO time, not epoch seconds
    listed = json.loads(cli("directives", "list", "c", "--json"))
    assert [d["id"] for d in listed] == [made["id"]]
    assert made["id"] in cli("directives", "list", "c")  # full id in the table
    changed = json.loads(cli("directives", "update", "c", made["id"], "--inactive",
                             "--clear-tags", "--json"))
    assert changed.get("active", False) is False and "tags" not in changed
    assert changed["text"] == GERMAN and changed["title"] == "language"
    got = json.loads(cli("directives", "get", "c", made["id"], "--json"))
    assert got == changed
    cli("directives", "delete", "c", made["id"])
    assert json.loads(cli("directives", "list", "c", "--json")) == []
    out = run.invoke(app, ["directives", "get", "c", made["id"], "-a", server.address])
    assert out.exit_code == 2 and "NOT_FOUND" in out.output
    out = run.invoke(app, ["directives", "update", "c", made["id"], "-a", server.address])
    assert out.exit_code == 2 and "nothing to change" in out.output
