"""Trace-driven simulation of one placer: TTFT, quality and hit rates per request.

Per request for context ``c`` (EvicPress §6.1 metrics):

* cached at ``(variant, tier)``: TTFT = bytes / tier bandwidth + tier overhead + restore + prefill
  of the query attending to the kept tokens; quality = the variant's profiled quality;
* not cached (first use, evicted, dropped, or the ``prefill`` placer): TTFT = prefill of context
  + query; quality 1.0. The context is then offered to the placer (``insert``).

Prefill time is a roofline: ``2 * active_params`` FLOPs per token plus attention
``4 * layers * q_heads * head_dim`` FLOPs per token pair, at ``gpu_flops`` (default H100 bf16
dense 989 TFLOP/s x 40% utilisation). Plans are executed instantly (in the background, as in
§4.1); the first ``warmup_fraction`` of requests fill the cache and are not measured.

The unloaded TTFT of a request is its service time; :func:`loaded_ttft_s` adds queueing on one
FIFO GPU for a given request rate (used for "QPS at equal TTFT", Fig. 8).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from kvtierd.policies.base import Placer, PlacerParams, make_placer
from kvtierd.policies.model import FloatArray, IntArray
from kvtierd.sim.variants import VariantSpace, VariantTable, make_variants
from kvtierd.sim.workload import ModelPreset, Workload, WorkloadConfig, make_workload
from kvtierd.types import ContextProfile, TierModel, VariantProfile

GB = 1e9

PAPER_TIERS: tuple[TierModel, ...] = (
    TierModel("dram", int(80 * GB), 20 * GB, 0.0005),
    TierModel("ssd", int(800 * GB), 2 * GB, 0.002),
    TierModel("remote", None, 1 * GB, 0.01),
)
"""§6.1: 80 GB CPU DRAM, 800 GB SSD, unbounded remote; bandwidths as in the paper's Fig. 2
(20 GB/s fast, 2 GB/s slow) and 1 GB/s for the remote store."""


@dataclass(frozen=True, slots=True)
class SimulationConfig:
    """One simulation run: workload, variants, tiers and the placer under test."""

    workload: WorkloadConfig = field(default_factory=WorkloadConfig)
    variants: VariantSpace = field(default_factory=VariantSpace)
    tiers: tuple[TierModel, ...] = PAPER_TIERS
    placer: str = "evicpress"
    alpha: float = 1.0
    selection: str = "per_byte"
    warmup_fraction: float = 0.2
    gpu_flops: float = 989e12 * 0.4
    sensitivity_cov: float = 0.25


@dataclass(frozen=True, slots=True, eq=False)
class SimulationResult:
    """Measured requests only. ``service_s``/``arrival_s``: per request, for queueing."""

    placer: str
    alpha: float
    ttft_mean_s: float
    ttft_p50_s: float
    ttft_p99_s: float
    quality_mean: float
    hit_rate: dict[str, float]
    service_s: FloatArray
    arrival_s: FloatArray

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


def prefill_s(
    model: ModelPreset, new_tokens: FloatArray, past_tokens: FloatArray, flops: float
) -> FloatArray:
    """Roofline prefill time (s) of ``new_tokens`` attending to ``past_tokens`` earlier ones."""
    linear = 2.0 * model.active_params * new_tokens
    attention = 4.0 * model.layers * model.q_heads * model.head_dim * new_tokens
    return (linear + attention * (past_tokens + new_tokens / 2.0)) / flops


@dataclass(frozen=True, slots=True, eq=False)
class Prepared:
    """A workload with its variants and profiles, shared by every placer of a sweep."""

    workload: Workload
    variants: VariantTable
    profiles: tuple[ContextProfile, ...]


def prepare(cfg: SimulationConfig) -> Prepared:
    """Generate the workload and per-context profiles (deterministic in the seed)."""
    wl = make_workload(cfg.workload)
    vt = make_variants(wl, cfg.variants, cfg.sensitivity_cov, cfg.workload.seed)
    tokens = wl.context_tokens.astype(np.float64)
    full = prefill_s(wl.model, tokens, np.zeros_like(tokens), cfg.gpu_flops)
    expected_hits = wl.popularity * wl.arrival_s.size
    profiles = []
    for i in range(tokens.size):
        variants = tuple(
            VariantProfile(
                name, int(vt.size_bytes[i, j]), float(vt.quality[i, j]), float(vt.restore_s[i, j])
            )
            for j, name in enumerate(vt.names)
        )
        profiles.append(ContextProfile(f"c{i}", variants, float(expected_hits[i]), float(full[i])))
    return Prepared(wl, vt, tuple(profiles))


@dataclass(frozen=True, slots=True, eq=False)
class Replay:
    """What a replay leaves: the placer (final placements) and, per request, the tier index
    it was served from (``-1``: a miss, prefilled) and the variant index."""

    placer: Placer
    tier_hit: IntArray
    variant: IntArray


def replay(cfg: SimulationConfig, prep: Prepared) -> Replay:
    """Send the workload's requests through a fresh ``cfg.placer`` in order: a context the
    placer does not know is inserted (a miss); a known one is served from its placement and
    counted as an access."""
    wl, vt = prep.workload, prep.variants
    params = PlacerParams(alpha=cfg.alpha, selection=cfg.selection)
    placer = make_placer(cfg.placer, cfg.tiers, params)
    tier_of = {t.name: i for i, t in enumerate(cfg.tiers)}
    var_of = {name: j for j, name in enumerate(vt.names)}
    m = wl.arrival_s.size
    tier_hit = np.full(m, -1, dtype=np.int64)
    variant = np.zeros(m, dtype=np.int64)
    for k in range(m):
        c = int(wl.request_context[k])
        cid = prep.profiles[c].context_id
        try:
            where = placer.placement(cid)
        except KeyError:
            placer.insert(prep.profiles[c])
            continue
        if where.tier is not None:
            tier_hit[k] = tier_of[where.tier]
            variant[k] = var_of[where.variant]
        placer.access(cid, float(wl.arrival_s[k]))
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
    miss = tier_hit < 0
    service = prefill_s(wl.model, tokens + query, np.zeros_like(query), cfg.gpu_flops)
    quality = np.ones(ctx.size)
    hit = np.flatnonzero(~miss)
    c, v, t = ctx[hit], variant[hit], tier_hit[hit]
    bw = np.array([tier.load_bandwidth_bytes_per_s for tier in cfg.tiers])
    overhead = np.array([tier.load_overhead_s for tier in cfg.tiers])
    load = vt.size_bytes[c, v] / bw[t] + overhead[t] + vt.restore_s[c, v]
    service[hit] = load + prefill_s(wl.model, query[hit], vt.kept_tokens[c, v], cfg.gpu_flops)
    quality[hit] = vt.quality[c, v]
    start = int(cfg.warmup_fraction * ctx.size)
    s, q, th = service[start:], quality[start:], tier_hit[start:]
    rates = {tier.name: float(np.mean(th == i)) for i, tier in enumerate(cfg.tiers)}
    rates["miss"] = float(np.mean(th < 0))
    return SimulationResult(
        placer=cfg.placer,
        alpha=cfg.alpha,
        ttft_mean_s=float(s.mean()),
        ttft_p50_s=float(np.percentile(s, 50)),
        ttft_p99_s=float(np.percentile(s, 99)),
        quality_mean=float(q.mean()),
        hit_rate=rates,
        service_s=s,
        arrival_s=wl.arrival_s[start:] - wl.arrival_s[start],
    )


def loaded_ttft_s(result: SimulationResult, qps: float) -> float:
    """Mean TTFT (s) with FIFO queueing on one GPU when requests arrive at ``qps``.

    The measured arrival pattern is stretched or compressed to the given mean rate.
    """
    arrivals = result.arrival_s
    base_qps = (arrivals.size - 1) / max(float(arrivals[-1]), 1e-9)
    times = (arrivals * (base_qps / qps)).tolist()
    finish = 0.0
    total = 0.0
    for a, s in zip(times, result.service_s.tolist(), strict=True):
        finish = max(finish, a) + s
        total += finish - a
    return total / len(times)


def qps_at_ttft(result: SimulationResult, target_s: float, hi: float = 1e4) -> float:
    """Highest request rate whose mean loaded TTFT stays within ``target_s`` (bisection)."""
    if float(result.service_s.mean()) >= target_s:
        return 0.0
    lo, high = 0.0, min(hi, 1.0 / float(result.service_s.mean()))  # at most GPU saturation
    for _ in range(40):
        mid = (lo + high) / 2
        if mid > 0 and loaded_ttft_s(result, mid) <= target_s:
            lo = mid
        else:
            high = mid
    return lo
