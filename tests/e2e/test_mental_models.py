"""Mental models through a real ``mneme up`` (offline: extractive refresh) on a LoCoMo
conversation: create, refresh, staleness by scope, history, reflect answering from a fresh
model, replay reproducing models, history and staleness, validation, and the
``mneme mental-models`` CLI group."""

from __future__ import annotations

import json
from datetime import datetime, timezone

import grpc
import pytest
from google.protobuf.json_format import MessageToDict
from typer.testing import CliRunner

from mneme import locomo
from mneme.cli import app
from mneme.client import field_violations
from mneme.keys import fact_key_id
from mneme.stores.keys_sqlite import SqliteKeyStore
from mneme.v1 import mental_models_pb2
from tests.e2e.server import Server, conversation_file
from tests.waits import drained

BANK = "mm"
QUESTION = "When did Caroline go to the LGBTQ support group?"


def refused(call) -> grpc.RpcError:
    with pytest.raises(grpc.RpcError) as e:
        call()
    return e.value


def snapshot(m, bank: str = BANK) -> list:
    models = [MessageToDict(x) for x in m.list_mental_models(bank)]
    history = {x["id"]: [MessageToDict(r) for r in m.mental_model_revisions(bank, x["id"])]
               for x in models}
    return [models, history]


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    s = Server(tmp_path_factory.mktemp("mm") / "data").start()
    conv = next(c for c in locomo.load(conversation_file()) if c["sample_id"] == "conv-26")
    with s.client() as m:
        m.upsert_bank(BANK)
        for sess in locomo.sessions(conv)[:2]:
            assert m.retain(BANK, sess.items).operation.state == 3
        drained(m, BANK)
    yield s
    s.stop()


def test_lifecycle_staleness_reflect_and_replay(server):
    at = datetime(2023, 7, 1, tzinfo=timezone.utc)
    with server.client() as m:
        made = m.create_mental_model(BANK, "Caroline's support group", QUESTION)
        assert made.name == f"banks/{BANK}/mental-models/{made.id}"
        assert (made.revision, made.content, made.is_stale) == (0, "", False)
        assert not made.HasField("refresh_time")
        scoped = m.create_mental_model(BANK, "Work", "What does Caroline do for work?",
                                       content="She counsels people.", tags=["work"])
        assert scoped.revision == 1

        got = m.refresh_mental_model(BANK, made.id)
        assert got.revision == 1 and got.content and got.based_on and not got.is_stale
        assert got.HasField("refresh_time")
        assert all(n.startswith(f"banks/{BANK}/memories/") for n in got.based_on)
        texts = {x.id: x.text for x in m.list_memories(BANK)}
        cited = [n.rsplit("/", 1)[-1] for n in got.based_on]
        # an extractive summary, each quote cited
        assert all(f"{texts[i].strip()}" in got.content for i in cited)
        assert all(f"[{n}]" in got.content for n in range(1, len(cited) + 1))
        dry = m.refresh_mental_model(BANK, made.id, dry_run=True)
        assert dry.content == got.content and m.get_mental_model(BANK, made.id).revision == 1

        # a fresh model that covers the question answers it (offline: no recall)
        a = m.reflect(BANK, QUESTION)
        assert a.extractive and list(a.sources.mental_models) == [made.id]
        assert got.content in a.text and not a.sources.facts

        # a change in its scope makes it stale; one in another scope does not
        m.retain(BANK, [{"content": "Caroline: I am a counsellor at a youth centre now.",
                         "tags": ["home"], "timestamp": at}])
        drained(m, BANK)
        assert m.get_mental_model(BANK, made.id).is_stale  # untagged: sees every change
        assert not m.get_mental_model(BANK, scoped.id).is_stale  # "home" is not its scope
        m.retain(BANK, [{"content": "Caroline: I started a new job at the youth centre.",
                         "tags": ["work"], "timestamp": at}])
        drained(m, BANK)
        assert m.get_mental_model(BANK, scoped.id).is_stale
        # a stale model does not answer alone: reflect recalls the facts and quotes the
        # model after them as context
        a = m.reflect(BANK, QUESTION)
        assert a.sources.facts and list(a.sources.mental_models) == [made.id]
        assert list(a.based_on)[-1] == made.id and "is stale" in a.text
        assert a.text.index("Context:") > a.text.index("- ")

        again = m.refresh_mental_model(BANK, made.id)
        assert again.revision == 2 and not again.is_stale
        history = m.mental_model_revisions(BANK, made.id)
        assert [(r.revision, r.source, r.mode) for r in history] == [
            (1, "refresh_offline", mental_models_pb2.FULL),
            (2, "refresh_offline", mental_models_pb2.FULL)]
        assert history[0].content == got.content and list(history[0].based_on) == list(got.based_on)
        assert history[1].content == again.content
        page = m.mental_models.ListMentalModelRevisions(
            mental_models_pb2.ListMentalModelRevisionsRequest(parent=made.name, page_size=1))
        assert [r.revision for r in page.revisions] == [1] and page.next_page_token

        changed = m.update_mental_model(BANK, scoped.id, display_name="Caroline's work")
        assert changed.display_name == "Caroline's work" and changed.revision == 1
        assert changed.content == "She counsels people." and list(changed.tags) == ["work"]
        assert [x.id for x in m.list_mental_models(BANK, tags=["home"])] == [made.id]
        before = snapshot(m)

    server.replay()  # no model: the recorded answers come back as they were
    with server.client() as m:
        assert snapshot(m) == before
        m.delete_mental_model(BANK, scoped.id)
        assert refused(lambda: m.get_mental_model(BANK, scoped.id)).code() == grpc.StatusCode.NOT_FOUND
        assert refused(lambda: m.mental_model_revisions(BANK, scoped.id)).code() == \
            grpc.StatusCode.NOT_FOUND


