"""Tables fitted on labelled contexts of the real model (SmolLM2-135M-Instruct), with their
provenance: the calibration from ``query_attention``'s raw score to the share of questions
answered unchanged, and the per-variant prior (the labels' mean), the floor every estimate is
judged against (DESIGN.md §3.11). Data, not code: refit them with the commands named below.
"""

from __future__ import annotations

import bisect
from collections.abc import Sequence

from kvtierd.variants import parse_variant

CALIBRATION: tuple[tuple[float, float], ...] = (
    (0.6479, 0.1298),
    (0.7477, 0.2939),
    (0.8112, 0.3969),
    (0.842, 0.6489),
    (0.8814, 0.7252),
    (0.9196, 0.8244),
    (0.9397, 0.9084),
    (0.9802, 0.9237),
    (0.9965, 1.0),
    (1.0, 1.0),
)
"""``(raw, quality)`` knots, raw ascending, quality non-decreasing; linear between knots.
Fitted on the exact-match labels of benchmarks/data/quality_labels.jsonl (65 cases of 1k tokens,
SmolLM2-135M-Instruct, 20 variants each) against ``raw`` of the default reading (every fifth
layer, the question's pass in bfloat16: ``query_attention/question/stride5-bf16`` of
benchmarks/data/estimator_cost_strides.jsonl): equal-count bins made monotone (``python -m
benchmarks.quality.bench_estimators --constants --constants-of query_attention/question/stride5-bf16
--out benchmarks/data/estimator_cost_strides.jsonl``, 2026-11-26)."""

COVERAGE_CALIBRATION: tuple[tuple[float, float], ...] = (
    (0.1671, 0.0778),
    (0.221, 0.0877),
    (0.271, 0.2251),
    (0.3326, 0.2477),
    (0.3909, 0.2663),
    (0.4395, 0.2974),
    (0.4873, 0.3149),
    (0.5847, 0.3246),
    (1.0, 1.0),
)
"""``(coverage, quality)`` knots for ``first_put="coverage"`` (:mod:`.coverage`, 4-grams, every
fifth layer): the exact-match share of the token-dropping variants (knorm@0.7/0.5,
keydiff@0.7/0.5, snapkv@0.5) against their coverage on the *fit half* (even seeds, 46
contexts) of benchmarks/data/context_labels.jsonl (SmolLM2-135M-Instruct, bfloat16), equal-count
bins made monotone, and coverage 1 (every entry kept) answering as the original (``python -m
benchmarks.quality.bench_context_ranking --constants``, 2026-11-27). These contexts lose far
more answers to token dropping than the needle cases :data:`PRIOR` comes from (knorm@0.5: 0.06
against 0.52): the two label sets disagree on the level, which the equal-weight blend splits."""

PRIOR: dict[str, tuple[tuple[float, float], ...]] = {
    "int4": ((1.0, 0.923),),
    "int8": ((1.0, 0.985),),
    "keydiff": ((0.1, 0.169), (0.3, 0.662), (0.6, 0.762), (0.9, 0.862)),
    "knorm": ((0.1, 0.015), (0.3, 0.077), (0.5, 0.523), (0.7, 0.723), (0.9, 0.892)),
    "knorm+int8": ((0.1, 0.015), (0.3, 0.077), (0.5, 0.523), (0.7, 0.738), (0.9, 0.892)),
    "streamingllm": ((0.1, 0.138), (0.25, 0.215), (0.5, 0.585)),
}
"""Per method (``Variant.method_name``), ``(ratio, share of questions answered unchanged)``
knots, ratio ascending: the mean exact-match label per method and ratio over the same 65
cases (ratios labelled on 5 cases or more, made non-decreasing in the ratio; same command)."""


def prior_quality(variants: Sequence[str]) -> dict[str, float] | None:
    """Each variant's share from :data:`PRIOR` (linear in the ratio between its knots, clamped
    at the ends); ``None`` when a variant's method has none (the caller probes instead)."""
    out = {}
    for v in variants:
        parsed = parse_variant(v)
        if parsed.method_name == "none":
            out[v] = 1.0
            continue
        knots = PRIOR.get(parsed.method_name)
        if knots is None:
            return None
        out[v] = calibrate(parsed.ratio, knots)
    return out


def calibrate(raw: float, knots: Sequence[tuple[float, float]] | None = None) -> float:
    """``raw`` through the piecewise-linear monotone map ``knots`` (default
    :data:`CALIBRATION`, clamped at its ends)."""
    knots = CALIBRATION if knots is None else knots
    xs = [x for x, _ in knots]
    i = bisect.bisect_right(xs, raw)
    if i == 0:
        return knots[0][1]
    if i == len(knots):
        return knots[-1][1]
    (x0, y0), (x1, y1) = knots[i - 1], knots[i]
    return y0 + (y1 - y0) * (raw - x0) / (x1 - x0)
