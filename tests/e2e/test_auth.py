"""Authentication and authorisation on a real ``mneme up`` with MNEME_AUTH_MODE=api_key:
no key → UNAUTHENTICATED, a key for another bank or a read-only key doing a write →
PERMISSION_DENIED, and nothing is written (checked with an admin key); the audit trail
on ``mneme.audit.v1``; the Prometheus endpoint of the same server."""

from __future__ import annotations

import urllib.request

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from typer.testing import CliRunner

from mneme.bus import AUDIT, codec
from mneme.bus.sqlite_log import SqliteEventLog
from mneme.cli import app
from mneme.client import MnemeClient
from mneme.domain import derive_id
from mneme.v1 import operations_pb2
from tests.e2e.server import Server, free_port

ITEM = [{"content": "Alice moved to Lisbon in May 2023."}]


def _create_key(data_dir, bank: str, scope: str) -> tuple[str, str]:
    out = CliRunner().invoke(app, ["keys", "create", "--bank", bank, "--scope", scope,
                                   "--data-dir", str(data_dir)])
    assert out.exit_code == 0, out.output
    key = out.stdout.strip().splitlines()[-1]
    assert key.startswith("mneme_k")
    return key.split("_")[1], key


@pytest.fixture(scope="module")
def node(tmp_path_factory):
    data = tmp_path_factory.mktemp("auth") / "data"
    keys = {name: _create_key(data, bank, scope) for name, bank, scope in (
        ("admin", "*", "write"), ("alice_w", "alice", "write"), ("alice_r", "alice", "read"),
        ("bob_w", "bob", "write"))}
    stored = (data / "api_keys.json").read_text()
    assert all(k not in stored for _, k in keys.values())  # only hashes at rest
    metrics_port = free_port()
    srv = Server(data, env={"MNEME_AUTH_MODE": "api_key",
                            "MNEME_METRICS_PORT": str(metrics_port)}).start()
    with MnemeClient(srv.address, api_key=keys["admin"][1]) as admin:
        admin.upsert_bank("alice")
        admin.upsert_bank("bob")
    yield srv, keys, metrics_port
    srv.stop()


def _code(fn) -> grpc.StatusCode:
    with pytest.raises(grpc.RpcError) as e:
        fn()
    return e.value.code()


def test_refused_calls_get_their_status_and_write_nothing(node):
    srv, keys, _ = node
    with MnemeClient(srv.address, timeout=60, api_key="") as anon:
        # health stays open
        health = health_pb2_grpc.HealthStub(anon.channel)
        assert health.Check(health_pb2.HealthCheckRequest()).status == \
            health_pb2.HealthCheckResponse.SERVING
        assert _code(lambda: anon.retain("alice", ITEM)) == grpc.StatusCode.UNAUTHENTICATED
        assert _code(lambda: anon.upsert_bank("carol")) == grpc.StatusCode.UNAUTHENTICATED
        assert _code(lambda: anon.recall("alice", "Lisbon")) == grpc.StatusCode.UNAUTHENTICATED
    with MnemeClient(srv.address, timeout=60, api_key="mneme_kbad_nope") as bad:
        assert _code(lambda: bad.retain("alice", ITEM)) == grpc.StatusCode.UNAUTHENTICATED
    with MnemeClient(srv.address, timeout=60, api_key=keys["bob_w"][1]) as bob:
        assert _code(lambda: bob.retain("alice", ITEM)) == grpc.StatusCode.PERMISSION_DENIED
        assert _code(lambda: bob.delete_bank("alice")) == grpc.StatusCode.PERMISSION_DENIED
        assert _code(lambda: bob.recall("alice", "Lisbon")) == grpc.StatusCode.PERMISSION_DENIED
        assert _code(lambda: bob.list_banks()) == grpc.StatusCode.PERMISSION_DENIED
        # a tag scope is a filter, not a grant: keys stay per bank
        assert _code(lambda: list(bob.list_entities("alice", tags=["user:bob"]))) == \
            grpc.StatusCode.PERMISSION_DENIED
        assert _code(lambda: bob.get_entity("alice", derive_id("e"), tags=["user:bob"])) == \
            grpc.StatusCode.PERMISSION_DENIED
    with MnemeClient(srv.address, timeout=60, api_key=keys["alice_r"][1]) as reader:
        assert _code(lambda: reader.retain("alice", ITEM)) == grpc.StatusCode.PERMISSION_DENIED
        assert _code(lambda: reader.upsert_bank("alice", display_name="x")) == \
            grpc.StatusCode.PERMISSION_DENIED
        assert _code(lambda: reader.delete_bank("alice")) == grpc.StatusCode.PERMISSION_DENIED
        assert reader.recall("alice", "Lisbon").results == []  # reads are allowed
        assert list(reader.list_entities("alice", tags=["user:alice"])) == []
        assert reader.get_bank("alice").display_name == ""
    with MnemeClient(srv.address, timeout=60, api_key=keys["admin"][1]) as admin:
        assert {b.name for b in admin.list_banks()} == {"banks/alice", "banks/bob"}
        assert list(admin.list_memories("alice")) == []
        assert list(admin.list_operations("alice")) == []
        assert admin.get_bank("alice").display_name == ""


