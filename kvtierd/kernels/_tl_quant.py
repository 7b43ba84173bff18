# ruff: noqa: N803, N806, PLR0917
# mypy: disable-error-code="untyped-decorator,no-untyped-def"
# Triton kernels: upper-case constexpr names and long positional argument lists are the
# Triton idiom; their parameters cannot carry Python type annotations.
"""Triton KIVI quantize / dequantize kernels (spec: ``quant.py``).

Each program reads a tile of whole rows ``[ROWS, BLOCK_D]`` of one (layer, head) — contiguous,
so the loads and the code stores are vectorized — and owns every quantization group in it:

* keys (``axis="channel"``): program per (layer*head, group of ``G`` tokens); min/max over the
  tile's rows (the ``G`` tokens) of each channel;
* values (``axis="token"``): program per (layer*head, block of ``ROWS`` tokens); the tile is
  viewed as ``[ROWS, BLOCK_D / GB, GB]`` (``GB = min(G, BLOCK_D)``) and reduced over the last
  axis: min/max over the ``G`` channels of each token.

int4 packs channel pair ``(2i, 2i+1)`` by viewing the codes as ``[ROWS, BLOCK_D / 2, 2]`` and
splitting the pair. One launch covers every layer and head. Division uses ``tl.div_rn``
(IEEE) so codes match the torch reference bit for bit.

(The first version loaded even and odd channels as two stride-2 tiles and stored int8 codes
byte by byte at stride 2, with values' programs a ``[32, G]`` sliver: 4-7 % of the copy
bandwidth on an H200, gpu-check 2026-11-26.)
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kvtierd.kernels._tl_common import block_d, check_device
from kvtierd.kernels.results import QuantAxis, QuantizedTensor

BLOCK_T = 32
MAX_TILE = 8192  # elements of x per program before more warps are given (register pressure)


@triton.jit
def _div_rn(x, c: tl.constexpr):
    return tl.div_rn(x, tl.full(x.shape, c, tl.float32))


@triton.jit
def _codes(x, zero, scale, QMAX: tl.constexpr):
    q = tl.floor(tl.div_rn(x - zero, tl.where(scale > 0, scale, 1.0)) + 0.5)
    q = tl.where(scale > 0, q, 0.0)
    return tl.minimum(tl.maximum(q, 0.0), QMAX).to(tl.uint8)


@triton.jit
def _zero_scale(lo, hi, QMAX: tl.constexpr):
    """fp16 ``zero`` and ``scale`` of groups with extremes ``lo``, ``hi`` (as float32)."""
    z = lo.to(tl.float16).to(tl.float32)
    s = _div_rn(hi - lo, QMAX).to(tl.float16).to(tl.float32)
    return z, s


@triton.jit
def _quant_kernel(
    x_ptr, c_ptr, s_ptr, z_ptr, H, N, D,
    xs_l, xs_h, xs_n, xs_d, cs_l, cs_h, cs_n, cs_d, ps_l, ps_h, ps_r, ps_c,
    BITS: tl.constexpr, G: tl.constexpr, PER_CHANNEL: tl.constexpr,
    ROWS: tl.constexpr, BLOCK_D: tl.constexpr, GB: tl.constexpr,
):  # fmt: skip
    lh = tl.program_id(0)
    l_ = (lh // H).to(tl.int64)
    h_ = (lh % H).to(tl.int64)
    r = tl.program_id(1) * ROWS + tl.arange(0, ROWS)  # tokens
    d = tl.arange(0, BLOCK_D)
    rm = r < N
    dm = d < D
    m = rm[:, None] & dm[None, :]
    r64, d64 = r.to(tl.int64), d.to(tl.int64)
    xrow = x_ptr + l_ * xs_l + h_ * xs_h + r64[:, None] * xs_n
    x = tl.load(xrow + d64[None, :] * xs_d, mask=m, other=0.0).to(tl.float32)
    QMAX: tl.constexpr = 2**BITS - 1
    pbase = l_ * ps_l + h_ * ps_h
    if PER_CHANNEL:  # one group = the ROWS (= G) tokens of this program, per channel
        lo = tl.min(tl.where(m, x, float("inf")), axis=0)
        hi = tl.max(tl.where(m, x, float("-inf")), axis=0)
        z, s = _zero_scale(lo, hi, QMAX)
        p = pbase + tl.program_id(1).to(tl.int64) * ps_r + d64 * ps_c
        tl.store(s_ptr + p, s.to(tl.float16), mask=dm)
        tl.store(z_ptr + p, z.to(tl.float16), mask=dm)
        codes = _codes(x, z[None, :], s[None, :], QMAX)
    else:  # groups of G channels per token: the row viewed as [BLOCK_D // GB, GB]
        NG: tl.constexpr = BLOCK_D // GB
        x3 = tl.reshape(x, [ROWS, NG, GB])
        m3 = tl.reshape(m, [ROWS, NG, GB])
        lo = tl.min(tl.where(m3, x3, float("inf")), axis=2)
        hi = tl.max(tl.where(m3, x3, float("-inf")), axis=2)
        z, s = _zero_scale(lo, hi, QMAX)  # [ROWS, NG]
        j = tl.arange(0, NG)
        p = pbase + r64[:, None] * ps_r + j.to(tl.int64)[None, :] * ps_c
        pm = rm[:, None] & (j * G < D)[None, :]
        tl.store(s_ptr + p, s.to(tl.float16), mask=pm)
        tl.store(z_ptr + p, z.to(tl.float16), mask=pm)
        codes3 = _codes(x3, z[:, :, None], s[:, :, None], QMAX)
        codes = tl.reshape(codes3, [ROWS, BLOCK_D])
    crow = c_ptr + l_ * cs_l + h_ * cs_h + r64[:, None] * cs_n
    if BITS == 4:
        even, odd = tl.split(tl.reshape(codes, [ROWS, BLOCK_D // 2, 2]))
        i = tl.arange(0, BLOCK_D // 2)
        packed = even | (odd << 4)
        tl.store(
            crow + i.to(tl.int64)[None, :] * cs_d, packed, mask=rm[:, None] & (2 * i < D)[None, :]
        )
    else:
        tl.store(crow + d64[None, :] * cs_d, codes, mask=m)


@triton.jit
def _dequant_kernel(
    c_ptr, s_ptr, z_ptr, o_ptr, H, N, D,
    cs_l, cs_h, cs_n, ps_l, ps_h, ps_r, ps_c,
    BITS: tl.constexpr, G: tl.constexpr, PER_CHANNEL: tl.constexpr,
    BLOCK_T: tl.constexpr, BLOCK_D: tl.constexpr,
):  # fmt: skip
    lh = tl.program_id(0)
    l_ = (lh // H).to(tl.int64)
    h_ = (lh % H).to(tl.int64)
    r = tl.program_id(1) * BLOCK_T + tl.arange(0, BLOCK_T)
    d = tl.arange(0, BLOCK_D)
    m = (r < N)[:, None] & (d < D)[None, :]
    r64, d64 = r.to(tl.int64), d.to(tl.int64)
    crow = c_ptr + l_ * cs_l + h_ * cs_h + r64[:, None] * cs_n
    if BITS == 4:
        byte = tl.load(crow + (d64 // 2)[None, :], mask=m, other=0)
        code = tl.where((d % 2)[None, :] == 0, byte & 0xF, byte >> 4)
    else:
        code = tl.load(crow + d64[None, :], mask=m, other=0)
    if PER_CHANNEL:
        p = l_ * ps_l + h_ * ps_h + (r64 // G)[:, None] * ps_r + d64[None, :] * ps_c
    else:
        p = l_ * ps_l + h_ * ps_h + r64[:, None] * ps_r + (d64 // G)[None, :] * ps_c
    s = tl.load(s_ptr + p, mask=m, other=0.0).to(tl.float32)
    z = tl.load(z_ptr + p, mask=m, other=0.0).to(tl.float32)
    x = code.to(tl.float32) * s + z
    o = o_ptr + ((l_ * H + h_) * N + r64)[:, None] * D + d64[None, :]
    tl.store(o, x.to(o_ptr.dtype.element_ty), mask=m)


def quantize(x: torch.Tensor, bits: int, group_size: int, axis: QuantAxis) -> QuantizedTensor:
    """Arguments already validated by ``quant.check_quant_args``."""
    check_device(x)
    lyr, h, n, d = (int(s) for s in x.shape)
    g = group_size
    codes = torch.empty((lyr, h, n, -(-d * bits // 8)), dtype=torch.uint8, device=x.device)
    per_channel = axis == "channel"
    pshape = (lyr, h, -(-n // g), d) if per_channel else (lyr, h, n, -(-d // g))
    scale = torch.empty(pshape, dtype=torch.float16, device=x.device)
    zero = torch.empty(pshape, dtype=torch.float16, device=x.device)
    bd = block_d(d)
    rows = g if per_channel else BLOCK_T
    grid = (lyr * h, triton.cdiv(n, rows))
    _quant_kernel[grid](
        x, codes, scale, zero, h, n, d, *x.stride(), *codes.stride(), *scale.stride(),
        BITS=bits, G=g, PER_CHANNEL=per_channel, ROWS=rows, BLOCK_D=bd, GB=min(g, bd),
        num_warps=8 if rows * bd > MAX_TILE else 4,
    )  # fmt: skip
    return QuantizedTensor(
        codes=codes, scale=scale, zero=zero, bits=bits, group_size=g, axis=axis,
        head_dim=d, dtype=x.dtype,
    )  # fmt: skip


def dequantize(q: QuantizedTensor) -> torch.Tensor:
    check_device(q.codes)
    lyr, h, n, d = q.shape
    out = torch.empty((lyr, h, n, d), dtype=q.dtype, device=q.codes.device)
    codes, scale, zero = q.codes.contiguous(), q.scale.contiguous(), q.zero.contiguous()
    grid = (lyr * h, triton.cdiv(n, BLOCK_T))
    _dequant_kernel[grid](
        codes, scale, zero, out, h, n, d, *codes.stride()[:3], *scale.stride(),
        BITS=q.bits, G=q.group_size, PER_CHANNEL=q.axis == "channel",
        BLOCK_T=BLOCK_T, BLOCK_D=block_d(d),
    )  # fmt: skip
    return out
