"""``adopt`` (placements found at daemon start), ``access`` (hit counting) and the lazy
rebalance plan of the EvicPress placer. Instance A/B as in ``test_evicpress.py``."""

from __future__ import annotations

import dataclasses

import pytest
from placer_helpers import profile, replay

from kvtierd.policies import placer_class
from kvtierd.policies.base import PlacerParams
from kvtierd.policies.baselines import LfuPlacer, PrefillPlacer
from kvtierd.policies.evicpress import EvicPressPlacer
from kvtierd.policies.lru import LruPlacer
from kvtierd.types import DROPPED, OpKind, Placement, TierModel

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


def test_room_cost_prices_room_by_the_next_operation(two_tiers):
    """What write advice subtracts for a new context's room (``EvicPressPlacer.room_cost``):
    nothing while the tier has the room, else the per-byte score of the operation Algorithm 1
    would apply next there times the bytes short; hits renew the price."""
    placer = EvicPressPlacer(two_tiers, PlacerParams(alpha=100.0))
    assert not placer.adopt(A, Placement("none", "fast"))  # 80 of 100 bytes
    assert placer.room_cost("fast", 20) == 0.0
    assert placer.room_cost("slow", 10**9) == 0.0  # unbounded
    # A's compress in place: utility 99.2 -> 99.1 for 40 bytes freed; 10 bytes short
    assert placer.room_cost("fast", 30) == pytest.approx(0.1 / 40 * 10)
    placer.access("A", 1.0)  # frequency 2: its entry is renewed, the old one goes stale
    assert placer.room_cost("fast", 30) == pytest.approx(2 * 0.1 / 40 * 10)
    assert placer.placement("A") == Placement("none", "fast")  # pricing moves nothing
    assert placer.used_bytes() == [80.0, 0.0]


def test_room_cost_is_infinite_where_nothing_can_make_room(two_tiers):
    placer = EvicPressPlacer(two_tiers, PlacerParams(alpha=100.0))
    pinned = profile("P", {"none": (80, 1.0), "x@0.5": (40, 0.995)}, pinned=True)
    assert not placer.adopt(pinned, Placement("none", "fast"))
    assert placer.room_cost("fast", 30) == float("inf")
    with pytest.raises(ValueError, match="unknown tier"):
        placer.room_cost("nvme", 1)


def test_an_adopt_that_overflows_a_slow_tier_may_compress_in_a_fast_one():
    """Algorithm 1 resolves an overflow inside the overflowing tier: adopting C in a full slow
    tier dropped B there while A, read once, stayed whole in the fast tier. The adopt is
    repaired as an insert is: A compressed, B moved up, nothing dropped."""
    tiers = [TierModel("fast", 100, 100.0), TierModel("slow", 100, 10.0)]
    a = profile("A", {"none": (80, 1.0), "x": (40, 0.995)})
    b = profile("B", {"none": (120, 1.0), "x": (60, 0.995)}, frequency=3.0)
    c = profile("C", {"none": (120, 1.0), "x": (60, 0.995)}, frequency=3.0)
    placer = EvicPressPlacer(tiers, PlacerParams(alpha=100.0))
    state = {"A": Placement("none", "fast"), "B": Placement("x", "slow")}
    assert not placer.adopt(a, state["A"])
    assert not placer.adopt(b, state["B"])
    plan = placer.adopt(c, Placement("x", "slow"))  # the slow tier holds 120 of 100 bytes
    after = {k: placer.placement(k) for k in "ABC"}
    assert after == {
        "A": Placement("x", "fast"),
        "B": Placement("x", "fast"),
        "C": Placement("x", "slow"),
    }
    assert {op.context_id: op.target for op in plan.operations} == {
        "A": after["A"],
        "B": after["B"],
    }
    assert placer.used_bytes() == [100.0, 60.0]


