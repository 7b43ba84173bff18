"""Online inserts on the merged trap instances of 100-200 contexts (issue 28): every insert
keeps at least 98% of the achievable gain, and the repair after an overflow is bounded in
work (search nodes), so the same inserts give the same plans.

The reference is the LP relaxation of an independent MILP (``milp_reference``, scipy): it is
at least the optimum, so a share of it is at most the share of the exact optimum.
"""

from __future__ import annotations

import numpy as np
import pytest
from milp_reference import gain_share, optimum

from kvtierd.policies.base import PlacerParams
from kvtierd.policies.branch_bound import branch_and_bound
from kvtierd.policies.evicpress import EXACT_MAX, EvicPressPlacer
from kvtierd.policies.exact import Problem
from kvtierd.policies.knapsack import greedy_assign
from kvtierd.policies.model import UtilityTable
from kvtierd.policies.refine import contested
from kvtierd.sim.families import FAMILIES, merged_traps
from kvtierd.types import TierModel


def _inserted(table: UtilityTable) -> EvicPressPlacer:
    """The daemon's path: one insert at a time, in context order, into an empty placer."""
    tiers = [TierModel(str(t), c, 1.0) for t, c in enumerate(table.capacity_bytes)]
    placer = EvicPressPlacer(tiers, PlacerParams())
    for i in range(table.n_contexts):
        placer.insert_row(table, i)
    return placer


@pytest.mark.parametrize(("seed", "n"), [(0, 100), (1, 137), (2, 174), (3, 200)])
def test_inserts_keep_98_percent_of_the_gain_on_merged_traps(seed, n):
    table = merged_traps(seed, n)
    assert contested(Problem.of(table)).size > EXACT_MAX  # above the exact re-solve
    placer = _inserted(table)
    used = placer.used_bytes()
    assert all(c is None or u <= c for u, c in zip(used, table.capacity_bytes, strict=True))
    assert gain_share(table, placer.total_utility(), optimum(table, relax=True)) >= 0.98


def test_the_merged_instances_trap_the_greedy():
    """Without a repair the per-byte greedy misses more than 2% on them: the test above can
    fail."""
    shares = []
    for seed, n in [(0, 100), (1, 137), (2, 174)]:
        table = merged_traps(seed, n)
        greedy = greedy_assign(table).total_utility(table)
        shares.append(gain_share(table, greedy, optimum(table, relax=True)))
    assert min(shares) < 0.98, shares


@pytest.mark.parametrize("name", list(FAMILIES))
def test_branch_and_bound_finds_the_optimum_of_small_instances_and_says_so(name):
    for seed in range(3):
        table = FAMILIES[name](seed, 7)
        start = greedy_assign(table)
        found = branch_and_bound(Problem.of(table), start, max_nodes=10**6)
        assert found.proven
        assert found.assignment.feasible(table)
        assert found.objective == pytest.approx(optimum(table), rel=1e-9, abs=1e-9)


def test_branch_and_bound_stops_at_its_node_budget_and_never_loses_the_start():
    table = merged_traps(4, 60)
    start = greedy_assign(table)
    found = branch_and_bound(Problem.of(table), start, max_nodes=50)
    assert found.nodes <= 50 and not found.proven
    assert found.objective >= start.total_utility(table)
    assert found.assignment.feasible(table)


def test_the_same_inserts_give_the_same_placements():
    table = merged_traps(5, 120)
    a, b = _inserted(table), _inserted(table)
    ids = list(table.context_ids)
    assert a.placements(ids) == b.placements(ids)
    assert np.isclose(a.total_utility(), b.total_utility(), rtol=0, atol=0)
