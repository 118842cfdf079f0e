"""The catalog projection and resource-name parsing."""

import pytest

from mneme.domain import BankConfig
from mneme.errors import InvalidArgument
from mneme.names import bank_id_of, memory_of, operation_of, unit_name, unit_of
from mneme.domain import Operation
from mneme.stores.catalog_sqlite import SqliteCatalog


def test_bank_upsert_is_idempotent_and_paged(tmp_path):
    c = SqliteCatalog(str(tmp_path / "c.db"))
    for b in ("b", "a", "c"):
        c.upsert_bank(b, b.upper(), BankConfig(), 1.0)
    c.upsert_bank("a", "renamed", BankConfig(skepticism=5), 2.0)
    assert [b.bank_id for b in c.list_banks(2)] == ["a", "b"]
    assert [b.bank_id for b in c.list_banks(2, after="b")] == ["c"]
    a = c.get_bank("a")
    assert a.display_name == "renamed" and a.config.skepticism == 5
    assert a.created_at.timestamp() == 1.0 and a.updated_at.timestamp() == 2.0
    c.delete_bank("a")
    assert c.get_bank("a") is None
    c.close()
    assert [b.bank_id for b in SqliteCatalog(str(tmp_path / "c.db")).list_banks(10)] == ["b", "c"]


def test_operation_progress_never_reverts_a_terminal_state(tmp_path):
    c = SqliteCatalog(":memory:")
    c.put_operation(Operation("op", "b", "retain", items_total=3, created_at=1, updated_at=1))
    c.put_operation(Operation("op", "b", "retain", items_total=3, created_at=9, updated_at=9))
    assert c.get_operation("op").created_at == 1  # redelivered request keeps the first
    c.update_operation(Operation("op", "b", "retain", "succeeded", 3, 3, 7, created_at=2, updated_at=2))
    c.update_operation(Operation("op", "b", "retain", "running", 3, 1, created_at=3, updated_at=3))
    op = c.get_operation("op")
    assert op.state == "succeeded" and op.facts == 7 and op.created_at == 1
    # A second verdict (e.g. a dead letter elsewhere after success) does not change it.
    c.update_operation(Operation("op", "b", "retain", "failed", 3, 3, 0, "late", created_at=4,
                                 updated_at=4))
    assert c.get_operation("op").state == "succeeded"


def test_deleting_a_bank_deletes_its_operations_and_ignores_their_late_progress():
    c = SqliteCatalog(":memory:")
    c.upsert_bank("b", "", BankConfig(), 1)
    c.upsert_bank("b", "", BankConfig(), 1.5)  # an upsert of a live bank: same incarnation
    assert c.get_bank("b").incarnation == "1"
    c.put_operation(Operation("op", "b", "retain", created_at=1, updated_at=1))
    c.delete_bank("b")
    c.upsert_bank("b", "", BankConfig(), 2)
    assert c.get_bank("b").incarnation == "2"
    c.update_operation(Operation("op", "b", "retain", "succeeded", created_at=3, updated_at=3))
    c.put_operation(Operation("op", "b", "retain", created_at=3, updated_at=3))
    assert c.get_operation("op") is None and c.list_operations("b", 10) == []


def test_masked_upsert_changes_only_the_named_fields_and_never_creates():
    c = SqliteCatalog(":memory:")
    c.upsert_bank("b", "Old", BankConfig(retain_mission="keep", skepticism=5), 1)
    c.upsert_bank("b", "New", BankConfig(), 2, mask=("display_name",))
    b = c.get_bank("b")
    assert (b.display_name, b.config.retain_mission, b.config.skepticism) == ("New", "keep", 5)
    c.upsert_bank("b", "", BankConfig(empathy=1), 3, mask=("config.empathy",))
    b = c.get_bank("b")
    assert (b.display_name, b.config.empathy, b.config.retain_mission, b.incarnation) == (
        "New", 1, "keep", "1")
    c.upsert_bank("ghost", "x", BankConfig(), 4, mask=("display_name",))
    assert c.get_bank("ghost") is None


