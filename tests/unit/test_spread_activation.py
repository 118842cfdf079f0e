"""Spreading activation over edge groups gives exactly what the pairwise definition
gives (every source of a group to every unit, the maximum kept, no self-activation),
on random graphs with hubs, ties, duplicates and self-mentions."""

from __future__ import annotations

import random

import pytest

from mneme.stores.graph_cypher import spread_activation


def _pairwise(starts, hops, decay, groups_of, cap):
    """The definition, edge by edge (what the grouped version must equal)."""
    act, frontier = dict(starts), dict(starts)
    for _ in range(hops):
        if not frontier:
            break
        source_act = dict(sorted(frontier.items(), key=lambda kv: (-kv[1], kv[0]))[:cap])
        risen = {}
        for sources, units, w in groups_of(list(source_act)):
            for src in sources:
                for unit in units:
                    if unit == src or w <= 0:
                        continue
                    a = source_act[src] * decay * w
                    if a > act.get(unit, 0.0) + 1e-12:
                        act[unit] = risen[unit] = a
        frontier = risen
    return act


@pytest.mark.parametrize("seed", range(40))
def test_grouped_activation_equals_the_pairwise_definition(seed):
    rnd = random.Random(seed)
    units = [f"u{i}" for i in range(rnd.randint(5, 80))]
    mentions = {f"e{j}": rnd.sample(units, rnd.randint(1, min(len(units), 30)))
                for j in range(rnd.randint(1, 12))}
    weights = {e: rnd.choice([0.0, 0.3, 0.56, 1.0]) for e in mentions}
    links = [((rnd.choice(units),), (rnd.choice(units),), rnd.choice([0.5, 1.0]))
             for _ in range(rnd.randint(0, 20))]

    def groups_of(ids):
        ids = set(ids)
        for e, us in mentions.items():
            sources = [u for u in us if u in ids] * rnd.choice([1, 1, 2])  # duplicates too
            if sources:
                yield sources, us[:15], weights[e]
        yield from ((s, u, w) for s, u, w in links if s[0] in ids)

    starts = {u: rnd.choice([1.0, 0.5, 0.5, 0.25]) for u in rnd.sample(units, rnd.randint(1, 6))}
    cap = rnd.choice([2, 4, 64])
    state = rnd.getstate()
    got = spread_activation(starts, 3, 0.5, groups_of, cap)
    rnd.setstate(state)  # the same duplicate choices for the reference
    want = _pairwise(starts, 3, 0.5, groups_of, cap)
    assert got.keys() == want.keys()
    assert all(abs(got[u] - want[u]) < 1e-12 for u in got)


@pytest.mark.parametrize("seed", range(60))
def test_keep_skips_only_work_that_cannot_reach_the_top_k(seed):
    """With ``keep=k`` (and a bound on the weights) the k most activated units, and their
    activations, are exactly those of the unpruned run, also when links weigh more than
    1/decay (the bound then makes the pruning wait for the later hops)."""
    rnd = random.Random(1000 + seed)
    units = [f"u{i}" for i in range(rnd.randint(10, 120))]
    mentions = {f"e{j}": rnd.sample(units, rnd.randint(1, min(len(units), 40)))
                for j in range(rnd.randint(1, 15))}
    weights = {e: rnd.choice([0.3, 0.56, 0.8, 1.0]) for e in mentions}
    link_w = rnd.choice([[0.5, 1.0], [0.5, 1.0, 2.5]])
    links = [((rnd.choice(units),), (rnd.choice(units),), rnd.choice(link_w))
             for _ in range(rnd.randint(0, 60))]

    def groups_of(ids):
        ids = set(ids)
        for e, us in mentions.items():
            sources = [u for u in us if u in ids]
            if sources:
                yield sources, us[:20], weights[e]
        yield from ((s, u, w) for s, u, w in links if s[0] in ids)

    starts = {u: rnd.choice([1.0, 0.9, 0.55, 0.3]) for u in rnd.sample(units, rnd.randint(1, 12))}
    hops, k, cap = rnd.choice([1, 2, 3]), rnd.choice([1, 3, 10, 30]), rnd.choice([4, 16, 64])
    full = spread_activation(starts, hops, 0.5, groups_of, cap)
    pruned = spread_activation(starts, hops, 0.5, groups_of, cap, keep=k,
                               max_weight=max(link_w + [1.0]))

    def top(act):
        return [(u, round(a, 12)) for u, a in sorted(act.items(), key=lambda kv: (-kv[1], kv[0]))[:k]]

    assert top(pruned) == top(full)
    assert all(pruned[u] <= full[u] + 1e-12 for u in pruned)
