"""A model endpoint that misbehaves as real providers do, over real HTTP against the stub:
lone UTF-16 surrogates in its text (a cut emoji escape), a 200 reply of the wrong shape,
a rerank answer with unusable entries, a reply that never ends, and fact lists that are
junk (causal indexes into dropped or missing facts, a megabyte of text, thousands of
facts for one sentence, names that are not names). Each must end as an ``LlmError`` the
callers handle, or be cleaned, never as a crash that fails a whole request."""

from __future__ import annotations

import json
import threading
from datetime import datetime, timezone

import pytest

from mneme.domain import Fact, RetainItem, Scored
from mneme.llm import LlmError, LlmUnavailable
from mneme.llm.rerank import rerank
from services.extraction.llm import LlmExtractor
from tests.llm.conftest import make_gateway
from tests.llm.stub import Reply, chat, computed, drip, status

TS = datetime(2023, 5, 8, 13, 56, tzinfo=timezone.utc)
MSGS = [{"role": "user", "content": "hi"}]


def raw(body: str) -> Reply:
    """A 200 answer whose body is ``body`` as is."""
    return Reply("raw", code=200, text=body)


def completion(content_json: str) -> Reply:
    """A chat completion whose message content is the JSON string literal
    ``content_json`` written as is (so escapes such as a lone ``\\ud83d`` reach the client)."""
    return raw('{"id": "c", "object": "chat.completion", "created": 1, "model": "m", '
               '"choices": [{"index": 0, "finish_reason": "stop", "message": {"role": '
               f'"assistant", "content": {content_json}}}}}], "usage": {{"prompt_tokens": 1, '
               '"completion_tokens": 1, "total_tokens": 2}}')


def encodable(value) -> bool:
    json.dumps(value, ensure_ascii=False).encode("utf-8")  # raises on a lone surrogate
    return True


def test_lone_surrogates_in_model_text_become_replacement_characters(stub, gateway):
    # content text with a lone high surrogate, and JSON inside the content whose string
    # escapes decode to one (a model that cut an emoji's escape in half)
    stub.on("chat", completion(r'"tea \ud83d time, \ud83d\ude00 ok"'))
    c = gateway.complete("retain", MSGS)
    assert c.text == "tea \ufffd time, \U0001F600 ok" and encodable(c.text)
    stub.on("chat", completion(r'"{\"facts\": [{\"text\": \"Ann likes \\ud83d tea\", '
                               r'\"entities\": [{\"name\": \"Ann\\udc00\"}]}]}"'))
    value = gateway.complete_json("retain", MSGS, {"type": "object"}).value
    assert value == {"facts": [{"text": "Ann likes \ufffd tea",
                                "entities": [{"name": "Ann\ufffd"}]}]}
    stub.on("chat", chat("streamed \udc00 text"))
    *deltas, done = list(gateway.stream("reflect", MSGS))
    assert done.text == "streamed \ufffd text" and all(encodable(d) for d in deltas)


def test_an_extracted_fact_with_a_lone_surrogate_is_stored_cleaned(stub, gateway):
    stub.on("chat", completion(r'"{\"facts\": [{\"text\": \"Ann likes \\ud83d tea\", '
                               r'\"entities\": [{\"name\": \"Ann\\ud83d\", \"type\": \"person\"}]}]}"'))
    facts = LlmExtractor(gateway).extract_many(
        "b", [RetainItem("Ann: I like tea \U0001F375", TS)], "op")
    assert [f.text for f in facts] == ["Ann likes \ufffd tea"]
    assert encodable([e.name for e in facts[0].entities])


@pytest.mark.parametrize("body", [
    '{"id": "c", "object": "chat.completion", "created": 1, "model": "m", "choices": []}',
    '{"id": "c", "object": "chat.completion", "created": 1, "model": "m"}',
])
def test_a_reply_of_the_wrong_shape_is_an_llm_error_not_a_crash(stub, body):
    gw = make_gateway(stub, llm_max_retries=1)
    stub.on("chat", raw(body), raw(body))
    with pytest.raises(LlmError) as e:
        gw.complete("retain", MSGS)
    assert e.value.usage.failed_calls == 2
    if "choices" in body:  # litellm itself refuses an answer without the key
        assert e.value.reason == "malformed"
    assert gw.sleeps and len(stub.chat_requests()) == 2  # retried once, by the policy


