"""KeyService.BatchGetDataKeys in process (a real gRPC server with the limits and auth
interceptors, a real Keyring over SQLite): request validation (INVALID_ARGUMENT naming
the field), the keys served and the missing ones, FAILED_PRECONDITION without a keyring,
the history scope of API keys; and the SDK's opener over it: records sealed by the
Sealer opened with keys fetched in batches, erased once the document's keys are
destroyed."""

from __future__ import annotations

import grpc
import pytest

from mneme import auth
from mneme.bus import codec
from mneme.bus.sealing import ERASED_HEADER, Sealer
from mneme.client import MnemeClient, field_violations
from mneme.config import Settings
from mneme.events.v1 import events_pb2 as ev
from mneme.history import HistoryOpener, RemoteKeys
from mneme.keys import Keyring, LocalKms, document_scope
from mneme.ports import Record
from mneme.runtime import grpc_server
from mneme.stores.keys_sqlite import SqliteKeyStore
from mneme.v1 import keys_pb2
from services.ingest.grpc_api import KeyServicer, key_ids_of
from services.ingest.handlers import Ingest


@pytest.fixture
def keyring():
    store = SqliteKeyStore(":memory:")
    yield Keyring(store, LocalKms(b"\x01" * 32))
    store.close()


def _serve(keys, guard=None):
    settings = Settings()
    server = grpc_server.server(settings, guard)
    from mneme.v1 import keys_pb2_grpc
    ingest = Ingest(log=None, catalog=None, keys=keys)  # data_keys needs only the keys
    keys_pb2_grpc.add_KeyServiceServicer_to_server(KeyServicer(ingest), server)
    port = grpc_server.bind(server, "127.0.0.1:0", settings)
    server.start()
    return server, f"127.0.0.1:{port}"


@pytest.fixture
def served(keyring):
    server, address = _serve(keyring)
    yield keyring, address
    server.stop(0)


def _refused(call) -> tuple[grpc.StatusCode, list[tuple[str, str]]]:
    with pytest.raises(grpc.RpcError) as e:
        call()
    return e.value.code(), field_violations(e.value)


def _get(m: MnemeClient, parent: str, ids):
    return m.key_service.BatchGetDataKeys(keys_pb2.BatchGetDataKeysRequest(
        parent=parent, key_ids=list(ids)), timeout=10)


def test_request_validation_names_the_field(served):
    _, address = served
    with MnemeClient(address, api_key="") as m:
        cases = {
            "": "parent", "bank/a": "parent", "banks/A!": "parent", "banks/a/x": "parent",
        }
        for parent, field in cases.items():
            code, fields = _refused(lambda: _get(m, parent, ["bank"]))
            assert code == grpc.StatusCode.INVALID_ARGUMENT and fields[0][0] == field, parent
        for ids, field in (((), "key_ids"), (["bank", ""], "key_ids[1]"),
                           (["k"] * 1001, "key_ids"), (["d:" + "x" * 400], "key_ids[0]"),
                           (["ok", "d:a\nb"], "key_ids[1]")):
            code, fields = _refused(lambda: _get(m, "banks/a", ids))
            assert code == grpc.StatusCode.INVALID_ARGUMENT, ids[:3]
            assert fields[0][0] == field, (ids[:3], fields)
        # the bounds: 1000 ids, and an id of the longest document id plus its generation
        longest = f"d:{'x' * 256}#{'0' * 16}"
        r = _get(m, "banks/a", [f"k{i}" for i in range(999)] + [longest])
        assert len(r.missing_key_ids) == 1000 and not r.data_keys


def test_key_ids_of_keeps_order_and_drops_duplicates():
    req = keys_pb2.BatchGetDataKeysRequest(parent="banks/a", key_ids=["b", "a", "b", "c"])
    assert key_ids_of(req) == ["b", "a", "c"]