def test_delta_refresh_keeps_prior_content_and_drops_what_was_retracted(server):
    bank, at = "delta", datetime(2023, 5, 1, tzinfo=timezone.utc)
    with server.client() as m:
        m.upsert_bank(bank, auto_consolidate=False)  # facts only: no observation quotes them
        m.retain(bank, [{"content": "Caroline: I joined a pottery class in May.", "timestamp": at},
                        {"content": "Caroline: my pottery teacher is called Ann.", "timestamp": at}])
        drained(m, bank)
        made = m.create_mental_model(bank, "Caroline's pottery", "What does Caroline do in pottery?")
        full = m.refresh_mental_model(bank, made.id)
        assert len(full.based_on) == 2
        quotes = [x for x in full.content.splitlines() if x.startswith("- ")]
        assert len(quotes) == 2

        added = m.retain(bank, [{"content": "Caroline: I made a pottery bowl for my mum.",
                                 "timestamp": datetime(2023, 6, 1, tzinfo=timezone.utc)}])
        m.retain(bank, [{"content": "Melanie: the weather is lovely.", "timestamp": at}])
        drained(m, bank)
        assert m.get_mental_model(bank, made.id).is_stale
        texts = {x.id: x.text for x in m.list_memories(bank)}
        new = added.memory_ids[0]
        delta = m.refresh_mental_model(bank, made.id, mode="delta")
        assert not delta.is_stale and delta.revision == 2
        # the prior quotes are kept as they were, the new fact is appended and cited after them
        assert all(q in delta.content for q in quotes)
        assert texts[new].strip() in delta.content and "weather" not in delta.content
        assert list(delta.based_on) == [*full.based_on, f"banks/{bank}/memories/{new}"]
        assert delta.content.rstrip().endswith("[3]")

        # a cited memory deleted: every content that quoted it is erased (both revisions
        # cite it), so the model is empty and stale until its next refresh, which makes it
        # from what is left
        gone = full.based_on[0].rsplit("/", 1)[-1]
        m.delete_memory(bank, gone)
        drained(m, bank)
        erased = m.get_mental_model(bank, made.id)
        assert (erased.content, list(erased.based_on), erased.revision) == ("", [], 0)
        assert erased.is_stale and not m.mental_model_revisions(bank, made.id)
        again = m.refresh_mental_model(bank, made.id, mode="delta")
        assert f"banks/{bank}/memories/{gone}" not in again.based_on
        assert set(list(delta.based_on)[1:]) <= set(again.based_on)  # a full refresh
        assert texts[gone].strip() not in again.content
        assert quotes[1].rsplit(" [", 1)[0] in again.content and texts[new].strip() in again.content
        history = m.mental_model_revisions(bank, made.id)
        assert [(r.revision, r.source, r.mode) for r in history] == [
            (1, "refresh_offline", mental_models_pb2.FULL)]  # a delta of nothing is a full one
        assert [list(r.based_on) for r in history] == [list(again.based_on)]
        before = snapshot(m, bank)

    server.replay()  # no model: the delta revisions come back as they were
    with server.client() as m:
        assert snapshot(m, bank) == before


