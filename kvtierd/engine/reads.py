"""The read path: lookups (with shared tiers asked on a miss), leases over arena blocks, and
access recording. A lease references its arena block; a block no tier owns any more (the
object was demoted or deleted meanwhile) is freed by the last release."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Sequence
from typing import TYPE_CHECKING, cast

from kvtierd.engine.state import ContextRecord, LeaseRecord, ObjectRecord
from kvtierd.errors import CorruptObjectError, KvtierError, LeaseError, NotFoundError
from kvtierd.storage.allocator import Block
from kvtierd.storage.pooled import PooledTier

if TYPE_CHECKING:
    from kvtierd.engine.engine import Engine


class Reads:
    """Mixed into :class:`~kvtierd.engine.Engine`."""

    async def lookup(
        self, keys: Sequence[str], hold_s: float = 0.0, tenant: str = ""
    ) -> tuple[list[ObjectRecord | None], int]:
        e = cast("Engine", self)
        now = e.last_read_s = time.monotonic()
        found: list[ObjectRecord | None] = [e.owned(k, tenant) for k in keys]
        if e._shared:
            await self._verify_unhealthy_shared(keys, found)
        if e._shared and None in found:
            missing = [i for i, f in enumerate(found) if f is None]
            fetched = await asyncio.gather(*(e._fetch_shared(keys[i], tenant) for i in missing))
            for i, rec in zip(missing, fetched, strict=True):
                found[i] = rec
        prefix = next((i for i, f in enumerate(found) if f is None), len(found))
        for rec in found:
            if rec is not None and hold_s > 0:
                ctx = e.contexts[rec.meta.context]
                ctx.hold_until_s = max(ctx.hold_until_s, now + hold_s)
        return found, prefix

    async def _verify_unhealthy_shared(
        self, keys: Sequence[str], found: list[ObjectRecord | None]
    ) -> None:
        """While a shared tier is unhealthy (a Redis node down), an object it holds counts as
        found only if the tier can still produce its manifest: a lookup must not promise what
        the following Get cannot deliver."""
        e = cast("Engine", self)
        sick = {t.name: t for t in e._shared if not t.healthy}
        if not sick:
            return
        todo = [i for i, f in enumerate(found) if f is not None and f.tier in sick]

        async def reachable(i: int) -> bool:
            rec = found[i]
            assert rec is not None
            try:
                await sick[rec.tier].fetch_meta(rec.meta.key, tenant=rec.meta.tenant)
            except KvtierError:
                return False
            return True

        for i, ok in zip(todo, await asyncio.gather(*(reachable(i) for i in todo)), strict=True):
            if not ok:
                found[i] = None

    async def _fetch_shared(self, key: str, tenant: str) -> ObjectRecord | None:
        """An object another daemon stored in a shared tier since this one started."""
        e = cast("Engine", self)
        for tier in e._shared:
            try:
                meta = await tier.fetch_meta(key, tenant=tenant)
            except KvtierError:
                continue  # a miss, or the tier is unreachable: a miss either way
            if key in e.objects:  # found meanwhile by a concurrent call (or another tenant's)
                return e.owned(key, tenant)
            rec = e.objects[key] = ObjectRecord(meta, tier.name, durable=True, unread=meta.durable)
            e.account(meta, tier.name, +1)
            ctx = e._context_add(meta)
            e.executor.submit(e.adopt_placement(ctx, e.placement_of(ctx)))
            return rec
        return None

    async def get(
        self, keys: Sequence[str], lease_s: float = 0.0, tenant: str = "", device_ok: bool = False
    ) -> list[LeaseRecord]:
        """A lease per key on a block holding the object's bytes: in the arena (the CPU tier's
        own block, or a copy staged from a slower tier), or — with ``device_ok``, for an
        object in a gpu tier — its block in that tier's CUDA pool, in place."""
        e = cast("Engine", self)
        e._check_open()
        lease_s = lease_s if lease_s > 0 else e.config.lease_s
        leases: list[LeaseRecord] = []
        e.last_read_s = time.monotonic()
        e._loads_in_flight += 1
        try:
            for key in keys:
                if key not in e.objects and e._shared:
                    await e._fetch_shared(key, tenant)
                leases.append(await e._lease_one(key, lease_s, device_ok, tenant))
        except BaseException:
            e.release([lease.lease_id for lease in leases])
            raise
        finally:
            e._loads_in_flight -= 1
        for ctx_id in dict.fromkeys(lease.meta.context for lease in leases):
            e._record_access(e.contexts[ctx_id])
        return leases

    async def _lease_one(
        self, key: str, lease_s: float, device_ok: bool, tenant: str
    ) -> LeaseRecord:
        e = cast("Engine", self)
        started = time.perf_counter()
        obj = e.owned(key, tenant)
        if obj is None:
            e.misses += 1
            e.metrics.record_miss()
            raise NotFoundError(f"object {key!r} not found")
        ctx = e.contexts[obj.meta.context]
        async with ctx.lock:
            obj = e.record_of(key)
            if obj is None:
                raise NotFoundError(f"object {key!r} was removed while being read")
            tier = e.tiers[obj.tier]
            if tier is e.cpu or (device_ok and isinstance(tier, PooledTier)):
                pool, block = obj.tier, tier.block_of(obj.meta.key)
            else:
                pool, block = e.cpu.name, await e._stage_from(obj)
                e._orphans[pool, block.offset] = block
        ref = (pool, block.offset)
        e._block_refs[ref] = e._block_refs.get(ref, 0) + 1
        if obj.unread:  # read once: from now on the placer may drop it (durable.py)
            obj.unread = False
            e.note_read(ctx)
        e.hits += 1
        e.tier_hits[obj.tier] += 1
        e.metrics.record_hit(obj.tier)
        lease = LeaseRecord(
            f"{e.instance_id}:l{next(e._ids)}", obj.meta, obj.tier, block,
            time.monotonic() + lease_s, pool,
        )  # fmt: skip
        e.leases[lease.lease_id] = lease
        e.metrics.observe_load(obj.tier, time.perf_counter() - started, obj.meta.size_bytes)
        return lease

    async def _stage_from(self, obj: ObjectRecord) -> Block:
        e = cast("Engine", self)
        block = e.cpu.stage(obj.meta.size_bytes)
        try:
            view = e.cpu.view(block, padded=True)
            await e.tiers[obj.tier].read_into(obj.meta.key, view, tenant=obj.meta.tenant)
        except CorruptObjectError:
            e.cpu.free_block(block)
            ctx = e.contexts[obj.meta.context]
            e._forget_object(obj.meta.key)
            if ctx.context_id not in e.contexts:  # its last object: drop the rest, as delete does
                await e.drop_extras(ctx)
            raise
        except BaseException:
            e.cpu.free_block(block)
            raise
        return block

    def release(self, lease_ids: Sequence[str]) -> None:
        e = cast("Engine", self)
        for lid in lease_ids:
            lease = e.leases.pop(lid, None)
            if lease is None:
                if not lid.startswith(e.instance_id + ":"):
                    raise LeaseError(
                        f"lease {lid!r} is from a previous daemon instance (it restarted); "
                        "get the object again"
                    )
                raise NotFoundError(f"unknown, expired or already released lease {lid!r}")
            e._unref(lease.pool, lease.block)

    def _unref(self, pool: str, block: Block) -> None:
        e = cast("Engine", self)
        ref = (pool, block.offset)
        left = e._block_refs[ref] - 1
        if left:
            e._block_refs[ref] = left
            return
        del e._block_refs[ref]
        orphan = e._orphans.pop(ref, None)
        if orphan is not None:
            tier = e.tiers[pool]
            assert isinstance(tier, PooledTier)
            tier.free_block(orphan)

    def owned(self, key: str, tenant: str) -> ObjectRecord | None:
        """The object under ``key`` if it belongs to ``tenant``: keys are scoped by tenant,
        but a default-tenant object stored as ``A/...`` before tenant ``A`` was configured
        must not become tenant ``A``'s."""
        obj = self.record_of(key)
        return obj if obj is not None and obj.meta.tenant == tenant else None

    def record_of(self, key: str) -> ObjectRecord | None:
        """The object under ``key``: a context's, or a daemon-made variant's manifest (no
        object of its context, but the router reads it)."""
        e = cast("Engine", self)
        obj = e.objects.get(key)
        if obj is not None or key not in e.manifest_owner:
            return obj
        ctx = e.contexts.get(e.manifest_owner[key])
        if ctx is None or ctx.manifest is None or ctx.manifest[0].key != key:
            return None
        return ObjectRecord(*ctx.manifest)

    def touch(self, keys: Sequence[str], tenant: str = "") -> int:
        e = cast("Engine", self)
        owned = (e.owned(k, tenant) for k in keys)
        touched = {o.meta.context for o in owned if o is not None}
        for ctx_id in touched:
            e._record_access(e.contexts[ctx_id])
        return len(touched)

    def _record_access(self, ctx: ContextRecord) -> None:
        e = cast("Engine", self)
        now = time.monotonic()
        ctx.hits += 1
        ctx.last_access_s = now
        e.profiling.note_access(ctx.context_id)
        if ctx.durable_held or not e.placer_target(ctx.context_id).dropped:
            e.executor.submit(e.placer.access(ctx.context_id, now))
        else:
            # A context the placer dropped, still here while a hold defers its drop
            # (executor.py), is used again: the placer places it again and counts its bytes.
            e.executor.submit(e.placer.insert(e.profile(ctx)))