def test_served_keys_missing_ones_and_destroyed_ones(served):
    keyring, address = served
    doc = keyring.current("alice", document_scope("d1"))
    other = keyring.current("alice", document_scope("d2"))
    with MnemeClient(address, api_key="") as m:
        found, missing = m.batch_get_data_keys("alice", [doc, "d:nope#00", other, doc])
        assert found == {doc: keyring.key("alice", doc), other: keyring.key("alice", other)}
        assert all(len(k) == 32 for k in found.values())
        assert missing == ["d:nope#00"]
        # another bank never sees them; a bank that does not exist has every key missing
        assert m.batch_get_data_keys("bob", [doc]) == ({}, [doc])
        keyring.destroy_scope("alice", document_scope("d1"))
        assert m.batch_get_data_keys("alice", [doc, other]) == (
            {other: keyring.key("alice", other)}, [doc])


def test_no_keyring_is_a_failed_precondition():
    server, address = _serve(None)
    try:
        with MnemeClient(address, api_key="") as m:
            with pytest.raises(grpc.RpcError) as e:
                m.batch_get_data_keys("alice", ["bank"])
            assert e.value.code() == grpc.StatusCode.FAILED_PRECONDITION
            assert "not sealed" in e.value.details()
    finally:
        server.stop(0)


def test_the_history_scope(tmp_path, keyring):
    store = auth.KeyStore(tmp_path / "api_keys.json")
    keys = {name: store.add(banks, scope)[1] for name, banks, scope in (
        ("read", ["alice"], "read"), ("write", ["alice"], "write"),
        ("history", ["alice"], "history"), ("both", ["alice"], "history,write"),
        ("bob_history", ["bob"], "history"), ("all_history", ["*"], "read,history"))}
    assert {e["scope"] for e in store.entries()} == {"read", "write", "history", "write,history"}
    with pytest.raises(ValueError, match="scope must be one of"):
        store.add(["alice"], "admin")
    audits = []
    guard = auth.AuthInterceptor("api_key", store, audit=audits.append)
    server, address = _serve(keyring, guard)
    doc = keyring.current("alice", document_scope("d1"))
    try:
        for name in ("read", "write", "bob_history"):
            with MnemeClient(address, api_key=keys[name]) as m:
                with pytest.raises(grpc.RpcError) as e:
                    m.batch_get_data_keys("alice", [doc])
                assert e.value.code() == grpc.StatusCode.PERMISSION_DENIED, name
                assert "'history' scope" in e.value.details()
        for name in ("history", "both", "all_history"):
            with MnemeClient(address, api_key=keys[name]) as m:
                assert m.batch_get_data_keys("alice", [doc])[0] == {
                    doc: keyring.key("alice", doc)}, name
    finally:
        server.stop(0)
    outcomes = [(a.method.rsplit("/", 1)[1], a.access, a.outcome) for a in audits]
    assert outcomes.count(("BatchGetDataKeys", "history", "permission_denied")) == 3
    assert outcomes.count(("BatchGetDataKeys", "history", "allowed")) == 3
    # a write key still writes, a history key does not
    write = auth.Principal("k", frozenset({"alice"}), True)
    assert write.allows("alice", auth.WRITE) and not write.allows("alice", auth.HISTORY)
    assert auth.ANONYMOUS.allows("alice", auth.HISTORY)  # open mode serves history keys


def _sealed(sealer: Sealer, msg, bank="alice") -> Record:
    out = sealer.seal(codec.encode(msg, bank_id=bank, source="mneme/test"))
    return Record(topic=out.topic, partition=0, offset=0, key=out.key, value=out.value,
                  headers=dict(out.headers))


