"""The ``Admin`` servicer: status, tiers, contexts, evict/pin/drain, rebalance, policy."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

from kvtierd import __version__
from kvtierd.engine import Engine
from kvtierd.engine.views import ContextSummary, LookupOutcome
from kvtierd.errors import InvalidArgumentError, NotFoundError
from kvtierd.model_dirs import allowed_model_roots, check_model_dir
from kvtierd.policies.loader import parse_policy
from kvtierd.rpc import kvtier_pb2 as pb
from kvtierd.rpc import kvtier_pb2_grpc as pb_grpc
from kvtierd.server.convert import profile_provenance, record_info
from kvtierd.server.health import HealthMonitor
from kvtierd.server.identity import Caller
from kvtierd.types import OpKind

MAX_DESCENDANTS = 256
"""Descendants ``DescribeContext`` lists (a shared system prompt may have thousands)."""

_ORDERS: dict[str, Callable[[ContextSummary], Any]] = {
    "recency": lambda c: -c.last_access_s,
    "frequency": lambda c: -c.hits,
    "size": lambda c: -c.size_bytes,
    "id": lambda c: c.context_id,
}


class AdminServicer(pb_grpc.AdminServicer):
    def __init__(self, engine: Engine, health: HealthMonitor) -> None:
        self.engine = engine
        self.health = health
        # what ApplyPolicy may name as profiling.model_dir (kvtierd/model_dirs.py)
        self._model_dirs = allowed_model_roots(engine.config.model_dirs)
        self._started_model_dir = engine.policy.evaluator_model_dir

    def _summary(self, s: ContextSummary) -> pb.ContextSummary:
        return pb.ContextSummary(
            context_id=s.context_id,
            variant=s.variant,
            tier=s.tier,
            size_bytes=s.size_bytes,
            objects=s.objects,
            frequency=s.frequency,
            last_access_age_s=max(0.0, time.monotonic() - s.last_access_s),
            pinned=s.pinned,
            hits=s.hits,
            durable_unread=s.durable_unread,
            durable_held=s.durable_held,
            parent_context_id=s.parent,
            children=s.children,
            token_drop_refused=s.token_drop_refused,
        )

    async def Status(self, request: pb.StatusRequest, rpc_context: Any) -> pb.StatusResponse:
        c = self.engine.counts()
        return pb.StatusResponse(
            version=__version__,
            instance_id=c.instance_id,
            uptime_s=c.uptime_s,
            placer=c.placer,
            contexts=c.contexts,
            objects=c.objects,
            leases=c.leases,
            allocations=c.allocations,
            draining=c.draining,
            health=self.health.describe(),
            hits=c.hits,
            misses=c.misses,
            lookups_hit=c.lookups.get(LookupOutcome.HIT, 0),
            lookups_partial=c.lookups.get(LookupOutcome.PARTIAL, 0),
            lookups_missed=c.lookups.get(LookupOutcome.MISS, 0),
            pending_plans=c.pending_plans,
            durable_holds=c.durable_holds,
            **_prefill_fields(self.engine),
            quality=_quality(self.engine),
        )

    async def ListTiers(
        self, request: pb.ListTiersRequest, rpc_context: Any
    ) -> pb.ListTiersResponse:
        tiers = []
        for tier in self.engine.tiers.values():
            s = tier.stats()
            tiers.append(
                pb.TierInfo(
                    name=s.name,
                    kind=tier.kind,
                    capacity_bytes=s.capacity_bytes,
                    used_bytes=s.used_bytes,
                    object_count=s.object_count,
                    read_bandwidth_bytes_per_s=s.read_bandwidth_bytes_per_s,
                    read_overhead_s=tier.read_meter.overhead_s,
                    write_bandwidth_bytes_per_s=s.write_bandwidth_bytes_per_s,
                    fragmentation=s.fragmentation,
                    healthy=s.healthy,
                    hits=self.engine.tier_hits.get(s.name, 0),
                    detail=s.detail,
                )
            )
        return pb.ListTiersResponse(tiers=tiers)

    async def ListContexts(
        self, request: pb.ListContextsRequest, rpc_context: Any
    ) -> pb.ListContextsResponse:
        order = request.order_by or "recency"
        if order not in _ORDERS:
            raise InvalidArgumentError(
                f"order_by {order!r} is not one of: {', '.join(sorted(_ORDERS))}"
            )
        if request.tier and request.tier not in self.engine.tiers:
            known = ", ".join(self.engine.tiers)
            raise NotFoundError(f"no tier {request.tier!r}; tiers: {known}")
        ctxs = self.engine.summaries(request.tier)
        ctxs.sort(key=_ORDERS[order])
        if request.limit:
            ctxs = ctxs[: request.limit]
        return pb.ListContextsResponse(contexts=[self._summary(c) for c in ctxs])

    async def DescribeContext(
        self, request: pb.DescribeContextRequest, rpc_context: Any
    ) -> pb.DescribeContextResponse:
        ctx = self.engine.contexts.get(request.context_id)
        if ctx is None:
            raise NotFoundError(f"context {request.context_id!r} not found")
        objects = [record_info(self.engine.objects[k], Caller()) for k in ctx.keys]
        table = self.engine.options_of(ctx)
        record = self.engine.context_profiling(ctx.context_id).record
        return pb.DescribeContextResponse(
            summary=self._summary(self.engine.summary(ctx)),
            objects=objects,
            options=[
                pb.PlacementOption(
                    variant=o.variant,
                    tier=o.tier,
                    size_bytes=o.size_bytes,
                    quality=o.quality,
                    ttft_s=o.ttft_s,
                    utility=o.utility,
                )
                for o in table
            ],
            reason=self.engine.placement_reason(ctx, table),
            ancestors=self.engine.ancestors(ctx),
            descendants=[
                self._summary(self.engine.summary(d))
                for d in self.engine.descendants(ctx, MAX_DESCENDANTS)
            ],
            profile=None if record is None else profile_provenance(record),
        )

    async def Evict(self, request: pb.EvictRequest, rpc_context: Any) -> pb.EvictResponse:
        return pb.EvictResponse(evicted=await self.engine.evict(request.context_ids))

    async def Pin(self, request: pb.PinRequest, rpc_context: Any) -> pb.PinResponse:
        return pb.PinResponse(changed=self.engine.set_pinned(request.context_ids, True))

    async def Unpin(self, request: pb.PinRequest, rpc_context: Any) -> pb.PinResponse:
        return pb.PinResponse(changed=self.engine.set_pinned(request.context_ids, False))

    async def Drain(self, request: pb.DrainRequest, rpc_context: Any) -> pb.DrainResponse:
        moved, dropped = await self.engine.drain(request.tier)
        return pb.DrainResponse(moved=moved, dropped=dropped)

    async def GetPolicy(self, request: pb.PolicyRequest, rpc_context: Any) -> pb.PolicyResponse:
        p = self.engine.policy
        return pb.PolicyResponse(name=p.name, yaml=p.text, source=p.source)

    async def ApplyPolicy(
        self, request: pb.ApplyPolicyRequest, rpc_context: Any
    ) -> pb.PolicyResponse:
        policy = parse_policy(request.yaml, request.source or "policy")
        check_model_dir(policy.evaluator_model_dir, self._model_dirs, self._started_model_dir)
        if not request.dry_run:
            await self.engine.apply_policy(policy)
        return pb.PolicyResponse(name=policy.name, yaml=policy.text, source=policy.source)

    async def Profile(self, request: pb.ProfileRequest, rpc_context: Any) -> pb.ProfileResponse:
        ids = list(request.context_ids) or list(self.engine.contexts)
        for cid in ids:
            if cid not in self.engine.contexts:
                raise NotFoundError(f"context {cid!r} not found")
        ok = failed = 0
        errors = []
        for cid in ids:
            ctx = self.engine.contexts.get(cid)
            if ctx is None:
                continue
            why_not = await self.engine.profile(ctx)
            if not why_not:
                ok += 1
            else:
                failed += 1
                errors.append(why_not)
        return pb.ProfileResponse(profiled=ok, failed=failed, errors=errors)

    async def ProfileStatus(
        self, request: pb.ProfileStatusRequest, rpc_context: Any
    ) -> pb.ProfileStatusResponse:
        p = self.engine.profiling_counts()
        resp = pb.ProfileStatusResponse(
            evaluator=self.engine.policy.evaluator,
            runs_ok=p.runs_ok,
            runs_failed=p.runs_failed,
            reprofiled=p.reprofiled,
            last_error=p.last_error,
            estimator=self.engine.policy.estimator,
        )
        if not request.context_id:  # the daemon's newest runs (engine/profiling/profile_runs.py)
            resp.runs.extend(
                pb.ProfileRun(context_id=r.context_id, evaluator=r.evaluator, kind=r.kind.value,
                              started_unix_s=r.started_unix_s, ended_unix_s=r.ended_unix_s,
                              waited_s=r.waited_s, ok=r.ok)
                for r in p.runs
            )  # fmt: skip
        if request.context_id:
            if request.context_id not in self.engine.contexts:
                raise NotFoundError(f"context {request.context_id!r} not found")
            c = self.engine.context_profiling(request.context_id)
            if c.upcoming is not None:
                resp.next_query_source, resp.next_num_queries, resp.known_tokens = c.upcoming
            record = c.record
            resp.min_queries = self.engine.policy.min_queries
            if record is not None:
                resp.profiled = True
                resp.trusted = c.trusted
                resp.profiled_age_s = max(0.0, time.time() - record.profiled_at_s)
                resp.num_queries = record.num_queries
                resp.query_source = record.query_source
                resp.reading = record.reading.value
                resp.profile_evaluator = record.evaluator
                resp.variants.extend(
                    pb.VariantQuality(
                        variant=v.variant,
                        size_bytes=v.size_bytes,
                        quality=v.quality,
                        restore_s=v.restore_s,
                    )
                    for v in record.profile.variants
                )
        return resp

    async def Rebalance(
        self, request: pb.RebalanceRequest, rpc_context: Any
    ) -> pb.RebalanceResponse:
        plan = await self.engine.rebalance()
        kinds = [op.kind for op in plan.operations]
        return pb.RebalanceResponse(
            operations=len(kinds),
            moved=kinds.count(OpKind.MOVE),
            dropped=kinds.count(OpKind.DROP),
            compressed=kinds.count(OpKind.COMPRESS),
        )


def _prefill_fields(e: Engine) -> dict[str, Any]:
    """The TTFT model's prefill speed (learned from served requests, or configured), the
    prefill samples served requests gave, and the fitted fixed cost per request."""
    speed = e.prefill_speed()
    return {
        "prefill_tokens_per_s": speed.tokens_per_s,
        "prefill_samples": speed.samples,
        "prefill_overhead_s": speed.overhead_s,
        "prefill_learned": speed.learned,
    }


def _quality(e: Engine) -> pb.QualityProfiling:
    """How the running policy's quality profiles are made (issue 39)."""
    q = e.quality_profiling()
    return pb.QualityProfiling(estimator=q.estimator, refiner=q.refiner, model_dir=q.model_dir,
                               model_dir_from=q.model_from, prior_only=q.prior_only)  # fmt: skip