def test_a_reply_that_never_ends_is_bounded_by_the_call_timeout(stub):
    """A server that sends a byte every 0.2 s forever resets the HTTP client's read
    timeout each time: only a bound on the whole attempt ends the call."""
    gw = make_gateway(stub, llm_timeout_s=1.0, llm_max_retries=1)
    stop = threading.Event()
    stub.on("chat", drip(0.2, stop), drip(0.2, stop))
    try:
        with pytest.raises(LlmUnavailable) as e:
            gw.complete("retain", MSGS)
        assert e.value.reason == "timeout" and e.value.usage.failed_calls == 2
        assert "no complete answer within 1.0 s" in str(e.value)
    finally:
        stop.set()


def fused(n=4):
    return [Scored(fact=Fact(id=f"f{i}", bank_id="b", text=f"fact number {i}"), final=1.0 - i / 10)
            for i in range(n)]


def test_unusable_rerank_entries_leave_those_candidates_in_fusion_order(stub):
    gw = make_gateway(stub, rerank_model="hosted_vllm/bge", rerank_base_url=stub.root_url,
                      rerank_head=4)
    # litellm refuses a result without an integer index itself (the call fails: fusion
    # order); these it lets through
    stub.on("rerank", Reply("rerank", {"id": "r", "results": [
        {"index": 3, "relevance_score": 0.9}, {"index": 7, "relevance_score": 0.8},
        {"index": -1, "relevance_score": 0.7}, {"index": 1, "relevance_score": float("nan")},
        {"index": 3, "relevance_score": 0.1}]}))
    out = rerank("q", fused(), gw)
    assert [s.fact.id for s in out] == ["f3", "f0", "f1", "f2"]
    assert out[0].scores["rerank"] == 0.9 and "rerank" not in out[2].scores  # f1: NaN


def fact(text, **kw):
    d = {"text": text, "fact_type": "world", "occurred_start": None, "occurred_end": None,
         "entities": [], "caused_by": []}
    d.update(kw)
    return d


def test_causal_links_follow_the_models_own_positions(stub, gateway):
    """``caused_by`` indexes the model's list: a fact it gave without text is dropped,
    and the links of the others still point at the facts the model meant; indexes out of
    the list (negative, past its end, of another chunk) link nothing."""
    stub.on("chat", chat({"facts": [
        fact(""), fact("Eve fell ill on 7 May 2023."),
        fact("Eve stayed home on 8 May 2023.", caused_by=[1, -1, 7, 0]),
        fact("Eve missed the concert.", caused_by=[2]),
        fact("Eve was sad.", caused_by=3, entities=5)]}))
    facts = LlmExtractor(gateway).extract_many(
        "b", [RetainItem("Eve: I fell ill yesterday so I stayed home and missed the concert.",
                         TS)], "op")
    by_text = {f.text.split(" on ")[0].rstrip("."): f for f in facts}
    ill, home, concert = (by_text[k] for k in ("Eve fell ill", "Eve stayed home",
                                                "Eve missed the concert"))
    assert [l.target_id for l in home.links if l.kind == "causal"] == [ill.id]
    assert [l.target_id for l in concert.links if l.kind == "causal"] == [home.id]


def test_junk_facts_are_bounded(stub, gateway):
    """A fact longer than its text could ever say, a reply with thousands of facts for
    one sentence, and entity names that are no names are dropped, not stored."""
    text = "Dan: I adopted a cat named Tom and a dog named Rex."
    stub.on("chat", chat({"facts": [
        fact("Dan adopted a cat named Tom.",
             entities=[{"name": "Tom", "type": "thing"}, {"name": "T" * 5000, "type": "person"},
                       {"name": "\u200b\u200b", "type": "person"},
                       {"name": "\u200c\u200d", "type": "person"}]),
        fact("Dan " + "x" * 1_000_000)] + [fact(f"Dan has pet number {i}.") for i in range(5000)]}))
    facts = LlmExtractor(gateway).extract_many("b", [RetainItem(text, TS)], "op")
    assert facts[0].text == "Dan adopted a cat named Tom."
    assert [e.name for e in facts[0].entities] == ["Tom"]
    assert max(len(f.text) for f in facts) < 1000
    assert len(facts) <= 64


