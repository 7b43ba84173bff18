# Long because the replay loop and its per-request metrics share one state; split by caller.
"""Trace-driven simulation of one placer: TTFT, quality and hit rates per request.

Per request for context ``c`` (EvicPress §6.1 metrics):

* cached at ``(variant, tier)``: TTFT = bytes / tier bandwidth + tier overhead + restore +
  prefill of the query after the kept tokens; quality = the variant's profiled quality. When
  the load is not faster than recomputing by the daemon's margin (``recompute_slower_loads``, on by
  default: the rule the daemon's Lookup applies, :func:`kvtierd.utility.loaded_prefix`, with
  :data:`kvtierd.utility.LOAD_MARGIN`) the request is
  **recomputed** instead, as kvtierd's lookup decides (issue 41): TTFT = prefill of
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

**A shared prefix** (``Workload.shared_prefix_tokens`` > 0: one system prompt before every
context) is modelled as one more context, :data:`PREFIX_ID`, that every request needs before
its own: offered to the same placer (as the original only: what compressing a shared segment
means for the contexts after it is not modelled), with every request counted towards its
frequency (so under the oracle its expected requests are all of them), placed, moved and
dropped like any context: its profile prices only its own prefill when dropped, as the
simulator does not link the contexts to it (the daemon's EvicPress placer takes parent links,
``Placer.link`` / ``policies/tree_placement.py``; passing them here is not done yet; the replay
below already counts what losing the prefix costs the contexts after it). Each request
first uses the prefix (a lookup; not cached: prefilled and offered again), then its own
context, whose variants hold only its own tokens. A context's KV is usable only behind its
prefix's, as LMCache's lookup stops at the first chunk it lacks:

* prefix not cached: the whole prompt is prefilled (``miss``), its own context counted as not
  loaded even when it is cached (and offered to the placer again only when it is not);
* prefix cached, own context not: TTFT = the prefix's bytes / the tier's bandwidth (no
  per-load overhead: ``_prefix_only``) + prefill of the own tokens and the query after the
  prefix's (``prefix``, quality 1.0);
* both cached: TTFT = both loads (one tier overhead when they share a tier) + prefill of the
  query; quality = the own context's variant's. Slower than recomputing: ``recompute``.

**What the placer is offered** (``SimulationConfig.offers``, :mod:`kvtierd.sim.offers`): by
default every variant from a context's first put (the paper's model); the daemon's rules offer
a compressed form only once the context's profile is trusted and a token-dropped one only once
the router can serve it, and place the context again when they allow more; and without an
unbounded tier a compressed context keeps only what its form can make: a plan that asks more
of it leaves it in its form where the plan put it, adopted so by the placer (``ExecutingPlacer``).

**Lookup holds** (``hold_s`` > 0, :mod:`kvtierd.sim.executing`): a request that finds its
context holds it that long, as kvtierd's LMCache plugin pins a lookup (``kvtierd.hold_s``);
a drop or compression the placer plans for a held context waits until the hold ends, the
context meanwhile found where it was, and a load of a context the placer had dropped places
it again.

Plans are executed instantly (in the background, as in §4.1). Warm-up requests
(``Workload.measured``) fill the cache and are not counted. Prefill times come from the
prepared workload's :class:`~kvtierd.sim.timing.PrefillModel`.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace

import numpy as np
import numpy.typing as npt

from kvtierd.errors import InvalidArgumentError
from kvtierd.policies.base import Placer, PlacerParams, make_placer
from kvtierd.policies.model import FloatArray, IntArray
from kvtierd.profiler.frequency import FrequencyTracker
from kvtierd.sim.executing import ExecutingPlacer
from kvtierd.sim.offers import OfferRule, Offers
from kvtierd.sim.timing import H100_BF16_FLOPS, PrefillModel, RooflinePrefill
from kvtierd.sim.variant_space import VariantSpace, VariantTable, make_variants
from kvtierd.sim.workload import Workload, WorkloadConfig, make_workload
from kvtierd.types import (
    ORIGINAL_VARIANT,
    ContextProfile,
    TierModel,
    VariantProfile,
)
from kvtierd.utility import load_seconds, loaded_prefix

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
PREFIX = -3
"""Codes of :attr:`SimulationResult.served` besides tier indices (:data:`PREFIX`: only the
shared prefix loaded, the own context prefilled)."""

PREFIX_ID = "shared-prefix"
"""The placer's id of a workload's shared prefix (the contexts are ``c0``, ``c1``, ...)."""


@dataclass(frozen=True, slots=True)
class SimulationConfig:
    """One simulation run: workload, variants, tiers and the placer under test. ``hold_s``:
    how long a lookup that finds a context holds it against the placer's drops and
    compressions (0: not at all; kvtierd's LMCache plugin holds for 30 s, module docstring)."""

    workload: WorkloadConfig = field(default_factory=WorkloadConfig)
    variants: VariantSpace = field(default_factory=VariantSpace)
    tiers: tuple[TierModel, ...] = PAPER_TIERS
    placer: str = "evicpress"
    alpha: float = 1.0
    selection: str = "per_byte"
    frequency: str = "online"
    half_life_s: float = 3600.0
    recompute_slower_loads: bool = True
    offers: OfferRule = field(default_factory=OfferRule)
    warmup_fraction: float = 0.2
    gpu_flops: float = H100_BF16_FLOPS * 0.4
    sensitivity_cov: float = 0.25
    hold_s: float = 0.0

    def __post_init__(self) -> None:
        if self.frequency not in FREQUENCIES:
            raise InvalidArgumentError(
                f"unknown frequency {self.frequency!r}; known: {', '.join(FREQUENCIES)}"
            )
        if not self.hold_s >= 0:
            raise InvalidArgumentError(f"hold_s must be >= 0 seconds, got {self.hold_s!r}")

    @property
    def label(self) -> str:
        """The placer as results name it; EvicPress with oracle frequencies is marked."""
        oracle = self.frequency == "oracle" and self.placer == "evicpress"
        return f"{self.placer} (oracle)" if oracle else self.placer


@dataclass(frozen=True, slots=True, eq=False)
class SimulationResult:
    """Measured requests only, in arrival order. Per request: ``service_s`` (unloaded TTFT),
    ``arrival_s``, ``quality``, ``served`` (tier index, :data:`MISS`, :data:`RECOMPUTED`
    or :data:`PREFIX`) and ``new_tokens`` (the tokens it prefills); ``tiers`` names the tier
    indices. With a shared prefix ``hit_rate``
    also has ``prefix`` (only the prefix loaded) and ``shared_prefix_cached`` (the share of
    requests that found the prefix cached, whatever became of their own context)."""

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
    new_tokens: FloatArray

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
        """Per request: the tier it loaded from, ``recompute``, ``miss`` or ``prefix``."""
        names = {MISS: "miss", RECOMPUTED: "recompute", PREFIX: "prefix",
                 **dict(enumerate(self.tiers))}  # fmt: skip
        return [names[int(s)] for s in self.served]


@dataclass(frozen=True, slots=True, eq=False)
class Prepared:
    """A workload with its variants, profiles and prefill model, shared by every placer of a
    sweep. ``profiles[i].frequency`` is context ``i``'s true expected number of requests;
    ``prefix`` is the shared prefix's profile (``None``: the workload has none)."""

    workload: Workload
    variants: VariantTable
    profiles: tuple[ContextProfile, ...]
    prefill: PrefillModel
    prefix: ContextProfile | None = None


def prepare(cfg: SimulationConfig) -> Prepared:
    """Generate the workload and per-context profiles (deterministic in the seed)."""
    wl = make_workload(cfg.workload, cfg.warmup_fraction)
    vt = make_variants(wl, cfg.variants, cfg.sensitivity_cov, cfg.workload.seed)
    return prepared(wl, vt, RooflinePrefill(wl.model, cfg.gpu_flops))


def prepared(wl: Workload, vt: VariantTable, prefill: PrefillModel) -> Prepared:
    """Profiles of ``wl``'s contexts from their variants and prefill times (a context's own
    tokens after its shared prefix's, when the workload has one), and the prefix's."""
    tokens = wl.own_tokens.astype(np.float64)
    full = prefill.seconds(tokens, np.full_like(tokens, wl.shared_prefix_tokens))
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
    return Prepared(wl, vt, tuple(profiles), prefill, _prefix_profile(wl, prefill))


def _prefix_profile(wl: Workload, prefill: PrefillModel) -> ContextProfile | None:
    """The shared prefix as a context every request needs (module docstring), kept whole."""
    n = wl.shared_prefix_tokens
    if n == 0:
        return None
    size = n * wl.model.kv_bytes_per_token
    seconds = float(prefill.seconds(np.array([float(n)]), np.zeros(1))[0])
    original = VariantProfile(ORIGINAL_VARIANT, size, 1.0, 0.0)
    return ContextProfile(PREFIX_ID, (original,), float(wl.arrival_s.size), seconds)


@dataclass(frozen=True, slots=True, eq=False)
class Replay:
    """What a replay leaves: the placer (final placements) and, per request, the tier index
    its own context was served from (:data:`MISS`: prefilled), the variant index, and the tier
    index its shared prefix was found in (:data:`MISS`: not cached, or no prefix)."""

    placer: Placer
    tier_hit: IntArray
    variant: IntArray
    prefix_hit: IntArray


def replay(cfg: SimulationConfig, prep: Prepared) -> Replay:
    """Send the workload's requests through a fresh ``cfg.placer`` in order (module doc)."""
    wl, vt = prep.workload, prep.variants
    params = PlacerParams(alpha=cfg.alpha, selection=cfg.selection)
    tier_of = {t.name: i for i, t in enumerate(cfg.tiers)}
    var_of = {name: j for j, name in enumerate(vt.names)}
    seen = FrequencyTracker(cfg.half_life_s) if cfg.frequency == "online" else None
    m = wl.arrival_s.size
    tier_hit = np.full(m, MISS, dtype=np.int64)
    prefix_hit = np.full(m, MISS, dtype=np.int64)
    variant = np.zeros(m, dtype=np.int64)
    unbounded = any(t.capacity_bytes is None for t in cfg.tiers)
    offers = Offers(cfg.offers, cfg.placer, reference_tier=unbounded)
    by_id = {p.context_id: p for p in (*prep.profiles, *filter(None, [prep.prefix]))}
    now = 0.0

    def current(context_id: str) -> ContextProfile:
        """A context's profile as the daemon would give it now (its frequency so far)."""
        p = by_id[context_id]
        if seen is not None:
            p = replace(p, frequency=seen.frequency(context_id, now))
        return offers.offered(p)

    placer = ExecutingPlacer(
        make_placer(cfg.placer, cfg.tiers, params), offers, current, hold_s=cfg.hold_s
    )
    for k, (c, now) in enumerate(
        zip(wl.request_context.tolist(), wl.arrival_s.tolist(), strict=True)
    ):
        profile = _counted(seen, prep.profiles[c], now)
        if placer.where(profile.context_id, now) is None:
            offers.dropped(profile.context_id)
        offered = offers.offered(profile)
        if prep.prefix is not None:
            shared = _use(placer, _counted(seen, prep.prefix, now), now)
            if shared is None:  # all prefilled: the own context is stored again if it is not
                _store(placer, offered, now)
                _served(placer, offers, profile, now)
                continue
            prefix_hit[k] = tier_of[shared.tier]
        where = _use(placer, offered, now)
        if where is not None:
            tier_hit[k] = tier_of[where.tier]
            variant[k] = var_of[where.variant]
        _served(placer, offers, profile, now)
    return Replay(placer.placer, tier_hit, variant, prefix_hit)


def _served(placer: ExecutingPlacer, offers: Offers, profile: ContextProfile, now: float) -> None:
    """A request of ``profile``'s context was served: where that lets the placer choose more of
    its variants (its profile is trusted now, a token-dropped form servable: ``offers.py``),
    the cached context is placed again with them, in the background as the daemon does."""
    before = offers.offered(profile)  # in the form it has now: the insert may have changed it
    offers.served(profile.context_id)
    again = offers.offered(profile)
    cached = placer.where(profile.context_id, now) is not None
    if len(again.variants) != len(before.variants) and cached:
        placer.insert(again, now)


def _counted(seen: FrequencyTracker | None, profile: ContextProfile, now: float) -> ContextProfile:
    """``profile`` with this request counted towards its online frequency (``seen``; ``None``:
    the oracle's, as prepared)."""
    if seen is None:
        return profile
    seen.record(profile.context_id, now)
    return replace(profile, frequency=seen.frequency(profile.context_id, now))


@dataclass(frozen=True, slots=True)
class _Cached:
    """Where a request found a context: its tier and variant."""

    tier: str
    variant: str


def _use(placer: ExecutingPlacer, profile: ContextProfile, now: float) -> _Cached | None:
    """Where a request loads ``profile``'s context from (a lookup, then its load), or ``None``:
    not cached (first use, evicted or dropped), so prefilled and offered to the placer again."""
    where = placer.found(profile.context_id, now)
    if where is None or where.tier is None:
        placer.insert(profile, now)  # prefilled, so stored again
        return None
    placer.load(profile, now)
    return _Cached(where.tier, where.variant)


def _store(placer: ExecutingPlacer, profile: ContextProfile, now: float) -> None:
    """A prefilled context's KV arrives: offered to the placer unless it is cached already
    (LMCache stores only the chunks it lacks)."""
    if placer.where(profile.context_id, now) is None:
        placer.insert(profile, now)


def run_simulation(cfg: SimulationConfig, prepared: Prepared | None = None) -> SimulationResult:
    """Replay the workload's requests through ``cfg.placer`` and measure every request."""
    prep = prepared or prepare(cfg)
    done = replay(cfg, prep)
    return _measure(cfg, prep, done)


def _measure(cfg: SimulationConfig, prep: Prepared, done: Replay) -> SimulationResult:
    wl, vt = prep.workload, prep.variants
    ctx = wl.request_context
    query = wl.query_tokens.astype(np.float64)
    tokens = wl.context_tokens[ctx].astype(np.float64)
    service = prep.prefill.seconds(tokens + query, np.zeros_like(query))
    new = tokens + query  # tokens each request prefills: all of a miss's, a hit's query
    quality = np.ones(ctx.size)
    served = done.tier_hit.copy()
    bw = np.array([tier.load_bandwidth_bytes_per_s for tier in cfg.tiers])
    overhead = np.array([tier.load_overhead_s for tier in cfg.tiers])
    shared = float(wl.shared_prefix_tokens)
    prefix_bytes = shared * wl.model.kv_bytes_per_token
    hit = np.flatnonzero(done.tier_hit >= 0)
    c, v, t = ctx[hit], done.variant[hit], done.tier_hit[hit]
    load = load_seconds(vt.size_bytes[c, v], vt.restore_s[c, v], bw[t], overhead[t])
    if shared:  # the prefix's load too; its tier's overhead once when both share a tier
        pt = done.prefix_hit[hit]
        load = load + prefix_bytes / bw[pt] + np.where(pt == t, 0.0, overhead[pt])
    after = prep.prefill.seconds(query[hit], vt.kept_tokens[c, v] + shared)
    loaded = load + after
    if cfg.recompute_slower_loads:  # the daemon's rule, on the prefill the load saves
        slower = _recomputed(load, service[hit] - after)
        served[hit[slower]] = RECOMPUTED
        hit, loaded, c, v = hit[~slower], loaded[~slower], c[~slower], v[~slower]
    service[hit] = loaded
    new[hit] = query[hit]
    quality[hit] = vt.quality[c, v]
    if shared:
        _prefix_only(cfg, prep, done, service, served, new_tokens=new)
    keep = wl.measured
    s, q, th = service[keep], quality[keep], served[keep]
    rates = {tier.name: float(np.mean(th == i)) for i, tier in enumerate(cfg.tiers)}
    rates["recompute"] = float(np.mean(th == RECOMPUTED))
    rates["miss"] = float(np.mean(th == MISS))
    if shared:
        rates["prefix"] = float(np.mean(th == PREFIX))
        rates["shared_prefix_cached"] = float(np.mean(done.prefix_hit[keep] >= 0))
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
        new_tokens=new[keep],
    )


