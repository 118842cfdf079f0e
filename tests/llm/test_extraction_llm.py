"""LLM fact extraction over real HTTP against the stub: scripted replies become facts
with absolute times, entities and causal links; malformed, truncated, slow and
rate-limited replies are retried, then recorded as item failures by the extraction
handler without losing the other items."""

from __future__ import annotations

from datetime import datetime, timezone

import pytest

from mneme.bus import codec
from mneme.domain import EXPERIENCE, WORLD, BankConfig, RetainItem, derive_id
from mneme.events.v1 import events_pb2 as ev
from mneme.llm import METRICS
from services.extraction import handlers
from services.extraction.llm import (ExtractionIncomplete, ItemExtractionFailed, LlmExtractor,
                                     split_text)
from tests.llm.conftest import make_gateway
from tests.llm.stub import chat, delay, status

UTC = timezone.utc
TS = datetime(2023, 5, 8, 13, 56, tzinfo=UTC)  # a Monday


def fact(text, ftype="world", start=None, end=None, entities=(), caused_by=()):
    return {"text": text, "fact_type": ftype, "occurred_start": start, "occurred_end": end,
            "entities": [{"name": n, "type": t} for n, t in entities], "caused_by": list(caused_by)}


class FakeEmbedder:
    model_name, dim = "fake-embedder", 3

    def embed(self, texts):
        return [[1.0, 0.0, 0.0] for _ in texts]


def extractor(gw, mission="", **kw):
    return LlmExtractor(gw, bank_config=lambda b: BankConfig(retain_mission=mission), **kw)


def test_scripted_reply_becomes_facts_with_times_entities_and_causal_links(stub, gateway):
    stub.on("chat", chat({"facts": [
        fact("Caroline went to an LGBTQ support group on 7 May 2023.", start="2023-05-07",
             end="2023-05-07", entities=[("Caroline", "person"), ("LGBTQ support group", "event")]),
        fact("Caroline decided to pursue counseling after the support group on 7 May 2023.",
             start="2023-05-07", entities=[("Caroline", "person")], caused_by=[0]),
        fact("Caroline moved from Sweden in 2015.", start="2015", end="2015",
             entities=[("Caroline", "person"), ("Sweden", "place")]),
        fact("Caroline is studying psychology.", entities=[("Caroline", "person")]),
        fact("I recommended a book on counseling to Caroline.", ftype="experience",
             start="2023-05", entities=[("Caroline", "person")]),
    ]}))
    item = RetainItem("Caroline: I went to a LGBTQ support group yesterday and it made me want "
                      "to pursue counseling! I moved from Sweden in 2015 ...", TS,
                      context="chat with Caroline", document_id="conv-1",
                      tags=("chat",), metadata={"speaker": "Caroline"})
    facts = extractor(gateway, mission="Remember the user's life events.").extract_many(
        "bank", [item], "op-1")

    assert [f.id for f in facts] == [derive_id("op-1", 0, n) for n in range(5)]
    f0, f1, f2, f3, f4 = facts
    assert f0.text == "Caroline went to an LGBTQ support group on 7 May 2023."
    day = (datetime(2023, 5, 7, tzinfo=UTC), datetime(2023, 5, 7, 23, 59, 59, 999999, tzinfo=UTC))
    assert (f0.occurred_start, f0.occurred_end) == day
    assert (f1.occurred_start, f1.occurred_end) == day  # a lone start spans its own period
    assert (f2.occurred_start, f2.occurred_end) == (
        datetime(2015, 1, 1, tzinfo=UTC), datetime(2015, 12, 31, 23, 59, 59, 999999, tzinfo=UTC))
    # no time from the model or in the text: the day it was told (as offline)
    assert (f3.occurred_start, f3.occurred_end) == (
        datetime(2023, 5, 8, tzinfo=UTC), datetime(2023, 5, 8, 23, 59, 59, 999999, tzinfo=UTC))
    assert (f4.occurred_start, f4.occurred_end) == (
        datetime(2023, 5, 1, tzinfo=UTC), datetime(2023, 5, 31, 23, 59, 59, 999999, tzinfo=UTC))
    assert all(f.mentioned_at == TS for f in facts)
    assert [f.fact_type for f in facts] == [WORLD] * 4 + [EXPERIENCE]
    # entities resolved per bank: one Caroline everywhere, labels mapped
    caroline = {e.id for f in facts for e in f.entities if e.name == "Caroline"}
    assert len(caroline) == 1
    assert {(e.name, e.label) for e in f2.entities} == {("Caroline", "PERSON"), ("Sweden", "GPE")}
    # links: effect → cause, and each fact to the previous one of the item
    assert ("causal", f0.id) in {(l.kind, l.target_id) for l in f1.links}
    assert ("temporal", f1.id) in {(l.kind, l.target_id) for l in f2.links}
    assert not any(l.kind == "causal" for l in f0.links)
    # item fields carried over
    assert {f.chunk_id for f in facts} == {derive_id("op-1", 0, "chunk", 0)}
    assert all(f.document_id == "conv-1" and f.tags == ("chat",) and f.context == "chat with Caroline"
               for f in facts)
    assert f0.metadata["speaker"] == "Caroline" and f0.metadata["extracted_by"] == "openai/stub-model"

    (req,) = stub.chat_requests()
    system, user = req.messages[0]["content"], req.messages[1]["content"]
    assert "Remember the user's life events." in system  # the bank's retain_mission steers it
    assert "Written at: 2023-05-08T13:56:00Z (Monday, 8 May 2023)" in user
    assert "Speaker: Caroline" in user and "Context: chat with Caroline" in user
    assert req.body["response_format"]["json_schema"]["name"] == "facts"
    assert req.body["temperature"] == 0.0
    assert METRICS.get("mneme.retain.documents", outcome="extracted") == 1


