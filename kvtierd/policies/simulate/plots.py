"""PNG plots of a sweep: the TTFT-quality frontier (Fig. 7) and TTFT vs QPS (Fig. 8).

matplotlib is imported inside each function (Agg backend) so the package imports without it.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np

from kvtierd.policies.simulate.engine import SimulationResult, loaded_ttft_s
from kvtierd.policies.simulate.frontier import Sweep, frontier


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
    """Mean TTFT (s) against mean quality for EvicPress (alpha sweep) and every baseline."""
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(6.4, 4.4))
    qs, ts = frontier(sweep.evicpress)
    ax.plot(qs, ts, "o-", color="tab:red", label="EvicPress (alpha sweep)", zorder=3)
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
        ax.plot(grid, [loaded_ttft_s(r, q) for q in grid], label=name)
    ax.set_xlabel("requests per second")
    ax.set_ylabel("mean TTFT (s, FIFO queue on one GPU)")
    return _save(plt, fig, ax, path)
