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
3 tiers take well under a second (``benchmarks/bench_placer.py``).
"""

from __future__ import annotations

import numpy as np

from kvtierd.policies.model import Assignment, BoolArray, FloatArray, IntArray, UtilityTable

SMALL_INSTANCE = 5000
"""Up to this many contexts :func:`greedy_assign` prices slower tiers and polishes by default."""

LEAVE = -1
"""Choice index meaning "not in this tier" in the per-tier solver's result."""


def greedy_assign(
    table: UtilityTable, rounds: int | None = None, max_improve_rounds: int | None = None
) -> Assignment:
    """Place every context by the per-byte greedy, then improve it by local search.

    Round 1 values the option of leaving a tier at the best utility below, as if the slower
    tiers had room. Later rounds charge each byte in a slower tier the marginal utility per byte
    that round 1 found there (its knapsack's Lagrange multiplier), which stops a fast tier from
    pushing out contexts the slower tier cannot hold either. The best round (by true utility)
    is polished by :func:`improve`.
    """
    # Pricing and polishing matter when contexts are large next to a tier (few contexts); with
    # thousands the greedy is already within 1e-5 of the LP bound, so skip them for speed.
    small = table.n_contexts <= SMALL_INSTANCE
    rounds = (2 if small else 1) if rounds is None else rounds
    max_improve_rounds = (64 if small else 0) if max_improve_rounds is None else max_improve_rounds
    prices: FloatArray = np.zeros(table.n_tiers)
    best: Assignment | None = None
    best_util = -np.inf
    for _ in range(max(1, rounds)):
        candidate, prices = _cascade(table, prices)
        util = candidate.total_utility(table)
        if util > best_util:
            best, best_util = candidate, util
    assert best is not None
    return improve(table, best, max_improve_rounds) if max_improve_rounds > 0 else best


def _cascade(table: UtilityTable, prices: FloatArray) -> tuple[Assignment, FloatArray]:
    """One greedy pass, tier by tier (fastest first); returns it and each tier's multiplier."""
    n, n_tiers = table.n_contexts, table.n_tiers
    new_prices = np.zeros(n_tiers)
    variant = np.zeros(n, dtype=np.int64)
    tier = np.zeros(n, dtype=np.int64)
    dropped = np.ones(n, dtype=bool)
    remaining = np.arange(n)
    # Best utility in tiers t..T-1 or dropped, for the "leave tier t-1" option.
    below = np.empty((n, n_tiers + 1))
    below[:, n_tiers] = table.drop_util
    for t in range(n_tiers - 1, -1, -1):
        priced = table.util[:, :, t] - prices[t] * table.size_bytes
        below[:, t] = np.maximum(below[:, t + 1], priced.max(axis=1))
    for t in range(n_tiers):
        if remaining.size == 0:
            break
        util = table.util[remaining, :, t]
        size = table.size_bytes[remaining]
        leave = below[remaining, t + 1]
        pinned = table.pinned[remaining]
        cap = table.capacity_bytes[t]
        choice, new_prices[t] = _solve_tier(util, size, leave, pinned, cap)
        here = choice != LEAVE
        rows = remaining[here]
        variant[rows] = choice[here]
        tier[rows] = t
        dropped[rows] = False
        remaining = remaining[~here]
    return Assignment(variant=variant, tier=tier, dropped=dropped), new_prices


def _solve_tier(
    util: FloatArray, size: FloatArray, leave: FloatArray, pinned: BoolArray, cap: int | None
) -> tuple[IntArray, float]:
    """One tier's multi-choice knapsack: per row a variant index or ``LEAVE``, and the price.

    ``util``/``size``: ``(m, V)``; ``leave``: ``(m,)``. Pinned rows take their best variant
    first (they are never moved down) and reduce the capacity for the rest. The price is the
    utility per byte of the first hull edge that did not fit (0 when everything fit).
    """
    m = util.shape[0]
    best = util.argmax(axis=1)
    best_util = util[np.arange(m), best]
    if cap is None:
        return np.where(best_util >= leave, best, LEAVE).astype(np.int64), 0.0
    choice = np.full(m, LEAVE, dtype=np.int64)
    choice[pinned] = best[pinned]
    free = float(cap) - float(size[pinned, best[pinned]].sum())
    rows = np.flatnonzero(~pinned)
    if rows.size == 0 or free <= 0:
        return choice, 0.0
    sub_util = np.where(size[rows] <= free, util[rows], -np.inf)
    choice[rows], price = _hull_greedy(sub_util, size[rows], leave[rows], free)
    return choice, price


