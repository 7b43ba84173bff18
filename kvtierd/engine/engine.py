"""The engine: wires the index of contexts and objects, the lease table, the tier mover, the
variant writer, the profiling service, the placer and the plan executor, and serves the put path
(allocate, commit, delete) itself. Servicers translate gRPC to calls on it; placement decisions
come from a :class:`~kvtierd.policies.Placer`; the :class:`~kvtierd.engine.executor.Executor`
carries plans out in the background.

Everything here runs on the daemon's event loop, so index updates need no locks; byte copies
and file I/O run on worker threads inside the tiers. A context's ``lock`` serialises the
moves of its objects against reads that stage them.

Dependencies run one way (each module imports only those above it)::

    state, context_kv, validate, tokens, servable
    index -> leases -> mover -> profiling -> placing -> durable, variants -> executor
    -> reads, writes, admin_ops, write_advice -> views, engine
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import secrets
import time
from collections import Counter
from collections.abc import Mapping, Sequence

from kvtierd.config import DaemonConfig
from kvtierd.engine.admin_ops import AdminOps
from kvtierd.engine.context_kv import client_key
from kvtierd.engine.durable import DurableGuard
from kvtierd.engine.executor import Executor
from kvtierd.engine.in_flight import InFlightReports
from kvtierd.engine.index import ContextIndex, found_order
from kvtierd.engine.leases import LeaseTable
from kvtierd.engine.margin import decision_margin, room_bytes
from kvtierd.engine.mover import TierMover
from kvtierd.engine.placing import Placing
from kvtierd.engine.profiling import ProfilingService
from kvtierd.engine.reads import ReadPath
from kvtierd.engine.segments import Segments
from kvtierd.engine.servable import load_cards
from kvtierd.engine.shutdown_flush import (
    flush_cpu_tier,
    restore_access_times,
    save_access_times,
)
from kvtierd.engine.state import (
    AllocationRecord,
    ContextRecord,
    LeaseRecord,
    ObjectRecord,
    RunningPolicy,
)
from kvtierd.engine.variants import VariantWriter, settle_variants
from kvtierd.engine.views import ContextSummary, EngineCounts
from kvtierd.engine.write_advice import WriteAdvisor
from kvtierd.engine.writes import WritePath
from kvtierd.errors import (
    ConfigError,
    InvalidArgumentError,
    KvtierError,
    UnavailableError,
)
from kvtierd.kernels.placeholder import ModelCard
from kvtierd.metrics import Metrics
from kvtierd.policies.evicpress import EvicPressPlacer
from kvtierd.policies.loader import default_policy, load_policy
from kvtierd.policy_config import PolicyConfig
from kvtierd.storage import CpuTier, Tier, create_tier
from kvtierd.types import ObjectMeta, Plan

logger = logging.getLogger(__name__)


class Engine:
    """One daemon's engine. Its parts are attributes; servicers read through the read-only
    properties (``contexts``, ``objects``, ``leases``, ...) and act through the methods."""

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
        self.metrics = Metrics()
        self.draining = False
        # LMCache model name -> the card its plugin registered (kernels/placeholder.py).
        self.model_cards: dict[str, ModelCard] = {}
        self.running = RunningPolicy(
            load_policy(config.policy_file) if config.policy_file else default_policy()
        )
        self.index = ContextIndex({t.name: t.quota_bytes for t in config.tenants})
        self.lease_table = LeaseTable(self.instance_id, self.cpu, self.tiers)
        self.in_flight = InFlightReports()  # vLLM's requests, as the routers report them
        tiers, cpu, index, metrics = self.tiers, self.cpu, self.index, self.metrics
        self.mover = TierMover(
            tiers=tiers, cpu=cpu, index=index, leases=self.lease_table, metrics=metrics
        )
        self.profiling = ProfilingService(
            config=config, index=index, mover=self.mover, policy=self.running, metrics=metrics,
            model_cards=self.model_cards, loads_busy=self.loads_busy,
        )  # fmt: skip
        options = self.profiling.options
        self.placing = Placing(
            index=index, options=options, tiers=tiers, cpu=cpu, policy=self.running
        )
        self.durable = DurableGuard(
            index=index, mover=self.mover, placing=self.placing, tiers=tiers, cpu=cpu,
            metrics=metrics,
        )  # fmt: skip
        self.variants = VariantWriter(
            index=index, mover=self.mover, options=options, tiers=tiers, cpu=cpu
        )
        self.executor = Executor(
            index=index, mover=self.mover, variants=self.variants, durable=self.durable,
            placing=self.placing, metrics=metrics,
        )  # fmt: skip
        self.reads = ReadPath(
            index=index, leases=self.lease_table, mover=self.mover, placing=self.placing,
            durable=self.durable, executor=self.executor, profiling=self.profiling,
            metrics=metrics, quiet_s=config.profile_quiet_s,
        )  # fmt: skip
        self.admin = AdminOps(
            index=index, mover=self.mover, executor=self.executor, placing=self.placing,
            profiling=self.profiling, policy=self.running,
        )  # fmt: skip
        self.writes = WritePath(
            config=config, index=index, leases=self.lease_table, mover=self.mover,
            durable=self.durable, placing=self.placing, executor=self.executor,
            profiling=self.profiling, metrics=metrics, model_cards=self.model_cards,
        )  # fmt: skip
        self.write_advisor = WriteAdvisor(
            index=index, options=options, placing=self.placing, policy=self.running
        )
        self.segments = Segments(
            index=index, placing=self.placing, executor=self.executor, profiling=self.profiling,
            tiers=self.tiers,
        )  # fmt: skip
        # The loops between the parts (a read or a profile changes what the placer should
        # do; a forgotten object changes where its context is) close here.
        self.mover.on_forgotten = self._keep_placer_in_step
        self.mover.on_context_gone = self.profiling.forget
        self.profiling.on_profiled = self._place_again
        self.profiling.refinement.margin_of = self._margin
        self._reaper: asyncio.Task[None] | None = None

    # -- read-only views for the servicers -----------------------------------------------------

    @property
    def contexts(self) -> Mapping[str, ContextRecord]:
        return self.index.contexts

    @property
    def objects(self) -> Mapping[str, ObjectRecord]:
        return self.index.objects

    @property
    def leases(self) -> Mapping[str, LeaseRecord]:
        return self.lease_table.leases

    @property
    def allocations(self) -> Mapping[str, AllocationRecord]:
        return self.lease_table.allocations

    @property
    def policy(self) -> PolicyConfig:
        return self.running.current

    @property
    def tier_hits(self) -> Mapping[str, int]:
        return self.reads.tier_hits

    def publish_tier_state(self) -> None:
        """Tier occupancy and the contexts placed per (variant, tier) into the metrics (from
        the health loop, every second); ``kvtierd_placed_contexts`` was never set before."""
        self.mover.publish_tier_state()
        placed = Counter(self.index.placement_of(c) for c in self.index.contexts.values())
        self.metrics.set_placed_contexts({(p.variant, p.tier): n for p, n in placed.items()})

    def counts(self) -> EngineCounts:
        return EngineCounts(
            instance_id=self.instance_id,
            uptime_s=time.monotonic() - self.started_s,
            placer=self.placing.name,
            contexts=len(self.index.contexts),
            objects=len(self.index.objects),
            leases=len(self.lease_table.leases),
            allocations=len(self.lease_table.allocations),
            draining=self.draining,
            hits=self.reads.hits,
            misses=self.reads.misses,
            pending_plans=self.executor.pending,
            durable_holds=self.durable.holds,
        )

    def summaries(self, tier: str = "") -> list[ContextSummary]:
        """Every context (only those in ``tier`` when given), unordered."""
        out = [self.summary(c) for c in self.index.contexts.values()]
        return [s for s in out if s.tier == tier] if tier else out

    def summary(self, ctx: ContextRecord) -> ContextSummary:
        placement = self.index.placement_of(ctx)
        return ContextSummary(
            context_id=ctx.context_id,
            variant=placement.variant,
            tier=placement.tier or "",
            size_bytes=ctx.size_bytes,
            objects=len(ctx.keys),
            frequency=self.placing.profile(ctx).frequency,
            last_access_s=ctx.last_access_s,
            pinned=ctx.pinned,
            hits=ctx.hits,
            durable_unread=self.index.unread_durable(ctx),
            durable_held=ctx.durable_held,
            parent=ctx.parent,
            children=len(self.index.children.get(ctx.context_id, ())),
            token_drop_refused=self.index.token_drop_refused(ctx),
        )

    # -- lifecycle ---------------------------------------------------------------------------

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
        self.placing.placer = self.placing.make_placer(self.running.current)
        self.profiling.configure()
        self.model_cards.update(load_cards(self.config.data_dir))
        await self._rebuild_index()
        restore_access_times(self.index, self.config.data_dir)
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
                # on demand (``ReadPath._fetch_shared``) once it is back.
                logger.warning("tier %s: cannot list objects at start: %s", tier.name, e)
        # Each context's objects in the order they were put: tiers list them in scan order.
        found.sort(key=lambda item: found_order(item[0]))
        settled = await settle_variants(found, self.tiers, self.mover.reference_tier())
        index = self.index
        for meta, tier_name in settled.objects:
            key = client_key(meta.key)
            if key in index.objects:
                logger.warning("object %r found in two tiers; keeping one copy", key)
                continue
            # Found on persistent storage: keep it persistent; one committed durable is
            # protected again until read (the daemon does not know whether it was before).
            record = ObjectRecord(meta, tier_name, durable=True, unread=meta.durable)
            index.add(record, key, found=True)
        index.relink()  # a child found before its parent
        for ctx in index.contexts.values():
            ctx.marker = settled.markers.get(ctx.context_id)
            if ctx.marker is not None:
                index.marker_owner[ctx.marker[0].key] = ctx.context_id
            ctx.reference = settled.references.get(ctx.context_id)
            for meta, where in ctx.reference or ():
                index.account(meta, where, +1)
            if ctx.marker is not None:
                index.account(ctx.marker[0], ctx.marker[1], +1)
            self.executor.submit(self.placing.adopt_where_it_is(ctx))
        if index.objects:
            logger.info("rebuilt index: %d objects in %d contexts", len(index.objects),
                        len(index.contexts))  # fmt: skip

    async def close(self, flush_s: float = 0.0) -> None:
        """Stop; ``flush_s`` > 0 (a graceful stop) first writes the CPU tier's hottest
        contexts to the SSD tier for at most that long (``shutdown_flush``)."""
        self.draining = True
        if self._reaper is not None:
            self._reaper.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._reaper
        await self.executor.close()
        await self.profiling.close()
        if flush_s > 0:
            await flush_cpu_tier(self.index, self.mover, self.tiers, flush_s)
            save_access_times(self.index, self.config.data_dir)
        for tier in self.tiers.values():
            await tier.close()

    def _keep_placer_in_step(self, ctx: ContextRecord) -> None:
        """An object left the index outside a plan: the placer forgets a context left empty,
        and learns where a context that still has objects is."""
        if not ctx.keys:
            self.placing.remove(ctx.context_id)
        else:
            self.executor.submit(self.placing.adopt_where_it_is(ctx))

    def _place_again(self, ctx: ContextRecord) -> None:
        self.executor.submit(self.placing.insert(ctx))

    def _margin(self, ctx: ContextRecord) -> float:
        """How close the placer's decision on ``ctx`` is, in quality (``margin.py``)."""
        placing = self.placing
        profile, chosen = placing.profile(ctx), placing.target(ctx.context_id)
        tiers = placing.tier_models()
        placer = placing.placer
        used = placer.used_bytes() if isinstance(placer, EvicPressPlacer) else [0.0] * len(tiers)
        room = room_bytes(profile, chosen, tiers, used)
        return decision_margin(profile, chosen, tiers, self.running.current.alpha, room)

    def loads_busy(self) -> bool:
        """Requests are being served — the daemon's own reads (``ReadPath.busy``), or vLLM's
        requests in flight as the routers report them (``in_flight.py``): background
        profiling waits."""
        return self.reads.busy or self.in_flight.busy

    # -- reads and operator actions (ReadPath, AdminOps) ----------------------------------------

    async def lookup(
        self, keys: Sequence[str], hold_s: float = 0.0, tenant: str = ""
    ) -> tuple[list[ObjectRecord | None], int]:
        return await self.reads.lookup(keys, hold_s, tenant)

    async def get(
        self, keys: Sequence[str], lease_s: float = 0.0, tenant: str = "", device_ok: bool = False
    ) -> list[LeaseRecord]:
        self._check_open()
        lease_s = lease_s if lease_s > 0 else self.config.lease_s
        return await self.reads.get(keys, lease_s, tenant, device_ok)

    def release(self, lease_ids: Sequence[str]) -> None:
        self.lease_table.release(lease_ids)

    def touch(self, keys: Sequence[str], tenant: str = "") -> int:
        return self.reads.touch(keys, tenant)

    async def evict(self, context_ids: Sequence[str]) -> int:
        return await self.admin.evict(context_ids)

    def set_pinned(self, context_ids: Sequence[str], pinned: bool) -> int:
        return self.admin.set_pinned(context_ids, pinned)

    async def drain(self, tier_name: str) -> tuple[int, int]:
        return await self.admin.drain(tier_name)

    async def rebalance(self) -> Plan:
        return await self.admin.rebalance()

    async def apply_policy(self, policy: PolicyConfig) -> Plan:
        return await self.admin.apply_policy(policy)

    # -- puts through the arena ----------------------------------------------------------------

    def _check_open(self) -> None:
        if self.draining:
            raise UnavailableError("the daemon is shutting down; retry against the new instance")

    def allocate(self, metas: Sequence[ObjectMeta]) -> list[AllocationRecord]:
        self._check_open()
        return self.writes.allocate(metas)

    def abort(self, allocation_ids: Sequence[str]) -> None:
        self.lease_table.abort(allocation_ids)

    async def commit(
        self, allocation_ids: Sequence[str], durable: bool = False
    ) -> list[ObjectMeta]:
        self._check_open()
        return await self.writes.commit(allocation_ids, durable)

    async def put_bytes(
        self, meta: ObjectMeta, data: memoryview, durable: bool = False
    ) -> ObjectMeta:
        """Store bytes that arrived by stream (not through the arena)."""
        self._check_open()
        return await self.writes.put_bytes(meta, data, durable)

    def learn_card(self, meta: ObjectMeta, data: bytes) -> None:
        self.writes.learn_card(meta, data)

    async def delete(self, keys: Sequence[str], tenant: str | None = None) -> int:
        """Delete objects (only ``tenant``'s when given: a client's delete)."""
        return await self.writes.delete(keys, tenant)

    # -- background --------------------------------------------------------------------------

    async def _reap_forever(self, period_s: float = 1.0) -> None:
        while True:
            await asyncio.sleep(period_s)
            self.lease_table.reap(time.monotonic())
