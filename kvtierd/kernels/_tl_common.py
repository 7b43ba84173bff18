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
    """``views`` as one tensor with a leading layer dimension when they are evenly spaced
    slices of one storage with the same shape and strides (a contiguous ``[L, ...]`` tensor);
    ``None`` otherwise (vLLM's caches, one tensor per layer)."""
    first = views[0]
    if len(views) == 1:
        return first.unsqueeze(0)
    ptr = first.untyped_storage().data_ptr()
    step = views[1].storage_offset() - first.storage_offset()
    for i, v in enumerate(views):
        if (
            v.shape != first.shape
            or v.stride() != first.stride()
            or v.dtype != first.dtype
            or v.untyped_storage().data_ptr() != ptr
            or v.storage_offset() != first.storage_offset() + i * step
        ):
            return None
    if step <= 0:
        return None
    return first.as_strided((len(views), *first.shape), (step, *first.stride()))


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
