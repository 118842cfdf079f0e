"""Crypto-shredding: the key hierarchy (mneme.keys) and the sealing of events
(mneme.bus.sealing) over the SQLite key store."""

from __future__ import annotations

import base64
import os
from array import array

import pytest

from mneme.bus import codec
from mneme.bus.sealing import (ERASED_HEADER, SEAL_ERROR_HEADER, SealedLog, Sealer,
                               check_opened, erased_record)
from mneme.bus.sqlite_log import SqliteEventLog
from mneme.errors import ConfigurationError
from mneme.events.v1 import events_pb2 as ev
from mneme.keys import Keyring, LocalKms, local_kms
from mneme.ports import Record
from mneme.stores.keys_sqlite import SqliteKeyStore

MARKER = "415-555-0199"


@pytest.fixture
def keyring(tmp_path):
    store = SqliteKeyStore(str(tmp_path / "keys.db"))
    yield Keyring(store, LocalKms(os.urandom(32)))
    store.close()


def _as_read(out, offset: int = 0) -> Record:
    return Record(topic=out.topic, partition=0, offset=offset, key=out.key, value=out.value,
                  headers=dict(out.headers))


def _retain(*docs: str, op: str = "op1") -> ev.RetainRequested:
    return ev.RetainRequested(bank_id="b", operation_id=op, items=[
        ev.RetainItem(content=f"{d}: call me on {MARKER}" if d == "secret" else f"{d} text",
                      context="ctx", document_id=d, metadata={"k": "v"}) for d in docs])


def _facts(*pairs: tuple[str, str], op: str = "op2", keys: list[str] | None = None):
    return ev.FactsExtracted(bank_id="b", operation_id=op, facts=[
        ev.Fact(id=fid, text=f"{doc} says {MARKER}", document_id=doc,
                embedding=codec.to_float32([0.1 * (i + 1)] * 8),
                entities=[ev.Entity(id="e1", name="Alice")],
                seal=ev.Seal(keys=keys or []))
        for i, (fid, doc) in enumerate(pairs)])


def _seal_open(sealer: Sealer, msg, event_id: str | None = None):
    out = sealer.seal(codec.encode(msg, bank_id="b", source="t", event_id=event_id))
    return out, sealer.open(_as_read(out))


def test_content_is_sealed_and_opens_back_exactly(keyring):
    sealer = Sealer(keyring)
    msg = _retain("secret", "keep")
    out, opened = _seal_open(sealer, msg)
    assert MARKER.encode() not in out.value and b"ctx" not in out.value
    sealed = ev.RetainRequested.FromString(out.value)
    assert [i.document_id for i in sealed.items] == ["secret", "keep"]  # ids in the clear
    assert all(i.seal.ciphertext and not i.content for i in sealed.items)
    back = ev.RetainRequested.FromString(opened.value)
    for a, b in zip(back.items, msg.items):
        assert (a.content, a.context, dict(a.metadata)) == (b.content, b.context, dict(b.metadata))
        assert not a.seal.ciphertext and a.seal.keys  # keys kept for derived content
    assert ERASED_HEADER not in opened.headers


def test_the_embedding_bytes_are_not_on_the_log(keyring):
    sealer = Sealer(keyring)
    msg = _facts(("f1", "secret"))
    out, opened = _seal_open(sealer, msg)
    vector = array("f", msg.facts[0].embedding).tobytes()
    assert vector not in out.value and vector[:16] not in out.value
    assert list(ev.FactsExtracted.FromString(opened.value).facts[0].embedding) == \
        list(msg.facts[0].embedding)


def test_deleting_a_document_erases_its_items_and_facts_and_nothing_else(keyring):
    sealer = Sealer(keyring)
    out, _ = _seal_open(sealer, _retain("secret", "keep"))
    items = ev.RetainRequested.FromString(out.value).items
    facts_out, _ = _seal_open(sealer, _facts(("f1", "secret"), ("f2", "keep"),
                                             keys=None))
    keyring.destroy_scope("b", "d:secret")
    opened = sealer.open(_as_read(out))
    back = ev.RetainRequested.FromString(opened.value)
    assert back.items[0].content == "" and back.items[1].content == "keep text"
    assert [(r.item_index, r.reason) for r in back.rejected_items] == [(0, "erased")]
    assert opened.headers[ERASED_HEADER] == "1" and not erased_record(opened)
    facts = ev.FactsExtracted.FromString(sealer.open(_as_read(facts_out)).value).facts
    assert [f.id for f in facts] == ["f2"]
    assert items[0].seal.keys[0].startswith("d:secret#")


