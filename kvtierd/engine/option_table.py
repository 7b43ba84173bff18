"""The utility table ``DescribeContext`` shows: every (variant, tier) option of a context and
``dropped``, priced by EvicPress's utility (:mod:`kvtierd.utility`, §4.2)."""

from __future__ import annotations

from dataclasses import dataclass

from kvtierd.engine.index import ContextIndex
from kvtierd.engine.placing import Placing
from kvtierd.engine.profiling.profiling_service import ProfilingService
from kvtierd.engine.state import ContextRecord
from kvtierd.policy_config import PolicyConfig
from kvtierd.types import ORIGINAL_VARIANT
from kvtierd.utility import dropped_utility, load_ttft_s, utility


@dataclass(frozen=True, slots=True)
class Option:
    variant: str
    tier: str  # "" = dropped
    size_bytes: int
    quality: float
    ttft_s: float
    utility: float


def utility_table(placing: Placing, alpha: float, ctx: ContextRecord) -> list[Option]:
    """Best first. TTFT of a stored option = bytes / the tier's measured load bandwidth + its
    per-load overhead + the variant's restore cost; of ``dropped`` = the context's prefill."""
    profile = placing.profile(ctx)
    options = []
    for tier in placing.tier_models():
        for v in profile.variants:
            if tier.capacity_bytes is not None and v.size_bytes > tier.capacity_bytes:
                continue
            ttft = load_ttft_s(float(v.size_bytes), v.restore_s, tier)
            value = utility(alpha, v.quality, ttft, profile.frequency)
            options.append(Option(v.variant, tier.name, v.size_bytes, v.quality, ttft, value))
    drop = dropped_utility(alpha, profile.prefill_s, profile.frequency)
    options.append(Option(ORIGINAL_VARIANT, "", 0, 1.0, profile.prefill_s, drop))
    return sorted(options, key=lambda o: -o.utility)


@dataclass(frozen=True, slots=True)
class ReasonSources:
    """What a placement's reason is read from."""

    index: ContextIndex
    placing: Placing
    profiling: ProfilingService
    policy: PolicyConfig


def placement_reason(of: ReasonSources, ctx: ContextRecord, table: list[Option]) -> str:
    """Why ``ctx`` is where it is, in words, from its row in ``table`` (:func:`utility_table`)."""
    where = of.index.placement_of(ctx)
    chosen = next(
        (o for o in table if o.variant == where.variant and o.tier == (where.tier or "")), None
    )
    name = of.placing.name
    if chosen is None:
        return f"{name}: stored as {where.variant} in {where.tier}"
    best = table[0]
    text = (
        f"{name}: stored as {chosen.variant} in {chosen.tier or 'nowhere (dropped)'}, "
        f"utility {chosen.utility:.4g} (quality {chosen.quality:.3f}, TTFT {chosen.ttft_s:.4g} s)"
    )
    if best is not chosen:
        text += (
            f"; the unconstrained best, {best.variant} in {best.tier or 'dropped'} "
            f"({best.utility:.4g}), does not fit beside the other contexts' choices"
        )
    if ctx.pinned:
        text += "; pinned"
    if why := of.profiling.servable.why.get(ctx.context_id):
        text += f"; token-dropped variants left out until they can be served ({why})"
    if failed := of.profiling.failed_why.get(ctx.context_id):
        text += f"; not profiled, set aside until it changes: {failed}"
    return text + _untrusted(of, ctx)


def _untrusted(of: ReasonSources, ctx: ContextRecord) -> str:
    """Why a profiled context's qualities are not in the table (the confidence rule)."""
    profiler = of.profiling.profiler
    record = of.profiling.record(ctx.context_id)
    if profiler is None or record is None or profiler.trusted(ctx.context_id):
        return ""
    return (
        f"; its profile is from {record.num_queries} queries, below profiling.min_queries "
        f"{of.policy.min_queries}, not each asked twice in that many requests: not used "
        "until it has more (kvtierctl profile status)"
    )
