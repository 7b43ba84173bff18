# ruff: noqa: PLR0917
# mypy: disable-error-code="untyped-decorator,no-untyped-def"
# Triton kernels: upper-case constexpr names and long positional argument lists are the
# Triton idiom; their parameters cannot carry Python type annotations.
"""Triton helpers shared by the kernels (imported only when a Triton backend runs).

``layer_runs``: the layers of a source as few 5-D ``[layers, num_blocks, block_size, H, D]``
views as the memory allows, so a kernel launches once over every layer (a grid dimension) rather
than once per layer: the launch itself costs ~25 us, which at 8k tokens was most of a score or
gather kernel's time on an H200 (gpu-check, issue 31).

``token_offset``: element offset of token ``t`` in one layer's ``[num_blocks, block_size, H, D]``
view (layout.py): ``block_table[t // block_size] * s_blk + (t % block_size) * s_slot``, int64.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from kvtierd.errors import InvalidArgumentError
from kvtierd.kernels.layout import KVSource

MAX_HEAD_DIM = 512


@triton.jit
def token_offset(bt_ptr, t, mask, block_size, s_blk, s_slot):
    blk = tl.load(bt_ptr + t // block_size, mask=mask, other=0).to(tl.int64)
    return blk * s_blk + (t % block_size).to(tl.int64) * s_slot


@dataclass(frozen=True, slots=True)
class LayerRun:
    """Layers ``first .. first + keys.shape[0] - 1`` as ``[layers, blocks, block_size, H, D]``."""

    first: int
    keys: torch.Tensor
    values: torch.Tensor


def _stacked(views: Sequence[torch.Tensor]) -> torch.Tensor | None:
    """``views`` as one tensor with a leading layer dimension when they are evenly spaced in
    memory with the same shape, strides and dtype, inside the first view's storage (a contiguous
    ``[L, ...]`` tensor); ``None`` otherwise (vLLM's caches, one tensor per layer).

    Runs before every launch, so it checks each view with the fewest tensor calls (address,
    shape, strides, dtype): with ``untyped_storage()`` and ``storage_offset()`` per view,
    ``layer_runs`` took 77 us at 32 layers on the H200's host (46 us now), of the ~270 us a
    knorm call spends on the host against its kernel's 128 us at 8k tokens (issue 31)."""
    first = views[0]
    if len(views) == 1:
        return first.unsqueeze(0)
    shape, strides, dtype = first.shape, first.stride(), first.dtype
    base, size = first.data_ptr(), first.element_size()
    step_bytes = views[1].data_ptr() - base
    if step_bytes <= 0 or step_bytes % size:
        return None
    for i, v in enumerate(views):
        if (
            v.data_ptr() != base + i * step_bytes
            or v.shape != shape
            or v.stride() != strides
            or v.dtype != dtype
        ):
            return None
    step = step_bytes // size
    # the stacked view reads the views' own memory, but through the first view's storage
    extent = 1 + sum((n - 1) * st for n, st in zip(shape, strides, strict=True))
    end = first.storage_offset() + (len(views) - 1) * step + extent
    if min(shape, default=1) == 0 or end * size > first.untyped_storage().nbytes():
        return None
    return first.as_strided((len(views), *shape), (step, *strides))


def layer_runs(
    layer_keys: Sequence[torch.Tensor], layer_values: Sequence[torch.Tensor]
) -> list[LayerRun]:
    """One run of every layer when K and V each stack (``_stacked``), else a run per layer."""
    k, v = _stacked(layer_keys), _stacked(layer_values)
    if k is not None and v is not None:
        return [LayerRun(0, k, v)]
    return [
        LayerRun(i, kl.unsqueeze(0), vl.unsqueeze(0))
        for i, (kl, vl) in enumerate(zip(layer_keys, layer_values, strict=True))
    ]


def source_runs(source: KVSource) -> list[LayerRun]:
    """``layer_runs`` of a source, or at once its one stacked run where it was made with one."""
    if source.stacked is not None:
        return [LayerRun(0, *source.stacked)]
    return layer_runs(source.layer_keys, source.layer_values)


def block_d(head_dim: int) -> int:
    if head_dim > MAX_HEAD_DIM:
        raise InvalidArgumentError(f"head_dim {head_dim} > {MAX_HEAD_DIM} is not supported")
    return max(16, int(triton.next_power_of_2(head_dim)))


def check_device(*tensors: torch.Tensor) -> None:
    """Triton needs CUDA tensors, or CPU tensors under ``TRITON_INTERPRET=1``."""
    import os

    for t in tensors:
        if t.device.type != "cuda" and os.environ.get("TRITON_INTERPRET") != "1":
            raise InvalidArgumentError(
                f"Triton backend got a tensor on {t.device}; use CUDA, or set "
                "TRITON_INTERPRET=1 before importing triton to run kernels on CPU"
            )
