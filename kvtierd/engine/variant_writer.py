"""Compressing a stored context into another variant (the executor's ``compress``) and
restoring its original.

Crash safety (a context has its old or its new variant after a crash, never neither): the new
variant's objects are written first, then a marker object naming them (for a token-dropped
variant: its placeholder manifest), then the old objects are deleted. At start the engine
deletes variant objects without a marker (a compression cut short) and original objects whose
context has a marker (a deletion cut short) — see :func:`settle_variants`. A move takes the
marker along, written after the objects (``TierMover.move_context``).
"""

from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import Mapping
from dataclasses import dataclass, field
from functools import partial

from kvtierd.engine.context_kv import (
    MARKER_LAYOUT,
    SEPARATOR,
    EncodedObject,
    EncodedVariant,
    chunk_formats,
    decode_context,
    encode_variant,
    marker_key,
)
from kvtierd.engine.context_options import ContextOptions
from kvtierd.engine.index import ContextIndex
from kvtierd.engine.mover import TierMover
from kvtierd.engine.state import ContextRecord, ObjectRecord
from kvtierd.errors import InvalidArgumentError, KvtierError
from kvtierd.kernels.placeholder import manifest_key
from kvtierd.storage import CpuTier, Tier
from kvtierd.types import ORIGINAL_VARIANT, ObjectMeta
from kvtierd.variants import parse_variant

logger = logging.getLogger(__name__)