def test_relative_expressions_left_in_the_text_are_annotated(stub, gateway):
    stub.on("chat", chat({"facts": [fact("Melanie ran a charity race last Saturday.")]}))
    (f,) = extractor(gateway).extract_many("bank", [RetainItem("Melanie: I ran ...", TS)], "op")
    assert f.text == "Melanie ran a charity race last Saturday (6 May 2023)."
    # the window comes from the text's time expression when the model gave none
    assert f.occurred_start == datetime(2023, 5, 6, tzinfo=UTC)


def test_handler_records_failures_and_keeps_the_other_items(stub):
    """Item 1 is malformed every time, item 2 rate-limited past the retries, item 3 times
    out: each is an ItemFailure with its reason; items 0 and 4 keep their facts."""
    gw = make_gateway(stub, llm_timeout_s=1.0, llm_max_retries=1, llm_json_retries=1)
    stub.on("chat", chat({"facts": [fact("Alice adopted a cat named Miso.")]}), match="ITEM-ZERO")
    stub.on("chat", chat("{facts: [oops"), chat("still { not json"), match="ITEM-ONE")
    stub.on("chat", status(429), status(429), match="ITEM-TWO")
    stub.on("chat", delay(5.0), delay(5.0), match="ITEM-THREE")
    stub.on("chat", chat({"facts": [fact("Bob runs marathons.")]}), match="ITEM-FOUR")
    names = ["ZERO", "ONE", "TWO", "THREE", "FOUR"]
    m = ev.RetainRequested(bank_id="bank", operation_id="op-9", items=[
        codec.retain_item_to_pb(RetainItem(f"ITEM-{n} something worth remembering", TS,
                                           document_id=f"doc-{n}")) for n in names])
    ex = extractor(gw)
    out = handlers.extract(m, "op-9", ex, FakeEmbedder())

    assert out.items_total == 5
    assert [pb.text for pb in out.facts] == ["Alice adopted a cat named Miso.", "Bob runs marathons."]
    assert [pb.item_index for pb in out.facts] == [0, 4]
    assert [pb.id for pb in out.facts] == [derive_id("op-9", 0, 0), derive_id("op-9", 4, 0)]
    assert all(len(pb.embedding) == 3 for pb in out.facts)
    fails = {f.item_index: f.error for f in out.failures}
    assert set(fails) == {1, 2, 3}
    assert fails[1].startswith("ItemExtractionFailed: malformed")
    assert fails[2].startswith("ItemExtractionFailed: rate_limited")
    assert fails[3].startswith("ItemExtractionFailed: timeout")
    # the handler's per-item pass is served from the cache: no request was sent twice
    per_item = {n: sum(f"ITEM-{n}" in r.raw for r in stub.chat_requests()) for n in names}
    assert per_item == {"ZERO": 1, "ONE": 2, "TWO": 2, "THREE": 2, "FOUR": 1}
    assert METRICS.get("mneme.retain.documents", outcome="failed") == 3
    assert METRICS.get("mneme.retain.documents", outcome="extracted") == 2


