"""Exact solves where they are cheap, boundary neighbourhoods where they are not (issue 14).

A per-byte greedy falls into the classic knapsack traps when contexts are large next to a tier:
it fills DRAM with a few slightly better contexts per byte and leaves a gap that a large one
would have used (gaining more in total), or packs a subset-sum badly when every context gains
the same per byte. Pairwise exchange cannot leave such an optimum when the fix moves three or
more contexts at once. This module closes the gap with the MILP (:mod:`kvtierd.policies.exact`):

* A start that the Lagrangian bound (:func:`lagrangian_bound`, with the greedy's tier prices)
  proves within :data:`CERTIFIED_GAP` of the achievable gain is kept without a solve: large
  instances of small contexts, where the greedy is within 1e-6.
* A context is *contested* when its best option, ignoring other contexts, is in a finite tier
  (only those compete for capacity; the rest take their best option in an unbounded tier, or are
  dropped, whatever the others do). Pinned contexts are never moved here.
* Up to :data:`EXACT_MAX` contested contexts, all of them are re-solved jointly by the MILP —
  the exact optimum of the whole instance. The threshold comes from measured HiGHS times
  (``docs/policies.md``).
* Above it, :func:`refine` frees a *neighbourhood* of :data:`NEIGHBOURHOOD` contexts at the
  capacity boundaries (:func:`boundary`: per finite tier the residents that lose least per byte
  by leaving, the largest residents, the outsiders that would gain most by entering, per byte
  and in total — the "largest items first" fix of the greedy knapsack — and the smallest
  entrants) and solves that sub-problem exactly with every other context fixed: a k-exchange
  with k up to :data:`NEIGHBOURHOOD`, repeated while it gains.

Every solve has a work limit (branch-and-bound nodes, :class:`RefineLimits`), never a
wall clock; an incumbent HiGHS returns at the limit is used when it is better.
A solver failure (:class:`~kvtierd.errors.SolverError`) keeps the greedy's answer, with a
warning: the greedy's placement is valid, only possibly less good.
"""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass

import numpy as np

from kvtierd.errors import SolverError
from kvtierd.policies.branch_bound import branch_and_bound
from kvtierd.policies.exact import Problem, solve_problem
from kvtierd.policies.model import Assignment, FloatArray, IntArray

logger = logging.getLogger(__name__)

EXACT_MAX = 32
"""Up to this many contested contexts the whole instance is solved exactly (measured:
``docs/policies.md``, "Exact where it is cheap")."""

NEIGHBOURHOOD = 24
"""Contexts freed at once by a neighbourhood solve above :data:`EXACT_MAX`."""

MIP_REL_GAP = 1e-4
"""Stop when the incumbent is within this share of the achievable gain of the MILP bound."""


CERTIFIED_GAP = 1e-4
"""A start whose Lagrangian bound proves it within this share of the achievable gain is kept
as it is (no HiGHS call): how a rebalance of 100,000 contexts stays within its time."""


REBALANCE_NODES = 200
"""Branch-and-bound nodes a rebalance's HiGHS solve may use (:class:`RefineLimits`)."""


@dataclass(frozen=True, slots=True)
class RefineLimits:
    """How much a refinement may spend: branch-and-bound nodes per HiGHS solve
    (``max_nodes``) and neighbourhood rounds. Work, not seconds: a wall-clock limit made the
    plan depend on how busy the machine was (issue 28); the same inputs now give the same
    plan."""

    max_nodes: int = REBALANCE_NODES
    rounds: int = 4
    # The own branch-and-bound (branch_bound.py) instead of HiGHS: no root work beyond the
    # node budget, so an insert's repair is bounded in time as well as deterministic.
    own_search: bool = False
    exact_max: int = EXACT_MAX
    neighbourhood: int = NEIGHBOURHOOD
    certified_gap: float = CERTIFIED_GAP


def contested(problem: Problem) -> IntArray:
    """Contexts whose best option, alone, is in a finite tier (see the module doc), ``(k,)``."""
    caps = problem.capacity_bytes
    fits = problem.size_bytes[:, :, None] <= caps[None, None, :]
    util = np.where(fits, problem.util, -np.inf)
    best_tier = np.argmax(util.max(axis=1), axis=1)
    best = util.max(axis=(1, 2))
    wants = (best > problem.drop_util) & np.isfinite(caps[best_tier])
    return np.flatnonzero(wants & ~problem.pinned)