def test_the_sdk_opener_reads_sealed_records_until_the_keys_are_destroyed(served):
    keyring, address = served
    sealer = Sealer(keyring)
    retain = _sealed(sealer, ev.RetainRequested(bank_id="alice", operation_id="op1", items=[
        ev.RetainItem(content="Call me at 415-555-0171", document_id="d1"),
        ev.RetainItem(content="Bob likes tea", document_id="d2")]))
    facts = _sealed(sealer, ev.FactsExtracted(bank_id="alice", operation_id="op1", facts=[
        ev.Fact(id="f1", text="Alice's phone is 415-555-0171", document_id="d1"),
        ev.Fact(id="f2", text="Bob likes tea", document_id="d2")]))
    assert b"415-555-0171" not in retain.value + facts.value
    with MnemeClient(address, api_key="") as m:
        keys = RemoteKeys(m.batch_get_data_keys)
        opener = HistoryOpener(keys)
        r, f = opener.open_all([retain, facts])
        assert keys.calls == 1  # every key of both records in one batch
        assert [i.content for i in r.message.items] == ["Call me at 415-555-0171",
                                                        "Bob likes tea"]
        assert [x.text for x in f.message.facts] == ["Alice's phone is 415-555-0171",
                                                     "Bob likes tea"]
        assert (r.erased, f.erased, r.record_erased) == (0, 0, False)
        opener.open(facts)
        assert keys.calls == 1  # cached
        keyring.destroy_scope("alice", document_scope("d1"))
        # a fresh opener (no cache) finds d1's content erased, d2's intact
        fresh = m.history_opener()
        r, f = fresh.open(retain), fresh.open_value(facts.headers["ce_type"], "alice",
                                                    facts.value)
        assert r.message.items[0].content == "" and r.message.items[1].content == "Bob likes tea"
        assert [(x.item_index, x.reason) for x in r.message.rejected_items] == [(0, "erased")]
        assert [x.id for x in f.message.facts] == ["f2"] and f.erased == 1
        assert r.record.headers[ERASED_HEADER] == "1"
        # the first opener still holds d1's keys until they age out or are forgotten
        assert opener.open(facts).erased == 0
        keys.forget("alice")
        assert [x.id for x in opener.open(facts).message.facts] == ["f2"]


def test_remote_keys_batches_and_ages_out():
    calls = []
    now = [0.0]

    def fetch(bank, ids):
        calls.append(list(ids))
        return {k: bytes(32) for k in ids if k != "gone"}, [k for k in ids if k == "gone"]

    keys = RemoteKeys(fetch, max_age_s=10, batch=2, clock=lambda: now[0])
    assert keys.combined("b", ["a", "c", "e"]) is not None
    assert calls == [["a", "c"], ["e"]]
    assert keys.combined("b", ["gone"]) is None and keys.combined("b", ["gone", "a"]) is None
    assert len(calls) == 3  # the missing key is cached as missing too
    now[0] = 11
    keys.combined("b", ["a"])
    assert calls[-1] == ["a"]
    with pytest.raises(ValueError, match="32"):
        RemoteKeys(lambda b, ids: ({"x": b"short"}, [])).combined("b", ["x"])


def test_a_seal_naming_more_keys_than_the_cache_holds_still_opens():
    """The keys a seal names are used as fetched, not re-read from the LRU: a cache
    smaller than one seal's keys (or another thread's batch evicting them meanwhile)
    must not make live content read as erased."""
    fetch = lambda bank, ids: ({k: bytes(32) for k in ids if k != "gone"},  # noqa: E731
                               [k for k in ids if k == "gone"])
    keys = RemoteKeys(fetch, cache=2)
    assert keys.combined("b", ["a", "c", "e"]) is not None
    assert keys.combined("b", ["a", "gone", "e"]) is None
    many = [f"f:{i}" for i in range(150)]
    wide = RemoteKeys(fetch, cache=100, batch=1000)
    assert wide.keys("b", many) == [bytes(32)] * 150 and wide.calls == 1
    assert len(wide._keys) == 100  # the cache stays bounded


def test_records_of_kafka_clients_are_opened(served):
    """aiokafka / kafka-python records (attributes, headers as [(name, bytes)]) and
    confluent-kafka messages (methods) open like the log's own records."""
    import types

    keyring, address = served
    rec = _sealed(Sealer(keyring), ev.FactsExtracted(bank_id="alice", operation_id="op", facts=[
        ev.Fact(id="f9", text="Alice likes figs", document_id="d9")]))
    headers = [(k, v.encode()) for k, v in rec.headers.items()]
    aiokafka = types.SimpleNamespace(topic=rec.topic, partition=3, offset=7, key=b"alice",
                                     value=rec.value, headers=headers)
    confluent = types.SimpleNamespace(topic=lambda: rec.topic, partition=lambda: 3,
                                      offset=lambda: 7, key=lambda: b"alice",
                                      value=lambda: rec.value, headers=lambda: headers)
    with MnemeClient(address, api_key="") as m:
        opener = m.history_opener()
        for r in (aiokafka, confluent):
            e = opener.open(r)
            assert (e.bank_id, e.record.partition, e.record.offset) == ("alice", 3, 7)
            assert [f.text for f in e.message.facts] == ["Alice likes figs"]


