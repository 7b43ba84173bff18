"""Exact placement as a MILP (HiGHS through ``highspy``) and its LP relaxation.

The problem of §4.4 over all tiers at once: binary ``x[i, v, t]`` (context ``i`` stored as
variant ``v`` in tier ``t``) and ``d[i]`` (dropped),

    maximise   sum (util[i, v, t] - drop_util[i]) * x[i, v, t]      (+ sum drop_util, a constant)
    subject to sum_{v, t} x[i, v, t] + d[i] = 1                      for every context i
               sum_{i, v} size[i, v] / cap_t * x[i, v, t] <= 1        for every finite tier t

The objective is the *gain over dropping*, so HiGHS's relative gap is a share of the achievable
gain (a total utility near 0 would make a relative gap on the utility itself meaningless), and
it is scaled to at most 1 in magnitude; capacity rows are divided by the capacity. Both keep the
model well conditioned when sizes are in bytes (1e10) and utilities near 1: unscaled, HiGHS
re-solved numerically troubled incumbents and once gave up with "Solve error" (issue 14).

Pinned contexts may not be dropped or leave the fastest tier. The MILP is exact for small
instances (it is NP-hard: a multi-choice knapsack); the LP relaxation is an upper bound for any
size. If a HiGHS run ends without a usable solution, the solve is retried with other options
(:data:`ATTEMPTS`); when every attempt fails, :class:`~kvtierd.errors.SolverError` names each
attempt's HiGHS status. ``highspy`` is imported inside the solve so importing the package stays
cheap.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np

from kvtierd.errors import InvalidArgumentError, SolverError
from kvtierd.policies.model import (
    Assignment,
    BoolArray,
    FloatArray,
    IntArray,
    UtilityTable,
    capacity_array,
)

if TYPE_CHECKING:
    import highspy

HighsOptions = Mapping[str, bool | int | float | str]

ATTEMPTS: tuple[HighsOptions, ...] = (
    {},
    {"presolve": "off"},
    {"random_seed": 7, "simplex_scale_strategy": 4, "mip_feasibility_tolerance": 1e-7},
    {"presolve": "off", "random_seed": 11, "primal_feasibility_tolerance": 1e-9},
)
"""HiGHS option sets tried in order until one run ends with a usable solution: the defaults,
then presolve off (presolve is where numerically delicate reductions happen), then another
random seed and scaling with tighter tolerances, then both."""


@dataclass(frozen=True, slots=True, eq=False)
class Problem:
    """A placement problem as arrays: ``m`` contexts, ``V`` variant slots, ``T`` tiers.

    Shapes: ``size_bytes`` ``(m, V)``, ``util`` ``(m, V, T)`` (``-inf`` = not an option),
    ``drop_util`` and ``pinned`` ``(m,)``, ``capacity_bytes`` ``(T,)`` (``inf`` = unbounded;
    a float, so that a sub-problem can get the bytes its fixed contexts leave free).
    """

    size_bytes: FloatArray
    util: FloatArray
    drop_util: FloatArray
    pinned: BoolArray
    capacity_bytes: FloatArray

    @classmethod
    def of(cls, table: UtilityTable) -> Problem:
        """Every context of ``table``, with the table's capacities."""
        return cls(
            table.size_bytes,
            table.util,
            table.drop_util,
            table.pinned,
            capacity_array(table.capacity_bytes),
        )

    def subset(self, rows: IntArray, free_bytes: FloatArray) -> Problem:
        """Contexts ``rows`` only, with ``free_bytes`` per tier (what the others leave)."""
        return Problem(
            self.size_bytes[rows],
            self.util[rows],
            self.drop_util[rows],
            self.pinned[rows],
            np.maximum(free_bytes, 0.0),
        )

    @property
    def n_contexts(self) -> int:
        return int(self.drop_util.shape[0])


@dataclass(frozen=True, slots=True, eq=False)
class ExactResult:
    """A solve's objective (total utility) and, for an integral solve, its assignment.

    ``optimal`` is False when HiGHS stopped at its time limit with a feasible incumbent;
    ``bound`` is an upper bound on the optimum (HiGHS's dual bound; the LP optimum for
    ``relax=True``). ``status`` is HiGHS's model status of the run that was used.
    """

    objective: float
    assignment: Assignment | None
    status: str
    optimal: bool = True
    bound: float = float("nan")


@dataclass(frozen=True, slots=True, eq=False)
class _Model:
    rows: IntArray  # context of each column
    var: IntArray  # variant slot of each column (0 for drop columns)
    tier: IntArray  # tier of each column, n_tiers for drop columns
    gain: FloatArray  # util - drop_util of each column (0 for drop columns), unscaled
    scale: float  # the objective is gain / scale
    n_tiers: int
    lp: highspy.HighsLp


