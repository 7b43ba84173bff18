"""proto <-> domain conversions. Servicers only translate; the engine decides."""

from __future__ import annotations

import functools
import sys
import time
from typing import TYPE_CHECKING

from kvtierd.engine.context_kv import client_key
from kvtierd.engine.state import ObjectRecord
from kvtierd.rpc import kvtier_pb2 as pb
from kvtierd.server.identity import Caller
from kvtierd.storage.allocator import Block
from kvtierd.storage.arena import Arena
from kvtierd.storage.gpu import GpuTier
from kvtierd.types import ORIGINAL_VARIANT, ObjectMeta

if TYPE_CHECKING:
    from kvtierd.profiler import ProfileRecord


def meta_from_spec(spec: pb.ObjectSpec, caller: Caller) -> ObjectMeta:
    """Keys and context ids become daemon-wide names scoped by the caller's tenant. The
    strings many objects repeat (variant, dtype, layout, tenant) are interned, and equal
    shapes and sizes share one object: each put would otherwise bring its own copies, ~200
    bytes an object for a daemon holding a million (issue 42). A context id is not interned:
    the index gives each object its context's own string (``ContextIndex.numbered``)."""
    intern = sys.intern
    parent = caller.scoped(spec.parent_context_id) if spec.parent_context_id else ""
    return ObjectMeta(
        key=caller.scoped(spec.key),
        size_bytes=_shared_int(spec.size_bytes),
        context_id=caller.scoped(spec.context_id),  # the index's string (``numbered``)
        tenant=intern(caller.tenant),
        variant=intern(spec.variant or ORIGINAL_VARIANT),
        dtype=intern(spec.dtype or "uint8"),
        shape=_shared_shape(tuple(spec.shape)),
        layout=intern(spec.layout),
        token_count=spec.token_count,
        kept_indices=spec.kept_indices,
        checksum=spec.checksum,
        parent_context_id=intern(parent),
    )


@functools.lru_cache(maxsize=4096)
def _shared_shape(shape: tuple[int, ...]) -> tuple[int, ...]:
    """One tuple for equal shapes (the cache hands back the first one it was given)."""
    return shape


@functools.lru_cache(maxsize=4096)
def _shared_int(n: int) -> int:
    """One int object for equal sizes: chunks of one model are one size, and each put would
    otherwise bring its own int above 256 (28 bytes an object, issue 42)."""
    return n


def spec_from_meta(meta: ObjectMeta, caller: Caller) -> pb.ObjectSpec:
    return pb.ObjectSpec(
        key=caller.unscoped(client_key(meta.key)),
        context_id=caller.unscoped(meta.context_id),
        variant=meta.variant,
        size_bytes=meta.size_bytes,
        dtype=meta.dtype,
        shape=list(meta.shape),
        layout=meta.layout,
        token_count=meta.token_count,
        kept_indices=meta.kept_indices,
        checksum=meta.checksum,
        parent_context_id=caller.unscoped(meta.parent_context_id) if meta.parent_context_id else "",
    )


def info(meta: ObjectMeta, tier: str, caller: Caller) -> pb.ObjectInfo:
    return pb.ObjectInfo(spec=spec_from_meta(meta, caller), tier=tier, checksum=meta.checksum)


def record_info(rec: ObjectRecord, caller: Caller) -> pb.ObjectInfo:
    return info(rec.meta, rec.tier, caller)


def device_region(tier: GpuTier, block: Block) -> pb.DeviceRegion:
    h = tier.ipc_handle()
    pool = pb.CudaIpcHandle(
        device=h.device,
        handle=h.handle,
        storage_size_bytes=h.storage_size_bytes,
        storage_offset_bytes=h.storage_offset_bytes,
        ref_counter_handle=h.ref_counter_handle,
        ref_counter_offset=h.ref_counter_offset,
        event_handle=h.event_handle,
        event_sync_required=h.event_sync_required,
    )
    return pb.DeviceRegion(tier=tier.name, pool=pool, offset=block.offset, length=block.length)


def region(arena: Arena, block: Block) -> pb.ArenaRegion:
    return pb.ArenaRegion(
        arena_path=str(arena.path), arena_id=arena.id, offset=block.offset, length=block.length
    )


def profile_provenance(record: ProfileRecord) -> pb.ProfileProvenance:
    """Which reading made a context's profile, by which evaluator, how long ago."""
    return pb.ProfileProvenance(
        reading=record.reading.value,
        evaluator=record.evaluator,
        age_s=max(0.0, time.time() - record.profiled_at_s),
        query_source=record.query_source,
        num_queries=record.num_queries,
    )
