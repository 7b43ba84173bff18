# ruff: noqa: N803, PLR0917
# mypy: disable-error-code="untyped-decorator,no-untyped-def"
# Triton kernels: upper-case constexpr names and long positional argument lists are the
# Triton idiom; their parameters cannot carry Python type annotations.
"""Triton top-k support: compact the kept positions of each (layer, head) row, ascending.

The ``M``-th largest score ``thr`` comes from ``torch.topk`` (its values are deterministic even
where its indices are not); the kernel then keeps every ``s > thr`` and the first
``M - count(s > thr)`` positions with ``s == thr`` — exactly the stable-sort rule of
``base.select_reference`` — writing positions with a running prefix sum (Zipage App. C.6's
two-pointer compaction, one program per row).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kvtierd.kernels._tl_common import check_device

BLOCK = 1024


@triton.jit
def _compact_kernel(s_ptr, thr_ptr, need_eq_ptr, out_ptr, N, M, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    thr = tl.load(thr_ptr + row)
    need_eq = tl.load(need_eq_ptr + row)
    written = tl.full([], 0, tl.int32)
    eq_seen = tl.full([], 0, tl.int32)
    for start in range(0, N, BLOCK):
        t = start + tl.arange(0, BLOCK)
        m = t < N
        s = tl.load(s_ptr + row * N + t, mask=m, other=0.0)
        gt = (s > thr) & m
        eq = (s == thr) & m
        eq_rank = tl.cumsum(eq.to(tl.int32), 0) + eq_seen
        keep = gt | (eq & (eq_rank <= need_eq))
        pos = tl.cumsum(keep.to(tl.int32), 0) - 1 + written
        tl.store(out_ptr + row * M + pos, t.to(tl.int32), mask=keep)
        written += tl.sum(keep.to(tl.int32), 0)
        eq_seen += tl.sum(eq.to(tl.int32), 0)


def select_kept(scores: torch.Tensor, num_kept: int) -> torch.Tensor:
    """Kept positions, int32 ``[L, H, M]`` ascending; ``scores`` already validated."""
    check_device(scores)
    lyr, h, n = scores.shape
    s = scores.contiguous()
    thr = torch.topk(s, num_kept, dim=-1).values[..., -1].contiguous()
    need_eq = (num_kept - (s > thr.unsqueeze(-1)).sum(dim=-1)).to(torch.int32).contiguous()
    out = torch.empty((lyr, h, num_kept), dtype=torch.int32, device=s.device)
    _compact_kernel[(lyr * h,)](s, thr, need_eq, out, n, num_kept, BLOCK=BLOCK)
    return out