def test_lru_adopt_reads_no_eviction_order_while_a_tier_has_room():
    """A restart adopts every context found; a tier with room is not asked for its eviction
    order (a copy of a 20,000-context recency list per adopt made a restart quadratic)."""
    tiers = [TierModel("fast", 1_000, 100.0), TierModel("slow", None, 10.0)]
    placer = LruPlacer(tiers)
    asked: list[int] = []
    victims = placer._victims
    placer._victims = lambda level: asked.append(level) or victims(level)  # type: ignore[method-assign]
    for i in range(10):
        assert not placer.adopt(profile(f"c{i}", {"none": (100, 1.0)}), Placement("none", "fast"))
    assert asked == []
    plan = placer.adopt(profile("c10", {"none": (100, 1.0)}), Placement("none", "fast"))
    assert asked == [0]
    assert [(op.context_id, op.target) for op in plan.operations] == [
        ("c0", Placement("none", "slow"))
    ]


@pytest.mark.parametrize("placer_class", [LruPlacer, LfuPlacer])
def test_a_spill_passes_over_more_pinned_contexts_than_one_batch(placer_class):
    """Eviction order is read a batch at a time; 100 pinned contexts at the front of a full
    tier (more than one batch) are passed over, the least recent unpinned ones move down, in
    order."""
    tiers = [TierModel("fast", 10_000, 100.0), TierModel("slow", None, 10.0)]
    placer = placer_class(tiers)
    for i in range(100):
        placer.insert(profile(f"p{i}", {"none": (50, 1.0)}, pinned=True))
    for i in range(100):
        placer.insert(profile(f"u{i}", {"none": (50, 1.0)}))
    plan = placer.insert(profile("big", {"none": (120, 1.0)}))
    moved = [op.context_id for op in plan.operations if op.kind == OpKind.MOVE]
    assert moved == ["u0", "u1", "u2"]
    assert placer.placement("p0") == Placement("none", "fast")
    assert placer.placement("big") == Placement("none", "fast")


@pytest.mark.parametrize("placer_name", ["evicpress", "lru"])
def test_a_rebalance_places_no_context_above_the_fastest_tier_named_for_it(two_tiers, placer_name):
    """The engine names a context's fastest tier where its quota is full above it; without
    that the rebalance puts B (the more used) in the fast tier, with it B stays below and A
    takes the fast tier."""
    placer = placer_class(placer_name)(two_tiers, PlacerParams(alpha=100.0))
    a = profile("A", {"none": (80, 1.0)}, frequency=1.0)
    b = profile("B", {"none": (80, 1.0)}, frequency=5.0)
    a = dataclasses.replace(a, last_access_s=1.0)
    b = dataclasses.replace(b, last_access_s=2.0)
    placer.rebalance([a, b])
    assert placer.placement("B") == Placement("none", "fast")
    placer.rebalance([a, b], {"B": "slow"})
    assert placer.placement("B") == Placement("none", "slow")
    assert placer.placement("A") == Placement("none", "fast")


def test_lru_keeps_each_context_only_in_its_tiers_recency_list():
    """Issue 42: at 1,000,000 contexts adopted at start, a dict of each context's tier beside
    the recency lists was 38 bytes a context; the tier is looked up in those lists instead.
    10,000 contexts cost the placer about what one ordered dict of them costs."""
    import tracemalloc
    from collections import OrderedDict

    tiers = [TierModel("fast", 1 << 20, 1e10), TierModel("slow", None, 1e9)]
    found = [profile(f"c{i}", {"none": (64, 1.0)}) for i in range(10_000)]
    placer = LruPlacer(tiers)
    tracemalloc.start()
    try:
        before = tracemalloc.get_traced_memory()[0]
        for p in found:
            assert not placer.adopt(p, Placement("none", "slow"))
        placer_bytes = tracemalloc.get_traced_memory()[0] - before
        alone = OrderedDict((p.context_id, 64) for p in found)
        list_bytes = tracemalloc.get_traced_memory()[0] - before - placer_bytes
    finally:
        tracemalloc.stop()
    assert len(alone) == len(found) and placer_bytes < 1.15 * list_bytes
    assert placer.placement("c7") == Placement("none", "slow")
    assert placer.access("c7", 1.0).operations[0].target == Placement("none", "fast")
    assert placer.placement("c7") == Placement("none", "fast")
    placer.remove("c7")
    with pytest.raises(KeyError):
        placer.placement("c7")
