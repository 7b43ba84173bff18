"""Trace-driven simulation of one placer: TTFT, quality and hit rates per request.

Per request for context ``c`` (EvicPress §6.1 metrics):

* cached at ``(variant, tier)``: TTFT = bytes / tier bandwidth + tier overhead + restore +
  prefill of the query after the kept tokens; quality = the variant's profiled quality. When
  that is slower than recomputing (``recompute_slower_loads``, on by default) the request is
  **recomputed** instead, as a serving engine that knows both costs would: TTFT = prefill of
  context + query, quality 1.0. This applies to every placer alike: without it the LRU family
  loads from tiers slower than prefill (29-39% of its requests in the paper-scale sweep);
* not cached (first use, evicted, or dropped): TTFT = prefill of context + query, quality 1.0.
  The context is then stored again: offered to the placer (``insert``), as the daemon does
  when the prefilled KV arrives.

**Frequencies** (``frequency``): ``online`` (default) gives the placer what the daemon's
profiler knows — each context's decayed count of the requests seen so far
(:class:`kvtierd.profiler.frequency.FrequencyTracker`, half-life ``half_life_s``), taken when
the context is inserted, plus the hits the placer counts itself; ``oracle`` gives it each
context's true expected number of requests over the whole workload (the upper bound the
paper's profiler assumes).

Plans are executed instantly (in the background, as in §4.1). Warm-up requests
(``Workload.measured``) fill the cache and are not counted. Prefill times come from the
prepared workload's :class:`~kvtierd.sim.timing.PrefillModel`.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace

import numpy as np

from kvtierd.errors import InvalidArgumentError
from kvtierd.policies.base import Placer, PlacerParams, make_placer
from kvtierd.policies.model import FloatArray, IntArray
from kvtierd.profiler.frequency import FrequencyTracker
from kvtierd.sim.timing import H100_BF16_FLOPS, PrefillModel, RooflinePrefill
from kvtierd.sim.variants import VariantSpace, VariantTable, make_variants
from kvtierd.sim.workload import Workload, WorkloadConfig, make_workload
from kvtierd.types import ContextProfile, TierModel, VariantProfile
from kvtierd.utility import load_seconds

GB = 1e9

PAPER_TIERS: tuple[TierModel, ...] = (
    TierModel("dram", int(80 * GB), 20 * GB, 0.0005),
    TierModel("ssd", int(800 * GB), 2 * GB, 0.002),
    TierModel("remote", None, 1 * GB, 0.01),
)
"""§6.1: 80 GB CPU DRAM, 800 GB SSD, unbounded remote; bandwidths as in the paper's Fig. 2
(20 GB/s fast, 2 GB/s slow) and 1 GB/s for the remote store."""

FREQUENCIES = ("online", "oracle")

MISS = -1
RECOMPUTED = -2
"""Codes of :attr:`SimulationResult.served` besides tier indices."""


@dataclass(frozen=True, slots=True)
class SimulationConfig:
    """One simulation run: workload, variants, tiers and the placer under test."""

    workload: WorkloadConfig = field(default_factory=WorkloadConfig)
    variants: VariantSpace = field(default_factory=VariantSpace)
    tiers: tuple[TierModel, ...] = PAPER_TIERS
    placer: str = "evicpress"
    alpha: float = 1.0
    selection: str = "per_byte"
    frequency: str = "online"
    half_life_s: float = 3600.0
    recompute_slower_loads: bool = True
    warmup_fraction: float = 0.2
    gpu_flops: float = H100_BF16_FLOPS * 0.4
    sensitivity_cov: float = 0.25

    def __post_init__(self) -> None:
        if self.frequency not in FREQUENCIES:
            raise InvalidArgumentError(
                f"unknown frequency {self.frequency!r}; known: {', '.join(FREQUENCIES)}"
            )

    @property
    def label(self) -> str:
        """The placer as results name it; EvicPress with oracle frequencies is marked."""
        oracle = self.frequency == "oracle" and self.placer == "evicpress"
        return f"{self.placer} (oracle)" if oracle else self.placer


@dataclass(frozen=True, slots=True, eq=False)
class SimulationResult:
    """Measured requests only, in arrival order. Per request: ``service_s`` (unloaded TTFT),
    ``arrival_s``, ``quality`` and ``served`` (tier index, :data:`MISS` or
    :data:`RECOMPUTED`); ``tiers`` names the tier indices."""

    placer: str
    alpha: float
    ttft_mean_s: float
    ttft_p50_s: float
    ttft_p99_s: float
    quality_mean: float
    hit_rate: dict[str, float]
    service_s: FloatArray
    arrival_s: FloatArray
    quality: FloatArray
    served: IntArray
    tiers: tuple[str, ...]

    def summary(self) -> dict[str, object]:
        """Plain values for JSON output and tables."""
        return {
            "placer": self.placer,
            "alpha": self.alpha,
            "ttft_mean_s": self.ttft_mean_s,
            "ttft_p50_s": self.ttft_p50_s,
            "ttft_p99_s": self.ttft_p99_s,
            "quality_mean": self.quality_mean,
            "hit_rate": self.hit_rate,
        }

    def served_as(self) -> list[str]:
        """Per request: the tier it loaded from, ``recompute`` or ``miss``."""
        names = {MISS: "miss", RECOMPUTED: "recompute", **dict(enumerate(self.tiers))}
        return [names[int(s)] for s in self.served]


@dataclass(frozen=True, slots=True, eq=False)
class Prepared:
    """A workload with its variants, profiles and prefill model, shared by every placer of a
    sweep. ``profiles[i].frequency`` is context ``i``'s true expected number of requests."""

    workload: Workload
    variants: VariantTable
    profiles: tuple[ContextProfile, ...]
    prefill: PrefillModel