def test_a_refusal_carries_an_error_info_naming_its_reason_and_bank(node):
    from google.rpc import error_details_pb2
    from grpc_status import rpc_status
    srv, keys, _ = node

    def info(fn) -> tuple[grpc.StatusCode, error_details_pb2.ErrorInfo]:
        with pytest.raises(grpc.RpcError) as e:
            fn()
        got = error_details_pb2.ErrorInfo()
        assert any(d.Unpack(got) for d in rpc_status.from_call(e.value).details)
        return e.value.code(), got

    with MnemeClient(srv.address, timeout=60, api_key="") as anon:
        code, got = info(lambda: anon.recall("alice", "Lisbon"))
        assert code == grpc.StatusCode.UNAUTHENTICATED
        assert (got.domain, got.reason) == ("mneme", "UNAUTHENTICATED")
    with MnemeClient(srv.address, timeout=60, api_key=keys["bob_w"][1]) as bob:
        code, got = info(lambda: bob.recall("alice", "Lisbon"))
        assert code == grpc.StatusCode.PERMISSION_DENIED
        assert (got.reason, dict(got.metadata)) == ("PERMISSION_DENIED", {"bank": "alice"})


def test_allowed_writes_and_the_audit_trail(node):
    srv, keys, _ = node
    with MnemeClient(srv.address, timeout=120, api_key=keys["alice_w"][1]) as alice:
        r = alice.retain("alice", ITEM)
        assert r.memory_ids
        op = alice.get_operation(r.operation.name.split("/", 1)[1])
        assert op.name == r.operation.name
        # past the key check: the operation has ended
        assert _code(lambda: alice.cancel_operation(op.name)) == \
            grpc.StatusCode.FAILED_PRECONDITION
    with MnemeClient(srv.address, timeout=60, api_key=keys["alice_r"][1]) as reader:
        for call in (reader.cancel_operation, reader.retry_operation):  # writes
            assert _code(lambda: call(op.name)) == grpc.StatusCode.PERMISSION_DENIED
    with MnemeClient(srv.address, timeout=60, api_key=keys["bob_w"][1]) as bob:
        # another bank's operation is not readable with bob's key, nor cancelled
        assert _code(lambda: bob.get_operation(r.operation.name.split("/", 1)[1])) == \
            grpc.StatusCode.PERMISSION_DENIED
        assert _code(lambda: bob.cancel_operation(op.name)) == grpc.StatusCode.PERMISSION_DENIED
        bob.delete_bank("bob")
    log = SqliteEventLog(srv.data_dir / "log.db")
    try:
        audits = [codec.decode(rec).message for rec in log.read(AUDIT, 0, 0, 1000)]
    finally:
        log.close()
    seen = {(a.method.rsplit("/", 1)[1], a.bank_id, a.principal, a.outcome) for a in audits}
    assert ("Retain", "alice", "unknown", "unauthenticated") in seen
    assert ("Retain", "alice", f"key:{keys['bob_w'][0]}", "permission_denied") in seen
    assert ("Retain", "alice", f"key:{keys['alice_w'][0]}", "allowed") in seen
    assert ("DeleteBank", "bob", f"key:{keys['bob_w'][0]}", "allowed") in seen
    assert all(a.peer for a in audits)