def _open_as_the_readme_says(record: Record, fetch) -> ev.FactsExtracted:
    """A consumer in another language, from README "Opening a seal without the SDK":
    only HKDF-SHA256, AES-256-GCM and protobuf merge, no mneme code."""
    from cryptography.hazmat.primitives import hashes
    from cryptography.hazmat.primitives.ciphers.aead import AESGCM
    from cryptography.hazmat.primitives.kdf.hkdf import HKDF

    bank = record.headers.get("ce_subject") or record.key
    msg = getattr(ev, record.headers["ce_type"].rsplit(".", 1)[1]).FromString(record.value)
    elements = {"RetainRequested": "items", "FactsExtracted": "facts",
                "EntitiesResolved": "aliases"}
    out = []
    for el in getattr(msg, elements[msg.DESCRIPTOR.name]):
        found, missing = fetch(bank, list(el.seal.keys))
        if missing:
            continue  # erased
        key = HKDF(algorithm=hashes.SHA256(), length=32, salt=None,
                   info=b"mneme/seal/v1\0" + "\0".join(el.seal.keys).encode()).derive(
            b"".join(found[k] for k in el.seal.keys))
        name = el.DESCRIPTOR.name
        el_id = {"RetainItem": "document_id", "EntityAlias": "entity_id"}.get(name, "id")
        aad = f"{bank}\0{name}\0{getattr(el, el_id, '')}".encode()
        part = type(el).FromString(AESGCM(key).decrypt(el.seal.nonce, el.seal.ciphertext, aad))
        el.MergeFrom(part)
        out.append(el)
    return out


def test_the_readmes_recipe_opens_a_seal_without_the_sdk(served):
    keyring, address = served
    sealer = Sealer(keyring)
    retain = _sealed(sealer, ev.RetainRequested(bank_id="alice", operation_id="op1", items=[
        ev.RetainItem(content="Call me at 415-555-0171", context="sms", document_id="d1")]))
    facts = _sealed(sealer, ev.FactsExtracted(bank_id="alice", operation_id="op1", facts=[
        ev.Fact(id="f1", text="Alice's phone is 415-555-0171", document_id="d1",
                metadata={"k": "v"})]))
    keyring.ensure("alice", "d:x", "d:x")  # an alias sealed under its item's key
    aliases = _sealed(sealer, ev.EntitiesResolved(bank_id="alice", aliases=[
        ev.EntityAlias(entity_id="e1", alias="Ali", seal=ev.Seal(keys=["d:x"]))]))
    with MnemeClient(address, api_key="") as m:
        item, = _open_as_the_readme_says(retain, m.batch_get_data_keys)
        assert (item.content, item.context) == ("Call me at 415-555-0171", "sms")
        fact, = _open_as_the_readme_says(facts, m.batch_get_data_keys)
        assert (fact.text, dict(fact.metadata)) == ("Alice's phone is 415-555-0171", {"k": "v"})
        alias, = _open_as_the_readme_says(aliases, m.batch_get_data_keys)
        assert alias.alias == "Ali"
        keyring.destroy_scope("alice", document_scope("d1"))
        assert _open_as_the_readme_says(facts, m.batch_get_data_keys) == []


