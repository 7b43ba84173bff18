"""``gpu`` tier: objects in one torch CUDA memory pool, carved by the same best-fit allocator
as the arena; shared with co-located processes by CUDA IPC.

The pool is a single ``uint8`` CUDA tensor allocated at start (plain cudaMalloc through
torch's allocator, never managed memory). A co-located process opens the pool once from
:meth:`GpuTier.ipc_handle` and addresses objects by :meth:`GpuTier.locate` (offset, length),
so no per-object IPC handles are needed. Host<->device copies go through a pinned staging
buffer reused across calls.

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
from kvtierd.errors import AlreadyExistsError, InvalidArgumentError, NotFoundError
from kvtierd.storage.allocator import Block, FreeListAllocator
from kvtierd.storage.base import Tier, register_tier
from kvtierd.types import ObjectMeta

if TYPE_CHECKING:
    import torch


@dataclass(frozen=True, slots=True)
class _Stored:
    meta: ObjectMeta
    block: Block


@register_tier
class GpuTier(Tier):
    kind = "gpu"

    def __init__(self, config: TierConfig) -> None:
        super().__init__(config)
        import torch

        if not torch.cuda.is_available():
            raise ValueError("a gpu tier needs CUDA, and torch reports none available")
        self.device = torch.device(str(config.options.get("device", "cuda:0")))
        self.staging_bytes = parse_size(config.options.get("staging_bytes", "64MiB"))
        self.allocator = FreeListAllocator(config.capacity_bytes, alignment=256)
        self._objects: dict[str, _Stored] = {}
        self._used = 0
        self._pool: torch.Tensor | None = None
        self._staging: torch.Tensor | None = None
        self._lock = asyncio.Lock()  # one staged copy at a time through the pinned buffer

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
        self._objects.clear()
        self._pool = self._staging = None
        self._used = 0

    def ipc_handle(self) -> Any:
        """The pool's CUDA IPC handle for a co-located process (torch's storage sharing)."""
        return self.pool.untyped_storage()._share_cuda_()  # type: ignore[no-untyped-call]

    def locate(self, key: str) -> Block:
        try:
            return self._objects[key].block
        except KeyError:
            raise NotFoundError(f"object {key!r} is not in tier {self.name!r}") from None

    def tensor(self, key: str) -> torch.Tensor:
        """A device view of the object's bytes (no copy)."""
        block = self.locate(key)
        return self.pool[block.offset : block.offset + block.length]

    async def put(self, meta: ObjectMeta, data: memoryview) -> ObjectMeta:
        if meta.key in self._objects:
            raise AlreadyExistsError(f"object {meta.key!r} is already in tier {self.name!r}")
        if len(data) != meta.size_bytes:
            raise InvalidArgumentError(
                f"object {meta.key!r}: {len(data)} bytes given, size_bytes says {meta.size_bytes}"
            )
        block = self.allocator.allocate(meta.size_bytes)
        try:
            t0 = time.perf_counter()
            await asyncio.to_thread(self._copy, block, data, True)
            self.write_meter.record(meta.size_bytes, time.perf_counter() - t0)
        except BaseException:
            self.allocator.free(block)
            raise
        self._objects[meta.key] = _Stored(meta, block)
        self._used += meta.size_bytes
        return meta

    async def read_into(self, key: str, dst: memoryview, *, tenant: str = "") -> ObjectMeta:
        stored = self._objects.get(key)
        if stored is None:
            raise NotFoundError(f"object {key!r} is not in tier {self.name!r}")
        t0 = time.perf_counter()
        await asyncio.to_thread(self._copy, stored.block, dst[: stored.meta.size_bytes], False)
        self.read_meter.record(stored.meta.size_bytes, time.perf_counter() - t0)
        return stored.meta

    def _copy(self, block: Block, host: memoryview, to_device: bool) -> None:
        """Copy through the pinned staging buffer in pieces (pageable copies are slower)."""
        import torch

        assert self._staging is not None
        host_t = torch.frombuffer(host, dtype=torch.uint8) if len(host) else None
        step = self.staging_bytes
        for start in range(0, block.length, step):
            n = min(step, block.length - start)
            dev = self.pool[block.offset + start : block.offset + start + n]
            stage = self._staging[:n]
            assert host_t is not None
            if to_device:
                stage.copy_(host_t[start : start + n])
                dev.copy_(stage, non_blocking=False)
            else:
                stage.copy_(dev, non_blocking=False)
                host_t[start : start + n].copy_(stage)
        torch.cuda.synchronize(self.device)

    async def delete(self, key: str, *, tenant: str = "") -> None:
        stored = self._objects.pop(key, None)
        if stored is None:
            raise NotFoundError(f"object {key!r} is not in tier {self.name!r}")
        self.allocator.free(stored.block)
        self._used -= stored.meta.size_bytes

    def get_meta(self, key: str) -> ObjectMeta:
        try:
            return self._objects[key].meta
        except KeyError:
            raise NotFoundError(f"object {key!r} is not in tier {self.name!r}") from None

    def metas(self) -> Iterator[ObjectMeta]:
        return (s.meta for s in list(self._objects.values()))

    def used_bytes(self) -> int:
        return self._used

    def object_count(self) -> int:
        return len(self._objects)