def test_failure_is_a_specific_exception_with_usage(stub):
    gw = make_gateway(stub, llm_json_retries=0)
    stub.on("chat", chat("nope", prompt_tokens=50))
    with pytest.raises(ItemExtractionFailed) as e:
        extractor(gw).extract("bank", RetainItem("x y z", TS), 3, "op")
    assert e.value.item_index == 3 and e.value.reason == "malformed"
    assert e.value.usage.input_tokens == 50


def test_a_truncated_chunk_is_split_and_asked_again(stub):
    gw = make_gateway(stub, llm_max_output_tokens=256)
    first = "Dana planted tomatoes in the garden this spring. " * 3
    second = "Dana also built a greenhouse for winter vegetables. " * 3
    text = (first + "\n\n" + second).strip()
    stub.on("chat", chat('{"facts": [{"text": "Dana pla', finish_reason="length"), match="tomatoes")
    stub.on("chat", chat({"facts": [fact("Dana planted tomatoes in spring 2023.")]}), match="tomatoes")
    stub.on("chat", chat({"facts": [fact("Dana built a greenhouse.")]}), match="greenhouse")
    ex = extractor(gw)
    facts = ex.extract_many("bank", [RetainItem(text, TS)], "op")
    assert [f.text for f in facts] == ["Dana planted tomatoes in spring 2023.", "Dana built a greenhouse."]
    reqs = stub.chat_requests()
    assert len(reqs) == 3 and "greenhouse" not in reqs[1].text() and "tomatoes" not in reqs[2].text()
    assert ex.report("op").usage.calls == 3


def test_truncated_beyond_splitting_fails_the_item(stub, gateway):
    stub.on("chat", *[chat('{"facts": [', finish_reason="length")] * 3)
    with pytest.raises(ExtractionIncomplete) as e:
        extractor(gateway).extract_many("bank", [RetainItem("Short text.", TS)], "op")
    assert e.value.failures[0].reason == "truncated" and e.value.facts == []


def test_no_facts_is_counted_not_failed(stub, gateway):
    stub.on("chat", chat({"facts": []}))
    ex = extractor(gateway)
    items = [RetainItem("Thanks, bye!", TS), RetainItem("   ", TS)]
    assert ex.extract_many("bank", items, "op") == []
    report = ex.report("op")
    assert report.no_fact_items == [0, 1] and report.failures == {}
    assert len(stub.chat_requests()) == 1  # blank content costs no call
    assert METRICS.get("mneme.retain.documents", outcome="no_facts") == 2
    m = ev.RetainRequested(bank_id="bank", operation_id="op2",
                           items=[codec.retain_item_to_pb(RetainItem("Thanks again!", TS))])
    stub.on("chat", chat({"facts": []}))
    out = handlers.extract(m, "op2", ex, FakeEmbedder())
    assert list(out.facts) == [] and list(out.failures) == [] and out.items_total == 1


