"""services.extraction.resolver: per-bank entity resolution with person aliases."""

from __future__ import annotations

import threading

from mneme.domain import derive_id
from mneme.stores.entities_sqlite import SqliteEntityStore
from services.extraction.resolver import EntityResolver


def test_same_name_same_id_and_id_derivation():
    r = EntityResolver()
    a = r.resolve("b1", [("Caroline", "PERSON")])[0]
    b = r.resolve("b1", [("caroline", "CONCEPT")])[0]
    assert a == b
    assert a.id == derive_id("entity", "b1", "caroline")
    assert a.label == "PERSON"  # the canonical entity keeps its first label
    assert r.resolve("b1", [("the Caroline's", "PERSON")])[0].id == a.id  # entity_key normalises


def test_first_name_prefix_aliases_both_ways():
    r = EntityResolver()
    mel = r.resolve("b", [("Melanie", "PERSON")])[0]
    assert r.resolve("b", [("Mel", "PERSON")])[0] == mel
    car = r.resolve("b", [("Caroline Smith", "PERSON")])[0]
    assert r.resolve("b", [("Caroline", "PERSON")])[0] == car
    # the other direction: the short name came first
    r2 = EntityResolver()
    short = r2.resolve("b", [("Caroline", "PERSON")])[0]
    assert r2.resolve("b", [("Caroline Smith", "PERSON")])[0] == short
    # an alias keeps resolving the same way; lookup follows aliases without creating
    assert r.lookup("b", ["mel", "Nobody"]) == [mel]
    assert r.aliases("b")["mel"] == "melanie"


def test_ambiguous_or_short_prefix_makes_a_new_entity():
    r = EntityResolver()
    mel = r.resolve("b", [("Melanie", "PERSON"), ("Melissa", "PERSON")])
    m = r.resolve("b", [("Mel", "PERSON")])[0]
    assert m.id not in {e.id for e in mel}
    jo = r.resolve("b", [("Joanna", "PERSON"), ("Jo", "PERSON")])
    assert len(jo) == 2  # "Jo" is under 3 letters


def test_prefix_rule_is_for_people_only():
    r = EntityResolver()
    r.resolve("b", [("Melanie", "PERSON")])
    assert r.resolve("b", [("mel", "CONCEPT")])[0].name == "mel"  # lowercase concept: no alias
    car = r.resolve("b", [("Caroline Smith", "PERSON")])[0]
    # a capitalised concept (NER missed the name) equal to a first name is that person
    assert r.resolve("b", [("Caroline", "CONCEPT")])[0] == car
    # a named mention of another kind is not: kinds are kept apart
    assert r.resolve("b", [("Caroline", "ORG")])[0] != car


def test_names_differing_by_a_number_stay_different():
    r = EntityResolver()
    a, b = r.resolve("b", [("Room 101", "FAC"), ("Room 102", "FAC")])
    assert a.id != b.id
    p1, p2 = r.resolve("b", [("Agent 007", "PERSON"), ("Agent 008", "PERSON")])
    assert p1.id != p2.id


def test_banks_are_isolated():
    r = EntityResolver()
    a = r.resolve("b1", [("Melanie", "PERSON")])[0]
    b = r.resolve("b2", [("Melanie", "PERSON")])[0]
    assert a.id != b.id
    assert r.resolve("b2", [("Mel", "PERSON")])[0] == b
    r.forget("b1")
    assert r.entities("b1") == []
    assert r.entities("b2") == [b]


def test_dedup_within_a_call_keeps_first_order():
    r = EntityResolver()
    out = r.resolve("b", [("Melanie", "PERSON"), ("painting", "CONCEPT"), ("Mel", "PERSON"),
                          ("Painting", "CONCEPT")])
    assert [e.name for e in out] == ["Melanie", "painting"]


def test_persistence_across_restarts(tmp_path):
    path = str(tmp_path / "entities.db")
    r = EntityResolver(SqliteEntityStore(path))
    mel = r.resolve("b", [("Melanie", "PERSON")])[0]
    alias = r.resolve("b", [("Mel", "PERSON")])[0]
    room = r.resolve("b", [("Room 101", "FAC")])[0]
    r.close()
    r2 = EntityResolver(SqliteEntityStore(path))
    assert r2.resolve("b", [("Mel", "PERSON")])[0] == alias == mel
    assert r2.resolve("b", [("Room 101", "FAC")])[0] == room
    # a new person that would make "Mel" ambiguous does not change the stored decision
    r2.resolve("b", [("Melissa", "PERSON")])
    assert r2.resolve("b", [("Mel", "PERSON")])[0] == mel
    assert [e.name for e in r2.entities("b")] == ["Melanie", "Room 101", "Melissa"]
    r2.forget("b")
    r2.close()
    assert EntityResolver(SqliteEntityStore(path)).entities("b") == []


