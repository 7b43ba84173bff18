"""The asyncio client: the same operations as :class:`~kvtierd.client.KVClient`, awaitable.
Byte copies run on a worker thread so the caller's event loop keeps going."""

from __future__ import annotations

import asyncio
import contextlib
import warnings
from collections.abc import AsyncIterator, Sequence
from typing import TYPE_CHECKING, Any

import grpc
from grpc import aio

from kvtierd.client.buffers import ArenaMap, as_payload, bytes_view, copy_bytes, new_array
from kvtierd.client.common import (
    CHANNEL_OPTIONS,
    PLAN_RENAMED,
    STREAM_PART_BYTES,
    Endpoint,
    LookupResult,
    advise_request,
    domain_error,
    lookup_result,
    spec,
)
from kvtierd.client.device import DevicePools
from kvtierd.errors import CorruptObjectError, InvalidArgumentError
from kvtierd.rpc import kvtier_pb2 as pb
from kvtierd.rpc import kvtier_pb2_grpc as pb_grpc

if TYPE_CHECKING:
    import torch


class AsyncKVClient:
    def __init__(
        self,
        socket_path: str | None = None,
        *,
        address: str | None = None,
        tls_ca_file: str = "",
        token: str = "",
        timeout_s: float = 60.0,
        tenant: str = "",
        tls_cert_file: str = "",
        tls_key_file: str = "",
    ) -> None:
        self.endpoint = Endpoint.resolve(
            socket_path,
            address,
            tls_ca_file=tls_ca_file,
            token=token,
            tls_cert_file=tls_cert_file,
            tls_key_file=tls_key_file,
        )
        if self.endpoint.colocated:
            self._channel = aio.insecure_channel(self.endpoint.target, options=CHANNEL_OPTIONS)
        else:
            creds = self.endpoint.credentials()
            self._channel = aio.secure_channel(self.endpoint.target, creds, CHANNEL_OPTIONS)
        self.kv = pb_grpc.KVStoreStub(self._channel)
        self.admin = pb_grpc.AdminStub(self._channel)
        self.timeout_s = timeout_s
        # On the Unix socket a tenant names itself; over TCP the token decides.
        self.metadata: tuple[tuple[str, str], ...] = (
            (("x-kvtierd-tenant", tenant),) if tenant else ()
        )
        self._arena = ArenaMap()
        self._device_pools = DevicePools()
        self._plan_warned = False

    async def close(self) -> None:
        self._arena.close()
        self._device_pools.close()
        await self._channel.close()

    async def __aenter__(self) -> AsyncKVClient:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    async def call(self, fn: Any, request: Any) -> Any:
        try:
            return await fn(request, timeout=self.timeout_s, metadata=self.metadata)
        except grpc.RpcError as e:
            raise domain_error(e, self.endpoint) from None

    async def put(
        self,
        key: str,
        data: Any,
        *,
        context_id: str = "",
        variant: str = "",
        layout: str = "",
        token_count: int = 0,
        durable: bool = False,
    ) -> pb.ObjectInfo:
        p = as_payload(data)
        s = spec(key, len(p.data), p.dtype, p.shape, context_id=context_id, variant=variant,
                 layout=layout, token_count=token_count)  # fmt: skip
        if not self.endpoint.colocated:

            async def parts() -> AsyncIterator[pb.PutPart]:
                yield pb.PutPart(spec=s, durable=durable)
                for start in range(0, len(p.data), STREAM_PART_BYTES):
                    yield pb.PutPart(data=bytes(p.data[start : start + STREAM_PART_BYTES]))

            resp: pb.PutResponse = await self.call(self.kv.PutStream, parts())
            return resp.object
        alloc_resp = await self.call(self.kv.Allocate, pb.AllocateRequest(objects=[s]))
        (alloc,) = alloc_resp.allocations
        try:
            await asyncio.to_thread(copy_bytes, self._arena.region(alloc.region), p.data)
        except BaseException:
            await self.call(self.kv.Abort, pb.AbortRequest(allocation_ids=[alloc.allocation_id]))
            raise
        req = pb.CommitRequest(allocation_ids=[alloc.allocation_id], durable=durable)
        commit: pb.CommitResponse = await self.call(self.kv.Commit, req)
        return commit.objects[0]

    async def lookup(
        self, keys: Sequence[str], hold_s: float = 0.0, decide: bool = False
    ) -> LookupResult:
        """Which keys are stored, where; ``decide``: and how many of the found prefix to load
        (``LookupResult.load_chunks``, the daemon's load-or-recompute decision)."""
        request = pb.LookupRequest(keys=list(keys), hold_s=hold_s, decide=decide)
        return lookup_result(await self.call(self.kv.Lookup, request))

    @contextlib.asynccontextmanager
    async def lease(
        self, key: str, lease_s: float = 0.0
    ) -> AsyncIterator[tuple[pb.ObjectInfo, memoryview]]:
        resp = await self.call(self.kv.Get, pb.GetRequest(keys=[key], lease_s=lease_s))
        (lease,) = resp.leases
        try:
            yield lease.object, self._arena.region(lease.region)
        finally:
            await self.call(self.kv.Release, pb.ReleaseRequest(lease_ids=[lease.lease_id]))

    @contextlib.asynccontextmanager
    async def device_lease(
        self, key: str, lease_s: float = 0.0
    ) -> AsyncIterator[tuple[pb.ObjectInfo, torch.Tensor]]:
        """The asyncio twin of :meth:`KVClient.device_lease`."""
        request = pb.GetRequest(keys=[key], lease_s=lease_s, device_ok=True)
        resp = await self.call(self.kv.Get, request)
        (lease,) = resp.leases
        try:
            yield lease.object, self._device_pools.tensor(lease, self._arena)
        finally:
            await self.call(self.kv.Release, pb.ReleaseRequest(lease_ids=[lease.lease_id]))

    async def get(self, key: str, out: Any = None) -> Any:
        if not self.endpoint.colocated:
            return await self._get_stream(key, out)
        async with self.lease(key) as (info, view):
            if out is None:
                out = new_array(info.spec)
            await asyncio.to_thread(copy_bytes, bytes_view(out), view)
        return out

    async def _get_stream(self, key: str, out: Any) -> Any:
        try:
            filled = 0
            dst = None
            stream = self.kv.GetStream(
                pb.GetStreamRequest(key=key), timeout=self.timeout_s, metadata=self.metadata
            )
            async for part in stream:
                if part.HasField("info"):
                    out = new_array(part.info.spec) if out is None else out
                    dst = bytes_view(out)
                    continue
                if dst is None:
                    raise CorruptObjectError(
                        f"object {key!r}: the stream did not start with its info"
                    )
                dst[filled : filled + len(part.data)] = part.data
                filled += len(part.data)
        except grpc.RpcError as e:
            raise domain_error(e, self.endpoint) from None
        if dst is None:
            raise CorruptObjectError(f"object {key!r}: the stream carried no object info")
        if filled != len(dst):
            raise InvalidArgumentError(
                f"object {key!r}: {filled} bytes for a {len(dst)}-byte buffer"
            )
        return out

    async def delete(self, keys: Sequence[str]) -> int:
        resp: pb.DeleteResponse = await self.call(self.kv.Delete, pb.DeleteRequest(keys=list(keys)))
        return resp.deleted

    async def touch(self, keys: Sequence[str]) -> int:
        resp: pb.TouchResponse = await self.call(self.kv.Touch, pb.TouchRequest(keys=list(keys)))
        return resp.touched

    async def set_context_tokens(self, context_id: str, token_ids: Sequence[int]) -> None:
        req = pb.SetContextTokensRequest(context_id=context_id, token_ids=list(token_ids))
        await self.call(self.kv.SetContextTokens, req)

    async def note_prompt(self, request_id: str, token_ids: Sequence[int]) -> None:
        req = pb.SetContextTokensRequest(request_id=request_id, token_ids=list(token_ids))
        await self.call(self.kv.SetContextTokens, req)

    async def link_prompt(self, context_id: str, request_id: str) -> None:
        req = pb.SetContextTokensRequest(context_id=context_id, request_id=request_id)
        await self.call(self.kv.SetContextTokens, req)

    async def report_served(self, sample: Any) -> pb.ReportServedResponse:
        """A served request's timing (``router.timing.ServedSample``): teaches the daemon's
        TTFT model vLLM's prefill speed."""
        req = pb.ReportServedRequest(
            prompt_tokens=sample.prompt_tokens,
            cached_tokens=sample.cached_tokens,
            ttft_s=sample.ttft_s,
        )
        resp: pb.ReportServedResponse = await self.call(self.kv.ReportServed, req)
        return resp

    async def report_in_flight(self, reporter: str, in_flight: int) -> float:
        """``reporter`` (a router instance) has ``in_flight`` requests in flight at vLLM; the
        seconds a nonzero count holds without a new report."""
        req = pb.ReportInFlightRequest(reporter=reporter, in_flight=in_flight)
        resp: pb.ReportInFlightResponse = await self.call(self.kv.ReportInFlight, req)
        return resp.hold_s

    async def advise(
        self, context_id: str, num_tokens: int = 0, size_bytes: int = 0, after_key: str = ""
    ) -> pb.WriteAdvice:
        """The daemon's write advice for ``context_id`` (:meth:`KVClient.advise`)."""
        request = advise_request(context_id, num_tokens, size_bytes, after_key)
        resp: pb.AdviseResponse = await self.call(self.kv.Advise, request)
        return resp.advice[0]

    async def plan(
        self, context_id: str, num_tokens: int = 0, size_bytes: int = 0
    ) -> pb.WriteAdvice:
        """Deprecated: :meth:`advise` under its name before issue 17, kept one release; warns
        (``DeprecationWarning``) on this client's first call."""
        if not self._plan_warned:
            self._plan_warned = True
            warnings.warn(PLAN_RENAMED, DeprecationWarning, stacklevel=2)
        return await self.advise(context_id, num_tokens, size_bytes)

    async def status(self) -> pb.StatusResponse:
        resp: pb.StatusResponse = await self.call(self.admin.Status, pb.StatusRequest())
        return resp