def test_a_document_retained_again_after_its_deletion_gets_a_new_key(keyring):
    sealer = Sealer(keyring)
    first, _ = _seal_open(sealer, _retain("secret"))
    keyring.destroy_scope("b", "d:secret")
    second, opened = _seal_open(sealer, _retain("secret", op="op9"))
    k1 = ev.RetainRequested.FromString(first.value).items[0].seal.keys[0]
    k2 = ev.RetainRequested.FromString(second.value).items[0].seal.keys[0]
    assert k1 != k2
    assert ev.RetainRequested.FromString(opened.value).items[0].content.startswith("secret")
    assert ev.RetainRequested.FromString(sealer.open(_as_read(first)).value).items[0].content == ""


def test_deleting_a_memory_erases_that_fact_only_and_its_id_stays_destroyed(keyring):
    sealer = Sealer(keyring)
    out, _ = _seal_open(sealer, _facts(("f1", "d"), ("f2", "d")))
    keyring.destroy("b", ["f:f1"])
    assert [f.id for f in ev.FactsExtracted.FromString(sealer.open(_as_read(out)).value).facts] \
        == ["f2"]
    # a redelivered extraction cannot bring the destroyed key back
    again, opened = _seal_open(sealer, _facts(("f1", "d"), ("f2", "d")))
    assert [f.id for f in ev.FactsExtracted.FromString(opened.value).facts] == ["f2"]


def test_facts_of_an_item_whose_key_is_gone_are_erased_at_birth(keyring):
    """Extraction still working on a document deleted meanwhile: its facts name the
    item's (destroyed) key and are sealed under a key nobody keeps."""
    sealer = Sealer(keyring)
    out, _ = _seal_open(sealer, _retain("secret"))
    item_key = ev.RetainRequested.FromString(out.value).items[0].seal.keys[0]
    keyring.destroy_scope("b", "d:secret")
    facts_out, opened = _seal_open(sealer, _facts(("f1", "secret"), keys=[item_key]))
    assert MARKER.encode() not in facts_out.value
    assert not ev.FactsExtracted.FromString(opened.value).facts
    assert keyring.store.get("b", "f:f1") is None  # no key made for it


def test_an_observation_is_erased_when_any_fact_it_cited_is(keyring):
    sealer = Sealer(keyring)
    f_out, _ = _seal_open(sealer, _facts(("f1", "d1"), ("f2", "d2")))
    facts = ev.FactsExtracted.FromString(sealer.open(_as_read(f_out)).value).facts
    keys = list(dict.fromkeys(k for f in facts for k in f.seal.keys))
    obs = ev.ObservationsChanged(bank_id="b", observations=[
        ev.Observation(id="o1", text=f"Alice: {MARKER}", seal=ev.Seal(keys=keys)),
        ev.Observation(id="o2", text="only d2", seal=ev.Seal(keys=list(facts[1].seal.keys)))])
    out, opened = _seal_open(sealer, obs)
    assert MARKER.encode() not in out.value
    assert [o.id for o in ev.ObservationsChanged.FromString(opened.value).observations] == \
        ["o1", "o2"]
    keyring.destroy_scope("b", "d:d1")
    assert [o.id for o in ev.ObservationsChanged.FromString(
        sealer.open(_as_read(out)).value).observations] == ["o2"]


def test_a_reflection_is_wholly_erased_with_a_fact_it_is_based_on(keyring):
    sealer = Sealer(keyring)
    _seal_open(sealer, _facts(("f1", "secret")))
    out, opened = _seal_open(sealer, ev.ReflectionRecorded(
        bank_id="b", query="phone?", answer=MARKER, based_on=["f1"]), event_id="e1")
    assert MARKER.encode() not in out.value
    assert ev.ReflectionRecorded.FromString(opened.value).answer == MARKER
    keyring.destroy_scope("b", "d:secret")
    gone = sealer.open(_as_read(out))
    assert erased_record(gone)


