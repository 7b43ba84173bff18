"""``gpu`` tier: objects in one torch CUDA memory pool, carved by the same best-fit allocator
as the arena; shared with co-located processes by CUDA IPC.

The pool is a single ``uint8`` CUDA tensor allocated at start (plain cudaMalloc through
torch's allocator, never managed memory). A co-located process opens the pool once from
:meth:`GpuTier.ipc_handle` and addresses objects by their block (offset, length) in a lease
(``Get`` with ``device_ok``), so no per-object IPC handles are needed. Host<->device copies
go through a pinned staging buffer reused across calls.

Options: ``device`` (default ``cuda:0``), ``staging_bytes`` (pinned host buffer, default
64 MiB). Only configured when CUDA is present; construction fails with a clear message
otherwise.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from kvtierd.config import TierConfig, parse_size
from kvtierd.errors import CapacityError, InvalidArgumentError
from kvtierd.storage.allocator import Block, FreeListAllocator, Move
from kvtierd.storage.base import TransferFit
from kvtierd.storage.pooled import PooledTier
from kvtierd.types import ObjectMeta

if TYPE_CHECKING:
    import torch


@dataclass(frozen=True, slots=True)
class CudaIpcHandle:
    """The pool's storage as torch shares CUDA memory between processes: the fields of
    ``UntypedStorage._share_cuda_()``, which ``UntypedStorage._new_shared_cuda`` opens."""

    device: int
    handle: bytes
    storage_size_bytes: int
    storage_offset_bytes: int
    ref_counter_handle: bytes
    ref_counter_offset: int
    event_handle: bytes
    event_sync_required: bool


MOVE_PIECE_BYTES = 64 << 20
"""The most device memory a move within the pool borrows (for a piece that overlaps itself)."""


def move_within(pool: torch.Tensor, move: Move, piece_bytes: int = MOVE_PIECE_BYTES) -> None:
    """``memmove`` of ``move.old`` to ``move.new`` (a lower offset) within the ``uint8`` tensor
    ``pool``. ``Tensor.copy_`` refuses a source and destination that partly overlap, so the
    bytes go in ascending pieces, each through a temporary copy when it overlaps itself: a
    piece's destination ends before the next piece's source begins, so no piece overwrites
    bytes not yet copied."""
    old, new, n = move.old.offset, move.new.offset, move.old.length
    shift = old - new
    for start in range(0, n, piece_bytes):
        k = min(piece_bytes, n - start)
        src = pool[old + start : old + start + k]
        pool[new + start : new + start + k].copy_(src if k <= shift else src.clone())


class GpuTier(PooledTier):
    kind = "gpu"
    # Nothing measured on the reference machine (no GPU): pinned host<->device copies run at
    # ~12 GB/s over PCIe 3.0 x16; 5 GB/s leaves room for a narrower or shared link.
    read_prior = TransferFit(0.0, 5e9)

    def __init__(self, config: TierConfig) -> None:
        super().__init__(config)
        import torch

        if not torch.cuda.is_available():
            raise ValueError("a gpu tier needs CUDA, and torch reports none available")
        self.device = torch.device(str(config.options.get("device", "cuda:0")))
        self.staging_bytes = parse_size(config.options.get("staging_bytes", "64MiB"))
        self.allocator = FreeListAllocator(config.capacity_bytes, alignment=256)
        self._pool: torch.Tensor | None = None
        self._staging: torch.Tensor | None = None
        self._ipc: CudaIpcHandle | None = None
        # One staged copy at a time: every copy goes through the one pinned buffer, so two on
        # worker threads at once would overwrite each other's bytes in it.
        self._lock = asyncio.Lock()

    @property
    def pool(self) -> torch.Tensor:
        if self._pool is None:
            raise InvalidArgumentError(f"tier {self.name!r} is not started")
        return self._pool

    async def start(self) -> None:
        import torch

        self._pool = torch.empty(self.allocator.size_bytes, dtype=torch.uint8, device=self.device)
        self._staging = torch.empty(self.staging_bytes, dtype=torch.uint8, pin_memory=True)
        self._calibrate()

    def _calibrate(self) -> None:
        import torch

        n = min(self.staging_bytes, self.allocator.size_bytes)
        if n < self.read_meter.min_bytes:
            self.calibration_failed(
                f"the pool or staging buffer ({n} bytes) is too small to time a copy of "
                f"{self.read_meter.min_bytes} bytes"
            )
            return
        assert self._staging is not None
        device, host = self.pool[:n], self._staging[:n]
        for meter, dst, src in ((self.write_meter, device, host), (self.read_meter, host, device)):
            dst.copy_(src)
            torch.cuda.synchronize(self.device)
            t0 = time.perf_counter()
            dst.copy_(src)
            torch.cuda.synchronize(self.device)
            meter.record(n, time.perf_counter() - t0)

    async def close(self) -> None:
        self._index.clear()
        self._pool = self._staging = None
        self._ipc = None

    def ipc_handle(self) -> CudaIpcHandle:
        """The pool's CUDA IPC handle for co-located processes (made once; the pool never
        moves while the tier runs)."""
        if self._ipc is None:
            shared: Any = self.pool.untyped_storage()._share_cuda_()  # type: ignore[no-untyped-call]
            device, handle, size, offset, ref_handle, ref_offset, event, sync = shared
            self._ipc = CudaIpcHandle(
                int(device), bytes(handle), int(size), int(offset), bytes(ref_handle),
                int(ref_offset), bytes(event or b""), bool(sync),
            )  # fmt: skip
        return self._ipc

    def block_of(self, key: str) -> Block:
        return self._index.get(key).block

    def detach(self, key: str) -> Block:
        return self._index.pop(key).block

    def free_block(self, block: Block) -> None:
        self.allocator.free(block)

    async def put(self, meta: ObjectMeta, data: memoryview) -> ObjectMeta:
        self._index.check_absent(meta.key)
        if len(data) != meta.size_bytes:
            raise InvalidArgumentError(
                f"object {meta.key!r}: {len(data)} bytes given, size_bytes says {meta.size_bytes}"
            )
        try:
            block = self.allocator.allocate(meta.size_bytes)
        except CapacityError:
            # Compact under the lock every copy takes: no copy on a worker thread reads or
            # writes an object's block while it moves (``PooledTier.allocate``).
            async with self._lock:
                block = self.allocate(self.allocator, meta.size_bytes)
        try:
            async with self._lock:
                t0 = time.perf_counter()
                await asyncio.to_thread(self._copy, block, data, True)
                self.write_meter.record(meta.size_bytes, time.perf_counter() - t0)
            self._index.add(meta, block)  # raises if a racing put of the key added first
        except BaseException:
            self.allocator.free(block)
            raise
        return meta

    def _move_bytes(self, move: Move) -> None:
        import torch

        move_within(self.pool, move)
        torch.cuda.synchronize(self.device)

    async def read_into(self, key: str, dst: memoryview, *, tenant: str = "") -> ObjectMeta:
        stored = self._index.get(key)
        async with self._lock:
            t0 = time.perf_counter()
            await asyncio.to_thread(self._copy, stored.block, dst[: stored.meta.size_bytes], False)
            self.read_meter.record(stored.meta.size_bytes, time.perf_counter() - t0)
        return stored.meta

    def _copy(self, block: Block, host: memoryview, to_device: bool) -> None:
        """Copy through the pinned staging buffer in pieces (pageable copies are slower)."""
        import torch

        assert self._staging is not None
        if block.length == 0:
            return  # nothing to move (and torch.frombuffer refuses an empty buffer)
        host_t = torch.frombuffer(host, dtype=torch.uint8)
        step = self.staging_bytes
        for start in range(0, block.length, step):
            n = min(step, block.length - start)
            dev = self.pool[block.offset + start : block.offset + start + n]
            stage = self._staging[:n]
            if to_device:
                stage.copy_(host_t[start : start + n])
                dev.copy_(stage, non_blocking=False)
            else:
                stage.copy_(dev, non_blocking=False)
                host_t[start : start + n].copy_(stage)
        torch.cuda.synchronize(self.device)

    async def delete(self, key: str, *, tenant: str = "") -> None:
        self.allocator.free(self._index.pop(key).block)

    def get_meta(self, key: str) -> ObjectMeta:
        return self._index.get(key).meta

    def metas(self) -> Iterator[ObjectMeta]:
        return self._index.metas()

    def used_bytes(self) -> int:
        return self._index.used_bytes

    def object_count(self) -> int:
        return len(self._index)