def test_requests_are_validated(server):
    with server.client() as m:
        ok = m.create_mental_model(BANK, "Valid", "What is valid?")
        cases = [
            (lambda: m.create_mental_model(BANK, " ", "q?"), grpc.StatusCode.INVALID_ARGUMENT,
             ["mental_model.display_name"]),
            (lambda: m.create_mental_model(BANK, "n", ""), grpc.StatusCode.INVALID_ARGUMENT,
             ["mental_model.source_query"]),
            (lambda: m.create_mental_model(BANK, "n", "q?", tags=[""]),
             grpc.StatusCode.INVALID_ARGUMENT, ["mental_model.tags[0]"]),
            (lambda: m.create_mental_model(BANK, "n", "q?", max_tokens=-1),
             grpc.StatusCode.INVALID_ARGUMENT, ["mental_model.max_tokens"]),
            (lambda: m.create_mental_model("nope", "n", "q?"), grpc.StatusCode.NOT_FOUND, []),
            (lambda: m.get_mental_model(BANK, "x/y"), grpc.StatusCode.INVALID_ARGUMENT, ["name"]),
            (lambda: m.refresh_mental_model(BANK, "00000000-0000-0000-0000-000000000000"),
             grpc.StatusCode.NOT_FOUND, []),
            (lambda: m.mental_models.RefreshMentalModel(
                mental_models_pb2.RefreshMentalModelRequest(name=ok.name, mode=7)),
             grpc.StatusCode.INVALID_ARGUMENT, ["mode"]),
        ]
        for call, code, fields in cases:
            err = refused(call)
            assert err.code() == code, (err.code(), err.details())
            assert [f for f, _ in field_violations(err)] == fields
        req = mental_models_pb2.UpdateMentalModelRequest(
            mental_model=mental_models_pb2.MentalModel(name=ok.name, content="x"))
        req.update_mask.paths.extend(["content", "colour"])
        err = refused(lambda: m.mental_models.UpdateMentalModel(req))
        assert [f for f, _ in field_violations(err)] == ["update_mask.paths[1]"]
        req = mental_models_pb2.CreateMentalModelRequest(
            parent=f"banks/{BANK}", mental_model=mental_models_pb2.MentalModel(
                display_name="n", source_query="q?", refresh_policy=9))
        err = refused(lambda: m.mental_models.CreateMentalModel(req))
        assert err.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert m.get_mental_model(BANK, ok.id).content == ""  # nothing changed


