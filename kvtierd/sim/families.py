"""Seeded placement instances, by family, to measure placers against the exact optimum.

``benchmarks/micro/bench_placer.py`` and ``tests/policies`` draw from these; the module lives with
the simulator, whose calibrated contexts the ``paper`` family uses (the daemon never needs it).
Each family is a function ``(seed, n_contexts) -> UtilityTable`` in :data:`FAMILIES`; the same
seed gives the same instance. Sizes are bytes, times seconds, three tiers (two finite, fastest
first).

* ``paper``: the simulator's calibrated contexts (monotone quality curves, 3 methods x 4 ratios
  + int8/int4), DRAM / SSD holding ~10% / ~40% of the original bytes, paper bandwidths.
* ``uniform``: sizes and qualities drawn independently (no monotone curve), 10-60% of a
  100-byte top tier each: many contexts large next to a tier.
* ``trap``: one or two large hot contexts that each almost fill DRAM (92-99%) against smaller
  ones with a 1-5% better gain per byte, sized so that 2-4 of them fit and leave a gap of
  10-30%. A per-byte greedy fills DRAM with the small ones; the optimum holds the large one, a
  move of three or more contexts at once (issue 14).
* ``tie``: one variant per context and the same gain per byte for every context in every
  tier (prefill time proportional to size, frequency 1): placement is subset-sum packing,
  where "best per byte" says nothing.
* ``slow_ssd``: ``paper`` contexts with an SSD whose load takes 60-120% of a typical
  context's prefill, and a remote tier half as fast: storing below DRAM is worth little or
  less than recomputing, so DRAM decisions carry the gain and the slower tiers' value as a
  "leave DRAM" option is often below dropping.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np

from kvtierd.policies.model import FloatArray, UtilityTable
from kvtierd.types import TierModel

GB = 1e9

Family = Callable[[int, int], UtilityTable]


PAPER_RATIOS = (0.8, 0.6, 0.4, 0.2)
"""Kept ratios of the three token-dropping methods in ``paper`` and ``slow_ssd`` instances
(small enough a grid for the MILP reference; the simulator's own grid has nine)."""


def paper(seed: int, n: int, ratios: tuple[float, ...] = PAPER_RATIOS) -> UtilityTable:
    """Simulator contexts, DRAM / SSD at 10% / 40% of the bytes; alpha drawn from the seed."""
    size, quality, restore, freq, prefill = _simulated(seed, n, ratios)
    total = float(size[:, 0].sum())
    tiers = [
        TierModel("dram", int(0.1 * total), 20 * GB, 0.0005),
        TierModel("ssd", int(0.4 * total), 2 * GB, 0.002),
        TierModel("remote", None, 1 * GB, 0.01),
    ]
    alpha = float(np.random.default_rng(seed).choice([0.3, 1.0, 3.0, 10.0]))
    return _table(
        tiers, alpha, size=size, quality=quality, freq=freq, prefill=prefill, restore=restore
    )


def slow_ssd(seed: int, n: int) -> UtilityTable:
    """``paper`` contexts over an SSD about as slow as recomputing (see the module doc)."""
    size, quality, restore, freq, prefill = _simulated(seed, n, PAPER_RATIOS)
    rng = np.random.default_rng(seed + 1)
    total = float(size[:, 0].sum())
    # Bandwidth at which a median context loads in 60-120% of its prefill time.
    ssd_bw = float(np.median(size[:, 0] / prefill)) / rng.uniform(0.6, 1.2)
    tiers = [
        TierModel("dram", int(0.1 * total), 20 * GB, 0.0005),
        TierModel("ssd", int(0.4 * total), ssd_bw, 0.002),
        TierModel("remote", None, ssd_bw / 2, 0.01),
    ]
    alpha = float(rng.choice([0.3, 1.0, 3.0, 10.0]))
    return _table(
        tiers, alpha, size=size, quality=quality, freq=freq, prefill=prefill, restore=restore
    )


def uniform(seed: int, n: int) -> UtilityTable:
    """Independent random sizes (10-60 bytes) and qualities, 6 variants, tiers 100 / 200 / inf."""
    rng = np.random.default_rng(seed)
    n_var = 6
    size = rng.uniform(10, 60, (n, n_var))
    size[:, 0] = 60
    quality = rng.uniform(0.3, 1, (n, n_var))
    quality[:, 0] = 1
    tiers = [TierModel("a", 100, 100.0), TierModel("b", 200, 20.0), TierModel("c", None, 5.0)]
    freq = rng.uniform(0.5, 2, n)
    return _table(tiers, 10.0, size=size, quality=quality, freq=freq, prefill=np.full(n, 8.0))


def trap(seed: int, n: int) -> UtilityTable:
    """Large contexts against slightly better small ones (see the module doc); ``n >= 4``."""
    rng = np.random.default_rng(seed)
    cap = 64 * GB
    n_big = int(rng.integers(1, 3))
    n_small = max(1, n - n_big)
    big = rng.uniform(0.92, 0.99, n_big) * cap
    fit = int(rng.integers(2, 5))  # small contexts that fit in DRAM together
    small = cap / (fit + rng.uniform(0.4, 0.9)) * rng.uniform(0.97, 1.03, n_small)
    f_big = rng.uniform(2, 4, n_big)
    # Per byte every small context gains 1-5% more than the best large one.
    f_small = float(f_big.max()) * rng.uniform(1.01, 1.05, n_small)
    perm = rng.permutation(n_big + n_small)
    size = np.concatenate([big, small])[perm]
    freq = np.concatenate([f_big, f_small])[perm]
    tiers = [
        TierModel("dram", int(cap), 20 * GB, 0.0005),
        TierModel("ssd", int(rng.uniform(1.2, 2.5) * cap), 1.4 * GB, 0.002),
        TierModel("remote", None, 0.9 * GB, 0.01),  # slower than recomputing: never used
    ]
    # Prefill proportional to size: the gain per byte is set by the frequency alone.
    return _table(
        tiers,
        1.0,
        size=size[:, None],
        quality=np.ones((size.size, 1)),
        freq=freq,
        prefill=size / GB,
    )


def tie(seed: int, n: int) -> UtilityTable:
    """Whole-GB sizes (13-45 GB), tiers of 51-96 GB, one variant, equal gain per byte."""
    rng = np.random.default_rng(seed)
    size = np.round(rng.uniform(0.2, 0.7, n) * 64) * GB
    # Whole-GB capacities too: some packings fill a tier exactly, so the LP bound is reached
    # and the MILP proves its optimum quickly (with a fractional capacity HiGHS cannot close a
    # subset-sum gap by bounds and enumerates for seconds).
    caps = (np.round(rng.uniform(0.8, 1.5) * 64) * GB, np.round(rng.uniform(0.8, 1.5) * 64) * GB)
    tiers = [
        TierModel("dram", int(caps[0]), 20 * GB),
        TierModel("ssd", int(caps[1]), 2 * GB),
        TierModel("remote", None, 1.25 * GB),
    ]
    return _table(
        tiers, 1.0, size=size[:, None], quality=np.ones((n, 1)), freq=np.ones(n), prefill=size / GB
    )


def merged_traps(seed: int, n: int, part: int = 15) -> UtilityTable:
    """``trap`` instances of about ``part`` contexts each, merged into one of ``n`` contexts
    whose tiers hold the sum of theirs: many large contexts competing at once, well above
    the exact re-solve's threshold (the stress instances of issue 28)."""
    parts = max(1, round(n / part))
    sizes = [n // parts + (1 if j < n % parts else 0) for j in range(parts)]
    tables = [trap(seed * 1000 + j, k) for j, k in enumerate(sizes)]
    size = np.concatenate([t.size_bytes[:, 0] for t in tables])
    freq = np.concatenate([t.frequency for t in tables])
    caps = [sum(int(t.capacity_bytes[i] or 0) for t in tables) for i in range(2)]
    tiers = [
        TierModel("dram", caps[0], 20 * GB, 0.0005),
        TierModel("ssd", caps[1], 1.4 * GB, 0.002),
        TierModel("remote", None, 0.9 * GB, 0.01),
    ]
    return _table(
        tiers,
        1.0,
        size=size[:, None],
        quality=np.ones((size.size, 1)),
        freq=freq,
        prefill=size / GB,
    )


FAMILIES: dict[str, Family] = {
    "paper": paper,
    "uniform": uniform,
    "trap": trap,
    "tie": tie,
    "slow_ssd": slow_ssd,
}
"""Every family by name (the benchmark and the tests iterate over it)."""


def family(name: str) -> Family:
    """A family by name; an unknown name lists the known ones."""
    try:
        return FAMILIES[name]
    except KeyError:
        known = ", ".join(FAMILIES)
        raise ValueError(f"unknown instance family {name!r}; known: {known}") from None


def _simulated(seed: int, n: int, ratios: tuple[float, ...]) -> tuple[FloatArray, ...]:
    """Sizes, qualities, restore times ``(n, V)``, frequencies and prefill times ``(n,)``."""
    from kvtierd.sim.replay import SimulationConfig, prepare
    from kvtierd.sim.variant_space import VariantSpace
    from kvtierd.sim.workload import WorkloadConfig

    cfg = SimulationConfig(
        workload=WorkloadConfig(n_contexts=n, n_requests=50 * n, seed=seed),
        variants=VariantSpace(ratios=ratios),
    )
    prep = prepare(cfg)
    vt = prep.variants
    freq = np.array([p.frequency for p in prep.profiles])
    prefill = np.array([p.prefill_s for p in prep.profiles])
    return vt.size_bytes, vt.quality, vt.restore_s, freq, prefill


def _table(
    tiers: list[TierModel],
    alpha: float,
    *,
    size: FloatArray,
    quality: FloatArray,
    freq: FloatArray,
    prefill: FloatArray,
    restore: FloatArray | None = None,
) -> UtilityTable:
    return UtilityTable.from_arrays(
        tiers=tiers,
        alpha=alpha,
        size_bytes=size,
        quality=quality,
        restore_s=np.zeros_like(size) if restore is None else restore,
        frequency=freq,
        prefill_s=prefill,
    )
