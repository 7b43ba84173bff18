"""``order_changes`` orders a placer's changes so that no prefix overflows a tier, and ends
when the placer's final state itself overflows one (pinned contexts can make it so)."""

from __future__ import annotations

from kvtierd.policies.plan_order import Change, order_changes
from kvtierd.types import DROPPED, OpKind, Placement, TierModel

TIERS = [TierModel("cpu", 100, 1e10, 0.0), TierModel("ssd", 300, 1e9, 0.0)]


def test_spills_run_before_the_placement_they_make_room_for() -> None:
    new = Change("new", DROPPED, Placement("none", "ssd"), 0, 200)
    old = Change("old", Placement("none", "ssd"), DROPPED, 200, 0)
    plan = order_changes([new, old], TIERS, {"ssd": 200})
    assert [(op.context_id, op.kind) for op in plan.operations] == [
        ("old", OpKind.DROP),
        ("new", OpKind.PLACE),
    ]


def test_a_final_state_over_capacity_ends() -> None:
    # 250 pinned bytes stay on ssd and the placer places 200 more: no order fits, and
    # nothing is left to drop (this looped forever, hanging the daemon's event loop).
    new = Change("new", DROPPED, Placement("none", "ssd"), 0, 200)
    plan = order_changes([new], TIERS, {"ssd": 450})
    assert [(op.context_id, op.kind) for op in plan.operations] == [("new", OpKind.PLACE)]
