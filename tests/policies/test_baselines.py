"""Baselines and the registry: exact placements on tiny instances, one test per placer."""

from __future__ import annotations

import pytest
from placer_helpers import profile, replay

from kvtierd.policies import PLACERS, make_placer, placer_class
from kvtierd.policies.base import Placer
from kvtierd.types import DROPPED, Placement

P = {c: profile(c, {"none": (60, 1.0), "k@0.5": (30, 0.8)}) for c in "abc"}
SIZES = {c: {"none": 60, "k@0.5": 30} for c in "abc"}


def _run(spec, tiers, accesses=()):
    placer = make_placer(spec, tiers)
    state: dict[str, Placement] = {}
    for cid in "abc":
        replay(placer.insert(P[cid]), state, SIZES, tiers)
    for cid in accesses:
        replay(placer.access(cid, 0.0), state, SIZES, tiers)
    return placer, state


def test_lru_moves_the_least_recent_down(two_tiers):
    placer, _ = _run("lru", two_tiers)
    assert [placer.placement(c).tier for c in "abc"] == ["slow", "slow", "fast"]


def test_lru_promotes_no_higher_than_the_fastest_tier_it_is_given(two_tiers):
    """The engine names ``fastest`` when a quota is full above it: no promotion, no move of
    another context to make room; the hit still counts (the context is the tier's newest)."""
    placer, state = _run("lru", two_tiers)
    assert not placer.access("a", 0.0, fastest="slow")
    assert state == {"a": Placement("none", "slow"), "b": Placement("none", "slow"),
                     "c": Placement("none", "fast")}  # fmt: skip
    assert list(placer._victims(1)) == ["b", "a"]
    replay(placer.access("a", 0.0), state, SIZES, two_tiers)  # any tier: promoted
    assert (state["a"].tier, state["c"].tier) == ("fast", "slow")
    with pytest.raises(ValueError, match="unknown tier 'tape'; tiers: fast, slow"):
        placer.access("b", 0.0, fastest="tape")


def test_fixed_stores_every_context_compressed(two_tiers):
    placer, _ = _run("fixed:k@0.5", two_tiers)
    # 3 x 30 B fit in the 100 B fast tier: compression alone avoids every eviction.
    assert [placer.placement(c) for c in "abc"] == [Placement("k@0.5", "fast")] * 3


def test_lfu_keeps_the_most_used(two_tiers):
    placer = make_placer("lfu", two_tiers)
    state: dict[str, Placement] = {}
    replay(placer.insert(P["a"]), state, SIZES, two_tiers)
    for _ in range(3):
        replay(placer.access("a", 0.0), state, SIZES, two_tiers)
    replay(placer.insert(P["b"]), state, SIZES, two_tiers)
    # b is newest, but a has 4 uses and b 1: LFU keeps a and pushes b... b is protected on its
    # own insert, so a moves; on b's next miss-free access LFU evicts b (fewer hits).
    replay(placer.access("a", 0.0), state, SIZES, two_tiers)
    assert placer.placement("a") == Placement("none", "fast")
    assert placer.placement("b") == Placement("none", "slow")


def test_prefill_caches_nothing(two_tiers):
    placer, state = _run("prefill", two_tiers)
    assert state == {}
    assert all(placer.placement(c) == DROPPED for c in "abc")
    with pytest.raises(KeyError):
        placer.placement("zzz")


@pytest.mark.parametrize("name", PLACERS.names())
def test_every_registered_placer_keeps_capacity(name, two_tiers):
    spec = "fixed:k@0.5" if name == "fixed" else name
    placer, state = _run(spec, two_tiers, accesses="abca")
    for cid in "abc":
        assert placer.placement(cid) == state.get(cid, DROPPED)


def test_registry_rejects_duplicates_and_lists_unknown_names():
    with pytest.raises(ValueError, match="placer 'lru' is built in"):
        PLACERS.register(type("Dup", (PLACERS.get("lru"),), {"name": "lru"}))
    with pytest.raises(ValueError, match="evicpress, fixed, lfu, lru, prefill"):
        placer_class("nope")
    with pytest.raises(TypeError):
        PLACERS.register(int)  # type: ignore[arg-type]
    assert issubclass(placer_class("fixed:knorm@0.5"), Placer)


def test_fixed_without_a_variant_is_an_error(two_tiers):
    with pytest.raises(ValueError, match="fixed:<variant>"):
        make_placer("fixed", two_tiers)


def test_every_placer_rebalances_nothing() -> None:
    # A daemon with no contexts applies a policy by rebalancing an empty set.
    from kvtierd.policies import PLACERS
    from kvtierd.policies.base import PlacerParams
    from kvtierd.types import TierModel

    tiers = [TierModel("cpu", 1 << 20, 1e10), TierModel("ssd", None, 1e9)]
    for name in PLACERS.names():
        params = PlacerParams(fixed_variant="int8") if name == "fixed" else None
        assert not PLACERS.get(name)(tiers, params).rebalance([]).operations, name
