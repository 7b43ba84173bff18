"""The price of an option: EvicPress's utility and its TTFT terms, written once (§4.2).

    Util(variant, tier) = (alpha * quality - TTFT) * frequency
    TTFT of a stored variant = size_bytes / load_bandwidth_bytes_per_s + load_overhead_s
                               + restore_s (dequantize, rotate)
    TTFT of ``dropped`` = the context's prefill, at quality 1.0 (recomputed KV is exact)

The query's own prefill is the same in every option of a context, so it shifts a context's
utilities by a constant and never changes a decision: it is left out here (the simulator adds it
to the TTFT it reports). ``alpha`` is in 1/seconds (the policy's quality weight).

Every place that prices an option — the placers' dense tables (:mod:`kvtierd.policies.model`),
``DescribeContext``'s table, the write plans, the simulator's replay — calls these functions,
on floats or on numpy arrays alike (the same IEEE operations in the same order, so a table and
a single option agree to the bit).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import TypeVar

import numpy as np
import numpy.typing as npt

from kvtierd.types import TierModel

Value = TypeVar("Value", float, npt.NDArray[np.float64])
"""A number or an array of them: every function here is elementwise."""


def check_tiers(tiers: Sequence[TierModel]) -> None:
    """Refuse a tier the TTFT formula cannot price: a load bandwidth that is not a finite
    number > 0 (an unmeasured 0 made every load of the tier infinitely slow, and a placer
    dropped what it held), an overhead that is not finite and >= 0, a negative capacity."""
    for tier in tiers:
        bw, overhead = tier.load_bandwidth_bytes_per_s, tier.load_overhead_s
        if not (math.isfinite(bw) and bw > 0):
            raise ValueError(
                f"tier {tier.name!r}: load_bandwidth_bytes_per_s must be a finite number > 0, "
                f"got {bw!r}"
            )
        if not (math.isfinite(overhead) and overhead >= 0):
            raise ValueError(
                f"tier {tier.name!r}: load_overhead_s must be a finite number >= 0, "
                f"got {overhead!r}"
            )
        if tier.capacity_bytes is not None and tier.capacity_bytes < 0:
            raise ValueError(
                f"tier {tier.name!r}: capacity_bytes must be >= 0 or None (unbounded), "
                f"got {tier.capacity_bytes!r}"
            )


def load_seconds(
    size_bytes: Value,
    restore_s: Value,
    bandwidth_bytes_per_s: Value | float,
    overhead_s: Value | float,
) -> Value:
    """Seconds to make a stored variant usable: transfer + per-load overhead + restore.

    The tier's terms may be arrays too (the simulator prices each request at the tier it hit);
    :func:`load_ttft_s` is the form that takes a checked tier."""
    return size_bytes / bandwidth_bytes_per_s + overhead_s + restore_s


def load_ttft_s(size_bytes: Value, restore_s: Value, tier: TierModel) -> Value:
    """:func:`load_seconds` in ``tier``; raises ``ValueError`` for a tier whose bandwidth or
    overhead cannot be priced (:func:`check_tiers`) instead of dividing by zero."""
    check_tiers((tier,))
    return load_seconds(
        size_bytes, restore_s, tier.load_bandwidth_bytes_per_s, tier.load_overhead_s
    )


def utility(alpha: float, quality: Value | float, ttft_s: Value, frequency: Value) -> Value:
    """``(alpha * quality - ttft_s) * frequency`` (module docstring)."""
    return (alpha * quality - ttft_s) * frequency


def dropped_utility(alpha: float, prefill_s: Value, frequency: Value) -> Value:
    """The utility of not caching: recomputed in ``prefill_s`` at quality 1.0."""
    return utility(alpha, 1.0, prefill_s, frequency)
