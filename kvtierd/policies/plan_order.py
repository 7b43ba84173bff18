"""Turn a set of placement changes into a :class:`~kvtierd.types.Plan` that is safe in order.

A placer decides final placements; the engine executes operations one at a time, and the
placer contract says no prefix of a plan may put a tier over capacity. A greedy cascade frees a
fast tier by pushing contexts into a slower one, so the slower tier's own evictions must run
first. This module simulates tier usage and emits, pass after pass, every change whose target
has room (drops and in-place compressions always do). A cycle in which every pending change
waits for another (possible only in a full rebalance: two contexts swapping tiers, both full)
is broken by taking one context out first (:data:`BREAK_CYCLE`) and placing it again at the
end. The engine keeps its bytes where they are meanwhile and carries the placement out as a
move: dropping them made every such context a miss (issue 13's end-to-end run).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from kvtierd.types import DROPPED, Operation, OpKind, Placement, Plan, TierModel

BREAK_CYCLE = "break cycle"  # the reason of a drop that the same plan places again


@dataclass(frozen=True, slots=True)
class Change:
    """One context's net change: ``source`` -> ``target`` with the bytes of each (0 if dropped)."""

    context_id: str
    source: Placement
    target: Placement
    source_bytes: float
    target_bytes: float
    reason: str = ""


def op_kind(source: Placement, target: Placement) -> OpKind:
    """``place`` from dropped, ``drop`` to dropped, ``compress`` within a tier, else ``move``."""
    if source.dropped:
        return OpKind.PLACE
    if target.dropped:
        return OpKind.DROP
    return OpKind.COMPRESS if source.tier == target.tier else OpKind.MOVE


def order_changes(
    changes: Sequence[Change], tiers: Sequence[TierModel], used_after: Mapping[str, float]
) -> Plan:
    """Order ``changes`` so that executing them one by one keeps every tier within capacity.

    ``used_after`` is each tier's usage (bytes) once all changes are applied; the usage before
    is derived from it, so the caller only reports its final state.
    """
    cap = {
        t.name: (float("inf") if t.capacity_bytes is None else float(t.capacity_bytes))
        for t in tiers
    }
    used = dict.fromkeys(cap, 0.0)
    used.update(used_after)
    for c in changes:  # roll the final usage back to the usage before the changes
        if c.target.tier is not None:
            used[c.target.tier] -= c.target_bytes
        if c.source.tier is not None:
            used[c.source.tier] += c.source_bytes
    pending = [c for c in changes if c.source != c.target]
    ops: list[Operation] = []
    replace_later: list[Change] = []
    while pending:
        waiting: list[Change] = []
        for c in pending:
            if _fits(c, used, cap):
                _apply(c, used)
                ops.append(_operation(c))
            else:
                waiting.append(c)
        if len(waiting) == len(pending) and all(c.source.dropped for c in waiting):
            # Nothing left to drop: the placer's final state itself overflows a tier (only
            # pinned contexts can make it so). Emit the placements rather than loop forever.
            ops.extend(_operation(c) for c in (*waiting, *replace_later))
            break
        if len(waiting) == len(pending):
            # Deadlock: drop the smallest waiting context now, place it again at the end.
            victim = min(waiting, key=lambda c: c.source_bytes)
            waiting.remove(victim)
            ops.append(
                Operation(OpKind.DROP, victim.context_id, victim.source, DROPPED, BREAK_CYCLE)
            )
            _apply(
                Change(victim.context_id, victim.source, DROPPED, victim.source_bytes, 0.0), used
            )
            replace_later.append(
                Change(
                    victim.context_id,
                    DROPPED,
                    victim.target,
                    0.0,
                    victim.target_bytes,
                    victim.reason,
                )
            )
        pending = waiting
        if not pending and replace_later:
            pending, replace_later = replace_later, []
    return Plan(tuple(ops))


def _operation(c: Change) -> Operation:
    return Operation(op_kind(c.source, c.target), c.context_id, c.source, c.target, c.reason)


def _fits(c: Change, used: dict[str, float], cap: dict[str, float]) -> bool:
    tier = c.target.tier
    if tier is None:
        return True
    delta = c.target_bytes - (c.source_bytes if c.source.tier == tier else 0.0)
    return used[tier] + delta <= cap[tier] or delta <= 0


def _apply(c: Change, used: dict[str, float]) -> None:
    if c.source.tier is not None:
        used[c.source.tier] -= c.source_bytes
    if c.target.tier is not None:
        used[c.target.tier] += c.target_bytes
