"""Batched puts and reads over ``KVClient``'s stubs: one Allocate/Commit for all chunks of a
request, one Get/Release for all chunks of a load (the client library does one object per call).

Bytes go through the daemon's shared-memory arena, never through protobuf.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field

import numpy as np
import numpy.typing as npt
import torch

from kvtierd.client import KVClient
from kvtierd.rpc import kvtier_pb2 as pb


@dataclass(frozen=True, slots=True)
class PutItem:
    """One object to store: its key, its bytes (a CPU tensor) and what the daemon records
    (``variant``: the form the bytes are in, e.g. ``int8`` for chunks quantized here)."""

    key: str
    data: torch.Tensor
    context_id: str
    variant: str
    layout: str
    token_count: int
    kept_indices: bytes = b""
    shape: tuple[int, ...] = field(default=())
    parent_context_id: str = ""  # the context ``context_id`` continues (issue 29)


def _bytes_of(t: torch.Tensor) -> npt.NDArray[np.uint8]:
    flat = t.detach().contiguous().cpu().reshape(-1).view(torch.uint8)
    return flat.numpy()


def put_many(client: KVClient, items: Sequence[PutItem], *, durable: bool = False) -> int:
    """Store ``items`` in one Allocate and one Commit; returns the bytes stored."""
    if not items:
        return 0
    payloads = [_bytes_of(i.data) for i in items]
    specs = []
    for item, raw in zip(items, payloads, strict=True):
        shape = item.shape or (int(raw.size),)
        dtype = str(item.data.dtype).removeprefix("torch.") if item.shape else "uint8"
        specs.append(
            pb.ObjectSpec(
                key=item.key,
                context_id=item.context_id,
                variant=item.variant,
                size_bytes=int(raw.size),
                dtype=dtype,
                shape=list(shape),
                layout=item.layout,
                token_count=item.token_count,
                kept_indices=item.kept_indices,
                parent_context_id=item.parent_context_id,
            )
        )
    allocs = client.call(client.kv.Allocate, pb.AllocateRequest(objects=specs)).allocations
    ids = [a.allocation_id for a in allocs]
    try:
        for alloc, raw in zip(allocs, payloads, strict=True):
            region = client._arena.region(alloc.region)
            np.copyto(np.frombuffer(region, np.uint8), raw)
    except BaseException:
        client.call(client.kv.Abort, pb.AbortRequest(allocation_ids=ids))
        raise
    client.call(client.kv.Commit, pb.CommitRequest(allocation_ids=ids, durable=durable))
    return sum(int(p.size) for p in payloads)


@contextlib.contextmanager
def lease_many(
    client: KVClient, keys: Sequence[str], lease_s: float = 0.0
) -> Iterator[list[tuple[pb.ObjectInfo, memoryview]]]:
    """Zero-copy views of several objects under one Get; released together on exit."""
    leases = client.call(client.kv.Get, pb.GetRequest(keys=list(keys), lease_s=lease_s)).leases
    try:
        yield [(lease.object, client._arena.region(lease.region)) for lease in leases]
    finally:
        ids = [lease.lease_id for lease in leases]
        client.call(client.kv.Release, pb.ReleaseRequest(lease_ids=ids))


def read_bytes(client: KVClient, key: str) -> bytes:
    with client.lease(key) as (_, view):
        return bytes(view)
