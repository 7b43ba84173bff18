"""Lookup holds (``kvtierd/sim/executing.py``, issue 30): a lookup that finds a context holds it
for ``hold_s``; the placer's drop or compression of it waits until the hold ends, meanwhile
lookups still find it where it was, and a load of a context the placer had dropped places it
again. Each checked on a replay that differs without the hold."""

from __future__ import annotations

from typing import cast

import pytest

from kvtierd.errors import InvalidArgumentError
from kvtierd.policies.base import Placer, make_placer
from kvtierd.sim.calibration import parse_calibration
from kvtierd.sim.executing import ExecutingPlacer
from kvtierd.sim.given import calibrated_prepare, calibrated_tiers, parse_workload
from kvtierd.sim.offers import DAEMON, OfferRule, Offers
from kvtierd.sim.replay import MISS, SimulationConfig, replay
from kvtierd.types import (
    DROPPED,
    ContextProfile,
    Operation,
    OpKind,
    Placement,
    Plan,
    TierModel,
    VariantProfile,
)
from tests.sim.test_offers import MODEL  # 32 bytes of KV per token: 1,000 tokens are 32,000 B

CALIBRATION = """\
prefill: {overhead_s: 0.1, seconds_per_token: 0.001}
tiers:
  - {name: cpu, overhead_s: 0.05, bandwidth_bytes_per_s: 320000}
quality: {int8: 0.99}
"""


def hits(
    asks: list[tuple[float, int]],
    hold_s: float,
    placer: str = "lru",
    capacity: int = 64_000,
    rule: OfferRule | None = None,
) -> list[bool]:
    """Three 1,000-token contexts (32,000 bytes; int8 18,000) and a tier of ``capacity`` (the
    default holds two originals); ``asks``: (time, context) per request. Per request, whether
    it found its context."""
    doc = {"model": MODEL, "tiers": [{"name": "cpu", "capacity_bytes": capacity}],
           "contexts": [{"tokens": 1000}] * 3,
           "requests": [{"index": k, "at_s": t, "context": c, "query_tokens": 10}
                        for k, (t, c) in enumerate(asks)]}  # fmt: skip
    given = parse_workload(doc, "w.json")
    cal = parse_calibration(CALIBRATION, "c.yaml", given.workload.model.kv_bytes_per_token)
    cfg = SimulationConfig(placer=placer, warmup_fraction=0.0, hold_s=hold_s,
                           tiers=calibrated_tiers(given, cal),
                           offers=rule or OfferRule())  # fmt: skip
    done = replay(cfg, calibrated_prepare(given, cal, ("int8",)))
    return [t != MISS for t in done.tier_hit.tolist()]


# c0 and c1 stored, c0 found at 10 s, c2's put at 20 s drops the least recently used: c1 (c0
# was used since); c1's put at 25 s then drops c0, found 10 s before, and c0 is asked at 30 s
ASKS = [(0.0, 0), (1.0, 1), (10.0, 0), (20.0, 2), (25.0, 1), (30.0, 0)]


def test_a_context_found_within_the_hold_is_not_dropped() -> None:
    assert hits(ASKS, hold_s=0.0) == [False, False, True, False, False, False]
    # the daemon defers the drop of c0 (held until 40 s): found at 30 s
    assert hits(ASKS, hold_s=30.0) == [False, False, True, False, False, True]


def test_the_drop_happens_once_the_hold_ends() -> None:
    late = [*ASKS[:-1], (45.0, 0)]  # c0's hold (10 s + 30 s) is over at 45 s
    assert hits(late, hold_s=30.0) == [False, False, True, False, False, False]


def placed(executing: ExecutingPlacer, context_id: str) -> bool:
    """Whether the placer has the context in a tier (whatever a hold keeps)."""
    try:
        return not executing.placement(context_id).dropped
    except KeyError:
        return False


def test_a_dropped_context_found_under_a_hold_is_placed_again() -> None:
    tier = TierModel("cpu", 64, 1e9, 0.0)
    profiles = {f"c{i}": ContextProfile(f"c{i}", (VariantProfile("none", 32, 1.0),), 1.0, 1.0)
                for i in range(3)}  # fmt: skip
    executing = ExecutingPlacer(make_placer("lru", (tier,)), Offers(OfferRule(), "lru"),
                                profiles.__getitem__, hold_s=30.0)  # fmt: skip
    for t, cid in ((0.0, "c0"), (1.0, "c1")):
        executing.insert(profiles[cid], t)
    assert executing.found("c0", 10.0) is not None  # held until 40 s
    executing.load(profiles["c0"], 10.0)
    executing.insert(profiles["c2"], 20.0)  # drops c1, the least recently used
    executing.insert(profiles["c1"], 25.0)  # drops c0: deferred
    assert not placed(executing, "c0")
    assert executing.found("c0", 30.0) == Placement("none", "cpu")
    executing.load(profiles["c0"], 30.0)  # the placer has it again, long after the hold
    assert placed(executing, "c0")
    assert executing.where("c0", 100.0) == Placement("none", "cpu")


def test_another_placer_is_held_the_same_way() -> None:
    # the fixed int8 placer, as the daemon offers it, in a tier that holds two int8 forms
    held = hits(ASKS, hold_s=30.0, placer="fixed:int8", capacity=40_000, rule=DAEMON)
    plain = hits(ASKS, hold_s=0.0, placer="fixed:int8", capacity=40_000, rule=DAEMON)
    assert (held[-1], plain[-1]) == (True, False)


class Compressing:
    """A placer that places ``c0`` whole, then compresses it to int8 on its next insert."""

    def __init__(self) -> None:
        self.at: Placement | None = None

    def placement(self, context_id: str) -> Placement:
        if self.at is None:
            raise KeyError(context_id)
        return self.at

    def insert(self, profile: ContextProfile) -> Plan:
        if self.at is None:
            self.at = Placement("none", "cpu")
            return Plan((Operation(OpKind.PLACE, "c0", DROPPED, self.at, "new"),))
        source, self.at = self.at, Placement("int8", "cpu")
        return Plan((Operation(OpKind.COMPRESS, "c0", source, self.at, "room"),))


def test_a_compression_of_a_held_context_waits_and_the_original_is_served() -> None:
    profile = ContextProfile("c0", (VariantProfile("none", 60, 1.0),
                                    VariantProfile("int8", 34, 0.99)), 1.0, 1.0)  # fmt: skip
    executing = ExecutingPlacer(cast(Placer, Compressing()), Offers(OfferRule(), "evicpress"),
                                lambda cid: profile, hold_s=30.0)  # fmt: skip
    executing.insert(profile, 0.0)
    assert executing.found("c0", 5.0) == Placement("none", "cpu")  # held until 35 s
    executing.insert(profile, 6.0)
    assert executing.where("c0", 20.0) == Placement("none", "cpu")
    assert executing.where("c0", 36.0) == Placement("int8", "cpu")


def test_hold_must_not_be_negative() -> None:
    with pytest.raises(InvalidArgumentError, match="hold_s"):
        SimulationConfig(hold_s=-1.0)
