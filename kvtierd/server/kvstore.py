"""The ``KVStore`` servicer: translates requests to engine calls and results to replies."""

from __future__ import annotations

import logging
import math
from collections.abc import AsyncIterator
from typing import Any

from kvtierd.config import MAX_LEASE_S
from kvtierd.engine import Engine
from kvtierd.engine.state import LeaseRecord
from kvtierd.engine.tokens import check_request_tokens
from kvtierd.engine.validate import MAX_KEY_BYTES
from kvtierd.errors import InvalidArgumentError, NotFoundError, PermissionDeniedError
from kvtierd.policies.tree_placement import MAX_DEPTH
from kvtierd.rpc import kvtier_pb2 as pb
from kvtierd.rpc import kvtier_pb2_grpc as pb_grpc
from kvtierd.rpc.framing import data_frame
from kvtierd.server.convert import device_region, info, meta_from_spec, region
from kvtierd.server.identity import CALLER, Caller
from kvtierd.storage.gpu import GpuTier

logger = logging.getLogger(__name__)

DEFAULT_PART_BYTES = 4 << 20
MIN_PART_BYTES = 64 << 10  # part_bytes=1 sent 65,537 messages for a 64 KiB object
MAX_PART_BYTES = 16 << 20
MAX_BATCH = 100_000
MAX_QUERIES_PER_REQUEST = 1000  # kvtierctl queries add batches by the same number
MAX_QUERY_TEXT_BYTES = 16 << 10  # a profiling query is a question, not a document
MAX_ID_BYTES = 1024  # a request id or context id, as object keys (engine/validate.py)


def _check_batch(n: int, what: str) -> None:
    if n == 0:
        raise InvalidArgumentError(f"{what}: the request names no keys")
    if n > MAX_BATCH:
        raise InvalidArgumentError(f"{what}: {n} keys in one request; at most {MAX_BATCH}")


def _check_advise(request: pb.AdviseRequest) -> None:
    """Every query of an Advise checked before any is answered: a bad one refuses the request
    before a split of an earlier one is made."""
    _check_batch(len(request.contexts), "Advise")
    splits = sum(bool(q.after_key) for q in request.contexts)
    if splits > MAX_DEPTH:
        # what one context can split into: every query with an after_key may split one
        # (tree_joins.py), and a chain of splits is at most MAX_DEPTH deep (issue 40.4)
        raise InvalidArgumentError(
            f"Advise: {splits} queries with an after_key in one request; at most {MAX_DEPTH}"
        )
    for q in request.contexts:
        if not q.context_id:
            raise InvalidArgumentError("Advise: every query needs a context_id")
        if len(q.after_key.encode()) > MAX_KEY_BYTES or "\x00" in q.after_key:
            raise InvalidArgumentError(
                f"Advise: after_key must be at most {MAX_KEY_BYTES} bytes, without NUL"
            )


def _check_seconds(value: float, what: str) -> None:
    """A lease or hold: 0 (the default) up to an hour, never NaN or infinite (a lease of
    1e300 s never expired, and a hold that long kept a context from eviction for good)."""
    if not (math.isfinite(value) and 0 <= value <= MAX_LEASE_S):
        raise InvalidArgumentError(
            f"{what} must be between 0 and {MAX_LEASE_S:g} seconds, got {value!r}"
        )


