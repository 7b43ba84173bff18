"""Trace-driven simulator of placers (issue 4): workloads, calibrated profiles, sweeps, plots.

Entry points: :func:`run_simulation` (one placer), :func:`run_sweep` + :func:`headline` +
:func:`qps_comparison` (the headline table), :func:`plot_frontier` / :func:`plot_qps` (PNGs),
and ``python -m kvtierd.policies.simulate``.
"""

from kvtierd.policies.simulate.engine import (
    PAPER_TIERS,
    SimulationConfig,
    SimulationResult,
    run_simulation,
)
from kvtierd.policies.simulate.frontier import headline, qps_comparison, run_sweep
from kvtierd.policies.simulate.plots import plot_frontier, plot_qps

__all__ = [
    "PAPER_TIERS",
    "SimulationConfig",
    "SimulationResult",
    "headline",
    "plot_frontier",
    "plot_qps",
    "qps_comparison",
    "run_simulation",
    "run_sweep",
]