def test_a_reflection_citing_a_mental_model_is_erased_with_a_fact_behind_it(keyring):
    """An answer that cites an observation or a mental model (ids without keys of their
    own) restates their facts: it is sealed under those facts' keys too."""
    sealer = Sealer(keyring)
    _seal_open(sealer, _facts(("f1", "secret"), ("f2", "keep")))
    out, opened = _seal_open(sealer, ev.ReflectionRecorded(
        bank_id="b", query="phone?", answer=MARKER, based_on=["m1"],
        evidence_memory_ids=["f1", "f2"]), event_id="e3")
    assert MARKER.encode() not in out.value and not erased_record(opened)
    assert ev.ReflectionRecorded.FromString(opened.value).answer == MARKER
    keyring.destroy_scope("b", "d:secret")
    assert erased_record(sealer.open(_as_read(out)))


def _refresh(content: str, *based_on: str) -> ev.MentalModelChanged:
    return ev.MentalModelChanged(bank_id="b", id="m1", content=content, update_mask=["content"],
                                 refresh=ev.MentalModelRefresh(based_on=list(based_on)))


def test_a_mental_models_refresh_is_erased_with_a_fact_it_cites(keyring):
    sealer = Sealer(keyring)
    _seal_open(sealer, _facts(("f1", "secret"), ("f2", "keep")))
    out, opened = _seal_open(sealer, _refresh(f"The phone is {MARKER} [1].", "f1", "o9"))
    assert MARKER.encode() not in out.value
    assert ev.MentalModelChanged.FromString(opened.value).content.startswith("The phone")
    kept, _ = _seal_open(sealer, _refresh("Bob keeps a bike [1].", "f2"))
    user, _ = _seal_open(sealer, ev.MentalModelChanged(bank_id="b", id="m1", content="Mine.",
                                                       update_mask=["content"]))
    keyring.destroy_scope("b", "d:secret")
    assert erased_record(sealer.open(_as_read(out)))
    assert not erased_record(sealer.open(_as_read(kept)))
    assert not erased_record(sealer.open(_as_read(user)))  # a user's content: the bank's key


def test_a_refresh_citing_an_observation_is_erased_with_a_fact_behind_it(keyring):
    sealer = Sealer(keyring)
    _seal_open(sealer, _facts(("f1", "secret"), ("f2", "keep")))
    msg = _refresh(f"The phone is {MARKER} [1].", "o1")  # an observation: no key of its own
    msg.refresh.evidence_memory_ids.extend(["f1", "f2"])
    out, opened = _seal_open(sealer, msg)
    assert MARKER.encode() not in out.value and not erased_record(opened)
    keyring.destroy_scope("b", "d:secret")
    assert erased_record(sealer.open(_as_read(out)))


def test_an_answer_citing_a_fact_deleted_while_it_was_made_is_erased_at_birth(keyring):
    """A refresh (or a reflection) that recalled a fact just before its document was
    deleted: its seal names the fact's destroyed key, so nobody can open it."""
    sealer = Sealer(keyring)
    _seal_open(sealer, _facts(("f1", "secret")))
    keyring.destroy_scope("b", "d:secret")
    out, opened = _seal_open(sealer, _refresh(f"The phone is {MARKER} [1].", "f1"))
    assert MARKER.encode() not in out.value and erased_record(opened)
    out, opened = _seal_open(sealer, ev.ReflectionRecorded(
        bank_id="b", query="phone?", answer=MARKER, based_on=["f1"]), event_id="e2")
    assert MARKER.encode() not in out.value and erased_record(opened)


def test_deleting_the_bank_erases_everything_of_it_and_a_new_bank_starts_afresh(keyring):
    sealer = Sealer(keyring)
    out, _ = _seal_open(sealer, _retain("keep"))
    keyring.destroy_bank("b")
    assert ev.RetainRequested.FromString(sealer.open(_as_read(out)).value).items[0].content == ""
    again, opened = _seal_open(sealer, _retain("keep", op="op3"))
    assert ev.RetainRequested.FromString(opened.value).items[0].content == "keep text"