def test_long_items_are_chunked_and_ids_run_across_chunks(stub):
    gw = make_gateway(stub, retain_llm_chunk_chars=500)
    paras = [f"Paragraph {n}: " + "Erin talked about her trip to Lisbon. " * 8 for n in range(3)]
    stub.on("chat", chat({"facts": [fact("Erin visited Lisbon."), fact("Erin liked it.", caused_by=[0])]}))
    stub.on("chat", chat({"facts": [fact("Erin ate pastel de nata.")]}))
    stub.on("chat", chat({"facts": [fact("Erin flew home.")]}))
    facts = extractor(gw).extract_many("bank", [RetainItem("\n\n".join(paras), TS)], "op")
    reqs = stub.chat_requests()
    assert len(reqs) == 3 and "part 2 of 3" in reqs[1].text()
    assert [f.id for f in facts] == [derive_id("op", 0, n) for n in range(4)]
    assert [f.chunk_id for f in facts] == [derive_id("op", 0, "chunk", c) for c in (0, 0, 1, 2)]
    assert ("causal", facts[0].id) in {(l.kind, l.target_id) for l in facts[1].links}


def test_split_text_respects_the_limit():
    text = "\n\n".join(["word " * 50] * 5) + "\n\n" + "x" * 900
    chunks = split_text(text, 400)
    assert all(len(c) <= 400 for c in chunks) and "".join(chunks).replace(" ", "").replace("\n", "") \
        == text.replace(" ", "").replace("\n", "")


class FakeOffline:
    def __init__(self):
        self.calls = 0

    def extract_many(self, bank_id, items, source_id, first_index=0):
        self.calls += 1
        return []


def test_extraction_mode_per_bank(stub, gateway):
    from services.extraction.llm import BankModeExtractor

    modes = {"a": "offline", "b": "llm", "c": "", "d": "llm_only"}
    offline = FakeOffline()
    router = BankModeExtractor(offline, extractor(gateway),
                               bank_config=lambda b: BankConfig(extraction_mode=modes[b]) if b in modes else None)
    assert router.for_bank("a") is offline
    assert router.for_bank("b") is router.with_offline and router.for_bank("c") is router.with_offline
    assert router.for_bank("unknown") is router.with_offline
    assert router.for_bank("d") is router.llm
    assert router.with_offline.llm is router.llm and router.with_offline.offline is offline
    no_model = BankModeExtractor(offline, None,
                                 bank_config=lambda b: BankConfig(extraction_mode=modes[b]))
    assert no_model.for_bank("b") is offline and no_model.for_bank("d") is offline
    assert METRICS.get("mneme.retain.llm_unavailable_fallback") == 2


def _with_offline(gw):
    from services.extraction.llm import WithOfflineFacts
    from services.extraction.offline import OfflineExtractor
    return WithOfflineFacts(extractor(gw), OfflineExtractor())


def test_a_reply_links_only_to_the_item_just_before_it(stub, gateway):
    """The first fact of an item links (temporal 0.5, what recall reads as "answers") to
    the last fact of the item before it; when the model found nothing in that item, to
    none: not to an earlier item's fact."""
    stub.on("chat", chat({"facts": [fact("Caroline went to a support group.")]}),
            match="support group")
    stub.on("chat", chat({"facts": []}), match="Wow")
    stub.on("chat", chat({"facts": [fact("Melanie painted a bowl.")]}), match="pottery")
    stub.on("chat", chat({"facts": [fact("Caroline likes the bowl.")]}), match="lovely")
    items = [RetainItem(t, TS, document_id="conv") for t in (
        "Caroline: I went to a support group yesterday.", "Melanie: Wow!",
        "Melanie: I painted that pottery bowl last year!", "Caroline: It is lovely.")]
    facts = extractor(gateway).extract_many("bank", items, "op-1")
    assert [f.item_index for f in facts] == [0, 2, 3]
    replies = {f.item_index: [lk.target_id for lk in f.links
                              if lk.kind == "temporal" and lk.weight == 0.5] for f in facts}
    assert replies == {0: [], 2: [], 3: [facts[1].id]}


