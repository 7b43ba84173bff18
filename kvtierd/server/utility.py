"""The utility table ``DescribeContext`` shows: every (variant, tier) option of a context and
``dropped``, priced by EvicPress's utility (:mod:`kvtierd.utility`, §4.2)."""

from __future__ import annotations

from dataclasses import dataclass

from kvtierd.engine import Engine
from kvtierd.engine.state import ContextRecord
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


def utility_table(engine: Engine, ctx: ContextRecord) -> list[Option]:
    """Best first. TTFT of a stored option = bytes / the tier's measured load bandwidth + its
    per-load overhead + the variant's restore cost; of ``dropped`` = the context's prefill."""
    profile = engine.placing.profile(ctx)
    alpha = engine.policy.alpha
    options = []
    for tier in engine.placing.tier_models():
        for v in profile.variants:
            if tier.capacity_bytes is not None and v.size_bytes > tier.capacity_bytes:
                continue
            ttft = load_ttft_s(float(v.size_bytes), v.restore_s, tier)
            value = utility(alpha, v.quality, ttft, profile.frequency)
            options.append(Option(v.variant, tier.name, v.size_bytes, v.quality, ttft, value))
    drop = dropped_utility(alpha, profile.prefill_s, profile.frequency)
    options.append(Option(ORIGINAL_VARIANT, "", 0, 1.0, profile.prefill_s, drop))
    return sorted(options, key=lambda o: -o.utility)


def placement_reason(engine: Engine, ctx: ContextRecord, table: list[Option]) -> str:
    where = engine.index.placement_of(ctx)
    chosen = next(
        (o for o in table if o.variant == where.variant and o.tier == (where.tier or "")), None
    )
    name = engine.placing.name
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
    if why := engine.profiling.servable.why.get(ctx.context_id):
        text += f"; token-dropped variants left out until they can be served ({why})"
    if failed := engine.profiling.failed_why.get(ctx.context_id):
        text += f"; not profiled, set aside until it changes: {failed}"
    return text + _untrusted(engine, ctx)


def _untrusted(engine: Engine, ctx: ContextRecord) -> str:
    """Why a profiled context's qualities are not in the table (the confidence rule)."""
    profiler = engine.profiling.profiler
    record = engine.profiling.record(ctx.context_id)
    if profiler is None or record is None or profiler.trusted(ctx.context_id):
        return ""
    return (
        f"; its profile is from {record.num_queries} queries, below profiling.min_queries "
        f"{engine.policy.min_queries}, not each asked twice in that many requests: not used "
        "until it has more (kvtierctl profile status)"
    )