def test_a_bank_with_erasure_none_stays_in_plaintext(keyring):
    sealer = Sealer(keyring, erasure=lambda bank: bank != "b")
    out, opened = _seal_open(sealer, _retain("secret"))
    assert MARKER.encode() in out.value
    assert opened.value == out.value


def test_a_tampered_seal_is_an_error_not_an_erasure(keyring, tmp_path):
    sealer = Sealer(keyring)
    out, _ = _seal_open(sealer, _retain("secret"))
    msg = ev.RetainRequested.FromString(out.value)
    ct = bytearray(msg.items[0].seal.ciphertext)
    ct[0] ^= 1
    msg.items[0].seal.ciphertext = bytes(ct)
    bad = _as_read(codec.encode(msg, bank_id="b", source="t"))
    with pytest.raises(ValueError, match="does not authenticate"):
        sealer.open(bad)
    # another document's id on the same ciphertext: the associated data no longer matches
    moved = ev.RetainRequested.FromString(out.value)
    moved.items[0].document_id = "keep"
    with pytest.raises(ValueError, match="does not authenticate"):
        sealer.open(_as_read(codec.encode(moved, bank_id="b", source="t")))


def test_the_sealed_log_seals_appends_and_commits_and_opens_reads(keyring, tmp_path):
    inner = SqliteEventLog(str(tmp_path / "log.db"))
    log = SealedLog(inner, Sealer(keyring))
    try:
        log.ensure_topic("mneme.intake.v1", 1)
        log.ensure_topic("mneme.memory.v1", 1)
        log.append([codec.encode(_retain("secret"), bank_id="b", source="t")])
        log.commit("g", {("mneme.intake.v1", 0): 1},
                   [codec.encode(_facts(("f1", "secret")), bank_id="b", source="t")])
        for topic in ("mneme.intake.v1", "mneme.memory.v1"):
            assert MARKER.encode() not in inner.read(topic, 0, 0)[0].value
            assert MARKER in str(codec.decode(log.read(topic, 0, 0)[0]).message)
        # a record that does not authenticate comes marked, for its consumer's DLQ
        msg = ev.RetainRequested.FromString(inner.read("mneme.intake.v1", 0, 0)[0].value)
        msg.items[0].document_id = "other"
        inner.append([codec.encode(msg, bank_id="b", source="t")])
        rec = log.read("mneme.intake.v1", 0, 1)[0]
        assert "does not authenticate" in rec.headers[SEAL_ERROR_HEADER]
        with pytest.raises(ValueError):
            check_opened(rec)
        check_opened(log.read("mneme.intake.v1", 0, 0)[0])
    finally:
        inner.close()


def test_key_loss_for_one_document_leaves_the_others_readable(keyring, tmp_path):
    sealer = Sealer(keyring)
    outs = [_seal_open(sealer, _retain(d, op=f"op-{d}"))[0] for d in ("a", "b", "c")]
    # the key file loses one row (e.g. a damaged page): only that document is gone
    key_a = ev.RetainRequested.FromString(outs[0].value).items[0].seal.keys[0]
    keyring.store._db.execute("DELETE FROM data_keys WHERE key_id=?", (key_a,))
    keyring.forget("b", [key_a])
    contents = [ev.RetainRequested.FromString(sealer.open(_as_read(o)).value).items[0].content
                for o in outs]
    assert contents == ["", "b text", "c text"]


def test_the_master_key_comes_from_the_environment_or_the_data_dir(tmp_path):
    key = os.urandom(32)
    kms = local_kms(None, {"MNEME_MASTER_KEY": base64.b64encode(key).decode()})
    assert kms.unwrap("b", kms.wrap("b", key)) == key
    with pytest.raises(ValueError):
        kms.unwrap("other-bank", kms.wrap("b", key))  # bound to its bank
    with pytest.raises(ConfigurationError, match="32 bytes"):
        local_kms(None, {"MNEME_MASTER_KEY": base64.b64encode(b"short").decode()})
    with pytest.raises(ConfigurationError, match="not set"):
        local_kms(None, {})
    made = local_kms(tmp_path, {})
    assert (tmp_path / "master.key").stat().st_mode & 0o777 == 0o600
    again = local_kms(tmp_path, {})
    assert again.unwrap("b", made.wrap("b", key)) == key


