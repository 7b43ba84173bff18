"""Vectorised greedy for the multi-tier multi-choice knapsack (EvicPress §4.4, Algorithm 1).

Algorithm 1 starts every context at its best configuration in the fastest tier and, while the
tier is over capacity, applies the operation with the least utility drop per byte freed. For one
context, the cheapest-per-byte step down from a point is the edge of the upper concave hull of
its ``(size, utility)`` points, so the whole sequence of greedy steps on a tier is the list of
all contexts' hull edges sorted by slope. This module computes those hulls for all contexts at
once with numpy, takes edges in slope order while they fit (exactly where Algorithm 1 stops),
then fills the capacity left over with further edges that still fit (Algorithm 1 can overshoot:
its last step may free more bytes than needed).

Tiers are solved fastest first. In tier ``t`` a context may also *leave* the tier (size 0) with
the best utility it could get below (any variant in a slower tier, or dropped), ignoring the
capacity of those tiers — the same optimistic estimate Algorithm 1 uses when it moves a context
down. Contexts that leave compete in the next tier. The bottom tier's leave option is dropping.

Cost: ``O(n V log(n V))`` per tier (a sort of the hull edges); 100,000 contexts x 60 variants x
3 tiers take well under a second (``benchmarks/micro/bench_placer.py``).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from kvtierd.policies.exchange import EXCHANGE_MAX, exchange, improve
from kvtierd.policies.model import Assignment, BoolArray, FloatArray, IntArray, UtilityTable

SMALL_INSTANCE = 5000
"""Up to this many contexts :func:`greedy_assign` prices slower tiers and polishes by default."""

LEAVE = -1
"""Choice index meaning "not in this tier" in the per-tier solver's result."""


@dataclass(frozen=True, slots=True, eq=False)
class GreedyResult:
    """The greedy's assignment and the tiers' prices (utility per byte, ``(T,)``) its first
    round found: Lagrange multipliers that give an upper bound on the optimum
    (:func:`kvtierd.policies.refine.lagrangian_bound`)."""

    assignment: Assignment
    prices: FloatArray


def greedy_assign(
    table: UtilityTable,
    rounds: int | None = None,
    max_improve_rounds: int | None = None,
    exchange_max: int | None = None,
) -> Assignment:
    """:func:`greedy_solve`'s assignment."""
    return greedy_solve(table, rounds, max_improve_rounds, exchange_max).assignment


def greedy_solve(
    table: UtilityTable,
    rounds: int | None = None,
    max_improve_rounds: int | None = None,
    exchange_max: int | None = None,
) -> GreedyResult:
    """Place every context by the per-byte greedy, then improve it by local search.

    Round 1 values the option of leaving a tier at the best utility below, as if the slower
    tiers had room. Later rounds charge each byte in a slower tier the marginal utility per byte
    that round 1 found there (its knapsack's Lagrange multiplier), which stops a fast tier from
    pushing out contexts the slower tier cannot hold either. The best round (by true utility)
    is polished by :func:`~kvtierd.policies.exchange.improve` (single-context moves) and, up to
    ``exchange_max`` contexts (default :data:`~kvtierd.policies.exchange.EXCHANGE_MAX`), by the
    pairwise :func:`~kvtierd.policies.exchange.exchange` search.
    """
    # Pricing and polishing matter when contexts are large next to a tier (few contexts); with
    # thousands the greedy is already within 1e-5 of the LP bound, so skip them for speed.
    small = table.n_contexts <= SMALL_INSTANCE
    rounds = (2 if small else 1) if rounds is None else rounds
    max_improve_rounds = (64 if small else 0) if max_improve_rounds is None else max_improve_rounds
    exchange_max = EXCHANGE_MAX if exchange_max is None else exchange_max
    prices: FloatArray = np.zeros(table.n_tiers)
    first: FloatArray | None = None
    best: Assignment | None = None
    best_util = -np.inf
    for _ in range(max(1, rounds)):
        candidate, prices = _cascade(table, prices)
        first = prices if first is None else first
        if max_improve_rounds > 0:
            candidate = improve(table, candidate, max_improve_rounds)
        if table.n_contexts <= exchange_max:
            # Every round's result is a start for the exchange search (they differ where the
            # slower tiers' prices matter); the best local optimum wins.
            candidate = exchange(table, candidate)
        util = candidate.total_utility(table)
        if util > best_util:
            best, best_util = candidate, util
    assert best is not None and first is not None
    return GreedyResult(best, first)


