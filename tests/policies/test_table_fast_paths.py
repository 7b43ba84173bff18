"""Issue 28's faster table building and per-tier greedy give exactly what the plain code gave:
the utilities bit for bit, and the same placements, on random padded instances."""

from __future__ import annotations

import numpy as np
import pytest

from kvtierd.policies import knapsack, model
from kvtierd.policies.exact import Problem
from kvtierd.policies.knapsack import _Points, _size_order, greedy_solve
from kvtierd.policies.model import UtilityTable
from kvtierd.policies.refine import lagrangian_bound
from kvtierd.types import TierModel
from kvtierd.utility import load_ttft_s, utility


def _instance(seed: int, n: int = 300, v: int = 12):
    rng = np.random.default_rng(seed)
    k = rng.integers(1, v + 1, n)
    valid = np.arange(v)[None, :] < k[:, None]
    ratio = rng.uniform(0.05, 1.0, (n, v))
    if seed % 2:  # rows in different size orders: the (n, V) order path
        ratio = np.sort(ratio, axis=1)[:, ::-1]
    size = np.where(valid, rng.integers(1, 17, n)[:, None] * 1e6 * ratio, 0.0)
    quality = np.where(valid, rng.uniform(0.2, 1.0, (n, v)), 1.0)
    restore = np.where(valid, rng.uniform(0.0, 0.01, (n, v)), 0.0)
    total = float(size.max(axis=1).sum())
    tiers = [
        TierModel("cpu", int(0.05 * total), 10e9, 1e-4),
        TierModel("ssd", int(0.3 * total), 2e9, 1e-3),
        TierModel("disk", [None, 4 * int(total), int(0.4 * total)][seed % 3], 1e9, 2e-3),
    ]
    freq = rng.zipf(1.5, n).clip(max=1000).astype(np.float64)
    pinned = rng.random(n) < 0.02
    table = UtilityTable.from_arrays(
        tiers=tiers, alpha=1.0, size_bytes=size, quality=quality, restore_s=restore,
        frequency=freq, prefill_s=rng.uniform(0.01, 0.5, n), valid=valid, pinned=pinned,
    )  # fmt: skip
    return table, tiers, size, quality, restore, freq, valid


def _reference_util(tiers, size, quality, restore, freq, *, valid):
    """The utilities as written before issue 28's rewrite (one expression per tier)."""
    util = np.empty((*size.shape, len(tiers)))
    for t, tier in enumerate(tiers):
        util[:, :, t] = utility(1.0, quality, load_ttft_s(size, restore, tier), freq[:, None])
    util[~valid] = -np.inf
    return util


def _reference_pareto(xs, ys, var, leave):
    """``knapsack._pareto`` as it was: every cell initialised."""
    m = xs.shape[0]
    prev = np.empty_like(ys)
    prev[:, 0] = leave
    np.maximum.accumulate(ys[:, :-1], axis=1, out=prev[:, 1:])
    np.maximum(prev, leave[:, None], out=prev)
    keep = ys > prev
    r, c = np.nonzero(keep)
    count = np.bincount(r, minlength=m)
    width = int(count.max()) + 1 if m else 1
    col = np.arange(r.size) - (np.cumsum(count) - count)[r] + 1
    cx = np.zeros((m, width))
    cy = np.full((m, width), -np.inf)
    cv = np.full((m, width), -1, dtype=np.int64)
    cy[:, 0] = leave
    cx[r, col], cy[r, col], cv[r, col] = xs[r, c], ys[r, c], var[r, c]
    return cx, cy, cv, count.astype(np.int64)