def test_destroyed_keys_leave_no_bytes_in_the_key_file(tmp_path):
    store = SqliteKeyStore(str(tmp_path / "keys.db"))
    kr = Keyring(store, LocalKms(os.urandom(32)))
    kid = kr.current("b", "d:secret")
    wrapped = store.get("b", kid).wrapped
    kr.destroy_scope("b", "d:secret")
    assert store.get("b", kid).wrapped is None
    store.close()
    data = b"".join(p.read_bytes() for p in tmp_path.iterdir() if p.is_file())
    assert wrapped not in data


def test_the_key_caches_are_bounded(tmp_path):
    store = SqliteKeyStore(":memory:")
    kr = Keyring(store, LocalKms(os.urandom(32)), cache=10)
    for i in range(50):
        kr.ensure("b", f"f:{i}", "d:x")
        kr.combined("b", [f"f:{i}"])
    assert len(kr._keys) <= 10 and len(kr._combined) <= 10
    assert kr.key("b", "f:3") is not None  # evicted from the cache, still in the store


def test_a_widened_key_cache_unwraps_a_working_set_once_and_is_trimmed_after():
    """A replay names every key of a bank again and again (observations' seals): inside
    :meth:`Keyring.widened` a working set over the normal bound is unwrapped once per key,
    not once per use, and afterwards the caches hold the normal bound again."""
    store = SqliteKeyStore(":memory:")
    kr = Keyring(store, LocalKms(os.urandom(32)), cache=10)
    ids = [f"f:{i}" for i in range(40)]
    for k in ids:
        kr.ensure("b", k, "d:x")
    reads = []
    get, get_many = store.get, store.get_many
    store.get = lambda bank, k: reads.append(k) or get(bank, k)
    store.get_many = lambda bank, wanted: reads.extend(wanted) or get_many(bank, wanted)

    def sweep(times: int) -> None:
        for _ in range(times):
            kr.prefetch("b", ids)
            assert kr.combined("b", ids) is not None and kr.keys("b", ids) is not None

    sweep(3)
    assert len(reads) >= 3 * 30  # the normal bound thrashes: most keys read every time
    reads.clear()
    with kr.widened(100):
        with kr.widened(50):  # nested: the largest open one applies
            sweep(3)
        assert kr.cache == 100
    assert len(set(reads)) == len(reads) <= len(ids)  # each key read at most once
    assert kr.cache == 10 and len(kr._keys) <= 10 and len(kr._combined) <= 10
    assert {k for (_, k) in kr._keys} == set(ids[-10:])  # the most recently used stay
    assert kr.key("b", "f:0") is not None


def test_a_destroyed_key_leaves_no_cached_seal_key_that_names_it(tmp_path):
    """Seal keys are cached by a digest of their key ids; destroying one id must still
    make every seal over it unreadable at once, and leave the others as they were."""
    kr = Keyring(SqliteKeyStore(":memory:"), LocalKms(os.urandom(32)))
    for k in ("f:1", "f:2", "f:3"):
        kr.ensure("b", k, "d:x")
    kr.ensure("c", "f:1", "d:x")
    both, other, elsewhere = (kr.combined("b", ["f:1", "f:2"]), kr.combined("b", ["f:3"]),
                              kr.combined("c", ["f:1"]))
    assert both and other and elsewhere
    assert kr.combined("b", ["f:2", "f:1"]) != both  # the order of the ids counts
    assert kr.combined("b", ["f:1", "f:2"]) == both  # (cached)
    kr.destroy("b", ["f:2"])
    assert kr.combined("b", ["f:1", "f:2"]) is None
    assert kr.combined("b", ["f:3"]) == other
    assert kr.combined("c", ["f:1"]) == elsewhere