def _cascade(table: UtilityTable, prices: FloatArray) -> tuple[Assignment, FloatArray]:
    """One greedy pass, tier by tier (fastest first); returns it and each tier's multiplier."""
    n, n_tiers = table.n_contexts, table.n_tiers
    new_prices = np.zeros(n_tiers)
    variant = np.zeros(n, dtype=np.int64)
    tier = np.zeros(n, dtype=np.int64)
    dropped = np.ones(n, dtype=bool)
    remaining = np.arange(n)
    # Each row's sizes in size order, gathered once: every tier sorts the same sizes.
    order, size_sorted = _sorted_sizes(table.size_bytes)
    # Best utility in tiers t..T-1 or dropped, for the "leave tier t-1" option.
    below = np.empty((n, n_tiers + 1))
    below[:, n_tiers] = table.drop_util
    for t in range(n_tiers - 1, -1, -1):
        priced = table.util[:, :, t]
        if prices[t]:  # round 1 has no prices: skip an (n, V) temporary per tier
            priced = priced - prices[t] * table.size_bytes
        below[:, t] = np.maximum(below[:, t + 1], priced.max(axis=1))
    for t in range(n_tiers):
        if remaining.size == 0:
            break
        every = remaining.size == n
        # The tier's rows are named, not copied: each (m, V) copy of the utilities or sizes
        # was 48 MB of fresh pages at 100,000 x 60 (issue 28); the sorted gather reads them.
        points = _Points(
            table.util[:, :, t], table.size_bytes, order, size_sorted, None if every else remaining
        )
        leave = below[remaining, t + 1]
        pinned = table.pinned[remaining]
        choice, new_prices[t] = _solve_tier(points, leave, pinned, table.capacity_bytes[t])
        here_mask = choice != LEAVE
        rows = remaining[here_mask]
        variant[rows] = choice[here_mask]
        tier[rows] = t
        dropped[rows] = False
        remaining = remaining[~here_mask]
    return Assignment(variant=variant, tier=tier, dropped=dropped), new_prices


def _size_order(size: FloatArray) -> IntArray:
    """Each row's variant order by size, ascending: ``(V,)`` when one order sorts every row
    (the usual case: variants listed by ratio), else ``(n, V)``."""
    return _sorted_sizes(size)[0]


def _sorted_sizes(size: FloatArray) -> tuple[IntArray, FloatArray]:
    """:func:`_size_order` and the sizes in that order (the gather that checks the shared
    order is that array already: at 100,000 x 60 one 48 MB copy less, issue 28)."""
    if size.shape[0] == 0:
        return np.arange(size.shape[1]), size.copy()
    perm = np.argsort(size[0], kind="stable")
    ranked = np.take(size, perm, axis=1)  # size[:, perm], about twice as fast
    if bool(np.all(ranked[:, 1:] >= ranked[:, :-1])):
        return perm, ranked
    order = np.argsort(size, axis=1, kind="stable")
    return order, np.take_along_axis(size, order, axis=1)


@dataclass(frozen=True, slots=True, eq=False)
class _Points:
    """One tier's points: utility and size ``(n, V)``, size order, of the ``m`` rows ``rows``
    (``None``: all ``n``)."""

    util: FloatArray
    size: FloatArray
    order: IntArray  # (V,) for all rows, or (n, V)
    size_sorted: FloatArray | None = None  # size in that order, when the caller has it
    rows: IntArray | None = None

    @property
    def m(self) -> int:
        return self.util.shape[0] if self.rows is None else self.rows.size

    def sorted(self) -> tuple[FloatArray, FloatArray, IntArray]:
        """Sizes, utilities and variant indices of the rows, each by size ascending (the
        utilities a fresh array, which the caller may write)."""
        rows, order = self.rows, self.order
        if order.ndim == 2 and rows is not None:
            order = order[rows]
        if self.size_sorted is not None:
            xs = self.size_sorted if rows is None else self.size_sorted[rows]
        else:
            size = self.size if rows is None else self.size[rows]
            xs = size[:, order] if order.ndim == 1 else np.take_along_axis(size, order, axis=1)
        if order.ndim == 1:
            var = np.broadcast_to(order, xs.shape)
            ys = np.take(self.util if rows is None else self.util[rows], order, axis=1)
            return xs, ys, var
        util = self.util if rows is None else self.util[rows]
        return xs, np.take_along_axis(util, order, axis=1), order

    def subset(self, keep: IntArray) -> _Points:
        """Rows ``keep`` (positions among this one's rows) only."""
        rows = keep if self.rows is None else self.rows[keep]
        return _Points(self.util, self.size, self.order, self.size_sorted, rows)