def lagrangian_bound(problem: Problem, prices: FloatArray) -> float:
    """An upper bound on the optimum for any prices ``(T,)`` >= 0 (utility per byte):
    ``sum_i max(drop_i, max_{v,t} util - price_t * size) + sum_t price_t * capacity_t``
    (weak duality of the capacity constraints). One pass over the ``(n, V, T)`` utilities."""
    caps = problem.capacity_bytes
    size = problem.size_bytes
    best = problem.drop_util.copy()
    largest = float(size.max()) if size.size else 0.0
    # One reused (n, V) buffer, and no mask where every size fits: at 100,000 contexts x 60
    # variants each temporary is 48 MB of fresh pages, and the plain expression made four per
    # tier (issue 28). The same operations, so the same bound bit for bit.
    buf: FloatArray | None = None
    for t in range(problem.util.shape[2]):
        price = float(prices[t]) if np.isfinite(caps[t]) else 0.0
        value = problem.util[:, :, t]
        over = largest > caps[t]
        if price or over:
            buf = np.empty_like(size) if buf is None else buf
            if price:
                np.multiply(size, price, out=buf)
                np.subtract(value, buf, out=buf)
            else:
                np.copyto(buf, value)
            if over:
                buf[size > caps[t]] = -np.inf
            value = buf
        np.maximum(best, value.max(axis=1), out=best)
    finite = np.isfinite(caps)
    return float(best.sum() + np.dot(prices[finite], caps[finite]))


def refine(
    problem: Problem,
    current: Assignment,
    limits: RefineLimits,
    prices: FloatArray | None = None,
) -> Assignment:
    """A better assignment than ``current`` (or ``current`` itself), see the module doc.

    With ``prices`` (the greedy's Lagrange multipliers), a ``current`` that the Lagrangian
    bound proves within ``limits.certified_gap`` of the achievable gain is returned at once.
    """
    if prices is not None:
        floor = float(problem.drop_util.sum())
        have = float(_value(problem, current).sum()) - floor
        bound = lagrangian_bound(problem, prices) - floor
        if have >= (1.0 - limits.certified_gap) * bound:
            return current
    # Contested contexts, and any other the start keeps in a finite tier (its bytes are in play).
    held = ~current.dropped & np.isfinite(problem.capacity_bytes[current.tier]) & ~problem.pinned
    rows = np.union1d(contested(problem), np.flatnonzero(held))
    if rows.size == 0:
        return current
    if rows.size <= limits.exact_max:
        return _resolve_rows(problem, current, rows, limits)
    for _ in range(limits.rounds):
        rows = boundary(problem, current, limits.neighbourhood)
        if rows.size == 0:
            break
        better = _resolve_rows(problem, current, rows, limits)
        if better is current:
            break
        current = better
    return current


def boundary(problem: Problem, current: Assignment, size: int) -> IntArray:
    """Up to ``size`` movable contexts at the finite tiers' capacity boundaries, ``(k,)``.

    Per finite tier five rankings: residents by least utility lost per byte when leaving, and
    by size (largest first); outsiders by most utility gained per byte and in total when
    entering (the "largest items first" fix), and by smallest entering size (what fills a gap).
    The rankings are merged round-robin, so every one of them has its best contexts in.
    """
    n, _, n_tiers = problem.util.shape
    rows = np.arange(n)
    cur_size = np.where(current.dropped, 0.0, problem.size_bytes[rows, current.variant])
    cur_util = _value(problem, current)
    movable = ~problem.pinned
    rankings: list[IntArray] = []
    for t in range(n_tiers):
        cap = problem.capacity_bytes[t]
        if not np.isfinite(cap):
            continue
        here = movable & ~current.dropped & (current.tier == t)
        outside = movable & ~here
        with np.errstate(divide="ignore", invalid="ignore"):
            loss_per_byte = (cur_util - _best_outside(problem, t)) / cur_size
        fits = problem.size_bytes <= cap
        gain = np.where(fits, problem.util[:, :, t], -np.inf) - cur_util[:, None]
        gains = gain > 0
        with np.errstate(divide="ignore", invalid="ignore"):
            per_byte = np.where(gains, gain / problem.size_bytes, -np.inf).max(axis=1)
        smallest = np.where(gains, problem.size_bytes, np.inf).min(axis=1)
        rankings += [
            _smallest(np.where(here, loss_per_byte, np.inf), size),
            _smallest(np.where(here, -cur_size, np.inf), size),
            _smallest(np.where(outside, -per_byte, np.inf), size),
            _smallest(np.where(outside, -gain.max(axis=1), np.inf), size),
            _smallest(np.where(outside, smallest, np.inf), size),
        ]
    return _round_robin(rankings, size)


