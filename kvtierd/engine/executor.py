"""Carries placer plans out in the background, one operation at a time, in plan order.

Plans come from the event loop (``submit`` never blocks the put or load path); operations are
*reconciling*: a ``move``/``place`` brings every object of the context to the target tier,
whatever subset is already there, so a plan that races with a later one still converges.
A failed operation is logged and counted and the engine's index stays the truth (the placer
adopts where the context is); one that fails unexpectedly (not a ``KvtierError``) also sets its
context aside: its form is not changed again, and the daemon keeps serving. Only a crash of the
executor task itself marks the daemon unhealthy.

A lookup's hold (``hold_s``: a client is about to load what it found) defers the operations that
would remove the looked-up objects — a drop, a change of variant — until the hold ends; moves go
ahead. A deferred operation runs when the hold ends (a timer wakes the executor), unless the
placer has placed the context elsewhere since (a later put or hit), which makes it stale.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections import Counter, OrderedDict
from collections.abc import Sequence

from kvtierd.engine.down_batch import DownBatch, down_objects, down_target
from kvtierd.engine.durable import DurableGuard
from kvtierd.engine.index import ContextIndex
from kvtierd.engine.mover import TierMover
from kvtierd.engine.placing import Placing
from kvtierd.engine.state import ContextRecord
from kvtierd.engine.variant_writer import VariantWriter
from kvtierd.errors import KvtierError
from kvtierd.metrics import Metrics
from kvtierd.policies.plan_order import BREAK_CYCLE
from kvtierd.types import ORIGINAL_VARIANT, Operation, OpKind, Placement, Plan

logger = logging.getLogger(__name__)

GATHER_PLANS = 256  # plans queued behind each other carried out together (their moves batch)
MAX_SET_ASIDE = 10_000  # reasons kept for contexts set aside (the oldest forgotten first)


class Executor:
    """Carries out the placer's plans over the tier mover and the variant writer."""

    def __init__(
        self,
        *,
        index: ContextIndex,
        mover: TierMover,
        variants: VariantWriter,
        durable: DurableGuard,
        placing: Placing,
        metrics: Metrics,
    ) -> None:
        self._index = index
        self._mover = mover
        self._variants = variants
        self._durable = durable
        self._placing = placing
        self._metrics = metrics
        self._tier_names: Sequence[str] = list(mover.tiers)
        self._down_target = down_target(mover.tiers)  # where moves down are batched
        self._queue: asyncio.Queue[Plan] = asyncio.Queue()
        self._task: asyncio.Task[None] | None = None
        self._running = 0  # plans taken off the queue and not yet finished (0 or 1)
        self.done = Counter[str]()
        self.failed = Counter[str]()
        self.down_batches = 0  # batches of moves down written (``down_batch``)
        self._relearnt: set[str] = set()  # failed, and adopted where they are since
        self.deferred: list[Operation] = []  # waiting for a hold to end (module docstring)
        self._wake: asyncio.TimerHandle | None = None
        self._wake_at = 0.0
        self.error: BaseException | None = None  # the executor task itself died
        # contexts whose operation failed unexpectedly, and why (``_set_aside``)
        self.set_aside: OrderedDict[str, str] = OrderedDict()

    def start(self) -> None:
        self._task = asyncio.create_task(self._run_forever(), name="kvtierd-executor")
        self._task.add_done_callback(self._on_exit)

    def _on_exit(self, task: asyncio.Task[None]) -> None:
        if not task.cancelled() and task.exception() is not None:
            self.error = task.exception()
            logger.error("plan executor died: %r", self.error)

    @property
    def healthy(self) -> bool:
        return self._task is not None and not self._task.done() and self.error is None

    def submit(self, plan: Plan) -> None:
        if plan:
            self._queue.put_nowait(plan)

    @property
    def pending(self) -> int:
        """Plans submitted and not yet finished (queued or running)."""
        return self._queue.qsize() + self._running

    async def idle(self) -> None:
        """Wait until every submitted plan has been carried out."""
        await self._queue.join()

    async def close(self) -> None:
        if self._wake is not None:
            self._wake.cancel()
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task

    async def _run_forever(self) -> None:
        while True:
            plans = [await self._queue.get()]
            while len(plans) < GATHER_PLANS and not self._queue.empty():
                plans.append(self._queue.get_nowait())  # their moves down share batches
            self._running = len(plans)
            try:
                await self.run(*plans)
            finally:
                self._running = 0
                for _ in plans:
                    self._queue.task_done()

    async def run(self, *plans: Plan) -> None:
        """Carry out ``plans`` in order (and the deferred operations still planned first)."""
        retry, self.deferred = self.deferred, []
        current = tuple(op for op in retry if self._still_planned(op))
        try:
            await self._run_ops((*current, *(op for plan in plans for op in plan.operations)))
        finally:
            self._mover.publish_tier_state()

    def _still_planned(self, op: Operation) -> bool:
        """Whether a deferred operation is still what the placer wants for its context."""
        return self._placing.target(op.context_id) == op.target

    def _defer(self, op: Operation, until_s: float) -> None:
        """Run ``op`` again once the hold ends at ``until_s`` (monotonic clock, the loop's)."""
        if not any(d.context_id == op.context_id and d.target == op.target for d in self.deferred):
            self.deferred.append(op)
        if self._wake is not None and self._wake_at <= until_s:
            return
        if self._wake is not None:
            self._wake.cancel()
        self._wake_at = until_s
        delay = max(0.0, until_s - time.monotonic()) + 0.001
        self._wake = asyncio.get_running_loop().call_later(delay, self._retry_deferred)

    def _retry_deferred(self) -> None:
        self._wake = None
        self._queue.put_nowait(Plan())  # an empty plan runs the deferred operations

    async def _run_ops(self, ops: tuple[Operation, ...]) -> None:
        """Apply ``ops`` in order, except that moves of small objects down to the SSD tier
        join a batch written with one sync (``down_batch``): when it is full, at the end, and
        before any operation that could depend on it (:meth:`_waits_for`)."""
        target = self._down_target
        down = DownBatch[Operation](self._index, self._mover, target) if target else None
        for op in ops:
            if down is not None:
                if self._join_down(op, down):
                    if down.full:
                        await self._write_down(down)
                    continue
                if down and self._waits_for(op, down):
                    await self._write_down(down)
            await self._apply_counted(op)
        if down:
            await self._write_down(down)

    async def _apply_counted(self, op: Operation) -> None:
        try:
            await self.apply(op)
        except KvtierError as e:
            self.failed[op.kind.value] += 1
            logger.error("plan operation %s on %r failed: %s", op.kind.value, op.context_id, e)
            self._learn_where_it_is(op.context_id)
        except Exception as e:
            # What a client stored can fail an operation in ways no check foresaw: that
            # context is set aside, the others and health go on. One such error used to
            # mark the daemon NOT_SERVING until restart, for every tenant (issue 40.2).
            self.failed[op.kind.value] += 1
            self._set_aside(op, e)
        else:
            self._count_done(op)

    def _count_done(self, op: Operation) -> None:
        self._relearnt.discard(op.context_id)
        self.done[op.kind.value] += 1
        self._metrics.record_operation(op.kind.value)
        self._metrics.record_placement(op.target.variant, op.target.tier)

    def _join_down(self, op: Operation, down: DownBatch[Operation]) -> bool:
        """Whether ``op`` joined the batch: a move (or place) of a context in the form it has,
        to the batch's tier, that is only writes of small objects from the CPU tier and
        that its tenant's quota lets go there (else :meth:`apply` finds where it goes)."""
        target = down.target.name
        if op.kind is OpKind.DROP or op.target.tier != target or op.context_id in down:
            return False
        ctx = self._index.contexts.get(op.context_id)
        if ctx is None or ctx.durable_held or op.target.variant != ctx.variant:
            return False
        objs = down_objects(self._index, ctx, self._mover.cpu.name, target)
        if not objs:
            return False
        if self._index.has_quotas and (
            self._index.quota_tier(ctx, target, self._tier_names) != target
        ):
            return False
        logger.debug("plan operation %s on %r: %s in %s -> %s (%s, batched)", op.kind.value,
                     ctx.context_id, ctx.variant, op.source.tier, target, op.reason)  # fmt: skip
        down.add(ctx, objs, op)
        return True

    def _waits_for(self, op: Operation, down: DownBatch[Operation]) -> bool:
        """Whether ``op`` must wait until the batch is written: it is on a context in the
        batch, or it needs room a move down frees. A drop, and a move of a context already
        wholly where the plan puts it in the form it has (a put's place in the CPU tier, queued
        between moves down), go first."""
        if op.context_id in down:
            return True
        if op.kind is OpKind.DROP:
            return False
        ctx = self._index.contexts.get(op.context_id)
        if ctx is None or ctx.durable_held:
            return False  # (apply does nothing with it)
        tier = op.target.tier
        objects = self._index.objects
        return not (
            tier is not None
            and op.target.variant == ctx.variant
            and ctx.marker is None
            and all(objects[k].tier == tier for k in ctx.keys if k in objects)
        )

    async def _write_down(self, down: DownBatch[Operation]) -> None:
        """Write the batch; each operation whose context changed since it joined, or all of
        them when the batch failed as a whole, is applied alone, with its own outcome."""
        wrote = await down.write()
        if wrote.error is not None:
            logger.warning("a batch of %d moves down to %s failed (%s); each is tried alone",
                           len(wrote.failed), down.target.name, wrote.error)  # fmt: skip
        self.down_batches += bool(wrote.written)
        for op in wrote.written:
            self._count_done(op)
        for op in (*wrote.changed, *wrote.failed):
            await self._apply_counted(op)

    def _set_aside(self, op: Operation, error: Exception) -> None:
        """After an unexpected error in ``op``: log it with the context, keep the reason
        (``set_aside``, the newest MAX_SET_ASIDE), and stop changing the context's form: later
        plans only move or drop it as it is (:meth:`apply`); the placer adopts where it is."""
        reason = f"{op.kind.value} failed: {type(error).__name__}: {error}"
        logger.error("context %r set aside: plan operation %s failed unexpectedly",
                     op.context_id, op.kind.value, exc_info=error)  # fmt: skip
        self.set_aside[op.context_id] = reason
        self.set_aside.move_to_end(op.context_id)
        while len(self.set_aside) > MAX_SET_ASIDE:
            self.set_aside.popitem(last=False)
        self._learn_where_it_is(op.context_id)

    def _learn_where_it_is(self, context_id: str) -> None:
        """After a failed operation the placer believes the context is where the plan put it;
        the index is the truth, and the placer adopts it. Without this a context whose
        compression failed (its token ids not there yet, say) stayed whole while the placer
        counted it compressed, and nothing placed it again. Adopting can plan the same
        operation again (an overflow resolved by compressing it): one that fails again is
        not adopted twice in a row, so a failure that persists cannot loop."""
        ctx = self._index.contexts.get(context_id)
        if ctx is None or not ctx.keys or ctx.durable_held or context_id in self._relearnt:
            return
        self._relearnt.add(context_id)
        self.submit(self._placing.adopt_where_it_is(ctx))

    async def apply(self, op: Operation) -> None:
        ctx = self._index.contexts.get(op.context_id)
        if ctx is None or ctx.durable_held:
            return  # deleted since the plan was made, or out of the placer's view (durable)
        if op.kind is OpKind.DROP and op.reason == BREAK_CYCLE:
            return  # the same plan places it again: its bytes stay until then (plan_order.py)
        logger.debug("plan operation %s on %r: %s in %s -> %s in %s (%s)", op.kind.value,
                     ctx.context_id, op.source.variant, op.source.tier, op.target.variant,
                     op.target.tier, op.reason)  # fmt: skip
        if self._removes(ctx, op) and ctx.hold_until_s > time.monotonic():
            self._defer(op, ctx.hold_until_s)  # a client looked it up and is about to load it
            return
        if op.kind is OpKind.DROP:
            await self._drop(ctx, "drop", forget=False)  # the placer keeps it as dropped
        elif op.target.variant != ctx.variant:
            # (a compression to the form the context already has, planned before an earlier
            # operation or the writer gave it that form, is a move: re-encoding it would
            # quantize twice, or find its own objects in the way)
            if self._index.unread_durable(ctx):
                await self._durable.hold(ctx, f"compress ({op.target.variant})")
                return
            variant, planned = op.target.variant, op.target.tier
            planned = planned or self._index.placement_of(ctx).tier
            assert planned is not None
            keep = ctx.context_id in self.set_aside or not self._index.can_make(ctx, variant)
            tier = await self._quota_tier(ctx, planned, ctx.variant if keep else variant)
            if tier is None:
                return
            if keep:
                await self._keep_form(ctx, op, tier)
                return
            await self._variants.compress_context(ctx, variant, tier)
            if tier != planned:  # the quota overrode the placer: tell it where it went
                self.submit(self._placing.adopt(ctx, Placement(variant, tier)))
            if not self._index.can_make(ctx, ORIGINAL_VARIANT):
                self.submit(self._placing.relearn(ctx))  # its original is no option any more
        elif op.target.tier is not None:
            tier = await self._quota_tier(ctx, op.target.tier, ctx.variant)
            if tier is None:
                return
            await self._mover.move_context(ctx, tier)
            if tier != op.target.tier:
                # The tenant's quota overrode the placer: tell it where the context went.
                self.submit(self._placing.adopt(ctx, Placement(ctx.variant, tier)))

    async def _quota_tier(self, ctx: ContextRecord, planned: str, variant: str) -> str | None:
        """Where ``ctx`` goes as ``variant`` for a plan that puts it in ``planned``: the first
        tier from there down with room in its tenant's and namespace's quotas. A compression
        into a faster tier was written where the plan said, over the namespace's quota there
        (issue 41.2). ``None``: no tier has room, and the context is dropped."""
        if not self._index.has_quotas:
            # No profile asked for either: it would cache the context's option row now, from
            # inputs a failing compression is about to change, and the placer then adopted the
            # failed form (tests/daemon/test_profile_kept.py).
            return planned
        size = ctx.size_bytes
        if variant != ctx.variant:
            with contextlib.suppress(KeyError):  # a form its options no longer list: as it is
                size = self._placing.profile(ctx).variant(variant).size_bytes
        tier = self._index.quota_tier(ctx, planned, self._tier_names, size)
        if tier is None:
            logger.info("context %r dropped: the quota of tenant %r (namespace %r) is full in "
                        "every tier from %s", ctx.context_id, ctx.tenant, ctx.namespace,
                        planned)  # fmt: skip
            await self._drop(ctx, "drop (quota full)", forget=True)
        return tier

    def _removes(self, ctx: ContextRecord, op: Operation) -> bool:
        """Whether ``op`` would remove what a lookup's hold protects: a drop, or a change to a
        form the context can be given. One to a form it can no longer have moves the form it
        has (:meth:`_keep_form`), and moves go ahead: deferred, such a plan for a hot context
        waited hold after hold while the placer counted the form it asked for (bench_e2e: an
        int8-only context planned as its 35 MB original in the CPU tier five times in two
        minutes, its 9 MB of int8 in the SSD tier counted nowhere)."""
        if op.kind is OpKind.DROP:
            return True
        return op.target.variant != ctx.variant and self._index.can_make(ctx, op.target.variant)

    async def _keep_form(self, ctx: ContextRecord, op: Operation, tier: str) -> None:
        """A plan made before the context took the form it has (plans queue behind each other:
        a put's insert can follow the compression another planned) asks for a form that can no
        longer be made from what the context keeps (``ContextIndex.can_make``): its original is
        gone (no unbounded tier keeps a reference copy), and the form it has drops tokens or is
        quantized coarser than the one planned. The context goes where the plan says in the
        form it has, and the placer learns that form (in the e2e run each such plan failed with
        an ERROR and left the context where it was, so EvicPress never used the SSD tier)."""
        logger.info("context %r: planned as %s, but only its %s form is kept; moved as that",
                    ctx.context_id, op.target.variant, ctx.variant)  # fmt: skip
        await self._mover.move_context(ctx, tier)
        self.submit(self._placing.adopt(ctx, Placement(ctx.variant, tier)))

    async def _drop(self, ctx: ContextRecord, planned: str, *, forget: bool) -> None:
        """Drop a context as planned (``forget``: the placer did not plan it, so it forgets
        the context too), unless it holds durable objects not read yet: those are kept
        (docs/daemon.md, durable) and the context leaves the placer's view."""
        if self._index.unread_durable(ctx):
            await self._durable.hold(ctx, planned)
            return
        await self._mover.drop_context(ctx)
        if forget:
            self._placing.remove(ctx.context_id)