def test_ensure_many_creates_the_missing_keys_in_one_write_and_never_a_destroyed_one(tmp_path):
    store = SqliteKeyStore(str(tmp_path / "keys.db"))
    kr = Keyring(store, LocalKms(os.urandom(32)))
    try:
        first = kr.ensure("b", "f:1", "d:x")
        kr.destroy("b", ["f:2"])
        writes = []
        add_many = store.add_many
        store.add_many = lambda bank, rows: writes.append(len(rows)) or add_many(bank, rows)
        got = kr.ensure_many("b", [("f:1", "d:x"), ("f:2", "d:x"), ("f:3", "d:x"),
                                   ("f:4", "d:x")])
        assert got["f:1"] == first and got["f:2"] is None
        assert got["f:3"] and got["f:4"] and got["f:3"] != got["f:4"]
        assert writes == [2]  # the two new keys, together
        assert kr.key("b", "f:3") == got["f:3"] and store.get("b", "f:4").scope == "d:x"
    finally:
        store.close()


def test_a_retain_looks_up_each_documents_key_once(keyring):
    """On Kafka every look-up of a document's current key is a catch-up of the key topic:
    one per document of a record, not one per item."""
    calls = []
    current = keyring.store.current
    keyring.store.current = lambda bank, scope: calls.append(scope) or current(bank, scope)
    msg = ev.RetainRequested(bank_id="b", operation_id="op", items=[
        ev.RetainItem(content=f"turn {i}", document_id="s1" if i < 30 else "s2")
        for i in range(50)])
    out, opened = _seal_open(Sealer(keyring), msg)
    assert sorted(calls) == ["d:s1", "d:s2"]
    assert [i.content for i in ev.RetainRequested.FromString(opened.value).items] == \
        [f"turn {i}" for i in range(50)]


@pytest.mark.parametrize("msg", [
    ev.EntityMergeRequested(bank_id="b", operation_id="op", survivor_id="e1",
                            merged_ids=["e2"], display_name=f"Alice {MARKER}"),
    ev.EntitiesMerged(bank_id="b", operation_id="op", survivor_id="e1", merged_ids=["e2"],
                      display_name=f"Alice {MARKER}"),
    ev.EntitySplitRequested(bank_id="b", operation_id="op", entity_id="e1", new_entity_id="e3",
                            aliases=[f"ally {MARKER}"], memory_ids=["m1"], display_name="Ally"),
    ev.EntitySplit(bank_id="b", operation_id="op", entity_id="e1", new_entity_id="e3",
                   aliases=[f"ally {MARKER}"], memory_ids=["m1"], display_name="Ally"),
], ids=lambda m: m.DESCRIPTOR.name)
def test_entity_corrections_are_sealed_under_the_bank_key(keyring, msg):
    sealer = Sealer(keyring)
    out, opened = _seal_open(sealer, msg)
    assert MARKER.encode() not in out.value
    sealed = type(msg).FromString(out.value)
    [key] = sealed.seal.keys
    assert key.startswith("bank#") and sealed.operation_id == "op"  # ids in the clear
    back = type(msg).FromString(opened.value)
    back.ClearField("seal")
    assert back == msg
    keyring.destroy_bank("b")
    assert erased_record(sealer.open(_as_read(out)))


@pytest.mark.parametrize("msg", [
    ev.EntitySplit(bank_id="b", operation_id="op", entity_id="e1", new_entity_id="e3",
                   aliases=[f"ally {MARKER}"], memory_ids=["m1"], display_name="Ally"),
    ev.DirectiveChanged(bank_id="b", id="d1", text=f"Call {MARKER}"),
], ids=lambda m: m.DESCRIPTOR.name)
def test_content_of_a_deleted_bank_stays_erased_when_the_id_is_used_again(keyring, msg):
    """A bank deleted and created again seals its new content under a bank key of its
    own: the old incarnation's records read as erased (they were a seal error once the
    new one had sealed anything under the bank key, so ``mneme replay`` dead-lettered
    them and refused to switch)."""
    sealer = Sealer(keyring)
    old = sealer.seal(codec.encode(msg, bank_id="b", source="t"))
    keyring.destroy_bank("b")
    new, opened = _seal_open(sealer, msg)  # the same bank id, created again
    read = sealer.open(_as_read(old))
    assert SEAL_ERROR_HEADER not in read.headers and erased_record(read), read.headers
    assert not erased_record(sealer.open(_as_read(new, offset=1)))


