"""What ``durable`` promises (docs/daemon.md, "What durable promises"): an object committed
durable is on a persistent tier before the commit is acknowledged, and the placer never drops
it — nor replaces it with a compressed form — before it has been read once (a ``Get`` or
``GetStream`` of it) or a client deletes it or an operator evicts it.

The placers know nothing of this rule; the executor enforces it. A drop (or compression) the
placer plans for a context with unread durable objects is refused: the context keeps only
those objects, each on its persistent copy, leaves the placer's view (``durable_held``) and
comes back to it once they are read. The rule survives a restart: the persistent copies carry
``ObjectMeta.durable``, so an object found at start is protected again until read.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence

from kvtierd.engine.index import ContextIndex
from kvtierd.engine.mover import TierMover
from kvtierd.engine.placing import Placing
from kvtierd.engine.state import ContextRecord
from kvtierd.errors import CapacityError, InvalidArgumentError
from kvtierd.metrics import Metrics
from kvtierd.storage import CpuTier, Tier
from kvtierd.types import ObjectMeta, Plan

logger = logging.getLogger(__name__)


class DurableGuard:
    """Keeps the promise of ``durable`` (module docstring); every method runs on the loop."""

    def __init__(
        self,
        *,
        index: ContextIndex,
        mover: TierMover,
        placing: Placing,
        tiers: Mapping[str, Tier],
        cpu: CpuTier,
        metrics: Metrics,
    ) -> None:
        self._index = index
        self._mover = mover
        self._placing = placing
        self._tiers = tiers
        self._cpu = cpu
        self._metrics = metrics
        self.holds = 0  # placer drops refused for unread durable objects

    async def hold(self, ctx: ContextRecord, planned: str) -> None:
        """Refuse the placer's ``planned`` drop or compression of a context with unread
        durable objects: keep those (each on its persistent copy only), delete the context's
        other objects as the placer wanted, and take the context out of the placer's view."""
        index, mover = self._index, self._mover
        async with ctx.lock:
            for key in list(ctx.keys):
                obj = index.objects[key]
                if not obj.unread:
                    del index.objects[key]  # out of the index before the await
                    ctx.keys.remove(key)
                    ctx.size_bytes -= obj.meta.size_bytes
                    await mover.remove_object_bytes(obj)
                elif obj.shadow and not self._tiers[obj.tier].persistent:
                    await mover.remove_from_tier(obj.meta, obj.tier)
                    obj.tier, obj.shadow = obj.shadow, ""
                    index.account(obj.meta, obj.tier, +1)  # the persistent copy is now charged
            if not ctx.keys:  # its unread objects were deleted while the lock was awaited
                await mover.drop_extras(ctx)
                index.forget_context(ctx)
        self._placing.remove(ctx.context_id)
        if not ctx.keys:
            return
        ctx.durable_held = True
        self.holds += 1
        self._metrics.record_durable_hold()
        logger.info(
            "context %r: the placer planned to %s it, but %d durable objects were not read yet: "
            "kept on tier %s until read, deleted or evicted",
            ctx.context_id, planned, len(ctx.keys), index.placement_of(ctx).tier,
        )  # fmt: skip

    def note_read(self, ctx: ContextRecord) -> Plan:
        """A lease on one of the context's objects was granted. Once a held context has no
        unread durable object left, the placer takes it back and places it afresh (as a
        context whose profile changed: it may move, be compressed or be dropped now): the
        plan to submit."""
        if ctx.durable_held and not self._index.unread_durable(ctx):
            ctx.durable_held = False
            return self._placing.insert(ctx)
        return Plan()

    def mark(self, metas: Sequence[ObjectMeta]) -> None:
        """Mark a durable commit's objects durable and unread, all at once and before anything
        awaits: from then on no plan can drop, compress or move them as non-durable (a hold
        keeps every one of them, a move carries ``durable`` into its copy). Marked one at a
        time, each after awaiting the previous one's SSD write, a drop's hold between two kept
        only those marked and deleted the rest of an acknowledged commit, and a move copied an
        unmarked one as not durable (issue 40.1). ``CapacityError`` (nothing marked) when the
        unread durable objects would exceed the persistent tier (:meth:`_check_room`)."""
        target = self._persistent()
        self._check_room(target, sum(m.size_bytes for m in metas))
        for meta in metas:
            obj = self._index.objects.get(meta.key)
            if obj is not None:
                obj.durable = obj.unread = True
                obj.meta = obj.meta.replace(durable=True)

    async def write_through(self, metas: Sequence[ObjectMeta]) -> None:
        """Give each object :meth:`mark` marked a copy on the first persistent tier before the
        commit is acknowledged. The copy is not charged to the tenant's quota again: it is the
        same object, kept safe."""
        target = self._persistent()
        cpu = self._cpu
        for meta in metas:
            async with self._index.contexts[meta.context].lock:
                obj = self._index.objects.get(meta.key)
                if obj is None:
                    continue  # a client's delete or an operator's evict meanwhile
                if obj.tier == cpu.name and not obj.shadow:
                    with cpu.pinned(meta.key) as block:  # not moved by a compaction
                        await target.put(obj.meta, cpu.view(block))
                    obj.shadow = target.name

    def _persistent(self) -> Tier:
        target = next((t for t in self._tiers.values() if t.persistent), None)
        if target is None:
            raise InvalidArgumentError("durable commit needs a persistent tier (ssd or remote)")
        return target

    def _check_room(self, target: Tier, nbytes: int) -> None:
        """Unread durable objects cannot be dropped to make room, so they may fill at most the
        persistent tier's capacity; a durable commit beyond that is refused."""
        capacity = target.capacity_bytes
        if not capacity or target.used_bytes() + nbytes <= capacity:
            return  # the common case, without a walk over the index
        kept = sum(
            o.meta.size_bytes
            for o in self._index.objects.values()
            if o.unread and target.name in (o.tier, o.shadow)
        )
        if kept + nbytes > capacity:
            raise CapacityError(
                f"durable commit refused: tier {target.name} holds {kept} bytes of durable "
                f"objects not read yet, and {nbytes} more would exceed its capacity of "
                f"{capacity} bytes; read, delete or evict some first (docs/daemon.md, durable)"
            )
