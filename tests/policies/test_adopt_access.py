"""``adopt`` (placements found at daemon start), ``access`` (hit counting) and the lazy
rebalance plan of the EvicPress placer. Instance A/B as in ``test_evicpress.py``."""

from __future__ import annotations

import pytest
from placer_helpers import profile, replay

from kvtierd.policies.base import PlacerParams
from kvtierd.policies.baselines import PrefillPlacer
from kvtierd.policies.evicpress import EvicPressPlacer
from kvtierd.types import DROPPED, OpKind, Placement

A = profile("A", {"none": (80, 1.0), "x@0.5": (40, 0.995)})
B = profile("B", {"none": (80, 1.0), "x@0.5": (40, 0.5)}, frequency=2.0)
SIZES = {"A": {"none": 80, "x@0.5": 40}, "B": {"none": 80, "x@0.5": 40}}


def test_adopt_keeps_a_placement_that_fits(two_tiers):
    placer = EvicPressPlacer(two_tiers, PlacerParams(alpha=100.0))
    # Not where Algorithm 1 would put it (it prefers the fast tier), but it is kept.
    assert not placer.adopt(A, Placement("none", "slow"))
    assert placer.placement("A") == Placement("none", "slow")
    assert placer.used_bytes() == [0.0, 80.0]


def test_adopt_resolves_only_the_overflow(two_tiers):
    placer = EvicPressPlacer(two_tiers, PlacerParams(alpha=100.0))
    state = {"A": Placement("none", "fast"), "B": Placement("none", "fast")}
    assert not placer.adopt(A, state["A"])
    plan = placer.adopt(B, state["B"])  # 160 bytes in a 100-byte tier
    # Per byte, A's compress (0.1/40) then A's move down (3.6/40) are cheapest; B stays.
    assert [(op.kind, op.context_id, op.source, op.target) for op in plan.operations] == [
        (OpKind.MOVE, "A", Placement("none", "fast"), Placement("x@0.5", "slow"))
    ]
    replay(plan, state, SIZES, two_tiers)
    assert state == {"A": placer.placement("A"), "B": Placement("none", "fast")}


def test_a_placer_that_cannot_honour_a_placement_places_afresh(two_tiers):
    placer = PrefillPlacer(two_tiers)  # no adopt of its own: every context is dropped
    assert not placer.adopt(A, Placement("none", "fast"))
    assert placer.placement("A") == DROPPED


def test_adopt_dropped_and_bad_input(two_tiers):
    placer = EvicPressPlacer(two_tiers, PlacerParams(alpha=100.0))
    assert not placer.adopt(A, DROPPED)
    assert placer.placement("A") == DROPPED
    with pytest.raises(ValueError, match="unknown tier"):
        placer.adopt(A, Placement("none", "tape"))
    with pytest.raises(ValueError, match="no variant"):
        placer.adopt(A, Placement("y@0.1", "fast"))
    with pytest.raises(KeyError):
        placer.placement("A")


def test_access_counts_hits_and_promotes_on_rebalance(two_tiers):
    placer = EvicPressPlacer(two_tiers, PlacerParams(alpha=100.0))
    c = profile("C", {"none": (80, 1.0)})
    d = profile("D", {"none": (80, 1.0)}, frequency=1.5)
    placer.insert(d)
    placer.insert(c)
    assert placer.placement("D") == Placement("none", "fast")
    assert placer.placement("C") == Placement("none", "slow")
    for _ in range(3):
        assert not placer.access("C", 0.0)
    assert placer.frequency("C") == pytest.approx(4.0)
    assert not placer.access("unknown", 0.0)
    # The profiles still say 1 and 1.5; the counted hits make C the hotter one.
    state = {"C": Placement("none", "slow"), "D": Placement("none", "fast")}
    plan = placer.rebalance([c, d])
    assert placer.placement("C") == Placement("none", "fast")
    assert placer.placement("D") == Placement("none", "slow")
    replay(plan, state, {"C": {"none": 80}, "D": {"none": 80}}, two_tiers)
    assert state == {"C": Placement("none", "fast"), "D": Placement("none", "slow")}


def test_access_renews_the_heap_entry(two_tiers):
    """A hot context is no longer the cheapest to move down when a newcomer arrives."""
    placer = EvicPressPlacer(two_tiers, PlacerParams(alpha=100.0))
    placer.insert(profile("C", {"none": (80, 1.0)}))
    for _ in range(5):
        placer.access("C", 0.0)
    placer.insert(profile("D", {"none": (80, 1.0)}, frequency=2.0))
    assert placer.placement("C") == Placement("none", "fast")
    assert placer.placement("D") == Placement("none", "slow")


def test_rebalance_placements_are_right_before_the_plan_is_read(two_tiers):
    placer = EvicPressPlacer(two_tiers, PlacerParams(alpha=100.0))
    plan = placer.rebalance([A, B])
    assert placer.placement("A") == Placement("x@0.5", "slow")
    assert placer.placement("B") == Placement("none", "fast")
    placer.insert(profile("E", {"none": (10, 1.0)}))  # later changes do not leak into the plan
    assert [(op.kind, op.context_id) for op in plan.operations] == [
        (OpKind.PLACE, "A"),
        (OpKind.PLACE, "B"),
    ]
    again = placer.rebalance([A, B])
    # E is not in this rebalance: it is dropped; A and B stay where they are.
    assert [(op.kind, op.context_id) for op in again.operations] == [(OpKind.DROP, "E")]
    assert placer.placement("A") == Placement("x@0.5", "slow")