def _solve_tier(
    points: _Points, leave: FloatArray, pinned: BoolArray, cap: int | None
) -> tuple[IntArray, float]:
    """One tier's multi-choice knapsack: per row a variant index or ``LEAVE``, and the price.

    ``leave``: ``(m,)``. Pinned rows take their best variant first (they are never moved down)
    and reduce the capacity for the rest. The price is the utility per byte of the first hull
    edge that did not fit (0 when everything fit).
    """
    m = points.m
    at = np.arange(m) if points.rows is None else points.rows
    if cap is None:
        best = _first_best(points.util)[at]
        best_util = points.util[at, best]
        return np.where(best_util >= leave, best, LEAVE).astype(np.int64), 0.0
    choice = np.full(m, LEAVE, dtype=np.int64)
    free = float(cap)
    if pinned.any():  # each row's best is needed only here (and for an unbounded tier)
        best = _first_best(points.util)[at[pinned]]
        choice[pinned] = best
        free -= float(points.size[at[pinned], best].sum())
    rows = np.flatnonzero(~pinned)
    if rows.size == 0 or free <= 0:
        return choice, 0.0
    if rows.size < m:
        points = points.subset(rows)
    choice[rows], price = _hull_greedy(points, leave[rows], free)
    return choice, price


def _first_best(util: FloatArray) -> IntArray:
    """``util.argmax(axis=1)`` of a tier's strided ``(n, V)`` view without the contiguous
    copy argmax makes of it (48 MB at 100,000 x 60, issue 28): the first column holding the
    row's maximum (utilities are never NaN: the table's inputs are checked finite)."""
    top = util.max(axis=1)
    first: IntArray = np.argmax(util == top[:, None], axis=1)
    return first


def _hull_greedy(points: _Points, leave: FloatArray, cap: float) -> tuple[IntArray, float]:
    """Greedy on the upper concave hulls of ``(size, util)``, leave point at ``(0, leave)``."""
    xs, ys, var = points.sorted()  # ys is a fresh gather: written in place below
    _mask_unfit(xs, ys, cap)
    every_best = _when_all_fit(xs, ys, var, leave, cap)
    if every_best is not None:
        return every_best, 0.0
    cx, cy, cv, count = _pareto_in_place(xs, ys, var, leave)
    m = cx.shape[0]
    ckeep = np.arange(cx.shape[1])[None, :] <= count[:, None]
    hull, top = _upper_hulls(cx, cy, ckeep)
    seg_row, seg_level = np.nonzero(np.arange(1, cx.shape[1])[None, :] <= top[:, None])
    level = seg_level + 1
    a = hull[seg_row, level - 1]
    b = hull[seg_row, level]
    dx = cx[seg_row, b] - cx[seg_row, a]
    dy = cy[seg_row, b] - cy[seg_row, a]
    slope = dy / np.maximum(dx, 1e-300)
    # Edges in descending slope; nonzero() lists them by (row, level), which a stable sort keeps
    # for equal slopes (within a row slopes strictly decrease, so ties only cross rows).
    by_slope = np.argsort(-slope, kind="stable")
    taken_dx = np.cumsum(dx[by_slope])
    stop = int(np.searchsorted(taken_dx, cap, side="right"))
    price = float(slope[by_slope[stop]]) if stop < by_slope.size else 0.0
    reached = np.zeros(m, dtype=np.int64)
    np.maximum.at(reached, seg_row[by_slope[:stop]], level[by_slope[:stop]])
    free = cap - (float(taken_dx[stop - 1]) if stop > 0 else 0.0)
    _fill(reached, by_slope[stop:], (seg_row, level, dx), free)
    result = cv[np.arange(m), hull[np.arange(m), reached]]
    return np.where(result < 0, LEAVE, result).astype(np.int64), price


def _mask_unfit(xs: FloatArray, ys: FloatArray, cap: float) -> None:
    """``ys = where(xs <= cap, ys, -inf)`` in place. Rows are sorted by size, so the last
    column holds each row's largest: the (m, V) mask is built only when some point does not
    fit (never, with tiers of many contexts)."""
    if xs.size and float(xs[:, -1].max()) > cap:
        ys[xs > cap] = -np.inf


def _when_all_fit(
    xs: FloatArray, ys: FloatArray, var: IntArray, leave: FloatArray, cap: float
) -> IntArray | None:
    """The greedy's answer when every row's best point fits at once (a large slower tier),
    else ``None``. Then the greedy takes every hull edge and ends at each row's last useful
    point: its best utility, the smallest such point (``ys`` sorted by size, ``-inf`` where it
    does not fit), or leaving when nothing beats ``leave``. Skips the hulls and the sort of
    their edges. The margin keeps the edges' cumulative sum (rounded differently from the sum
    of the points' sizes) clearly within ``cap``, so the answer is the greedy's exactly."""
    rows = np.arange(xs.shape[0])
    at = ys.argmax(axis=1)
    here = ys[rows, at] > leave
    if float(xs[rows, at][here].sum()) > cap * (1.0 - 1e-9):
        return None
    return np.where(here, var[rows, at], LEAVE).astype(np.int64)