class KVStoreServicer(pb_grpc.KVStoreServicer):
    def __init__(self, engine: Engine) -> None:
        self.engine = engine
        self._plan_called = False  # the deprecated Plan is logged once per daemon

    async def Lookup(self, request: pb.LookupRequest, rpc_context: Any) -> pb.LookupResponse:
        _check_batch(len(request.keys), "Lookup")
        _check_seconds(request.hold_s, "Lookup: hold_s")
        caller = CALLER.get()
        keys = caller.scoped_all(request.keys)
        found, prefix = await self.engine.lookup(keys, request.hold_s, caller.tenant)
        if request.request and keys:
            self.engine.reads.record_request_lookup(len(keys), prefix)
        index = self.engine.tier_index
        resp = pb.LookupResponse(prefix_hits=prefix, tiers=list(index))
        resp.found.extend([f is not None for f in found])
        resp.tier_index.extend([index[f.tier] if f is not None else 0 for f in found])
        resp.size_bytes.extend([f.meta.size_bytes if f is not None else 0 for f in found])
        if request.decide:
            decision = self.engine.lookup_decision(found)
            resp.load_chunks, resp.decision = decision.chunks, decision.decision
            resp.reason = decision.reason
        return resp

    async def Allocate(self, request: pb.AllocateRequest, rpc_context: Any) -> pb.AllocateResponse:
        _check_batch(len(request.objects), "Allocate")
        caller = CALLER.get()
        recs = self.engine.allocate([meta_from_spec(s, caller) for s in request.objects])
        arena = self.engine.arena
        return pb.AllocateResponse(
            allocations=[
                pb.Allocation(allocation_id=r.allocation_id, region=region(arena, r.block))
                for r in recs
            ]
        )

    async def Commit(self, request: pb.CommitRequest, rpc_context: Any) -> pb.CommitResponse:
        _check_batch(len(request.allocation_ids), "Commit")
        caller = CALLER.get()
        self._own_allocations(request.allocation_ids, caller)
        metas = await self.engine.commit(request.allocation_ids, request.durable)
        # A model card is kept by the engine, not as an object: reported in no tier.
        objects = self.engine.objects
        infos = [info(m, objects[m.key].tier if m.key in objects else "", caller) for m in metas]
        return pb.CommitResponse(objects=infos)

    def _own_allocations(self, allocation_ids: Any, caller: Caller) -> None:
        for aid in allocation_ids:
            rec = self.engine.allocations.get(aid)
            if rec is not None and rec.meta.tenant != caller.tenant:
                raise PermissionDeniedError(f"allocation {aid!r} belongs to another tenant")

    async def Abort(self, request: pb.AbortRequest, rpc_context: Any) -> pb.AbortResponse:
        self._own_allocations(request.allocation_ids, CALLER.get())
        self.engine.abort(request.allocation_ids)
        return pb.AbortResponse()

    async def Get(self, request: pb.GetRequest, rpc_context: Any) -> pb.GetResponse:
        _check_batch(len(request.keys), "Get")
        _check_seconds(request.lease_s, "Get: lease_s")
        caller = CALLER.get()
        keys = [caller.scoped(k) for k in request.keys]
        leases = await self.engine.get(keys, request.lease_s, caller.tenant, request.device_ok)
        lease_s = request.lease_s or self.engine.config.lease_s
        return pb.GetResponse(leases=[self._lease(lease, lease_s, caller) for lease in leases])

    def _lease(self, lease: LeaseRecord, lease_s: float, caller: Caller) -> pb.Lease:
        out = pb.Lease(
            lease_id=lease.lease_id,
            object=info(lease.meta, lease.tier, caller),
            expires_in_s=lease_s,
        )
        pool = self.engine.tiers[lease.pool]
        if isinstance(pool, GpuTier):
            out.device.CopyFrom(device_region(pool, lease.block))
        else:
            out.region.CopyFrom(region(self.engine.arena, lease.block))
        return out

    async def Release(self, request: pb.ReleaseRequest, rpc_context: Any) -> pb.ReleaseResponse:
        caller = CALLER.get()
        for lid in request.lease_ids:
            lease = self.engine.leases.get(lid)
            if lease is not None and lease.meta.tenant != caller.tenant:
                raise PermissionDeniedError(f"lease {lid!r} belongs to another tenant")
        self.engine.release(request.lease_ids)
        return pb.ReleaseResponse()

    async def PutStream(
        self, request_iterator: AsyncIterator[pb.PutPart], rpc_context: Any
    ) -> pb.PutResponse:
        first = await anext(aiter(request_iterator), None)
        if first is None or not first.HasField("spec"):
            raise InvalidArgumentError("PutStream: the first message must carry the object spec")
        caller = CALLER.get()
        (rec,) = self.engine.allocate([meta_from_spec(first.spec, caller)])
        try:
            view = self.engine.view(rec.block)
            filled = 0
            async for part in request_iterator:
                if part.HasField("spec") or part.durable:
                    raise InvalidArgumentError(
                        "PutStream: spec and durable belong in the first message only"
                    )
                n = len(part.data)
                if filled + n > len(view):
                    raise InvalidArgumentError(
                        f"PutStream: more than the {len(view)} bytes the spec announced"
                    )
                view[filled : filled + n] = part.data
                filled += n
            if filled != len(view):
                raise InvalidArgumentError(
                    f"PutStream: stream ended after {filled} of {len(view)} bytes"
                )
        except BaseException:
            # Includes the client going away mid-stream (cancellation): nothing partial stays.
            self.engine.abort([rec.allocation_id])
            raise
        (meta,) = await self.engine.commit([rec.allocation_id], first.durable)
        # A model card is kept by the engine, not as an object: reported in no tier (looking
        # it up among the objects answered INTERNAL for a card that was kept, issue 27.3).
        stored = self.engine.objects.get(meta.key)
        return pb.PutResponse(object=info(meta, stored.tier if stored else "", caller))

    # Yields pre-serialized data frames next to messages (see data_frame).
    async def GetStream(  # type: ignore[override]
        self, request: pb.GetStreamRequest, rpc_context: Any
    ) -> AsyncIterator[pb.GetPart | bytes]:
        part = request.part_bytes or DEFAULT_PART_BYTES
        if not MIN_PART_BYTES <= part <= MAX_PART_BYTES:
            raise InvalidArgumentError(
                f"GetStream: part_bytes must be 0 ({DEFAULT_PART_BYTES} bytes) or between "
                f"{MIN_PART_BYTES} and {MAX_PART_BYTES}, got {part}"
            )
        caller = CALLER.get()
        (lease,) = await self.engine.get([caller.scoped(request.key)], tenant=caller.tenant)
        try:
            yield pb.GetPart(info=info(lease.meta, lease.tier, caller))
            view = self.engine.view(lease.block)
            for start in range(0, len(view), part):
                yield data_frame(view[start : start + part])
        finally:
            self.engine.release([lease.lease_id])

    async def Delete(self, request: pb.DeleteRequest, rpc_context: Any) -> pb.DeleteResponse:
        _check_batch(len(request.keys), "Delete")
        caller = CALLER.get()
        keys = [caller.scoped(k) for k in request.keys]
        deleted = await self.engine.delete(keys, caller.tenant)
        return pb.DeleteResponse(deleted=deleted)

    async def AddQueries(
        self, request: pb.AddQueriesRequest, rpc_context: Any
    ) -> pb.AddQueriesResponse:
        caller = CALLER.get()
        cid = caller.scoped(request.context_id)
        if cid not in self.engine.contexts:
            raise NotFoundError(f"context {request.context_id!r} not found")
        if len(request.texts) > MAX_QUERIES_PER_REQUEST:
            raise InvalidArgumentError(
                f"AddQueries: at most {MAX_QUERIES_PER_REQUEST} queries per request"
            )
        sizes = [len(t.encode()) for t in request.texts]
        if max(sizes, default=0) > MAX_QUERY_TEXT_BYTES:
            raise InvalidArgumentError(
                f"AddQueries: a query of {max(sizes)} bytes; at most {MAX_QUERY_TEXT_BYTES}"
            )
        # within its token budget
        stored = await self.engine.add_queries(
            cid, caller.tenant, request.texts, request.from_traffic
        )
        return pb.AddQueriesResponse(stored=stored)

    async def Advise(self, request: pb.AdviseRequest, rpc_context: Any) -> pb.AdviseResponse:
        _check_advise(request)
        caller = CALLER.get()
        advice = []
        for q in request.contexts:
            # The context a put joins, from the chunk before its first one (tree_joins.py).
            joins = await self.engine.join(
                caller.tenant,
                caller.scoped(q.context_id),
                caller.scoped(q.after_key) if q.after_key else "",
                save=False,  # once for the request, below: each moved chunk written once
            )
            a = self.engine.advise(joins.context_id, q.num_tokens, q.size_bytes, caller.tenant)
            advice.append(
                pb.WriteAdvice(
                    context_id=caller.unscoped(joins.context_id),
                    variant=a.variant,
                    tier=a.tier,
                    source=a.source,
                    reason=a.reason,
                    parent_context_id=caller.unscoped(joins.parent) if joins.parent else "",
                )
            )
        await self.engine.save_joins()  # its splits are on disk before anyone is advised
        return pb.AdviseResponse(advice=advice)

    async def Plan(self, request: pb.PlanRequest, rpc_context: Any) -> pb.PlanResponse:
        """Advise under its name before issue 17, kept one release for plugins built before the
        rename. Its messages are Advise's field for field (same numbers and types), so their
        bytes are read as Advise's and the answer's as Plan's: one handler serves both."""
        if not self._plan_called:
            self._plan_called = True
            logger.warning(
                "a client called KVStore.Plan, deprecated: it is KVStore.Advise now (a kvtierd "
                "client or plugin older than the rename); Plan goes in the next release"
            )
        advice = await self.Advise(
            pb.AdviseRequest.FromString(request.SerializeToString()), rpc_context
        )
        return pb.PlanResponse.FromString(advice.SerializeToString())

    async def SetContextTokens(
        self, request: pb.SetContextTokensRequest, rpc_context: Any
    ) -> pb.SetContextTokensResponse:
        caller = CALLER.get()
        form = (bool(request.context_id), bool(request.token_ids), bool(request.request_id))
        if form not in ((True, True, False), (False, True, True), (True, False, True)):
            raise InvalidArgumentError(
                "SetContextTokens takes context_id + token_ids, request_id + token_ids, or "
                "context_id + request_id"
            )
        check_request_tokens(len(request.token_ids))
        for name, value in (("request_id", request.request_id), ("context_id", request.context_id)):
            if len(value.encode()) > MAX_ID_BYTES:
                raise InvalidArgumentError(
                    f"SetContextTokens: {name} is longer than {MAX_ID_BYTES} bytes"
                )
        cid = caller.scoped(request.context_id)
        # a prompt may also link to a context dropped since its put (ProfileInputs.set_aside)
        linkable = bool(request.request_id) and self.engine.tokens_set_aside(cid) > 0
        if request.context_id and cid not in self.engine.contexts and not linkable:
            raise NotFoundError(
                f"context {request.context_id!r} not found: token ids are kept only for a "
                "context the daemon holds (register them after its put)"
            )
        if not request.request_id:
            await self.engine.set_tokens(cid, request.token_ids)
        elif request.token_ids:
            rid = caller.scoped(request.request_id)
            self.engine.note_prompt(caller.tenant, rid, request.token_ids)
        else:
            await self.engine.link_prompt(cid, caller.scoped(request.request_id))
        return pb.SetContextTokensResponse()

    async def ReportServed(
        self, request: pb.ReportServedRequest, rpc_context: Any
    ) -> pb.ReportServedResponse:
        tenant = CALLER.get().tenant  # a named tenant's reports price nobody else's contexts
        sample = self.engine.observe_served(
            request.prompt_tokens, request.cached_tokens, request.ttft_s, tenant
        )
        rate = self.engine.prefill_tokens_per_s(tenant)
        return pb.ReportServedResponse(prefill_sample=sample, prefill_tokens_per_s=rate)

    async def ReportInFlight(
        self, request: pb.ReportInFlightRequest, rpc_context: Any
    ) -> pb.ReportInFlightResponse:
        """A router's requests in flight at vLLM (``engine/in_flight_reports.py``): kept under the
        caller's tenant, so that a client only ever replaces its own counts."""
        hold_s = self.engine.report_in_flight(
            CALLER.get().tenant, request.reporter, request.in_flight
        )
        return pb.ReportInFlightResponse(hold_s=hold_s)

    async def Touch(self, request: pb.TouchRequest, rpc_context: Any) -> pb.TouchResponse:
        _check_batch(len(request.keys), "Touch")
        caller = CALLER.get()
        keys = [caller.scoped(k) for k in request.keys]
        return pb.TouchResponse(touched=self.engine.touch(keys, caller.tenant))
