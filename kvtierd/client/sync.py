"""The blocking client. ``KVClient(socket_path)`` for co-located use (bytes through the
daemon's shared-memory arena), ``KVClient(address=..., tls_ca_file=..., token=...)`` for a
daemon on another host (bytes streamed in 4 MiB parts)."""

from __future__ import annotations

import contextlib
import warnings
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import TYPE_CHECKING, Any, TypeVar

import grpc

from kvtierd.client.buffers import ArenaMap, as_payload, bytes_view, copy_bytes, new_array
from kvtierd.client.common import (
    CHANNEL_OPTIONS,
    GET_STREAM,
    PLAN_RENAMED,
    PUT_STREAM,
    STREAM_PART_BYTES,
    Endpoint,
    LookupResult,
    advise_request,
    decode_get_part,
    domain_error,
    encode_put_part,
    lookup_result,
    spec,
)
from kvtierd.client.device import DevicePools
from kvtierd.errors import CorruptObjectError, InvalidArgumentError
from kvtierd.rpc import kvtier_pb2 as pb
from kvtierd.rpc import kvtier_pb2_grpc as pb_grpc
from kvtierd.rpc.framing import data_frame

if TYPE_CHECKING:
    import torch

T = TypeVar("T")


class KVClient:
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
        stream: bool = False,
    ) -> None:
        """``stream=True`` moves bytes by gRPC streams even over a Unix socket (the path a
        client on another host takes), instead of through the shared-memory arena."""
        self.endpoint = Endpoint.resolve(
            socket_path,
            address,
            tls_ca_file=tls_ca_file,
            token=token,
            tls_cert_file=tls_cert_file,
            tls_key_file=tls_key_file,
        )
        self.use_arena = self.endpoint.colocated and not stream
        self._open()
        self.timeout_s = timeout_s
        # On the Unix socket a tenant names itself; over TCP the token decides.
        self.metadata: tuple[tuple[str, str], ...] = (
            (("x-kvtierd-tenant", tenant),) if tenant else ()
        )
        self._arena = ArenaMap()
        self._device_pools = DevicePools()
        self._copier = ThreadPoolExecutor(1, thread_name_prefix="kvtierd-copy")
        self._plan_warned = False

    def _open(self) -> None:
        if self.endpoint.colocated:
            self._channel = grpc.insecure_channel(self.endpoint.target, options=CHANNEL_OPTIONS)
        else:
            creds = self.endpoint.credentials()
            target = self.endpoint.target
            self._channel = grpc.secure_channel(target, creds, options=CHANNEL_OPTIONS)
        self.kv = pb_grpc.KVStoreStub(self._channel)
        self._put_stream_call = self._channel.stream_unary(
            PUT_STREAM, encode_put_part, pb.PutResponse.FromString
        )
        self._get_stream_call = self._channel.unary_stream(
            GET_STREAM, pb.GetStreamRequest.SerializeToString, decode_get_part
        )
        self.admin = pb_grpc.AdminStub(self._channel)

    def reconnect(self) -> None:
        """Use a new channel from now on. A channel that failed to connect waits out its
        reconnect backoff before it tries again, and inside vLLM's process that wait was seen
        growing as gRPC's default (25 s) despite ``RECONNECT_BACKOFF_MS``; a new channel tries
        at once. The old one is not closed: calls still on it finish (it closes when
        collected)."""
        self._open()

    def close(self) -> None:
        self._copier.shutdown()
        self._arena.close()
        self._device_pools.close()
        self._channel.close()

    def __enter__(self) -> KVClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def call(self, fn: Callable[..., T], request: Any) -> T:
        """One RPC; gRPC errors come back as :mod:`kvtierd.errors` exceptions."""
        try:
            return fn(request, timeout=self.timeout_s, metadata=self.metadata)
        except grpc.RpcError as e:
            raise domain_error(e, self.endpoint) from None

    # -- puts --------------------------------------------------------------------------------

    def put(
        self,
        key: str,
        data: Any,
        *,
        context_id: str = "",
        variant: str = "",
        layout: str = "",
        token_count: int = 0,
        durable: bool = False,
        parent_context_id: str = "",
    ) -> pb.ObjectInfo:
        """Store bytes, a numpy array or a CPU torch tensor under ``key``;
        ``parent_context_id``: the context ``context_id`` continues (issue 29)."""
        p = as_payload(data)
        s = spec(
            key,
            len(p.data),
            p.dtype,
            p.shape,
            context_id=context_id,
            variant=variant,
            layout=layout,
            token_count=token_count,
            parent_context_id=parent_context_id,
        )
        if not self.use_arena:
            return self._put_stream(s, p.data, durable)
        (alloc,) = self.call(self.kv.Allocate, pb.AllocateRequest(objects=[s])).allocations
        try:
            copy_bytes(self._arena.region(alloc.region), p.data, self._copier)
        except BaseException:
            self.call(self.kv.Abort, pb.AbortRequest(allocation_ids=[alloc.allocation_id]))
            raise
        req = pb.CommitRequest(allocation_ids=[alloc.allocation_id], durable=durable)
        return self.call(self.kv.Commit, req).objects[0]

    def _put_stream(self, s: pb.ObjectSpec, data: memoryview, durable: bool) -> pb.ObjectInfo:
        def parts() -> Iterator[pb.PutPart | bytes]:
            yield pb.PutPart(spec=s, durable=durable)
            for start in range(0, len(data), STREAM_PART_BYTES):
                yield data_frame(data[start : start + STREAM_PART_BYTES])

        resp: pb.PutResponse = self.call(self._put_stream_call, parts())
        return resp.object

    # -- reads -------------------------------------------------------------------------------

    def lookup(
        self,
        keys: Sequence[str],
        hold_s: float = 0.0,
        decide: bool = False,
        *,
        request: bool = False,
    ) -> LookupResult:
        """Which keys are stored, where; ``decide``: and how many of the found prefix to load
        (``LookupResult.load_chunks``, the daemon's load-or-recompute decision); ``request``:
        this is a served request's lookup of its prompt, whose outcome the daemon counts (hit,
        partial, miss; ``LookupRequest.request``)."""
        message = pb.LookupRequest(keys=list(keys), hold_s=hold_s, decide=decide, request=request)
        return lookup_result(self.call(self.kv.Lookup, message))

    @contextlib.contextmanager
    def lease(self, key: str, lease_s: float = 0.0) -> Iterator[tuple[pb.ObjectInfo, memoryview]]:
        """Zero-copy read: a view of the object's bytes in the arena, valid inside the block."""
        (lease,) = self.call(self.kv.Get, pb.GetRequest(keys=[key], lease_s=lease_s)).leases
        try:
            yield lease.object, self._arena.region(lease.region)
        finally:
            self.call(self.kv.Release, pb.ReleaseRequest(lease_ids=[lease.lease_id]))

    @contextlib.contextmanager
    def device_lease(
        self, key: str, lease_s: float = 0.0
    ) -> Iterator[tuple[pb.ObjectInfo, torch.Tensor]]:
        """Zero-copy read for a CUDA process: a ``uint8`` CUDA tensor over the object's bytes
        in the daemon's gpu tier when it is there (CUDA IPC, in place), else a CPU tensor over
        its bytes in the arena. Valid inside the block; the object is not moved under it."""
        request = pb.GetRequest(keys=[key], lease_s=lease_s, device_ok=True)
        (lease,) = self.call(self.kv.Get, request).leases
        try:
            yield lease.object, self._device_pools.tensor(lease, self._arena)
        finally:
            self.call(self.kv.Release, pb.ReleaseRequest(lease_ids=[lease.lease_id]))

    def get(self, key: str, out: Any = None) -> Any:
        """Copy an object into ``out`` (numpy array / CPU tensor / bytearray) or a new numpy
        array shaped as stored; returns it."""
        if not self.use_arena:
            return self._get_stream(key, out)
        with self.lease(key) as (info, view):
            if out is None:
                out = new_array(info.spec)
            copy_bytes(bytes_view(out), view, self._copier)
        return out

    def _get_stream(self, key: str, out: Any) -> Any:
        stream = self._get_stream_call(
            pb.GetStreamRequest(key=key), timeout=self.timeout_s, metadata=self.metadata
        )
        try:
            first = next(stream)
            if not isinstance(first, pb.GetPart) or not first.HasField("info"):
                raise CorruptObjectError(f"object {key!r}: the stream did not start with its info")
            if out is None:
                out = new_array(first.info.spec)
            dst, filled = bytes_view(out), 0
            for part in stream:
                data = part if isinstance(part, memoryview) else memoryview(part.data)
                dst[filled : filled + len(data)] = data
                filled += len(data)
        except grpc.RpcError as e:
            raise domain_error(e, self.endpoint) from None
        if filled != len(dst):
            raise InvalidArgumentError(
                f"object {key!r}: {filled} bytes for a {len(dst)}-byte buffer"
            )
        return out

    def delete(self, keys: Sequence[str]) -> int:
        return self.call(self.kv.Delete, pb.DeleteRequest(keys=list(keys))).deleted

    def touch(self, keys: Sequence[str]) -> int:
        return self.call(self.kv.Touch, pb.TouchRequest(keys=list(keys))).touched

    def set_context_tokens(self, context_id: str, token_ids: Sequence[int]) -> None:
        """Tell the daemon the token ids ``context_id`` was computed from (the ``served``
        evaluator needs them)."""
        req = pb.SetContextTokensRequest(context_id=context_id, token_ids=list(token_ids))
        self.call(self.kv.SetContextTokens, req)

    def note_prompt(self, request_id: str, token_ids: Sequence[int]) -> None:
        """Register a request's prompt for a later :meth:`link_prompt` (kvtierd router)."""
        req = pb.SetContextTokensRequest(request_id=request_id, token_ids=list(token_ids))
        self.call(self.kv.SetContextTokens, req)

    def link_prompt(self, context_id: str, request_id: str) -> None:
        """The registered prompt of ``request_id`` made or read ``context_id`` (the plugin)."""
        req = pb.SetContextTokensRequest(context_id=context_id, request_id=request_id)
        self.call(self.kv.SetContextTokens, req)

    def report_in_flight(self, reporter: str, in_flight: int) -> float:
        """``reporter`` (a router instance) has ``in_flight`` requests in flight at vLLM
        (``KVStore.ReportInFlight``); the seconds a nonzero count holds without a new report."""
        req = pb.ReportInFlightRequest(reporter=reporter, in_flight=in_flight)
        hold_s: float = self.call(self.kv.ReportInFlight, req).hold_s
        return hold_s

    def advise(
        self, context_id: str, num_tokens: int = 0, size_bytes: int = 0, after_key: str = ""
    ) -> pb.WriteAdvice:
        """The daemon's write advice for ``context_id``: the variant to store it in
        (docs/daemon.md, "Write advice"); the sizes matter only for a context the daemon does
        not hold yet. With ``after_key`` (the chunk before the put's first one) the answer's
        ``context_id`` and ``parent_context_id`` say which context the put joins."""
        request = advise_request(context_id, num_tokens, size_bytes, after_key)
        (advice,) = self.call(self.kv.Advise, request).advice
        return advice

    def plan(self, context_id: str, num_tokens: int = 0, size_bytes: int = 0) -> pb.WriteAdvice:
        """Deprecated: :meth:`advise` under its name before issue 17, kept one release; warns
        (``DeprecationWarning``) on this client's first call."""
        if not self._plan_warned:
            self._plan_warned = True
            warnings.warn(PLAN_RENAMED, DeprecationWarning, stacklevel=2)
        return self.advise(context_id, num_tokens, size_bytes)

    # -- admin -------------------------------------------------------------------------------

    def status(self) -> pb.StatusResponse:
        return self.call(self.admin.Status, pb.StatusRequest())

    def tiers(self) -> list[pb.TierInfo]:
        return list(self.call(self.admin.ListTiers, pb.ListTiersRequest()).tiers)

    def contexts(self, tier: str = "") -> list[pb.ContextSummary]:
        return list(self.call(self.admin.ListContexts, pb.ListContextsRequest(tier=tier)).contexts)

    def drain(self, tier: str) -> pb.DrainResponse:
        return self.call(self.admin.Drain, pb.DrainRequest(tier=tier))

    def evict(self, context_ids: Sequence[str]) -> int:
        """Drop contexts from every tier; the number dropped. An unknown context raises
        :class:`~kvtierd.errors.NotFoundError` (those before it are dropped already)."""
        request = pb.EvictRequest(context_ids=list(context_ids))
        return int(self.call(self.admin.Evict, request).evicted)
