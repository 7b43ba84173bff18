"""Compressing a stored context into another variant (the executor's ``compress``), and
reading a context's bytes back for the profiler.

Crash safety (a context has its old or its new variant after a crash, never neither): the new
variant's objects are written first, then a manifest object naming them, then the old
objects are deleted. At start the engine deletes variant objects without a manifest (a
compression cut short) and original objects whose context has a manifest (a deletion cut
short) — see :meth:`VariantOps.settle_variants`.
"""

from __future__ import annotations

import asyncio
import json
import logging
from typing import TYPE_CHECKING, cast

from kvtierd.engine.context_kv import (
    MANIFEST_LAYOUT,
    SEPARATOR,
    EncodedObject,
    chunk_formats,
    decode_context,
    encode_variant,
    manifest_key,
)
from kvtierd.engine.state import ContextRecord, ObjectRecord
from kvtierd.errors import InvalidArgumentError, KvtierError
from kvtierd.types import ORIGINAL_VARIANT, ObjectMeta

if TYPE_CHECKING:
    import torch

    from kvtierd.engine.engine import Engine

logger = logging.getLogger(__name__)


class VariantOps:
    """Mixed into :class:`~kvtierd.engine.Engine`."""

    async def read_context_bytes(self, ctx: ContextRecord) -> tuple[list[ObjectMeta], list[bytes]]:
        """Every object of the context, in order, copied out (the caller holds no lock)."""
        e = cast("Engine", self)
        metas, payloads = [], []
        async with ctx.lock:
            for key in list(ctx.keys):
                obj = e.objects[key]
                if obj.tier == e.cpu.name:
                    data = bytes(e.cpu.view(e.cpu.block_of(obj.meta.key)))
                else:
                    block = await e._stage_from(obj)
                    try:
                        data = bytes(e.cpu.view(block))
                    finally:
                        e.cpu.free_block(block)
                metas.append(obj.meta)
                payloads.append(data)
        return metas, payloads

    async def context_tensors(self, ctx: ContextRecord) -> tuple[torch.Tensor, torch.Tensor]:
        """The context's keys and values ``[L, H, N, D]`` (original chunks only)."""
        from kvtierd.engine.context_kv import split_kv

        metas, payloads = await self.read_context_bytes(ctx)
        formats = chunk_formats(metas)
        kv = await asyncio.to_thread(decode_context, payloads, formats)
        return split_kv(kv, formats[0].num_kv_heads)

    async def compress_context(self, ctx: ContextRecord, variant: str, tier: str) -> None:
        e = cast("Engine", self)
        if ctx.variant != ORIGINAL_VARIANT:
            raise InvalidArgumentError(
                f"context {ctx.context_id!r} is stored as {ctx.variant!r}; only the original "
                f"can be compressed (to {variant!r})"
            )
        metas, payloads = await self.read_context_bytes(ctx)
        formats = chunk_formats(metas)
        kv = await asyncio.to_thread(decode_context, payloads, formats)
        objects = await asyncio.to_thread(
            encode_variant, ctx.context_id, metas, kv, formats, variant
        )
        async with ctx.lock:
            if e.contexts.get(ctx.context_id) is not ctx or ctx.variant != ORIGINAL_VARIANT:
                return  # deleted or changed while we compressed
            # A durable context stays durable: its new form gets a persistent copy too.
            durable = any(e.objects[k].durable for k in ctx.keys)
            shadow = ""
            if durable and not e.tiers[tier].persistent:
                shadow = next((t.name for t in e.tiers.values() if t.persistent), "")
            written: list[tuple[ObjectMeta, str]] = []
            try:
                for obj in objects:
                    for where in filter(None, (tier, shadow)):
                        written.append((await self._store_encoded(obj, where), where))
                metas_new = [m for m, where in written if where == tier]
                manifest = await self._store_manifest(ctx, variant, metas_new, shadow or tier)
            except BaseException:
                for meta, where in written:
                    await e._remove_from_tier(meta, where)
                raise
            for key in list(ctx.keys):
                await e._remove_object_bytes(e.objects.pop(key))
            ctx.keys.clear()
            for obj, meta in zip(objects, metas_new, strict=True):
                e.objects[obj.client_key] = ObjectRecord(
                    meta, tier, shadow=shadow, durable=durable or e.tiers[tier].persistent
                )
                ctx.keys[obj.client_key] = None
            ctx.size_bytes = sum(m.size_bytes for m in metas_new)
            ctx.variant = variant
            ctx.manifest = (manifest, shadow or tier)
        logger.info("context %r compressed to %s in %s: %d -> %d bytes", ctx.context_id,
                    variant, tier, sum(m.size_bytes for m in metas), ctx.size_bytes)  # fmt: skip

    async def _store_encoded(self, obj: EncodedObject, tier: str) -> ObjectMeta:
        e = cast("Engine", self)
        block = e.cpu.stage(obj.meta.size_bytes)
        try:
            e.cpu.view(block)[:] = obj.data
            if tier == e.cpu.name:
                meta = e.cpu.adopt(obj.meta, block)
            else:
                meta = await e.tiers[tier].put(obj.meta, e.cpu.view(block))
                e.cpu.free_block(block)
        except BaseException:
            if not e.cpu.contains(obj.meta.key):
                e.cpu.free_block(block)
            raise
        e.account(meta, tier, +1)
        return meta

    async def _store_manifest(
        self, ctx: ContextRecord, variant: str, written: list[ObjectMeta], tier: str
    ) -> ObjectMeta:
        data = json.dumps([m.key for m in written]).encode()
        meta = ObjectMeta(
            key=manifest_key(ctx.context_id, variant),
            size_bytes=len(data),
            context_id=ctx.context_id,
            variant=variant,
            layout=MANIFEST_LAYOUT,
            tenant=ctx.tenant,
        )
        return await self._store_encoded(EncodedObject(meta.key, meta, data), tier)

    async def settle_variants(
        self, found: list[tuple[ObjectMeta, str]]
    ) -> list[tuple[ObjectMeta, str]]:
        """Drop the leftovers of compressions a crash cut short; returns what to index and
        remembers manifests (``ObjectMeta``, tier) per context."""
        e = cast("Engine", self)
        manifests = {
            (m.context, m.variant): (m, t) for m, t in found if m.layout == MANIFEST_LAYOUT
        }
        keep: list[tuple[ObjectMeta, str]] = []
        for meta, tier in found:
            if meta.layout == MANIFEST_LAYOUT:
                continue
            made_by_daemon = SEPARATOR in meta.key
            complete = (meta.context, meta.variant) in manifests
            superseded = not made_by_daemon and any(c == meta.context for c, _ in manifests)
            if (made_by_daemon and not complete) or superseded:
                try:
                    await e.tiers[tier].delete(meta.key, tenant=meta.tenant)
                except KvtierError as err:
                    logger.warning("could not delete leftover %r: %s", meta.key, err)
                continue
            keep.append((meta, tier))
        kept_contexts = {m.context for m, _ in keep}
        for (context, _), (meta, tier) in manifests.items():
            if context not in kept_contexts:  # its objects were in a volatile tier
                await e.tiers[tier].delete(meta.key, tenant=meta.tenant)
        e.variant_manifests = {c: mt for (c, _), mt in manifests.items() if c in kept_contexts}
        return keep
