"""Every store is a projection of the log (DESIGN §1, §3): a seeded random sequence of
every kind of write against a real ``mneme up`` (offline extraction: retains sync and
async with tags, metadata, times and documents, document replacement and deletion, memory
deletion, entity merges, renames and splits, directives, mental models, consolidation,
ClearObservations, bank config updates, DeleteOpinion; halfway a replay while serving,
``CreateGeneration``), then the log alone (with the bank keys it is sealed under) copied
into a fresh data dir, ``mneme replay -d`` there, and everything the API reads compared
between the live server and the rebuilt one: banks, stats, profiles, memories,
documents, tags, entities (aliases, neighbours), observations, opinions, directives,
mental models with revisions, operations and recall results with their scores. Then
the same later calls on both must answer alike (the state no read shows: extraction's
entity resolver, what consolidation decides from). Opinions need a model: offline there
are none to compare (tests/llm/test_replay_property_llm.py has them).

``MNEME_REPLAYPROP_SEED`` reruns another seed (the seed is in every failure message),
``MNEME_REPLAYPROP_STEPS`` sets how many random calls a run makes (default 24: 30-55 s
here; 70 takes one to two minutes)."""

from __future__ import annotations

import json
import os
import random
import re
import shutil
import time
from datetime import datetime, timedelta, timezone

import grpc
import pytest
from google.protobuf import json_format

from mneme.v1 import generations_pb2, operations_pb2
from tests.e2e.server import Server
from tests.waits import drained

SEED = int(os.environ.get("MNEME_REPLAYPROP_SEED", "20261207"))
STEPS = int(os.environ.get("MNEME_REPLAYPROP_STEPS", "24"))
BANKS = ("rp-a", "rp-b")
NOW = datetime(2024, 6, 1, 12, tzinfo=timezone.utc)
NAMES = ["Maria Lopez", "Tom Becker", "Lena", "Omar", "Yuki Sato", "Pedro", "Acme Corp"]
PLACES = ["Lisbon", "Porto", "Berlin", "Oslo", "Kyoto", "Room 101", "Room 102"]
VERBS = ["moved to", "visited", "opened a bakery in", "gave a talk in", "lost a phone in"]
TAGS = ["work", "home", "travel", "user:1", "user:2"]
QUERIES = ["Who moved to Lisbon?", "What happened in Kyoto last year?", "Maria Lopez",
           "bakery", "Where did Tom Becker give a talk?"]
#: The files of a data dir that are not projections: the log itself and the bank keys
#: its sealed content is encrypted under (DESIGN §3, crypto-shredding).
SOURCES = ("log.db", "keys.db", "master.key")
REFUSED = {grpc.StatusCode.NOT_FOUND, grpc.StatusCode.FAILED_PRECONDITION,
           grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.ALREADY_EXISTS}


def _d(msg) -> dict:
    return json_format.MessageToDict(msg, preserving_proto_field_name=True)


def _id(name: str) -> str:
    return name.rsplit("/", 1)[-1]


