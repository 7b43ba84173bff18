"""The plan of a full rebalance, built only when someone reads it.

A rebalance of 100,000 contexts changes most placements, and an ordered plan of ~90,000
:class:`~kvtierd.types.Operation` objects costs more than the solve itself. The daemon does not
read it (it reconciles from :meth:`Placer.placement`), so :class:`LazyPlan` defers the work:
the placements before and after are captured as arrays (a few copies of ``(n,)`` index arrays)
and the ordered operations are made on first access of ``operations``, for the contexts whose
placement changed only.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np

from kvtierd.policies.model import FloatArray, IntArray
from kvtierd.policies.plan_order import Change, order_changes
from kvtierd.policies.slots import Slots
from kvtierd.types import DROPPED, Operation, Placement, Plan, TierModel


class LazyPlan(Plan):
    """A :class:`Plan` whose operations are computed on first use, then kept."""

    __slots__ = ("_build", "_ops")

    def __init__(self, build: Callable[[], Plan]) -> None:
        object.__setattr__(self, "_build", build)
        object.__setattr__(self, "_ops", None)

    @property
    def operations(self) -> tuple[Operation, ...]:
        ops: tuple[Operation, ...] | None = object.__getattribute__(self, "_ops")
        if ops is None:
            build: Callable[[], Plan] = object.__getattribute__(self, "_build")
            ops = build().operations
            object.__setattr__(self, "_ops", ops)
            object.__setattr__(self, "_build", None)
        return ops


@dataclass(frozen=True, slots=True, eq=False)
class Snapshot:
    """Placements of every live slot at one moment: ids, variant names, choices and the
    size of each slot's chosen variant."""

    keys: Sequence[str]
    names: Sequence[tuple[str, ...]]
    size: FloatArray
    variant: IntArray
    tier: IntArray
    index: dict[str, int]

    @classmethod
    def of(cls, slots: Slots) -> Snapshot:
        """Capture ``slots``; the index arrays are copied (the slots keep changing)."""
        return cls(
            list(slots.keys),
            list(slots.names),
            slots.chosen(np.arange(len(slots.keys)))[0],
            slots.variant.copy(),
            slots.tier.copy(),
            dict(slots.index),
        )

    def placement(self, slot: int, tiers: Sequence[TierModel]) -> tuple[Placement, float]:
        t = int(self.tier[slot])
        if t < 0:
            return DROPPED, 0.0
        v = int(self.variant[slot])
        return Placement(self.names[slot][v], tiers[t].name), float(self.size[slot])


def rebalance_plan(
    before: Snapshot, after: Snapshot, tiers: Sequence[TierModel], used_after: Sequence[float]
) -> Plan:
    """Ordered operations taking every context from ``before`` to ``after``."""
    changes: list[Change] = []
    for cid, slot in before.index.items():
        if cid not in after.index:
            src, src_bytes = before.placement(slot, tiers)
            changes.append(Change(cid, src, DROPPED, src_bytes, 0.0, "not in rebalance"))
    # Candidates: contexts whose (variant index, tier) moved, or that are new; compare names
    # only for those (a re-profiled context can keep its index but rename its variant).
    keys = list(after.index)
    new_slots = np.fromiter((after.index[k] for k in keys), dtype=np.int64, count=len(keys))
    old_slots = np.fromiter((before.index.get(k, -1) for k in keys), np.int64, len(keys))
    known = old_slots >= 0
    old_t = np.where(known, before.tier[np.maximum(old_slots, 0)], -1)
    old_v = np.where(known, before.variant[np.maximum(old_slots, 0)], 0)
    new_t, new_v = after.tier[new_slots], after.variant[new_slots]
    moved = (old_t != new_t) | ((new_t >= 0) & (old_v != new_v))
    for k in np.flatnonzero(~moved & (new_t >= 0)).tolist():
        v = int(new_v[k])
        if before.names[old_slots[k]][v] != after.names[new_slots[k]][v]:
            moved[k] = True
    for k in np.flatnonzero(moved).tolist():
        ns, os_ = int(new_slots[k]), int(old_slots[k])
        src, src_bytes = before.placement(os_, tiers) if os_ >= 0 else (DROPPED, 0.0)
        dst, dst_bytes = after.placement(ns, tiers)
        changes.append(Change(keys[k], src, dst, src_bytes, dst_bytes, "rebalance"))
    used = {t.name: u for t, u in zip(tiers, used_after, strict=True)}
    return order_changes(changes, tiers, used)
