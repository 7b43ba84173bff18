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
from functools import partial
from typing import TYPE_CHECKING, cast

from kvtierd.engine.context_kv import (
    MANIFEST_LAYOUT,
    SEPARATOR,
    EncodedObject,
    EncodedVariant,
    chunk_formats,
    decode_context,
    encode_variant,
    manifest_key,
)
from kvtierd.engine.state import ContextRecord, ObjectRecord
from kvtierd.errors import InvalidArgumentError, KvtierError
from kvtierd.kernels.placeholder import manifest_key as placeholder_manifest_key
from kvtierd.types import ORIGINAL_VARIANT, ObjectMeta
from kvtierd.variants import parse_variant

if TYPE_CHECKING:
    import torch

    from kvtierd.engine.engine import Engine

logger = logging.getLogger(__name__)


class VariantOps:
    """Mixed into :class:`~kvtierd.engine.Engine`."""

    async def read_context_bytes(self, ctx: ContextRecord) -> tuple[list[ObjectMeta], list[bytes]]:
        """The context's original objects, in order, copied out: its own objects while it is
        stored uncompressed, else its reference copy (``None`` reference: not available)."""
        e = cast("Engine", self)
        if ctx.variant == ORIGINAL_VARIANT:
            records = [e.objects[k] for k in ctx.keys]
        elif ctx.reference:
            records = [ObjectRecord(m, t) for m, t in ctx.reference]
            records += [e.objects[k] for k in self.added_in_form(ctx)]
        else:
            raise InvalidArgumentError(
                f"context {ctx.context_id!r} is stored as {ctx.variant!r} and its original is "
                "not kept (no unbounded tier to hold a reference copy)"
            )
        metas, payloads = [], []
        async with ctx.lock:
            for obj in records:
                payloads.append(await self._copy_out(obj))
                metas.append(obj.meta)
        return metas, payloads

    def added_in_form(self, ctx: ContextRecord) -> list[str]:
        """Keys of the objects a client added to a compressed context in its compressed form
        (the LMCache plugin quantizes a longer prompt's new chunks on its device when the
        write plan says int8). They have no original in the reference copy, so they are read
        as they are stored (decoded by their layout): a re-compression re-encodes them with
        the rest, and restoring the original drops them (LMCache recomputes them). Not the
        suffix chunks of requests served from a token-dropped variant: their KV follows the
        placeholders, not the original, so nothing can be built from them."""
        e = cast("Engine", self)
        ref = {m.key for m, _ in ctx.reference or ()}
        metas = {k: e.objects[k].meta for k in ctx.keys if k not in ref}
        unusable = [SEPARATOR in m.key or parse_variant(m.variant).drops_tokens
                     for m in metas.values()]  # fmt: skip
        return [k for k, skip in zip(metas, unusable, strict=True) if not skip]

    async def _copy_out(self, obj: ObjectRecord) -> bytes:
        e = cast("Engine", self)
        if obj.tier == e.cpu.name:
            return bytes(e.cpu.view(e.cpu.block_of(obj.meta.key)))
        block = await e._stage_from(obj)
        try:
            return bytes(e.cpu.view(block))
        finally:
            e.cpu.free_block(block)

    def reference_tier(self) -> str:
        """An unbounded persistent tier (EvicPress's remote disk, which keeps every context's
        original, §4); ``""`` when the configuration has none."""
        e = cast("Engine", self)
        for t in e.tiers.values():
            if t.persistent and not t.capacity_bytes:
                return t.name
        return ""

    async def context_tensors(self, ctx: ContextRecord) -> tuple[torch.Tensor, torch.Tensor]:
        """The context's original keys and values ``[L, H, N, D]``."""
        from kvtierd.engine.context_kv import split_kv

        metas, payloads = await self.read_context_bytes(ctx)
        formats = chunk_formats(metas)
        kv = await asyncio.to_thread(decode_context, payloads, formats)
        return split_kv(kv, formats[0].num_kv_heads)

    async def compress_context(self, ctx: ContextRecord, variant: str, tier: str) -> None:
        """Store the context as ``variant`` in ``tier`` (from its original), replacing the form
        it has; ``"none"`` restores the original from the reference copy. A token-dropping
        variant is written in the servable form (``servable.py``), or refused with the reason
        when the daemon cannot write that form yet."""
        e = cast("Engine", self)
        if variant == ORIGINAL_VARIANT:
            await self._restore_original(ctx, tier)
            return
        form = e.profiling.servable_form(ctx, variant) if parse_variant(variant).drops_tokens \
            else None  # fmt: skip
        metas, payloads = await self.read_context_bytes(ctx)
        if form is not None:  # the first N tokens: the part every prompt agreed on
            metas, payloads = metas[: form.num_chunks], payloads[: form.num_chunks]
        formats = chunk_formats(metas)
        kv = await asyncio.to_thread(decode_context, payloads, formats)
        encoded = await asyncio.to_thread(
            partial(encode_variant, ctx.context_id, metas, kv, formats, variant, form=form)
        )
        async with ctx.lock:
            if e.contexts.get(ctx.context_id) is not ctx:
                return  # deleted while we compressed
            await self._keep_reference(ctx)
            await self._install(ctx, encoded, variant, tier)
        logger.info("context %r compressed to %s in %s: %d -> %d bytes", ctx.context_id,
                    variant, tier, sum(m.size_bytes for m in metas), ctx.size_bytes)  # fmt: skip

    async def _keep_reference(self, ctx: ContextRecord) -> None:
        """Before the original leaves, put a copy of it in the reference tier (if any)."""
        e = cast("Engine", self)
        ref = self.reference_tier()
        if ctx.variant != ORIGINAL_VARIANT or not ref:
            return
        kept: list[tuple[ObjectMeta, str]] = []
        for key in list(ctx.keys):
            obj = e.objects[key]
            if ref not in (obj.tier, obj.shadow):
                await e.tiers[ref].put(obj.meta, memoryview(await self._copy_out(obj)))
                e.account(obj.meta, ref, +1)
            elif ref == obj.shadow:
                e.account(obj.meta, ref, +1)  # an uncharged durable copy becomes the reference
            # else: the copy already there becomes the reference (_drop_current_form keeps it)
            kept.append((obj.meta, ref))
        ctx.reference = kept

    async def _install(
        self, ctx: ContextRecord, encoded: EncodedVariant, variant: str, tier: str
    ) -> None:
        """Write the new form, its manifest, then drop the old form (crash-safe order)."""
        e = cast("Engine", self)
        objects = encoded.objects
        marker = self._marker(ctx, variant, encoded)
        durable = any(e.objects[k].durable for k in ctx.keys)
        shadow = ""
        if durable and not e.tiers[tier].persistent:
            shadow = next((t.name for t in e.tiers.values() if t.persistent), "")
        written: list[tuple[ObjectMeta, str]] = []
        try:
            for obj in objects:
                for where in filter(None, (tier, shadow)):
                    stored = await self._store_encoded(obj, where, charged=where == tier)
                    written.append((stored, where))
            metas_new = [m for m, where in written if where == tier]
            if ctx.manifest is not None and ctx.manifest[0].key == marker.meta.key:
                # One placeholder manifest per digest (the router's key): the old variant's
                # goes first. A crash right here leaves neither marked, and the context comes
                # back as its original from the reference copy (or is recomputed).
                await e._remove_from_tier(*ctx.manifest)
                ctx.manifest = None
            manifest = await self._store_encoded(marker, shadow or tier)
        except BaseException:
            for meta, where in written:
                await e._remove_from_tier(meta, where, charged=where == tier)
            raise
        await self._drop_current_form(ctx)
        for obj, meta in zip(objects, metas_new, strict=True):
            e.objects[obj.client_key] = ObjectRecord(
                meta, tier, shadow=shadow, durable=durable or e.tiers[tier].persistent
            )
            ctx.keys[obj.client_key] = None
        ctx.size_bytes = sum(m.size_bytes for m in metas_new)
        ctx.variant = variant
        ctx.manifest = (manifest, shadow or tier)
        e.manifest_owner[manifest.key] = ctx.context_id
        e.profiling.note_form()

    async def _drop_current_form(self, ctx: ContextRecord) -> None:
        """Delete the objects of the context's current form (never its reference copy)."""
        e = cast("Engine", self)
        reference = {(m.key, t) for m, t in ctx.reference or ()}
        for key in list(ctx.keys):
            obj = e.objects.pop(key)
            for where in filter(None, (obj.tier, obj.shadow)):
                if (obj.meta.key, where) not in reference:
                    await e._remove_from_tier(obj.meta, where, charged=where == obj.tier)
        ctx.keys.clear()
        if ctx.manifest is not None:
            await e._remove_from_tier(*ctx.manifest)
            e.manifest_owner.pop(ctx.manifest[0].key, None)
            ctx.manifest = None

    async def _restore_original(self, ctx: ContextRecord, tier: str) -> None:
        """Bring the original back from the reference copy into ``tier``."""
        e = cast("Engine", self)
        if ctx.variant == ORIGINAL_VARIANT:
            await e.move_context(ctx, tier)
            return
        if not ctx.reference:
            raise InvalidArgumentError(
                f"context {ctx.context_id!r}: the original is not kept, cannot restore it"
            )
        async with ctx.lock:
            reference = ctx.reference
            await self._drop_current_form(ctx)
            for meta, ref in reference:
                rec = ObjectRecord(meta, ref, durable=True)
                if tier != ref:
                    e.account(meta, tier, +1)
                    e.account(meta, ref, -1)  # the reference becomes an uncharged copy
                    if tier == e.cpu.name:
                        e.cpu.adopt(meta, await e._stage_from(rec))
                    else:
                        await e.tiers[tier].put(meta, memoryview(await self._copy_out(rec)))
                    rec = ObjectRecord(meta, tier, shadow=ref, durable=True)
                e.objects[meta.key] = rec
                ctx.keys[meta.key] = None
            ctx.size_bytes = sum(m.size_bytes for m, _ in reference)
            ctx.variant = ORIGINAL_VARIANT
            ctx.reference = None
            e.profiling.note_form()

    async def _store_encoded(
        self, obj: EncodedObject, tier: str, *, charged: bool = True
    ) -> ObjectMeta:
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
        if charged:
            e.account(meta, tier, +1)
        return meta

    def _marker(self, ctx: ContextRecord, variant: str, encoded: EncodedVariant) -> EncodedObject:
        """The object that marks the new form complete: a token-dropped variant's placeholder
        manifest, under the key the router looks its digest up by, else a list of the keys."""
        e = cast("Engine", self)
        manifest = encoded.manifest
        if manifest is None:
            key = manifest_key(ctx.context_id, variant)
            data = json.dumps([o.meta.key for o in encoded.objects]).encode()
        else:
            key, data = placeholder_manifest_key(manifest.digest), manifest.to_bytes()
            owner = e.manifest_owner.get(key, ctx.context_id)
            if key in e.objects or owner != ctx.context_id:
                raise InvalidArgumentError(
                    f"context {ctx.context_id!r}: its first {manifest.num_tokens} tokens are "
                    f"already stored as a token-dropped variant ({key}, of "
                    f"{owner if owner != ctx.context_id else 'a kvtierd router store request'})"
                )
        meta = ObjectMeta(key=key, size_bytes=len(data), context_id=ctx.context_id,
                          variant=variant, layout=MANIFEST_LAYOUT, tenant=ctx.tenant)  # fmt: skip
        return EncodedObject(key, meta, data)

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
            # A client's original of a compressed context was superseded; a client's object
            # stored in a compressed form (added after the compression) was not.
            superseded = (
                not made_by_daemon
                and meta.variant == ORIGINAL_VARIANT
                and any(c == meta.context for c, _ in manifests)
            )
            if superseded and tier == self.reference_tier():
                e.references.setdefault(meta.context, []).append((meta, tier))
                continue
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