class Workload:
    """Random calls over :data:`BANKS`; ``log`` keeps each call (for a failure message)."""

    def __init__(self, rng: random.Random):
        self.rng = rng
        self.n = 0
        self.log: list[str] = []

    def sentence(self) -> str:
        self.n += 1
        r = self.rng
        when = r.choice(["", " yesterday", " in 2015", " last March", " on 3 May 2023"])
        return f"{r.choice(NAMES)} {r.choice(VERBS)} {r.choice(PLACES)}{when} (note {self.n})."

    def item(self, doc: str = "") -> dict:
        r = self.rng
        it = {"content": " ".join(self.sentence() for _ in range(r.randint(1, 3)))}
        if doc:
            it["document_id"] = doc
        if r.random() < 0.5:
            it["tags"] = r.sample(TAGS, r.randint(1, 2))
        if r.random() < 0.4:
            it["metadata"] = {"source": r.choice(["chat", "mail"]), "n": str(self.n)}
        if r.random() < 0.6:
            it["timestamp"] = NOW - timedelta(days=r.randint(0, 900), minutes=r.randint(0, 600))
        if r.random() < 0.3:
            it["context"] = r.choice(["a chat with the user", "meeting notes"])
        return it

    def step(self, m) -> None:
        r = self.rng
        bank = r.choice(BANKS)
        op = r.choices(
            ["retain", "retain_async", "retain_doc", "del_mem", "del_doc", "merge", "split",
             "directive", "mental_model", "consolidate", "clear_obs", "bank_config",
             "del_opinion"],
            weights=[6, 2, 4, 2, 1, 2, 2, 2, 2, 1, 1, 1, 1])[0]
        self.log.append(f"{op} {bank}")
        if op in ("retain", "retain_async"):
            items = [self.item() for _ in range(r.randint(1, 3))]
            m.retain(bank, items, async_=op == "retain_async")
        elif op == "retain_doc":  # a document id seen before replaces that document
            m.retain(bank, [self.item(f"doc-{r.randrange(4)}")])
        elif op == "del_mem":
            mems = sorted(x.id for x in m.list_memories(bank))
            if mems:
                m.delete_memory(bank, r.choice(mems))
        elif op == "del_doc":
            m.delete_document(bank, f"doc-{r.randrange(4)}")
        elif op == "merge":
            ents = sorted(e.id for e in m.list_entities(bank))
            if len(ents) >= 2:
                pick = r.sample(ents, 2)
                m.merge_entities(bank, pick, display_name=r.choice(["", f"Merged {self.n}"]))
        elif op == "split":
            ents = [e for e in m.list_entities(bank) if len(e.aliases) > 1]
            if ents:
                e = r.choice(sorted(ents, key=lambda x: x.id))
                alias = r.choice(sorted(a for a in e.aliases if a != e.display_name)
                                 or list(e.aliases))
                m.split_entity(bank, e.id, f"{alias} split {self.n}", aliases=[alias])
        elif op == "directive":
            ds = sorted(d.name for d in m.list_directives(bank))
            act = r.choice(["create", "update", "delete"] if ds else ["create"])
            if act == "create":
                m.create_directive(bank, f"Answer briefly ({self.n}).", title=f"d{self.n}",
                                   priority=r.randint(0, 5), tags=r.sample(TAGS, r.randint(0, 1)))
            elif act == "update":
                m.update_directive(bank, _id(r.choice(ds)), text=f"Answer in German ({self.n}).",
                                   active=r.random() < 0.5)
            else:
                m.delete_directive(bank, _id(r.choice(ds)))
        elif op == "mental_model":
            mms = sorted(x.name for x in m.list_mental_models(bank))
            act = r.choice(["create", "refresh", "refresh", "delete", "clear", "update"]
                           if mms else ["create"])
            self.log[-1] += f" {act}"
            if act == "create":
                m.create_mental_model(bank, f"model {self.n}", r.choice(QUERIES),
                                      tags=r.sample(TAGS, r.randint(0, 1)))
            elif act == "refresh":
                m.refresh_mental_model(bank, _id(r.choice(mms)), mode=r.choice(["full", "delta"]))
            elif act == "delete":
                m.delete_mental_model(bank, _id(r.choice(mms)))
            elif act == "clear":
                m.clear_mental_model(bank, _id(r.choice(mms)))
            else:
                m.update_mental_model(bank, _id(r.choice(mms)), source_query=r.choice(QUERIES))
        elif op == "consolidate":
            m.consolidate(bank, reconsolidate=r.random() < 0.3)
        elif op == "clear_obs":
            mems = sorted(x.id for x in m.list_memories(bank))
            m.clear_observations(bank, r.choice(mems) if mems and r.random() < 0.5 else "")
        elif op == "bank_config":
            m.update_bank(bank, retain_mission=f"Keep what matters ({self.n}).",
                          skepticism=r.randint(1, 5), empathy=r.randint(1, 5))
        elif op == "del_opinion":
            ops = sorted(o.id for o in m.list_opinions(bank))
            if ops:
                m.delete_opinion(bank, r.choice(ops))

    def run(self, m, steps: int) -> None:
        for _ in range(steps):
            try:
                self.step(m)
            except grpc.RpcError as e:  # a refusal the random choice earned is not a finding
                assert e.code() in REFUSED, (SEED, self.log[-1], e.code(), e.details())
                self.log[-1] += f" -> {e.code().name}"


