"""Moving a context's bytes between tiers and dropping them (what plan operations do)."""

from __future__ import annotations

import time
from typing import TYPE_CHECKING, cast

from kvtierd.engine.state import ContextRecord, ObjectRecord

if TYPE_CHECKING:
    from kvtierd.engine.engine import Engine


class Moves:
    """Mixed into :class:`~kvtierd.engine.Engine`. A context's lock is held for the whole
    move, so a reader never stages an object the move is about to delete."""

    async def drop_context(self, ctx: ContextRecord) -> None:
        """Delete every object of a context (leased arena blocks are freed on release)."""
        e = cast("Engine", self)
        async with ctx.lock:
            for key in list(ctx.keys):
                await e._remove_object_bytes(e.objects.pop(key))
            ctx.keys.clear()
            ctx.size_bytes = 0
            await e.drop_extras(ctx)
            e.contexts.pop(ctx.context_id, None)

    async def drop_extras(self, ctx: ContextRecord) -> None:
        """Delete what belongs to a context besides its objects: a variant's manifest and the
        reference copy of its original."""
        e = cast("Engine", self)
        if ctx.manifest is not None:
            await e._remove_from_tier(*ctx.manifest)
            e.manifest_owner.pop(ctx.manifest[0].key, None)
            ctx.manifest = None
        for meta, where in ctx.reference or ():
            await e._remove_from_tier(meta, where)
        ctx.reference = None
        if ctx.context_id not in e.contexts or not ctx.keys:
            e.profiling.forget(ctx.context_id)

    async def move_context(self, ctx: ContextRecord, target: str) -> int:
        """Bring every object of ``ctx`` to tier ``target``; returns bytes moved."""
        e = cast("Engine", self)
        moved = 0
        async with ctx.lock:
            for key in list(ctx.keys):
                obj = e.objects.get(key)
                if obj is None or obj.tier == target:
                    continue
                moved += await e._move_object(obj, target)
        return moved

    async def _move_object(self, obj: ObjectRecord, target: str) -> int:
        e = cast("Engine", self)
        meta, source = obj.meta, obj.tier
        if obj.shadow == target:
            # A durable copy is already there: dropping the faster copy is the whole move.
            await e._remove_from_tier(meta, source)
            obj.tier, obj.shadow = target, ""
            e.account(meta, target, +1)  # the copy there is now the one charged
            return meta.size_bytes
        started = time.perf_counter()
        await e._copy_object(obj, target)
        e.metrics.observe_store(target, time.perf_counter() - started, meta.size_bytes)
        # A durable object keeps its persistent copy when promoted to a volatile tier, so a
        # crash after the promotion cannot lose it.
        keep = (
            obj.durable
            and not obj.shadow
            and e.tiers[source].persistent
            and not e.tiers[target].persistent
        )
        if keep:
            obj.shadow = source
            e.account(meta, source, -1)  # the object is charged where it is placed
        else:
            await e._remove_from_tier(meta, source)
        obj.tier = target
        return meta.size_bytes

    async def _copy_object(self, obj: ObjectRecord, target: str) -> None:
        e = cast("Engine", self)
        meta, source = obj.meta, obj.tier
        if target == e.cpu.name:
            e.cpu.adopt(meta, await e._stage_from(obj))
        elif source == e.cpu.name:
            await e.tiers[target].put(meta, e.cpu.view(e.cpu.block_of(meta.key)))
        else:
            block = await e._stage_from(obj)
            try:
                await e.tiers[target].put(meta, e.cpu.view(block))
            finally:
                e.cpu.free_block(block)
        e.account(meta, target, +1)
