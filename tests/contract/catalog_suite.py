"""Contract of :class:`mneme.ports.Catalog`, written once; subclass per adapter and
implement ``make_catalog(path)`` (same path → same data where the adapter persists)."""

from __future__ import annotations

from datetime import datetime, timezone

import pytest

from mneme.domain import BankConfig, Directive, MentalModel, MentalModelRevision, Operation

T0 = 1_700_000_000.0


def op(op_id, bank="a", state="pending", at=T0, **kw) -> Operation:
    return Operation(op_id, bank, kw.pop("kind", "retain"), state, created_at=at, updated_at=at, **kw)


class CatalogSuite:
    def make_catalog(self, path):  # pragma: no cover - abstract
        raise NotImplementedError

    @pytest.fixture
    def cat(self, tmp_path):
        c = self.make_catalog(tmp_path)
        yield c
        c.close()

    # -- banks --

    def test_bank_roundtrip_with_times(self, cat):
        cfg = BankConfig(retain_mission="m", skepticism=5, auto_consolidate=False,
                         dedup_threshold=0.9, extraction_mode="offline")
        cat.upsert_bank("a", "Alpha", cfg, T0)
        b = cat.get_bank("a")
        assert (b.bank_id, b.display_name, b.config, b.incarnation) == ("a", "Alpha", cfg, "1")
        assert b.created_at == b.updated_at == datetime.fromtimestamp(T0, tz=timezone.utc)
        assert cat.get_bank("missing") is None

    def test_upsert_is_idempotent_and_replaces_keeping_creation(self, cat):
        cat.upsert_bank("a", "Alpha", BankConfig(), T0)
        cat.upsert_bank("a", "Alpha", BankConfig(), T0)
        cat.upsert_bank("a", "Beta", BankConfig(empathy=1), T0 + 5)
        (b,) = cat.list_banks(10)
        assert (b.display_name, b.config.empathy, b.incarnation) == ("Beta", 1, "1")
        assert b.created_at.timestamp() == T0 and b.updated_at.timestamp() == T0 + 5

    def test_masked_update_changes_only_named_fields_and_never_creates(self, cat):
        cat.upsert_bank("a", "Alpha", BankConfig(skepticism=1, literalism=2), T0)
        cat.upsert_bank("a", "ignored", BankConfig(skepticism=5, literalism=5, empathy=5), T0 + 1,
                        mask=("config.skepticism", "config.nope", "other"))
        b = cat.get_bank("a")
        assert b.display_name == "Alpha"
        assert (b.config.skepticism, b.config.literalism, b.config.empathy) == (5, 2, 3)
        cat.upsert_bank("a", "Renamed", BankConfig(), T0 + 2, mask=("display_name",))
        assert cat.get_bank("a").display_name == "Renamed" and cat.get_bank("a").config == b.config
        cat.upsert_bank("ghost", "G", BankConfig(), T0, mask=("display_name",))
        assert cat.get_bank("ghost") is None

    def test_incarnations_count_creations_across_deletions(self, cat):
        cat.upsert_bank("a", "A", BankConfig(), T0)
        cat.delete_bank("a")
        assert cat.get_bank("a") is None
        cat.upsert_bank("a", "A", BankConfig(), T0 + 1)
        assert cat.get_bank("a").incarnation == "2"
        cat.upsert_bank("a", "A again", BankConfig(), T0 + 2)  # a change, not a creation
        assert cat.get_bank("a").incarnation == "2"
        cat.delete_bank("a")
        cat.delete_bank("a")  # idempotent
        cat.upsert_bank("a", "A", BankConfig(), T0 + 3)
        assert cat.get_bank("a").incarnation == "3"
        cat.upsert_bank("b", "B", BankConfig(), T0)
        assert cat.get_bank("b").incarnation == "1"

    def test_deleting_an_unknown_bank_counts_its_first_generation(self, cat):
        cat.delete_bank("z")
        cat.upsert_bank("z", "Z", BankConfig(), T0)
        assert cat.get_bank("z").incarnation == "2"

    def test_list_banks_pages_by_id(self, cat):
        for i in ("c", "a", "e", "b", "d"):
            cat.upsert_bank(i, i.upper(), BankConfig(), T0)
        assert [b.bank_id for b in cat.list_banks(2)] == ["a", "b"]
        assert [b.bank_id for b in cat.list_banks(2, after="b")] == ["c", "d"]
        assert [b.bank_id for b in cat.list_banks(10, after="d")] == ["e"]
        assert cat.list_banks(10, after="e") == []

    # -- operations --

    # -- directives --

    def test_directives_create_update_delete_and_go_with_their_bank(self, cat):
        cat.upsert_bank("a", "", BankConfig(), T0)
        d = Directive("d2", "a", "Answer in German.", title="lang", priority=5,
                      tags=("travel",), updated_at=T0 + 1)
        cat.upsert_directive(d)
        cat.upsert_directive(Directive("d1", "a", "Never give dosages.", updated_at=T0 + 2))
        assert cat.get_directive("a", "d2") == Directive(
            "d2", "a", "Answer in German.", "lang", 5, True, ("travel",), T0 + 1, T0 + 1)
        assert [x.id for x in cat.list_directives("a", 10)] == ["d1", "d2"]
        assert [x.id for x in cat.list_directives("a", 1, after="d1")] == ["d2"]
        # a masked change: only the named fields, creation time kept
        cat.upsert_directive(Directive("d2", "a", "ignored", title="ignored", priority=1,
                                       active=False, updated_at=T0 + 3), mask=("priority", "active"))
        got = cat.get_directive("a", "d2")
        assert (got.text, got.title, got.priority, got.active, got.tags) == (
            "Answer in German.", "lang", 1, False, ("travel",))
        assert (got.created_at, got.updated_at) == (T0 + 1, T0 + 3)
        cat.upsert_directive(got)  # a redelivered event changes nothing
        assert cat.get_directive("a", "d2") == got
        cat.upsert_directive(Directive("d9", "a", "x", updated_at=T0), mask=("text",))
        assert cat.get_directive("a", "d9") is None  # an update never creates
        cat.upsert_directive(Directive("d1", "zz", "no bank", updated_at=T0))
        assert cat.list_directives("zz", 10) == []
        cat.delete_directive("a", "d1")
        cat.delete_directive("a", "d1")
        assert [x.id for x in cat.list_directives("a", 10)] == ["d2"]
        cat.delete_bank("a")
        cat.upsert_bank("a", "", BankConfig(), T0 + 9)
        assert cat.list_directives("a", 10) == [] and cat.get_directive("a", "d2") is None

    # -- mental models --

    def test_mental_models_keep_revisions_once_per_event_and_go_with_their_bank(self, cat):
        cat.upsert_bank("a", "", BankConfig(), T0)
        m = MentalModel("m1", "a", "Home", "Where does Alice live?", content="Lisbon.",
                        tags=("people",), memory_offset=7, updated_at=T0 + 1)
        cat.upsert_mental_model(m)
        cat.upsert_mental_model(m)  # redelivered: no second revision
        got = cat.get_mental_model("a", "m1")
        assert (got.revision, got.created_at, got.memory_offset, got.refreshed_at) == (1, T0 + 1, 7, 0)
        assert [r.content for r in cat.mental_model_revisions("a", "m1")] == ["Lisbon."]
        # a refresh: content, based_on, refreshed_at and the new offset
        refreshed = MentalModel("m1", "a", "", "", content="Porto since 2024 [1].",
                                memory_offset=12, updated_at=T0 + 5)
        rev = MentalModelRevision(0, "", based_on=("f1", "f2"), source="refresh_offline",
                                  mode="delta")
        cat.upsert_mental_model(refreshed, mask=("content",), refresh=rev)
        cat.upsert_mental_model(refreshed, mask=("content",), refresh=rev)
        got = cat.get_mental_model("a", "m1")
        assert (got.content, got.revision, got.based_on, got.refreshed_at, got.memory_offset) == (
            "Porto since 2024 [1].", 2, ("f1", "f2"), T0 + 5, 12)
        assert (got.display_name, got.source_query, got.tags) == ("Home", "Where does Alice live?",
                                                                  ("people",))
        revs = cat.mental_model_revisions("a", "m1")
        assert [(r.revision, r.content, r.based_on, r.source, r.at, r.mode) for r in revs] == [
            (1, "Lisbon.", (), "user", T0 + 1, ""),
            (2, "Porto since 2024 [1].", ("f1", "f2"), "refresh_offline", T0 + 5, "delta")]
        # a change that leaves the content alone adds no revision
        cat.upsert_mental_model(MentalModel("m1", "a", "Alice's home", "", updated_at=T0 + 6),
                                mask=("display_name",))
        got = cat.get_mental_model("a", "m1")
        assert (got.display_name, got.revision, got.content) == ("Alice's home", 2,
                                                                 "Porto since 2024 [1].")
        # a user's content (a clear too) cites nothing: based_on goes with the refresh's
        cat.upsert_mental_model(MentalModel("m1", "a", "", "", content="", updated_at=T0 + 6.5),
                                mask=("content",))
        got = cat.get_mental_model("a", "m1")
        assert (got.content, got.revision, got.based_on) == ("", 3, ())
        cat.upsert_mental_model(MentalModel("m9", "a", "x", "y", updated_at=T0), mask=("content",))
        assert cat.get_mental_model("a", "m9") is None  # an update never creates
        cat.upsert_mental_model(MentalModel("m2", "a", "Empty", "What?", updated_at=T0 + 7))
        assert [x.id for x in cat.list_mental_models("a", 10)] == ["m1", "m2"]
        assert [x.id for x in cat.list_mental_models("a", 10, after="m1")] == ["m2"]
        assert cat.get_mental_model("a", "m2").revision == 0  # no content yet
        cat.delete_mental_model("a", "m2")
        assert cat.get_mental_model("a", "m2") is None and cat.mental_model_revisions("a", "m2") == []
        cat.delete_bank("a")
        cat.upsert_bank("a", "", BankConfig(), T0 + 9)
        assert cat.list_mental_models("a", 10) == [] and cat.mental_model_revisions("a", "m1") == []

    def test_deleted_sources_erase_the_contents_citing_them(self, cat):
        cat.upsert_bank("a", "", BankConfig(), T0)
        cat.upsert_bank("b", "", BankConfig(), T0)
        for bank in ("a", "b"):
            cat.upsert_mental_model(MentalModel("m1", bank, "Home", "Where?", content="Mine.",
                                                updated_at=T0 + 1))
        def refresh(at, content, based_on, documents):
            cat.upsert_mental_model(
                MentalModel("m1", "a", "", "", content=content, memory_offset=int(at),
                            updated_at=T0 + at),
                mask=("content",), refresh=MentalModelRevision(
                    0, "", based_on=based_on, source="refresh_offline", mode="full",
                    documents=documents))
        refresh(2, "Lisbon [1].", ("f1",), ("d1",))
        refresh(3, "Porto [1], Lisbon [2].", ("f2", "f1"), ("d2", "d1"))
        refresh(4, "Porto [1].", ("f2",), ("d2",))
        # nothing cites these: nothing changes
        assert cat.erase_mental_model_sources("a", ("f9",), "d9") == 0
        assert cat.get_mental_model("a", "m1").revision == 4
        # document d1: revisions 2 and 3 go, the current one (4) stays, renumbered
        assert cat.erase_mental_model_sources("a", (), "d1") == 1
        assert cat.erase_mental_model_sources("a", (), "d1") == 0  # idempotent
        got = cat.get_mental_model("a", "m1")
        assert (got.content, got.revision, got.based_on) == ("Porto [1].", 2, ("f2",))
        assert [(r.revision, r.content, r.documents) for r in cat.mental_model_revisions("a", "m1")] == [
            (1, "Mine.", ()), (2, "Porto [1].", ("d2",))]
        # memory f2: the current content goes; the model falls back to the user's content
        assert cat.erase_mental_model_sources("a", ("f2",)) == 1
        got = cat.get_mental_model("a", "m1")
        assert (got.content, got.revision, got.based_on, got.refreshed_at) == ("Mine.", 1, (), 0)
        assert [r.content for r in cat.mental_model_revisions("a", "m1")] == ["Mine."]
        # another bank's model of the same id is not touched
        assert cat.get_mental_model("b", "m1").content == "Mine."
        # an empty document id erases nothing by document
        refresh(5, "Faro [1].", ("f3",), ("",))
        assert cat.erase_mental_model_sources("a", (), "") == 0
        assert cat.get_mental_model("a", "m1").content == "Faro [1]."
        # a fallback restores the state its content was made in, as a replay would
        refresh(6, "Faro [1], Elvas [2].", ("f3", "f4"), ("", "d4"))
        assert cat.erase_mental_model_sources("a", ("f4",)) == 1
        got = cat.get_mental_model("a", "m1")
        assert (got.content, got.memory_offset, got.refreshed_at) == ("Faro [1].", 5, T0 + 5)
        # a content citing an observation stands on the observation's facts (evidence):
        # deleting one by id, or one the deletion's keys say is gone, erases it
        for n, (deleted, gone) in enumerate(((("f8",), None), ((), {"f9"}.__contains__))):
            cat.upsert_mental_model(
                MentalModel("m1", "a", "", "", content=f"Obs {n} [1].", memory_offset=7 + n,
                            updated_at=T0 + 7 + n), mask=("content",),
                refresh=MentalModelRevision(0, "", based_on=("o1",), source="refresh",
                                            mode="delta", documents=("",),
                                            evidence=("f8", "f9")))
            assert cat.get_mental_model("a", "m1").based_on_evidence == ("f8", "f9")
            assert cat.erase_mental_model_sources("a", (), "d-unrelated") == 0
            assert cat.erase_mental_model_sources("a", deleted, "d-any", gone) == 1
            assert cat.get_mental_model("a", "m1").content == "Faro [1]."

    def test_put_operation_is_insert_only(self, cat):
        cat.put_operation(op("o1", items_total=3))
        cat.update_operation(op("o1", state="running", items_total=3, items_done=1))
        cat.put_operation(op("o1", items_total=3))  # a redelivered request
        got = cat.get_operation("o1")
        assert (got.state, got.items_done, got.kind) == ("running", 1, "retain")
        assert cat.get_operation("missing") is None

    def test_operation_roundtrip_and_copies(self, cat):
        o = op("o1", state="failed", items_total=2, items_done=2, facts=4, error="boom",
               memory_ids=["m1", "m2"], item_errors=[(1, "items[1].content", "empty")])
        cat.put_operation(o)
        got = cat.get_operation("o1")
        assert got == o and got.done
        got.memory_ids.append("x")
        o.memory_ids.append("y")
        assert cat.get_operation("o1").memory_ids == ["m1", "m2"]

    def test_update_keeps_created_at_and_inserts_unknown(self, cat):
        cat.put_operation(op("o1", at=T0))
        cat.update_operation(op("o1", state="running", at=T0 + 9, items_done=1))
        got = cat.get_operation("o1")
        assert (got.created_at, got.updated_at, got.items_done) == (T0, T0 + 9, 1)
        cat.update_operation(op("o2", state="running", at=T0 + 3))
        assert cat.get_operation("o2").created_at == T0 + 3

    @pytest.mark.parametrize("first", ["succeeded", "failed"])
    def test_first_terminal_state_is_final(self, cat, first):
        cat.put_operation(op("o1"))
        cat.update_operation(op("o1", state="running", items_done=1))
        cat.update_operation(op("o1", state=first, items_done=2, facts=5))
        other = "failed" if first == "succeeded" else "succeeded"
        cat.update_operation(op("o1", state=other, error="late verdict"))
        cat.update_operation(op("o1", state="running", items_done=0))
        cat.put_operation(op("o1"))
        got = cat.get_operation("o1")
        assert (got.state, got.items_done, got.facts, got.error) == (first, 2, 5, "")

    def test_count_operations_counts_the_banks_and_its_unfinished(self, cat):
        assert cat.count_operations("a") == (0, 0)
        for i, state in enumerate(["pending", "running", "succeeded", "failed", "pending"]):
            cat.put_operation(op(f"o{i}", "a", state=state, at=T0 + i))
        cat.put_operation(op("x1", "b", state="pending"))
        assert cat.count_operations("a") == (5, 3)
        cat.update_operation(op("o0", "a", state="succeeded"))
        assert cat.count_operations("a") == (5, 2)
        assert cat.count_operations("b") == (1, 1) and cat.count_operations("zzz") == (0, 0)
        cat.delete_bank("a")
        assert cat.count_operations("a") == (0, 0)

    def test_operations_of_a_deleted_bank_never_return(self, cat):
        cat.upsert_bank("a", "A", BankConfig(), T0)
        cat.put_operation(op("o1", "a"))
        cat.put_operation(op("keep", "b"))
        cat.delete_bank("a")
        assert cat.get_operation("o1") is None
        cat.upsert_bank("a", "A", BankConfig(), T0 + 1)  # re-created: a new incarnation
        cat.update_operation(op("o1", "a", "succeeded"))  # late progress of the old one
        cat.put_operation(op("o1", "a"))  # a redelivered old request
        assert cat.get_operation("o1") is None and cat.list_operations("a", 10) == []
        assert cat.get_operation("keep") is not None
        cat.put_operation(op("o2", "a"))  # the new incarnation's operations are fine
        assert [o.operation_id for o in cat.list_operations("a", 10)] == ["o2"]

    def test_list_operations_newest_first_with_paging(self, cat):
        cat.put_operation(op("o-old", "a", at=T0))
        cat.put_operation(op("o-b", "a", at=T0 + 2))
        cat.put_operation(op("o-a", "a", at=T0 + 2))  # same time: by id
        cat.put_operation(op("o-new", "a", at=T0 + 5))
        cat.put_operation(op("x", "b", at=T0 + 1))
        assert [o.operation_id for o in cat.list_operations("a", 10)] == [
            "o-new", "o-a", "o-b", "o-old"]
        # keyset: after (created_at, id) of the last one served, ties by id
        assert [o.operation_id for o in cat.list_operations("a", 2, after=(T0 + 5, "o-new"))] \
            == ["o-a", "o-b"]
        assert [o.operation_id for o in cat.list_operations("a", 10, after=(T0 + 2, "o-a"))] \
            == ["o-b", "o-old"]
        assert [o.operation_id for o in cat.list_operations("a", 10, after=(T0, "o-old"))] == []
        assert [o.operation_id for o in cat.list_operations("", 10)] == [
            "o-new", "o-a", "o-b", "x", "o-old"]
        assert [o.operation_id for o in cat.list_operations("", 2, after=(T0 + 2, "o-b"))] == [
            "x", "o-old"]

    def test_list_operations_by_state_and_kind_fills_each_page(self, cat):
        # the two failed ones are the oldest: a page of the newest holds none of them
        cat.put_operation(op("f1", "a", state="failed", at=T0))
        cat.put_operation(op("f2", "a", state="failed", at=T0 + 1))
        cat.put_operation(op("g1", "b", state="failed", at=T0 + 2))
        for i in range(5):
            cat.put_operation(op(f"s{i}", "a", state="succeeded", at=T0 + 10 + i))
        cat.put_operation(op("d1", "a", state="succeeded", at=T0 + 20, kind="delete_document"))
        ids = lambda ops: [o.operation_id for o in ops]  # noqa: E731
        assert ids(cat.list_operations("a", 2, state="failed")) == ["f2", "f1"]
        assert ids(cat.list_operations("a", 1, after=(T0 + 1, "f2"), state="failed")) == ["f1"]
        assert ids(cat.list_operations("", 10, state="failed")) == ["g1", "f2", "f1"]
        assert ids(cat.list_operations("a", 10, kind="delete_document")) == ["d1"]
        assert ids(cat.list_operations("a", 2, state="succeeded", kind="retain")) == ["s4", "s3"]
        assert cat.list_operations("a", 10, state="running") == []
        assert cat.list_operations("a", 10, state="failed", kind="delete_document") == []

    def test_list_operations_pages_stay_put_when_operations_come_and_go(self, cat):
        for i in range(4):
            cat.put_operation(op(f"o{i}", "a", at=T0 + i))
        cat.upsert_bank("b", "B", BankConfig(), T0)
        cat.put_operation(op("b0", "b", at=T0 + 1.5))
        first = cat.list_operations("", 2)
        assert [o.operation_id for o in first] == ["o3", "o2"]
        # between pages: a newer operation, another bank deleted
        cat.put_operation(op("o9", "a", at=T0 + 9))
        cat.delete_bank("b")
        last = first[-1]
        rest = cat.list_operations("", 10, after=(last.created_at, last.operation_id))
        assert [o.operation_id for o in rest] == ["o1", "o0"]

    def test_reset_forgets_everything(self, cat):
        cat.upsert_bank("a", "A", BankConfig(), T0)
        cat.put_operation(op("o1", "a"))
        cat.delete_bank("a")
        cat.upsert_bank("a", "A", BankConfig(), T0)
        cat.put_operation(op("o2", "a"))
        cat.reset()
        assert cat.list_banks(10) == [] and cat.list_operations("", 10) == []
        cat.upsert_bank("a", "A", BankConfig(), T0)  # generations forgotten too
        assert cat.get_bank("a").incarnation == "1"
        cat.put_operation(op("o1", "a"))  # so are deleted operations (replay rebuilds them)
        assert cat.get_operation("o1") is not None