class Continuation(Workload):
    """Calls that name nothing by a server-drawn id and carry their own times, so two
    servers with the same state given them end in the same state: retains (with a
    ``request_id``), deletions of documents by their ids, consolidation."""

    def __init__(self, rng: random.Random, n: int):
        super().__init__(rng)
        self.n = n

    def step(self, m) -> None:
        r = self.rng
        bank = r.choice(BANKS)
        op = r.choices(["retain", "retain_doc", "del_doc", "consolidate"], weights=[4, 3, 1, 1])[0]
        self.log.append(f"{op} {bank}")
        if op in ("retain", "retain_doc"):
            items = [self.item(f"doc-{r.randrange(4)}" if op == "retain_doc" else "")
                     for _ in range(r.randint(1, 2))]
            for it in items:
                it.setdefault("timestamp", NOW - timedelta(days=r.randint(0, 30)))
            m.retain(bank, items, request_id=f"later-{self.n}")
        elif op == "del_doc":
            m.delete_document(bank, f"doc-{r.randrange(4)}")
        else:
            m.consolidate(bank)


def snapshot(m, bank: str) -> dict:
    """Everything the API reads of ``bank`` (volatile fields only where the live and a
    rebuilt server may differ by design: none so far)."""
    mems = sorted((_d(x) for x in m.list_memories(bank)), key=lambda x: x["id"])
    ents = sorted(m.list_entities(bank), key=lambda e: e.id)
    mms = sorted(m.list_mental_models(bank), key=lambda x: x.name)
    docs = sorted(m.list_documents(bank), key=lambda d: d.document_id)
    obs = sorted((_d(o) for o in m.list_observations(bank)), key=lambda o: o["name"])
    stats = _d(m.bank_stats(bank))
    for k in ("pending_records", "lag", "pending_operations"):
        stats.pop(k, None)
    return {
        "bank": _d(m.get_bank(bank)),
        "stats": stats,
        "memories": mems,
        "memories_get": [_d(m.get_memory(bank, x["id"])) for x in mems],
        "documents": [_d(d) for d in docs],
        "documents_get": [_d(m.get_document(bank, d.document_id)) for d in docs],
        "tags": [_d(t) for t in m.list_tags(bank)],
        "entities": [_d(e) for e in ents],
        "entities_get": [_d(m.get_entity(bank, e.id)) for e in ents],
        "observations": obs,
        "observations_get": [_d(m.get_observation(bank, _id(o["name"]))) for o in obs],
        "profile": _d(m.bank_profile(bank)),
        "operations": sorted((_d(o) for o in m.list_operations(bank)), key=lambda o: o["name"]),
        "scopes": [_d(s) for s in m.list_observation_scopes(bank)],
        "opinions": [_d(o) for o in m.list_opinions(bank)],
        "directives": [_d(d) for d in m.list_directives(bank)],
        "mental_models": [_d(x) for x in mms],
        "mm_revisions": {x.name: [_d(v) for v in m.mental_model_revisions(bank, _id(x.name))]
                         for x in mms},
        "recall": {q: [(h.memory.id, _d(h.scores)) for h in
                       m.recall(bank, q, max_tokens=2048, query_timestamp=NOW).results]
                   for q in QUERIES},
    }


def _ended(m, bank: str, timeout: float = 120) -> None:
    """Until every operation of ``bank`` has ended and every group has consumed it."""
    end = time.monotonic() + timeout
    while any(o.state not in (operations_pb2.SUCCEEDED, operations_pb2.FAILED)
              for o in m.list_operations(bank)):
        assert time.monotonic() < end, f"operations of {bank} never ended"
        time.sleep(0.1)
    drained(m, bank, timeout)


UUID = re.compile(r"[0-9a-f]{8}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{12}")