@pytest.mark.parametrize("seed", range(8))
@pytest.mark.parametrize("block", [4096, 7])
def test_utilities_are_bit_for_bit_the_plain_expression(
    seed: int, block: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Also priced a few rows at a time (``block`` 7: 43 blocks, the last one short), with
    each cell's best tier beside them."""
    monkeypatch.setattr(model, "UTILITY_BLOCK_ROWS", block)
    _, tiers, size, quality, restore, freq, valid = _instance(seed)
    expected = _reference_util(tiers, size, quality, restore, freq, valid=valid)
    best = np.empty(size.shape)
    got = model._utilities(1.0, tiers, size=size, quality=quality, restore_s=restore,
                           frequency=freq, valid=valid, best=best)  # fmt: skip
    assert got.tobytes() == expected.tobytes()
    assert best.tobytes() == expected.max(axis=2).tobytes()


@pytest.mark.parametrize("seed", range(12))
def test_greedy_places_as_the_plain_hull_greedy_did(
    seed: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Sizes sorted once, Pareto cells left unwritten and the all-fit shortcut place every
    context as the plain per-tier hull greedy did (the old ``_pareto``, no shortcut)."""
    table = _instance(seed)[0]
    shortcut = knapsack._when_all_fit
    taken = []

    def spy(*args):
        out = shortcut(*args)
        taken.append(out is not None)
        return out

    monkeypatch.setattr(knapsack, "_when_all_fit", spy)
    fast = greedy_solve(table)
    if seed % 3 == 1:  # a bounded bottom tier that holds everything: the shortcut answers
        assert any(taken)
    monkeypatch.setattr(knapsack, "_when_all_fit", lambda *args: None)
    monkeypatch.setattr(knapsack, "_pareto_in_place", _reference_pareto)
    plain = greedy_solve(table)
    assert np.array_equal(fast.assignment.tier, plain.assignment.tier)
    assert np.array_equal(fast.assignment.variant, plain.assignment.variant)
    assert np.array_equal(fast.assignment.dropped, plain.assignment.dropped)
    assert np.array_equal(fast.prices, plain.prices)


def test_pareto_keeps_the_plain_points() -> None:
    """The compacted points agree with the plain code's wherever they are read."""
    table = _instance(1)[0]
    order = _size_order(table.size_bytes)
    xs, ys, var = _Points(table.util[:, :, 1], table.size_bytes, order).sorted()
    ys = np.where(xs <= float(table.capacity_bytes[1] or 0), ys, -np.inf)
    got = knapsack._pareto(xs, ys, var, table.drop_util)
    want = _reference_pareto(xs, ys, var, table.drop_util)
    kept = np.arange(got[0].shape[1])[None, :] <= got[3][:, None]
    assert np.array_equal(got[3], want[3])
    for a, b in zip(got[:3], want[:3], strict=True):
        assert np.array_equal(a[kept], b[kept])


def test_pareto_in_place_keeps_the_plain_points_and_overwrites_only_its_copy() -> None:
    table = _instance(2)[0]
    order = _size_order(table.size_bytes)
    xs, ys, var = _Points(table.util[:, :, 0], table.size_bytes, order).sorted()
    ys[:, ::7] = -np.inf  # points that do not fit
    want = _reference_pareto(xs, ys, var, table.drop_util)
    kept_ys = ys.copy()
    got = knapsack._pareto(xs, ys, var, table.drop_util)
    assert np.array_equal(ys, kept_ys)  # _pareto leaves its argument alone
    kept = np.arange(got[0].shape[1])[None, :] <= got[3][:, None]
    assert np.array_equal(got[3], want[3])
    for a, b in zip(got[:3], want[:3], strict=True):
        assert np.array_equal(a[kept], b[kept])


@pytest.mark.parametrize("seed", range(4))
def test_points_of_named_rows_are_those_rows_copied(seed: int) -> None:
    """A tier's rows named (issue 28: not copied) sort as the copied rows did."""
    table = _instance(seed)[0]
    rng = np.random.default_rng(seed)
    rows = np.sort(rng.choice(table.n_contexts, 120, replace=False))
    order = _size_order(table.size_bytes)
    util = table.util[:, :, 1]
    for size_sorted in (None, knapsack._sorted_sizes(table.size_bytes)[1]):
        named = _Points(util, table.size_bytes, order, size_sorted, rows)
        copied = _Points(util[rows], table.size_bytes[rows],
                         order if order.ndim == 1 else order[rows],
                         None if size_sorted is None else size_sorted[rows])  # fmt: skip
        assert named.m == rows.size
        for a, b in zip(named.sorted(), copied.sorted(), strict=True):
            assert np.array_equal(a, b)
        sub = named.subset(np.arange(0, rows.size, 3))
        assert np.array_equal(sub.sorted()[1], copied.sorted()[1][::3])


def test_first_best_is_argmax_with_its_ties() -> None:
    rng = np.random.default_rng(5)
    util = np.round(rng.normal(size=(500, 9, 3)), 1)  # many ties within a row
    util[::17] = -np.inf  # rows with no option
    util[3, 4:, 1] = util[3, :, 1].max() + 1.0
    for t in range(3):
        view = util[:, :, t]
        assert np.array_equal(knapsack._first_best(view), view.argmax(axis=1))


def test_unfit_points_are_masked_as_the_plain_where() -> None:
    rng = np.random.default_rng(6)
    xs = np.sort(rng.uniform(0, 100, (200, 8)), axis=1)
    ys = rng.normal(size=(200, 8))
    for cap in (5.0, 50.0, 99.0, 1e9):
        got = ys.copy()
        knapsack._mask_unfit(xs, got, cap)
        assert np.array_equal(got, np.where(xs <= cap, ys, -np.inf))


def _plain_bound(problem: Problem, prices: np.ndarray) -> float:
    """``lagrangian_bound`` as written before issue 28."""
    caps = problem.capacity_bytes
    best = problem.drop_util.copy()
    for t in range(problem.util.shape[2]):
        price = float(prices[t]) if np.isfinite(caps[t]) else 0.0
        value = (
            problem.util[:, :, t] - price * problem.size_bytes if price else problem.util[:, :, t]
        )
        value = np.where(problem.size_bytes <= caps[t], value, -np.inf)
        np.maximum(best, value.max(axis=1), out=best)
    finite = np.isfinite(caps)
    return float(best.sum() + np.dot(prices[finite], caps[finite]))


@pytest.mark.parametrize("seed", range(6))
def test_lagrangian_bound_is_the_plain_bound_bit_for_bit(seed: int) -> None:
    table = _instance(seed)[0]
    problem = Problem.of(table)
    largest = float(table.size_bytes.max())
    caps = problem.capacity_bytes.copy()
    if seed % 2:  # tiers smaller than some options: the masked path
        caps[0] = 0.5 * largest
        caps[1] = 0.9 * largest
        problem = Problem(problem.size_bytes, problem.util, problem.drop_util, problem.pinned,
                          caps)  # fmt: skip
    rng = np.random.default_rng(seed)
    for prices in (np.zeros(3), rng.uniform(0, 1e-6, 3), np.array([1e-7, 0.0, 2e-8])):
        assert lagrangian_bound(problem, prices) == _plain_bound(problem, prices)