def test_deterministic_given_the_same_calls():
    calls = [[("Caroline", "PERSON"), ("LGBTQ support group", "CONCEPT")],
             [("Mel", "PERSON")], [("Melanie", "PERSON"), ("Caro", "PERSON")]]
    outs = []
    for _ in range(2):
        r = EntityResolver()
        outs.append([r.resolve("b", c) for c in calls])
    assert outs[0] == outs[1]
    many = EntityResolver().resolve_many("b", calls)
    assert many == outs[0]


def test_thread_safe():
    r = EntityResolver()
    results: list = []

    def run():
        results.append(tuple(e.id for e in r.resolve("b", [("Melanie", "PERSON"), ("Mel", "PERSON"),
                                                          ("Paris", "GPE")])))

    ts = [threading.Thread(target=run) for _ in range(8)]
    for t in ts:
        t.start()
    for t in ts:
        t.join()
    assert len(set(results)) == 1
    assert len(r.entities("b")) == 2


# ---- issue 9 item 8: kinds and numbers keep entities apart ------------------------------


def test_kinds_are_kept_apart_and_ids_stay_deterministic():
    r = EntityResolver()
    person = r.resolve("b", [("Jordan", "PERSON")])[0]
    country = r.resolve("b", [("Jordan", "GPE")])[0]
    assert person.id != country.id and (person.label, country.label) == ("PERSON", "GPE")
    assert person.id == derive_id("entity", "b", "jordan")  # the first keeps the plain id
    assert country.id == derive_id("entity", "b", "jordan", "place")
    # each kind keeps resolving to its own entity; LOC/FAC are places like GPE
    assert r.resolve("b", [("Jordan", "LOC")])[0] == country
    assert r.resolve("b", [("jordan", "PERSON")])[0] == person
    org = r.resolve("b", [("Jordan", "ORG")])[0]
    assert org.id not in {person.id, country.id}
    # a concept (kindless) mention joins the first entity of its key, never makes one
    assert r.resolve("b", [("jordan", "CONCEPT")])[0] == person
    assert len(r.entities("b")) == 3
    assert set(r.lookup("b", ["Jordan"])) == {person, country, org}


def test_a_concept_entity_is_claimed_by_the_first_named_kind():
    r = EntityResolver()
    concept = r.resolve("b", [("apple", "CONCEPT")])[0]
    org = r.resolve("b", [("Apple", "ORG")])[0]
    assert org.id == concept.id and org.label == "ORG"  # same id, now of kind org
    fruit_co = r.resolve("b", [("Apple", "PRODUCT")])[0]
    assert fruit_co.id != org.id
    assert r.resolve("b", [("apple", "CONCEPT")])[0] == org


def test_numbers_years_and_ordinals_keep_names_apart_in_every_rule():
    r = EntityResolver()
    pairs = [("Annual Report 2023", "Annual Report 2024", "WORK_OF_ART"),
             ("2023 report", "2024 report", "CONCEPT"), ("Room 101", "Room 102", "FAC"),
             ("iPhone 14", "iPhone 15", "PRODUCT"), ("2nd floor", "3rd floor", "CONCEPT")]
    for a, b, label in pairs:
        x, y = r.resolve("b", [(a, label), (b, label)])
        assert x.id != y.id, (a, b)
    # person prefixes (the fuzzy rule) never bridge differing number tokens
    henry8 = r.resolve("b", [("Henry VIII", "PERSON")])[0]
    assert r.resolve("b", [("Henry VII", "PERSON")])[0] != henry8
    agent = r.resolve("b", [("Agent 007 Bond", "PERSON")])[0]
    assert r.resolve("b", [("Agent 008", "PERSON")])[0] != agent
    assert r.resolve("b", [("Agent 007", "PERSON")])[0] == agent  # same number: alias
    # and a name with a number does not alias the one without
    report = r.resolve("b", [("Report", "PERSON")])[0]
    assert r.resolve("b", [("Report 2023", "PERSON")])[0] != report


def test_number_tokens():
    from services.extraction.resolver import number_tokens
    assert number_tokens("annual report 2023") == ("2023",)
    assert number_tokens("henry viii") == ("viii",)
    assert number_tokens("vi hart") == ()  # a first word is a name, not a numeral
    assert number_tokens("second floor q3") == ("second", "q3")
    assert number_tokens("melanie") == ()


