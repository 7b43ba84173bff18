"""The price of an option: EvicPress's utility and its TTFT terms, written once (§4.2).

    Util(variant, tier) = (alpha * quality - TTFT) * frequency
    TTFT of a stored variant = size_bytes / load_bandwidth_bytes_per_s + load_overhead_s
                               + restore_s (dequantize, rotate)
    TTFT of ``dropped`` = the context's prefill, at quality 1.0 (recomputed KV is exact)

Load or recompute (issue 41): a lookup that finds chunks loads the longest prefix of them whose
load beats prefilling its tokens by :data:`LOAD_MARGIN` (:func:`loaded_prefix`); the daemon's
Lookup and the simulator's replay both decide with it, on the same predicted costs.

The query's own prefill is the same in every option of a context, so it shifts a context's
utilities by a constant and never changes a decision: it is left out here (the simulator adds it
to the TTFT it reports). ``alpha`` is in 1/seconds (the policy's quality weight).

Every place that prices an option — the placers' dense tables (:mod:`kvtierd.policies.model`),
``DescribeContext``'s table, the write advice, the simulator's replay — calls these functions,
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

LOAD_MARGIN = 0.1
"""A load must beat recomputing its tokens by this share of its own predicted time: the load
side of :func:`loaded_prefix` is charged ``(1 + LOAD_MARGIN) * load_s``. A load is priced
from fits of past reads that a busy tier can miss by a lot (a 40 s disk hit against a 0.9 s
prefill, issue 41), while a recompute's cost is bounded by what the fit of vLLM's prefill
says; near a tie recomputing is the safer side."""

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


def loaded_prefix(
    load_s: npt.ArrayLike, saved_s: npt.ArrayLike, margin: float = LOAD_MARGIN
) -> npt.NDArray[np.int64]:
    """How many leading chunks of what a lookup found to load; the rest are recomputed.

    Along the last axis, entry ``k`` prices loading the first ``k + 1`` chunks found:
    ``load_s[..., k]`` the seconds to load them (:func:`load_seconds`, summed over the
    chunks, each tier's overhead once), ``saved_s[..., k]`` the seconds of prefill that load
    saves (their tokens at the server's prefill speed). Both are cumulative, so
    non-decreasing. The answer (per row) is the ``k + 1`` that maximises
    ``saved_s - (1 + margin) * load_s`` when that is >= 0, else 0 (recompute everything);
    among equal gains the longer prefix (a tie loads, as a lookup did before the rule). One
    candidate per row (``[..., 1]``) is the whole-context choice: load iff
    ``(1 + margin) * load_s <= saved_s``."""
    if not (math.isfinite(margin) and margin >= 0):
        raise ValueError(f"the load margin must be a finite number >= 0, got {margin!r}")
    load = np.asarray(load_s, dtype=np.float64)
    saved = np.asarray(saved_s, dtype=np.float64)
    if load.shape != saved.shape or load.ndim == 0:
        raise ValueError(
            f"load_s and saved_s must be arrays of one shape with a candidates axis, got "
            f"{load.shape} and {saved.shape}"
        )
    gain = saved - (1.0 + margin) * load
    gain = np.where(np.isnan(gain), -np.inf, gain)  # an unpriceable side never wins
    zeros = np.zeros((*gain.shape[:-1], 1))
    gains = np.concatenate([zeros, gain], axis=-1)  # entry 0: load nothing
    last = gains.shape[-1] - 1
    best: npt.NDArray[np.int64] = last - np.argmax(gains[..., ::-1], axis=-1)  # the longest max
    return best
