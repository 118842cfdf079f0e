"""Issue 9 regressions through the gRPC API of a real ``mneme up`` process: limits,
times, names and page tokens, UpdateBank, idempotency per bank incarnation, per-item
retain failures, Reflect's query_timestamp, bank stats and the CLI's usage errors."""

from __future__ import annotations

import os
import signal
import subprocess
import threading
import time
from datetime import datetime, timedelta, timezone

import grpc
import pytest
from google.protobuf import field_mask_pb2, timestamp_pb2
from typer.testing import CliRunner

from mneme.cli import app
from mneme.client import field_violations
from mneme.v1 import banks_pb2, memory_pb2, observations_pb2, operations_pb2, recall_pb2
from mneme.v1 import reflect_pb2, resources_pb2
from tests.e2e.server import Server
from tests.waits import drained

T0 = datetime(2024, 5, 20, 12, tzinfo=timezone.utc)
QUERY_CHARS = 2000  # MNEME_LIMIT_QUERY_CHARS of the server below


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    s = Server(tmp_path_factory.mktemp("hardening") / "data",
               env={"MNEME_LIMIT_QUERY_CHARS": str(QUERY_CHARS)}).start()
    yield s
    s.stop()


@pytest.fixture(scope="module")
def m(server):
    with server.client(timeout=120) as c:
        yield c


def refused(call, *fields: str) -> list[tuple[str, str]]:
    """Run ``call``; assert INVALID_ARGUMENT whose violations name each of ``fields``."""
    with pytest.raises(grpc.RpcError) as e:
        call()
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT, e.value.details()
    got = field_violations(e.value)
    named = {f for f, _ in got}
    for f in fields:
        assert f in named, (f, got)
    return got


def still_readable(m, bank: str) -> None:
    """The property the fuzz suite checks too: the bank answers Recall and ListMemories."""
    m.recall(bank, "anything at all")
    list(m.list_memories(bank))


# ---- 1. limits: a huge query is refused at once, before any model runs -------------------


def test_oversized_query_and_context_are_refused_naming_the_field(m):
    m.upsert_bank("limits")
    refused(lambda: m.recall("limits", "x" * 1_000_000), "query")
    refused(lambda: m.reflect("limits", "x" * (QUERY_CHARS + 1)), "query")
    refused(lambda: list(m.stream_reflect("limits", "y" * 1_000_000)), "query")
    refused(lambda: m.reflect("limits", "ok?", context="c" * 100_000), "context")
    # The configured bound is the limit: one character under it is accepted.
    m.recall("limits", "q" * QUERY_CHARS)
    refused(lambda: m.retain("limits", [{"content": "a", "tags": [f"t{i}" for i in range(65)]}]),
            "items[0].tags")
    refused(lambda: m.retain("limits", [{"content": "a", "tags": ["bad\ttag"]}]),
            "items[0].tags[0]")
    refused(lambda: m.retain("limits", [{"content": "a",
                                         "metadata": {f"k{i}": "v" for i in range(65)}}]),
            "items[0].metadata")
    refused(lambda: m.recall_stub.Recall(recall_pb2.RecallRequest(
        parent="banks/limits", query="q", budget=42, tags_match=77)), "budget", "tags_match")
    refused(lambda: m.recall_stub.Recall(recall_pb2.RecallRequest(
        parent="banks/limits", query="q", max_tokens=-1)), "max_tokens")
    still_readable(m, "limits")


def test_a_request_over_the_byte_limit_is_resource_exhausted(m):
    m.upsert_bank("bytes")
    items = [{"content": "z" * 190_000} for _ in range(200)]  # ~38 MB > 32 MiB
    with pytest.raises(grpc.RpcError) as e:
        m.retain("bytes", items)
    assert e.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    still_readable(m, "bytes")


def test_sigterm_drains_promptly_under_recall_load(tmp_path):
    s = Server(tmp_path / "data").start()
    try:
        with s.client(timeout=60) as c:
            c.upsert_bank("load")
            c.retain("load", [{"content": f"Person {i} likes topic {i}.", "timestamp": T0}
                              for i in range(40)])
        stop = threading.Event()

        def hammer():
            with s.client(timeout=30) as c:
                while not stop.is_set():
                    try:
                        c.recall("load", "who likes topic 7?")
                    except grpc.RpcError:
                        return

        threads = [threading.Thread(target=hammer, daemon=True) for _ in range(6)]
        for t in threads:
            t.start()
        time.sleep(2)
        s.proc.send_signal(signal.SIGTERM)
        # Graceful shutdown must end by itself (the server grants 5 s to in-flight calls).
        code = s.proc.wait(timeout=60)
        stop.set()
        assert code == 0, s.log.read_text()[-2000:]
    finally:
        s.stop()


# ---- 2. times ---------------------------------------------------------------------------


def _ts(seconds: int, nanos: int = 0) -> timestamp_pb2.Timestamp:
    return timestamp_pb2.Timestamp(seconds=seconds, nanos=nanos)