class VariantWriter:
    """Writes a context's variants (from its sources, ``ContextIndex.sources``) over the tier
    mover; the context options say which token-dropped forms can be served."""

    def __init__(
        self,
        *,
        index: ContextIndex,
        mover: TierMover,
        options: ContextOptions,
        tiers: Mapping[str, Tier],
        cpu: CpuTier,
    ) -> None:
        self._index = index
        self._mover = mover
        self._options = options
        self._tiers = tiers
        self._cpu = cpu

    async def compress_context(self, ctx: ContextRecord, variant: str, tier: str) -> None:
        """Store the context as ``variant`` in ``tier`` (from its original, or from its own
        quantized chunks when they are all it keeps), replacing the form it has; ``"none"``
        restores the original from the reference copy. A token-dropping variant is written in
        the servable form (``servable.py``), or refused with the reason when the daemon cannot
        write that form yet."""
        if variant == ORIGINAL_VARIANT:
            await self._restore_original(ctx, tier)
            return
        form = self._options.servable_form(ctx, variant) \
            if parse_variant(variant).drops_tokens else None  # fmt: skip
        metas, payloads = await self._mover.read_context_bytes(ctx)
        if form is not None:  # the first N tokens: the part every prompt agreed on
            metas, payloads = metas[: form.num_chunks], payloads[: form.num_chunks]
        formats = chunk_formats(metas)
        kv = await asyncio.to_thread(decode_context, payloads, formats)
        encoded = await asyncio.to_thread(
            partial(encode_variant, ctx.context_id, metas, kv, formats, variant, form=form)
        )
        async with ctx.lock:
            if self._index.contexts.get(ctx.context_id) is not ctx:
                return  # deleted while we compressed
            await self._keep_reference(ctx)
            await self._install(ctx, encoded, variant, tier)
        logger.info("context %r compressed to %s in %s: %d -> %d bytes", ctx.context_id,
                    variant, tier, sum(m.size_bytes for m in metas), ctx.size_bytes)  # fmt: skip

    async def _keep_reference(self, ctx: ContextRecord) -> None:
        """Before the original leaves, put a copy of it in the reference tier (if any)."""
        ref = self._mover.reference_tier()
        if ctx.variant != ORIGINAL_VARIANT or not ref:
            return
        kept: list[tuple[ObjectMeta, str]] = []
        for key in list(ctx.keys):
            obj = self._index.objects[key]
            if ref not in (obj.tier, obj.shadow):
                await self._tiers[ref].put(obj.meta, memoryview(await self._mover.copy_out(obj)))
                self._index.account(obj.meta, ref, +1)
            elif ref == obj.shadow:
                self._index.account(obj.meta, ref, +1)  # an uncharged durable copy: the reference
            # else: the copy already there becomes the reference (_drop_current_form keeps it)
            kept.append((obj.meta, ref))
        ctx.reference = kept

    async def _install(
        self, ctx: ContextRecord, encoded: EncodedVariant, variant: str, tier: str
    ) -> None:
        """Write the new form, its marker, then drop the old form (crash-safe order)."""
        index, mover, tiers = self._index, self._mover, self._tiers
        objects = encoded.objects
        new_marker = self._marker(ctx, variant, encoded)
        durable = any(index.objects[k].durable for k in ctx.keys)
        shadow = ""
        if durable and not tiers[tier].persistent:
            shadow = next((t.name for t in tiers.values() if t.persistent), "")
        written: list[tuple[ObjectMeta, str]] = []
        try:
            for obj in objects:
                for where in filter(None, (tier, shadow)):
                    stored = await mover.store_encoded(obj, where, charged=where == tier)
                    written.append((stored, where))
            metas_new = [m for m, where in written if where == tier]
            if ctx.marker is not None and ctx.marker[0].key == new_marker.meta.key:
                # One placeholder manifest per digest (the router's key): the old variant's
                # goes first. A crash right here leaves neither marked, and the context comes
                # back as its original from the reference copy (or is recomputed).
                await mover.remove_from_tier(*ctx.marker)
                ctx.marker = None
            marker = await mover.store_encoded(new_marker, shadow or tier)
        except BaseException:
            for meta, where in written:
                await mover.remove_from_tier(meta, where, charged=where == tier)
            raise
        await self._drop_current_form(ctx)
        for obj, meta in zip(objects, metas_new, strict=True):
            # durable only by the client's promise: an object that is merely on a persistent
            # tier moves up without leaving a copy there (an uncharged copy filled the SSD)
            index.objects[obj.client_key] = ObjectRecord(meta, tier, shadow=shadow, durable=durable)
            ctx.keys.add(obj.client_key)
        ctx.size_bytes = sum(m.size_bytes for m in metas_new)
        # a chunk a client adds later is numbered after these (placeholders count from 0)
        numbered = [m.position + 1 for m in metas_new if m.position is not None]
        ctx.next_position = max([ctx.next_position, *numbered])
        ctx.variant = variant
        ctx.marker = (marker, shadow or tier)
        index.marker_owner[marker.key] = ctx.context_id
        self._options.changed()  # its form changed

    async def _drop_current_form(self, ctx: ContextRecord) -> None:
        """Delete the objects of the context's current form (never its reference copy)."""
        reference = {(m.key, t) for m, t in ctx.reference or ()}
        for obj in self._index.take_objects(ctx):
            for where in filter(None, (obj.tier, obj.shadow)):
                if (obj.meta.key, where) not in reference:
                    await self._mover.remove_from_tier(obj.meta, where, charged=where == obj.tier)
        if ctx.marker is not None:
            await self._mover.remove_from_tier(*ctx.marker)
            self._index.marker_owner.pop(ctx.marker[0].key, None)
            ctx.marker = None

    async def _restore_original(self, ctx: ContextRecord, tier: str) -> None:
        """Bring the original back from the reference copy into ``tier``."""
        index, mover, cpu = self._index, self._mover, self._cpu
        if ctx.variant == ORIGINAL_VARIANT:
            await mover.move_context(ctx, tier)
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
                    index.account(meta, tier, +1)
                    index.account(meta, ref, -1)  # the reference becomes an uncharged copy
                    if tier == cpu.name:
                        cpu.adopt(meta, await mover.stage_from(rec))
                    else:
                        await self._tiers[tier].put(meta, memoryview(await mover.copy_out(rec)))
                    rec = ObjectRecord(meta, tier, shadow=ref, durable=True)
                index.objects[meta.key] = rec
                ctx.keys.add(meta.key)
            ctx.size_bytes = sum(m.size_bytes for m, _ in reference)
            ctx.variant = ORIGINAL_VARIANT
            ctx.reference = None
            self._options.changed()  # its form changed

    def _marker(self, ctx: ContextRecord, variant: str, encoded: EncodedVariant) -> EncodedObject:
        """The object that marks the new form complete: a token-dropped variant's placeholder
        manifest, under the key the router looks its digest up by, else a list of the keys."""
        manifest = encoded.manifest
        if manifest is None:
            key = marker_key(ctx.context_id, variant)
            data = json.dumps([o.meta.key for o in encoded.objects]).encode()
        else:
            key, data = manifest_key(manifest.digest), manifest.to_bytes()
            owner = self._index.marker_owner.get(key, ctx.context_id)
            if key in self._index.objects or owner != ctx.context_id:
                raise InvalidArgumentError(
                    f"context {ctx.context_id!r}: its first {manifest.num_tokens} tokens are "
                    f"already stored as a token-dropped variant ({key}, of "
                    f"{owner if owner != ctx.context_id else 'a kvtierd router store request'})"
                )
        meta = ObjectMeta(key=key, size_bytes=len(data), context_id=ctx.context_id,
                          variant=variant, layout=MARKER_LAYOUT, tenant=ctx.tenant)  # fmt: skip
        return EncodedObject(key, meta, data)


