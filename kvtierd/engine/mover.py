"""The tier mover: copies a context's bytes between tiers, deletes them, and reads them back
(what plan operations and the profiler do with bytes), keeping the index in step.

A context's lock is held for the whole move, so a reader never stages an object the move is
about to delete. Byte copies and file I/O run on worker threads inside the tiers.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING

from kvtierd.engine.context_kv import (
    SEPARATOR,
    EncodedObject,
    chunk_formats,
    decode_context,
    split_kv,
)
from kvtierd.engine.index import ContextIndex
from kvtierd.engine.leases import LeaseTable
from kvtierd.engine.state import ContextRecord, ObjectRecord
from kvtierd.errors import CorruptObjectError, InvalidArgumentError, NotFoundError
from kvtierd.metrics import Metrics
from kvtierd.storage import CpuTier, Tier
from kvtierd.storage.allocator import Block
from kvtierd.storage.pooled import PooledTier
from kvtierd.storage.ssd import SsdTier
from kvtierd.types import ObjectMeta

if TYPE_CHECKING:
    import torch


def _ignore(_: object) -> None:
    return None


class TierMover:
    """Bytes of indexed objects in ``tiers`` (``cpu``: the arena every copy goes through).

    ``on_forgotten(ctx)`` is called after an object left the index outside a plan (a client's
    delete, a corrupt object): the placer is kept in step by whoever wires the mover;
    ``on_context_gone(context_id)`` once a context and everything it had are gone.
    """

    def __init__(
        self,
        *,
        tiers: Mapping[str, Tier],
        cpu: CpuTier,
        index: ContextIndex,
        leases: LeaseTable,
        metrics: Metrics,
    ) -> None:
        self.tiers = tiers
        self.cpu = cpu
        self._index = index
        self._leases = leases
        self._metrics = metrics
        self.on_forgotten: Callable[[ContextRecord], None] = _ignore
        self.on_context_gone: Callable[[str], None] = _ignore

    def reference_tier(self) -> str:
        """An unbounded persistent tier (EvicPress's remote disk, which keeps every context's
        original, §4); ``""`` when the configuration has none."""
        for t in self.tiers.values():
            if t.persistent and not t.capacity_bytes:
                return t.name
        return ""

    def publish_tier_state(self) -> None:
        """Tier occupancy into the metrics (after each change, and from the health loop)."""
        for tier in self.tiers.values():
            st = tier.stats()
            self._metrics.set_tier_state(
                st.name, st.used_bytes, st.object_count, st.capacity_bytes, st.healthy
            )
        for row in self._index.namespace_rows(list(self.tiers)):
            self._metrics.set_namespace_state(*row)

    # -- reading -------------------------------------------------------------------------------

    async def stage_from(self, obj: ObjectRecord) -> Block:
        """A copy of the object's bytes in an arena block the caller owns. A corrupt object
        leaves the index (and its context's extras, if it was the last object)."""
        try:
            return await self._stage(obj.meta, obj.tier)
        except CorruptObjectError:
            ctx = self.forget_object(obj.meta.key)
            if not ctx.keys:  # its last object: drop the rest, as delete does
                await self.drop_extras(ctx)
            raise

    async def _stage(self, meta: ObjectMeta, tier: str) -> Block:
        block = self.cpu.stage(meta.size_bytes)
        try:
            view = self.cpu.view(block, padded=True)
            await self.tiers[tier].read_into(meta.key, view, tenant=meta.tenant)
        except BaseException:
            self.cpu.free_block(block)
            raise
        return block

    async def copy_out(self, obj: ObjectRecord) -> bytes:
        if obj.tier == self.cpu.name:
            return bytes(self.cpu.view(self.cpu.block_of(obj.meta.key)))
        block = await self.stage_from(obj)
        try:
            return bytes(self.cpu.view(block))
        finally:
            self.cpu.free_block(block)

    async def read_context_bytes(self, ctx: ContextRecord) -> tuple[list[ObjectMeta], list[bytes]]:
        """The objects the context's variants are made from (``ContextIndex.sources``: its
        original, or its own quantized chunks when they are all it keeps), copied out."""
        records = self._index.sources(ctx)
        if not records:
            raise InvalidArgumentError(
                f"context {ctx.context_id!r} is stored as {ctx.variant!r} and its original is "
                "not kept (no unbounded tier to hold a reference copy)"
            )
        metas, payloads = [], []
        async with ctx.lock:
            for obj in records:
                payloads.append(await self.copy_out(obj))
                metas.append(obj.meta)
        return metas, payloads

    async def context_tensors(self, ctx: ContextRecord) -> tuple[torch.Tensor, torch.Tensor]:
        """The context's keys and values ``[L, H, N, D]`` as its sources decode: the original,
        or a quantized form's dequantized KV when that is all it keeps."""
        metas, payloads = await self.read_context_bytes(ctx)
        formats = chunk_formats(metas)
        kv = await asyncio.to_thread(decode_context, payloads, formats)
        return split_kv(kv, formats[0].num_kv_heads)

    # -- removing ------------------------------------------------------------------------------

    def forget_object(self, key: str) -> ContextRecord:
        """Drop the object from the index (its bytes are gone); tell ``on_forgotten``."""
        ctx = self._index.remove(key)
        self.on_forgotten(ctx)
        return ctx

    async def remove_from_tier(
        self, meta: ObjectMeta, tier_name: str, *, charged: bool = True
    ) -> None:
        """Delete one copy; ``charged=False`` for a copy the tenant is not charged for (the
        persistent copy of a durable object under a faster tier)."""
        if charged:
            self._index.account(meta, tier_name, -1)
        tier = self.tiers[tier_name]
        if isinstance(tier, PooledTier):
            self._leases.discard(tier_name, tier.detach(meta.key))  # freed by the last release
        else:
            with contextlib.suppress(NotFoundError):
                await tier.delete(meta.key, tenant=meta.tenant)

    async def remove_object_bytes(self, obj: ObjectRecord) -> None:
        await self.remove_from_tier(obj.meta, obj.tier)
        if obj.shadow:
            await self.remove_from_tier(obj.meta, obj.shadow, charged=False)

    async def drop_context(self, ctx: ContextRecord) -> None:
        """Delete every object of a context (leased arena blocks are freed on release)."""
        async with ctx.lock:
            gone = self._index.take_objects(ctx)
            self._index.forget_context(ctx)
            for obj in gone:
                await self.remove_object_bytes(obj)
            await self.drop_extras(ctx)

    async def drop_extras(self, ctx: ContextRecord) -> None:
        """Delete what belongs to a context besides its objects: a variant's marker and the
        reference copy of its original."""
        if ctx.marker is not None:
            await self.remove_from_tier(*ctx.marker)
            self._index.marker_owner.pop(ctx.marker[0].key, None)
            ctx.marker = None
        for meta, where in ctx.reference or ():
            await self.remove_from_tier(meta, where)
        ctx.reference = None
        if ctx.context_id not in self._index.contexts or not ctx.keys:
            self.on_context_gone(ctx.context_id)

    # -- moving --------------------------------------------------------------------------------

    async def move_context(self, ctx: ContextRecord, target: str) -> int:
        """Bring every object of ``ctx`` to tier ``target``; returns bytes moved.

        A daemon-made variant's marker goes where its objects are kept (:meth:`_marker_home`):
        a restart deletes a variant whose marker it does not find on a persistent tier as a
        compression cut short (``variants.settle_variants``). It is written there only after
        every object, so a crash in the move leaves the old copy or a complete new one, never
        a part taken for the whole; a move up that keeps no persistent copy takes it off the
        persistent tier before any object leaves, for the same reason.
        """
        moved = 0
        async with ctx.lock:
            home = self._marker_home(ctx, target)
            if ctx.marker is not None and not self.tiers[home].persistent:
                await self._move_marker(ctx, ctx.marker, home)
            for key in list(ctx.keys):
                obj = self._index.objects.get(key)
                if obj is None or obj.tier == target:
                    continue
                moved += await self._move_object(obj, target)
            if ctx.marker is not None:  # (None now if a corrupt last object took the context)
                await self._move_marker(ctx, ctx.marker, home)
        return moved

    def _marker_home(self, ctx: ContextRecord, target: str) -> str:
        """Where the context's marker belongs once its objects are moved to ``target``: the
        persistent tier that then holds a copy of every object the marker covers (those the
        daemon made), else ``target``."""
        homes = {
            self._kept_on(obj, target)
            for key in ctx.keys
            if (obj := self._index.objects.get(key)) is not None and SEPARATOR in obj.meta.key
        }
        return homes.pop() if len(homes) == 1 and "" not in homes else target

    def _kept_on(self, obj: ObjectRecord, target: str) -> str:
        """The persistent tier holding the object after a move to ``target`` ("" if none), as
        :meth:`_move_object` leaves it."""
        if self.tiers[target].persistent:
            return target
        if obj.shadow:
            return obj.shadow
        if obj.durable and obj.tier != target and self.tiers[obj.tier].persistent:
            return obj.tier  # a durable object keeps its persistent copy when promoted
        return ""

    async def _move_marker(
        self, ctx: ContextRecord, marker: tuple[ObjectMeta, str], target: str
    ) -> None:
        """Write the context's ``marker`` to ``target``, then delete it where it was (a crash
        in between leaves two, and the restart keeps one: ``settle_variants``)."""
        meta, where = marker
        if where == target:
            return
        if where == self.cpu.name:
            data = bytes(self.cpu.view(self.cpu.block_of(meta.key)))
        else:
            block = await self._stage(meta, where)
            try:
                data = bytes(self.cpu.view(block))
            finally:
                self.cpu.free_block(block)
        stored = await self.store_encoded(EncodedObject(meta.key, meta, data), target)
        await self.remove_from_tier(meta, where)
        ctx.marker = (stored, target)

    async def _move_object(self, obj: ObjectRecord, target: str) -> int:
        meta, source = obj.meta, obj.tier
        if obj.shadow == target:
            # A durable copy is already there: dropping the faster copy is the whole move.
            await self.remove_from_tier(meta, source)
            obj.tier, obj.shadow = target, ""
            self._index.account(meta, target, +1)  # the copy there is now the one charged
            return meta.size_bytes
        started = time.perf_counter()
        await self.copy_object(obj, target)
        self._metrics.observe_store(target, time.perf_counter() - started, meta.size_bytes)
        # A durable object keeps its persistent copy when promoted to a volatile tier, so a
        # crash after the promotion cannot lose it.
        keep = (
            obj.durable
            and not obj.shadow
            and self.tiers[source].persistent
            and not self.tiers[target].persistent
        )
        if keep:
            obj.shadow = source
            self._index.account(meta, source, -1)  # the object is charged where it is placed
        else:
            await self.remove_from_tier(meta, source)
        if obj.shadow and self.tiers[target].persistent:
            # The new copy is persistent and written: the old one would stay on its device,
            # uncharged, and be found beside it at the next start.
            await self.remove_from_tier(meta, obj.shadow, charged=False)
            obj.shadow = ""
        obj.tier = target
        return meta.size_bytes

    async def write_down(self, objs: list[ObjectRecord], target: SsdTier) -> int:
        """Write ``objs``, each in the CPU tier and already charged to ``target``, with one
        sync (``SsdTier.put_many``), then drop their CPU copies; returns the bytes written.
        The caller holds their contexts' locks (``down_batch``). On an error nothing has
        moved, and it is raised."""
        cpu = self.cpu
        with contextlib.ExitStack() as pins:  # a compaction must not move them meanwhile
            items = [(o.meta, cpu.view(pins.enter_context(cpu.pinned(o.meta.key)))) for o in objs]
            started = time.perf_counter()
            stored = await target.put_many(items)
        nbytes = sum(o.meta.size_bytes for o in objs)
        self._metrics.observe_store(target.name, time.perf_counter() - started, nbytes)
        for obj, meta in zip(objs, stored, strict=True):
            await self.remove_from_tier(obj.meta, cpu.name)
            obj.tier = target.name
            obj.meta = meta  # with its checksum: one ObjectMeta for the index and the tier
        return nbytes

    async def copy_object(self, obj: ObjectRecord, target: str) -> None:
        """Put a copy of the object in ``target``, charged there."""
        meta, source = obj.meta, obj.tier
        if target == self.cpu.name:
            self.cpu.adopt(meta, await self.stage_from(obj))
        elif source == self.cpu.name:
            with self.cpu.pinned(meta.key) as block:  # a compaction must not move it meanwhile
                await self.tiers[target].put(meta, self.cpu.view(block))
        else:
            block = await self.stage_from(obj)
            try:
                await self.tiers[target].put(meta, self.cpu.view(block))
            finally:
                self.cpu.free_block(block)
        self._index.account(meta, target, +1)

    async def store_encoded(
        self, obj: EncodedObject, tier: str, *, charged: bool = True
    ) -> ObjectMeta:
        """Write bytes the daemon made (a variant's object) to ``tier`` through the arena."""
        cpu = self.cpu
        block = cpu.stage(obj.meta.size_bytes)
        try:
            cpu.view(block)[:] = obj.data
            if tier == cpu.name:
                meta = cpu.adopt(obj.meta, block)
            else:
                meta = await self.tiers[tier].put(obj.meta, cpu.view(block))
                cpu.free_block(block)
        except BaseException:
            if not cpu.contains(obj.meta.key):
                cpu.free_block(block)
            raise
        if charged:
            self._index.account(meta, tier, +1)
        return meta
