"""Operator actions on the engine: evict, pin, drain, rebalance, hot policy reload."""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence

from kvtierd.engine.executor import Executor
from kvtierd.engine.index import ContextIndex
from kvtierd.engine.mover import TierMover
from kvtierd.engine.placing import Placing
from kvtierd.engine.profiling.profiling_service import ProfilingService
from kvtierd.engine.state import RunningPolicy
from kvtierd.errors import NotFoundError
from kvtierd.policy_config import PolicyConfig
from kvtierd.types import Placement, Plan

logger = logging.getLogger(__name__)


class AdminOps:
    """What an operator asks of the engine; every method runs on the event loop."""

    def __init__(
        self,
        *,
        index: ContextIndex,
        mover: TierMover,
        executor: Executor,
        placing: Placing,
        profiling: ProfilingService,
        policy: RunningPolicy,
    ) -> None:
        self._index = index
        self._mover = mover
        self._executor = executor
        self._placing = placing
        self._profiling = profiling
        self._policy = policy

    async def evict(self, context_ids: Sequence[str]) -> int:
        evicted = 0
        for cid in context_ids:
            ctx = self._index.contexts.get(cid)
            if ctx is None:
                raise NotFoundError(f"context {cid!r} not found")
            await self._mover.drop_context(ctx)
            self._placing.remove(cid)
            evicted += 1
        return evicted

    def set_pinned(self, context_ids: Sequence[str], pinned: bool) -> int:
        changed = 0
        for cid in context_ids:
            ctx = self._index.contexts.get(cid)
            if ctx is None:
                raise NotFoundError(f"context {cid!r} not found")
            if ctx.pinned != pinned:
                ctx.pinned = pinned
                changed += 1
                self._executor.submit(self._placing.adopt_where_it_is(ctx))
        return changed

    async def drain(self, tier_name: str) -> tuple[int, int]:
        """Move every context out of ``tier_name`` to the next tier down, or drop it.

        The placer's plans already submitted run first: a queued ``place`` (after a put) or
        ``promoted on access`` move into this tier would otherwise bring a context back into it
        right after the drain returned, behind the placer's back (it was told the context is
        below). A read after the drain may still promote what it reads: that is the placer's
        call, made after the drain."""
        names = list(self._mover.tiers)
        if tier_name not in names:
            raise NotFoundError(f"no tier {tier_name!r}; tiers: {', '.join(names)}")
        below = names[names.index(tier_name) + 1 :]
        await self._executor.idle()
        moved = dropped = 0
        index = self._index
        for ctx in [c for c in index.contexts.values() if index.placement_of(c).tier == tier_name]:
            if below:
                await self._mover.move_context(ctx, below[0])
                self._executor.submit(self._placing.adopt(ctx, Placement(ctx.variant, below[0])))
                moved += 1
            else:
                await self._mover.drop_context(ctx)
                self._placing.remove(ctx.context_id)
                dropped += 1
        return moved, dropped

    async def rebalance(self) -> Plan:
        """Re-place every context from its kept options (``Placing.rebalance``) and run the
        plan: the executor first finishes what it has, so the plan starts from where the bytes
        are."""
        started = time.perf_counter()
        await self._executor.idle()
        waited = time.perf_counter()
        plan = self._placing.rebalance("rebalance")
        placed = time.perf_counter()
        await self._executor.run(plan)
        # Where a rebalance's time goes: after a restart most of it is carrying out the plan
        # (the CPU tier refilled from the SSD tier), not the placer's pass (issue 42.3).
        logger.info("rebalance: %.2f s waiting for the executor, %.2f s placing %d contexts, "
                    "%d operations carried out in %.2f s", waited - started, placed - waited,
                    len(self._index.contexts), len(plan.operations),
                    time.perf_counter() - placed)  # fmt: skip
        return plan

    async def apply_policy(self, policy: PolicyConfig) -> Plan:
        """Hot reload: a new placer re-places every context; the old one stays on error."""
        placing = self._placing
        placer = placing.make_placer(policy)
        await self._executor.idle()
        old = self._policy.current
        self._policy.current = policy  # profiles below list the new policy's variants
        try:
            placer.rebalance_options(placing.placed_options(), placing.quota_floors())
        except BaseException:
            self._policy.current = old
            raise
        placing.placer = placer
        placing.all_adopted()
        self._profiling.configure()
        plan = placing.reconcile("policy applied")
        await self._executor.run(plan)
        return plan