def _round_robin(rankings: list[IntArray], size: int) -> IntArray:
    """The first ``size`` distinct indices taking one from each ranking in turn."""
    chosen: dict[int, None] = {}
    depth = max((r.size for r in rankings), default=0)
    for k in range(depth):
        for r in rankings:
            if k < r.size:
                chosen[int(r[k])] = None
                if len(chosen) == size:
                    return np.fromiter(chosen, dtype=np.int64)
    return np.fromiter(chosen, dtype=np.int64, count=len(chosen))


def _smallest(key: FloatArray, k: int) -> IntArray:
    """Indices of the ``k`` smallest finite keys, in ascending key order."""
    ok = np.flatnonzero(np.isfinite(key))
    if ok.size > k:
        ok = ok[np.argpartition(key[ok], k - 1)[:k]]
    return ok[np.argsort(key[ok], kind="stable")].astype(np.int64)


def _best_outside(problem: Problem, t: int) -> FloatArray:
    """Each context's best utility outside tier ``t`` (other tiers, capacity ignored, or
    dropped), ``(n,)``."""
    best = problem.drop_util.copy()
    for other in range(problem.util.shape[2]):
        if other == t:
            continue
        fits = problem.size_bytes <= problem.capacity_bytes[other]
        np.maximum(best, np.where(fits, problem.util[:, :, other], -np.inf).max(axis=1), out=best)
    return best


def _subset(a: Assignment, rows: IntArray) -> Assignment:
    return Assignment(variant=a.variant[rows], tier=a.tier[rows], dropped=a.dropped[rows])


def _value(problem: Problem, a: Assignment) -> FloatArray:
    rows = np.arange(problem.n_contexts)
    return np.where(a.dropped, problem.drop_util, problem.util[rows, a.variant, a.tier])


def _resolve_rows(
    problem: Problem, current: Assignment, rows: IntArray, limits: RefineLimits
) -> Assignment:
    """``current`` with ``rows`` re-placed optimally given every other context where it is;
    ``current`` itself when that gains nothing (or the solver gives up)."""
    n, _, n_tiers = problem.util.shape
    fixed = np.ones(n, dtype=bool)
    fixed[rows] = False
    size = np.where(current.dropped, 0.0, problem.size_bytes[np.arange(n), current.variant])
    used = np.bincount(current.tier[fixed], weights=size[fixed], minlength=n_tiers)
    free = problem.capacity_bytes - used
    sub = problem.subset(rows, free)
    a, objective = _solve_sub(sub, _subset(current, rows), limits)
    before = float(_value(problem, current)[rows].sum())
    gain = before - float(sub.drop_util.sum())
    if a is None or objective <= before + 1e-9 * max(1.0, abs(gain)):
        return current
    variant, tier, dropped = current.variant.copy(), current.tier.copy(), current.dropped.copy()
    variant[rows], tier[rows], dropped[rows] = a.variant, a.tier, a.dropped
    return Assignment(
        variant=np.where(dropped, 0, variant).astype(np.int64),
        tier=np.where(dropped, 0, tier).astype(np.int64),
        dropped=dropped,
    )


def _solve_sub(
    sub: Problem, start: Assignment, limits: RefineLimits
) -> tuple[Assignment | None, float]:
    """The best assignment of a sub-problem found within ``limits.max_nodes`` nodes, and its
    total utility (``None`` when the solver gave up)."""
    if limits.own_search:
        found = branch_and_bound(sub, start, limits.max_nodes)
        return found.assignment, found.objective
    try:
        result = solve_problem(
            sub,
            time_limit_s=math.inf,
            max_nodes=limits.max_nodes,
            mip_rel_gap=MIP_REL_GAP,
            start=start,
        )
    except SolverError as e:
        logger.warning("placement refinement skipped, the greedy's placement stands: %s", e)
        return None, -math.inf
    return result.assignment, result.objective
