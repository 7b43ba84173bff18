"""The improvement phase (pairwise exchange) and the greedy's gap to the MILP optimum."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from test_properties import instances

from kvtierd.policies.exact import solve_exact
from kvtierd.policies.exchange import exchange
from kvtierd.policies.knapsack import greedy_assign
from kvtierd.policies.model import Assignment, UtilityTable
from kvtierd.types import TierModel


def _table(size, quality, caps, freq=None):
    size = np.asarray(size, dtype=np.float64)
    n = size.shape[0]
    tiers = [TierModel(f"t{i}", c, 1e9) for i, c in enumerate(caps)]
    return UtilityTable.from_arrays(
        tiers=tiers,
        alpha=10.0,
        size_bytes=size,
        quality=np.asarray(quality, dtype=np.float64),
        restore_s=np.zeros_like(size),
        frequency=np.ones(n) if freq is None else np.asarray(freq, dtype=np.float64),
        prefill_s=np.full(n, 5.0),
    )


def test_exchange_swaps_contexts_that_no_single_move_improves():
    # One 100-byte tier; cached utility ~ 10 * freq, dropped 5 * freq. Start: X (70 B) cached,
    # Y (50 B, hotter) dropped = 10 + 7.5. Y alone does not fit beside X and dropping X alone
    # loses, but the pair move (X out, Y in) gains: 5 + 15 = 20, the optimum.
    table = _table([[70.0], [50.0]], [[1.0], [1.0]], [100], [1.0, 1.5])
    start = Assignment(
        variant=np.zeros(2, dtype=np.int64),
        tier=np.zeros(2, dtype=np.int64),
        dropped=np.array([False, True]),
    )
    assert greedy_assign(table, rounds=1, max_improve_rounds=64, exchange_max=0).feasible(table)
    got = exchange(table, start)
    assert got.feasible(table)
    assert got.dropped.tolist() == [True, False]
    assert got.total_utility(table) == pytest.approx(solve_exact(table).objective)
    assert got.total_utility(table) == pytest.approx(20.0, rel=1e-6)


@settings(max_examples=40, deadline=None)
@given(instances())
def test_exchange_never_loses_and_stays_feasible(inst):
    tiers, profiles = inst
    table = UtilityTable.from_profiles(profiles, tiers, alpha=10.0)
    start = greedy_assign(table, rounds=1, max_improve_rounds=0, exchange_max=0)
    got = exchange(table, start)
    assert got.feasible(table)
    assert got.total_utility(table) >= start.total_utility(table) - 1e-9


def test_greedy_reaches_98_percent_of_the_optimum_on_random_instances():
    """Uniform random instances as in benchmarks/micro/bench_placer.py (the harder kind)."""
    rng = np.random.default_rng(7)
    for _ in range(25):
        n, n_var = 12, 6
        size = rng.uniform(10, 60, (n, n_var))
        size[:, 0] = 60
        quality = rng.uniform(0.3, 1, (n, n_var))
        quality[:, 0] = 1
        tiers = [TierModel("a", 100, 100.0), TierModel("b", 200, 20.0), TierModel("c", None, 5.0)]
        table = UtilityTable.from_arrays(
            tiers=tiers,
            alpha=10.0,
            size_bytes=size,
            quality=quality,
            restore_s=np.zeros((n, n_var)),
            frequency=rng.uniform(0.5, 2, n),
            prefill_s=np.full(n, 8.0),
        )
        opt = solve_exact(table).objective
        got = greedy_assign(table)
        assert got.feasible(table)
        assert got.total_utility(table) >= 0.98 * opt
