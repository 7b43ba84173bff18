"""Opening the daemon's gpu-tier pools in a co-located CUDA process (torch CUDA IPC).

A lease asked with ``device_ok`` on an object in a gpu tier names the tier's pool (its CUDA
IPC handle) and the object's block in it. The pool is opened once per handle and kept while
the client lives; each lease is a view into it, valid until the lease is released.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from kvtierd.errors import InvalidArgumentError
from kvtierd.rpc import kvtier_pb2 as pb

if TYPE_CHECKING:
    import torch

    from kvtierd.client.buffers import ArenaMap


class DevicePools:
    def __init__(self) -> None:
        # Keyed as torch's rebuild_cuda_tensor keys its cache: one cudaMalloc segment (one
        # handle) can hold several storages, told apart by their offset in it.
        self._pools: dict[tuple[bytes, int], torch.Tensor] = {}

    def tensor(self, lease: pb.Lease, arena: ArenaMap) -> torch.Tensor:
        """A ``uint8`` tensor over a ``device_ok`` lease's bytes: in the daemon's gpu pool
        when the object is there, else a CPU tensor over its bytes in the arena (no copy)."""
        if lease.HasField("device"):
            return self.region(lease.device)
        import torch

        return torch.frombuffer(arena.region(lease.region), dtype=torch.uint8)

    def region(self, r: pb.DeviceRegion) -> torch.Tensor:
        """A ``uint8`` CUDA tensor over the object's bytes in the daemon's pool (no copy)."""
        key = (r.pool.handle, r.pool.storage_offset_bytes)
        pool = self._pools.get(key)
        if pool is None:
            pool = self._pools[key] = _open(r.pool)
        if r.offset + r.length > pool.numel():
            raise InvalidArgumentError(
                f"device region [{r.offset}, {r.offset + r.length}) outside the pool of "
                f"tier {r.tier!r} ({pool.numel()} bytes)"
            )
        return pool[r.offset : r.offset + r.length]

    def close(self) -> None:
        self._pools.clear()


def _open(h: pb.CudaIpcHandle) -> torch.Tensor:
    import torch

    if not torch.cuda.is_available():
        raise InvalidArgumentError(
            "the daemon leased a gpu-tier object in place, but this process has no CUDA; "
            "ask without device_ok to get a copy in the arena"
        )
    torch.cuda._lazy_init()  # type: ignore[no-untyped-call]
    storage_cls: Any = torch.UntypedStorage
    storage = storage_cls._new_shared_cuda(
        h.device,
        h.handle,
        h.storage_size_bytes,
        h.storage_offset_bytes,
        h.ref_counter_handle,
        h.ref_counter_offset,
        h.event_handle,
        h.event_sync_required,
    )
    pool = torch.empty(0, dtype=torch.uint8, device=torch.device("cuda", h.device))
    return pool.set_(storage, 0, (h.storage_size_bytes,), (1,))