def test_a_caller_that_goes_away_mid_call_stops_the_call(stub):
    """The caller cancels while the model holds its answer (and while a stream drips):
    the call ends with Cancelled then, not when the model answers (it would, 10 s after
    the request arrived, well within the call's timeout)."""
    from mneme import deadline
    from mneme.errors import Cancelled
    gw = make_gateway(stub, llm_timeout_s=60.0)
    for script in (Reply("delay", seconds=60, until=threading.Event(), then=chat("late")),
                   drip(0.2, threading.Event(), b": keep-alive\n\n")):
        held, gone, timers = script.until, threading.Event(), []

        def in_flight(request, script=script, held=held, gone=gone, timers=timers):
            # the caller goes away once the model has the request; the model would answer later
            timers += [threading.Timer(0.3, gone.set), threading.Timer(10.0, held.set)]
            for t in timers:
                t.start()
            return script
        stub.on("chat", computed(in_flight))
        try:
            with deadline.bind(deadline.Deadline(None, lambda gone=gone: not gone.is_set())):
                with pytest.raises(Cancelled):
                    if script.kind == "drip":
                        list(gw.stream("reflect", MSGS))
                    else:
                        gw.complete("reflect", MSGS)
            assert gone.is_set() and len(stub.chat_requests()) in (1, 2)
        finally:
            for t in timers:
                t.cancel()
            held.set()


def test_a_runaway_tool_turn_is_bounded(stub, gateway):
    """A reflect model that asks for a thousand tool calls in one turn, or recalls with a
    megabyte of query text, got them all: each a recall (78 s for the megabyte through
    mneme up). A turn runs at most MAX_TOOL_CALLS_PER_TURN calls (the assistant message
    keeps only those, each answered) and a query is cut to the API's query limit."""
    from mneme.domain import RecallOutcome
    from mneme.limits import limits
    from services.reflect.agent import MAX_TOOL_CALLS_PER_TURN, ReflectAgent

    queries = []

    def recall(q):
        queries.append(q.query)
        return RecallOutcome([Scored(fact=Fact(id="f1", bank_id="b", text="Ann likes tea."))], 5)
    calls = [{"name": "recall", "arguments": {"query": f"tea {i}"}} for i in range(1000)]
    stub.on("chat", chat(None, tool_calls=calls),
            chat(None, tool_calls=[{"name": "recall", "arguments": {"query": "tea " * 250_000}}]),
            chat("Ann likes tea [m1]."))
    r = ReflectAgent(gateway, recall)("b", "What does Ann like?", "", "mid", TS)
    assert r.text == "Ann likes tea [1]." and len(queries) == MAX_TOOL_CALLS_PER_TURN + 1
    assert len(queries[-1]) <= limits().query_chars
    second = stub.chat_requests()[1].messages
    assert len(second[-MAX_TOOL_CALLS_PER_TURN - 1]["tool_calls"]) == MAX_TOOL_CALLS_PER_TURN
    assert [m["role"] for m in second[-MAX_TOOL_CALLS_PER_TURN:]] == ["tool"] * MAX_TOOL_CALLS_PER_TURN


def test_a_misbehaving_model_through_mneme_up_leaves_the_bank_whole(stub, server):
    """End to end: a reply with a cut emoji escape in a fact and an entity, then a reply
    with thousands of facts and a megabyte of text, then an ordinary one. Every retain
    succeeds (the bank is not poisoned), each item keeps its offline fact, the junk is
    bounded, and ``mneme replay`` rebuilds exactly what was served."""
    def memories(m):
        return sorted((x.id, x.text, tuple(sorted(e.name for e in x.entities)))
                      for x in m.list_memories("mis"))
    stub.on("chat", completion(r'"{\"facts\": [{\"text\": \"Ann likes \\ud83d tea.\", '
                               r'\"entities\": [{\"name\": \"Ann\\udc00\", \"type\": \"person\"}]}]}"'),
            match="cut-emoji")
    stub.on("chat", chat({"facts": [fact("Dan " + "x" * 1_000_000)]
                          + [fact(f"Dan has pet number {i}.") for i in range(5000)]}),
            match="runaway")
    stub.on("chat", chat({"facts": [fact("Ann has a dog named Rex.",
                                         entities=[{"name": "Ann", "type": "person"}])]}),
            match="dog named Rex")
    with server.client() as m:
        m.upsert_bank("mis", auto_consolidate=False)
        for text in ("Ann: cut-emoji I like tea \U0001F375", "Dan: runaway I have pets.",
                     "Ann: I have a dog named Rex."):
            r = m.retain("mis", [{"content": text, "timestamp": TS,
                                  "metadata": {"speaker": text.split(":")[0]}}])
            assert r.operation.state == 3, r.operation.error
        live = memories(m)
        texts = [t for _, t, _ in live]
        assert "Ann likes \ufffd tea." in texts and "Ann has a dog named Rex." in texts
        assert all(any(t.startswith(s) for t in texts) for s in ("Ann: cut-emoji", "Dan: runaway",
                                                                  "Ann: I have a dog"))
        assert len(texts) < 40 and max(map(len, texts)) < 1000
    server.replay()
    with server.client() as m:
        assert memories(m) == live


