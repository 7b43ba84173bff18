"""The read path: lookups (with shared tiers asked on a miss), leases over arena blocks, and
access recording (what the placer and the profiler learn from reads)."""

from __future__ import annotations

import math
import time
from collections import Counter
from collections.abc import Sequence

from kvtierd.engine.durable import DurableGuard
from kvtierd.engine.executor import Executor
from kvtierd.engine.index import ContextIndex
from kvtierd.engine.leases import LeaseTable
from kvtierd.engine.mover import TierMover
from kvtierd.engine.placing import Placing
from kvtierd.engine.profiling.profiling_service import ProfilingService
from kvtierd.engine.shared_lookups import SharedLookups
from kvtierd.engine.state import ContextRecord, LeaseRecord, ObjectRecord
from kvtierd.engine.views import LookupOutcome
from kvtierd.errors import KvtierError, NotFoundError
from kvtierd.metrics import Metrics
from kvtierd.storage import Tier
from kvtierd.storage.pooled import PooledTier


class ReadPath:
    """Lookups, gets and touches of the objects in ``index``; counts hits and misses.
    ``quiet_s``: how long after a Lookup or Get the engine counts as serving (:attr:`busy`)."""

    def __init__(
        self,
        *,
        index: ContextIndex,
        leases: LeaseTable,
        mover: TierMover,
        placing: Placing,
        durable: DurableGuard,
        executor: Executor,
        profiling: ProfilingService,
        metrics: Metrics,
        quiet_s: float,
    ) -> None:
        self._index = index
        self._leases = leases
        self._mover = mover
        self._placing = placing
        self._durable = durable
        self._executor = executor
        self._profiling = profiling
        self._metrics = metrics
        self._shared = [t for t in mover.tiers.values() if t.shared]
        self.shared = SharedLookups(self._shared, self._fetch_one)
        self.hits = 0
        self.misses = 0  # chunks: reads that found nothing, and served lookups' unfound chunks
        self.lookup_outcomes: Counter[LookupOutcome] = Counter()
        self.tier_hits: Counter[str] = Counter()
        self.loads_in_flight = 0
        self.last_read_s = -math.inf  # monotonic time of the newest Lookup or Get
        self._quiet_s = quiet_s

    @property
    def busy(self) -> bool:
        """Requests are being served — a Get in flight, a client still reading under a lease,
        or a Lookup or Get within ``quiet_s`` (``profile_quiet_s``: vLLM computes
        the rest of the prompt and decodes after its loads): background profiling waits
        (EvicPress §4.3: only with free cycles; ``profiler/yield_gate.py``)."""
        if self.loads_in_flight > 0 or self._leases.busy:
            return True
        return time.monotonic() - self.last_read_s < self._quiet_s

    async def lookup(
        self, keys: Sequence[str], hold_s: float = 0.0, tenant: str = ""
    ) -> tuple[list[ObjectRecord | None], int]:
        now = self.last_read_s = time.monotonic()
        found = self._index.owned_all(keys, tenant)
        if self._shared:
            self.shared.forget_unusable(found)
            if None in found:
                await self.shared.fetch_missing(keys, found, tenant)
        prefix = next((i for i, f in enumerate(found) if f is None), len(found))
        if hold_s > 0:
            for rec in found:
                if rec is not None:
                    ctx = self._index.contexts[rec.meta.context]
                    ctx.hold_until_s = max(ctx.hold_until_s, now + hold_s)
        return found, prefix

    def record_request_lookup(self, asked: int, prefix: int) -> LookupOutcome:
        """A served request's lookup of ``asked`` chunks found its first ``prefix``: counted by
        outcome, and the chunks after the prefix (the request recomputes them) as misses. Only
        reads counted before (issue 41): a request that found nothing was no miss at all."""
        outcome = LookupOutcome.of(asked, prefix)
        self.lookup_outcomes[outcome] += 1
        self.misses += asked - prefix
        self._metrics.record_lookup(outcome.value, asked - prefix)
        return outcome

    async def _fetch_shared(self, key: str, tenant: str) -> ObjectRecord | None:
        """An object another daemon stored in a shared tier since this one started (a tier
        whose breaker is open is not asked: shared_lookups.py)."""
        for tier in self._shared:
            if self.shared.usable(tier):
                rec = await self._fetch_one(tier, key, tenant)
                if rec is not None:
                    return rec
        return None

    async def _fetch_one(self, tier: Tier, key: str, tenant: str) -> ObjectRecord | None:
        """Ask one shared tier about ``key``; index what it holds."""
        try:
            meta = await tier.fetch_meta(key, tenant=tenant)
        except KvtierError:
            return None  # a miss, or the tier is unreachable: a miss either way
        if key in self._index.objects:  # found meanwhile by a concurrent call
            return self._index.owned(key, tenant)  # (or another tenant's)
        rec = ObjectRecord(meta, tier.name, durable=True, unread=meta.durable)
        ctx = self._index.add(rec, key)
        self._executor.submit(self._placing.adopt_where_it_is(ctx))
        return rec

    async def get(
        self, keys: Sequence[str], lease_s: float, tenant: str = "", device_ok: bool = False
    ) -> list[LeaseRecord]:
        """A lease per key on a block holding the object's bytes: in the arena (the CPU tier's
        own block, or a copy staged from a slower tier), or — with ``device_ok``, for an
        object in a gpu tier — its block in that tier's CUDA pool, in place."""
        leases: list[LeaseRecord] = []
        self.last_read_s = time.monotonic()
        self.loads_in_flight += 1
        try:
            for key in keys:
                if key not in self._index.objects and self._shared:
                    await self._fetch_shared(key, tenant)
                leases.append(await self._lease_one(key, lease_s, device_ok, tenant))
        except BaseException:
            self._leases.release([lease.lease_id for lease in leases])
            raise
        finally:
            self.loads_in_flight -= 1
        for ctx_id in dict.fromkeys(lease.meta.context for lease in leases):
            self._record_access(self._index.contexts[ctx_id])
        return leases

    async def _lease_one(
        self, key: str, lease_s: float, device_ok: bool, tenant: str
    ) -> LeaseRecord:
        started = time.perf_counter()
        obj = self._index.owned(key, tenant)
        if obj is None:
            self.misses += 1
            self._metrics.record_miss()
            raise NotFoundError(f"object {key!r} not found")
        ctx = self._index.contexts[obj.meta.context]
        cpu = self._mover.cpu
        async with ctx.lock:
            obj = self._index.record_of(key)
            if obj is None:
                raise NotFoundError(f"object {key!r} was removed while being read")
            tier = self._mover.tiers[obj.tier]
            staged = not (tier is cpu or (device_ok and isinstance(tier, PooledTier)))
            if staged:
                pool, block = cpu.name, await self._mover.stage_from(obj)
            else:
                assert isinstance(tier, PooledTier)
                pool, block = obj.tier, tier.block_of(obj.meta.key)
        lease = self._leases.lease(obj.meta, obj.tier, pool, block, lease_s, staged=staged)
        if obj.unread:  # read once: from now on the placer may drop it (durable.py)
            obj.unread = False
            self._executor.submit(self._durable.note_read(ctx))
        self.hits += 1
        self.tier_hits[obj.tier] += 1
        self._metrics.record_hit(obj.tier)
        self._metrics.observe_load(obj.tier, time.perf_counter() - started, obj.meta.size_bytes)
        return lease

    def touch(self, keys: Sequence[str], tenant: str = "") -> int:
        owned = (self._index.owned(k, tenant) for k in keys)
        touched = {o.meta.context for o in owned if o is not None}
        for ctx_id in touched:
            self._record_access(self._index.contexts[ctx_id])
        return len(touched)

    def _record_access(self, ctx: ContextRecord) -> None:
        now = time.monotonic()
        ctx.hits += 1
        ctx.last_access_s = now
        self._profiling.note_access(ctx.context_id)
        if ctx.durable_held or not self._placing.target(ctx.context_id).dropped:
            self._executor.submit(self._placing.access(ctx.context_id, now))
        else:
            # A context the placer dropped, still here while a hold defers its drop
            # (executor.py), is used again: the placer places it again and counts its bytes.
            self._executor.submit(self._placing.insert(ctx))