@dataclass(slots=True)
class Settled:
    """What the persistent tiers hold after a restart, leftovers deleted: the objects to index,
    and per context the marker of its variant and the reference copy of its original."""

    objects: list[tuple[ObjectMeta, str]] = field(default_factory=list)
    markers: dict[str, tuple[ObjectMeta, str]] = field(default_factory=dict)
    references: dict[str, list[tuple[ObjectMeta, str]]] = field(default_factory=dict)


def made_or_marking(found: list[tuple[ObjectMeta, str]]) -> list[tuple[ObjectMeta, str]]:
    """The few objects of ``found`` a restart looks at again (:func:`settle_variants`): those
    the daemon made (their keys are derived, ``variant_key``) and the markers (a marker's key
    need not be derived), in one pass over all."""
    return [item for item in found
            if SEPARATOR in item[0].key or item[0].layout == MARKER_LAYOUT]  # fmt: skip


async def settle_variants(
    found: list[tuple[ObjectMeta, str]],
    made_or_marks: list[tuple[ObjectMeta, str]],
    tiers: Mapping[str, Tier],
    reference_tier: str,
) -> Settled:
    """Drop the leftovers of compressions a crash cut short (module docstring). The objects
    to index keep the order of ``found`` (``out.objects`` may be ``found`` itself);
    ``made_or_marks`` is :func:`made_or_marking` of ``found``, in its order (picked out by
    the caller before sorting ``found``: in key order the pass met each meta at another place
    in memory, ~1 s of a 1,000,000-object restart)."""
    markers: dict[tuple[str, str], tuple[ObjectMeta, str]] = {}
    for meta, tier in [item for item in made_or_marks if item[0].layout == MARKER_LAYOUT]:
        if (meta.context, meta.variant) in markers:
            # A move a crash cut short between writing the marker and deleting its old copy
            # (TierMover.move_context): one is kept, so none is left to mark a later variant.
            await _delete_leftover(tiers[tier], meta)
            continue
        markers[meta.context, meta.variant] = (meta, tier)
    if not markers:
        return await _settle_unmarked(found, made_or_marks, tiers)
    made: dict[str, set[str]] = {}  # context -> the forms the daemon completed of it
    for c, v in markers:
        made.setdefault(c, set()).add(v)
    out = Settled()
    for meta, tier in found:
        if meta.layout == MARKER_LAYOUT:
            continue
        made_by_daemon = SEPARATOR in meta.key
        complete = (meta.context, meta.variant) in markers
        # A client's object of a context the daemon made another form of was superseded: its
        # original, or its quantized chunks a variant was made from (ContextIndex.sources); a
        # client's object stored in the compressed form (added after the compression) was not.
        forms = None if made_by_daemon else made.get(meta.context)
        superseded = forms is not None and bool(forms - {meta.variant})
        if superseded and meta.variant == ORIGINAL_VARIANT and tier == reference_tier:
            out.references.setdefault(meta.context, []).append((meta, tier))
            continue
        if (made_by_daemon and not complete) or superseded:
            await _delete_leftover(tiers[tier], meta)
            continue
        out.objects.append((meta, tier))
    kept_contexts = {m.context for m, _ in out.objects}
    for (context, _), (meta, tier) in markers.items():
        if context not in kept_contexts:  # its objects were in a volatile tier
            await tiers[tier].delete(meta.key, tenant=meta.tenant)
    out.markers = {c: mt for (c, _), mt in markers.items() if c in kept_contexts}
    return out


async def _settle_unmarked(
    found: list[tuple[ObjectMeta, str]],
    made: list[tuple[ObjectMeta, str]],
    tiers: Mapping[str, Tier],
) -> Settled:
    """:func:`settle_variants` when no variant the daemon made is complete (most restarts: no
    lookup per object; issue 42): every object the daemon made (among ``made``, those of
    ``found`` the daemon made or that mark a variant) is a leftover."""
    leftovers = [item for item in made if SEPARATOR in item[0].key]
    if not leftovers:
        return Settled(objects=found)
    for meta, tier in leftovers:
        await _delete_leftover(tiers[tier], meta)
    return Settled(objects=[item for item in found if SEPARATOR not in item[0].key])


async def _delete_leftover(tier: Tier, meta: ObjectMeta) -> None:
    try:
        await tier.delete(meta.key, tenant=meta.tenant)
    except KvtierError as err:
        logger.warning("could not delete leftover %r: %s", meta.key, err)