def test_records_sealed_under_the_first_bank_key_id_still_open(keyring):
    """Logs written before the bank key had generations name it ``bank``: they open."""
    msg = ev.DirectiveChanged(bank_id="b", id="d1", text=f"Call {MARKER}")
    msg.seal.keys.append("bank")
    keyring.ensure("b", "bank", "bank")
    sealer = Sealer(keyring)
    out, opened = _seal_open(sealer, msg)
    assert ev.DirectiveChanged.FromString(out.value).seal.keys == ["bank"]
    assert ev.DirectiveChanged.FromString(opened.value).text == msg.text
    keyring.destroy_bank("b")
    assert erased_record(sealer.open(_as_read(out)))


def test_a_re_embeds_vectors_are_sealed_with_their_facts_keys(keyring):
    """VectorsReplaced (``mneme reembed``): each unit's vector is sealed under the keys
    :func:`services.extraction.reembed.seal_keys` names (a fact's own, an observation's
    evidence facts'), so deleting a document erases its facts' new vectors too."""
    from mneme.domain import Fact
    from services.extraction.reembed import seal_keys
    sealer = Sealer(keyring)
    _seal_open(sealer, _facts(("f1", "d1"), ("f2", "d2")))
    units = [Fact(id="f1", bank_id="b", text="x"), Fact(id="f2", bank_id="b", text="y"),
             Fact(id="o1", bank_id="b", text="z", fact_type="observation",
                  metadata={"evidence": '[{"memory_id": "f1", "quote": "x"}]'})]
    assert [seal_keys(u) for u in units] == [["f:f1"], ["f:f2"], ["f:f1"]]
    msg = ev.VectorsReplaced(bank_id="b", embedding_model="m2", units=[
        ev.UnitVector(id=u.id, fact_type=u.fact_type, vector=codec.to_float32([0.5] * 8),
                      seal=ev.Seal(keys=seal_keys(u))) for u in units])
    out, opened = _seal_open(sealer, msg)
    vector = array("f", msg.units[0].vector).tobytes()
    assert vector[:16] not in out.value
    assert ev.VectorsReplaced.FromString(opened.value) == ev.VectorsReplaced(
        bank_id="b", embedding_model="m2", units=[
            ev.UnitVector(id=u.id, fact_type=u.fact_type, vector=list(msg.units[0].vector),
                          seal=ev.Seal(keys=seal_keys(u))) for u in units])
    keyring.destroy_scope("b", "d:d1")
    assert [u.id for u in ev.VectorsReplaced.FromString(
        sealer.open(_as_read(out)).value).units] == ["f2"]


def test_a_batch_read_fetches_its_keys_in_one_store_read(keyring, tmp_path):
    inner = SqliteEventLog(str(tmp_path / "log.db"))
    log = SealedLog(inner, Sealer(keyring))
    try:
        log.ensure_topic("mneme.memory.v1", 1)
        log.append([codec.encode(_facts(*[(f"f{n}-{i}", f"doc{n}") for i in range(5)],
                                        op=f"op{n}"), bank_id="b", source="t")
                    for n in range(4)])
        keyring.forget("b", None)  # a fresh process: nothing cached
        calls = {"get": 0, "get_many": 0}
        store = keyring.store
        for name in calls:
            def counted(*a, _f=getattr(store, name), _n=name, **kw):
                calls[_n] += 1
                return _f(*a, **kw)
            setattr(store, name, counted)
        first = ev.FactsExtracted.FromString(inner.read("mneme.memory.v1", 0, 0)[0].value)
        store.destroy("b", [k for k in first.facts[0].seal.keys if k.startswith("f:")])
        keyring.forget("b", None)
        opened = [codec.decode(r).message for r in log.read("mneme.memory.v1", 0, 0)]
        # one read for the batch; the destroyed fact key is asked again when its fact is
        # opened (a tombstone is not cached), with its seal's other keys in one read
        assert calls == {"get": 0, "get_many": 2}
        assert [len(m.facts) for m in opened] == [4, 5, 5, 5]  # the destroyed one erased
        assert all(MARKER in f.text for m in opened for f in m.facts)
    finally:
        inner.close()


