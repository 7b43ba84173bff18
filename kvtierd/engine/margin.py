"""How close a placer's decision on a context is, in quality (issue 26, item 4).

The cheap estimator's qualities are off by up to its error (``profiling.estimator_error``); an
expensive refinement (``answer``, ``served``) can change a decision only where the option the
placer chose for a context and the next best are closer than that. EvicPress prices an option
``(alpha * quality - ttft_s) * frequency`` (§4.2, ``kvtierd/utility.py``), so two options'
utilities differ by ``alpha * frequency`` times::

    margin = (quality_chosen - quality_other) - (ttft_chosen - ttft_other) / alpha

— the quality error that would make them trade places. Only pairs in which an estimated
quality decides count: the original and ``dropped`` (recomputed) are exact, and the same
variant in another tier has the same quality, so neither choice is a question of quality.

Read from the placer's view, never from inside it: the chosen option is where the placer has
the context now, and every other option of its profile that fits the room its tier has left
(what the placer has placed there, less what the context holds there itself) is priced as the
placer prices it. An option that would need another context moved out is left out: a
refinement of this context alone cannot bring that about.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

from kvtierd.types import ORIGINAL_VARIANT, ContextProfile, Placement, TierModel
from kvtierd.utility import load_ttft_s


def room_bytes(
    profile: ContextProfile, chosen: Placement, tiers: Sequence[TierModel], used: Sequence[float]
) -> list[float]:
    """Per tier, the bytes the context could take without moving another: the tier's capacity
    less what is placed there (``used``, the placer's figures), plus what the context holds
    there itself; ``inf`` for an unbounded tier."""
    sizes = {v.variant: v.size_bytes for v in profile.variants}
    own = 0.0 if chosen.dropped else float(sizes.get(chosen.variant, 0))
    return [
        math.inf if t.capacity_bytes is None
        else t.capacity_bytes - u + (own if t.name == chosen.tier else 0.0)
        for t, u in zip(tiers, used, strict=True)
    ]  # fmt: skip


def decision_margin(
    profile: ContextProfile,
    chosen: Placement,
    tiers: Sequence[TierModel],
    alpha: float,
    room: Sequence[float] | None = None,
) -> float:
    """The smallest quality margin between ``chosen`` and another option of ``profile`` that
    fits ``room`` (:func:`room_bytes`; ``None``: every tier is free) and whose order an
    estimated quality decides (module docstring); ``inf`` when no such pair exists (nothing
    lossy to choose). Negative when an option the placer did not choose prices higher."""
    free = [math.inf] * len(tiers) if room is None else room
    options = _options(profile, tiers, free)
    key = ("", "") if chosen.dropped else (chosen.variant, chosen.tier or "")
    if key not in options:
        return math.inf
    quality, ttft = options.pop(key)
    exact = _exact(key[0])
    margins = [
        (quality - q) - (ttft - t) / alpha
        for (variant, _), (q, t) in options.items()
        # the same variant elsewhere has the same quality: a better estimate moves both
        if variant != key[0] and not (exact and _exact(variant))
    ]
    return min(margins, default=math.inf)


def _exact(variant: str) -> bool:
    """The original and a recompute (``""``: dropped) have quality 1, not an estimate."""
    return variant in (ORIGINAL_VARIANT, "")


def _options(
    profile: ContextProfile, tiers: Sequence[TierModel], room: Sequence[float]
) -> dict[tuple[str, str], tuple[float, float]]:
    """``(variant, tier) -> (quality, ttft_s)`` of every option that fits ``room``,
    ``("", "")`` for dropped."""
    out = {("", ""): (1.0, profile.prefill_s)}
    for v in profile.variants:
        for tier, free in zip(tiers, room, strict=True):
            if v.size_bytes <= free:
                ttft = load_ttft_s(v.size_bytes, v.restore_s, tier)
                out[(v.variant, tier.name)] = (v.quality, ttft)
    return out