def normalised(snap: dict) -> dict:
    """``snap`` with the ids two servers given the same calls name differently (those
    derived from an event id the server drew: memories, observations, operations)
    replaced by what they name; lists but recall's in a canonical order."""
    label: dict[str, str] = {}
    for bank in snap.values():
        for x in bank["memories"]:
            label[x["id"]] = f"memory<{x['text']}|{x.get('document_id', '')}>"
        for o in bank["observations"]:
            label[_id(o["name"])] = f"observation<{o['text']}>"
    # entity ids derive from the bank and the name: the same on both

    def walk(v, ordered=False):
        if isinstance(v, dict):
            # the times of the calls themselves: the two servers were called at other times
            return {k: walk(x, ordered or k == "recall") for k, x in v.items()
                    if k not in ("operations", "time") and not k.endswith("_time")}
        if isinstance(v, (list, tuple)):
            out = [walk(x, ordered) for x in v]
            return out if ordered else sorted(out, key=repr)
        if isinstance(v, str):
            return UUID.sub(lambda mt: label.get(mt[0], mt[0]), v)
        return v
    return walk(snap)


def diff(a, b, path: str = "") -> list[str]:
    """The paths where ``a`` and ``b`` differ (for a readable failure)."""
    if isinstance(a, dict) and isinstance(b, dict):
        return [d for k in sorted(set(a) | set(b), key=str)
                for d in diff(a.get(k), b.get(k), f"{path}.{k}")]
    if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)) and len(a) == len(b):
        return [d for n, (x, y) in enumerate(zip(a, b)) for d in diff(x, y, f"{path}[{n}]")]
    return [] if a == b else [f"{path}: live {a!r} != replayed {b!r}"]


