"""The replay property (tests/e2e/test_replay_property.py) with the stub model: a seeded
random sequence of reflections that form opinions, retains whose facts revise them
(support, contradict), mental-model refreshes, memory, document and opinion deletions;
then the log and keys alone copied into a fresh data dir, ``mneme replay -d`` there (no
model is asked), and every read compared with the live server's. Same knobs as the
offline test (``MNEME_REPLAYPROP_SEED``, ``MNEME_REPLAYPROP_STEPS``)."""

from __future__ import annotations

import json
import random
import zlib
from datetime import datetime, timedelta, timezone

from tests.e2e.server import Server
from tests.e2e.test_replay_property import (SEED, STEPS, _ended, _fresh_copy, _id, diff,
                                            snapshot)
from tests.llm.conftest import MODEL
from tests.llm.stub import OPINION_FORMATION, chat, computed

BANK = "rp-llm"
TS = datetime(2023, 5, 8, 13, 56, tzinfo=timezone.utc)
FACTS = ["Caroline: I'm studying psychology to become a counselor.",
         "Caroline: I enrolled in a counseling course today.",
         "Caroline: My counseling mentor says I'm a natural.",
         "Caroline: I quit counseling; I paint full time now.",
         "Melanie: I ran a charity race for mental health.",
         "Melanie: I painted a lake at sunrise."]
QUESTIONS = ["What does Caroline want to do with her life?", "What does Melanie enjoy?"]


def _pick(raw: str, options: list):
    """One of ``options`` chosen by the request itself: the same request, the same answer
    (the live run and nothing else asks; this keeps a seed's run reproducible)."""
    return options[zlib.crc32(raw.encode()) % len(options)]


def _answer(req):
    """Every chat request: opinion formation, opinion revision, and the reflect loop (a
    recall first, then an answer citing the first memory it was shown)."""
    raw = req.raw
    if OPINION_FORMATION in raw:
        return chat({"opinions": [{"text": _pick(raw, [
            "Caroline is committed to becoming a counselor.",
            "Melanie cares about mental health.", "Caroline likes painting."]),
            "citations": [1], "entities": [_pick(raw[::-1], ["Caroline", "Melanie"])]}]})
    if "Opinion updates" in raw:
        content = req.messages[1]["content"]
        shown = json.loads(content[content.index("{"):])["new_facts"]
        updates = [{"opinion_id": o["opinion_id"], "memory_id": f["memory_id"],
                    "relation": _pick(f["memory_id"] + o["opinion_id"],
                                      ["support", "weaken", "contradict"]),
                    "revised_text": f"Revised after {f['memory_id'][:8]}.", "reason": "stub"}
                   for f in shown for o in f.get("opinions", [])[:1]]
        return chat({"updates": updates})
    if any(m.get("role") == "tool" for m in req.messages):
        return chat("From what is remembered [m1].")
    return chat(None, tool_calls=[{"name": "recall",
                                   "arguments": {"query": "Caroline Melanie counselor paint"}}])


def _step(m, rng: random.Random, log: list[str], n: int) -> None:
    op = rng.choices(["retain", "reflect", "refresh", "del_mem", "del_doc", "del_opinion"],
                     weights=[5, 3, 1, 1, 1, 1])[0]
    log.append(op)
    if op == "retain":
        m.retain(BANK, [{"content": rng.choice(FACTS), "timestamp": TS + timedelta(days=n),
                         "document_id": f"doc-{rng.randrange(3)}" if rng.random() < 0.5 else ""}])
    elif op == "reflect":
        m.reflect(BANK, rng.choice(QUESTIONS), query_timestamp=TS + timedelta(days=n))
    elif op == "refresh":
        mms = sorted(x.name for x in m.list_mental_models(BANK))
        if mms:
            m.refresh_mental_model(BANK, _id(rng.choice(mms)))
        else:
            m.create_mental_model(BANK, "career", rng.choice(QUESTIONS))
    elif op == "del_mem":
        mems = sorted(x.id for x in m.list_memories(BANK))
        if mems:
            m.delete_memory(BANK, rng.choice(mems))
    elif op == "del_doc":
        m.delete_document(BANK, f"doc-{rng.randrange(3)}")
    else:
        ops = sorted(o.id for o in m.list_opinions(BANK))
        if ops:
            m.delete_opinion(BANK, rng.choice(ops))


def test_a_replay_with_model_decisions_answers_every_read_as_the_live_server(stub, tmp_path):
    stub.on("chat", computed(_answer), forever=True)
    env = {"MNEME_LLM_MODEL": MODEL, "MNEME_LLM_BASE_URL": stub.base_url,
           "MNEME_LLM_API_KEY": "sk-test", "MNEME_LLM_TIMEOUT_S": "10",
           "MNEME_LLM_MAX_RETRIES": "1", "MNEME_LLM_BACKOFF_S": "0.05"}
    rng, log = random.Random(SEED), []
    live = Server(tmp_path / "live", env=env).start()
    try:
        with live.client(timeout=120) as m:
            m.upsert_bank(BANK, auto_consolidate=False, extraction_mode="offline")
            for n in range(STEPS):
                _step(m, rng, log, n)
            # (opinion formation is a consumer group of its own: drained with the rest)
            _ended(m, BANK)
            before = snapshot(m, BANK)
    finally:
        live.stop()
    calls = len(stub.chat_requests())
    rebuilt = Server(_fresh_copy(live.data_dir, tmp_path / "fresh"), env=env)
    rebuilt.replay()
    try:
        with rebuilt.client(timeout=120) as m:
            _ended(m, BANK)
            after = snapshot(m, BANK)
    finally:
        rebuilt.stop()
    assert len(stub.chat_requests()) == calls  # neither the replay nor its reads asked
    problems = diff(before, after)
    if problems:
        (tmp_path / "snapshots.json").write_text(json.dumps(
            {"live": before, "replayed": after, "calls": log}, indent=1, default=str))
    assert not problems, (f"seed {SEED}, steps {STEPS}", log, problems[:40])
