"""Hand-checked instances for the EvicPress placer (Algorithm 1) and its offline solver.

Instance (alpha = 100, tiers from ``two_tiers``): utility = (100 * q - size / bw) * freq.

====  ===========  =====  =========  ==========  =========
ctx   variant      size   quality    fast        slow
====  ===========  =====  =========  ==========  =========
A     none         80     1.0        99.2        92.0
A     x@0.5        40     0.995      99.1        95.5
B     none (f=2)   80     1.0        198.4       184.0
B     x@0.5 (f=2)  40     0.5        99.2        92.0
====  ===========  =====  =========  ==========  =========

Dropping is worth (100 - 20) * freq: 80 for A, 160 for B. Inserting B after A overflows the
fast tier by 60 bytes; per byte the cheapest steps are A: compress in place (0.1 / 40), then A:
move its compressed copy down (3.6 / 40 = 0.09 < B's 14.4 / 80 = 0.18). Optimum = 198.4 + 95.5.
"""

from __future__ import annotations

import numpy as np
import pytest
from placer_helpers import profile, replay

from kvtierd.policies import make_placer
from kvtierd.policies.base import PlacerParams
from kvtierd.policies.evicpress import EvicPressPlacer, solve
from kvtierd.policies.exact import solve_exact
from kvtierd.policies.greedy_state import Selection
from kvtierd.policies.model import UtilityTable
from kvtierd.types import DROPPED, OpKind, Placement, TierModel

A = profile("A", {"none": (80, 1.0), "x@0.5": (40, 0.995)})
B = profile("B", {"none": (80, 1.0), "x@0.5": (40, 0.5)}, frequency=2.0)
SIZES = {"A": {"none": 80, "x@0.5": 40}, "B": {"none": 80, "x@0.5": 40}}


@pytest.mark.parametrize("selection", ["per_byte", "absolute"])
def test_insert_compresses_then_moves_the_insensitive_context(two_tiers, selection):
    placer = EvicPressPlacer(two_tiers, PlacerParams(alpha=100.0, selection=selection))
    state: dict[str, Placement] = {}
    plan_a = placer.insert(A)
    replay(plan_a, state, SIZES, two_tiers)
    assert placer.placement("A") == Placement("none", "fast")
    plan_b = placer.insert(B)
    replay(plan_b, state, SIZES, two_tiers)
    assert placer.placement("A") == Placement("x@0.5", "slow")
    assert placer.placement("B") == Placement("none", "fast")
    # A's net change comes first (it makes room), then B is placed.
    assert [(op.kind, op.context_id) for op in plan_b.operations] == [
        (OpKind.MOVE, "A"),
        (OpKind.PLACE, "B"),
    ]
    assert state == {"A": placer.placement("A"), "B": placer.placement("B")}
    assert placer.total_utility() == pytest.approx(198.4 + 95.5)
    assert placer.used_bytes() == [80.0, 40.0]


def test_rebalance_and_milp_agree_on_the_hand_checked_optimum(two_tiers):
    table = UtilityTable.from_profiles([A, B], two_tiers, alpha=100.0)
    exact = solve_exact(table)
    assert exact.objective == pytest.approx(198.4 + 95.5)
    assert exact.assignment is not None
    for selection in Selection:
        got = solve(table, selection)
        assert got.total_utility(table) == pytest.approx(exact.objective)
        assert got.dropped.tolist() == [False, False]
        assert got.tier.tolist() == [1, 0]
        assert got.variant.tolist() == [1, 0]
    lp = solve_exact(table, relax=True)
    assert lp.objective >= exact.objective - 1e-9
    placer = EvicPressPlacer(two_tiers, PlacerParams(alpha=100.0))
    state: dict[str, Placement] = {}
    replay(placer.rebalance([A, B]), state, SIZES, two_tiers)
    assert state == {"A": Placement("x@0.5", "slow"), "B": Placement("none", "fast")}


