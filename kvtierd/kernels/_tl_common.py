# ruff: noqa: PLR0917
# mypy: disable-error-code="untyped-decorator,no-untyped-def"
# Triton kernels: upper-case constexpr names and long positional argument lists are the
# Triton idiom; their parameters cannot carry Python type annotations.
"""Triton helpers shared by the kernels (imported only when a Triton backend runs).

``token_offset``: element offset of token ``t`` in one layer's ``[num_blocks, block_size, H, D]``
view (layout.py): ``block_table[t // block_size] * s_blk + (t % block_size) * s_slot``, int64.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kvtierd.errors import InvalidArgumentError

MAX_HEAD_DIM = 512


@triton.jit
def token_offset(bt_ptr, t, mask, block_size, s_blk, s_slot):
    blk = tl.load(bt_ptr + t // block_size, mask=mask, other=0).to(tl.int64)
    return blk * s_blk + (t % block_size).to(tl.int64) * s_slot


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
