"""Improvement phase for small instances: pairwise exchange local search.

The greedy (Appendix A) commits to one context at a time, so on instances where a few contexts
each fill a large share of a tier it can end in a local optimum that no *single-context* move
improves (say a fast tier holding one context whose two neighbours would fit there together in
compressed form). This phase searches the 2-exchange neighbourhood: every pair of contexts
``(i, j)`` and every joint re-assignment of both — any variant in any tier, or dropped — that
keeps every tier within capacity. It applies the best improving pair and repeats until no pair
improves (a 2-opt local optimum; single-context moves are the pairs where one context keeps its
configuration). Pinned contexts keep their configuration.

Cost per round is ``O(n^2 K^2 T)`` with ``K = V T + 1`` options per context, evaluated with numpy
in blocks of rows, so it is used only up to :data:`EXCHANGE_MAX` contexts (the instances where
the greedy's integrality gap matters; with thousands of contexts the greedy is within 1e-5 of
the LP bound, see ``benchmarks/RESULTS.md``).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from kvtierd.policies.model import (
    Assignment,
    FloatArray,
    IntArray,
    UtilityTable,
    capacity_array,
)

EXCHANGE_MAX = 64
"""Largest instance (contexts) the exchange phase runs on by default."""

_BLOCK_ELEMENTS = 1 << 21
"""Upper bound on ``rows x n x K x K`` evaluated at once (memory ~ 16 MiB per array)."""


@dataclass(frozen=True, slots=True, eq=False)
class _Options:
    """Every context's options: utility ``(n, K)``, bytes ``(n, K)``, tier ``(K,)`` (-1 = none)."""

    util: FloatArray
    size: FloatArray
    tier: IntArray
    room: FloatArray  # capacity of each tier, inf when unbounded, ``(T,)``


def _options(table: UtilityTable) -> _Options:
    n, n_var, n_tiers = table.util.shape
    caps = capacity_array(table.capacity_bytes)
    # Option k < V*T is (variant k // T, tier k % T); option V*T is dropped.
    util = np.concatenate([table.util.reshape(n, n_var * n_tiers), table.drop_util[:, None]], 1)
    size = np.concatenate([np.repeat(table.size_bytes, n_tiers, axis=1), np.zeros((n, 1))], 1)
    tier = np.concatenate([np.tile(np.arange(n_tiers), n_var), [-1]]).astype(np.int64)
    fits = np.ones_like(util, dtype=bool)
    fits[:, :-1] = size[:, :-1] <= caps[tier[:-1]][None, :]
    util = np.where(fits & np.isfinite(util), util, -np.inf)
    return _Options(util, size, tier, caps)


def _current(table: UtilityTable, a: Assignment) -> IntArray:
    return np.where(
        a.dropped, table.util.shape[1] * table.n_tiers, a.variant * table.n_tiers + a.tier
    )


def exchange(table: UtilityTable, assignment: Assignment, max_rounds: int = 1000) -> Assignment:
    """Improve ``assignment`` by best-improvement pairwise exchanges (see the module doc)."""
    n = table.n_contexts
    if n == 0:
        return assignment
    opts = _options(table)
    cur = _current(table, assignment)
    # Pinned contexts may only keep their option.
    pinned = np.flatnonzero(table.pinned)
    if pinned.size:
        keep = opts.util[pinned, cur[pinned]]
        util = opts.util.copy()
        util[pinned] = -np.inf
        util[pinned, cur[pinned]] = keep
        opts = _Options(util, opts.size, opts.tier, opts.room)
    for _ in range(max_rounds):
        move = _best_pair(opts, cur)
        if move is None:
            break
        i, a, j, b = move
        cur[i], cur[j] = a, b
    n_tiers = table.n_tiers
    n_opts = opts.util.shape[1]
    dropped = cur == n_opts - 1
    return Assignment(
        variant=np.where(dropped, 0, cur // n_tiers).astype(np.int64),
        tier=np.where(dropped, 0, cur % n_tiers).astype(np.int64),
        dropped=dropped,
    )


def _best_pair(opts: _Options, cur: IntArray) -> tuple[int, int, int, int] | None:
    """The pair re-assignment with the largest utility gain, or ``None`` when none gains."""
    n, k = opts.util.shape
    rows = np.arange(n)
    cur_util = opts.util[rows, cur]
    cur_size = opts.size[rows, cur]
    cur_tier = opts.tier[cur]
    n_tiers = opts.room.shape[0]
    used = np.array([cur_size[cur_tier == t].sum() for t in range(n_tiers)])
    # Bytes each context holds in each tier now, (n, T).
    held = np.where(cur_tier[:, None] == np.arange(n_tiers)[None, :], cur_size[:, None], 0.0)
    # Bytes each option puts in each tier, (n, K, T).
    put = np.where(opts.tier[None, :, None] == np.arange(n_tiers)[None, None, :],
                   opts.size[:, :, None], 0.0)  # fmt: skip
    gain_one = opts.util - cur_util[:, None]  # (n, K)
    tol = 1e-9 * max(1.0, float(np.abs(cur_util).sum()))
    best: tuple[float, tuple[int, int, int, int] | None] = (tol, None)
    block = max(1, _BLOCK_ELEMENTS // max(1, n * k * k))
    for start in range(0, n, block):
        i = np.arange(start, min(n, start + block))
        gain = gain_one[i, None, :, None] + gain_one[None, :, None, :]  # (b, n, K, K)
        for t in range(n_tiers):
            if not np.isfinite(opts.room[t]):
                continue
            room = opts.room[t] - used[t] + held[i, t][:, None] + held[:, t][None, :]  # (b, n)
            load = put[i, None, :, None, t] + put[None, :, None, :, t]
            gain = np.where(load <= room[:, :, None, None], gain, -np.inf)
        gain[np.arange(i.size), i] = -np.inf  # a context does not pair with itself
        flat = int(np.argmax(gain))
        if gain.flat[flat] > best[0]:
            bi, j, a, b = np.unravel_index(flat, gain.shape)
            best = (float(gain.flat[flat]), (int(i[bi]), int(a), int(j), int(b)))
    return best[1]


def improve(table: UtilityTable, assignment: Assignment, max_rounds: int = 256) -> Assignment:
    """Local search after the greedy: apply the best single-context upgrade that fits.

    Each round moves, for every finite tier, the one context whose move into that tier (any
    variant, from anywhere, including a compressed copy already there) gains the most utility
    and fits in the tier's free bytes. Space freed in the source tier is used by later rounds.
    Stops when no move gains or after ``max_rounds`` rounds (``O(n V T)`` numpy work each).
    """
    n = table.n_contexts
    if n == 0:
        return assignment  # nothing to improve (a rebalance with no contexts)
    rows = np.arange(n)
    variant = assignment.variant.copy()
    tier = assignment.tier.copy()
    dropped = assignment.dropped.copy()
    caps = capacity_array(table.capacity_bytes)
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