def test_a_replay_into_a_fresh_data_dir_answers_every_read_as_the_live_server(tmp_path):
    rng = random.Random(SEED)
    work = Workload(rng)
    live = Server(tmp_path / "live").start()
    try:
        with live.client(timeout=120) as m:
            m.upsert_bank(BANKS[0], store_documents=True)
            m.upsert_bank(BANKS[1], auto_consolidate=False)
            work.run(m, STEPS // 2)
            # a replay while serving (a new generation, switched to) halfway: the writes
            # after it go on in the generation it built
            g = m.replay(poll_s=0.2)
            assert g.state == generations_pb2.Generation.LIVE and not g.check.problems, (SEED, g)
            work.run(m, STEPS - STEPS // 2)
            for b in BANKS:
                _ended(m, b)
            before = {b: snapshot(m, b) for b in BANKS}
    finally:
        live.stop()
    rebuilt = Server(_fresh_copy(live.data_dir, tmp_path / "fresh"))
    rebuilt.replay()
    try:
        with rebuilt.client(timeout=120) as m:
            for b in BANKS:
                drained(m, b)
            after = {b: snapshot(m, b) for b in BANKS}
    finally:
        rebuilt.stop()
    problems = diff(before, after)
    if problems:  # both sides in full beside the servers' logs
        (tmp_path / "snapshots.json").write_text(json.dumps(
            {"live": before, "replayed": after, "calls": work.log}, indent=1, default=str))
    assert not problems, (f"seed {SEED}, steps {STEPS}", work.log, problems[:40])

    # The state that is not read through the API (extraction's entity resolver, what
    # consolidation decides from) was rebuilt too: the same later calls on both servers
    # answer alike.
    later = {}
    for s in (rebuilt, live):
        s.start()
        try:
            with s.client(timeout=120) as m:
                Continuation(random.Random(SEED + 1), work.n).run(m, max(4, STEPS // 3))
                for b in BANKS:
                    _ended(m, b)
                later[s.data_dir.name] = normalised({b: snapshot(m, b) for b in BANKS})
        finally:
            s.stop()
    problems = diff(later["live"], later["fresh"])
    if problems:
        (tmp_path / "later.json").write_text(json.dumps(later, indent=1, default=str))
    assert not problems, (f"seed {SEED}, steps {STEPS}, after the replay", work.log,
                          problems[:40])


def _fresh_copy(data_dir, fresh):
    """A new data dir holding only the log and the keys of ``data_dir`` (its server
    stopped): what a replay must rebuild everything else from."""
    fresh.mkdir()
    for name in SOURCES:
        for f in data_dir.glob(name + "*"):
            shutil.copy2(f, fresh / f.name)
    return fresh


def test_a_replay_rebuilds_entity_resolution_with_the_users_corrections(tmp_path):
    """extraction's resolver (``entities.db``) is state the log makes too: a data dir
    rebuilt from the log resolves a later mention as the live one would, after a merge
    (the merged name resolves to the survivor, which keeps the name it was given) and
    a split (the moved name resolves to the new entity)."""
    at = datetime(2024, 3, 2, tzinfo=timezone.utc)
    live = Server(tmp_path / "live").start()
    try:
        with live.client() as m:
            m.upsert_bank("fam")
            m.retain("fam", [{"content": t, "timestamp": at} for t in (
                "Liz adopted a puppy named Biscuit.", "Elizabeth started a pottery class.",
                "Bob Stone fixed a boat in Porto.")])
            ents = {e.display_name: e.id for e in m.list_entities("fam")}
            m.merge_entities("fam", [ents["Elizabeth"], ents["Liz"]], display_name="Beth")
            m.merge_entities("fam", [ents["Bob Stone"], ents["Porto"]])
            m.split_entity("fam", ents["Bob Stone"], "Porto City", aliases=["porto"])
    finally:
        live.stop()
    rebuilt = Server(_fresh_copy(live.data_dir, tmp_path / "fresh"))
    rebuilt.replay(start=False)
    later = [{"content": "Liz and Bob Stone sailed to Porto.", "timestamp": at,
              "document_id": "later"}]
    answers = {}
    for s in (rebuilt, live):
        s.start()
        try:
            with s.client() as m:
                r = m.retain("fam", later, request_id="later")
                [mem] = [m.get_memory("fam", i) for i in r.memory_ids]
                answers[s.data_dir.name] = (
                    sorted((e.id, e.name) for e in mem.entities),
                    sorted((e.id, e.display_name, tuple(e.aliases))
                           for e in m.list_entities("fam")))
        finally:
            s.stop()
    assert answers["fresh"] == answers["live"]


@pytest.mark.xfail(strict=True, reason=(
    "known divergence, not fixed: a name merged into an entity stays its alias (graph and "
    "resolver) after every memory naming it is deleted; a replay, which cannot open the "
    "deleted content, never learns it. Fixing it needs per-alias provenance in the graph "
    "and in entities.db (the commit adding this test says how)"))
def test_a_merged_name_whose_every_mention_is_deleted_is_forgotten_as_replay_forgets_it(
        tmp_path):
    at = datetime(2024, 3, 2, tzinfo=timezone.utc)
    live = Server(tmp_path / "live").start()
    try:
        with live.client() as m:
            m.upsert_bank("b")
            m.retain("b", [{"content": "Tom Becker likes tea.", "timestamp": at}])
            m.retain("b", [{"content": "Tom Becker met Zed Quill.", "timestamp": at,
                            "document_id": "d"}])
            ents = {e.display_name: e.id for e in m.list_entities("b")}
            m.merge_entities("b", [ents["Tom Becker"], ents["Zed Quill"]])
            m.delete_document("b", "d")  # the only content that named Zed Quill
    finally:
        live.stop()
    rebuilt = Server(_fresh_copy(live.data_dir, tmp_path / "fresh"))
    rebuilt.replay(start=False)
    answers = {}
    for s in (rebuilt, live):
        s.start()
        try:
            with s.client() as m:
                before = sorted((e.id, tuple(e.aliases)) for e in m.list_entities("b"))
                r = m.retain("b", [{"content": "Zed Quill waved.", "timestamp": at}],
                             request_id="later")
                answers[s.data_dir.name] = (before, sorted(
                    (e.id, e.name) for e in m.get_memory("b", r.memory_ids[0]).entities))
        finally:
            s.stop()
    assert answers["live"] == answers["fresh"]