def test_offline_facts_are_kept_beside_the_models(stub, gateway):
    """The model's facts come first per item, then the offline facts of the same item,
    marked and with their own ids; an item the model finds nothing in keeps its offline
    fact (and is no no-fact item), so a model cannot make an item unrecallable."""
    stub.on("chat", chat({"facts": [fact("Caroline went to an LGBTQ support group on 7 May 2023.",
                                          start="2023-05-07", end="2023-05-07")]}),
            match="support group")
    stub.on("chat", chat({"facts": []}), match="pottery")
    items = [RetainItem("Caroline: I went to a LGBTQ support group yesterday.", TS,
                        document_id="conv", metadata={"speaker": "Caroline", "dia_id": "D1:1"}),
             RetainItem("Melanie: Yeah, painted that pottery bowl last year!", TS,
                        document_id="conv", metadata={"speaker": "Melanie", "dia_id": "D1:2"})]
    x = _with_offline(gateway)
    facts = x.extract_many("bank", items, "op-1")
    by = [(f.item_index, f.metadata.get("extracted_by")) for f in facts]
    assert by == [(0, "openai/stub-model"), (0, "offline"), (1, "offline")]
    assert facts[0].id == derive_id("op-1", 0, 0)
    assert len({f.id for f in facts}) == 3
    assert facts[1].text.startswith("Caroline: I went to a LGBTQ support group yesterday")
    assert [f.metadata["dia_id"] for f in facts] == ["D1:1", "D1:1", "D1:2"]
    # the offline reply is linked to the offline turn it answers, not to the model's fact
    assert ("temporal", facts[1].id) in {(l.kind, l.target_id) for l in facts[2].links}
    # embedded as offline embeds it: the short reply with the turn it answers
    parts = x.embedding_parts(facts)
    assert parts[0].texts == (facts[0].text,) and parts[0].context is None
    assert len(parts[2].texts) == 1 and "(in reply to Caroline:" in parts[2].texts[0]
    assert parts[1].context is None  # the offline turn's context is an offline fact, if any

    out = handlers.extract(ev.RetainRequested(bank_id="bank", operation_id="op-1", items=[
        codec.retain_item_to_pb(i) for i in items]), "op-1", x, FakeEmbedder())  # cached replies
    assert not out.failures and list(out.no_fact_items) == []
    assert [f.item_index for f in out.facts] == [0, 0, 1]


def test_the_offline_facts_context_is_found_among_the_models_facts():
    """Beside a model's facts, an offline fact's context (the offline turn before it) is
    named by its index in the whole list, not among the offline facts alone."""
    from mneme.domain import Fact
    from services.extraction.llm import OFFLINE, WithOfflineFacts
    from services.extraction.offline import OfflineExtractor

    items = [RetainItem("Mia: Who is in the photo on your desk?", TS, document_id="d"),
             RetainItem("Leo: That's my sister and my dogs. We were chilling at the lake "
                        "house yesterday.", TS, document_id="d")]
    offline = OfflineExtractor().extract_many("bank", items, "op")
    for f in offline:
        f.metadata["extracted_by"] = OFFLINE
    model = [Fact(id=f"m{k}", bank_id="bank", text=t, fact_type=WORLD) for k, t in
             enumerate(("Mia asked about a photo.", "Leo's sister visited him."))]
    facts = [model[0], offline[0], model[1], offline[1]]
    parts = WithOfflineFacts(None, OfflineExtractor()).embedding_parts(facts)
    assert [p.texts for p in parts[::2]] == [(model[0].text,), (model[1].text,)]
    assert parts[3].context == 1 and len(parts[3].texts) == 2  # its sentences; the turn before
    assert parts[1].context is None and parts[0].context is None


def test_an_item_the_model_fails_on_gets_no_offline_facts(stub):
    """A model failure stays a failure (recorded, retryable); the other items keep both
    kinds of facts, and the offline facts of a run after the failure are not linked
    across it."""
    gw = make_gateway(stub, llm_max_retries=0, llm_max_concurrency=1)
    stub.on("chat", chat({"facts": [fact("Alice adopted a cat named Miso.")]}), match="ITEM-0")
    stub.on("chat", status(400, "bad request"), match="ITEM-1")
    stub.on("chat", chat({"facts": [fact("Bob runs marathons.")]}), match="ITEM-2")
    items = [RetainItem(f"ITEM-{n}: something worth remembering about cats", TS,
                        document_id="d") for n in range(3)]
    x = _with_offline(gw)
    with pytest.raises(ExtractionIncomplete) as e:
        x.extract_many("bank", items, "op-1")
    assert set(e.value.failures) == {1}
    assert [(f.item_index, f.metadata.get("extracted_by")) for f in e.value.facts] == [
        (0, "openai/stub-model"), (0, "offline"), (2, "openai/stub-model"), (2, "offline")]
    offline2 = e.value.facts[3]
    assert not any(l.weight == 0.5 for l in offline2.links)
    with pytest.raises(ItemExtractionFailed):  # the handler's per-item path, the same way
        x.extract("bank", items[1], 1, "op-1")


