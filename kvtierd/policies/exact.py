"""Exact placement as a MILP (HiGHS via ``scipy.optimize.milp``) and its LP relaxation.

The problem of §4.4 over all tiers at once: binary ``x[i, v, t]`` (context ``i`` stored as
variant ``v`` in tier ``t``) and ``d[i]`` (dropped),

    maximise   sum util[i, v, t] * x[i, v, t] + drop_util[i] * d[i]
    subject to sum_{v, t} x[i, v, t] + d[i] = 1                 for every context i
               sum_{i, v} size[i, v] * x[i, v, t] <= capacity_t  for every finite tier t

Pinned contexts may not be dropped or leave the fastest tier. The MILP is exact for small
instances (it is NP-hard: a multi-choice knapsack); the LP relaxation is an upper bound for any
size and is what the greedy is compared with on large instances. scipy is imported inside the
functions so importing the package stays cheap.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from kvtierd.errors import InvalidArgumentError
from kvtierd.policies.model import (
    Assignment,
    FloatArray,
    IntArray,
    UtilityTable,
    capacity_array,
)


@dataclass(frozen=True, slots=True, eq=False)
class ExactResult:
    """Optimal (MILP) or bound (LP) objective; ``assignment`` only for an integral solve."""

    objective: float
    assignment: Assignment | None
    status: str


@dataclass(frozen=True, slots=True, eq=False)
class _Model:
    cost: FloatArray
    rows: IntArray  # context of each column
    var: IntArray  # variant slot of each column (0 for drop columns)
    tier: IntArray  # tier of each column, n_tiers for drop columns
    a_eq: object
    a_cap: object
    cap: FloatArray
    n_tiers: int


def _build(table: UtilityTable) -> _Model:
    from scipy import sparse

    n, _, n_tiers = table.util.shape
    fits = table.size_bytes[:, :, None] <= capacity_array(table.capacity_bytes)
    usable = np.isfinite(table.util) & fits
    if table.pinned.any():
        usable[table.pinned, :, 1:] = False
    i_idx, v_idx, t_idx = np.nonzero(usable)
    droppable = np.flatnonzero(~table.pinned)
    rows = np.concatenate([i_idx, droppable])
    var = np.concatenate([v_idx, np.zeros(droppable.size, dtype=np.int64)])
    tier = np.concatenate([t_idx, np.full(droppable.size, n_tiers)])
    util = np.concatenate([table.util[i_idx, v_idx, t_idx], table.drop_util[droppable]])
    n_cols = rows.size
    a_eq = sparse.csr_array((np.ones(n_cols), (rows, np.arange(n_cols))), shape=(n, n_cols))
    finite = [t for t, c in enumerate(table.capacity_bytes) if c is not None]
    cap_rows, cap_cols, cap_vals = [], [], []
    for r, t in enumerate(finite):
        cols = np.flatnonzero(tier == t)
        cap_rows.append(np.full(cols.size, r))
        cap_cols.append(cols)
        cap_vals.append(table.size_bytes[rows[cols], var[cols]])
    a_cap = sparse.csr_array(
        (
            np.concatenate(cap_vals) if cap_vals else np.zeros(0),
            (
                np.concatenate(cap_rows) if cap_rows else np.zeros(0, dtype=np.int64),
                np.concatenate(cap_cols) if cap_cols else np.zeros(0, dtype=np.int64),
            ),
        ),
        shape=(len(finite), n_cols),
    )
    cap = np.array([float(table.capacity_bytes[t] or 0) for t in finite])
    return _Model(-util, rows, var, tier, a_eq, a_cap, cap, n_tiers)


def solve_exact(
    table: UtilityTable, *, relax: bool = False, time_limit_s: float = 60.0
) -> ExactResult:
    """Solve the placement MILP (``relax=False``) or its LP relaxation (``relax=True``)."""
    from scipy.optimize import Bounds, LinearConstraint, milp

    if table.n_contexts == 0:
        raise InvalidArgumentError("an exact solve needs at least one context")
    model = _build(table)
    n = table.n_contexts
    constraints = [LinearConstraint(model.a_eq, np.ones(n), np.ones(n))]
    if model.cap.size:
        constraints.append(LinearConstraint(model.a_cap, -np.inf, model.cap))
    integrality = np.zeros(model.cost.size) if relax else np.ones(model.cost.size)
    res = milp(
        model.cost,
        constraints=constraints,
        integrality=integrality,
        bounds=Bounds(0.0, 1.0),
        options={"time_limit": time_limit_s, "disp": False},
    )
    if res.x is None:
        raise InvalidArgumentError(f"exact solve failed: {res.message}")
    objective = -float(res.fun)
    if relax:
        return ExactResult(objective, None, str(res.message))
    return ExactResult(objective, _decode(model, np.asarray(res.x), n), str(res.message))


def _decode(model: _Model, x: FloatArray, n: int) -> Assignment:
    chosen = np.flatnonzero(x > 0.5)
    variant = np.zeros(n, dtype=np.int64)
    tier = np.zeros(n, dtype=np.int64)
    dropped = np.ones(n, dtype=bool)
    cached = chosen[model.tier[chosen] < model.n_tiers]  # tier == n_tiers marks drop columns
    variant[model.rows[cached]] = model.var[cached]
    tier[model.rows[cached]] = model.tier[cached]
    dropped[model.rows[cached]] = False
    return Assignment(variant=variant, tier=tier, dropped=dropped)
