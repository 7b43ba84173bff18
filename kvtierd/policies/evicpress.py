# Long because Algorithm 1's insert, evict and rebalance share one greedy state (§4.4).
"""``evicpress``: joint compression + eviction by utility (EvicPress §4.2, §4.4, Algorithm 1).

* :meth:`EvicPressPlacer.insert` is Algorithm 1: the new context goes to its best configuration
  (normally its best variant in the fastest tier); while a tier is over capacity the cheapest
  operation (compress in place, move down with any variant, drop) is applied, recursing into
  slower tiers. Lazy heaps make each operation ``O(log n)``
  (:mod:`kvtierd.policies.greedy_state`).
* :meth:`EvicPressPlacer.adopt` records a placement found at daemon start (or left by an
  operation) as it is and only resolves an overflow it causes, repaired as an insert's is.
* :meth:`EvicPressPlacer.rebalance` recomputes every placement from fresh profiles: with the
  ``per_byte`` rule through the vectorised hull greedy (:mod:`kvtierd.policies.knapsack`) and,
  on small instances, its improvement phase (:mod:`kvtierd.policies.exchange`); with
  ``absolute`` by running Algorithm 1 on all contexts at once. State is installed as arrays
  and the plan is built only when read (:mod:`kvtierd.policies.rebalance_plan`).
* :meth:`EvicPressPlacer.access` counts a hit: the context's frequency grows by one, its
  utilities scale with it (``O(V T)``) and its heap entry is renewed (``O(log n)``), so it is
  costlier to demote from now on and is promoted by the next :meth:`insert` of it or
  :meth:`rebalance` (which takes ``max(profiled frequency, frequency counted here)``).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import replace
from typing import ClassVar

import numpy as np

from kvtierd.policies.base import Placer, PlacerParams
from kvtierd.policies.exact import Problem
from kvtierd.policies.greedy_state import DROP, GreedyState, Selection, Step
from kvtierd.policies.knapsack import greedy_assign, greedy_solve
from kvtierd.policies.model import (
    Assignment,
    IntArray,
    OptionArrays,
    UtilityTable,
    capacity_array,
)
from kvtierd.policies.plan_order import Change, order_changes
from kvtierd.policies.rebalance_plan import LazyPlan, Snapshot, rebalance_plan
from kvtierd.policies.refine import EXACT_MAX, RefineLimits, contested, refine
from kvtierd.policies.tree_placement import ContextTree, solve_with_precedence, subtree_frequency
from kvtierd.policy_config import (
    PROFILED_FIELDS,
    PROFILED_KEYS,
    PolicyConfig,
    PolicyDocument,
    read_profiled,
)
from kvtierd.types import DROPPED, ContextProfile, Placement, Plan, TierModel

INSERT_NODES = 1500
"""Search nodes an overflowing insert's repair may visit: a work limit, not seconds (the same
inserts give the same plan under any load). Measured on the merged trap instances of
100-200 contexts (issue 28): within 0.7% of the LP bound, the longest insert well under
50 ms on an idle core (``benchmarks/micro/bench_placer.py``)."""

INSERT_LIMITS = RefineLimits(max_nodes=INSERT_NODES, rounds=1, own_search=True)
"""What an overflowing insert may spend on its repair: one search of the own branch-and-bound
(:mod:`kvtierd.policies.branch_bound`; HiGHS's root work alone took 50-1000 ms on these)."""

COARSE_SHARE = 0.05
"""Above ``EXACT_MAX`` contested contexts an insert is repaired only when its overflow pushed
out a context holding at least this share of the tier: knapsack traps need contexts that are
large next to the tier; with small ones Algorithm 1 leaves little unused."""

COARSE_REPAIR_MAX = 2000
"""... and only up to this many contexts: a boundary neighbourhood reads every context's
``(V, T)`` utilities, which past a few thousand costs more than an insert may."""


class EvicPressPlacer(Placer):
    """EvicPress's greedy multi-choice-knapsack placer."""

    name = "evicpress"
    uses_quality = True
    policy_keys: ClassVar[tuple[str, ...]] = ("alpha", "selection", *PROFILED_KEYS)
    policy_fields: ClassVar[tuple[str, ...]] = ("alpha", "selection", *PROFILED_FIELDS)

    @classmethod
    def read_policy(cls, doc: PolicyDocument, policy: PolicyConfig) -> PolicyConfig:
        """``alpha`` (1/s), ``selection`` and the sections of a placer that places by profiles
        (the variant grid, profiling, frequency)."""
        alpha = doc.number(("alpha",), 1.0, lambda x: x > 0, "> 0 (1/s)")
        selection = doc.choice(("selection",), tuple(s.value for s in Selection), "per_byte")
        return read_profiled(doc, replace(policy, alpha=alpha, selection=selection))

    def __init__(self, tiers: Sequence[TierModel], params: PlacerParams | None = None) -> None:
        super().__init__(tiers, params)
        self.selection = Selection.parse(self.params.selection)
        self._caps = tuple(t.capacity_bytes for t in self.tiers)
        self._caps_f = capacity_array(self._caps)
        self._tier_index = {t.name: i for i, t in enumerate(self.tiers)}
        self._state = GreedyState(self._caps, self.selection)
        # Ids of the contested contexts (refine.contested), kept per insert/remove; None after a
        # rebalance installed a whole table (counted again at the next overflowing insert).
        self._contested: set[str] | None = set()

    # -- the Placer interface ----------------------------------------------------------------

    def insert(self, profile: ContextProfile) -> Plan:
        return self.insert_row(self._table([profile]), 0)

    def adopt(self, profile: ContextProfile, placement: Placement) -> Plan:
        """Record a context that already lives at ``placement``; only resolve an overflow."""
        cid = profile.context_id
        tier = DROP if placement.tier is None else self._tier_of(placement.tier)
        slot = self._readd(profile)
        if tier == DROP:
            return Plan()
        names = self._state.slots.names[slot]
        if placement.variant not in names:
            self.remove(cid)
            raise ValueError(f"context {cid!r} has no variant {placement.variant!r}")
        self._state.place(slot, names.index(placement.variant), tier)
        before = self._snapshot(cid)  # it is already there: not a change
        # Repaired as an insert is: Algorithm 1 resolves an overflow inside the overflowing
        # tier, so without it an adopt that overflowed the SSD tier dropped contexts there
        # while a faster tier kept a rarely read context whole (measured: RESULTS.md, the
        # system-prompt trace).
        return self._resolve(cid, before, tier, "overflow on adopt", repair=True)

    def relearn(self, profile: ContextProfile, where: Placement) -> Plan:
        """Take a known context's options afresh, at its placement when its variant is still
        among them, else at ``where``. Each context keeps the options it was inserted with, so
        after a compression that left no original the repair of a later insert could choose
        the original again, a form the context no longer has: it would be counted at its
        original size in one tier while its compressed objects sit in another. Rule: a
        placer's options for a context are always forms it can still take."""
        cid = profile.context_id
        at = self.placement(cid) if cid in self._state.slots.index else where
        if not at.dropped and at.variant not in {v.variant for v in profile.variants}:
            at = where
        return self.adopt(profile, at)

    def access(self, context_id: str, now_s: float, fastest: str = "") -> Plan:
        """Count a hit (see the module doc); placement changes wait for insert/rebalance."""
        slot = self._state.slots.index.get(context_id)
        if slot is not None:
            self._state.rescale(slot, float(self._state.slots.freq[slot]) + 1.0)
        return Plan()

    def remove(self, context_id: str) -> None:
        self._state.discard(context_id)
        if self._contested is not None:
            self._contested.discard(context_id)

    def placement(self, context_id: str) -> Placement:
        s = self._state.slots
        slot = s.index[context_id]
        t = int(s.tier[slot])
        if t < 0:
            return DROPPED
        return Placement(s.names[slot][int(s.variant[slot])], self.tiers[t].name)

    def rebalance(
        self, profiles: Sequence[ContextProfile], fastest: Mapping[str, str] | None = None
    ) -> Plan:
        return self.rebalance_options(OptionArrays.from_profiles(profiles), fastest)

    def rebalance_options(
        self, options: OptionArrays, fastest: Mapping[str, str] | None = None
    ) -> Plan:
        """:meth:`rebalance` from arrays: each context at ``max(its frequency, the hits
        counted here)``, priced in the tiers as measured now; a context ``fastest`` names is
        given no option above that tier (:func:`_kept_below`)."""
        s = self._state.slots
        slot = np.array([s.index.get(c, -1) for c in options.context_ids], dtype=np.int64)
        counted = np.where(slot >= 0, s.freq[np.maximum(slot, 0)] if s.freq.size else 0.0, 0.0)
        freq = np.maximum(options.frequency, counted)
        if self.parents:  # a prefix is loaded by every request of its descendants too
            freq = subtree_frequency(freq, ContextTree.of(options.context_ids, self.parents))
        merged = replace(options, frequency=freq)
        table = UtilityTable.from_options(merged, self.tiers, self.params.alpha)
        if fastest:
            table = _kept_below(table, fastest, [t.name for t in self.tiers])
        return self.rebalance_table(table)

    def placements(self, context_ids: Sequence[str]) -> list[Placement]:
        """:meth:`placement` of each context from the arrays (``DROPPED`` when unknown)."""
        s = self._state.slots
        names = [t.name for t in self.tiers]
        known: dict[tuple[str, int], Placement] = {}
        out = []
        index, tier, variant = s.index, s.tier.tolist(), s.variant.tolist()
        for cid in context_ids:
            slot = index.get(cid, -1)
            t = -1 if slot < 0 else tier[slot]
            if t < 0:
                out.append(DROPPED)
                continue
            key = (s.names[slot][variant[slot]], t)
            placement = known.get(key)
            if placement is None:
                placement = known[key] = Placement(key[0], names[t])
            out.append(placement)
        return out

    # -- extensions ------------------------------------------------------------------------

    def rebalance_table(self, table: UtilityTable) -> Plan:
        """:meth:`rebalance` from a prebuilt table (the profiler's fast path: no objects).

        The table's arrays become the placer's state (shared; copied on the first later
        write). The returned plan is built when first read.
        """
        before = Snapshot.of(self._state.slots)
        forest = ContextTree.of(table.context_ids, self.parents) if self.parents else None
        if forest is not None and forest.has_children:
            assignment = solve_with_precedence(table, forest, lambda t: solve(t, self.selection))
        else:
            assignment = solve(table, self.selection)
        tier = np.where(assignment.dropped, DROP, assignment.tier)
        self._state = GreedyState.from_table(table, assignment.variant, tier, self.selection)
        self._contested = None
        after = Snapshot.of(self._state.slots)
        used = list(self._state.used)
        return LazyPlan(lambda: rebalance_plan(before, after, self.tiers, used))

    def insert_row(self, table: UtilityTable, row: int) -> Plan:
        """:meth:`insert` of row ``row`` of a prebuilt table (no profile objects)."""
        cid = table.context_ids[row]
        before = self._snapshot(cid)
        self._state.discard(cid)
        slot = self._state.add(cid, table.variant_names[row], table, row)
        self._note_contested(cid, slot)
        s = self._state.slots
        variant, tier = self._state.best_start(*s.row(slot), float(s.drop[slot]))
        if tier != DROP:
            self._state.place(slot, variant, tier)
        return self._resolve(cid, before, max(tier, 0), "utility (Algorithm 1)", repair=True)

    def total_utility(self) -> float:
        """Sum of the current placements' utilities (the objective of §4.4)."""
        return self._state.total_utility()

    def room_cost(self, tier: str, need_bytes: float) -> float:
        """The utility the placer would give up to fit ``need_bytes`` more in ``tier``
        (``GreedyState.room_cost``: 0 while there is room)."""
        return self._state.room_cost(self._tier_of(tier), need_bytes)

    def used_bytes(self) -> list[float]:
        """Bytes placed in each tier, fastest first."""
        return list(self._state.used)

    def variants(self, context_id: str) -> tuple[str, ...]:
        """The variants the placer weighs for a context (``KeyError`` for an unknown one)."""
        s = self._state.slots
        return tuple(s.names[s.index[context_id]])

    def frequency(self, context_id: str) -> float:
        """The access frequency the placer now uses for a context (profile + counted hits)."""
        s = self._state.slots
        return float(s.freq[s.index[context_id]])

    # -- internals -------------------------------------------------------------------------

    def _capacity_changed(self, tier: int, plan: bool) -> Plan:
        """Algorithm 1's cheapest operations in a tier that shrank (:meth:`hold_back`), as
        for an overflow: compress, move down or drop what gives up least utility."""
        self._caps = tuple(t.capacity_bytes for t in self.tiers)
        self._caps_f = capacity_array(self._caps)
        self._state.set_capacities(self._caps)
        if not plan:
            return Plan()
        steps = self._state.resolve(tier)
        touched = {s.key: self._step_source(s) for s in reversed(steps)}
        return self._plan(touched, "room held back in the tier")

    def _tier_of(self, name: str) -> int:
        try:
            return self._tier_index[name]
        except KeyError:
            known = ", ".join(self._tier_index)
            raise ValueError(f"unknown tier {name!r}; tiers: {known}") from None

    def _table(self, profiles: Sequence[ContextProfile]) -> UtilityTable:
        """The profiles' utilities, each at ``max(profiled frequency, hits counted here)``."""
        merged = [self._merge_counted(p) for p in profiles]
        return UtilityTable.from_profiles(merged, self.tiers, self.params.alpha)

    def _merge_counted(self, profile: ContextProfile) -> ContextProfile:
        """``profile`` with the hits counted by :meth:`access` if they exceed its frequency."""
        s = self._state.slots
        slot = s.index.get(profile.context_id)
        if slot is not None and s.freq[slot] > profile.frequency:
            return replace(profile, frequency=float(s.freq[slot]))
        return profile

    def _readd(self, profile: ContextProfile) -> int:
        """Forget the context's old slot and give it a fresh one (dropped) from ``profile``."""
        table = self._table([profile])
        self._state.discard(profile.context_id)
        return self._state.add(profile.context_id, table.variant_names[0], table, 0)

    def _resolve(
        self,
        cid: str,
        before: tuple[Placement, float],
        start: int,
        reason: str,
        repair: bool = False,
    ) -> Plan:
        steps = self._state.resolve(start)
        if repair and steps:
            steps += self._repair(steps)
        if self.parents:
            steps += self._orphans(cid, steps)
        # The earliest source of each touched context is its placement before this call.
        touched = {s.key: self._step_source(s) for s in reversed(steps)}
        touched[cid] = before
        return self._plan(touched, reason)

    def _note_contested(self, cid: str, slot: int) -> None:
        if self._contested is None:
            return
        if self._held_in_finite_tiers() > EXACT_MAX:
            # Not read while so many are held (:meth:`_few_contested`), so not kept: a set of
            # a million ids, and a check per insert; counted again when next needed.
            self._contested = None
            return
        s = self._state.slots
        one = Problem(*s.gather(np.array([slot])), s.drop[[slot]], s.pinned[[slot]], self._caps_f)
        if contested(one).size:
            self._contested.add(cid)
        else:
            self._contested.discard(cid)

    def _repair(self, steps: list[Step]) -> list[Step]:
        """After an overflow, the online path's fix for knapsack traps
        (:mod:`kvtierd.policies.refine`): every context re-solved exactly when few compete for
        capacity, else one boundary neighbourhood when the overflow was coarse (see
        :data:`COARSE_SHARE`). Returns the changes as steps."""
        s = self._state.slots
        coarse = len(s.index) <= COARSE_REPAIR_MAX and self._coarse(steps)
        if not coarse and self._held_in_finite_tiers() > EXACT_MAX:
            return []  # (before any pass over the contexts: an insert at 1M took ~5 ms here)
        live = np.flatnonzero(s.alive)
        if not (coarse or self._few_contested(live)):
            return []
        problem = Problem(*s.gather(live), s.drop[live], s.pinned[live], self._caps_f)
        tier = s.tier[live]
        current = Assignment(
            variant=np.where(tier < 0, 0, s.variant[live]),
            tier=np.maximum(tier, 0),
            dropped=tier < 0,
        )
        better = refine(problem, current, INSERT_LIMITS)
        if better is current:
            return []
        new_tier = np.where(better.dropped, DROP, better.tier)
        changed = np.flatnonzero((new_tier != tier) | (better.variant != current.variant))
        return [
            self._state.reassign(int(live[k]), int(better.variant[k]), int(new_tier[k]))
            for k in changed.tolist()
        ]

    def _orphans(self, cid: str, steps: list[Step]) -> list[Step]:
        """Drop what precedence makes useless (:mod:`kvtierd.policies.tree_placement`): ``cid``
        when its parent is dropped, and whatever is cached below a context that is dropped.
        A parent the placer does not know yet (adopted later at start, or held outside its
        view for its durable objects) drops nothing. Dropping only frees room, so no tier
        overflows."""
        s = self._state.slots

        def cached(key: str) -> bool:
            slot = s.index.get(key)
            return slot is None or bool(s.tier[slot] >= 0)

        todo = [st.key for st in steps if st.dst_tier is None or st.dst_tier < 0]
        todo.append(cid)
        seen: set[str] = set()
        out: list[Step] = []
        while todo:
            key = todo.pop()
            if key in seen:
                continue
            seen.add(key)
            parent = self.parents.get(key, "")
            slot = s.index.get(key)  # None: outside the placer's view, nothing to drop
            if slot is not None and cached(key) and parent and not cached(parent):
                out.append(self._state.reassign(slot, 0, DROP))
            if not cached(key):
                todo.extend(self.children.get(key, ()))
        return out

    def _held_in_finite_tiers(self) -> int:
        caps, held = self._caps_f, self._state.held
        return sum(n for t, n in enumerate(held) if np.isfinite(caps[t]))

    def _few_contested(self, live: IntArray) -> bool:
        """At most ``EXACT_MAX`` contexts held in finite tiers and at most as many contested."""
        s = self._state.slots
        tier = s.tier[live]
        held = (tier >= 0) & np.isfinite(self._caps_f[np.maximum(tier, 0)])
        if np.count_nonzero(held) > EXACT_MAX:
            return False  # checked first: O(n), where counting the contested reads (n, V, T)
        if self._contested is None:
            whole = Problem(*s.gather(live), s.drop[live], s.pinned[live], self._caps_f)
            self._contested = {s.keys[i] for i in live[contested(whole)].tolist()}
        return len(self._contested) <= EXACT_MAX

    def _coarse(self, steps: list[Step]) -> bool:
        """Whether a step moved a context holding ``COARSE_SHARE`` of a finite tier out of it."""
        s = self._state.slots
        for step in steps:
            t = step.src_tier
            if t is None or step.dst_tier == t or not np.isfinite(self._caps_f[t]):
                continue
            size = s.size_of(s.index[step.key], step.src_variant)
            if size >= COARSE_SHARE * self._caps_f[t]:
                return True
        return False

    def _snapshot(self, cid: str) -> tuple[Placement, float]:
        s = self._state.slots
        slot = s.index.get(cid)
        if slot is None or s.tier[slot] < 0:
            return DROPPED, 0.0
        return self.placement(cid), s.size_of(slot, int(s.variant[slot]))

    def _step_source(self, step: Step) -> tuple[Placement, float]:
        if step.src_tier is None:
            return DROPPED, 0.0
        s = self._state.slots
        slot = s.index[step.key]
        name = s.names[slot][step.src_variant]
        return Placement(name, self.tiers[step.src_tier].name), s.size_of(slot, step.src_variant)

    def _plan(self, sources: dict[str, tuple[Placement, float]], reason: str) -> Plan:
        """Net changes from ``sources`` (placement before) to now, safely ordered."""
        changes = []
        for cid, (src, src_bytes) in sources.items():
            dst, dst_bytes = self._snapshot(cid)
            if dst != src:
                changes.append(Change(cid, src, dst, src_bytes, dst_bytes, reason))
        used = {t.name: u for t, u in zip(self.tiers, self._state.used, strict=True)}
        return order_changes(changes, self.tiers, used)


FORBIDDEN_UTILITY = -1e30
"""The utility of an option a context may not take: below any drop, so no solver or repair
picks it (finite, unlike ``-inf``, so that no difference or ratio of utilities is NaN)."""


def _kept_below(
    table: UtilityTable, fastest: Mapping[str, str], tier_names: Sequence[str]
) -> UtilityTable:
    """``table`` with every option of a context above its ``fastest`` tier forbidden: its
    tenant's or namespace's quota is full there, so a plan that put it there would move other
    contexts down for one the executor then keeps out (issue 41.2)."""
    row = {cid: i for i, cid in enumerate(table.context_ids)}
    util = table.util.copy()
    for cid, name in fastest.items():
        i = row.get(cid)
        if i is not None and name in tier_names:
            util[i, :, : tier_names.index(name)] = FORBIDDEN_UTILITY
    return replace(table, util=util)


def solve(
    table: UtilityTable,
    selection: Selection = Selection.PER_BYTE,
    limits: RefineLimits | None = None,
) -> Assignment:
    """Place all contexts of ``table`` at once (offline; used by rebalance and the checks).

    The greedy's answer is then refined (:mod:`kvtierd.policies.refine`): solved exactly when
    few contexts compete for capacity, improved by boundary neighbourhoods otherwise.
    """
    if table.n_contexts == 0:
        return greedy_assign(table)
    limits = limits or RefineLimits()
    if selection is Selection.PER_BYTE:
        greedy = greedy_solve(table)
        return refine(Problem.of(table), greedy.assignment, limits, greedy.prices)
    return refine(Problem.of(table), algorithm1_offline(table, selection), limits)


def algorithm1_offline(table: UtilityTable, selection: Selection) -> Assignment:
    """Algorithm 1 on all contexts: each at its best configuration, then resolve overflows."""
    n = table.n_contexts
    state = GreedyState.from_table(
        table, np.zeros(n, dtype=np.int64), np.full(n, DROP, dtype=np.int64), selection
    )
    for i in range(n):
        variant, tier = state.best_start(
            table.size_bytes[i], table.util[i], float(table.drop_util[i])
        )
        if tier != DROP:
            state.place(i, variant, tier)
    state.resolve(0)
    tier_arr = state.slots.tier[:n].copy()
    dropped = tier_arr < 0
    return Assignment(
        variant=np.where(dropped, 0, state.slots.variant[:n]).astype(np.int64),
        tier=np.maximum(tier_arr, 0).astype(np.int64),
        dropped=dropped,
    )
