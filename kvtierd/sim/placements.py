"""Where a placer leaves every context at the end of a simulated workload (paper Fig. 11).

``final_placements`` runs the simulator's replay (:func:`kvtierd.sim.replay.replay`) and
reads every context's final placement; :func:`kvtierd.sim.plots.plot_placements` draws tier
occupancy and the mix of compression methods and ratios per tier.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from kvtierd.sim.replay import SimulationConfig, prepare, replay
from kvtierd.variants import parse_variant

DROPPED = "dropped"


@dataclass(frozen=True, slots=True)
class Group:
    """Contexts of one (tier, method, ratio): ``ratio`` is kept size / original (1.0: all)."""

    tier: str
    method: str
    ratio: float
    contexts: int
    bytes: int


@dataclass(frozen=True, slots=True)
class PlacementSummary:
    placer: str
    alpha: float
    capacity: dict[str, int | None]
    groups: list[Group] = field(default_factory=list)

    def used(self, tier: str) -> int:
        return sum(g.bytes for g in self.groups if g.tier == tier)

    def as_dict(self) -> dict[str, Any]:
        tiers = [
            {
                "tier": t,
                "capacity_bytes": c,
                "used_bytes": self.used(t),
                "contexts": sum(g.contexts for g in self.groups if g.tier == t),
            }
            for t, c in self.capacity.items()
        ]
        groups = [
            {
                "tier": g.tier,
                "method": g.method,
                "ratio": g.ratio,
                "contexts": g.contexts,
                "bytes": g.bytes,
            }
            for g in self.groups
        ]
        return {"placer": self.placer, "alpha": self.alpha, "tiers": tiers, "groups": groups}


def split_variant(name: str) -> tuple[str, float]:
    """``knorm@0.5`` -> (knorm, 0.5); ``int8`` -> (int8, 1.0); ``knorm@0.5+int8`` ->
    (knorm+int8, 0.5); ``none`` -> (none, 1.0)."""
    v = parse_variant(name)
    return v.method_name, v.ratio


def final_placements(cfg: SimulationConfig) -> PlacementSummary:
    """Where ``cfg.placer`` leaves every context the workload asked for, grouped by tier,
    method and kept ratio."""
    prep = prepare(cfg)
    placer = replay(cfg, prep).placer
    asked = dict.fromkeys(int(c) for c in prep.workload.request_context)
    counts: dict[tuple[str, str, float], list[int]] = {}
    for c in asked:
        profile = prep.profiles[c]
        where = placer.placement(profile.context_id)
        method, ratio = split_variant(where.variant)
        size = 0 if where.tier is None else profile.variant(where.variant).size_bytes
        acc = counts.setdefault((where.tier or DROPPED, method, ratio), [0, 0])
        acc[0] += 1
        acc[1] += size
    groups = [Group(t, m, r, n, b) for (t, m, r), (n, b) in sorted(counts.items())]
    capacity = {t.name: t.capacity_bytes for t in cfg.tiers}
    return PlacementSummary(cfg.placer, cfg.alpha, capacity, groups)
