"""Issue 9 items 8 and 9 end to end through gRPC on a real ``mneme up`` (offline
extractor, embedded stores): names that differ by a year or by kind stay different
entities; CJK text is found by the keyword (BM25) arm and yields no sentence-long
entities; both survive ``mneme replay`` unchanged."""

from __future__ import annotations

from datetime import datetime, timezone

import pytest

from tests.e2e.server import Server

pytestmark = pytest.mark.slow

TS = datetime(2024, 5, 1, 12, tzinfo=timezone.utc)
REPORTS = ["Acme published its Annual Report 2023 today.",
           "Acme published its Annual Report 2024 today."]
JORDAN = ["Jordan called me about the budget meeting.", "We flew to Jordan last summer."]
CJK = {
    "zh1": "我昨天在北京吃了烤鸭。",
    "zh2": "他下周要去上海出差，然后回杭州看父母。",
    "zh3": "我的猫喜欢在阳台上晒太阳。",
    "ja": "東京で寿司を食べました。",
    "ko": "나는 서울에서 김치를 먹었다.",
}
KEYWORDS = [("北京", "zh1"), ("烤鸭", "zh1"), ("上海出差", "zh2"), ("杭州", "zh2"),
            ("阳台", "zh3"), ("晒太阳", "zh3"), ("寿司", "ja"), ("김치", "ko"), ("서울", "ko")]


def _items(texts: list[str], prefix: str) -> list[dict]:
    return [{"content": t, "timestamp": TS, "metadata": {"k": f"{prefix}{i}"}}
            for i, t in enumerate(texts)]


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    data = tmp_path_factory.mktemp("hardening") / "data"
    s = Server(data).start()
    with s.client() as m:
        m.upsert_bank("names")
        for texts, prefix in ((REPORTS, "report"), (JORDAN, "jordan")):
            assert m.retain("names", _items(texts, prefix)).operation.state == 3
        m.upsert_bank("cjk")
        items = [{"content": t, "timestamp": TS, "metadata": {"k": k}} for k, t in CJK.items()]
        assert m.retain("cjk", items).operation.state == 3
    yield s
    s.stop()


def _by_key(m, bank: str) -> dict:
    return {x.metadata["k"]: x for x in m.list_memories(bank)}


def _entity_ids(m, bank: str) -> dict:
    return {k: sorted((e.name, e.label, e.id) for e in x.entities)
            for k, x in _by_key(m, bank).items()}


def test_two_yearly_reports_are_two_entities(server):
    with server.client() as m:
        mems = _by_key(m, "names")
        a, b = ({e.name: e.id for e in m.get_memory("names", mems[k].id).entities}
                for k in ("report0", "report1"))
    assert a["Annual Report 2023"] != b["Annual Report 2024"]
    shared = set(a.values()) & set(b.values())
    # what the two facts share is the publisher, never a year-less "Annual Report"
    assert {n for n, i in a.items() if i in shared} <= {"Acme"}


def test_a_person_and_a_place_of_the_same_name_are_two_entities(server):
    with server.client() as m:
        mems = _by_key(m, "names")
        person = [e for e in mems["jordan0"].entities if e.name == "Jordan"]
        place = [e for e in mems["jordan1"].entities if e.name == "Jordan"]
    assert [e.label for e in person] == ["PERSON"] and [e.label for e in place] == ["GPE"]
    assert person[0].id != place[0].id


@pytest.mark.parametrize("keyword, key", KEYWORDS)
def test_cjk_keyword_is_found_by_the_keyword_arm(server, keyword, key):
    with server.client() as m:
        want = _by_key(m, "cjk")[key].id
        r = m.recall("cjk", keyword, max_tokens=4096)
    ranks = {x.memory.id: x.scores.keyword_rank for x in r.results}
    assert ranks.get(want, 0) >= 1, (keyword, ranks)
    best = min((x for x in r.results if x.scores.keyword_rank), key=lambda x: x.scores.keyword_rank)
    assert best.memory.id == want


def test_cjk_sentences_have_no_sentence_long_entities(server):
    with server.client() as m:
        for key, x in _by_key(m, "cjk").items():
            mem = m.get_memory("cjk", x.id)
            assert mem.text.startswith(CJK[key][:4])
            for e in mem.entities:
                assert e.name.strip("。. ") != CJK[key].strip("。. ") and len(e.name) <= 8, e


def test_replay_keeps_entity_ids_and_cjk_keyword_hits(server):
    with server.client() as m:
        before = {b: _entity_ids(m, b) for b in ("names", "cjk")}
    server.replay()
    with server.client() as m:
        assert {b: _entity_ids(m, b) for b in ("names", "cjk")} == before
        want = _by_key(m, "cjk")["zh1"].id
        r = m.recall("cjk", "北京烤鸭", max_tokens=4096)
        assert any(x.memory.id == want and x.scores.keyword_rank == 1 for x in r.results)