def solve_exact(
    table: UtilityTable,
    *,
    relax: bool = False,
    time_limit_s: float = 60.0,
    mip_rel_gap: float = 1e-6,
) -> ExactResult:
    """Solve the placement MILP (``relax=False``) or its LP relaxation (``relax=True``).

    ``mip_rel_gap`` is relative to the gain over dropping everything (see the module doc).
    """
    if table.n_contexts == 0:
        raise InvalidArgumentError("an exact solve needs at least one context")
    return solve_problem(
        Problem.of(table), relax=relax, time_limit_s=time_limit_s, mip_rel_gap=mip_rel_gap
    )


def solve_problem(
    problem: Problem,
    *,
    relax: bool = False,
    time_limit_s: float = 60.0,
    mip_rel_gap: float = 1e-6,
    attempts: Sequence[HighsOptions] = ATTEMPTS,
    start: Assignment | None = None,
    max_nodes: int | None = None,
    parent: IntArray | None = None,
) -> ExactResult:
    """:func:`solve_exact` of a :class:`Problem` (a sub-problem of a placer's contexts).

    ``parent``, shape ``(m,)``: each context's parent row (its own row for a root); a context
    is then cached only if its parent is (contexts that form a tree:
    :mod:`kvtierd.policies.tree_placement`).

    ``start``, a feasible assignment, is handed to HiGHS as its first incumbent (a placer's
    current placement: HiGHS then only has to beat or prove it). ``max_nodes`` bounds the
    branch-and-bound nodes (HiGHS's ``mip_max_nodes``): a limit in work, not seconds, so the
    same problem gives the same answer however busy the machine is (pass
    ``time_limit_s=math.inf`` with it).
    """
    import highspy

    model = _build(problem, relax)
    x0 = None if start is None or relax else _columns_of(model, start, problem.util.shape)
    failures: list[str] = []
    for options in attempts:
        h = highspy.Highs()  # type: ignore[no-untyped-call]
        h.silent()
        work = {} if max_nodes is None else {"mip_max_nodes": int(max_nodes)}
        for key, value in {
            "time_limit": float(time_limit_s),
            "mip_rel_gap": float(mip_rel_gap),
            **work,
            **options,
        }.items():
            h.setOptionValue(key, value)
        h.passModel(model.lp)
        if parent is not None:
            _add_precedence(h, model, parent)
        if x0 is not None:
            incumbent = highspy.HighsSolution()
            incumbent.col_value = x0
            incumbent.value_valid = True
            h.setSolution(incumbent)
        h.run()
        status = h.getModelStatus()
        name = h.modelStatusToString(status)
        optimal = status == highspy.HighsModelStatus.kOptimal
        result = _result(h, model, problem, relax, (name, optimal))
        if result is None:
            failures.append(f"{dict(options) or 'defaults'}: {name}")
            continue
        return result
    shape = "x".join(str(d) for d in problem.util.shape)
    raise SolverError(
        f"HiGHS found no usable solution of a placement {'LP' if relax else 'MILP'} of "
        f"{shape} (contexts x variants x tiers) after {len(failures)} attempt(s): "
        + "; ".join(failures)
    )


def _result(
    h: highspy.Highs, model: _Model, problem: Problem, relax: bool, status: tuple[str, bool]
) -> ExactResult | None:
    """The result of a finished run (``status``: HiGHS's name for it, and whether optimal);
    ``None`` if unusable: no feasible solution, a partial LP, or an assignment that breaks a
    capacity once counted in bytes."""
    name, optimal = status
    info = h.getInfo()
    if info.primal_solution_status != 2:  # 2 = feasible
        return None
    x = np.asarray(h.getSolution().col_value)
    floor = float(problem.drop_util.sum())
    if relax:
        if not optimal:
            return None  # a partial LP is no bound
        value = floor + float(model.gain @ x)
        return ExactResult(value, None, name, True, value)
    assignment = _decode(model, x, problem.n_contexts)
    if assignment is None or not _fits(problem, assignment):
        return None
    rows = np.arange(problem.n_contexts)
    cached = problem.util[rows, assignment.variant, assignment.tier]
    value = float(np.where(assignment.dropped, problem.drop_util, cached).sum())
    bound = floor + float(info.mip_dual_bound) * model.scale
    bound = max(bound, value) if np.isfinite(bound) else np.inf
    return ExactResult(value, assignment, name, optimal, bound)


