"""``evicpress``: joint compression + eviction by utility (EvicPress §4.2, §4.4, Algorithm 1).

* :meth:`EvicPressPlacer.insert` is Algorithm 1: the new context goes to its best configuration
  (normally its best variant in the fastest tier); while a tier is over capacity the cheapest
  operation (compress in place, move down with any variant, drop) is applied, recursing into
  slower tiers. Lazy heaps make each operation ``O(log n)``
  (:mod:`kvtierd.policies.greedy_state`).
* :meth:`EvicPressPlacer.rebalance` recomputes every placement from fresh profiles: with the
  ``per_byte`` rule through the vectorised hull greedy (:mod:`kvtierd.policies.knapsack`),
  with ``absolute`` by running Algorithm 1 on all contexts at once.
* :meth:`EvicPressPlacer.access` changes nothing: placement follows the profiled frequency, not
  recency (the profiler re-inserts a context whose frequency changed).
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from kvtierd.policies.base import Placer, PlacerParams, register_placer
from kvtierd.policies.greedy_state import GreedyState, Row, Selection, Step
from kvtierd.policies.knapsack import greedy_assign
from kvtierd.policies.model import Assignment, UtilityTable
from kvtierd.policies.plan_order import Change, order_changes
from kvtierd.types import DROPPED, ContextProfile, Placement, Plan, TierModel


@register_placer
class EvicPressPlacer(Placer):
    """EvicPress's greedy multi-choice-knapsack placer."""

    name = "evicpress"

    def __init__(self, tiers: Sequence[TierModel], params: PlacerParams | None = None) -> None:
        super().__init__(tiers, params)
        self.selection = Selection.parse(self.params.selection)
        self._caps = tuple(t.capacity_bytes for t in self.tiers)
        self._state = GreedyState(self._caps, self.selection)
        self._names: dict[str, tuple[str, ...]] = {}

    # -- the Placer interface ----------------------------------------------------------------

    def insert(self, profile: ContextProfile) -> Plan:
        cid = profile.context_id
        before = self._snapshot(cid)
        self._state.discard(cid)
        table = UtilityTable.from_profiles([profile], self.tiers, self.params.alpha)
        row = _row(table, 0)
        self._names[cid] = table.variant_names[0]
        variant, tier = self._state.best_start(row)
        self._state.add(row, variant, tier)
        steps = self._state.resolve(0 if tier is None else tier)
        # The earliest source of each touched context is its placement before this insert.
        touched = {s.key: self._step_source(s) for s in reversed(steps)}
        touched[cid] = before
        return self._plan(touched, "utility (Algorithm 1)")

    def access(self, context_id: str, now_s: float) -> Plan:
        # Placement follows the profiled frequency (§4.3), not recency: nothing to do per hit.
        return Plan()

    def remove(self, context_id: str) -> None:
        self._state.discard(context_id)
        self._names.pop(context_id, None)

    def placement(self, context_id: str) -> Placement:
        row = self._state.rows[context_id]
        if row.tier is None:
            return DROPPED
        return Placement(self._names[context_id][row.variant], self.tiers[row.tier].name)

    def rebalance(self, profiles: Sequence[ContextProfile]) -> Plan:
        table = UtilityTable.from_profiles(profiles, self.tiers, self.params.alpha)
        return self.rebalance_table(table)

    # -- extensions ------------------------------------------------------------------------

    def rebalance_table(self, table: UtilityTable) -> Plan:
        """:meth:`rebalance` from a prebuilt table (the profiler's fast path: no objects)."""
        before = {cid: self._snapshot(cid) for cid in self._state.rows}
        assignment = solve(table, self.selection)
        state = GreedyState(self._caps, self.selection)
        for i in range(table.n_contexts):
            row = _row(table, i)
            tier = None if assignment.dropped[i] else int(assignment.tier[i])
            state.add(row, int(assignment.variant[i]), tier, queue=False)
        self._state = state
        self._names = dict(zip(table.context_ids, table.variant_names, strict=True))
        gone = [cid for cid in before if cid not in state.rows]
        touched = before | {cid: (DROPPED, 0.0) for cid in table.context_ids if cid not in before}
        return self._plan(touched, "rebalance", gone=gone)

    def total_utility(self) -> float:
        """Sum of the current placements' utilities (the objective of §4.4)."""
        total = 0.0
        for row in self._state.rows.values():
            total += row.drop_util if row.tier is None else float(row.util[row.variant, row.tier])
        return total

    def used_bytes(self) -> list[float]:
        """Bytes placed in each tier, fastest first."""
        return list(self._state.used)

    # -- internals -------------------------------------------------------------------------

    def _snapshot(self, cid: str) -> tuple[Placement, float]:
        row = self._state.rows.get(cid)
        if row is None or row.tier is None:
            return DROPPED, 0.0
        return self.placement(cid), float(row.size[row.variant])

    def _step_source(self, step: Step) -> tuple[Placement, float]:
        row = self._state.rows[step.key]
        if step.src_tier is None:
            return DROPPED, 0.0
        name = self._names[step.key][step.src_variant]
        return Placement(name, self.tiers[step.src_tier].name), float(row.size[step.src_variant])

    def _plan(
        self, sources: dict[str, tuple[Placement, float]], reason: str, gone: Sequence[str] = ()
    ) -> Plan:
        """Net changes from ``sources`` (placement before) to now, safely ordered."""
        changes = []
        for cid, (src, src_bytes) in sources.items():
            if cid in gone:
                changes.append(Change(cid, src, DROPPED, src_bytes, 0.0, "not in rebalance"))
                continue
            dst, dst_bytes = self._snapshot(cid)
            if dst != src:
                changes.append(Change(cid, src, dst, src_bytes, dst_bytes, reason))
        used = {t.name: u for t, u in zip(self.tiers, self._state.used, strict=True)}
        return order_changes(changes, self.tiers, used)


def _row(table: UtilityTable, i: int) -> Row:
    return Row(
        key=table.context_ids[i],
        size=table.size_bytes[i],
        util=table.util[i],
        drop_util=float(table.drop_util[i]),
        pinned=bool(table.pinned[i]),
    )


def solve(table: UtilityTable, selection: Selection = Selection.PER_BYTE) -> Assignment:
    """Place all contexts of ``table`` at once (offline; used by rebalance and the checks)."""
    if selection is Selection.PER_BYTE:
        return greedy_assign(table)
    return algorithm1_offline(table, selection)


def algorithm1_offline(table: UtilityTable, selection: Selection) -> Assignment:
    """Algorithm 1 on all contexts: each at its best configuration, then resolve overflows."""
    state = GreedyState(table.capacity_bytes, selection)
    for i in range(table.n_contexts):
        row = _row(table, i)
        variant, tier = state.best_start(row)
        state.add(row, variant, tier)
    state.resolve(0)
    n = table.n_contexts
    variant_arr = np.zeros(n, dtype=np.int64)
    tier_arr = np.zeros(n, dtype=np.int64)
    dropped = np.zeros(n, dtype=bool)
    for i, cid in enumerate(table.context_ids):
        row = state.rows[cid]
        variant_arr[i] = row.variant
        tier_arr[i] = 0 if row.tier is None else row.tier
        dropped[i] = row.tier is None
    return Assignment(variant=variant_arr, tier=tier_arr, dropped=dropped)