def test_a_record_that_cannot_be_opened_is_named_in_the_error(served):
    """open_all of a batch with a tampered seal or a garbled value: the error says which
    record (topic, partition, offset, type) and carries it."""
    import dataclasses

    from google.protobuf.message import DecodeError
    keyring, address = served
    good = _sealed(Sealer(keyring), ev.FactsExtracted(bank_id="alice", operation_id="op", facts=[
        ev.Fact(id="f7", text="Alice likes plums", document_id="d7")]))
    sealed = ev.FactsExtracted.FromString(good.value)
    sealed.facts[0].seal.ciphertext = bytes(b ^ 1 for b in sealed.facts[0].seal.ciphertext)
    tampered = dataclasses.replace(good, topic="mneme.memory.v1", partition=2, offset=41,
                                   value=sealed.SerializeToString())
    garbled = dataclasses.replace(tampered, offset=42, value=b"\xff\xff not protobuf")
    with MnemeClient(address, api_key="") as m:
        opener = m.history_opener()
        with pytest.raises(ValueError, match=r"mneme\.memory\.v1\[2\]@41 .*authenticate") as e:
            opener.open_all([good, tampered])
        assert e.value.record.offset == 41
        with pytest.raises(DecodeError, match=r"mneme\.memory\.v1\[2\]@42 \(mneme\.events"):
            opener.open(garbled)


def test_a_key_for_a_bank_id_that_cannot_exist_is_refused(tmp_path):
    """`mneme keys create --bank 'Bad Bank!'` stored a key for a bank no request can
    name (a typo, or a display name given for the id): refused, naming the bank."""
    store = auth.KeyStore(tmp_path / "api_keys.json")
    with pytest.raises(ValueError, match="'Bad Bank!'.*bank id must match"):
        store.add(["alice", "Bad Bank!"], "read")
    assert store.entries() == []
    store.add(["alice", "*"], "read")  # '*' covers every bank


def test_missing_keys_cost_one_catch_up_of_a_shared_key_store(tmp_path):
    """A consumer of a deleted bank's history (or of another deployment's log) asks for
    keys the store no longer knows: the KafkaKeyStore (here over an embedded log) reads
    its topic to the end before it answers a miss. BatchGetDataKeys of 1000 such ids made
    one catch-up per id (twice for a deleted bank: its bank key too), ~0.25 s each on the
    test broker, so the call ran minutes past any deadline; it now makes one for all."""
    from mneme.bus.sqlite_log import SqliteEventLog
    from mneme.stores.keys_kafka import KafkaKeyStore
    log = SqliteEventLog(tmp_path / "log.db")
    store = KafkaKeyStore(log, poll_s=0)
    try:
        keyring = Keyring(store, LocalKms(b"\x01" * 32))
        gone = [keyring.current("gone", document_scope(f"d{i}")) for i in range(40)]
        live = keyring.current("alice", document_scope("d1"))
        keyring.destroy_bank("gone")
        catch_ups = []
        inner = store.catch_up
        store.catch_up = lambda until=None: (catch_ups.append(until), inner(until))[1]
        ingest = Ingest(log=None, catalog=None, keys=keyring)
        assert ingest.data_keys("gone", gone) == ([], gone)
        assert len(catch_ups) == 1
        catch_ups.clear()
        unknown = [f"d:nope{i}#00" for i in range(40)]
        found, missing = ingest.data_keys("alice", [live, *unknown])
        assert found == [(live, keyring.key("alice", live))] and missing == unknown
        assert len(catch_ups) == 1
    finally:
        store.close()
        log.close()


def test_opening_one_record_fetches_its_keys_in_one_call(served):
    """README's consumer opens records one by one (``opener.open(rec)``): a
    FactsExtracted of 25 facts, each under its own key, made 25 BatchGetDataKeys calls
    (one per fact, each an audit record), ~700 calls for a retain of 57 facts read on
    Kafka; one record's keys now come in one call."""
    keyring, address = served
    facts = _sealed(Sealer(keyring), ev.FactsExtracted(bank_id="alice", operation_id="op1",
        facts=[ev.Fact(id=f"f{i}", text=f"fact {i}", document_id="d1") for i in range(25)]))
    with MnemeClient(address, api_key="") as m:
        keys = RemoteKeys(m.batch_get_data_keys)
        opened = HistoryOpener(keys).open(facts)
        assert [f.text for f in opened.message.facts] == [f"fact {i}" for i in range(25)]
        assert keys.calls == 1
