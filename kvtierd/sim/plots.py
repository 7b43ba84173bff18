"""PNG plots: the TTFT-quality frontier (Fig. 7), TTFT vs QPS (Fig. 8), placements (Fig. 11).

matplotlib (the ``sim`` extra) is imported inside each function (Agg backend), so the package
imports without it.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np

from kvtierd.sim.frontier import Sweep, frontier
from kvtierd.sim.placements import DROPPED, PlacementSummary
from kvtierd.sim.replay import SimulationResult
from kvtierd.sim.timing import loaded_ttft_s


def have_matplotlib() -> bool:
    """Whether the ``sim`` extra's matplotlib can be imported (checked before a sweep, not
    after it)."""
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        return False
    return True


def _pyplot() -> Any:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def _save(plt: Any, fig: Any, ax: Any, path: str | Path) -> Path:
    """Log TTFT axis, grid and legend (both figures share them); write the PNG and close."""
    ax.set_yscale("log")
    ax.grid(True, alpha=0.3)
    ax.legend(fontsize=8)
    out = Path(path)
    fig.tight_layout()
    fig.savefig(out, dpi=120)
    plt.close(fig)
    return out


def plot_frontier(sweep: Sweep, path: str | Path) -> Path:
    """Mean TTFT (s) against mean quality for EvicPress (alpha sweep; with oracle frequencies
    dashed, the upper bound) and every baseline."""
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(6.4, 4.4))
    qs, ts = frontier(sweep.evicpress)
    ax.plot(qs, ts, "o-", color="tab:red", label="EvicPress (alpha sweep)", zorder=3)
    if sweep.oracle:
        qs, ts = frontier(sweep.oracle)
        ax.plot(qs, ts, ".:", color="tab:red", alpha=0.6, label="EvicPress, oracle frequencies")
    families: dict[str, list[SimulationResult]] = {}
    for r in sweep.baselines:
        families.setdefault(r.placer.split("@")[0], []).append(r)
    for name, unsorted in families.items():
        runs = sorted(unsorted, key=lambda r: r.quality_mean)
        style = "s--" if len(runs) > 1 else "D"
        ax.plot([r.quality_mean for r in runs], [r.ttft_mean_s for r in runs], style, label=name)
    ax.set_xlabel("mean quality (1.0 = uncompressed)")
    ax.set_ylabel("mean TTFT (s, unloaded)")
    return _save(plt, fig, ax, path)


def plot_qps(runs: dict[str, SimulationResult], path: str | Path, max_qps: float) -> Path:
    """Mean loaded TTFT (s) against request rate for the given named runs."""
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(6.4, 4.4))
    grid = np.linspace(max_qps / 40, max_qps, 40)
    for name, r in runs.items():
        ax.plot(grid, [loaded_ttft_s(r.arrival_s, r.service_s, q) for q in grid], label=name)
    ax.set_xlabel("requests per second")
    ax.set_ylabel("mean TTFT (s, FIFO queue on one GPU)")
    return _save(plt, fig, ax, path)


def plot_placements(runs: list[PlacementSummary], path: str | Path) -> Path:
    """Left: bytes per tier for each run (bounded tiers also as % of capacity). Right, one
    panel per tier of the first run: contexts by kept ratio, stacked by method (Fig. 11)."""
    from matplotlib.patches import Rectangle

    plt = _pyplot()

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