def _hull_greedy(
    util: FloatArray, size: FloatArray, leave: FloatArray, cap: float
) -> tuple[IntArray, float]:
    """Greedy on the upper concave hulls of ``(size, util)``, leave point at ``(0, leave)``."""
    m, n_var = util.shape
    xs = np.concatenate([np.zeros((m, 1)), size], axis=1)
    ys = np.concatenate([leave[:, None], util], axis=1)
    order = np.argsort(xs, axis=1, kind="stable")
    xs = np.take_along_axis(xs, order, axis=1)
    ys = np.take_along_axis(ys, order, axis=1)
    # Pareto filter: a point is useful only if it beats every smaller point (strictly).
    prev_best = np.maximum.accumulate(ys, axis=1)
    keep = np.ones_like(ys, dtype=bool)
    keep[:, 1:] = ys[:, 1:] > prev_best[:, :-1]
    # The stable sort keeps the leave point (column 0, size 0) at sorted position 0.
    hull, top = _upper_hulls(xs, ys, keep)
    seg_row, seg_level = np.nonzero(np.arange(1, n_var + 1)[None, :] <= top[:, None])
    level = seg_level + 1
    a = hull[seg_row, level - 1]
    b = hull[seg_row, level]
    dx = xs[seg_row, b] - xs[seg_row, a]
    dy = ys[seg_row, b] - ys[seg_row, a]
    slope = dy / np.maximum(dx, 1e-300)
    # Edges in descending slope; within a row slopes strictly decrease, so ties only cross rows.
    by_slope = np.lexsort((level, seg_row, -slope))
    taken_dx = np.cumsum(dx[by_slope])
    stop = int(np.searchsorted(taken_dx, cap, side="right"))
    price = float(slope[by_slope[stop]]) if stop < by_slope.size else 0.0
    reached = np.zeros(m, dtype=np.int64)
    np.maximum.at(reached, seg_row[by_slope[:stop]], level[by_slope[:stop]])
    free = cap - (float(taken_dx[stop - 1]) if stop > 0 else 0.0)
    _fill(reached, by_slope[stop:], (seg_row, level, dx), free)
    pos = hull[np.arange(m), reached]
    # Column 0 of the unsorted points is the leave point; column v + 1 is variant v.
    result = order[np.arange(m), pos] - 1
    return np.where(result < 0, LEAVE, result).astype(np.int64), price


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


def improve(table: UtilityTable, assignment: Assignment, max_rounds: int = 256) -> Assignment:
    """Local search after the greedy: apply the best single-context upgrade that fits.

    Each round moves, for every finite tier, the one context whose move into that tier (any
    variant, from anywhere, including a compressed copy already there) gains the most utility
    and fits in the tier's free bytes. Space freed in the source tier is used by later rounds.
    Stops when no move gains or after ``max_rounds`` rounds (``O(n V T)`` numpy work each).
    """
    n = table.n_contexts
    rows = np.arange(n)
    variant = assignment.variant.copy()
    tier = assignment.tier.copy()
    dropped = assignment.dropped.copy()
    caps = np.array([np.inf if c is None else float(c) for c in table.capacity_bytes])
    movable = ~table.pinned
    for _ in range(max_rounds):
        cur_size = np.where(dropped, 0.0, table.size_bytes[rows, variant])
        used = np.bincount(tier[~dropped], weights=cur_size[~dropped], minlength=table.n_tiers)
        cur_util = np.where(dropped, table.drop_util, table.util[rows, variant, tier])
        moved = False
        for t in range(table.n_tiers):
            free = caps[t] - used[t]
            own = np.where(~dropped & (tier == t), cur_size, 0.0)  # bytes freed by leaving t
            fits = table.size_bytes <= (free + own)[:, None]
            gain = (
                np.where(fits & movable[:, None], table.util[:, :, t], -np.inf) - cur_util[:, None]
            )
            flat = int(np.argmax(gain))
            i, v = divmod(flat, gain.shape[1])
            if not gain[i, v] > 1e-12 * max(1.0, abs(float(cur_util[i]))):
                continue
            if not dropped[i]:
                used[tier[i]] -= cur_size[i]
            used[t] += table.size_bytes[i, v]
            cur_size[i] = table.size_bytes[i, v]
            cur_util[i] = table.util[i, v, t]
            variant[i], tier[i], dropped[i] = v, t, False
            moved = True
        if not moved:
            break
    return Assignment(variant=variant, tier=tier, dropped=dropped)