@pytest.mark.parametrize("name", ["", "bank/x", "banks/", "banks/UPPER", "banks/a/b", "banks/-x",
                                  "banks/x\n", "banks/x ", "banks/ä", "banks/" + "a" * 64])
def test_bad_bank_names_name_the_field(name):
    with pytest.raises(InvalidArgument) as e:
        bank_id_of(name, "parent")
    assert e.value.violations[0][0] == "parent"


def test_names_parse():
    assert bank_id_of("banks/conv-26") == "conv-26"
    mid = "0b7a6b8e-4f5c-5d7e-9a1b-2c3d4e5f6a7b"
    assert memory_of(f"banks/b1/memories/{mid}") == ("b1", mid)
    with pytest.raises(InvalidArgument):
        memory_of("banks/b1/memories/not-a-uuid")
    assert operation_of(f"operations/{mid}") == mid
    # Full match only: a trailing newline, braces or upper case are not canonical ids.
    for bad in ("abc", f"{mid}\n", "{" + mid + "}", mid.upper(), mid.replace("-", "")):
        with pytest.raises(InvalidArgument):
            operation_of(f"operations/{bad}")
        with pytest.raises(InvalidArgument):
            memory_of(f"banks/b1/memories/{bad}")


def test_an_operation_name_in_another_collection_is_refused_as_such():
    mid = "0b7a6b8e-4f5c-5d7e-9a1b-2c3d4e5f6a7b"
    for bad in (f"banks/b1/operations/{mid}", f"ops/{mid}", f"operations/{mid}/x"):
        with pytest.raises(InvalidArgument) as e:
            operation_of(bad)
        assert e.value.violations == [("name", "must be 'operations/{operation_id}'")], bad
    assert operation_of(mid) == mid  # a bare id, as before


def test_each_kind_of_unit_is_named_in_its_own_collection_and_the_name_parses_back():
    mid = "0b7a6b8e-4f5c-5d7e-9a1b-2c3d4e5f6a7b"
    for fact_type, collection, kind in (("world", "memories", None),
                                        ("experience", "memories", None),
                                        ("observation", "observations", "observation"),
                                        ("opinion", "opinions", "opinion")):
        name = unit_name("b1", mid, fact_type)
        assert name == f"banks/b1/{collection}/{mid}"
        assert unit_of(name) == ("b1", mid, kind)
    for bad in (f"banks/b1/entities/{mid}", f"banks/b1/observations/{mid}/x",
                "banks/b1/opinions/not-a-uuid", f"observations/{mid}", ""):
        with pytest.raises(InvalidArgument) as e:
            unit_of(bad, "name")
        assert e.value.violations[0][0] == "name"


def test_a_bank_from_before_generations_is_reborn_as_the_second(tmp_path):
    import sqlite3
    path = str(tmp_path / "old.db")
    c = SqliteCatalog(path)
    c.upsert_bank("b", "", BankConfig(), 1)
    c.close()
    db = sqlite3.connect(path)  # as an older release left it: no generation counted
    db.execute("DELETE FROM bank_generations")
    db.execute("UPDATE banks SET incarnation=''")
    db.commit()
    db.close()
    c = SqliteCatalog(path)
    assert c.get_bank("b").incarnation == ""
    c.delete_bank("b")
    c.upsert_bank("b", "", BankConfig(), 2)
    assert c.get_bank("b").incarnation == "2"


def test_every_operation_kind_is_one_the_filter_knows():
    """ListOperations' filter refuses a kind it does not know: every kind an operation
    is given must be in mneme.domain.OPERATION_KINDS."""
    from mneme.domain import OPERATION_KINDS
    from services.ingest import handlers
    assert set(handlers._KIND.values()) | {"delete_opinion"} <= set(OPERATION_KINDS)
