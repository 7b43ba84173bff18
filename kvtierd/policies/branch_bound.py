"""A small, deterministic branch-and-bound for the online repair's sub-problems (issue 28).

An overflowing insert re-solves a few dozen contexts exactly (:mod:`kvtierd.policies.refine`).
HiGHS spends tens to hundreds of milliseconds on such a MILP before its first branch (presolve,
root cuts, heuristics) — more than an insert may block the event loop (50 ms) — and a node or
time limit does not bound that part. This search is bounded by the nodes it visits alone.

Over the contexts, largest first; each context's options (a variant in a tier, or dropped) in
order of gain, as a limited discrepancy search (the start itself first, then every
solution one, two, ... moves away from it). A node is pruned by a Lagrangian bound: with prices
``lam[t] >= 0`` per finite tier, the best any completion can reach is

    sum over the contexts left of max_option (gain - lam[t] * size)  +  sum_t lam[t] * free[t]

(weak duality of the capacity constraints), which costs one addition per node once the first
term's suffix sums are known. The prices minimise the root's dual, one tier at a time, in a fixed
number of steps. The start assignment is the first incumbent; the result is never worse.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from kvtierd.policies.exact import Problem
from kvtierd.policies.model import Assignment, BoolArray, FloatArray, IntArray

DUAL_ROUNDS = 2
"""Rounds over the finite tiers that choose the bound's prices (:func:`_prices`)."""

TERNARY_STEPS = 20
"""Ternary-search steps per tier and round (the price found to ~3e-4 of its range)."""


@dataclass(frozen=True, slots=True)
class SearchResult:
    """The best assignment found (``start`` when nothing better), its total utility, and
    whether the search finished (then it is optimal) within its node budget."""

    assignment: Assignment
    objective: float
    proven: bool
    nodes: int


@dataclass(frozen=True, slots=True)
class _Options:
    """Per context (in search order): option gains, sizes, tiers, variants; ``tier == T`` is
    dropped."""

    gain: list[list[float]]
    size: list[list[float]]
    tier: list[list[int]]
    variant: list[list[int]]


def branch_and_bound(problem: Problem, start: Assignment, max_nodes: int) -> SearchResult:
    """The best placement of ``problem``'s contexts found in ``max_nodes`` nodes, searching
    outward from ``start`` (a feasible assignment)."""
    n, _, n_tiers = problem.util.shape
    caps = problem.capacity_bytes
    finite = np.isfinite(caps)
    options = _options(problem, start)
    order = np.argsort(-problem.size_bytes.max(axis=1), kind="stable")
    opts = _Options(*(list(map(getattr(options, f).__getitem__, order.tolist()))
                      for f in ("gain", "size", "tier", "variant")))  # fmt: skip
    lam = _prices(opts, caps, finite)
    suffix = _suffix_bounds(opts, lam, n_tiers)
    free = [float(c) if f else 0.0 for c, f in zip(caps, finite, strict=True)]
    lam_list = [float(x) for x in lam]
    start_gain = _objective(problem, start) - float(problem.drop_util.sum())
    best_gain, best_choice = start_gain, None
    choice = [0] * n
    nodes = 0
    eps = 1e-12 * max(1.0, abs(start_gain))

    cut = False  # a branch was skipped for want of discrepancies (the search is not complete)

    def visit(d: int, value: float, left: int) -> None:
        nonlocal best_gain, best_choice, nodes, cut
        nodes += 1
        if d == n:
            if value > best_gain + eps:
                best_gain, best_choice = value, choice.copy()
            return
        bound = value + suffix[d] + sum(lam_list[t] * free[t] for t in range(n_tiers))
        if bound <= best_gain + eps:
            return
        first = True  # the first option that fits is free; any other costs a discrepancy
        for k, (g, s, t) in enumerate(zip(opts.gain[d], opts.size[d], opts.tier[d], strict=True)):
            if nodes >= max_nodes:
                return
            bounded = t < n_tiers and finite[t]
            if bounded and s > free[t]:
                continue
            if not first and left == 0:
                cut = True
                return
            spend = 0 if first else 1
            first = False
            choice[d] = k
            if bounded:
                free[t] -= s
                visit(d + 1, value + g, left - spend)
                free[t] += s
            else:
                visit(d + 1, value + g, left - spend)

    # Limited discrepancy search: solutions that deviate from the best-gain dive in few
    # places first, at any depth — a knapsack trap's fix moves a few large contexts, which
    # plain depth-first search reaches only after exhausting the deepest levels.
    for discrepancies in range(n + 1):
        cut = False
        visit(0, 0.0, discrepancies)
        if not cut or nodes >= max_nodes:
            break
    proven = nodes < max_nodes and not cut
    if best_choice is None:
        return SearchResult(start, _objective(problem, start), proven, nodes)
    a = _decode(opts, order, best_choice, n_tiers)
    return SearchResult(a, _objective(problem, a), proven, nodes)