def test_edge_timestamps_never_make_a_bank_unreadable(server, m):
    m.upsert_bank("edge-times")
    # The top of the Timestamp range with relative dates: resolved times are clamped.
    top = memory_pb2.RetainItem(content="Alice: next year I will move to Paris, tomorrow too",
                                timestamp=_ts(253402300000))
    bottom = memory_pb2.RetainItem(content="Bob: last year I lived in Rome, yesterday too",
                                   timestamp=_ts(-62135596800))
    r = m.memory.Retain(memory_pb2.RetainRequest(parent="banks/edge-times", items=[top, bottom]))
    assert r.operation.state == operations_pb2.SUCCEEDED
    res = m.recall("edge-times", "Where will Alice move?")
    assert res.results
    assert len(list(m.list_memories("edge-times"))) >= 2
    m.recall_stub.Recall(recall_pb2.RecallRequest(
        parent="banks/edge-times", query="what happens next year?", query_timestamp=_ts(253402300000)))
    for seconds, nanos in ((253402300800, 0), (-62135596801, 0), (10, -1), (10, 1_000_000_000)):
        refused(lambda: m.memory.Retain(memory_pb2.RetainRequest(
            parent="banks/edge-times", items=[memory_pb2.RetainItem(
                content="x", timestamp=_ts(seconds, nanos))])), "items[0].timestamp")
        refused(lambda: m.recall_stub.Recall(recall_pb2.RecallRequest(
            parent="banks/edge-times", query="q", query_timestamp=_ts(seconds, nanos))),
            "query_timestamp")
        refused(lambda: m.recall_stub.Recall(recall_pb2.RecallRequest(
            parent="banks/edge-times", query="q",
            time_range=memory_pb2.TimeRange(start=_ts(seconds, nanos)))), "time_range.start")
        refused(lambda: m.reflect_stub.Reflect(reflect_pb2.ReflectRequest(
            parent="banks/edge-times", query="q", query_timestamp=_ts(seconds, nanos))),
            "query_timestamp")
    # ... and across a restart (the stores and the log are read again).
    server.stop()
    server.start()
    with server.client(timeout=120) as again:
        still_readable(again, "edge-times")


# ---- 4. request_id belongs to one incarnation of a bank -----------------------------------


def test_request_id_after_delete_and_recreate_stores_the_new_items(m):
    m.upsert_bank("reborn")
    first = m.retain("reborn", [{"content": "Dan likes coffee.", "timestamp": T0}], request_id="r-1")
    again = m.retain("reborn", [{"content": "Dan likes coffee.", "timestamp": T0}], request_id="r-1")
    assert again.operation.name == first.operation.name  # idempotent within one life
    m.delete_bank("reborn")
    m.upsert_bank("reborn")
    assert list(m.list_operations("reborn")) == []  # old operations are gone with the bank
    second = m.retain("reborn", [{"content": "Eve likes juice.", "timestamp": T0}], request_id="r-1")
    assert second.operation.name != first.operation.name
    assert second.memory_ids and set(second.memory_ids).isdisjoint(first.memory_ids)
    texts = [x.text for x in m.list_memories("reborn")]
    assert any("Eve" in t for t in texts) and not any("Dan" in t for t in texts)
    assert [o.name for o in m.list_operations("reborn")] == [second.operation.name]


def test_a_request_id_sent_again_with_other_items_is_refused_naming_it(m):
    """A request_id reused for a different retain (a client bug: a counter reset, a key
    reused) was answered with the first request's operation, SUCCEEDED, and the new items
    were dropped without a word. It is INVALID_ARGUMENT naming ``request_id``, whether the
    first request is in the catalog already or only just appended (async), and nothing of
    the second is stored; the identical request stays idempotent."""
    m.upsert_bank("reuse")
    first = m.retain("reuse", [{"content": "Ivy plays the cello.", "timestamp": T0}],
                     request_id="r-1")
    for other in ([{"content": "Jon plays the drums.", "timestamp": T0}],
                  [{"content": "Ivy plays the cello.", "timestamp": T0, "tags": ["music"]}],
                  [{"content": "Ivy plays the cello.", "timestamp": T0},
                   {"content": "Jon plays the drums.", "timestamp": T0}]):
        refused(lambda: m.retain("reuse", other, request_id="r-1"), "request_id")
    async_items = [{"content": "Kim paints murals.", "timestamp": T0}]
    m.retain("reuse", async_items, async_=True, request_id="r-2")
    refused(lambda: m.retain("reuse", [{"content": "Kim sings.", "timestamp": T0}],
                             async_=True, request_id="r-2"), "request_id")
    again = m.retain("reuse", [{"content": "Ivy plays the cello.", "timestamp": T0}],
                     request_id="r-1")
    assert again.operation.name == first.operation.name
    drained(m, "reuse")
    texts = [x.text for x in m.list_memories("reuse")]
    assert not any("Jon" in t or "sings" in t for t in texts), texts
    assert len(list(m.list_operations("reuse"))) == 2


def test_delete_memory_of_a_memory_the_bank_does_not_hold_fails_and_deletes_nothing(m):
    """DeleteMemory's operation fails with "memory not found" for an id never retained,
    one deleted already, or one of another bank (AIP-135: a missing resource is an
    error), and for an observation's id; the bank's other memories stay readable."""
    import uuid

    m.upsert_bank("del-a")
    m.upsert_bank("del-b")
    a = m.retain("del-a", [{"content": "Ola sails on Lake Garda.", "timestamp": T0},
                           {"content": "Ola repairs old radios.", "timestamp": T0}]).memory_ids
    b = m.retain("del-b", [{"content": "Piet grows tulips.", "timestamp": T0}]).memory_ids
    assert len(a) >= 2 and b
    op = m.delete_memory("del-a", a[0])
    assert (op.state, op.error) == (operations_pb2.SUCCEEDED, "")
    for bank, memory in (("del-a", a[0]), ("del-a", str(uuid.uuid4())), ("del-a", b[0])):
        op = m.delete_memory(bank, memory)
        assert (op.kind, op.state, op.error) == ("delete_memory", operations_pb2.FAILED,
                                                 "memory not found"), (bank, memory)
    assert {x.id for x in m.list_memories("del-a")} == set(a[1:])
    assert {x.id for x in m.list_memories("del-b")} == set(b)
    # an observation is consolidation's: DeleteMemory refuses it and it stays
    drained(m, "del-b")
    (obs,) = m.list_observations("del-b")
    op = m.delete_memory("del-b", obs.id)
    assert op.state == operations_pb2.FAILED and "ClearObservations" in op.error
    assert m.get_observation("del-b", obs.id).text == obs.text
    hits = m.recall("del-b", "Piet grows tulips", types=["observation"]).results
    assert obs.id in {r.memory.id for r in hits}


