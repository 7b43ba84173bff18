# ruff: noqa: N803, PLR0917
# mypy: disable-error-code="untyped-decorator,no-untyped-def"
# Triton kernels: upper-case constexpr names and long positional argument lists are the
# Triton idiom; their parameters cannot carry Python type annotations.
"""Triton gather/compaction of kept tokens into dense ``[L, H, M, D]``, with RoPE delta fused.

One program per (KV head, block of kept slots) per layer: reads the kept rows of K and V
through the block table, writes them densely. Values (and keys without rotation) are copied
bit for bit; with rotation, keys become ``x * cos + x[partner] * sin_signed`` in float32
(``rope.py``'s tables and formula), cast back to the input dtype.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kvtierd.kernels._tl_common import block_d, check_device, layer_runs, token_offset
from kvtierd.kernels.layout import KVSource
from kvtierd.kernels.rope import RopeSpec, rotation_tables

BLOCK_M = 32


@triton.jit
def _gather_kernel(
    k_ptr, v_ptr, bt_ptr, kept_ptr, ok_ptr, ov_ptr, cos_ptr, sin_ptr, partner_ptr,
    H, M, D, block_size,
    ks_l, ks_blk, ks_slot, ks_h, ks_d, vs_l, vs_blk, vs_slot, vs_h, vs_d,
    os_l, os_h, os_m, os_d,
    ROTATE: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_D: tl.constexpr,
):  # fmt: skip
    h = tl.program_id(0).to(tl.int64)
    layer = tl.program_id(2).to(tl.int64)
    k_ptr += layer * ks_l
    v_ptr += layer * vs_l
    kept_ptr += layer * H * M
    ok_ptr += layer * os_l
    ov_ptr += layer * os_l
    j = tl.program_id(1) * BLOCK_M + tl.arange(0, BLOCK_M)
    jm = j < M
    d = tl.arange(0, BLOCK_D)
    dm = d < D
    mask = jm[:, None] & dm[None, :]
    t = tl.load(kept_ptr + h * M + j, mask=jm, other=0)
    k_row = token_offset(bt_ptr, t, jm, block_size, ks_blk, ks_slot) + h * ks_h
    v_row = token_offset(bt_ptr, t, jm, block_size, vs_blk, vs_slot) + h * vs_h
    o_row = h * os_h + j.to(tl.int64) * os_m
    d64 = d.to(tl.int64)
    k = tl.load(k_ptr + k_row[:, None] + d64[None, :] * ks_d, mask=mask, other=0.0)
    v = tl.load(v_ptr + v_row[:, None] + d64[None, :] * vs_d, mask=mask, other=0.0)
    if ROTATE:
        p = tl.load(partner_ptr + d, mask=dm, other=0).to(tl.int64)
        kp = tl.load(k_ptr + k_row[:, None] + p[None, :] * ks_d, mask=mask, other=0.0)
        c = tl.load(cos_ptr + d, mask=dm, other=1.0)
        s = tl.load(sin_ptr + d, mask=dm, other=0.0)
        kf = k.to(tl.float32) * c[None, :] + kp.to(tl.float32) * s[None, :]
        k = kf.to(ok_ptr.dtype.element_ty)
    tl.store(ok_ptr + o_row[:, None] + d64[None, :] * os_d, k, mask=mask)
    tl.store(ov_ptr + o_row[:, None] + d64[None, :] * os_d, v, mask=mask)


def gather(
    source: KVSource, kept: torch.Tensor, rope: RopeSpec | None, delta: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """Dense ``[L, H, M, D]`` keys (rotated when ``rope`` and ``delta``) and values."""
    check_device(source.layer_keys[0], kept)
    lyr, h, d = source.num_layers, source.num_kv_heads, source.head_dim
    m = int(kept.shape[-1])
    shape = (lyr, h, m, d)
    out_k = torch.empty(shape, dtype=source.dtype, device=source.device)
    out_v = torch.empty(shape, dtype=source.dtype, device=source.device)
    if m == 0:
        return out_k, out_v
    rotate = rope is not None and delta != 0
    tables = rotation_tables(rope, delta, source.device) if rope is not None and rotate else None
    kept_c = kept.contiguous()
    cos = tables.cos if tables is not None else out_k
    sin = tables.sin_signed if tables is not None else out_k
    partner = tables.partner if tables is not None else kept_c
    for run in layer_runs(source.layer_keys, source.layer_values):
        k, v, first = run.keys, run.values, run.first
        ok, ov = out_k[first:], out_v[first:]
        _gather_kernel[(h, triton.cdiv(m, BLOCK_M), k.shape[0])](
            k, v, source.block_table, kept_c[first:], ok, ov, cos, sin, partner,
            h, m, d, source.block_size, *k.stride(), *v.stride(), *ok.stride(),
            ROTATE=rotate, BLOCK_M=BLOCK_M, BLOCK_D=block_d(d),
        )  # fmt: skip
    return out_k, out_v
