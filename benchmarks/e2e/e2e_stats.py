"""The statistics of bench_e2e's headline (issue 30): intervals, the trace's ceiling, ratios.

* :func:`bootstrap` — a 95% percentile-bootstrap interval of a request statistic (mean, p50,
  p90 TTFT; accuracy; similarity) over one run's requests: requests resampled with
  replacement, the statistic of each resample, the 2.5th and 97.5th percentiles of those.
* :func:`wilson` — a share of requests (answers identical to the full KV's, issue 39) with
  its 95% Wilson score interval: exact for a count, sound near 0 and 1 where a normal
  interval leaves [0, 1].
* :func:`ceiling` — the best any policy could do on one trace: a context's first request in
  the run (warm-up included) is a miss at the measured miss time for its length (the mean of
  every system's misses of that length), every other request a hit at the fastest measured
  hit time for its length (the lowest of the systems' median hit TTFT at that length). Each
  system then reads as a share of what was possible (``ceiling / its mean``).
* :func:`ratio_bootstrap` — one seed's ratio of two systems' mean TTFT (a baseline's over
  EvicPress's) with its 95% interval: the requests are resampled in pairs (both systems served
  the same trace, request ``i`` is the same context, question and arrival in both).
* :func:`across_seeds` — a ratio measured on several seeds (one trace each): its mean with a
  95% Student-t interval over the seeds. The headline is that interval, not one run's point.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Collection, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

STATISTICS = ("mean", "p50", "p90")
"""What :func:`bootstrap` computes: the mean, or a percentile (nearest rank, as bench_e2e)."""


@dataclass(frozen=True, slots=True)
class Interval:
    """A point estimate and its 95% interval (``nan`` bounds: no interval, e.g. one seed)."""

    point: float
    low: float
    high: float

    def __str__(self) -> str:
        if math.isnan(self.low):
            return f"{self.point:.3f}"
        return f"{self.point:.3f} [{self.low:.3f}, {self.high:.3f}]"


def _statistic(x: np.ndarray[Any, Any], stat: str) -> np.ndarray[Any, Any]:
    """``stat`` of each row of ``x``."""
    if stat == "mean":
        return np.asarray(x.mean(axis=-1))
    return np.asarray(np.percentile(x, float(stat[1:]), axis=-1, method="nearest"))


def bootstrap(
    xs: Sequence[float], stat: str = "mean", *, resamples: int = 2000, seed: int = 0
) -> Interval:
    """``stat`` of ``xs`` with its 95% percentile-bootstrap interval (module docstring)."""
    if stat not in STATISTICS:
        raise ValueError(f"stat must be one of {', '.join(STATISTICS)}, got {stat!r}")
    if not xs:
        raise ValueError("a bootstrap needs at least one value, got none")
    if resamples < 100:
        raise ValueError(f"resamples must be >= 100 for a 95% interval, got {resamples}")
    x = np.asarray(xs, dtype=np.float64)
    if not np.isfinite(x).all():
        raise ValueError("every value must be finite (a failed request has no TTFT)")
    rng = np.random.default_rng(seed)
    drawn = x[rng.integers(0, len(x), size=(resamples, len(x)))]
    low, high = np.percentile(_statistic(drawn, stat), [2.5, 97.5])
    return Interval(float(_statistic(x, stat)), float(low), float(high))


Z95 = 1.959963984540054
"""The standard normal's 97.5th percentile: a two-sided 95% interval."""


def wilson(successes: int, n: int) -> Interval:
    """``successes / n`` with its 95% Wilson score interval (module docstring)."""
    if n <= 0:
        raise ValueError(f"a share needs at least one request, got n={n}")
    if not 0 <= successes <= n:
        raise ValueError(f"successes must be within [0, {n}], got {successes}")
    p = successes / n
    z2 = Z95 * Z95
    centre = (p + z2 / (2 * n)) / (1 + z2 / n)
    half = Z95 * math.sqrt(p * (1 - p) / n + z2 / (4 * n * n)) / (1 + z2 / n)
    return Interval(p, max(0.0, centre - half), min(1.0, centre + half))


