# Long because it is the one facade servicers call (a method each) and the one place parts are made.
"""The engine: the one place that builds the daemon's parts (the index of contexts and
objects, the lease table, the tier mover, the variant writer, the profiling service and its
parts, the placer and the plan executor) and the one facade the servicers call; each method
delegates to the part that does the work (puts: ``writes.py``, reads: ``reads.py``, operator
actions: ``admin_ops.py``).
Placement decisions come from a :class:`~kvtierd.policies.Placer`; the
:class:`~kvtierd.engine.executor.Executor` carries plans out in the background.

Everything here runs on the daemon's event loop, so index updates need no locks; byte copies
and file I/O run on worker threads inside the tiers. A context's ``lock`` serialises the
moves of its objects against reads that stage them.

Dependencies run one way (each module imports only those above it)::

    state, context_kv, validate, tokens, servable
    index -> leases -> mover -> profiling/ -> placing -> durable, variants -> executor
    -> reads, writes, admin_ops, write_advice, segments -> option_table, views
    -> index_rebuild -> engine
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import secrets
import time
from collections import Counter
from collections.abc import Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from functools import partial
from typing import TYPE_CHECKING

from kvtierd.config import DaemonConfig
from kvtierd.engine.admin_ops import AdminOps
from kvtierd.engine.context_options import ContextOptions
from kvtierd.engine.durable import DurableGuard
from kvtierd.engine.executor import Executor
from kvtierd.engine.in_flight_reports import InFlightReports
from kvtierd.engine.index import ContextIndex
from kvtierd.engine.index_rebuild import adopt_found, rebuild_index
from kvtierd.engine.leases import LeaseTable
from kvtierd.engine.lookup_decision import LookupDecision, decide, restore_share
from kvtierd.engine.margin import decision_margin, room_bytes
from kvtierd.engine.mover import TierMover
from kvtierd.engine.option_table import Option, ReasonSources, placement_reason, utility_table
from kvtierd.engine.placing import Placing
from kvtierd.engine.profiling.ancestor_kv import AncestorReader
from kvtierd.engine.profiling.profile_inputs import ProfileInputs
from kvtierd.engine.profiling.profile_runs import RunLog
from kvtierd.engine.profiling.profiler_factory import make_profiler
from kvtierd.engine.profiling.profiling_model import ProfilingModel, QualityProfiling
from kvtierd.engine.profiling.profiling_parts import ProfilingParts
from kvtierd.engine.profiling.profiling_service import ProfilingService
from kvtierd.engine.profiling.refinement import Refinement
from kvtierd.engine.reads import ReadPath
from kvtierd.engine.servable import Servability, load_cards
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
from kvtierd.engine.tokens import TokenBudget
from kvtierd.engine.tree_joins import TreeJoins, TreePlace
from kvtierd.engine.variant_writer import VariantWriter
from kvtierd.engine.views import (
    ContextProfiling,
    ContextSummary,
    EngineCounts,
    PrefillSpeed,
    ProfilingCounts,
)
from kvtierd.engine.write_advice import WriteAdvice, WriteAdvisor
from kvtierd.engine.writes import WritePath
from kvtierd.errors import (
    ConfigError,
    InvalidArgumentError,
    UnavailableError,
)
from kvtierd.heap import collector_paused
from kvtierd.kernels.placeholder import ModelCard
from kvtierd.metrics import Metrics
from kvtierd.policies.loader import default_policy, load_policy
from kvtierd.policy_config import PolicyConfig
from kvtierd.profiler.prefill_fit import PrefillFit, ServedReports
from kvtierd.profiler.yield_gate import YieldGate
from kvtierd.storage import CpuTier, Tier, create_tier
from kvtierd.storage.allocator import Block
from kvtierd.storage.arena import Arena
from kvtierd.types import DROPPED, ObjectMeta, Plan

if TYPE_CHECKING:
    from kvtierd.profiler import Profiler

logger = logging.getLogger(__name__)

PLACED_PASS_SPACING = 20
"""The pass counting contexts per placement waits this many times its own duration."""


class Engine:
    """One daemon's engine. Its parts are attributes, built here and nowhere else; servicers
    read through the read-only properties (``contexts``, ``objects``, ``leases``, ...) and act
    through the methods, never on the parts."""

    def __init__(self, config: DaemonConfig) -> None:
        self.config = config
        self.instance_id = secrets.token_hex(6)
        self.started_s = time.monotonic()
        self._placed_due_s = 0.0  # when publish_tier_state next counts contexts per placement
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
        spaces = {"": config.namespaces, **{t.name: t.namespaces for t in config.tenants}}
        self.index = ContextIndex(
            {t.name: t.quota_bytes for t in config.tenants},
            {tenant: {n.name: n.quota_bytes for n in ns} for tenant, ns in spaces.items() if ns},
        )
        self.lease_table = LeaseTable(self.instance_id, self.cpu, self.tiers)
        self.in_flight = InFlightReports()  # vLLM's requests, as the routers report them
        tiers, cpu, index, metrics = self.tiers, self.cpu, self.index, self.metrics
        self.mover = TierMover(
            tiers=tiers, cpu=cpu, index=index, leases=self.lease_table, metrics=metrics
        )
        self.profiling = self._wire_profiling(config, index, self.running, metrics)
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
        self.tree_joins = TreeJoins(
            index=index, placing=self.placing, executor=self.executor, profiling=self.profiling,
            tiers=self.tiers,
        )  # fmt: skip
        # The loops between the parts (a read or a profile changes what the placer should
        # do; a forgotten object changes where its context is) close here.
        self.mover.on_forgotten = self._keep_placer_in_step
        self.mover.on_context_gone = self.profiling.forget
        self._reaper: asyncio.Task[None] | None = None

    def _wire_profiling(
        self, config: DaemonConfig, index: ContextIndex, policy: RunningPolicy, metrics: Metrics
    ) -> ProfilingService:
        """The profiling service and the parts it is handed (part of ``__init__``: the engine
        is the one place that builds parts). Its parts ask for the running profiler late
        (``self.profiling.profiler``): it is rebuilt on each policy reload."""

        def profiler() -> Profiler | None:
            return self.profiling.profiler

        tokens = TokenBudget(config.token_bytes_per_tenant)
        servable = Servability(self.model_cards, lambda: policy.current.evaluator_model_dir)
        options = ContextOptions(index=index, policy=policy, servable=servable, profiler=profiler)
        inputs = ProfileInputs(
            index=index, options=options, servable=servable, tokens=tokens, policy=policy,
            profiler=profiler, place_again=self._place_again,
            # (read at each call: self.profiling is built from these parts below)
            profile_again=lambda context_id: self.profiling.schedule(context_id),  # noqa: PLW0108
        )  # fmt: skip
        prefill_fit = PrefillFit()  # kept across policy reloads: it describes vLLM
        yield_gate = YieldGate(self.loads_busy)  # profiling steps wait for serving
        parts = ProfilingParts(
            worker=ThreadPoolExecutor(1, thread_name_prefix="kvtierd-profiler"),
            prefill_fit=prefill_fit, served=ServedReports(prefill_fit), yield_gate=yield_gate,
            run_log=RunLog(), tokens=tokens, servable=servable, options=options, inputs=inputs,
            ancestors=AncestorReader(index=index, mover=self.mover),
            refinement=Refinement(index=index, options=options, policy=policy,
                                  profiler=profiler, margin_of=self._margin),
            model=ProfilingModel(config, self.model_cards),
        )  # fmt: skip
        return ProfilingService(
            config=config, index=index, mover=self.mover, policy=policy, metrics=metrics,
            parts=parts, loads_busy=self.loads_busy, on_profiled=self._place_again,
            make_profiler=partial(make_profiler, config=config, prefill_fit=prefill_fit,
                                  yield_gate=yield_gate, is_busy=self.loads_busy),
        )  # fmt: skip

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

    @property
    def arena(self) -> Arena:
        """The CPU tier's shared-memory arena, where co-located clients read and write."""
        return self.cpu.arena

    def view(self, block: Block) -> memoryview:
        """The arena bytes of ``block`` (an allocation's or a lease's)."""
        return self.cpu.view(block)

    @property
    def placer_name(self) -> str:
        return self.placing.name

    def publish_tier_state(self) -> None:
        """Tier occupancy and the contexts placed per (variant, tier) into the metrics (from
        the health loop, every second); ``kvtierd_placed_contexts`` was never set before."""
        self.mover.publish_tier_state()
        now = time.monotonic()
        if now < self._placed_due_s:
            return
        # One pass over every context: at most ~5% of the event loop's time (at a million
        # contexts a pass takes seconds, and this runs every second: issue 42).
        objects = self.index.objects
        placed: Counter[tuple[str, str | None]] = Counter(
            (c.variant, objects[next(iter(c.keys))].tier) if c.keys else (DROPPED.variant, None)
            for c in self.index.contexts.values()  # ContextIndex.placement_of, without objects
        )
        self.metrics.set_placed_contexts(dict(placed))
        self._placed_due_s = now + PLACED_PASS_SPACING * (time.monotonic() - now)

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
            lookups=dict(self.reads.lookup_outcomes),
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
        """Start the tiers, rebuild the index from what they hold, start the background work.
        The cyclic garbage collector waits meanwhile: the tiers' indexes and the engine's are
        millions of long-lived objects at 1,000,000 stored (issue 42), and each full
        collection the start would trigger walks all of them (~1 s of a 100k-object start);
        the daemon freezes what the start made (``server.main.gc_tuned_after_start``)."""
        with collector_paused():
            await self._start()

    async def _start(self) -> None:
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
        # cards first: one kept from vLLM's last start may name the model profiles read
        self.model_cards.update(load_cards(self.config.data_dir))
        self.profiling.configure()
        await rebuild_index(self.index, self.tiers, self.mover)
        restored = restore_access_times(self.index, self.config.data_dir)
        adopt_found(self.index, self.executor, self.placing, restored > 0)
        self.executor.start()
        self.profiling.start()
        self._reaper = asyncio.create_task(self._reap_forever(), name="kvtierd-reaper")

    async def close(self, flush_s: float = 0.0) -> None:
        """Stop; ``flush_s`` > 0 (a graceful stop) first writes the CPU tier's hottest
        contexts to the SSD tier for at most that long (``shutdown_flush``)."""
        self.draining = True
        if self._reaper is not None:
            self._reaper.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._reaper
        await self.placing.close()
        await self.executor.close()
        await self.profiling.close()
        await self.reads.shared.close()
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
        room = room_bytes(profile, chosen, tiers, placing.placer.used_bytes())
        return decision_margin(profile, chosen, tiers, self.running.current.alpha, room)

    def loads_busy(self) -> bool:
        """Requests are being served — the daemon's own reads (``ReadPath.busy``), or vLLM's
        requests in flight as the routers report them (``in_flight_reports.py``): background
        profiling waits."""
        return self.reads.busy or self.in_flight.busy

    # -- reads and operator actions (ReadPath, AdminOps) ----------------------------------------

    async def lookup(
        self, keys: Sequence[str], hold_s: float = 0.0, tenant: str = ""
    ) -> tuple[list[ObjectRecord | None], int]:
        return await self.reads.lookup(keys, hold_s, tenant)

    def lookup_decision(self, found: Sequence[ObjectRecord | None]) -> LookupDecision:
        """Of a lookup's found prefix, the chunks to load (``lookup_decision.py``), priced as
        the placer prices them; counted in ``kvtierd_lookup_decisions``."""
        prefix = next((i for i, f in enumerate(found) if f is None), len(found))
        held = [f for f in found[:prefix] if f is not None]
        options = self.profiling.options
        per_context: dict[str, tuple[int, float | None]] = {}  # a lookup's chunks share few

        def restore_s(rec: ObjectRecord) -> float:
            cid = rec.meta.context
            if cid not in per_context:
                ctx = self.index.contexts.get(cid)
                known = None if ctx is None else options.profiled(cid).get(ctx.variant)
                per_context[cid] = (0 if ctx is None else ctx.size_bytes,
                                    known.restore_s if known else None)  # fmt: skip
            return restore_share(rec, *per_context[cid])

        decision = decide(
            held,
            self.placing.tier_models(),
            restore_s=restore_s,
            prefill_tokens_per_s=self.profiling.prefill_tokens_per_s(),
            mode=self.config.lookup_decision,
        )
        if decision.decision:
            self.metrics.record_lookup_decision(decision.decision)
        return decision

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

    # -- the context tree, write advice and profiling (for the servicers) --------------------

    async def join(
        self, tenant: str, proposed: str, after_key: str, *, save: bool = True
    ) -> TreePlace:
        """The context a put joins (``tree_joins.py``): ``proposed``, or the context of the
        chunk ``after_key`` it follows; with ``save`` false, its split is persistent only
        once :meth:`save_joins` returns (one save for a batch of joins)."""
        return await self.tree_joins.resolve(tenant, proposed, after_key, save=save)

    async def save_joins(self) -> None:
        await self.tree_joins.save()

    def advise(
        self, context_id: str, num_tokens: int, size_bytes: int, tenant: str = ""
    ) -> WriteAdvice:
        return self.write_advisor.advise(context_id, num_tokens, size_bytes, tenant)

    def ancestors(self, ctx: ContextRecord) -> list[str]:
        return self.index.ancestors(ctx)

    def descendants(self, ctx: ContextRecord, limit: int) -> list[ContextRecord]:
        """The contexts under ``ctx``, children first (breadth first), at most ``limit``."""
        index = self.index
        out: list[ContextRecord] = []
        level = [ctx]
        while level and len(out) < limit:
            kids = [index.contexts[k] for c in level
                    for k in sorted(index.children.get(c.context_id, ()))
                    if k in index.contexts]  # fmt: skip
            out.extend(kids)
            level = kids
        return out[:limit]

    def options_of(self, ctx: ContextRecord) -> list[Option]:
        """Every placement ``ctx`` could take, priced, best first (``option_table.py``)."""
        return utility_table(self.placing, self.running.current.alpha, ctx)

    def placement_reason(self, ctx: ContextRecord, table: list[Option]) -> str:
        sources = ReasonSources(self.index, self.placing, self.profiling, self.running.current)
        return placement_reason(sources, ctx, table)

    async def add_queries(
        self, context_id: str, tenant: str, texts: Sequence[str], from_traffic: bool
    ) -> int:
        """Store profiling queries of a context, charged to ``tenant``'s token budget."""
        inputs = self.profiling.inputs
        inputs.charge_queries(context_id, tenant, sum(len(t.encode()) for t in texts))
        return await inputs.add_queries(context_id, list(texts), from_traffic)

    def tokens_set_aside(self, context_id: str) -> int:
        """How many token ids are kept for ``context_id`` since it was dropped (a prompt may
        still link to it: ``ProfileInputs.set_aside``)."""
        return self.profiling.inputs.set_aside_tokens(context_id)

    async def set_tokens(self, context_id: str, token_ids: Sequence[int]) -> None:
        await self.profiling.inputs.set_tokens(context_id, token_ids)

    def note_prompt(self, tenant: str, request_id: str, token_ids: Sequence[int]) -> None:
        self.profiling.inputs.note_prompt(tenant, request_id, token_ids)

    async def link_prompt(self, context_id: str, request_id: str) -> None:
        await self.profiling.inputs.link_prompt(context_id, request_id)

    def observe_served(
        self, prompt_tokens: int, cached_tokens: int, ttft_s: float, tenant: str = ""
    ) -> bool:
        return self.profiling.observe_served(prompt_tokens, cached_tokens, ttft_s, tenant)

    def prefill_tokens_per_s(self, tenant: str = "") -> float:
        return self.profiling.prefill_tokens_per_s(tenant)

    def prefill_speed(self) -> PrefillSpeed:
        learned = self.profiling.prefill_fit.estimate()
        return PrefillSpeed(
            tokens_per_s=self.profiling.prefill_tokens_per_s(),
            samples=self.profiling.prefill_fit.samples,
            overhead_s=learned.overhead_s if learned is not None else 0.0,
            learned=learned is not None,
        )

    def report_in_flight(self, tenant: str, reporter: str, in_flight: int) -> float:
        """A router's requests in flight at vLLM (``in_flight_reports.py``); returns how long the
        report holds."""
        self.in_flight.report(tenant, reporter, in_flight)
        return self.in_flight.hold_s

    async def profile(self, ctx: ContextRecord) -> str:
        """Profile ``ctx`` now; "" when it worked, else why not."""
        if await self.profiling.profile_context(ctx):
            return ""
        # a context with nothing to choose between is not run at all: no last_error of its own
        why = self.profiling.options.unchoosable(ctx)
        if why:
            return f"context {ctx.context_id}: {why}"
        return self.profiling.last_error

    def profiling_counts(self) -> ProfilingCounts:
        p = self.profiling
        return ProfilingCounts(
            runs_ok=p.runs["ok"], runs_failed=p.runs["failed"], reprofiled=p.reprofiled,
            last_error=p.last_error, runs=tuple(p.run_log.runs()),
        )  # fmt: skip

    def quality_profiling(self) -> QualityProfiling:
        """How the running policy's quality profiles are made: with which model, or from the
        prior alone (``profiling_model.py``)."""
        return self.profiling.quality()

    def context_profiling(self, context_id: str) -> ContextProfiling:
        p = self.profiling
        return ContextProfiling(
            upcoming=p.inputs.upcoming(context_id),
            record=p.record(context_id),
            trusted=p.profiler is not None and p.profiler.trusted(context_id),
        )

    def problems(self) -> list[str]:
        """Why the daemon is not serving (empty: it is)."""
        found = []
        if self.draining:
            found.append("draining")
        if not self.executor.healthy:
            found.append(f"plan executor failed: {self.executor.error!r}")
        if not self.profiling.healthy:
            found.append("profiling task stopped")
        for tier in self.tiers.values():
            stats = tier.stats()
            if not stats.healthy:
                found.append(f"tier {tier.name} unhealthy: {stats.detail}")
        return found

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
