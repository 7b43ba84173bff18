"""Turning numpy arrays and torch tensors into bytes views and back, and mapping the arena.

Nothing here copies unless it must: a contiguous array is viewed as bytes as it is; an object
read from the arena is copied once into the caller's buffer (or a new array), or handed out
as a zero-copy view under a lease.
"""

from __future__ import annotations

import contextlib
import mmap
import os
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np
import numpy.typing as npt

from kvtierd.errors import InvalidArgumentError
from kvtierd.rpc import kvtier_pb2 as pb

if TYPE_CHECKING:
    import torch


@dataclass(frozen=True, slots=True)
class Payload:
    """A put's bytes and what to record about them."""

    data: memoryview
    dtype: str
    shape: tuple[int, ...]


def _is_torch(obj: object) -> bool:
    return type(obj).__module__.startswith("torch") and hasattr(obj, "untyped_storage")


def as_payload(data: Any) -> Payload:
    """bytes / bytearray / memoryview / numpy array / CPU torch tensor -> a bytes view."""
    if isinstance(data, bytes | bytearray | memoryview):
        view = memoryview(data).cast("B")
        return Payload(view, "uint8", (len(view),))
    if isinstance(data, np.ndarray):
        arr = np.ascontiguousarray(data)
        return Payload(arr.reshape(-1).view(np.uint8).data, arr.dtype.name, arr.shape)
    if _is_torch(data):
        t: torch.Tensor = data
        if t.device.type != "cpu":
            t = t.cpu()
        import torch

        flat = t.contiguous().reshape(-1).view(torch.uint8)
        dtype = str(t.dtype).removeprefix("torch.")
        return Payload(flat.numpy().data, dtype, tuple(t.shape))
    raise InvalidArgumentError(
        f"cannot store a {type(data).__name__}; pass bytes, a numpy array or a torch tensor"
    )


def bytes_view(out: Any) -> memoryview:
    """A writable bytes view of a caller's output buffer (numpy array or CPU torch tensor)."""
    if isinstance(out, np.ndarray):
        if not out.flags.c_contiguous or not out.flags.writeable:
            raise InvalidArgumentError("the output array must be C-contiguous and writeable")
        return out.reshape(-1).view(np.uint8).data
    if _is_torch(out):
        import torch

        if out.device.type != "cpu" or not out.is_contiguous():
            raise InvalidArgumentError("the output tensor must be a contiguous CPU tensor")
        view: memoryview = out.reshape(-1).view(torch.uint8).numpy().data
        return view
    if isinstance(out, bytearray | memoryview):
        return memoryview(out).cast("B")
    raise InvalidArgumentError(f"cannot read into a {type(out).__name__}")


PARALLEL_COPY_BYTES = 8 << 20


def copy_bytes(dst: memoryview, src: memoryview, pool: ThreadPoolExecutor | None = None) -> None:
    """memcpy through numpy (which releases the GIL). With a pool, a large copy is split in
    two halves copied at once: two threads move 24.5 GB/s here against 20.6 for one
    (notes/machine-limits.md)."""
    if len(dst) != len(src):
        raise InvalidArgumentError(f"buffer of {len(dst)} bytes for an object of {len(src)}")
    d, s = np.frombuffer(dst, np.uint8), np.frombuffer(src, np.uint8)
    if pool is None or len(d) < PARALLEL_COPY_BYTES:
        np.copyto(d, s)
        return
    half = len(d) // 2 // 4096 * 4096
    other = pool.submit(np.copyto, d[half:], s[half:])
    np.copyto(d[:half], s[:half])
    other.result()


def new_array(spec: pb.ObjectSpec) -> npt.NDArray[Any]:
    """An empty numpy array shaped like a stored object (bfloat16 comes back as uint16)."""
    name = "uint16" if spec.dtype == "bfloat16" else (spec.dtype or "uint8")
    try:
        dtype = np.dtype(name)
    except TypeError:
        dtype = np.dtype(np.uint8)
    shape = tuple(spec.shape) if spec.shape else (spec.size_bytes // dtype.itemsize,)
    return np.empty(shape, dtype)


def new_tensor(spec: pb.ObjectSpec) -> torch.Tensor:
    import torch

    dtype = getattr(torch, spec.dtype or "uint8", None)
    if not isinstance(dtype, torch.dtype):
        raise InvalidArgumentError(f"stored dtype {spec.dtype!r} is not a torch dtype")
    shape = tuple(spec.shape) if spec.shape else (spec.size_bytes // dtype.itemsize,)
    return torch.empty(shape, dtype=dtype)


class ArenaMap:
    """The client's mapping of the daemon's arena, remapped when the daemon restarts."""

    def __init__(self) -> None:
        self._id = ""
        self._mmap: mmap.mmap | None = None
        self._view: memoryview | None = None

    def region(self, r: pb.ArenaRegion) -> memoryview:
        if r.arena_id != self._id:
            self._map(r.arena_path, r.arena_id)
        assert self._view is not None
        return self._view[r.offset : r.offset + r.length]

    def _map(self, path: str, arena_id: str) -> None:
        self.close()
        fd = os.open(path, os.O_RDWR)
        try:
            self._mmap = mmap.mmap(fd, os.fstat(fd).st_size)
        finally:
            os.close(fd)
        advice = getattr(mmap, "MADV_HUGEPAGE", None)
        if advice is not None:  # huge pages make copies ~1.6x faster (storage/arena.py)
            with contextlib.suppress(OSError):
                self._mmap.madvise(advice)
        self._view = memoryview(self._mmap)
        self._id = arena_id

    def close(self) -> None:
        if self._view is not None:
            try:
                self._view.release()
                if self._mmap is not None:
                    self._mmap.close()
            except BufferError:
                pass  # a caller still holds a zero-copy view; the mapping dies with it
        self._view = self._mmap = None
        self._id = ""
