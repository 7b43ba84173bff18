"""The engine: the single owner of index state (context -> objects -> tier), leases and
access statistics. Servicers translate gRPC to calls on it; placement decisions come from a
:class:`~kvtierd.policies.Placer`; the :class:`~kvtierd.engine.executor.Executor` carries
plans out in the background.

Everything here runs on the daemon's event loop, so index updates need no locks; byte copies
and file I/O run on worker threads inside the tiers. A context's ``lock`` serialises the
moves of its objects against reads that stage them.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import itertools
import logging
import math
import secrets
import time
from collections import Counter, OrderedDict
from collections.abc import Sequence

from kvtierd.config import DaemonConfig
from kvtierd.engine.admin_ops import AdminOps
from kvtierd.engine.context_kv import client_key
from kvtierd.engine.durable import DurableOps
from kvtierd.engine.executor import Executor
from kvtierd.engine.moves import Moves
from kvtierd.engine.plans import WritePlanner
from kvtierd.engine.profiling import ProfilingService
from kvtierd.engine.reads import Reads
from kvtierd.engine.servable import load_cards, save_card
from kvtierd.engine.state import AllocationRecord, ContextRecord, LeaseRecord, ObjectRecord
from kvtierd.engine.validate import validate_meta
from kvtierd.engine.variants import VariantOps
from kvtierd.errors import (
    AlreadyExistsError,
    CapacityError,
    ConfigError,
    InvalidArgumentError,
    KvtierError,
    NotFoundError,
    UnavailableError,
)
from kvtierd.kernels.placeholder import MODEL_CARD_LAYOUT, ModelCard
from kvtierd.metrics import Metrics
from kvtierd.policies import Placer, PlacerParams, placer_class
from kvtierd.policies.model import check_tiers
from kvtierd.policy_config import PLACER_PARAMS_FIELDS, PolicyConfig, default_policy, load_policy
from kvtierd.storage import CpuTier, Tier, create_tier
from kvtierd.storage.allocator import Block
from kvtierd.storage.pooled import PooledTier
from kvtierd.storage.ssd_format import data_checksum
from kvtierd.types import (
    DROPPED,
    ContextProfile,
    ObjectMeta,
    Operation,
    OpKind,
    Placement,
    Plan,
    TierModel,
)

logger = logging.getLogger(__name__)


class Engine(Reads, AdminOps, Moves, VariantOps, DurableOps):
    def __init__(self, config: DaemonConfig) -> None:
        self.config = config
        self.instance_id = secrets.token_hex(6)
        self.started_s = time.monotonic()
        self.tiers: dict[str, Tier] = {t.name: create_tier(t) for t in config.tiers}
        cpus = [t for t in self.tiers.values() if isinstance(t, CpuTier)]
        if len(cpus) != 1:
            raise InvalidArgumentError(
                f"exactly one tier of kind 'cpu' is required (the shared-memory data plane), "
                f"found {len(cpus)}"
            )
        self.cpu: CpuTier = cpus[0]
        self.tier_index = {name: i for i, name in enumerate(self.tiers)}
        self._shared = [t for t in self.tiers.values() if t.shared]
        self.objects: dict[str, ObjectRecord] = {}
        self.contexts: dict[str, ContextRecord] = {}
        self.allocations: dict[str, AllocationRecord] = {}
        self.leases: dict[str, LeaseRecord] = {}
        self._committed: OrderedDict[str, None] = OrderedDict()  # recent ids: double commits
        # (pool tier, offset) -> leases on that block; blocks no tier owns any more, freed by
        # their last release. The pool is the CPU tier's arena, or a gpu tier (device leases).
        self._block_refs: dict[tuple[str, int], int] = {}
        self._orphans: dict[tuple[str, int], Block] = {}
        self._ids = itertools.count(1)
        self.hits = 0
        self.misses = 0
        self.tier_hits: Counter[str] = Counter()
        # (tenant, tier) -> bytes charged: each object once, in the tier it is placed in
        # (a durable object's persistent copy under a faster tier is not charged again).
        self.usage: Counter[tuple[str, str]] = Counter()
        self.durable_holds = 0  # placer drops refused for unread durable objects (durable.py)
        self.quotas = {t.name: dict(t.quota_bytes) for t in config.tenants}
        self.variant_manifests: dict[str, tuple[ObjectMeta, str]] = {}
        # A daemon-made variant's manifest key -> its context (the manifest is no object of
        # the context's, but a client reads it: the router, by the digest of its tokens).
        self.manifest_owner: dict[str, str] = {}
        # LMCache model name -> the card its plugin registered (kernels/placeholder.py).
        self.model_cards: dict[str, ModelCard] = {}
        self.references: dict[str, list[tuple[ObjectMeta, str]]] = {}
        self.metrics = Metrics()
        self.draining = False
        self.policy = load_policy(config.policy_file) if config.policy_file else default_policy()
        self.placer = self._make_placer(self.policy)
        self.executor = Executor(self)
        self.profiling = ProfilingService(self)
        self.write_planner = WritePlanner(self)
        self._loads_in_flight = 0
        self.last_read_s = -math.inf  # monotonic time of the newest Lookup or Get
        self._reaper: asyncio.Task[None] | None = None

    # -- lifecycle ---------------------------------------------------------------------------

    def _make_placer(self, policy: PolicyConfig) -> Placer:
        try:
            cls = placer_class(policy.placer)
        except ValueError as e:
            raise ConfigError(f"{policy.source}: {e}") from e
        known = {f.name for f in dataclasses.fields(PlacerParams)}
        params = PlacerParams(
            **{f: getattr(policy, a) for f, a in PLACER_PARAMS_FIELDS.items() if f in known}
        )
        return cls(self.tier_models(), params)

    def tier_models(self) -> list[TierModel]:
        """Load time per tier, from the tiers' read fits (overhead + bandwidth of real reads;
        a tier that has timed no read yet gives its kind's prior, never 0). A host reader
        copies every load out of the arena (the CPU tier's read fit); an object in another
        tier is first read into the arena (that tier's fit)."""
        arena = self.cpu.load_fit()
        models = []
        for t in self.tiers.values():
            load = arena if t is self.cpu else t.load_fit().then(arena)
            models.append(
                TierModel(t.name, t.capacity_bytes or None, load.bytes_per_s, load.overhead_s)
            )
        check_tiers(models)
        return models

    async def start(self) -> None:
        started: list[Tier] = []
        try:
            for tier in self.tiers.values():
                try:
                    await tier.start()
                except OSError as e:  # a start-up error to report, not a traceback
                    raise ConfigError(f"tier {tier.name} ({tier.kind}): cannot start: {e}") from e
                started.append(tier)
        except BaseException:
            for tier in reversed(started):
                await tier.close()
            raise
        # Bandwidths are known now: give the placer the calibrated figures.
        self.placer = self._make_placer(self.policy)
        self.profiling.configure()
        self.model_cards.update(load_cards(self.config.data_dir))
        await self._rebuild_index()
        self.executor.start()
        self.profiling.start()
        self._reaper = asyncio.create_task(self._reap_forever(), name="kvtierd-reaper")

    async def _rebuild_index(self) -> None:
        """Index every object the persistent tiers still hold (after a restart)."""
        found: list[tuple[ObjectMeta, str]] = []
        for tier in self.tiers.values():
            try:
                found.extend((meta, tier.name) for meta in tier.metas())
            except KvtierError as e:
                # A shared tier that is down at start is not fatal: its objects are found
                # on demand (``_fetch_shared``) once it is back.
                logger.warning("tier %s: cannot list objects at start: %s", tier.name, e)
        for meta, tier_name in await self.settle_variants(found):
            key = client_key(meta.key)
            if key in self.objects:
                logger.warning("object %r found in two tiers; keeping one copy", key)
                continue
            # Found on persistent storage: keep it persistent; one committed durable is
            # protected again until read (the daemon does not know whether it was before).
            self.objects[key] = ObjectRecord(meta, tier_name, durable=True, unread=meta.durable)
            self.account(meta, tier_name, +1)
            self._context_add(meta, key)
        for ctx in self.contexts.values():
            ctx.manifest = self.variant_manifests.get(ctx.context_id)
            if ctx.manifest is not None:
                self.manifest_owner[ctx.manifest[0].key] = ctx.context_id
            ctx.reference = self.references.get(ctx.context_id)
            for meta, where in ctx.reference or ():
                self.account(meta, where, +1)
            if ctx.manifest is not None:
                self.account(ctx.manifest[0], ctx.manifest[1], +1)
            self.executor.submit(self.adopt_placement(ctx, self.placement_of(ctx)))
        if self.objects:
            logger.info("rebuilt index: %d objects in %d contexts", len(self.objects),
                        len(self.contexts))  # fmt: skip

    async def close(self) -> None:
        self.draining = True
        if self._reaper is not None:
            self._reaper.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._reaper
        await self.executor.close()
        await self.profiling.close()
        for tier in self.tiers.values():
            await tier.close()

    def adopt_placement(self, ctx: ContextRecord, placement: Placement) -> Plan:
        """Tell the placer where the context is. A context held for its unread durable
        objects stays outside the placer's view until they are read (durable.py)."""
        if ctx.durable_held and self.unread_durable(ctx):
            return Plan()
        ctx.durable_held = False
        return self.placer.adopt(self.profile(ctx), placement)

    # -- puts through the arena ----------------------------------------------------------------

    def _check_open(self) -> None:
        if self.draining:
            raise UnavailableError("the daemon is shutting down; retry against the new instance")

    def allocate(self, metas: Sequence[ObjectMeta]) -> list[AllocationRecord]:
        self._check_open()
        largest = max((t.capacity_bytes or 1 << 62) for t in self.tiers.values())
        seen: set[str] = set()
        for meta in metas:
            validate_meta(meta, min(largest, self.config.max_object_bytes))
            if meta.key in self.objects or meta.key in seen or self._allocating(meta.key):
                raise AlreadyExistsError(f"object {meta.key!r} already exists or is being put")
            seen.add(meta.key)
        self._check_quota(metas)
        records: list[AllocationRecord] = []
        try:
            for meta in metas:
                block = self.cpu.stage(meta.size_bytes)
                now = time.monotonic()
                rec = AllocationRecord(
                    allocation_id=f"{self.instance_id}:a{next(self._ids)}",
                    meta=meta,
                    block=block,
                    deadline_s=now + self.config.allocation_timeout_s,
                    created_s=now,
                )
                self.allocations[rec.allocation_id] = rec
                records.append(rec)
        except BaseException:
            for rec in records:
                self.abort([rec.allocation_id])
            raise
        return records

    def _check_quota(self, metas: Sequence[ObjectMeta]) -> None:
        """A tenant's objects (stored and in flight) stay within the sum of its tier quotas."""
        asked: Counter[str] = Counter()
        for meta in metas:
            asked[meta.tenant] += meta.size_bytes
        for tenant, nbytes in asked.items():
            quota = self.quotas.get(tenant)
            if not quota:
                continue
            total = sum(quota.values())
            held = sum(v for (t, _), v in self.usage.items() if t == tenant)
            held += sum(
                a.meta.size_bytes for a in self.allocations.values() if a.meta.tenant == tenant
            )
            if held + nbytes > total:
                raise CapacityError(
                    f"tenant {tenant!r} quota exceeded: {held} bytes stored or being put, "
                    f"{nbytes} more asked, quota {total} bytes over tiers {', '.join(quota)}"
                )

    def quota_tier(self, ctx: ContextRecord, wanted: str) -> str | None:
        """The first tier from ``wanted`` down where the context fits the tenant's quota
        (``None``: nowhere, drop it). Tiers without a quota for the tenant are unlimited."""
        quota = self.quotas.get(ctx.tenant)
        names = list(self.tiers)
        for name in names[names.index(wanted) :]:
            limit = quota.get(name) if quota else None
            if limit is None:
                return name
            here = sum(
                self.objects[k].meta.size_bytes for k in ctx.keys if self.objects[k].tier == name
            )
            if self.usage[ctx.tenant, name] - here + ctx.size_bytes <= limit:
                return name
        return None

    def _allocating(self, key: str) -> bool:
        return any(a.meta.key == key for a in self.allocations.values())

    def abort(self, allocation_ids: Sequence[str]) -> None:
        for aid in allocation_ids:
            rec = self.allocations.pop(aid, None)
            if rec is not None:
                self.cpu.free_block(rec.block)

    async def commit(
        self, allocation_ids: Sequence[str], durable: bool = False
    ) -> list[ObjectMeta]:
        self._check_open()
        if len(set(allocation_ids)) < len(allocation_ids):
            twice = next(aid for aid, n in Counter(allocation_ids).items() if n > 1)
            raise InvalidArgumentError(f"allocation {twice!r} is listed twice; list each once")
        recs: list[AllocationRecord] = []
        for aid in allocation_ids:
            if aid in self._committed:
                raise AlreadyExistsError(f"allocation {aid!r} was already committed")
            if aid not in self.allocations:
                raise NotFoundError(f"unknown or expired allocation {aid!r}; allocate again")
            recs.append(self.allocations[aid])
        self._verify_checksums(recs)
        metas = []
        for rec in recs:
            del self.allocations[rec.allocation_id]
            self._committed[rec.allocation_id] = None
            if len(self._committed) > 100_000:
                self._committed.popitem(last=False)
            if rec.meta.layout == MODEL_CARD_LAYOUT:  # kept by the engine, no object
                self.learn_card(rec.meta, bytes(self.cpu.view(rec.block)))
                self.cpu.free_block(rec.block)
                metas.append(rec.meta)
                continue
            metas.append(self._add_object(self.cpu.adopt(rec.meta, rec.block), self.cpu.name))
            seconds = time.monotonic() - rec.created_s  # includes the client's copy in
            self.metrics.observe_store(self.cpu.name, seconds, rec.meta.size_bytes)
        self.publish_tier_state()
        if durable:
            try:
                await self.write_through([m for m in metas if m.layout != MODEL_CARD_LAYOUT])
            except BaseException:
                # Not acknowledged, so not stored: the client may put the same keys again.
                await self.delete([m.key for m in metas])
                raise
        return metas

    def _verify_checksums(self, recs: Sequence[AllocationRecord]) -> None:
        """A checksum the client gave (xxh3_64 of the bytes; 0: none) must match what it
        wrote: one that does not is refused before anything of the commit is stored (a wrong
        one was accepted and served, and failed only when the object was written to SSD)."""
        for rec in recs:
            given = rec.meta.checksum
            if not given:
                continue
            actual = data_checksum(self.cpu.view(rec.block))
            if actual != given:
                self.abort([r.allocation_id for r in recs])
                raise InvalidArgumentError(
                    f"object {rec.meta.key!r}: checksum {given:#x} given, but the bytes written "
                    f"hash to {actual:#x} (xxh3_64); nothing of this commit was stored: "
                    "allocate and write again"
                )

    async def put_bytes(
        self, meta: ObjectMeta, data: memoryview, durable: bool = False
    ) -> ObjectMeta:
        """Store bytes that arrived by stream (not through the arena)."""
        (rec,) = self.allocate([meta])
        try:
            self.cpu.view(rec.block)[:] = data
        except BaseException:
            self.abort([rec.allocation_id])
            raise
        (stored,) = await self.commit([rec.allocation_id], durable)
        return stored

    def _add_object(self, meta: ObjectMeta, tier: str) -> ObjectMeta:
        self.objects[meta.key] = ObjectRecord(meta, tier)
        self.account(meta, tier, +1)
        ctx = self._context_add(meta)
        ctx.last_access_s = time.monotonic()
        ctx.durable_held = False  # the placer places the whole context again
        self.profiling.note_change(ctx)
        self.executor.submit(self._joined(ctx, self.placer.insert(self.profile(ctx)), tier))
        return meta

    def learn_card(self, meta: ObjectMeta, data: bytes) -> None:
        """A model card a plugin registered (a put of layout ``MODEL_CARD_LAYOUT``, kept in
        memory and in ``data_dir``, never as an object the placer would see): token-dropped
        variants of its model's contexts can now be written in the servable form."""
        try:
            card = ModelCard.from_bytes(data)
        except InvalidArgumentError as e:
            logger.warning("model card %r ignored: %s", meta.key, e)
            return
        self.model_cards[card.model] = card
        save_card(self.config.data_dir, card)
        self.profiling.note_form()

    def _joined(self, ctx: ContextRecord, plan: Plan, tier: str) -> Plan:
        """``plan`` (the placer's answer to a context that grew), plus the operation that
        brings the new object in ``tier`` to where the context is placed: the placer plans
        none for a context it leaves where it is, yet the new object is not there yet."""
        if any(op.context_id == ctx.context_id for op in plan.operations):
            return plan  # a move or drop of the context takes every object of it along
        target = self.placer_target(ctx.context_id)
        if target.tier == tier and target.variant == ctx.variant:
            return plan
        kind = OpKind.DROP if target.dropped else OpKind.MOVE
        source = Placement(ctx.variant, tier)
        return plan + Plan((Operation(kind, ctx.context_id, source, target, "joins its context"),))

    def placer_target(self, context_id: str) -> Placement:
        """Where the placer has a context now (``DROPPED`` for one it does not keep)."""
        try:
            return self.placer.placement(context_id)
        except KeyError:
            return DROPPED

    def _context_add(self, meta: ObjectMeta, key: str = "") -> ContextRecord:
        ctx = self.contexts.get(meta.context)
        if ctx is None:
            ctx = ContextRecord(meta.context, meta.variant, tenant=meta.tenant)
            self.contexts[meta.context] = ctx
        ctx.keys[key or meta.key] = None
        ctx.size_bytes += meta.size_bytes
        return ctx

    # -- removal -----------------------------------------------------------------------------

    async def delete(self, keys: Sequence[str], tenant: str | None = None) -> int:
        """Delete objects (only ``tenant``'s when given: a client's delete)."""
        deleted = 0
        for key in keys:
            obj = self.objects.get(key) if tenant is None else self.owned(key, tenant)
            if obj is None:
                continue
            ctx = self.contexts[obj.meta.context]
            async with ctx.lock:
                if key in self.objects:
                    await self._remove_object_bytes(self.objects[key])
                    self._forget_object(key)
                    deleted += 1
                if ctx.context_id not in self.contexts:
                    await self.drop_extras(ctx)
        return deleted

    async def _remove_object_bytes(self, obj: ObjectRecord) -> None:
        await self._remove_from_tier(obj.meta, obj.tier)
        if obj.shadow:
            await self._remove_from_tier(obj.meta, obj.shadow, charged=False)

    def account(self, meta: ObjectMeta, tier: str, sign: int) -> None:
        """Keep per-tenant bytes per tier (quotas) in step with where objects are charged:
        their placement, a variant's manifest, the reference copy of an original."""
        self.usage[meta.tenant, tier] += sign * meta.size_bytes

    async def _remove_from_tier(
        self, meta: ObjectMeta, tier_name: str, *, charged: bool = True
    ) -> None:
        """Delete one copy; ``charged=False`` for a copy the tenant is not charged for (the
        persistent copy of a durable object under a faster tier)."""
        key = meta.key
        if charged:
            self.account(meta, tier_name, -1)
        tier = self.tiers[tier_name]
        if isinstance(tier, PooledTier):
            block = tier.detach(key)
            if self._block_refs.get((tier_name, block.offset)):
                self._orphans[tier_name, block.offset] = block  # freed by the last release
            else:
                tier.free_block(block)
        else:
            with contextlib.suppress(NotFoundError):
                await self.tiers[tier_name].delete(key, tenant=meta.tenant)

    def publish_tier_state(self) -> None:
        """Tier occupancy into the metrics (after each change, and from the health loop)."""
        for tier in self.tiers.values():
            st = tier.stats()
            self.metrics.set_tier_state(
                st.name, st.used_bytes, st.object_count, st.capacity_bytes, st.healthy
            )

    def _forget_object(self, key: str) -> None:
        """Drop the object from the index; keep the placer in step with its context."""
        obj = self.objects.pop(key)
        ctx = self.contexts[obj.meta.context]
        del ctx.keys[key]
        ctx.size_bytes -= obj.meta.size_bytes
        if not ctx.keys:
            del self.contexts[ctx.context_id]
            self.placer.remove(ctx.context_id)
        else:
            self.executor.submit(self.adopt_placement(ctx, self.placement_of(ctx)))

    def placement_of(self, ctx: ContextRecord) -> Placement:
        """Where the context's bytes are (its first object's tier; moves keep them together)."""
        if not ctx.keys:
            return DROPPED
        return Placement(ctx.variant, self.objects[next(iter(ctx.keys))].tier)

    def loads_busy(self) -> bool:
        """Requests are being served — a Get in flight, a client still reading under a lease,
        or a Lookup or Get within ``profile_quiet_s`` (the serving engine computes the rest of
        the prompt and decodes after its loads): background profiling waits (EvicPress §4.3:
        only with free cycles; ``profiler/yield_gate.py``)."""
        if self._loads_in_flight > 0 or self.leases:
            return True
        return time.monotonic() - self.last_read_s < self.config.profile_quiet_s

    def profile(self, ctx: ContextRecord) -> ContextProfile:
        """What the placer knows of a context: its variants (sizes; quality once profiled),
        decayed frequency, recency, protection."""
        decayed = self.profiling.frequency(ctx.context_id)
        prefill = self.profiling.prefill_s(ctx)
        return ContextProfile(
            context_id=ctx.context_id,
            variants=self.profiling.grid(ctx),
            frequency=decayed if decayed is not None else float(max(ctx.hits, 1)),
            prefill_s=prefill,
            last_access_s=ctx.last_access_s,
            # Not a lookup's hold: it ends on its own, and a placer told of it would keep the
            # context pinned after it (the executor defers what a hold forbids, executor.py).
            pinned=ctx.pinned,
        )

    # -- background --------------------------------------------------------------------------

    async def _reap_forever(self, period_s: float = 1.0) -> None:
        while True:
            await asyncio.sleep(period_s)
            self.reap(time.monotonic())

    def reap(self, now_s: float) -> None:
        """Expire leases and abandoned allocations (a client that died mid-put)."""
        for lid in [lid for lid, lease in self.leases.items() if lease.deadline_s < now_s]:
            logger.warning("lease %s on %r expired unreleased", lid, self.leases[lid].meta.key)
            self.release([lid])
        for aid in [a for a, rec in self.allocations.items() if rec.deadline_s < now_s]:
            logger.warning("allocation %s for %r expired uncommitted", aid,
                           self.allocations[aid].meta.key)  # fmt: skip
            self.abort([aid])