def test_a_cancelled_request_stops_before_the_next_item(stub):
    """``stop`` turns true once the first item was asked: the items not started fail
    "cancelled" without a model call, and are not cached (asked again, they run)."""
    gw = make_gateway(stub, llm_max_concurrency=1)
    stub.on("chat", chat({"facts": [fact("Alice adopted a cat named Miso.")]}),
            chat({"facts": [fact("Bob runs marathons.")]}))
    items = [RetainItem(f"ITEM-{n} something worth remembering", TS) for n in range(3)]
    ex = extractor(gw)
    with pytest.raises(ExtractionIncomplete) as e:
        ex.extract_many("bank", items, "op-c", stop=lambda: len(stub.chat_requests()) >= 1)
    assert [f.item_index for f in e.value.facts] == [0]
    assert {i: f.reason for i, f in e.value.failures.items()} == {1: "cancelled", 2: "cancelled"}
    assert len(stub.chat_requests()) == 1
    assert [f.text for f in ex.extract_many("bank", items[1:2], "op-c", first_index=1)] == [
        "Bob runs marathons."]


def test_a_model_reads_and_answers_the_writers_clock(stub, gateway):
    # 23:30 on 1 March 2024 in New York is 04:30 on 2 March in UTC
    stub.on("chat", chat({"facts": [
        fact("Ivy ran a marathon on 29 February 2024 at 9 pm.", start="2024-02-29T21:00-05:00"),
        fact("Ivy is tired."),
    ]}))
    item = RetainItem("Ivy: I ran a marathon yesterday at 9 pm, I'm tired", datetime(
        2024, 3, 2, 4, 30, tzinfo=UTC), time_zone="America/New_York", metadata={"speaker": "Ivy"})
    timed, untimed = extractor(gateway).extract_many("bank", [item], "op-tz")
    prompt = stub.chat_requests()[-1].raw
    assert "2024-03-01T23:30:00-05:00" in prompt and "Friday, 1 March 2024" in prompt
    # the model's time is a wall time of the writer's day, kept as such (not shifted to
    # 2 March 02:00 UTC by its offset); a fact with no time is dated by the writer's day
    assert timed.occurred_start == datetime(2024, 2, 29, 21, tzinfo=UTC)
    assert (untimed.occurred_start.date().isoformat(), untimed.occurred_end.date().isoformat()) == (
        "2024-03-01", "2024-03-01")
    assert timed.mentioned_at == item.timestamp  # the instant itself stays as it was


def test_an_items_failure_never_quotes_the_models_reply(stub):
    """A reply that breaks the schema fails its item; the failure's error goes in the
    clear on the log (FactsExtracted.failures, never sealed nor erased), so it names the
    path and the rule broken, not the value (jsonschema's message quotes it: here the
    item's own text). The model is still told the whole message when re-asked."""
    secret = "Alice's phone is 415-555-0171"
    gw = make_gateway(stub, llm_json_retries=1)
    bad = {"facts": [{**fact("x"), "text": [secret]}]}
    stub.on("chat", chat(bad), chat(bad))
    m = ev.RetainRequested(bank_id="bank", operation_id="op-7", items=[
        codec.retain_item_to_pb(RetainItem(f"Alice: my phone is 415-555-0171", TS,
                                           document_id="doc"))])
    out = handlers.extract(m, "op-7", extractor(gw), FakeEmbedder())
    error, = [f.error for f in out.failures]
    assert "415-555" not in error and "facts/0/text" in error and "type" in error, error
    assert secret in stub.chat_requests()[1].messages[-1]["content"]