def _bank(**kw) -> ev.BankUpserted:
    config = dict(retain_mission=f"retain for {MARKER}", observations_mission="obs Wexmoor",
                  reflect_mission="reflect Wexmoor", skepticism=4, extraction_mode="offline",
                  erasure="crypto_shred", store_documents=False)
    config.update(kw.pop("config", {}))
    return ev.BankUpserted(bank_id="b", display_name=f"Bob's {MARKER}",
                           config=ev.BankConfig(**config), **kw)


@pytest.mark.parametrize("mask", [(), ("config.retain_mission",), ("display_name",)])
def test_a_banks_name_and_missions_are_sealed_under_the_bank_key(keyring, mask):
    """BankUpserted's user text (name, missions) was in the clear on the log, readable
    for ever, also after DeleteBank: it is sealed under the bank's key; the settings the
    projections route and decide on stay readable."""
    sealer = Sealer(keyring)
    msg = _bank(update_mask=list(mask))
    out, opened = _seal_open(sealer, msg)
    assert MARKER.encode() not in out.value and b"Wexmoor" not in out.value
    sealed = ev.BankUpserted.FromString(out.value)
    [key] = sealed.seal.keys
    assert key.startswith("bank#") and key == keyring.bank_content_key("b")
    assert (sealed.bank_id, list(sealed.update_mask), sealed.config.erasure,
            sealed.config.skepticism, sealed.config.extraction_mode,
            sealed.config.HasField("store_documents")) == (
        "b", list(mask), "crypto_shred", 4, "offline", True)
    assert not (sealed.display_name or sealed.config.retain_mission
                or sealed.config.observations_mission or sealed.config.reflect_mission)
    back = ev.BankUpserted.FromString(opened.value)
    assert not back.seal.ciphertext and ERASED_HEADER not in opened.headers
    back.ClearField("seal")
    assert back == msg


def test_a_deleted_banks_upsert_reads_with_its_settings_and_no_text(keyring):
    """After DeleteBank (a replay), the bank's upserts are erased but not skipped: their
    settings apply, the name and missions read empty (the deletion follows on the log)."""
    sealer = Sealer(keyring)
    out, _ = _seal_open(sealer, _bank())
    keyring.destroy_bank("b")
    read = sealer.open(_as_read(out))
    assert read.headers[ERASED_HEADER] == "1" and not erased_record(read)
    m = ev.BankUpserted.FromString(read.value)
    assert (m.display_name, m.config.retain_mission, m.config.reflect_mission) == ("", "", "")
    assert (m.config.skepticism, m.config.erasure) == (4, "crypto_shred")
    # created again: a new generation of the bank key, which the old upsert does not open
    again, opened = _seal_open(sealer, _bank())
    assert ev.BankUpserted.FromString(again.value).seal.keys != \
        ev.BankUpserted.FromString(out.value).seal.keys
    assert ev.BankUpserted.FromString(opened.value).display_name == f"Bob's {MARKER}"
    assert sealer.open(_as_read(out)).headers[ERASED_HEADER] == "1"


def test_an_upsert_goes_by_the_erasure_it_carries(keyring):
    """A new bank is in no catalog when its first upsert is sealed: the setting the event
    carries decides (an "erasure: none" bank stays in plaintext, a bank switched to
    crypto_shred is sealed from that upsert on)."""
    sealer = Sealer(keyring, erasure=lambda bank: True)
    out, opened = _seal_open(sealer, _bank(config={"erasure": "none"}))
    assert MARKER.encode() in out.value and opened.value == out.value
    sealer = Sealer(keyring, erasure=lambda bank: False)  # the catalog still says none
    out, _ = _seal_open(sealer, _bank(update_mask=["config.erasure"]))
    assert MARKER.encode() not in out.value


def test_an_unsealed_upsert_of_an_older_log_still_reads(keyring):
    sealer = Sealer(keyring)
    msg = _bank()
    read = sealer.open(_as_read(codec.encode(msg, bank_id="b", source="t")))
    assert ev.BankUpserted.FromString(read.value) == msg and ERASED_HEADER not in read.headers