def test_a_provider_that_echoes_the_key_never_gets_it_into_errors(stub, caplog):
    """Some proxies answer a bad key by quoting it. The failure's text goes into logs, an
    item's failure on the event log (in the clear) and the operation's error: the key is
    masked there."""
    from mneme.llm import LlmRequestError
    gw = make_gateway(stub, llm_api_key="sk-live-0123456789abcdef")
    stub.on("chat", Reply("status", {"error": {
        "message": "Incorrect API key provided: sk-live-0123456789abcdef", "code": 401}},
        code=401))
    with pytest.raises(LlmRequestError) as e:
        gw.complete("retain", MSGS)
    assert e.value.reason == "auth" and "Incorrect API key" in str(e.value)
    assert "0123456789abcdef" not in str(e.value) and "0123456789abcdef" not in caplog.text


def test_a_streamed_reflect_that_stops_halfway_ends_unavailable(stub, server):
    """The model's stream dies after part of the answer was sent: the partial text cannot
    be taken back (no extractive fallback), and the call must end with a status a client
    can act on -- UNAVAILABLE naming the broken stream -- not UNKNOWN."""
    import grpc
    from tests.llm.stub import cut
    with server.client() as m:
        m.upsert_bank("half", auto_consolidate=False, extraction_mode="offline")
        m.retain("half", [{"content": "Caroline: I moved to Berlin in 2021.", "timestamp": TS}])
        stub.on("chat", chat(None, tool_calls=[{"name": "recall",
                                                 "arguments": {"query": "Caroline Berlin"}}]),
                cut(chat("Caroline moved to Berlin in 2021 [m1] and then she"), 20),
                match="Where did Caroline")
        got = []
        with pytest.raises(grpc.RpcError) as e:
            for event in m.stream_reflect("half", "Where did Caroline move?"):
                got.append(event.WhichOneof("event"))
        assert "text_delta" in got and "done" not in got
        assert e.value.code() == grpc.StatusCode.UNAVAILABLE, e.value
        assert "stream" in e.value.details()


@pytest.mark.filterwarnings("ignore:This process .* is multi-threaded")
def test_a_forked_process_makes_model_calls_on_its_own_loop(stub, gateway):
    """Model calls run on an event loop thread; a child forked after the parent made one
    has the loop object but no thread to run it, and its first call would wait forever."""
    import os
    import signal
    import time
    stub.on("chat", chat("parent"), chat("child"))
    assert gateway.complete("retain", MSGS).text == "parent"
    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: answer through the pipe, never return into pytest
        try:
            os.write(write, gateway.complete("retain", MSGS).text.encode())
        finally:
            os._exit(0)
    os.close(write)
    end = time.monotonic() + 60  # a hang, not a timing assertion
    while os.waitpid(pid, os.WNOHANG) == (0, 0) and time.monotonic() < end:
        time.sleep(0.05)
    if time.monotonic() >= end:
        os.kill(pid, signal.SIGKILL)
        os.waitpid(pid, 0)
    assert os.read(read, 100) == b"child"
    os.close(read)


def test_a_stream_its_reader_abandons_releases_the_connection(stub, gateway):
    """A reflect client that goes away stops reading the model's stream; the stream's
    HTTP connection must be closed then, not held open while the model goes on."""
    piece = ('data: {"id": "c", "object": "chat.completion.chunk", "created": 1, "model": "m", '
             '"choices": [{"index": 0, "delta": {"content": "more "}, "finish_reason": null}]}'
             '\n\n').encode()
    stop = threading.Event()
    stub.on("chat", drip(0.1, stop, piece))
    try:
        deltas = gateway.stream("reflect", MSGS)
        assert next(deltas) == "more "
        deltas.close()  # the reader has gone
        assert stub.client_gone.wait(30)  # a hang, not a timing assertion
    finally:
        stop.set()


def _cannot_shape():
    return [chat(None, tool_calls=[{"name": "recall", "arguments": {"query": "Caroline"}}]),
            *[chat("Berlin, I think.")] * 4]


@pytest.mark.parametrize("bank, replies, code, reason", [
    ("shape", _cannot_shape, "UNAVAILABLE", "malformed"),
    ("refused", lambda: [status(401, "invalid api key")], "FAILED_PRECONDITION", "auth")])