def test_an_items_failure_never_quotes_the_item(caplog):
    """An extractor error that quotes the text it choked on (Python's errors quote the
    values they reject) fails the item without its message: the failure is in the clear
    on the log, where the deletion of the item's document cannot reach it. One that quotes
    nothing of the item is told whole."""
    secret = "my vault code is ZEBRA-SECRET-4711"

    class Choking:
        def extract_many(self, bank_id, items, source_id, **kw):
            raise ValueError(f"cannot parse {items[0].content!r}")

        def extract(self, bank_id, item, index, source_id):
            if "ZEBRA" in item.content:
                raise ValueError(f"cannot parse {item.content!r}")
            raise RuntimeError("no room for item 1 (limit 3)")

    m = ev.RetainRequested(bank_id="bank", operation_id="op-5", items=[
        codec.retain_item_to_pb(RetainItem(f"Alice: {secret}.", TS, document_id="doc")),
        codec.retain_item_to_pb(RetainItem("Bob rides a bike.", TS, document_id="doc"))])
    out = handlers.extract(m, "op-5", Choking(), FakeEmbedder())
    fails = {f.item_index: f.error for f in out.failures}
    assert fails[0].startswith("ValueError") and "ZEBRA" not in fails[0], fails
    assert fails[1] == "RuntimeError: no room for item 1 (limit 3)"
    assert "ZEBRA" not in caplog.text


@pytest.mark.parametrize("code", [400, 500])
def test_a_providers_words_about_its_own_disk_are_an_items_failure_not_a_shortage(stub, code):
    """A provider's error text is the provider's: one that echoes the prompt (the user's
    own "No space left on device"), or whose own disk is full, fails the item as any other
    model error. Taken for this process's shortage it was raised instead, and the consumer
    handled the event again for as long as the provider said so (a 400 echoing the prompt:
    for ever), the partition stuck behind it."""
    from mneme.errors import resource_shortage
    text = "Ops: the backup died with 'No space left on device' (os error 28)"
    gw = make_gateway(stub, llm_max_retries=0)
    stub.on("chat", status(code, f"cannot serve {text!r}"), status(code, f"cannot serve {text!r}"))
    m = ev.RetainRequested(bank_id="bank", operation_id="op-8", items=[
        codec.retain_item_to_pb(RetainItem(text, TS, document_id="doc"))])
    out = handlers.extract(m, "op-8", extractor(gw), FakeEmbedder())
    assert [f.item_index for f in out.failures] == [0]
    # this process's own shortage behind a model call is still one
    from mneme.llm import LlmUnavailable
    try:
        try:
            raise OSError(24, "Too many open files")
        except OSError as local:
            raise LlmUnavailable("retain call failed (unavailable): Connection error") from local
    except LlmUnavailable as e:
        assert resource_shortage(e) == "open files"


def test_an_item_failed_for_want_of_open_files_is_extracted_once_there_are_some(stub):
    """A model call that cannot open its connection at the open-file limit fails the item
    with that shortage, which goes up so that the consumer handles the event again later.
    The extractor kept the failure in its cache of results, so every later try answered
    it again without calling the model, after files were freed too: the event was retried
    for ever. Such a failure is not kept."""
    from mneme.llm import LlmUnavailable
    gw = make_gateway(stub)
    real = gw.complete_json
    calls = []

    def complete_json(*a, **kw):
        calls.append(1)
        if len(calls) == 1:
            try:
                raise OSError(24, "Too many open files")
            except OSError as local:
                raise LlmUnavailable("retain call failed (unavailable): Connection error",
                                     "unavailable") from local
        return real(*a, **kw)
    gw.complete_json = complete_json
    stub.on("chat", chat({"facts": [fact("Ann likes tea.")]}))
    x = extractor(gw)
    m = ev.RetainRequested(bank_id="bank", operation_id="op-9", items=[
        codec.retain_item_to_pb(RetainItem("Ann: I like tea.", TS, document_id="doc"))])
    with pytest.raises(ItemExtractionFailed):
        handlers.extract(m, "op-9", x, FakeEmbedder())
    out = handlers.extract(m, "op-9", x, FakeEmbedder())  # files freed: handled again
    assert not out.failures and [f.text for f in out.facts] == ["Ann likes tea."]
