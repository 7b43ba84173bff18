"""The placement simulator: workloads, calibrated profiles, replays, sweeps, plots.

It replays a workload's requests through the placers of :mod:`kvtierd.policies` in this
process and models each request's TTFT and quality; the daemon never imports it (its layer
sits above the daemon's, pyproject.toml). Entry points: :func:`run_simulation` (one placer),
:func:`run_sweep` + :func:`headline` + :func:`qps_comparison` (the headline table),
:func:`kvtierd.sim.plots.plot_frontier` and friends (PNGs, the ``sim`` extra: matplotlib), and
the command line ``kvtierd sim`` (:mod:`kvtierd.sim.cli`, docs/simulator.md).
"""

from kvtierd.sim.frontier import headline, qps_comparison, run_sweep
from kvtierd.sim.replay import (
    PAPER_TIERS,
    SimulationConfig,
    SimulationResult,
    run_simulation,
)

__all__ = [
    "PAPER_TIERS",
    "SimulationConfig",
    "SimulationResult",
    "headline",
    "qps_comparison",
    "run_simulation",
    "run_sweep",
]