def _prefix_only(
    cfg: SimulationConfig,
    prep: Prepared,
    done: Replay,
    service: FloatArray,
    served: IntArray,
    *,
    new_tokens: FloatArray,
) -> None:
    """The requests that found only the shared prefix cached: its bytes' load, then the
    prefill of their own tokens and query after it (``service`` holds their full prefill,
    which wins when it is faster and ``recompute_slower_loads``); updates ``service``,
    ``served`` and ``new_tokens``.

    The tier's per-load overhead is not added. A calibrated tier's overhead is fitted from
    whole hits as what they cost beyond their bytes and their query's prefill on the prefill
    line; a request that prefills its own tokens after the prefix did not pay it: beside
    seed1-sp1024 of issue 30's matrix the requests that found only the prefix took, alone,
    1.12-1.22 s (LMCache, lru, EvicPress; 768 own tokens and a query) where the line gives
    1.18 s for their new tokens and the fitted overhead added 0.19 s (LMCache logged 26 ms
    to retrieve the prefix), and the queue behind them turned that into lru predicted at
    1.43x its measured mean TTFT."""
    wl = prep.workload
    only = np.flatnonzero((done.tier_hit == MISS) & (done.prefix_hit >= 0))
    pt = done.prefix_hit[only]
    bw = np.array([tier.load_bandwidth_bytes_per_s for tier in cfg.tiers])[pt]
    shared = float(wl.shared_prefix_tokens)
    own = wl.own_tokens[wl.request_context[only]].astype(np.float64)
    new = own + wl.query_tokens[only].astype(np.float64)
    size = np.full_like(new, shared * wl.model.kv_bytes_per_token)
    load = load_seconds(size, np.zeros_like(new), bw, 0.0)
    after = prep.prefill.seconds(new, np.full_like(new, shared))
    loaded = load + after
    if cfg.recompute_slower_loads:
        slower = _recomputed(load, service[only] - after)
    else:
        slower = np.zeros(only.size, bool)
    served[only[slower]] = RECOMPUTED
    served[only[~slower]] = PREFIX
    service[only[~slower]] = loaded[~slower]
    new_tokens[only[~slower]] = new[~slower]


def _recomputed(load_s: FloatArray, saved_s: FloatArray) -> npt.NDArray[np.bool_]:
    """Per request: recomputed rather than loaded, by the daemon's own rule
    (:func:`kvtierd.utility.loaded_prefix`, one candidate each: the whole cached context,
    margin :data:`~kvtierd.utility.LOAD_MARGIN`); ``saved_s``: the prefill its load saves."""
    recomputed: npt.NDArray[np.bool_] = loaded_prefix(load_s[:, None], saved_s[:, None]) == 0
    return recomputed