def test_identical_retains_at_once_append_once_and_keep_the_documents_facts(m):
    """Two calls with one request_id and document at the same moment (a client's retry
    racing its first try): one operation, appended once. A second copy on the log would
    be handled as a replacement of the document, its facts gone for a moment after both
    calls returned."""
    m.upsert_bank("twice")
    items = [{"content": f"Lena{i} collects stamps from Peru.", "document_id": "album",
              "timestamp": T0} for i in range(20)]
    for attempt in range(3):
        rid = f"same-{attempt}"
        barrier, out = threading.Barrier(2), []

        def call() -> None:
            barrier.wait()
            out.append(m.retain("twice", items, request_id=rid))
        threads = [threading.Thread(target=call) for _ in range(2)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(120)
        assert len(out) == 2 and out[0].operation.name == out[1].operation.name
        assert sorted(out[0].memory_ids) == sorted(out[1].memory_ids) and out[0].memory_ids
        end = time.monotonic() + 1.5
        while time.monotonic() < end:  # read back at once and for a while: never a gap
            assert len(list(m.list_memories("twice", document_id="album"))) == 20
            m.get_memory("twice", out[0].memory_ids[0])
    ops = [o for o in m.list_operations("twice")]
    assert len(ops) == 3 and len({o.name for o in ops}) == 3
    # an async call and its repeat right after it (before it is projected): one operation
    first = m.retain("twice", items, async_=True, request_id="async-1")
    again = m.retain("twice", items, async_=True, request_id="async-1")
    assert again.operation.name == first.operation.name
    assert len(list(m.list_operations("twice"))) == 4


# ---- 6. names and page tokens -------------------------------------------------------------


def test_odd_digits_forged_tokens_and_empty_filters_are_refused_naming_the_field(m):
    """Inputs a fuzzer found answered with UNKNOWN or taken as something else."""
    import base64
    import uuid

    from mneme.v1 import entities_pb2, generations_pb2
    m.upsert_bank("odd")
    m.retain("odd", [{"content": "Lena collects stamps from Peru.", "timestamp": T0}])
    # "²" passes str.isdigit() but not int(); "３" and "٣" int() reads as 3
    for n in ("\u00b2", "\uff13", "\u0663", "03"):
        refused(lambda: m.generations.GetGeneration(
            generations_pb2.GetGenerationRequest(name=f"generations/{n}")), "name")
        refused(lambda: m.generations.DeleteGeneration(
            generations_pb2.DeleteGenerationRequest(name=f"generations/{n}")), "name")
    # a forged page token: a lone surrogate, an object of two keys
    for raw in (b'["banks","\\ud800"]', b'{"banks":0,"x":0}'):
        token = base64.urlsafe_b64encode(raw).decode().rstrip("=")
        refused(lambda: m.banks.ListBanks(banks_pb2.ListBanksRequest(page_token=token)),
                "page_token")
    refused(lambda: list(m.list_opinions("odd", entity_id="banks/odd/entities/x")), "entity_id")
    refused(lambda: list(m.list_observations("odd", scope=[""])), "scope[0]")
    entity = next(iter(m.entities.ListEntities(
        entities_pb2.ListEntitiesRequest(parent="banks/odd")).entities))
    memory = next(iter(m.list_memories("odd"))).name
    refused(lambda: m.entities.SplitEntity(entities_pb2.SplitEntityRequest(
        name=entity.name, memories=[memory] * 300, display_name="N")), "memories")
    assert list(m.list_opinions("odd", entity_id=str(uuid.uuid4()))) == []


def test_resource_ids_are_matched_in_full(m):
    for bad in ("names\n", "names ", "Names", "ä", "a" * 64, "a/b"):
        refused(lambda: m.get_bank(bad), "name")
        refused(lambda: m.upsert_bank(bad), "bank.name")
        refused(lambda: m.retain(bad, [{"content": "x"}]), "parent")
        refused(lambda: m.recall(bad, "x"), "parent")
    m.upsert_bank("names")
    for bad in ("not-a-uuid", "0B7A6B8E-4F5C-5D7E-9A1B-2C3D4E5F6A7B",
                "0b7a6b8e-4f5c-5d7e-9a1b-2c3d4e5f6a7b\n"):
        refused(lambda: m.get_memory("names", bad), "name")
        refused(lambda: m.get_operation(bad), "name")
        refused(lambda: m.get_observation("names", bad), "name")


def test_page_tokens_are_opaque_and_validated_on_every_list(m):
    for b in ("pages-a", "pages-b", "pages-c"):
        m.upsert_bank(b)
        for n in range(2):
            m.retain(b, [{"content": f"{b} fact {n}{i}.", "timestamp": T0} for i in range(2)])
    r = m.banks.ListBanks(banks_pb2.ListBanksRequest(page_size=1))
    assert r.next_page_token
    nxt = m.banks.ListBanks(banks_pb2.ListBanksRequest(page_size=1, page_token=r.next_page_token))
    assert nxt.banks[0].name != r.banks[0].name
    ops = m.operations.ListOperations(operations_pb2.ListOperationsRequest(
        parent="banks/pages-a", page_size=1))
    assert ops.next_page_token
    mems = m.recall_stub.ListMemories(memory_pb2.ListMemoriesRequest(parent="banks/pages-a",
                                                                     page_size=1))
    for token in ("garbage", "MTA=", "e30", "%%%", r.next_page_token + "x"):
        refused(lambda: m.banks.ListBanks(banks_pb2.ListBanksRequest(page_token=token)),
                "page_token")
        refused(lambda: m.operations.ListOperations(operations_pb2.ListOperationsRequest(
            page_token=token)), "page_token")
        refused(lambda: m.recall_stub.ListMemories(memory_pb2.ListMemoriesRequest(
            parent="banks/pages-a", page_token=token)), "page_token")
        refused(lambda: m.observations.ListObservations(observations_pb2.ListObservationsRequest(
            parent="banks/pages-a", page_token=token)), "page_token")
        refused(lambda: m.observations.ListObservationScopes(
            observations_pb2.ListObservationScopesRequest(parent="banks/pages-a",
                                                          page_token=token)), "page_token")
    # A token is bound to its list: another list's, or another bank's, is refused.
    refused(lambda: m.operations.ListOperations(operations_pb2.ListOperationsRequest(
        page_token=r.next_page_token)), "page_token")
    refused(lambda: m.operations.ListOperations(operations_pb2.ListOperationsRequest(
        parent="banks/pages-b", page_token=ops.next_page_token)), "page_token")
    refused(lambda: m.recall_stub.ListMemories(memory_pb2.ListMemoriesRequest(
        parent="banks/pages-b", page_token=mems.next_page_token)), "page_token")
    refused(lambda: m.banks.ListBanks(banks_pb2.ListBanksRequest(page_size=-1)), "page_size")
    # forged positions: a time past what a store takes, not a (time, id), an id with a NUL
    from mneme.paging import encode_token
    for parent, token in (("banks/pages-a", encode_token(("operations", "pages-a"), [2**70, "x"])),
                          ("", encode_token(("operations", ""), 2**62)),
                          ("", encode_token(("operations", ""), [1.5, "a\x00b"]))):
        refused(lambda: m.operations.ListOperations(operations_pb2.ListOperationsRequest(
            parent=parent, page_token=token)), "page_token")
    refused(lambda: m.banks.ListBanks(banks_pb2.ListBanksRequest(
        page_token=encode_token("banks", "a\x00b"))), "page_token")
    still_readable(m, "pages-a")


# ---- 7. UpdateBank changes only what its mask names ----------------------------------------


def test_update_bank_keeps_what_it_is_not_given(m):
    m.upsert_bank("upd", display_name="Old", retain_mission="Keep names of pets.", skepticism=5)
    b = m.update_bank("upd", display_name="New name")
    assert b.display_name == "New name"
    assert b.config.retain_mission == "Keep names of pets." and b.config.skepticism == 5
    b = m.update_bank("upd", retain_mission="Keep birthdays.")
    assert (b.display_name, b.config.retain_mission, b.config.skepticism) == (
        "New name", "Keep birthdays.", 5)
    assert m.get_bank("upd").config.retain_mission == "Keep birthdays."
    refused(lambda: m.banks.UpdateBank(banks_pb2.UpdateBankRequest(
        bank=resources_pb2.Bank(name="banks/upd"),
        update_mask=field_mask_pb2.FieldMask(paths=["config.nope"]))), "update_mask.paths[0]")
    refused(lambda: m.update_bank("upd", skepticism=9), "bank.config.skepticism")
    refused(lambda: m.update_bank("upd", erasure="shred"), "bank.config.erasure")
    refused(lambda: m.update_bank("upd", extraction_mode="LLM"), "bank.config.extraction_mode")
    assert m.update_bank("upd", extraction_mode="llm_only").config.extraction_mode == "llm_only"
    assert m.get_bank("upd").config.erasure == "crypto_shred"  # the default
    with pytest.raises(grpc.RpcError) as e:
        m.update_bank("no-such-bank", display_name="x")
    assert e.value.code() == grpc.StatusCode.NOT_FOUND
    # Upsert keeps its documented replace semantics.
    b = m.upsert_bank("upd", display_name="Replaced")
    assert b.config.retain_mission == "" and b.config.skepticism == 3


def test_cli_bank_update(server, m):
    m.upsert_bank("cli-upd", display_name="A", retain_mission="Missions stay.")
    out = CliRunner().invoke(app, ["banks", "update", "cli-upd", "--name", "B",
                                   "--set", "empathy=4", "-a", server.address])
    assert out.exit_code == 0, out.output
    b = m.get_bank("cli-upd")
    assert (b.display_name, b.config.empathy, b.config.retain_mission) == ("B", 4, "Missions stay.")
    # printed for reading: field per line, the config nested, times as RFC 3339
    said = out.stdout.splitlines()
    assert "display_name: B" in said and "config:" in said and "  empathy: 4" in said
    assert any(x.startswith("create_time: 20") and x.endswith("Z") for x in said), said
    # create takes the config it is given (it was ignored)
    out = CliRunner().invoke(app, ["banks", "create", "cli-new", "--skepticism", "5", "--set",
                                   "auto_consolidate=false", "-a", server.address])
    assert out.exit_code == 0, out.output
    b = m.get_bank("cli-new")
    assert (b.config.skepticism, b.config.auto_consolidate) == (5, False)


# ---- 11. one bad item fails alone ----------------------------------------------------------


def test_one_oversized_item_fails_alone(m):
    m.upsert_bank("batch")
    r = m.retain("batch", [{"content": "Frank plays the cello.", "timestamp": T0},
                           {"content": "y" * 300_000, "timestamp": T0},
                           {"content": "Gina: hi", "document_id": "doc\x001", "timestamp": T0},
                           {"content": "   ", "timestamp": T0},
                           {"content": "Hugo collects stamps.", "timestamp": T0}])
    op = r.operation
    assert op.state == operations_pb2.SUCCEEDED and op.items_total == 5
    errors = {e.item_index: e for e in op.item_errors}
    assert set(errors) == {1, 2, 3}
    assert errors[1].field == "items[1].content" and "200000" in errors[1].error
    assert errors[2].field == "items[2].document_id"
    assert errors[3].field == "items[3].content"
    texts = [x.text for x in m.list_memories("batch")]
    assert any("cello" in t for t in texts) and any("stamps" in t for t in texts)
    assert not any("y" * 100 in t for t in texts)
    got = m.get_operation(op.name.split("/", 1)[1])
    assert [e.item_index for e in got.item_errors] == [1, 2, 3]
    # When every item is bad nothing is appended: the request is refused.
    refused(lambda: m.retain("batch", [{"content": ""}, {"content": "n\x00l"}]),
            "items[0].content", "items[1].content")


# ---- 12. Reflect has a "now" ----------------------------------------------------------------


def test_reflect_query_timestamp_resolves_relative_questions(m):
    m.upsert_bank("now")
    m.retain("now", [
        {"content": "Ivy: I went hiking in the Alps today.", "timestamp": T0 - timedelta(days=6)},
        {"content": "Ivy: I went to a pottery class today.", "timestamp": T0 - timedelta(days=300)},
    ])
    r = m.reflect("now", "What did Ivy do last week?", query_timestamp=T0)
    assert "Alps" in r.text.split("\n")[1], r.text  # the best-quoted memory is last week's
    earlier = m.reflect("now", "What did Ivy do last week?",
                        query_timestamp=T0 - timedelta(days=293))
    assert "pottery" in earlier.text.split("\n")[1], earlier.text


# ---- 13. stats and CLI usage errors -------------------------------------------------------


def test_embedded_stats_count_only_groups_that_run(m):
    m.upsert_bank("stats")
    s = m.bank_stats("stats")
    groups = {x.group for x in s.lag}
    assert groups == {"ingest", "extraction", "search", "consolidation", "reflect-refresh",
                      "reflect-opinions", "search-documents"}
    assert s.pending_records == 0 or s.pending_records == sum(x.lag for x in s.lag)


@pytest.mark.parametrize("args, allowed", [
    (["recall", "b", "q", "--budget", "huge"], "low, mid, high"),
    (["recall", "b", "q", "--tags-match", "some"], "any, all"),
    (["reflect", "b", "q", "--budget", "x"], "low, mid, high"),
])
def test_cli_bad_choices_name_the_allowed_values(server, args, allowed):
    out = CliRunner().invoke(app, [*args, "-a", server.address])
    assert out.exit_code == 2, out.output
    assert allowed in out.output and "Traceback" not in out.output
    assert out.exception is None or isinstance(out.exception, SystemExit)


# ---- read-your-writes: an operation an async call returns is found at once --------------


def test_an_async_operation_is_found_the_moment_it_is_returned(m):
    """GetOperation, CancelOperation and ListOperations right after an async Retain or
    Consolidate find the operation the call named (the catalog is a projection of the
    log; the call answers once the operation is in it)."""
    m.upsert_bank("ryw")
    for n in range(25):
        r = m.retain("ryw", [{"content": f"Olaf: I counted to {n}.", "timestamp": T0}],
                     async_=True)
        got = m.get_operation(r.operation.name)
        assert got.name == r.operation.name
        if n % 5 == 0:  # a cancel straight away finds it too (or it has ended already)
            try:
                assert m.cancel_operation(r.operation.name).name == r.operation.name
            except grpc.RpcError as e:
                assert e.code() == grpc.StatusCode.FAILED_PRECONDITION, e.details()
        c = m.memory.Consolidate(memory_pb2.ConsolidateRequest(parent="banks/ryw",
                                                               **{"async": True}))
        assert m.get_operation(c.name).name == c.name
    listed = m.operations.ListOperations(operations_pb2.ListOperationsRequest(
        parent="banks/ryw", page_size=1000))
    assert {o.name for o in listed.operations} >= {r.operation.name, c.name}


def test_a_cancel_stops_a_large_offline_retain_and_keeps_what_was_done(m):
    """A thousand turns retained async and cancelled at once: the offline extraction and
    embedding stop within a slice of their work, so most items are not processed; the
    operation ends FAILED cancelled, and exactly the facts it counts are stored and
    readable."""
    m.upsert_bank("cancel-big")
    items = [{"content": f"{'Ada' if k % 2 else 'Ben'}: On day {k} I walked {k} miles along "
                         f"the river to the old mill, painted it and talked about books.",
              "timestamp": T0 + timedelta(minutes=k), "document_id": "chat"}
             for k in range(1000)]
    r = m.retain("cancel-big", items, async_=True)
    m.cancel_operation(r.operation.name)
    drained(m, "cancel-big")
    op = m.get_operation(r.operation.name)
    assert op.state == operations_pb2.FAILED and op.cancelled, op
    assert 0 <= op.items_done < op.items_total == 1000
    cancelled = [e for e in op.item_errors if e.error.startswith("cancelled: ")]
    assert len(cancelled) == 1000 - op.items_done
    assert len(list(m.list_memories("cancel-big"))) == op.facts
    still_readable(m, "cancel-big")


def test_request_bytes_that_do_not_parse_are_invalid_argument(m):
    """Corrupt wire bytes, a string field that is not UTF-8, or a message nested past
    protobuf's recursion limit: INVALID_ARGUMENT naming ``request`` (grpcio alone answers
    INTERNAL), and the server goes on serving."""
    m.upsert_bank("undecodable")
    m.retain("undecodable", [{"content": "Ada: I moved to Lisbon in May.", "timestamp": T0}])
    raw = lambda method: m.channel.unary_unary(  # noqa: E731
        method, request_serializer=lambda b: b, response_deserializer=lambda b: b)
    query = recall_pb2.RecallRequest(parent="banks/undecodable", query="Lisbon").SerializeToString()
    bad_utf8 = query.replace(b"Lisbon", b"Lis\xff\xfen")
    for method, body in (("/mneme.v1.RecallService/Recall", bad_utf8),
                         ("/mneme.v1.RecallService/Recall", b"\xff\xff\xff\xff"),
                         ("/mneme.v1.MemoryService/Retain", b"\x0a\x05banks\x12\x03\x0a\x01\xff"),
                         ("/mneme.v1.ReflectService/StreamReflect", b"\xff\xff")):
        call = raw(method) if "Stream" not in method else (
            lambda b, f=m.channel.unary_stream(method, request_serializer=lambda b: b,
                                               response_deserializer=lambda b: b): list(f(b)))
        fields = refused(lambda: call(body), "request")
        assert "do not parse" in fields[0][1]
    # a response schema nested deeper than protobuf parses (a Struct takes 3 levels a JSON
    # object): refused whole, as nothing of it can be read
    schema: dict = {"type": "string"}
    for _ in range(40):
        schema = {"type": "object", "properties": {"x": schema}}
    deep = reflect_pb2.ReflectRequest(parent="banks/undecodable", query="Where does Ada live?")
    deep.response_schema.update(schema)
    refused(lambda: raw("/mneme.v1.ReflectService/Reflect")(deep.SerializeToString()), "request")
    still_readable(m, "undecodable")
    assert "Lisbon" in m.recall("undecodable", "Lisbon").results[0].memory.text


def test_empty_tags_are_refused_wherever_tags_are_given(m):
    """An empty tag is refused the same way in every request that takes tags (no memory
    carries one), and a list of an unknown bank's operations is NOT_FOUND."""
    m.upsert_bank("tags-empty")
    refused(lambda: m.recall_stub.Recall(recall_pb2.RecallRequest(
        parent="banks/tags-empty", query="anything", tags=["a", " "])), "tags[1]")
    refused(lambda: m.reflect_stub.Reflect(reflect_pb2.ReflectRequest(
        parent="banks/tags-empty", query="anything", tags=[""])), "tags[0]")
    scopes = resources_pb2.ObservationScopes(
        mode=resources_pb2.ObservationScopes.EXPLICIT,
        scopes=[resources_pb2.ObservationScopes.Scope(tags=["x"]),
                resources_pb2.ObservationScopes.Scope(tags=["y", ""])])
    refused(lambda: m.retain("tags-empty", [{"content": "Ada: I like tea.", "timestamp": T0}],
                             observation_scopes=scopes),
            "observation_scopes.scopes[1].tags[1]")
    refused(lambda: m.memory.Consolidate(memory_pb2.ConsolidateRequest(
        parent="banks/tags-empty", observation_scopes=scopes)),
        "observation_scopes.scopes[1].tags[1]")
    assert not list(m.list_memories("tags-empty"))  # nothing was appended
    with pytest.raises(grpc.RpcError) as e:
        m.operations.ListOperations(operations_pb2.ListOperationsRequest(
            parent="banks/never-was"))
    assert e.value.code() == grpc.StatusCode.NOT_FOUND
    assert not m.operations.ListOperations(operations_pb2.ListOperationsRequest(
        parent="banks/tags-empty")).operations  # a bank with none: an empty list


# ---- 14. relative dates are the speaker's calendar dates ---------------------------------

#: 23:30 on Friday 1 March 2024 in New York is already 2 March in UTC.
LATE_IN_NEW_YORK = datetime(2024, 3, 2, 4, 30, tzinfo=timezone.utc)


def test_relative_dates_resolve_in_the_items_time_zone(m):
    from zoneinfo import ZoneInfo
    m.upsert_bank("zones")
    said = "Ivy: I ran my first marathon yesterday"
    r = m.retain("zones", [
        {"content": said, "timestamp": LATE_IN_NEW_YORK, "time_zone": "America/New_York",
         "document_id": "ny"},
        {"content": said, "timestamp": LATE_IN_NEW_YORK, "document_id": "utc"},
        # an aware timestamp says its zone itself (the client sends it as time_zone)
        {"content": "Ivy: I baked rye bread for the neighbours.", "document_id": "aware",
         "timestamp": LATE_IN_NEW_YORK.astimezone(ZoneInfo("America/Los_Angeles"))},
        {"content": "Ivy: I baked rye bread for the neighbours.", "document_id": "offset",
         "timestamp": LATE_IN_NEW_YORK, "time_zone": "+05:30"},
    ])
    assert r.operation.state == operations_pb2.SUCCEEDED, r.operation
    by_doc = {x.document_id: x for x in m.list_memories("zones")}
    day = lambda doc: by_doc[doc].occurred_start.ToDatetime().date().isoformat()  # noqa: E731
    assert day("ny") == "2024-02-29", by_doc["ny"]  # New York's yesterday: a leap day
    assert "29 February 2024" in by_doc["ny"].text
    assert day("utc") == "2024-03-01", by_doc["utc"]
    assert day("aware") == "2024-03-01"  # 20:30 on 1 March in Los Angeles: no time named
    assert day("offset") == "2024-03-02"  # 10:00 on 2 March in India
    # the query's "yesterday" is the asker's too, and finds the New York fact's day
    ny = m.recall("zones", "What did Ivy do yesterday?", query_timestamp=datetime(
        2024, 3, 1, 3, 0, tzinfo=timezone.utc), time_zone="America/New_York")
    assert ny.query_time_range.start.ToDatetime().date().isoformat() == "2024-02-28"
    utc = m.recall("zones", "What did Ivy do yesterday?", query_timestamp=datetime(
        2024, 3, 1, 3, 0, tzinfo=timezone.utc))
    assert utc.query_time_range.start.ToDatetime().date().isoformat() == "2024-02-29"
    assert "marathon" in utc.results[0].memory.text
    r = m.reflect("zones", "What did Ivy do yesterday?", query_timestamp=LATE_IN_NEW_YORK,
                  time_zone="America/New_York")
    assert "marathon" in r.text, r.text


def test_an_unknown_time_zone_is_refused_naming_the_field(m):
    m.upsert_bank("zones-bad")
    r = m.retain("zones-bad", [
        {"content": "Jo: I moved to Lisbon last week.", "timestamp": T0, "time_zone": "Europe/Lisbon"},
        {"content": "Jo: I sold my car last week.", "timestamp": T0, "time_zone": "Mars/Olympus"},
        {"content": "Jo: I bought a bike.", "timestamp": T0, "time_zone": "../../etc/passwd"},
        {"content": "Jo: I started a job.", "timestamp": T0, "time_zone": "+25:00"},
    ])
    errors = {e.item_index: e for e in r.operation.item_errors}
    assert set(errors) == {1, 2, 3}, errors
    assert all(errors[i].field == f"items[{i}].time_zone" for i in (1, 2, 3))
    assert "IANA" in errors[1].error
    assert [x.text.split(" (")[0] for x in m.list_memories("zones-bad")] == [
        "Jo: I moved to Lisbon last week"]
    got = refused(lambda: m.recall("zones-bad", "Lisbon", time_zone="Nowhere/Land"), "time_zone")
    assert "IANA" in got[0][1]
    refused(lambda: m.reflect("zones-bad", "Where did Jo move?", time_zone="\x01"), "time_zone")
    still_readable(m, "zones-bad")


def test_cli_retain_and_recall_take_a_time_zone(server, m, tmp_path):
    out = CliRunner().invoke(app, ["retain", "zones-cli", "Kim: I adopted a cat yesterday",
                                   "--timestamp", "2024-03-02T04:30:00+00:00",
                                   "--time-zone", "America/New_York", "-a", server.address])
    assert out.exit_code == 0, out.output
    items = tmp_path / "items.jsonl"
    items.write_text('{"content": "Kim: I painted the fence yesterday", '
                     '"timestamp": "2024-03-01T23:30:00-05:00", "document_id": "fence"}\n'
                     '{"content": "Kim: I fixed the roof yesterday", "document_id": "roof", '
                     '"timestamp": "2024-03-02T04:30:00Z", "time_zone": "Asia/Tokyo"}\n')
    out = CliRunner().invoke(app, ["retain", "zones-cli", "--items", str(items),
                                   "-a", server.address])
    assert out.exit_code == 0, out.output
    dates = {x.text.split(" (")[0]: x.occurred_start.ToDatetime().date().isoformat()
             for x in m.list_memories("zones-cli")}
    assert dates == {"Kim: I adopted a cat yesterday": "2024-02-29",
                     "Kim: I painted the fence yesterday": "2024-02-29",  # the offset given
                     "Kim: I fixed the roof yesterday": "2024-03-01"}  # 13:30 in Tokyo
    out = CliRunner().invoke(app, ["recall", "zones-cli", "what happened yesterday", "--json",
                                   "--at", "2024-03-01T03:00:00Z", "--time-zone", "Pacific/Auckland",
                                   "-a", server.address])
    assert out.exit_code == 0, out.output
    assert '"start": "2024-02-29T00:00:00Z"' in out.stdout  # 16:00 on 1 March in Auckland
    out = CliRunner().invoke(app, ["recall", "zones-cli", "cat", "--time-zone", "Nowhere",
                                   "-a", server.address])
    assert out.exit_code == 2 and "time_zone" in out.output, out.output
    # a time without an offset, given with a zone, is read on that zone's clock
    out = CliRunner().invoke(app, ["retain", "zones-local", "Emi: I went to the onsen yesterday",
                                   "--timestamp", "2024-03-02T20:00:00", "--time-zone",
                                   "Asia/Tokyo", "-a", server.address])
    assert out.exit_code == 0, out.output
    (x,) = m.list_memories("zones-local")
    assert x.occurred_start.ToDatetime().date().isoformat() == "2024-03-01", x
    assert x.mentioned_at.ToDatetime() == datetime(2024, 3, 2, 11, 0)  # 20:00 in Tokyo
    r = m.recall("zones-local", "onsen yesterday", query_timestamp=datetime(2024, 3, 2, 20),
                 time_zone="Asia/Tokyo")
    assert r.query_time_range.start.ToDatetime().date().isoformat() == "2024-03-01"



def test_a_combined_scope_is_bounded_like_an_items_tags(m):
    from mneme.client import observation_scopes
    m.upsert_bank("combined")
    items = [{"content": f"Note {n} about the garden.", "tags": [f"t{n}-{k}" for k in range(30)]}
             for n in range(3)]
    refused(lambda: m.retain("combined", items, observation_scopes=observation_scopes("combined")),
            "observation_scopes.mode")
    assert not list(m.list_memories("combined"))
    r = m.retain("combined", items[:2], observation_scopes=observation_scopes("combined"))
    assert r.operation.state == operations_pb2.SUCCEEDED  # 60 tags: one scope of them


def test_items_times_scopes_is_bounded(m):
    """EXPLICIT and PER_TAG put each fact into several scopes, each worked by
    consolidation: a retain whose items × scopes pass MNEME_LIMIT_SCOPE_ASSIGNMENTS
    (16,384) is refused naming observation_scopes, and stores nothing."""
    from mneme.client import observation_scopes
    m.upsert_bank("scoped")
    many = observation_scopes("explicit", [[f"s{n}"] for n in range(256)])
    items = [{"content": f"Note {n} about the pond.", "tags": [f"t{n % 7}-{k}" for k in range(64)]}
             for n in range(300)]
    refused(lambda: m.retain("scoped", items[:65], observation_scopes=many), "observation_scopes")
    refused(lambda: m.retain("scoped", items, observation_scopes=observation_scopes("per_tag")),
            "observation_scopes")
    assert not list(m.list_memories("scoped"))
    few = observation_scopes("explicit", [["a"], ["b"], ["a", "b"]])
    r = m.retain("scoped", [{"content": "Kim feeds the carp."}], observation_scopes=few)
    assert r.operation.state == operations_pb2.SUCCEEDED


def test_a_create_with_a_client_chosen_id_is_safe_to_retry(m):
    """CreateDirective and CreateMentalModel take an id of the client's choosing
    (AIP-133): a retry of a call whose answer was lost (several at once, too) gets
    ALREADY_EXISTS and leaves one resource; an id that is not a UUID is refused."""
    import uuid
    from concurrent.futures import ThreadPoolExecutor

    m.upsert_bank("chosen")
    creates = {
        "directive_id": (lambda i: m.create_directive("chosen", "Be brief.", directive_id=i),
                         lambda: list(m.list_directives("chosen"))),
        "mental_model_id": (lambda i: m.create_mental_model("chosen", "Diet", "What does Ann eat?",
                                                            mental_model_id=i),
                            lambda: list(m.list_mental_models("chosen")))}
    for field, (create, listed) in creates.items():
        chosen = str(uuid.uuid4())
        made = create(chosen)
        assert made.name.endswith("/" + chosen)
        with ThreadPoolExecutor(4) as pool:  # a client's retries racing each other
            tries = [pool.submit(create, chosen) for _ in range(4)]
        for t in tries:
            assert isinstance(t.exception(), grpc.RpcError), field
            assert t.exception().code() == grpc.StatusCode.ALREADY_EXISTS, field
        assert [x.name for x in listed()] == [made.name]
        refused(lambda: create("not-a-uuid"), field)
        other = create("")  # no id: the server picks a new one each time
        assert other.name != made.name and len(listed()) == 2
    # several deletions of one directive at once: one deletes it, the others find none
    victim = next(iter(m.list_directives("chosen"))).name.rsplit("/", 1)[-1]
    with ThreadPoolExecutor(4) as pool:
        tries = [pool.submit(m.delete_directive, "chosen", victim) for _ in range(4)]
    codes = sorted(str(t.exception().code()) if t.exception() else "OK" for t in tries)
    assert codes == ["OK"] + ["StatusCode.NOT_FOUND"] * 3, codes


def test_sync_writes_beyond_the_bound_are_refused_and_reads_go_on(tmp_path):
    """With MNEME_SYNC_CALLS=1, a second sync retain while one waits is
    RESOURCE_EXHAUSTED and stores nothing; reads and async retains are served meanwhile."""
    s = Server(tmp_path / "data", env={"MNEME_SYNC_CALLS": "1"}).start()
    try:
        with s.client(timeout=300) as m:
            m.upsert_bank("busy")
            long = [{"content": f"Gil counted {n} gulls on pier {n % 9} at dawn.",
                     "document_id": "long"} for n in range(400)]
            first = threading.Thread(target=m.retain, args=("busy", long), daemon=True)
            first.start()
            while not list(m.list_operations("busy")):  # appended: it waits now
                time.sleep(0.02)
            with pytest.raises(grpc.RpcError) as e:
                m.retain("busy", [{"content": "Ida rows.", "document_id": "other"}])
            assert e.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED, e.value.details()
            assert "MNEME_SYNC_CALLS" in e.value.details()
            assert [b.name for b in m.list_banks()] == ["banks/busy"]
            op = m.retain("busy", [{"content": "Ida rows.", "document_id": "async"}],
                          async_=True).operation
            first.join(300)
            assert len(list(m.list_operations("busy"))) == 2  # the refused one: none
            assert m.retain("busy", [{"content": "Jo swims."}]).operation.state == 3
            assert op.name
    finally:
        s.stop()