def _suffix_bounds(opts: _Options, lam: FloatArray, n_tiers: int) -> list[float]:
    """``suffix[d]``: the sum over contexts ``d..`` of their best gain less its bytes at the
    prices ``lam`` (the bound's first term; 0 past the last context)."""
    reduced = [
        max(g - (lam[t] * s if t < n_tiers else 0.0) for g, s, t in zip(gs, ss, ts, strict=True))
        for gs, ss, ts in zip(opts.gain, opts.size, opts.tier, strict=True)
    ]
    suffix = [0.0] * (len(reduced) + 1)
    for d in range(len(reduced) - 1, -1, -1):
        suffix[d] = suffix[d + 1] + reduced[d]
    return suffix


def _options(problem: Problem, start: Assignment) -> _Options:
    """Every usable option of every context: its option in ``start`` first (so that ``k``
    discrepancies are the solutions ``k`` moves away from it), then by gain (a pinned context
    stays cached in the fastest tier)."""
    n, _, n_tiers = problem.util.shape
    caps = problem.capacity_bytes
    out = _Options([], [], [], [])
    for i in range(n):
        gain = problem.util[i] - problem.drop_util[i]
        ok = np.isfinite(gain) & (problem.size_bytes[i][:, None] <= caps[None, :])
        if problem.pinned[i]:
            ok[:, 1:] = False
        v, t = np.nonzero(ok)
        g = gain[v, t].tolist()
        s = problem.size_bytes[i, v].tolist()
        tt, vv = t.tolist(), v.tolist()
        if not problem.pinned[i]:
            g, s, tt, vv = [*g, 0.0], [*s, 0.0], [*tt, n_tiers], [*vv, 0]
        own = (n_tiers, 0) if start.dropped[i] else (int(start.tier[i]), int(start.variant[i]))
        rank = sorted(range(len(g)), key=lambda k: ((tt[k], vv[k]) != own, -g[k], s[k], tt[k]))
        out.gain.append([g[k] for k in rank])
        out.size.append([s[k] for k in rank])
        out.tier.append([tt[k] for k in rank])
        out.variant.append([vv[k] for k in rank])
    return out


def _prices(opts: _Options, caps: FloatArray, finite: BoolArray) -> FloatArray:
    """Tier prices for the bound: the Lagrangian dual ``L(lam)`` (module doc) minimised one
    finite tier at a time by ternary search (it is convex in each price), for
    :data:`DUAL_ROUNDS` rounds: a fixed amount of work, so the same input gives the same
    prices. Any prices >= 0 give a valid bound; better ones prune more."""
    n_tiers = caps.size
    width = max((len(g) for g in opts.gain), default=1)
    n = len(opts.gain)
    gain = np.full((n, width), -np.inf)
    size = np.zeros((n, width))
    tier = np.full((n, width), n_tiers, dtype=np.int64)
    for i, (gs, ss, ts) in enumerate(zip(opts.gain, opts.size, opts.tier, strict=True)):
        gain[i, : len(gs)], size[i, : len(ss)], tier[i, : len(ts)] = gs, ss, ts
    cap = np.where(finite, caps, 0.0)

    def dual(lam: FloatArray) -> float:
        price = np.append(lam, 0.0)[tier]
        return float(np.max(gain - price * size, axis=1).sum() + np.dot(lam, cap))

    lam: FloatArray = np.zeros(n_tiers)
    ratio = np.where(size > 0, np.maximum(gain, 0.0) / np.where(size > 0, size, 1.0), 0.0)
    top = float(ratio.max()) if ratio.size else 0.0
    for _ in range(DUAL_ROUNDS):
        for t in np.flatnonzero(finite).tolist():
            lo, hi = 0.0, top
            for _ in range(TERNARY_STEPS):
                m1, m2 = lo + (hi - lo) / 3, hi - (hi - lo) / 3
                lam[t] = m1
                f1 = dual(lam)
                lam[t] = m2
                if f1 <= dual(lam):
                    hi = m2
                else:
                    lo = m1
            lam[t] = (lo + hi) / 2
    return lam


def _decode(opts: _Options, order: IntArray, choice: list[int], n_tiers: int) -> Assignment:
    n = len(choice)
    variant = np.zeros(n, dtype=np.int64)
    tier = np.zeros(n, dtype=np.int64)
    dropped = np.zeros(n, dtype=bool)
    for d, k in enumerate(choice):
        i = int(order[d])
        t = opts.tier[d][k]
        if t >= n_tiers:
            dropped[i] = True
        else:
            variant[i], tier[i] = opts.variant[d][k], t
    return Assignment(variant=variant, tier=tier, dropped=dropped)


def _objective(problem: Problem, a: Assignment) -> float:
    rows = np.arange(problem.n_contexts)
    cached = problem.util[rows, a.variant, a.tier]
    return float(np.where(a.dropped, problem.drop_util, cached).sum())
