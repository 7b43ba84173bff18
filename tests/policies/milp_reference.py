"""An independent optimum for placer tests: the placement MILP written out densely for
``scipy.optimize.milp``, on the raw table (no scaling, no gain shift, no warm start), so that it
shares no code with ``kvtierd.policies.exact`` beyond the utility table itself."""

from __future__ import annotations

import numpy as np
from scipy.optimize import Bounds, LinearConstraint, milp

from kvtierd.policies.model import UtilityTable


def optimum(table: UtilityTable, *, relax: bool = False) -> float:
    """The largest total utility of any feasible placement of ``table`` (HiGHS, gap 1e-9).

    One binary per (context, variant, tier) and one per context for "dropped"; a pinned
    context may only be cached in the fastest tier. ``relax``: the LP relaxation's optimum
    instead, an upper bound on the optimum that stays cheap at 100-200 contexts (where the
    MILP takes minutes): a share of the gain it bounds is at most the share of the optimum's.
    """
    n, n_var, n_tiers = table.util.shape
    k = n_var * n_tiers + 1  # options per context, the last one is "dropped"
    util = np.concatenate([table.util.reshape(n, n_var * n_tiers), table.drop_util[:, None]], 1)
    size = np.concatenate([np.repeat(table.size_bytes, n_tiers, axis=1), np.zeros((n, 1))], 1)
    tier = np.concatenate([np.tile(np.arange(n_tiers), n_var), [-1]])
    allowed = np.isfinite(util)
    for t, cap in enumerate(table.capacity_bytes):
        if cap is not None:
            allowed &= ~((tier == t)[None, :] & (size > cap))
    allowed[table.pinned] &= tier[None, :] == 0
    constraints = [LinearConstraint(np.kron(np.eye(n), np.ones(k)), 1, 1)]
    for t, cap in enumerate(table.capacity_bytes):
        if cap is not None:
            row = np.where(tier[None, :] == t, size, 0.0).ravel()
            constraints.append(LinearConstraint(row[None, :], -np.inf, cap))
    result = milp(
        np.where(allowed, -util, 0.0).ravel(),
        constraints=constraints,
        integrality=np.zeros(n * k) if relax else np.ones(n * k),
        bounds=Bounds(0, allowed.astype(float).ravel()),
        options={"mip_rel_gap": 1e-9, "time_limit": 120},
    )
    assert result.status == 0, result.message
    return -float(result.fun)


def gain_share(table: UtilityTable, utility: float, best: float) -> float:
    """Share of the achievable gain: ``(u - u_drop) / (opt - u_drop)``, where ``u_drop`` is
    the utility with every context dropped (1.0 when caching cannot gain anything)."""
    floor = float(table.drop_util.sum())
    return (utility - floor) / (best - floor) if best > floor else 1.0