def _pareto(
    xs: FloatArray, ys: FloatArray, var: IntArray, leave: FloatArray
) -> tuple[FloatArray, FloatArray, IntArray, IntArray]:
    """Each row's useful points, compacted: ``xs``, ``ys``, ``var`` sorted by size, ``ys``
    ``-inf`` where the point does not fit; a point is useful when it beats every smaller point
    and the leave point (strictly). Column 0 is the leave point ``(0, leave)``; row ``i`` has
    ``count[i]`` more. Returns sizes, utilities, variant (-1 = leave) ``(m, K + 1)`` and
    ``count``. Only ~10 of 60 variants survive on paper-like profiles, which keeps the hull
    work small."""
    return _pareto_in_place(xs, ys.copy(), var, leave)


def _pareto_in_place(
    xs: FloatArray, ys: FloatArray, var: IntArray, leave: FloatArray
) -> tuple[FloatArray, FloatArray, IntArray, IntArray]:
    """:func:`_pareto`, overwriting ``ys`` with its running maximum: at 100,000 x 60 the
    separate running-maximum array was 48 MB of fresh pages per tier (issue 28). With ``P``
    the running maximum of ``leave, ys[:, 0], ..., ys[:, j]``, a point beats every smaller
    one and the leave point exactly when ``P`` rises at it, and then its utility is ``P`` (a
    maximum is one of its inputs, so the values are the points' own, bit for bit)."""
    m = xs.shape[0]
    np.maximum.accumulate(ys, axis=1, out=ys)
    np.maximum(ys, leave[:, None], out=ys)
    keep = np.empty(ys.shape, dtype=bool)
    np.greater(ys[:, :1], leave[:, None], out=keep[:, :1])
    np.greater(ys[:, 1:], ys[:, :-1], out=keep[:, 1:])
    r, c = np.nonzero(keep)
    count = np.bincount(r, minlength=m)
    width = int(count.max()) + 1 if m else 1
    col = np.arange(r.size) - (np.cumsum(count) - count)[r] + 1
    # Only each row's first count + 1 columns are ever read (the hulls and the greedy index
    # kept points only), so the rest is left unwritten: at 100,000 rows x a wide grid,
    # filling it cost more than the points themselves (issue 28).
    cx = np.empty((m, width))
    cy = np.empty((m, width))
    cv = np.empty((m, width), dtype=np.int64)
    cx[:, 0], cy[:, 0], cv[:, 0] = 0.0, leave, LEAVE
    cx[r, col], cy[r, col], cv[r, col] = xs[r, c], ys[r, c], var[r, c]
    return cx, cy, cv, count.astype(np.int64)


def _fill(
    reached: IntArray, rest: IntArray, edges: tuple[IntArray, IntArray, FloatArray], free: float
) -> None:
    """Take further hull edges, in slope order, that still fit in ``free`` bytes (in place)."""
    seg_row, level, dx = edges
    if rest.size == 0 or free <= 0:
        return
    # Only each row's next edge is a candidate (one pass, at most one step per row): this keeps
    # the Python loop to at most one iteration per context.
    nxt = rest[level[rest] == reached[seg_row[rest]] + 1]
    nxt = nxt[dx[nxt] <= free]
    if nxt.size == 0:
        return
    suffix_min = np.minimum.accumulate(dx[nxt][::-1])[::-1]
    for k, e in enumerate(nxt.tolist()):
        if suffix_min[k] > free:
            break
        if dx[e] <= free:
            reached[seg_row[e]] += 1
            free -= float(dx[e])


def _upper_hulls(xs: FloatArray, ys: FloatArray, keep: BoolArray) -> tuple[IntArray, IntArray]:
    """Monotone-chain upper hulls of every row at once.

    Returns ``hull`` ``(m, K)`` (sorted point positions; ``hull[:, :top+1]`` is the hull) and
    ``top`` ``(m,)``. Point 0 (the smallest) is always on the hull.
    """
    m, k_points = xs.shape
    hull = np.zeros((m, k_points), dtype=np.int64)
    top = np.zeros(m, dtype=np.int64)
    for k in range(1, k_points):
        active = np.flatnonzero(keep[:, k])
        check = active[top[active] >= 1]
        while check.size:
            a = hull[check, top[check] - 1]
            b = hull[check, top[check]]
            xa, ya = xs[check, a], ys[check, a]
            cross = (xs[check, b] - xa) * (ys[check, k] - ya) - (ys[check, b] - ya) * (
                xs[check, k] - xa
            )
            pop = check[cross >= 0]  # b lies on or under the chord a-k: not on the hull
            top[pop] -= 1
            check = pop[top[pop] >= 1]
        top[active] += 1
        hull[active, top[active]] = k
    return hull, top
