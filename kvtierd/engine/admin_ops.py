"""Operator actions on the engine: evict, pin, drain, rebalance, hot policy reload."""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, cast

from kvtierd.errors import NotFoundError
from kvtierd.policy_config import PolicyConfig
from kvtierd.types import DROPPED, ContextProfile, Operation, OpKind, Placement, Plan

if TYPE_CHECKING:
    from kvtierd.engine.engine import Engine


class AdminOps:
    """Mixed into :class:`~kvtierd.engine.Engine`; every method runs on the event loop."""

    async def evict(self, context_ids: Sequence[str]) -> int:
        e = cast("Engine", self)
        evicted = 0
        for cid in context_ids:
            ctx = e.contexts.get(cid)
            if ctx is None:
                raise NotFoundError(f"context {cid!r} not found")
            await e.drop_context(ctx)
            e.placer.remove(cid)
            evicted += 1
        return evicted

    def set_pinned(self, context_ids: Sequence[str], pinned: bool) -> int:
        e = cast("Engine", self)
        changed = 0
        for cid in context_ids:
            ctx = e.contexts.get(cid)
            if ctx is None:
                raise NotFoundError(f"context {cid!r} not found")
            if ctx.pinned != pinned:
                ctx.pinned = pinned
                changed += 1
                e.executor.submit(e.adopt_placement(ctx, e.placement_of(ctx)))
        return changed

    async def drain(self, tier_name: str) -> tuple[int, int]:
        """Move every context out of ``tier_name`` to the next tier down, or drop it."""
        e = cast("Engine", self)
        names = list(e.tiers)
        if tier_name not in names:
            raise NotFoundError(f"no tier {tier_name!r}; tiers: {', '.join(names)}")
        below = names[names.index(tier_name) + 1 :]
        moved = dropped = 0
        for ctx in [c for c in e.contexts.values() if e.placement_of(c).tier == tier_name]:
            if below:
                await e.move_context(ctx, below[0])
                e.executor.submit(e.adopt_placement(ctx, Placement(ctx.variant, below[0])))
                moved += 1
            else:
                await e.drop_context(ctx)
                e.placer.remove(ctx.context_id)
                dropped += 1
        return moved, dropped

    async def rebalance(self) -> Plan:
        e = cast("Engine", self)
        await e.executor.idle()
        e.placer.refresh_tiers(e.tier_models())  # bandwidths measured since the last one
        e.placer.rebalance(e.placed_profiles())
        plan = e._reconcile("rebalance")
        await e.executor.run(plan)
        return plan

    async def apply_policy(self, policy: PolicyConfig) -> Plan:
        """Hot reload: a new placer re-places every context; the old one stays on error."""
        e = cast("Engine", self)
        placer = e._make_placer(policy)
        await e.executor.idle()
        old = e.policy
        e.policy = policy  # profiles below list the new policy's variants
        try:
            placer.rebalance(e.placed_profiles())
        except BaseException:
            e.policy = old
            raise
        e.placer = placer
        e.profiling.configure()
        plan = e._reconcile("policy applied")
        await e.executor.run(plan)
        return plan

    def placed_profiles(self) -> list[ContextProfile]:
        """Profiles of every context the placer decides on (not those held for their unread
        durable objects, durable.py)."""
        e = cast("Engine", self)
        return [e.profile(c) for c in e.contexts.values() if not c.durable_held]

    def _reconcile(self, reason: str) -> Plan:
        """Operations that bring every context to where the placer now wants it. Built from
        the placer's state, not its plan: a fresh placer's plan is relative to its own empty
        view, while this is relative to where the bytes really are."""
        e = cast("Engine", self)
        ops = []
        for ctx in e.contexts.values():
            if ctx.durable_held:
                continue  # outside the placer's view until its durable objects are read
            source = e.placement_of(ctx)
            try:
                target = e.placer.placement(ctx.context_id)
            except KeyError:
                target = DROPPED
            if target == source:
                continue
            if target.dropped:
                kind = OpKind.DROP
            elif target.variant != source.variant:
                kind = OpKind.COMPRESS
            else:
                kind = OpKind.MOVE
            ops.append(Operation(kind, ctx.context_id, source, target, reason))
        return Plan(tuple(ops))
