"""An entity's first and last seen times (Hindsight's entity listing has them) through a
real ``mneme up``: by the time each mention was told, after a deletion and after a replay."""

from __future__ import annotations

from datetime import datetime, timedelta, timezone

from typer.testing import CliRunner

from mneme.cli import app
from mneme.v1 import generations_pb2

T0 = datetime(2024, 3, 2, 9, 0, tzinfo=timezone.utc)
DAY = timedelta(days=1)


def _liz(m, bank: str):
    found = [e for e in m.list_entities(bank) if e.display_name == "Liz"]
    assert len(found) == 1, [(e.display_name, e.mention_count) for e in m.list_entities(bank)]
    return found[0]


def _seen(e) -> tuple:
    return (e.first_seen.ToDatetime(tzinfo=timezone.utc) if e.HasField("first_seen") else None,
            e.last_seen.ToDatetime(tzinfo=timezone.utc) if e.HasField("last_seen") else None)


def test_entity_first_and_last_seen_follow_deletes_and_replay(server, m):
    bank = "seen"
    m.upsert_bank(bank)
    ids = []
    # told on three days, out of order: first/last seen are by time told, not retain order
    for text, when in (("Liz bought a red kayak.", T0 + 5 * DAY),
                       ("Liz adopted a puppy named Biscuit.", T0),
                       ("Liz started a pottery class.", T0 + 9 * DAY)):
        r = m.retain(bank, [{"content": text, "timestamp": when}])
        assert r.operation.state == 3 and len(r.memory_ids) == 1, r
        ids.append(r.memory_ids[0])
    liz = _liz(m, bank)
    assert liz.mention_count == 3
    assert _seen(liz) == (T0, T0 + 9 * DAY)
    assert _seen(m.get_entity(bank, liz.id)) == (T0, T0 + 9 * DAY)

    # the latest mention deleted: last seen goes back to the latest live one
    assert m.delete_memory(bank, ids[2]).state == 3
    assert _seen(m.get_entity(bank, liz.id)) == (T0, T0 + 5 * DAY)
    assert _seen(_liz(m, bank)) == (T0, T0 + 5 * DAY)

    g = m.replay(poll_s=0.2)
    assert g.state == generations_pb2.Generation.LIVE, g
    assert _seen(m.get_entity(bank, liz.id)) == (T0, T0 + 5 * DAY)
    assert _seen(_liz(m, bank)) == (T0, T0 + 5 * DAY)

    out = CliRunner().invoke(app, ["entities", "get", bank, liz.id, "-a", server.address])
    assert out.exit_code == 0, out.output
    assert "first seen 2024-03-02T09:00:00+00:00, last seen 2024-03-07T09:00:00+00:00" in out.stdout