def test_list_by_tags_match_and_clear(server):
    bank = "mm-tags"
    with server.client() as m:
        m.upsert_bank(bank)
        made = {t: m.create_mental_model(bank, f"Model {t or 'all'}", "What about it?",
                                         content=f"About {t}.", tags=t.split("+") if t else [])
                for t in ("", "work", "home", "work+home")}

        def listed(tags, mode):
            return {x.id for x in m.list_mental_models(bank, tags=tags, tags_match=mode)}
        every = {x.id for x in made.values()}
        assert listed([], "any") == every
        assert listed(["work"], "any") == {made[""].id, made["work"].id, made["work+home"].id}
        assert listed(["work"], "any_strict") == {made["work"].id, made["work+home"].id}
        assert listed(["work", "home"], "all_strict") == {made["work+home"].id}
        assert listed(["work", "home"], "all") == {made[""].id, made["work+home"].id}
        assert listed(["work"], "exact") == {made["work"].id}
        assert listed([], "exact") == {made[""].id}
        err = refused(lambda: m.mental_models.ListMentalModels(
            mental_models_pb2.ListMentalModelsRequest(parent=f"banks/{bank}", tags_match=9)))
        assert [f for f, _ in field_violations(err)] == ["tags_match"]

        cleared = m.clear_mental_model(bank, made["work"].id)
        assert cleared.content == "" and cleared.revision == made["work"].revision + 1
        assert cleared.display_name == made["work"].display_name and list(cleared.tags) == ["work"]
        history = m.mental_model_revisions(bank, made["work"].id)
        assert [h.content for h in history] == ["About work.", ""]
        err = refused(lambda: m.clear_mental_model(bank, "00000000-0000-0000-0000-000000000000"))
        assert err.code() == grpc.StatusCode.NOT_FOUND


def test_mental_models_cli_round_trip(server):
    run = CliRunner()

    def cli(*args) -> str:
        out = run.invoke(app, [*args, "-a", server.address])
        assert out.exit_code == 0, out.output
        return out.stdout

    made = json.loads(cli("mental-models", "create", BANK, "Melanie's art", "What does Melanie "
                          "paint?", "--tag", "art", "--refresh-policy", "every_n_facts",
                          "--refresh-every", "10", "--json"))
    assert made["refresh_policy"] == "EVERY_N_FACTS" and made["tags"] == ["art"]
    assert made["create_time"].endswith("Z")  # ISO time
    assert made["id"] in cli("mental-models", "list", BANK)  # full ids in the table
    refreshed = json.loads(cli("mental-models", "refresh", BANK, made["id"], "--json"))
    assert refreshed["revision"] == 1 and refreshed["content"]
    delta = json.loads(cli("mental-models", "refresh", BANK, made["id"], "--mode", "delta",
                           "--json"))
    assert delta["revision"] == 2 and delta["content"] == refreshed["content"]  # nothing new
    changed = json.loads(cli("mental-models", "update", BANK, made["id"], "--content",
                             "Sunsets and lakes.", "--json"))
    assert changed["revision"] == 3 and changed["content"] == "Sunsets and lakes."
    history = json.loads(cli("mental-models", "history", BANK, made["id"], "--json"))
    assert [(r["revision"], r["source"], r.get("mode")) for r in history] == [
        (1, "refresh_offline", "FULL"), (2, "refresh_offline", "DELTA"), (3, "user", None)]
    assert json.loads(cli("mental-models", "get", BANK, made["id"], "--json")) == changed
    cli("mental-models", "delete", BANK, made["id"])
    out = run.invoke(app, ["mental-models", "get", BANK, made["id"], "-a", server.address])
    assert out.exit_code == 2 and "NOT_FOUND" in out.output
    out = run.invoke(app, ["mental-models", "create", BANK, "n", "q", "--refresh-policy",
                           "sometimes", "-a", server.address])
    assert out.exit_code == 2 and "every_n_facts" in out.output


def test_scheduled_refreshes_follow_each_models_policy(server):
    def revision(m, model_id: str) -> int:
        return m.get_mental_model("sched", model_id).revision

    with server.client() as m:
        m.upsert_bank("sched")
        every = m.create_mental_model("sched", "Pets", "What pets are mentioned?",
                                      refresh_policy="every_n_facts", refresh_every=3)
        after = m.create_mental_model("sched", "Hobbies", "What hobbies are mentioned?",
                                      refresh_policy="after_consolidation")
        manual = m.create_mental_model("sched", "Manual", "What cities are mentioned?")
        at = datetime(2023, 7, 1, tzinfo=timezone.utc)
        first = m.retain("sched", [{"content": "Alice: my dog Rex loves the beach.", "timestamp": at}])
        drained(m, "sched")
        assert first.operation.facts < 3 and revision(m, every.id) == 0  # not yet 3 facts
        assert revision(m, after.id) >= 1  # consolidation changed an observation: refreshed
        m.retain("sched", [{"content": f"Alice: my cat number {i} sleeps all day.", "timestamp": at}
                           for i in range(3)])
        drained(m, "sched")
        got = m.get_mental_model("sched", every.id)
        assert got.revision >= 1 and got.content and got.based_on
        assert [r.source for r in m.mental_model_revisions("sched", every.id)][0] == "refresh_offline"
        assert revision(m, manual.id) == 0 and m.get_mental_model("sched", manual.id).is_stale


