# ruff: noqa: N803, PLR0917
# mypy: disable-error-code="untyped-decorator,no-untyped-def"
# Triton kernels: upper-case constexpr names and long positional argument lists are the
# Triton idiom; their parameters cannot carry Python type annotations.
"""Triton gather/compaction of kept tokens into dense ``[L, H, M, D]``, with RoPE delta fused.

One program per (KV head, block of kept slots) per layer: reads the kept rows of K and V
through the block table, writes them densely. Values (and keys without rotation) are copied
bit for bit; with rotation, keys become ``x * cos + x[partner] * sin_signed`` in float32
(``rope.py``'s tables and formula), cast back to the input dtype.

Rotation by style (``ROTATE``):

* ``HALVES`` (neox, Llama's ``rotate_half``): channel ``j`` pairs with ``j + r/2``, so each key
  row is loaded once as its two contiguous halves ``lo = x[:r/2]``, ``hi = x[r/2:r]`` (vectorized
  loads) and both outputs come from them: ``lo * cos + hi * sin_signed`` and
  ``hi * cos + lo * sin_signed``; channels ``>= r`` are copied. The first version loaded the
  row and then each channel's partner again through the ``partner`` index (a gather the
  compiler cannot vectorize): 25-33 % of the copy bandwidth on an H200 against 53-77 % without
  rotation (gpu-check, issue 31).
* ``PARTNER`` (gptj, adjacent pairs): the partner-index load, as before.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kvtierd.kernels._tl_common import block_d, check_device, source_runs, token_offset
from kvtierd.kernels.layout import KVSource
from kvtierd.kernels.rope import RopeSpec, rotation_tables

BLOCK_M = 32
NO_ROTATION, HALVES, PARTNER = 0, 1, 2


@triton.jit
def _gather_kernel(
    k_ptr, v_ptr, bt_ptr, kept_ptr, ok_ptr, ov_ptr, cos_ptr, sin_ptr, partner_ptr,
    H, N, M, D, block_size,
    ks_l, ks_blk, ks_slot, ks_h, ks_d, vs_l, vs_blk, vs_slot, vs_h, vs_d,
    os_l, os_h, os_m, os_d,
    R, ROTATE: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_H: tl.constexpr,
):  # fmt: skip
    h = tl.program_id(0).to(tl.int64)
    layer = tl.program_id(2).to(tl.int64)
    k_ptr += layer * ks_l
    v_ptr += layer * vs_l
    kept_ptr += layer * H * M
    ok_ptr += layer * os_l
    ov_ptr += layer * os_l
    j = tl.program_id(1) * BLOCK_M + tl.arange(0, BLOCK_M)
    t = tl.load(kept_ptr + h * M + j, mask=j < M, other=0)
    jm = (j < M) & (t >= 0) & (t < N)  # the launcher raises after the launch on any other
    d = tl.arange(0, BLOCK_D)
    dm = d < D
    mask = jm[:, None] & dm[None, :]
    k_row = token_offset(bt_ptr, t, jm, block_size, ks_blk, ks_slot) + h * ks_h
    v_row = token_offset(bt_ptr, t, jm, block_size, vs_blk, vs_slot) + h * vs_h
    o_row = h * os_h + j.to(tl.int64) * os_m
    d64 = d.to(tl.int64)
    v = tl.load(v_ptr + v_row[:, None] + d64[None, :] * vs_d, mask=mask, other=0.0)
    tl.store(ov_ptr + o_row[:, None] + d64[None, :] * os_d, v, mask=mask)
    if ROTATE == 1:  # HALVES
        # lo = channels [0, R/2), hi = [R/2, R): the pairs (j, j + R/2), each half contiguous
        i = tl.arange(0, BLOCK_H)
        im = i < R // 2
        hm = jm[:, None] & im[None, :]
        i64 = i.to(tl.int64)
        klo = k_ptr + k_row[:, None] + i64[None, :] * ks_d
        khi = klo + (R // 2) * ks_d
        lo = tl.load(klo, mask=hm, other=0.0).to(tl.float32)
        hi = tl.load(khi, mask=hm, other=0.0).to(tl.float32)
        c_lo = tl.load(cos_ptr + i, mask=im, other=1.0)[None, :]
        s_lo = tl.load(sin_ptr + i, mask=im, other=0.0)[None, :]
        c_hi = tl.load(cos_ptr + R // 2 + i, mask=im, other=1.0)[None, :]
        s_hi = tl.load(sin_ptr + R // 2 + i, mask=im, other=0.0)[None, :]
        olo = ok_ptr + o_row[:, None] + i64[None, :] * os_d
        ohi = olo + (R // 2) * os_d
        out_ty = ok_ptr.dtype.element_ty
        tl.store(olo, (lo * c_lo + hi * s_lo).to(out_ty), mask=hm)
        tl.store(ohi, (hi * c_hi + lo * s_hi).to(out_ty), mask=hm)
        mask = mask & (d >= R)[None, :]  # what is left of the row: channels past rotary_dim
    if ROTATE == 2:  # PARTNER
        p = tl.load(partner_ptr + d, mask=dm, other=0).to(tl.int64)
        k = tl.load(k_ptr + k_row[:, None] + d64[None, :] * ks_d, mask=mask, other=0.0)
        kp = tl.load(k_ptr + k_row[:, None] + p[None, :] * ks_d, mask=mask, other=0.0)
        c = tl.load(cos_ptr + d, mask=dm, other=1.0)
        s = tl.load(sin_ptr + d, mask=dm, other=0.0)
        kf = k.to(tl.float32) * c[None, :] + kp.to(tl.float32) * s[None, :]
        ko = kf.to(ok_ptr.dtype.element_ty)
        tl.store(ok_ptr + o_row[:, None] + d64[None, :] * os_d, ko, mask=mask)
    else:  # no rotation, or the channels past rotary_dim
        k = tl.load(k_ptr + k_row[:, None] + d64[None, :] * ks_d, mask=mask, other=0.0)
        tl.store(ok_ptr + o_row[:, None] + d64[None, :] * os_d, k, mask=mask)


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
    mode = (
        NO_ROTATION
        if tables is None or rope is None
        else HALVES
        if rope.style == "neox"
        else PARTNER
    )
    r = rope.rotary_dim if rope is not None else d
    for run in source_runs(source):
        k, v, first = run.keys, run.values, run.first
        ok, ov = out_k[first:], out_v[first:]
        _gather_kernel[(h, triton.cdiv(m, BLOCK_M), k.shape[0])](
            k, v, source.block_table, kept_c[first:], ok, ov, cos, sin, partner,
            h, source.num_tokens, m, d, source.block_size, *k.stride(), *v.stride(), *ok.stride(),
            r, ROTATE=mode, BLOCK_M=BLOCK_M, BLOCK_D=block_d(d),
            BLOCK_H=max(1, int(triton.next_power_of_2(r // 2))),
        )  # fmt: skip
    return out_k, out_v