@dataclass(frozen=True, slots=True)
class Timed:
    """One timed request as the ceiling reads it: its context, the context's length class
    (tokens), bench_e2e's class of it (``Outcome.kind``: miss, hit, variant, unknown) and
    its TTFT."""

    context: int
    length: int
    kind: str
    ttft_s: float


def ceiling(runs: Mapping[str, Sequence[Timed]], warmed: Collection[int] = ()) -> float:
    """Mean TTFT of the best any policy could do on the trace the systems of ``runs`` served
    (the same requests in the same order); ``warmed``: contexts asked in the warm-up, whose
    first request is behind them (module docstring)."""
    if not runs:
        raise ValueError("the ceiling needs at least one system's requests")
    trace = next(iter(runs.values()))
    order = [(r.context, r.length) for r in trace]
    for name, reqs in runs.items():
        if [(r.context, r.length) for r in reqs] != order:
            raise ValueError(f"system {name!r} served another trace: the ceiling compares one")
    lengths = sorted({r.length for r in trace})
    miss_s, hit_s = {}, {}
    for length in lengths:
        misses = [r.ttft_s for reqs in runs.values() for r in reqs
                  if r.length == length and r.kind == "miss"]  # fmt: skip
        hits = [[r.ttft_s for r in reqs if r.length == length and r.kind == "hit"]
                for reqs in runs.values()]  # fmt: skip
        medians = [statistics.median(h) for h in hits if h]
        if not misses or not medians:
            raise ValueError(f"no {'miss' if not misses else 'hit'} of a {length}-token context "
                             "was measured: run a system that misses (prefill) and one that "
                             "hits")  # fmt: skip
        miss_s[length], hit_s[length] = statistics.fmean(misses), min(medians)
    seen = set(warmed)
    total = 0.0
    for context, length in order:
        total += hit_s[length] if context in seen else miss_s[length]
        seen.add(context)
    return total / len(order)


def ratio_bootstrap(
    base: Sequence[float], ours: Sequence[float], *, resamples: int = 2000, seed: int = 0
) -> Interval:
    """``mean(base) / mean(ours)`` with its 95% paired-bootstrap interval (module docstring):
    ``base[i]`` and ``ours[i]`` are the TTFTs of the same request under two systems."""
    if len(base) != len(ours):
        raise ValueError(f"a paired ratio needs the same requests: {len(base)} against "
                         f"{len(ours)}")  # fmt: skip
    if not base:
        raise ValueError("a ratio needs at least one request, got none")
    if resamples < 100:
        raise ValueError(f"resamples must be >= 100 for a 95% interval, got {resamples}")
    b, o = np.asarray(base, dtype=np.float64), np.asarray(ours, dtype=np.float64)
    if not (np.isfinite(b).all() and np.isfinite(o).all()) or (o <= 0).any():
        raise ValueError("every TTFT must be finite and positive (a failed request has none)")
    rng = np.random.default_rng(seed)
    pick = rng.integers(0, len(b), size=(resamples, len(b)))
    ratios = b[pick].mean(axis=1) / o[pick].mean(axis=1)
    low, high = np.percentile(ratios, [2.5, 97.5])
    return Interval(float(b.mean() / o.mean()), float(low), float(high))


def across_seeds(values: Sequence[float]) -> Interval:
    """The mean of one value per seed with its 95% Student-t interval (``nan`` bounds with
    one seed)."""
    if not values:
        raise ValueError("across_seeds needs at least one seed's value, got none")
    if not all(math.isfinite(v) for v in values):
        raise ValueError(f"every seed's value must be finite, got {list(values)}")
    mean = statistics.fmean(values)
    if len(values) == 1:
        return Interval(mean, math.nan, math.nan)
    from scipy import stats

    half = float(stats.t.ppf(0.975, len(values) - 1)) * statistics.stdev(values)
    half /= math.sqrt(len(values))
    return Interval(mean, mean - half, mean + half)