def test_kinds_persist_and_an_old_schema_file_is_migrated(tmp_path):
    import sqlite3

    from tests.contract.entity_suite import ENTITIES_V1_SCHEMA

    path = str(tmp_path / "entities.db")
    old = sqlite3.connect(path)  # the one-entity-per-key schema of earlier versions
    old.executescript(ENTITIES_V1_SCHEMA)
    mel_id = derive_id("entity", "b", "melanie")
    old.execute("INSERT INTO entities VALUES ('b', 'melanie', ?, 'Melanie', 'PERSON', 1)",
                (mel_id,))
    old.execute("INSERT INTO aliases VALUES ('b', 'mel', 'melanie')")
    old.commit()
    old.close()
    r = EntityResolver(SqliteEntityStore(path))
    assert r.resolve("b", [("Mel", "PERSON")])[0].id == mel_id  # alias kept, id unchanged
    country = r.resolve("b", [("Melanie", "GPE")])[0]
    assert country.id != mel_id
    r.close()
    r2 = EntityResolver(SqliteEntityStore(path))
    assert r2.resolve("b", [("Melanie", "GPE")])[0] == country
    assert r2.resolve("b", [("Melanie", "PERSON")])[0].id == mel_id
    assert len(r2.entities("b")) == 2


def test_merge_resolves_every_alias_to_the_survivor_and_survives_a_restart():
    store = SqliteEntityStore(":memory:")
    r = EntityResolver(store)
    liz, eli = (ref for [ref] in r.resolve_many("b", [[("Liz", "PERSON")],
                                                       [("Elizabeth", "PERSON")]]))
    assert liz.id != eli.id
    r.resolve("b", [("Lizzy", "PERSON")])  # "liz" is its prefix: an alias of Liz
    assert r.merge("b", eli.id, [liz.id], display_name="Elizabeth Bennet")
    assert not r.merge("b", eli.id, [liz.id], display_name="Elizabeth Bennet")  # redelivery
    survivor = r.resolve("b", [("Liz", "PERSON")])[0]
    assert survivor.id == eli.id and survivor.name == "Elizabeth Bennet"
    assert r.resolve("b", [("Lizzy", "PERSON")])[0].id == eli.id
    assert [e.id for e in r.entities("b")] == [eli.id]
    restarted = EntityResolver(store)  # the correction was persisted
    assert restarted.resolve("b", [("liz", "PERSON")])[0] == survivor
    assert restarted.resolve("b", [("elizabeth bennet", "PERSON")])[0].id == eli.id
    assert not r.merge("b", "unknown", [eli.id])  # an unknown survivor changes nothing


def test_split_moves_aliases_to_a_new_entity():
    store = SqliteEntityStore(":memory:")
    r = EntityResolver(store)
    mel = r.resolve("b", [("Melanie", "PERSON")])[0]
    assert r.resolve("b", [("Mel", "PERSON")])[0] == mel
    assert r.split("b", mel.id, "new-id", ["mel"], "Mel Gibson")
    assert not r.split("b", mel.id, "new-id", ["mel"], "Mel Gibson")  # redelivery
    got = r.resolve("b", [("Mel", "PERSON")])[0]
    assert (got.id, got.name, got.label) == ("new-id", "Mel Gibson", "PERSON")
    assert r.resolve("b", [("Melanie", "PERSON")])[0] == mel
    assert EntityResolver(store).resolve("b", [("mel", "PERSON")])[0].id == "new-id"
    # the entity's own key moved: its remaining alias becomes its key
    car = r.resolve("b", [("Caroline Smith", "PERSON")])[0]
    r.resolve("b", [("Caroline", "PERSON")])
    assert r.split("b", car.id, "c2", ["caroline smith"], "Caroline Smith")
    assert r.resolve("b", [("Caroline Smith", "PERSON")])[0].id == "c2"
    assert r.resolve("b", [("Caroline", "PERSON")])[0].id == car.id
    assert EntityResolver(store).resolve("b", [("Caroline", "PERSON")])[0].id == car.id


def test_a_split_applied_again_after_its_changelog_takes_the_aliases_again():
    r = EntityResolver()
    mel = r.resolve("b", [("Melanie", "PERSON")])[0]
    r.resolve("b", [("Mel", "PERSON")])
    entities, claims, aliases = r.drain("b")
    r.split("b", mel.id, "new-id", ["mel"], "Mel Gibson")
    # a restore from an older checkpoint: the resolution changelog, then the split again
    r.learn("b", entities, claims, aliases)
    assert r.split("b", mel.id, "new-id", ["mel"], "Mel Gibson")
    assert r.lookup("b", ["mel"]) == [r.resolve("b", [("Mel", "PERSON")])[0]]
    assert r.lookup("b", ["mel"])[0].id == "new-id"