def _delta_citing_an_observation(m, bank: str):
    """A model of Zoe's instruments in a new ``bank`` with the user's note A, then a delta
    refresh after a third retain: (model, the refresh, the observation ids it cites)."""
    m.upsert_bank(bank)
    m.retain(bank, [{"content": "Zoe: I play the violin.", "document_id": "X"}])
    m.retain(bank, [{"content": "Zoe: I play the cello too.", "document_id": "Y"}])
    drained(m, bank)
    made = m.create_mental_model(bank, "Zoe music", "What instruments does Zoe play?")
    m.refresh_mental_model(bank, made.id)
    m.update_mental_model(bank, made.id, content="Zoe is musical (note A).")
    m.retain(bank, [{"content": "Zoe: I started learning the violin-piano duo repertoire.",
                     "document_id": "Z"}])
    drained(m, bank)
    observations = {o.name.rsplit("/", 1)[-1] for o in m.list_observations(bank)}
    delta = m.refresh_mental_model(bank, made.id, mode="delta")
    cited = {i.rsplit("/", 1)[-1] for i in delta.based_on} & observations
    assert cited, delta
    return made, delta, cited


def test_a_deleted_fact_behind_a_cited_observation_erases_the_content(server):
    """A delta refresh cites an observation, not the fact under it: deleting that fact's
    document still erases the revision (the refresh recorded the observation's facts)."""
    bank = "obs-erase"
    with server.client() as m:
        made, delta, cited = _delta_citing_an_observation(m, bank)
        assert "play the violin" in delta.content, delta
        m.update_mental_model(bank, made.id, content="Zoe is musical (note B).")
        m.delete_document(bank, "X")
        drained(m, bank)
        history = [r.content for r in m.mental_model_revisions(bank, made.id)]
        assert history == ["Zoe is musical (note A).", "Zoe is musical (note B)."], history
        before = snapshot(m, bank)
    server.replay()
    with server.client() as m:
        assert snapshot(m, bank) == before
    for f in server.data_dir.rglob("*"):
        if f.is_file():
            assert b"play the violin" not in f.read_bytes(), f


def test_a_refused_delete_memory_of_an_observation_changes_nothing(server):
    """DeleteMemory of an observation's id fails (consolidation derives observations) and
    erases nothing: the mental-model revisions citing that observation stay, and a later
    refresh citing it is not sealed as if it cited a deleted fact (it survives a
    replay)."""
    bank = "obs-refused"
    with server.client() as m:
        made, delta, cited = _delta_citing_an_observation(m, bank)
        before = snapshot(m, bank)
        for obs in sorted(cited):
            op = m.delete_memory(bank, obs)
            assert op.state == 4 and "ClearObservations" in op.error, op  # FAILED
        drained(m, bank)
        # no revision erased (the retraction on the memory topic still marks it stale)
        now = snapshot(m, bank)
        now[0][0].pop("isStale", None)
        assert now == before
        after = snapshot(m, bank)
    server.stop()
    # no tombstone for the observation's id: a refresh or reflection citing it later
    # would be sealed under it, as if it cited a deleted fact (erased at birth)
    keys = SqliteKeyStore(str(server.data_dir / "keys.db"))
    try:
        assert all(keys.get(bank, fact_key_id(i)) is None for i in cited)
    finally:
        keys.close()
    server.start()
    server.replay()
    with server.client() as m:
        assert snapshot(m, bank) == after