def prepare(cfg: SimulationConfig) -> Prepared:
    """Generate the workload and per-context profiles (deterministic in the seed)."""
    wl = make_workload(cfg.workload, cfg.warmup_fraction)
    vt = make_variants(wl, cfg.variants, cfg.sensitivity_cov, cfg.workload.seed)
    return prepared(wl, vt, RooflinePrefill(wl.model, cfg.gpu_flops))


def prepared(wl: Workload, vt: VariantTable, prefill: PrefillModel) -> Prepared:
    """Profiles of ``wl``'s contexts from their variants and prefill times."""
    tokens = wl.context_tokens.astype(np.float64)
    full = prefill.seconds(tokens, np.zeros_like(tokens))
    expected_hits = wl.popularity * wl.arrival_s.size
    profiles = []
    for i in range(tokens.size):
        variants = tuple(
            VariantProfile(
                name, int(vt.size_bytes[i, j]), float(vt.quality[i, j]), float(vt.restore_s[i, j])
            )
            for j, name in enumerate(vt.names)
            if np.isfinite(vt.quality[i, j])
        )
        profiles.append(ContextProfile(f"c{i}", variants, float(expected_hits[i]), float(full[i])))
    return Prepared(wl, vt, tuple(profiles), prefill)


@dataclass(frozen=True, slots=True, eq=False)
class Replay:
    """What a replay leaves: the placer (final placements) and, per request, the tier index
    it was served from (:data:`MISS`: prefilled) and the variant index."""

    placer: Placer
    tier_hit: IntArray
    variant: IntArray


def replay(cfg: SimulationConfig, prep: Prepared) -> Replay:
    """Send the workload's requests through a fresh ``cfg.placer`` in order (module doc)."""
    wl, vt = prep.workload, prep.variants
    params = PlacerParams(alpha=cfg.alpha, selection=cfg.selection)
    placer = make_placer(cfg.placer, cfg.tiers, params)
    tier_of = {t.name: i for i, t in enumerate(cfg.tiers)}
    var_of = {name: j for j, name in enumerate(vt.names)}
    seen = FrequencyTracker(cfg.half_life_s) if cfg.frequency == "online" else None
    m = wl.arrival_s.size
    tier_hit = np.full(m, MISS, dtype=np.int64)
    variant = np.zeros(m, dtype=np.int64)
    for k, (c, now) in enumerate(
        zip(wl.request_context.tolist(), wl.arrival_s.tolist(), strict=True)
    ):
        profile = prep.profiles[c]
        cid = profile.context_id
        if seen is not None:
            seen.record(cid, now)
            profile = replace(profile, frequency=seen.frequency(cid, now))
        try:
            where = placer.placement(cid)
        except KeyError:
            placer.insert(profile)
            continue
        if where.tier is None:
            placer.insert(profile)  # prefilled, so stored again
            continue
        tier_hit[k] = tier_of[where.tier]
        variant[k] = var_of[where.variant]
        placer.access(cid, now)
    return Replay(placer, tier_hit, variant)


def run_simulation(cfg: SimulationConfig, prepared: Prepared | None = None) -> SimulationResult:
    """Replay the workload's requests through ``cfg.placer`` and measure every request."""
    prep = prepared or prepare(cfg)
    done = replay(cfg, prep)
    return _measure(cfg, prep, done.tier_hit, done.variant)


def _measure(
    cfg: SimulationConfig, prep: Prepared, tier_hit: IntArray, variant: IntArray
) -> SimulationResult:
    wl, vt = prep.workload, prep.variants
    ctx = wl.request_context
    query = wl.query_tokens.astype(np.float64)
    tokens = wl.context_tokens[ctx].astype(np.float64)
    service = prep.prefill.seconds(tokens + query, np.zeros_like(query))
    quality = np.ones(ctx.size)
    served = tier_hit.copy()
    hit = np.flatnonzero(tier_hit >= 0)
    c, v, t = ctx[hit], variant[hit], tier_hit[hit]
    bw = np.array([tier.load_bandwidth_bytes_per_s for tier in cfg.tiers])
    overhead = np.array([tier.load_overhead_s for tier in cfg.tiers])
    load = load_seconds(vt.size_bytes[c, v], vt.restore_s[c, v], bw[t], overhead[t])
    loaded = load + prep.prefill.seconds(query[hit], vt.kept_tokens[c, v])
    if cfg.recompute_slower_loads:
        slower = loaded > service[hit]
        served[hit[slower]] = RECOMPUTED
        hit, loaded, c, v = hit[~slower], loaded[~slower], c[~slower], v[~slower]
    service[hit] = loaded
    quality[hit] = vt.quality[c, v]
    keep = wl.measured
    s, q, th = service[keep], quality[keep], served[keep]
    rates = {tier.name: float(np.mean(th == i)) for i, tier in enumerate(cfg.tiers)}
    rates["recompute"] = float(np.mean(th == RECOMPUTED))
    rates["miss"] = float(np.mean(th == MISS))
    return SimulationResult(
        placer=cfg.label,
        alpha=cfg.alpha,
        ttft_mean_s=float(s.mean()),
        ttft_p50_s=float(np.percentile(s, 50)),
        ttft_p99_s=float(np.percentile(s, 99)),
        quality_mean=float(q.mean()),
        hit_rate=rates,
        service_s=s,
        arrival_s=wl.arrival_s[keep],
        quality=q,
        served=th,
        tiers=tuple(t.name for t in cfg.tiers),
    )