def _build(problem: Problem, relax: bool) -> _Model:
    import highspy

    n, _, n_tiers = problem.util.shape
    caps = problem.capacity_bytes
    usable = np.isfinite(problem.util) & (problem.size_bytes[:, :, None] <= caps[None, None, :])
    if problem.pinned.any():
        usable[problem.pinned, :, 1:] = False
    i_idx, v_idx, t_idx = np.nonzero(usable)
    droppable = np.flatnonzero(~problem.pinned)
    rows = np.concatenate([i_idx, droppable])
    var = np.concatenate([v_idx, np.zeros(droppable.size, dtype=np.int64)])
    tier = np.concatenate([t_idx, np.full(droppable.size, n_tiers)])
    gain = np.concatenate(
        [problem.util[i_idx, v_idx, t_idx] - problem.drop_util[i_idx], np.zeros(droppable.size)]
    )
    scale = float(np.abs(gain).max()) if gain.size else 1.0
    scale = scale if scale > 0 else 1.0
    finite = [t for t in range(n_tiers) if np.isfinite(caps[t])]
    cap_row = np.full(n_tiers + 1, -1)
    cap_row[finite] = n + np.arange(len(finite))
    # Column-wise matrix: every column has its context's row; a column in a finite tier also
    # has that tier's capacity row, with its bytes as a share of the capacity.
    in_cap = cap_row[tier] >= 0
    counts = 1 + in_cap.astype(np.int64)
    start = np.concatenate([[0], np.cumsum(counts)])
    index = np.empty(int(start[-1]), dtype=np.int32)
    value = np.empty(int(start[-1]))
    index[start[:-1]] = rows
    value[start[:-1]] = 1.0
    second = start[:-1][in_cap] + 1
    index[second] = cap_row[tier[in_cap]]
    size = np.where(in_cap, problem.size_bytes[rows, var], 0.0)
    # Capacity rows are divided by the capacity (a tier with none left holds only empty
    # options: its row keeps the bytes and a bound of 0).
    divisor = np.where(caps > 0, caps, 1.0)
    value[second] = size[in_cap] / divisor[tier[in_cap]]
    lp = highspy.HighsLp()
    lp.num_col_, lp.num_row_ = int(rows.size), n + len(finite)
    lp.sense_ = highspy.ObjSense.kMaximize
    lp.col_cost_ = gain / scale
    lp.col_lower_, lp.col_upper_ = np.zeros(rows.size), np.ones(rows.size)
    lp.row_lower_ = np.concatenate([np.ones(n), np.full(len(finite), -highspy.kHighsInf)])
    lp.row_upper_ = np.concatenate([np.ones(n), caps[finite] / divisor[finite]])
    lp.a_matrix_.format_ = highspy.MatrixFormat.kColwise
    lp.a_matrix_.start_, lp.a_matrix_.index_, lp.a_matrix_.value_ = start, index, value
    if not relax:
        lp.integrality_ = [highspy.HighsVarType.kInteger] * int(rows.size)
    return _Model(rows, var, tier, gain, scale, n_tiers, lp)


def _add_precedence(h: highspy.Highs, model: _Model, parent: IntArray) -> None:
    """One row per child: its cached columns minus its parent's cached columns <= 0."""
    cached = model.tier < model.n_tiers
    cols_of: dict[int, list[int]] = {}
    for c in np.flatnonzero(cached).tolist():
        cols_of.setdefault(int(model.rows[c]), []).append(c)
    for child in np.flatnonzero(parent != np.arange(parent.size)).tolist():
        mine = cols_of.get(child, [])
        theirs = cols_of.get(int(parent[child]), [])
        if not mine:
            continue
        index = np.array(mine + theirs, dtype=np.int32)
        value = np.concatenate([np.ones(len(mine)), -np.ones(len(theirs))])
        h.addRow(-np.inf, 0.0, index.size, index, value)


def _columns_of(model: _Model, a: Assignment, shape: tuple[int, ...]) -> FloatArray | None:
    """``a`` as a 0/1 column vector of ``model``; ``None`` if it uses an option the model lacks
    (a variant that no longer fits, say)."""
    _, n_var, n_tiers = shape
    key = (model.rows * n_var + model.var) * (n_tiers + 1) + model.tier
    rows = np.arange(a.variant.size)
    want = (rows * n_var + np.where(a.dropped, 0, a.variant)) * (n_tiers + 1) + np.where(
        a.dropped, n_tiers, a.tier
    )
    order = np.argsort(key)
    pos = np.minimum(np.searchsorted(key, want, sorter=order), key.size - 1)
    cols = order[pos]
    if key.size == 0 or not np.array_equal(key[cols], want):
        return None
    x = np.zeros(key.size)
    x[cols] = 1.0
    return x


def _decode(model: _Model, x: FloatArray, n: int) -> Assignment | None:
    """The chosen column of every context, or ``None`` if a context has not exactly one."""
    chosen = np.flatnonzero(x > 0.5)
    if np.bincount(model.rows[chosen], minlength=n).tolist() != [1] * n:
        return None
    variant = np.zeros(n, dtype=np.int64)
    tier = np.zeros(n, dtype=np.int64)
    dropped = np.ones(n, dtype=bool)
    cached = chosen[model.tier[chosen] < model.n_tiers]  # tier == n_tiers marks drop columns
    variant[model.rows[cached]] = model.var[cached]
    tier[model.rows[cached]] = model.tier[cached]
    dropped[model.rows[cached]] = False
    return Assignment(variant=variant, tier=tier, dropped=dropped)


def _fits(problem: Problem, a: Assignment) -> bool:
    """Every finite tier within its capacity, counted in bytes (not HiGHS's tolerance)."""
    rows = np.arange(problem.n_contexts)
    size = np.where(a.dropped, 0.0, problem.size_bytes[rows, a.variant])
    used = np.bincount(a.tier, weights=size, minlength=problem.capacity_bytes.size)
    return bool(np.all(used <= problem.capacity_bytes))