def test_last_finite_tier_drops_when_prefill_beats_loading():
    tiers = [TierModel("fast", 100, 100.0)]
    placer = EvicPressPlacer(tiers, PlacerParams(alpha=100.0))
    placer.insert(A)
    plan = placer.insert(B)
    # A's compressed copy (40 B) fits beside B? 80 + 40 > 100: A must go, and dropping is all
    # that is left below the only tier.
    assert placer.placement("A") == DROPPED
    assert placer.placement("B") == Placement("none", "fast")
    assert [op.kind for op in plan.operations] == [OpKind.DROP, OpKind.PLACE]


def test_small_context_is_dropped_when_prefill_is_cheaper_than_any_load(two_tiers):
    cheap = profile("C", {"none": (500, 1.0)}, prefill_s=1.0)  # load from slow = 50 s
    placer = EvicPressPlacer(two_tiers, PlacerParams(alpha=100.0))
    assert not placer.insert(cheap)
    assert placer.placement("C") == DROPPED


def test_remove_frees_space_and_reinsert_replaces(two_tiers):
    placer = EvicPressPlacer(two_tiers, PlacerParams(alpha=100.0))
    placer.insert(A)
    placer.insert(B)
    placer.remove("B")
    with pytest.raises(KeyError):
        placer.placement("B")
    assert placer.used_bytes() == [0.0, 40.0]
    plan = placer.insert(A)  # re-profiled A: Algorithm 1 puts it back at its best
    assert placer.placement("A") == Placement("none", "fast")
    assert [(op.kind, op.source, op.target) for op in plan.operations] == [
        (OpKind.MOVE, Placement("x@0.5", "slow"), Placement("none", "fast"))
    ]


def test_pinned_context_never_moves(two_tiers):
    pinned_a = profile("A", {"none": (80, 1.0), "x@0.5": (40, 0.995)}, pinned=True)
    placer = EvicPressPlacer(two_tiers, PlacerParams(alpha=100.0))
    placer.insert(pinned_a)
    placer.insert(B)
    assert placer.placement("A") == Placement("none", "fast")
    assert placer.placement("B") == Placement("none", "slow")


def test_unknown_selection_lists_the_known_rules(two_tiers):
    with pytest.raises(ValueError, match="per_byte, absolute"):
        make_placer("evicpress", two_tiers, PlacerParams(selection="cheapest"))


def test_rebalance_table_fast_path_matches_profiles(two_tiers):
    table = UtilityTable.from_arrays(
        tiers=two_tiers,
        alpha=100.0,
        size_bytes=np.array([[80.0, 40.0], [80.0, 40.0]]),
        quality=np.array([[1.0, 0.995], [1.0, 0.5]]),
        restore_s=np.zeros((2, 2)),
        frequency=np.array([1.0, 2.0]),
        prefill_s=np.array([20.0, 20.0]),
        context_ids=["A", "B"],
        variant_names=[["none", "x@0.5"], ["none", "x@0.5"]],
    )
    placer = EvicPressPlacer(two_tiers, PlacerParams(alpha=100.0))
    placer.rebalance_table(table)
    assert placer.placement("A") == Placement("x@0.5", "slow")
    # After a bulk rebalance the heaps are built lazily on the next overflow.
    placer.insert(profile("D", {"none": (30, 1.0)}, frequency=10.0))
    assert placer.placement("D") == Placement("none", "fast")
    assert placer.used_bytes()[0] <= 100


def test_rebalance_after_refresh_uses_the_measured_tiers(two_tiers):
    """A tier measured slower than at start turns a stored context into a recompute at the
    next rebalance; a refresh that renames or resizes a tier is refused."""
    ctx = profile("C", {"none": (500, 1.0)}, prefill_s=30.0)  # slow tier: 50 s load
    placer = EvicPressPlacer([TierModel("slow", None, 100.0)], PlacerParams(alpha=100.0))
    placer.insert(ctx)
    assert placer.placement("C") == Placement("none", "slow")  # 5 s load beats 30 s prefill
    placer.refresh_tiers([TierModel("slow", None, 10.0)])
    placer.rebalance([ctx])
    assert placer.placement("C") == DROPPED
    with pytest.raises(ValueError, match="names and capacities"):
        placer.refresh_tiers([TierModel("slow", 1000, 10.0)])
