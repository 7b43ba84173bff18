"""Where a placer leaves every context at the end of a simulated workload (paper Fig. 11).

``final_placements`` replays the workload's requests through a fresh placer exactly as
``run_simulation`` does (placement known: an access; unknown: an insert) and reads every
context's final placement; ``plot_placements`` draws tier occupancy and the mix of compression
methods and ratios per tier.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from kvtierd.policies import PlacerParams, make_placer
from kvtierd.policies.simulate import SimulationConfig
from kvtierd.policies.simulate.engine import prepare

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
    drop, _, quant = name.partition("+")
    method, _, ratio = drop.partition("@")
    return (f"{method}+{quant}" if quant else method), float(ratio) if ratio else 1.0


def final_placements(cfg: SimulationConfig) -> PlacementSummary:
    prep = prepare(cfg)
    params = PlacerParams(alpha=cfg.alpha, selection=cfg.selection)
    placer = make_placer(cfg.placer, cfg.tiers, params)
    wl = prep.workload
    seen: dict[int, None] = {}
    for k in range(wl.arrival_s.size):
        c = int(wl.request_context[k])
        cid = prep.profiles[c].context_id
        try:
            placer.placement(cid)
        except KeyError:
            placer.insert(prep.profiles[c])
            seen[c] = None
            continue
        placer.access(cid, float(wl.arrival_s[k]))
    counts: dict[tuple[str, str, float], list[int]] = {}
    for c in seen:
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


def plot_placements(runs: list[PlacementSummary], path: str | Path) -> Path:
    """Left: bytes per tier for each run (bounded tiers also as % of capacity). Right, one
    panel per tier of the first run: contexts by kept ratio, stacked by method (Fig. 11)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.patches import Rectangle

    main = runs[0]
    tiers = [t for t in main.capacity if any(g.tier == t for g in main.groups)] or [
        next(iter(main.capacity))
    ]
    fig, axes = plt.subplots(1, 1 + len(tiers), figsize=(4.2 * (1 + len(tiers)), 4.2))
    _occupancy(axes[0], runs)
    methods = sorted({g.method for g in main.groups if g.tier != DROPPED})
    colors = {m: plt.get_cmap("tab10")(i % 10) for i, m in enumerate(methods)}
    for ax, tier in zip(axes[1:], tiers, strict=True):
        _mix(ax, main, tier, colors)
    handles = [Rectangle((0, 0), 1, 1, color=colors[m]) for m in methods]
    fig.legend(handles, methods, loc="lower center", ncol=min(len(methods), 6), fontsize=8)
    fig.suptitle(f"placements of {main.placer} (alpha {main.alpha:g})")
    fig.tight_layout(rect=(0, 0.08, 1, 0.95))
    out = Path(path)
    fig.savefig(out, dpi=120)
    plt.close(fig)
    return out


def _occupancy(ax: Any, runs: list[PlacementSummary]) -> None:
    names = list(runs[0].capacity)
    width = 0.8 / len(runs)
    for i, run in enumerate(runs):
        xs = [j + i * width for j in range(len(names))]
        gb = [run.used(t) / 1e9 for t in names]
        label = run.placer if run.placer != "evicpress" else f"evicpress a={run.alpha:g}"
        ax.bar(xs, gb, width, label=label)
    for j, t in enumerate(names):
        cap = runs[0].capacity[t]
        if cap:
            ax.hlines(cap / 1e9, j - width / 2, j + 0.8 - width / 2, colors="k", linestyles=":")
    ax.set_xticks([j + 0.4 - width / 2 for j in range(len(names))], names)
    ax.set_ylabel("GB stored (dotted: capacity)")
    ax.set_title("tier occupancy")
    ax.legend(fontsize=7)


def _mix(ax: Any, run: PlacementSummary, tier: str, colors: dict[str, Any]) -> None:
    groups = [g for g in run.groups if g.tier == tier]
    ratios = sorted({g.ratio for g in groups}, reverse=True)
    bottom = [0.0] * len(ratios)
    total = sum(g.contexts for g in groups) or 1
    for method, color in colors.items():
        share = [
            sum(g.contexts for g in groups if g.method == method and g.ratio == r) / total
            for r in ratios
        ]
        ax.bar(range(len(ratios)), share, bottom=bottom, color=color)
        bottom = [b + s for b, s in zip(bottom, share, strict=True)]
    ax.set_xticks(range(len(ratios)), [f"{r:g}" for r in ratios])
    ax.set_xlabel("kept tokens (ratio; quantized keep all)")
    ax.set_ylabel("share of contexts in tier")
    ax.set_title(f"{tier}: {total if groups else 0} contexts")
