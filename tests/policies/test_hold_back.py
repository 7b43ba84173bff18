"""``Placer.hold_back``: a tier kept partly free of contexts, for a store that takes more room
than the bytes the placer counts (the CPU arena's 4 KiB blocks, issue 42). The plan it returns
frees the room at once; every later insert and rebalance keeps it free."""

from __future__ import annotations

import pytest
from placer_helpers import profile, replay

from kvtierd.policies import make_placer
from kvtierd.types import ORIGINAL_VARIANT, ContextProfile, Placement, TierModel

KIB = 1024
TIERS = (TierModel("cpu", 64 * KIB, 8e9), TierModel("ssd", 1 << 30, 1e9))


def _one(cid: str, frequency: float = 1.0) -> ContextProfile:
    return profile(cid, {ORIGINAL_VARIANT: (4 * KIB, 1.0)}, frequency=frequency)


@pytest.mark.parametrize("name", ["lru", "evicpress"])
def test_hold_back_frees_the_room_and_keeps_it_free(name: str) -> None:
    placer = make_placer(name, TIERS)
    state: dict[str, Placement] = {}
    sizes = {f"c{i}": {ORIGINAL_VARIANT: 4 * KIB} for i in range(40)}
    for i in range(16):  # fills the CPU tier: 16 x 4 KiB
        replay(placer.insert(_one(f"c{i}", frequency=1.0 + i)), state, sizes, TIERS)
    assert [p.tier for p in state.values()].count("cpu") == 16

    plan = placer.hold_back("cpu", 24 * KIB)
    assert placer.held_back == [24 * KIB, 0]
    replay(plan, state, sizes, TIERS)
    in_cpu = [c for c, p in state.items() if p.tier == "cpu"]
    assert len(in_cpu) == 10  # 40 KiB: what 64 - 24 KiB holds
    assert all(p.tier == "ssd" for p in state.values() if p.tier != "cpu")

    for i in range(16, 40):  # later inserts keep the room free
        replay(placer.insert(_one(f"c{i}", frequency=1.0 + i)), state, sizes, TIERS)
        assert sum(p.tier == "cpu" for p in state.values()) <= 10

    placer.refresh_tiers(TIERS)  # the tiers as configured: what is held back stays held
    replay(placer.rebalance([_one(f"c{i}", 1.0 + i) for i in range(40)]), state, sizes, TIERS)
    assert sum(p.tier == "cpu" for p in state.values()) == 10

    assert not placer.hold_back("cpu", 32 * KIB, plan=False).operations  # recorded only
    replay(placer.rebalance([_one(f"c{i}", 1.0 + i) for i in range(40)]), state, sizes, TIERS)
    assert sum(p.tier == "cpu" for p in state.values()) == 8  # the rebalance honours it

    replay(placer.hold_back("cpu", 0), state, sizes, TIERS)  # released: fills again
    replay(placer.rebalance([_one(f"c{i}", 1.0 + i) for i in range(40)]), state, sizes, TIERS)
    assert sum(p.tier == "cpu" for p in state.values()) == 16


@pytest.mark.parametrize("name", ["lru", "evicpress"])
def test_hold_back_refuses_an_unknown_or_unbounded_tier(name: str) -> None:
    placer = make_placer(name, (TIERS[0], TierModel("remote", None, 1e8)))
    with pytest.raises(ValueError, match="unknown tier 'gpu'"):
        placer.hold_back("gpu", 1)
    with pytest.raises(ValueError, match="'remote' is unbounded"):
        placer.hold_back("remote", 1)
    with pytest.raises(ValueError, match="keep their names and capacities"):
        placer.refresh_tiers((TierModel("cpu", 32 * KIB, 8e9), TierModel("remote", None, 1e8)))
