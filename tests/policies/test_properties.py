"""Property tests (hypothesis): capacity, one placement per context, quality-0 compression."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from placer_helpers import replay

from kvtierd.policies.base import PlacerParams
from kvtierd.policies.evicpress import EvicPressPlacer, solve
from kvtierd.policies.greedy_state import Selection
from kvtierd.policies.knapsack import greedy_assign
from kvtierd.policies.model import UtilityTable
from kvtierd.types import ContextProfile, Placement, TierModel, VariantProfile


@st.composite
def instances(draw: st.DrawFn, quality_zero: bool = False):
    n_tiers = draw(st.integers(1, 3))
    caps = [draw(st.integers(50, 400)) for _ in range(n_tiers)]
    if draw(st.booleans()):
        caps[-1] = None  # an unbounded bottom tier (EvicPress's remote store)
    tiers = [TierModel(f"t{t}", caps[t], 100.0 / (5**t), 0.01 * t) for t in range(n_tiers)]
    profiles = []
    for i in range(draw(st.integers(1, 10))):
        size = draw(st.integers(10, 200))
        variants = [VariantProfile("none", size, 1.0)]
        for k in range(draw(st.integers(0, 3))):
            ratio = draw(st.sampled_from([0.1, 0.25, 0.5, 0.75]))
            q = 0.0 if quality_zero else draw(st.floats(0.0, 1.0))
            variants.append(VariantProfile(f"m{k}@{ratio}", max(1, int(size * ratio)), q))
        freq = draw(st.floats(0.1, 5.0))
        prefill = draw(st.floats(0.5, 9.0))
        profiles.append(ContextProfile(f"c{i}", tuple(variants), freq, prefill))
    return tiers, profiles


def _sizes(profiles):
    return {p.context_id: {v.variant: v.size_bytes for v in p.variants} for p in profiles}


@settings(max_examples=60, deadline=None)
@given(instances(), st.sampled_from(["per_byte", "absolute"]))
def test_inserts_never_overflow_and_plans_replay_exactly(inst, selection):
    tiers, profiles = inst
    placer = EvicPressPlacer(tiers, PlacerParams(alpha=10.0, selection=selection))
    state: dict[str, Placement] = {}
    sizes = _sizes(profiles)
    for p in profiles:
        replay(placer.insert(p), state, sizes, tiers)
        _check_consistent(placer, state, sizes, tiers)
    replay(placer.rebalance(profiles), state, sizes, tiers)
    _check_consistent(placer, state, sizes, tiers)


def _check_consistent(placer, state, sizes, tiers):
    """Exactly one placement per context, equal to the replayed one; tiers within capacity;
    the placer's count of contexts per tier right."""
    for cid, placement in state.items():
        assert placer.placement(cid) == placement
    used = placer.used_bytes()
    for t, tier in enumerate(tiers):
        expect = sum(sizes[c][p.variant] for c, p in state.items() if p.tier == tier.name)
        assert used[t] == pytest.approx(expect)
        assert tier.capacity_bytes is None or used[t] <= tier.capacity_bytes
        # the count per tier an insert reads instead of a pass over every context (issue 42)
        assert placer._state.held[t] == sum(1 for p in state.values() if p.tier == tier.name)


@settings(max_examples=60, deadline=None)
@given(instances())
def test_offline_solvers_are_feasible(inst):
    tiers, profiles = inst
    table = UtilityTable.from_profiles(profiles, tiers, alpha=10.0)
    for selection in Selection:
        assert solve(table, selection).feasible(table)
    assert greedy_assign(table, rounds=1, max_improve_rounds=0).feasible(table)


@settings(max_examples=60, deadline=None)
@given(instances(quality_zero=True))
def test_quality_zero_compression_equals_eviction_only(inst):
    """alpha (10) > every prefill_s: a quality-0 variant is worth less than dropping, anywhere."""
    tiers, profiles = inst
    originals = [
        ContextProfile(p.context_id, p.variants[:1], p.frequency, p.prefill_s) for p in profiles
    ]
    full = UtilityTable.from_profiles(profiles, tiers, alpha=10.0)
    evict = UtilityTable.from_profiles(originals, tiers, alpha=10.0)
    for selection in Selection:
        a = solve(full, selection)
        b = solve(evict, selection)
        assert a.total_utility(full) == pytest.approx(b.total_utility(evict))
        assert np.all(a.dropped | (a.variant == 0))
    inc_full = EvicPressPlacer(tiers, PlacerParams(alpha=10.0))
    inc_evict = EvicPressPlacer(tiers, PlacerParams(alpha=10.0))
    for p, o in zip(profiles, originals, strict=True):
        inc_full.insert(p)
        inc_evict.insert(o)
    assert inc_full.total_utility() == pytest.approx(inc_evict.total_utility())


@settings(max_examples=80, deadline=None)
@given(instances(), st.sampled_from(["per_byte", "absolute"]))
def test_the_one_slot_cheapest_operation_is_the_vectorised_one(inst, selection):
    """``GreedyState.best_op`` (plain floats, what the heaps ask for one slot at a time) gives
    exactly ``best_ops``'s score and target for every placed context, at every insert."""
    tiers, profiles = inst
    placer = EvicPressPlacer(tiers, PlacerParams(alpha=10.0, selection=selection))
    for p in profiles:
        placer.insert(p)
        state = placer._state
        for slot in np.flatnonzero(state.slots.alive & (state.slots.tier >= 0)).tolist():
            t = int(state.slots.tier[slot])
            score, v, tt = state.best_ops(np.array([slot]), t)
            one = state.best_op(slot, t)
            assert one[0] == score[0] or (np.isnan(one[0]) and np.isnan(score[0]))
            if np.isfinite(score[0]):
                assert one[1:] == (int(v[0]), int(tt[0]))
