"""Sweeps, TTFT-quality frontiers and the headline table (EvicPress Fig. 7 and Fig. 8).

* EvicPress is swept over ``alpha`` twice: with frequencies learned online (the headline) and
  with each context's true frequency (``evicpress (oracle)``, an upper bound no deployment
  has); each ``fixed:<method>`` baseline over ratios; ``lru``, ``lfu`` and ``prefill`` are
  single points at quality 1.0.
* The EvicPress frontier is the lower envelope of (quality, mean TTFT), linearly interpolated
  between its points (mixing two configurations in proportion reaches every point between).
* **TTFT reduction at equal quality** vs a baseline point ``(q, T)`` = ``T / T_evicpress(q)``;
  vs the quality-1.0 baselines it is read at ``q = 0.97`` ("within 3% quality drop", §6.2).
* **QPS at equal TTFT** (Fig. 8): among configurations with quality >= ``quality_target``
  (paper: 0.8), the highest request rate each family sustains with mean loaded TTFT <= the
  target; the target defaults to twice the best baseline's unloaded mean TTFT.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace

import numpy as np

from kvtierd.policies.model import FloatArray
from kvtierd.sim.replay import SimulationConfig, SimulationResult, prepare, run_simulation
from kvtierd.sim.timing import qps_at_ttft

DEFAULT_ALPHAS = (0.01, 0.03, 0.1, 0.2, 0.5, 1.0, 2.0, 5.0, 10.0, 30.0, 100.0, 1000.0)


@dataclass(frozen=True, slots=True, eq=False)
class Sweep:
    """All runs of one sweep: ``evicpress`` (online frequencies) and ``oracle`` (true
    frequencies; empty when not run) by alpha, ``baselines`` by placer spec."""

    evicpress: tuple[SimulationResult, ...]
    baselines: tuple[SimulationResult, ...]
    oracle: tuple[SimulationResult, ...] = ()


@dataclass(frozen=True, slots=True)
class HeadlineRow:
    """One line of the headline table; ``None`` where the frontier does not reach."""

    baseline: str
    points: int
    reduction_min: float | None
    reduction_median: float | None
    reduction_max: float | None


def sweep_configs(
    base: SimulationConfig,
    alphas: Sequence[float] = DEFAULT_ALPHAS,
    *,
    fixed_methods: Sequence[str] = ("keydiff", "knorm", "snapkv"),
    fixed_ratios: Sequence[float] = (0.9, 0.7, 0.5, 0.3, 0.1),
    others: Sequence[str] = ("lru", "lfu", "prefill"),
    oracle: bool = True,
) -> list[SimulationConfig]:
    """Every run of a sweep on ``base``'s workload: EvicPress online, EvicPress oracle (when
    ``oracle``), then the baselines."""
    evic = replace(base, placer="evicpress")
    runs = [replace(evic, alpha=a, frequency="online") for a in alphas]
    runs += [replace(evic, alpha=a, frequency="oracle") for a in alphas] if oracle else []
    specs = [f"fixed:{m}@{r:g}" for m in fixed_methods for r in fixed_ratios] + list(others)
    return runs + [replace(base, placer=s) for s in specs]


def run_sweep(
    base: SimulationConfig,
    configs: Sequence[SimulationConfig] | None = None,
    step: Callable[[str], None] | None = None,
) -> Sweep:
    """Run ``configs`` (default: :func:`sweep_configs` of ``base``) on ``base``'s workload,
    prepared once; ``step`` is called with each finished run's label (progress)."""
    prep = prepare(base)
    results = []
    for cfg in sweep_configs(base) if configs is None else configs:
        results.append(run_simulation(cfg, prep))
        if step is not None:
            step(f"{cfg.label} a={cfg.alpha:g}" if cfg.placer == "evicpress" else cfg.label)
    evic = tuple(r for r in results if r.placer == "evicpress")
    oracle = tuple(r for r in results if r.placer == "evicpress (oracle)")
    baselines = tuple(r for r in results if not r.placer.startswith("evicpress"))
    return Sweep(evic, baselines, oracle)


def frontier(results: Sequence[SimulationResult]) -> tuple[FloatArray, FloatArray]:
    """Lower-left envelope: qualities ascending with their best (lowest) mean TTFT."""
    pts = sorted(((r.quality_mean, r.ttft_mean_s) for r in results), key=lambda p: -p[0])
    qs: list[float] = []
    ts: list[float] = []
    for q, t in pts:  # walking down in quality, keep points that lower the TTFT
        if not ts or t < ts[-1]:
            qs.append(q)
            ts.append(t)
    return np.array(qs[::-1]), np.array(ts[::-1])


def ttft_at_quality(front: tuple[FloatArray, FloatArray], quality: float) -> float | None:
    """Interpolated frontier TTFT at ``quality``; ``None`` above the frontier's best quality."""
    qs, ts = front
    if qs.size == 0 or quality > qs[-1] + 1e-12:
        return None
    if quality <= qs[0]:
        return float(ts[0])
    return float(np.interp(quality, qs, ts))


def headline(sweep: Sweep, within: float = 0.03, oracle: bool = False) -> list[HeadlineRow]:
    """TTFT reduction at equal quality vs each baseline family (see module docstring), of the
    online EvicPress frontier or, with ``oracle``, of the oracle's (the upper bound)."""
    front = frontier(sweep.oracle if oracle else sweep.evicpress)
    families: dict[str, list[SimulationResult]] = {}
    for r in sweep.baselines:
        families.setdefault(r.placer.split("@")[0], []).append(r)
    rows = []
    for name, runs in families.items():
        ratios = []
        for r in runs:
            q = r.quality_mean * (1 - within) if r.quality_mean >= 0.999 else r.quality_mean
            t = ttft_at_quality(front, q)
            if t is not None and t > 0:
                ratios.append(r.ttft_mean_s / t)
        if ratios:
            arr = np.array(ratios)
            rows.append(HeadlineRow(name, len(ratios), arr.min(), float(np.median(arr)), arr.max()))
        else:
            rows.append(HeadlineRow(name, 0, None, None, None))
    return rows


@dataclass(frozen=True, slots=True)
class QpsComparison:
    """Fig. 8: highest QPS at a TTFT target among configurations meeting a quality target."""

    quality_target: float
    ttft_target_s: float
    evicpress_qps: float
    evicpress_alpha: float
    baseline_qps: float
    baseline: str

    @property
    def ratio(self) -> float:
        return self.evicpress_qps / self.baseline_qps if self.baseline_qps > 0 else float("inf")


def qps_comparison(
    sweep: Sweep, quality_target: float = 0.8, ttft_target_s: float | None = None
) -> QpsComparison:
    """Compare the best EvicPress and best baseline configuration at equal TTFT."""
    evic = [r for r in sweep.evicpress if r.quality_mean >= quality_target]
    base = [r for r in sweep.baselines if r.quality_mean >= quality_target]
    if not evic or not base:
        raise ValueError(f"no configuration reaches quality {quality_target}")
    if ttft_target_s is None:
        ttft_target_s = 2.0 * min(r.ttft_mean_s for r in base)
    target = ttft_target_s

    def qps(r: SimulationResult) -> float:
        return qps_at_ttft(r.arrival_s, r.service_s, target)

    best_e = max(evic, key=qps)
    best_b = max(base, key=qps)
    return QpsComparison(
        quality_target, target, qps(best_e), best_e.alpha, qps(best_b), best_b.placer
    )