def test_a_structured_reflect_the_model_fails_ends_with_a_status_to_act_on(
        stub, server, bank, replies, code, reason):
    """Reflect with a response_schema whose model fails: there is no extractive fallback
    for a schema (before, a model failing in the agent loop -- a 401 -- got an extractive
    answer, prose where JSON of the schema was asked for, answered OK), and the call must
    end with a status a client can act on, naming the reason, not UNKNOWN: UNAVAILABLE
    when the model never answers in that shape (nor when re-asked), FAILED_PRECONDITION
    when it refuses the request for good (a wrong key: asking again cannot help). The
    same for the streaming form."""
    import grpc
    schema = {"type": "object", "required": ["city"], "properties": {"city": {"type": "string"}}}
    with server.client() as m:
        m.upsert_bank(bank, auto_consolidate=False, extraction_mode="offline")
        m.retain(bank, [{"content": "Caroline: I moved to Berlin in 2021.", "timestamp": TS}])
        for stream in (False, True):
            stub.on("chat", *replies(), match="Where did Caroline")
            with pytest.raises(grpc.RpcError) as e:
                if stream:
                    list(m.stream_reflect(bank, "Where did Caroline move?",
                                          response_schema=schema))
                else:
                    m.reflect(bank, "Where did Caroline move?", response_schema=schema)
            assert e.value.code() == getattr(grpc.StatusCode, code), e.value
            assert reason in e.value.details()


def test_joiners_that_spell_a_name_are_kept(stub, gateway):
    """Zero-width (non-)joiners are part of a name's spelling in Persian, Hindi and emoji
    sequences: the name is kept as written, so it keys as the same name in the fact, a
    query or the offline extractor does (only other format characters are junk)."""
    from mneme.domain import entity_key
    persian, hindi = "\u0645\u0647\u062f\u06cc\u200c\u0632\u0627\u062f\u0647", \
        "\u0915\u094d\u200d\u0937"
    stub.on("chat", chat({"facts": [fact(f"{persian} met {hindi}.", entities=[
        {"name": persian, "type": "person"}, {"name": hindi + "\u200b", "type": "person"}])]}))
    facts = LlmExtractor(gateway).extract_many("b", [RetainItem(f"{persian} met {hindi}.", TS)],
                                               "op")
    names = [e.name for e in facts[0].entities]
    assert names == [persian, hindi]
    assert [entity_key(n) for n in names] == [entity_key(persian), entity_key(hindi)]


def test_an_emoji_split_between_two_stream_chunks_is_streamed_whole(stub, gateway):
    """A server that cuts its text by UTF-16 code units can send an emoji's two halves
    (escaped surrogates) in two chunks: each half alone is a lone surrogate, cleaned to
    U+FFFD, so the answer lost the emoji. The high half waits for the next chunk."""
    stub.on("chat", chat("abcd\ud83d\ude00 ok"), chat("abcd\ud83d"))  # pieces of 5 units
    *deltas, done = list(gateway.stream("reflect", MSGS))
    assert "".join(deltas) == done.text == "abcd\U0001F600 ok"
    assert all(encodable(d) for d in deltas)
    *deltas, done = list(gateway.stream("reflect", MSGS))  # the stream ends on a half
    assert "".join(deltas) == done.text == "abcd\ufffd"


def test_a_provider_that_echoes_the_text_leaves_nothing_of_a_deleted_document(stub, server):
    """A provider whose rejection quotes the text it was sent ("invalid content: ...") as
    many do: the retain fails, and once its document is deleted no operation, file of the
    data dir or line of the server's log holds the text (its failure text was in the
    clear on the log and in the operation's error, beyond any key)."""
    secret = "ZEBRA-SECRET-4711"
    echo = computed(lambda req: status(400, "invalid content: " + req.messages[-1]["content"]))
    stub.on("chat", *[echo for _ in range(10)])
    with server.client() as m:
        m.upsert_bank("echo", auto_consolidate=False, extraction_mode="llm_only")
        r = m.retain("echo", [{"content": f"Alice: my vault code is {secret}.",
                               "document_id": "d", "timestamp": TS}])
        assert r.operation.state == 4 and "quotes the request" in r.operation.error
        assert m.delete_document("echo", "d").state == 3
        assert not [o.name for o in m.list_operations("echo") if secret in str(o)]
    files = [p for p in server.data_dir.rglob("*") if p.is_file()]
    assert not [p.name for p in files if secret.encode() in p.read_bytes()]
    assert secret not in server.log.read_text()