def test_a_deleted_documents_only_entities_leave_every_index():
    """forget_scope: an entity only a deleted document mentioned is gone from the
    resolver's key and alias indexes (its name is the document's content); the name made
    again later resolves to the same id."""
    from mneme.stores.memory import MemoryEntityStore
    r = EntityResolver(MemoryEntityStore())
    [a] = r.resolve("b", [("Melanie Smith", "PERSON")])
    [kept] = r.resolve("b", [("Lisbon", "GPE")])
    r.note_mentions("b", [(a.id, "d:x"), (kept.id, "d:x"), (kept.id, "d:y")])
    b = r._banks["b"]

    def keys(i):
        return {k for index in (b.by_key, b.aliases) for k, ids in index.items() if i in ids}
    assert keys(a.id) and keys(kept.id)
    assert r.forget_scope("b", "d:x") == [a.id]
    assert keys(a.id) == set() and a.id not in b.entities
    assert keys(kept.id) and kept.id in b.entities  # d:y still mentions it
    assert r.resolve("b", [("Melanie Smith", "PERSON")])[0].id == a.id


def test_a_failed_persist_leaves_no_entity_in_memory(tmp_path):
    """The store refused a call's decisions (here a name no UTF-8 encoder takes, as a
    model's cut emoji escape once gave): the entity must not live on in memory, or every
    later mention of the name resolves to it and fails the same way (a bank whose retains
    were all dead-lettered). Memory reloads from the store, which has what it committed."""
    r = EntityResolver(SqliteEntityStore(str(tmp_path / "entities.db")))
    tea = r.resolve("b", [("Tea House", "ORG")])[0]
    try:
        r.resolve("b", [("Ann\udc00", "PERSON")])
    except UnicodeEncodeError:
        pass
    ann = r.resolve("b", [("Ann", "PERSON")])[0]
    assert ann.name == "Ann"
    assert r.resolve("b", [("Tea House", "ORG")])[0] == tea


def test_a_failed_persist_leaves_nothing_only_in_memory(tmp_path):
    """A write of the entity store that failed (a full disk) left the new entities in the
    resolver's memory: the retry of the same fact resolved them from memory, had
    nothing to persist, and entities.db never got them (after a restart the bank had
    lost them, and their mentions). The failed call's decisions are forgotten; the
    retry persists them."""
    store = SqliteEntityStore(str(tmp_path / "entities.db"))
    real = store.persist
    failing = [False]

    def persist(*a, **kw):
        if failing[0]:
            raise OSError(28, "No space left on device")
        return real(*a, **kw)

    store.persist = persist
    r = EntityResolver(store)
    r.resolve("b", [("Caroline", "PERSON")])  # the bank is loaded (known entities: one)
    failing[0] = True
    try:
        r.resolve("b", [("Melanie", "PERSON")])
    except OSError:
        pass
    failing[0] = False
    mel = r.resolve("b", [("Melanie", "PERSON")])[0]  # the retry
    entities, _ = SqliteEntityStore(str(tmp_path / "entities.db")).load("b")
    assert mel.id in [e.id for e in entities]


def test_the_banks_kept_in_memory_are_bounded_and_an_evicted_bank_resolves_the_same(tmp_path):
    """A resolver kept every bank it had resolved in since the process started, all of
    its entities and aliases: a server of many tenants held all of entities.db in memory.
    With a store it keeps the least recently used up to RESOLVER_BANKS; a bank dropped is
    loaded again and resolves as before (aliases included)."""
    from services.extraction import resolver as module
    bound = getattr(module, "RESOLVER_BANKS", 256)
    r = EntityResolver(SqliteEntityStore(str(tmp_path / "entities.db")))

    def extract(bank: str, cause: str, mentions):  # as extraction does for an event
        r.begin(bank, cause)
        refs = r.resolve(bank, mentions)
        r.drain(bank)
        return refs

    mel = extract("t0", "e0", [("Melanie", "PERSON")])[0]
    assert extract("t0", "e1", [("Mel", "PERSON")])[0] == mel  # an alias
    for i in range(1, bound + 50):
        extract(f"t{i}", f"e{i}", [("Caroline", "PERSON")])
    assert len(r._banks) <= bound
    assert "t0" not in r._banks
    assert r.resolve("t0", [("Mel", "PERSON")])[0] == mel
    assert r.lookup("t0", ["mel"]) == [mel]