def test_another_banks_operation_looks_like_an_unknown_one(node):
    """A retain's operation id derives from its bank and request_id, so a tenant who
    guesses another's bank and request_id can compute it. Asked for with a key of
    another bank, GetOperation, CancelOperation and RetryOperation must answer exactly as
    for an operation that does not exist, naming no bank: before, the other bank's
    operation was PERMISSION_DENIED "may not read bank 'alice'" and an unknown one
    NOT_FOUND, which told that the request had been made, and by which bank."""
    srv, keys, _ = node
    with MnemeClient(srv.address, timeout=120, api_key=keys["alice_w"][1]) as alice:
        op = alice.retain("alice", ITEM, request_id="payroll-2026-12").operation
    assert op.name == f"operations/{derive_id('retain', 'alice', 'payroll-2026-12')}"
    unknown = f"operations/{derive_id('retain', 'alice', 'payroll-2027-01')}"
    with MnemeClient(srv.address, timeout=60, api_key=keys["bob_w"][1]) as bob:
        for call in (bob.get_operation, bob.cancel_operation, bob.retry_operation):
            answers = []
            for name in (op.name, unknown):
                with pytest.raises(grpc.RpcError) as e:
                    call(name)
                answers.append((e.value.code(), e.value.details().replace(name[11:], "ID")))
            assert answers[0] == answers[1], (call.__name__, answers)
            assert answers[0][0] == grpc.StatusCode.PERMISSION_DENIED
            assert "alice" not in answers[0][1]
    with MnemeClient(srv.address, timeout=60, api_key=keys["admin"][1]) as admin:
        assert _code(lambda: admin.get_operation(unknown)) == grpc.StatusCode.NOT_FOUND
        assert admin.get_operation(op.name).state == operations_pb2.SUCCEEDED


def test_prometheus_endpoint(node):
    srv, keys, port = node
    with MnemeClient(srv.address, timeout=60, api_key=keys["alice_r"][1]) as m:
        m.recall("alice", "Where does Alice live?")
    text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10).read().decode()
    for name in ("mneme_retain_documents_total", "mneme_recall_duration_seconds_count",
                 "mneme_retain_duration_seconds_count", "rpc_server_duration_milliseconds",
                 "mneme_consumer_lag", "mneme_auth_requests_total"):
        assert name in text, name
    assert 'outcome="permission_denied"' in text
    assert 'messaging_consumer_group_name="search"' in text


def test_a_tenants_key_sees_no_other_banks_write_volume_in_its_stats(node):
    """GetBankStats' consumer lag is per partition, which other banks share: a key limited
    to some banks gets its own bank's counts but no lag (pending_records -1), so it cannot
    watch another tenant's writes; a ``*`` key still gets the lag. Before, alice's key saw
    bob's retains as lag on alice's partition."""
    srv, keys, _ = node
    with MnemeClient(srv.address, timeout=60, api_key=keys["admin"][1]) as admin:
        full = admin.bank_stats("alice")
        assert full.pending_records >= 0 and full.lag
    with MnemeClient(srv.address, timeout=60, api_key=keys["alice_r"][1]) as alice:
        mine = alice.bank_stats("alice")
    assert mine.name == "banks/alice" and mine.operations == full.operations
    assert (list(mine.lag), mine.pending_records) == ([], -1)
