"""The headline's statistics (benchmarks/e2e/e2e_stats.py, issue 30), on numbers worked by hand."""

from __future__ import annotations

import math

import numpy as np
import pytest

from benchmarks.e2e.e2e_stats import (
    Interval,
    Timed,
    across_seeds,
    bootstrap,
    ceiling,
    ratio_bootstrap,
    wilson,
)


def test_bootstrap_interval_of_a_mean_is_about_two_standard_errors() -> None:
    xs = [float(i) for i in range(100)]  # mean 49.5, standard error 2.90
    got = bootstrap(xs, "mean", resamples=4000, seed=1)
    assert got.point == 49.5
    assert 49.5 - 2 * 2.9 - 0.8 < got.low < 49.5 - 2 * 2.9 + 0.8
    assert 49.5 + 2 * 2.9 - 0.8 < got.high < 49.5 + 2 * 2.9 + 0.8
    assert bootstrap(xs, "p90").point == 89.0  # nearest rank, as bench_e2e's _pct
    assert bootstrap([0.7] * 20, "p50") == Interval(0.7, 0.7, 0.7)  # nothing varies
    assert bootstrap(xs, seed=3) == bootstrap(xs, seed=3)  # deterministic


@pytest.mark.parametrize(
    ("xs", "stat", "match"),
    [([], "mean", "at least one value"), ([1.0], "p99", "stat must be one of"),
     ([1.0, math.nan], "mean", "finite")],
)  # fmt: skip
def test_bootstrap_refuses_what_has_no_interval(xs: list[float], stat: str, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        bootstrap(xs, stat)


def _run(kinds_ttfts: list[tuple[str, float]]) -> list[Timed]:
    trace = [(0, 1024), (1, 2048), (0, 1024), (1, 2048), (0, 1024)]
    return [Timed(c, n, k, t) for (c, n), (k, t) in zip(trace, kinds_ttfts, strict=True)]


def test_ceiling_is_first_misses_then_the_fastest_hits() -> None:
    runs = {
        "prefill": _run(
            [("miss", 2.0), ("miss", 4.0), ("miss", 2.2), ("miss", 4.2), ("miss", 1.8)]
        ),
        "fast": _run([("miss", 2.0), ("miss", 4.0), ("hit", 0.5), ("hit", 0.9), ("hit", 0.7)]),
        "slow": _run([("miss", 2.0), ("miss", 4.0), ("hit", 0.6), ("hit", 0.8), ("hit", 0.6)]),
    }
    miss_1k, miss_2k = (2.0 + 2.2 + 1.8 + 2.0 + 2.0) / 5, (4.0 + 4.2 + 4.0 + 4.0) / 4
    hit_1k, hit_2k = min(0.6, 0.6), min(0.9, 0.8)  # medians per system: fast 0.6, slow 0.6
    assert ceiling(runs) == pytest.approx((miss_1k + miss_2k + hit_1k + hit_2k + hit_1k) / 5)
    # context 0 asked in the warm-up: its first timed request is a hit at best
    assert ceiling(runs, warmed={0}) == pytest.approx(
        (hit_1k + miss_2k + hit_1k + hit_2k + hit_1k) / 5
    )


def test_ceiling_refuses_what_it_cannot_read() -> None:
    with pytest.raises(ValueError, match="at least one system"):
        ceiling({})
    only_misses = {"prefill": _run([("miss", 2.0)] * 5)}
    with pytest.raises(ValueError, match="no hit of a 1024-token context"):
        ceiling(only_misses)
    b = _run([("miss", 1.0)] * 5)
    other = {"a": _run([("miss", 1.0)] * 5), "b": [b[1], b[0], *b[2:]]}
    with pytest.raises(ValueError, match="system 'b' served another trace"):
        ceiling(other)


def test_across_seeds_is_a_t_interval() -> None:
    got = across_seeds([1.4, 1.5, 1.6])  # sd 0.1, t(0.975, 2 dof) = 4.303
    half = 4.3027 * 0.1 / math.sqrt(3)
    assert got.point == pytest.approx(1.5)
    assert got.low == pytest.approx(1.5 - half, abs=1e-4)
    assert got.high == pytest.approx(1.5 + half, abs=1e-4)
    one = across_seeds([1.2])
    assert one.point == 1.2 and math.isnan(one.low) and str(one) == "1.200"
    with pytest.raises(ValueError, match="at least one seed"):
        across_seeds([])
    with pytest.raises(ValueError, match="finite"):
        across_seeds([1.0, math.inf])


def test_ratio_bootstrap_is_paired_over_requests() -> None:
    # the same requests under two systems: the baseline is twice as slow on every request
    # but requests differ tenfold among themselves; pairing keeps the ratio's interval tight
    rng = np.random.default_rng(3)
    ours = rng.uniform(0.1, 1.0, size=200)
    base = 2.0 * ours
    r = ratio_bootstrap(base.tolist(), ours.tolist())
    assert r.point == pytest.approx(2.0)
    assert r.low == pytest.approx(2.0) and r.high == pytest.approx(2.0)
    # with noise the interval covers the point and has width
    noisy = base * rng.uniform(0.8, 1.2, size=200)
    r = ratio_bootstrap(noisy.tolist(), ours.tolist())
    assert r.low < r.point < r.high and r.high - r.low > 0.02


@pytest.mark.parametrize(
    ("base", "ours", "match"),
    [
        ([1.0], [1.0, 2.0], "same requests"),
        ([], [], "at least one"),
        ([1.0], [0.0], "positive"),
        ([math.nan], [1.0], "finite"),
    ],
)
def test_ratio_bootstrap_refuses_what_has_no_ratio(
    base: list[float], ours: list[float], match: str
) -> None:
    with pytest.raises(ValueError, match=match):
        ratio_bootstrap(base, ours)


def test_wilson_interval_of_a_share() -> None:
    # textbook values (Newcombe 1998, Table I): 81 of 263, and the edges 0 and n of 10
    got = wilson(81, 263)
    assert got.point == pytest.approx(81 / 263)
    assert (got.low, got.high) == pytest.approx((0.2553, 0.3662), abs=1e-4)
    assert (wilson(0, 10).low, wilson(0, 10).high) == pytest.approx((0.0, 0.2775), abs=1e-4)
    assert (wilson(10, 10).low, wilson(10, 10).high) == pytest.approx((0.7225, 1.0), abs=1e-4)
    assert wilson(5, 10).low == pytest.approx(1 - wilson(5, 10).high)  # symmetric about 1/2
    # issue 39's seed 7: 110 and 131 identical answers of 150 do not overlap
    assert wilson(110, 150).high < wilson(131, 150).low
    with pytest.raises(ValueError, match="at least one request"):
        wilson(0, 0)
    with pytest.raises(ValueError, match=r"within \[0, 3\]"):
        wilson(4, 3)
