# ruff: noqa: N803, N806, PLR0917
# mypy: disable-error-code="untyped-decorator,no-untyped-def"
# Triton kernels: upper-case constexpr names and long positional argument lists are the
# Triton idiom; their parameters cannot carry Python type annotations.
"""Triton KIVI quantize / dequantize kernels (spec: ``quant.py``).

Each program owns whole quantization groups, loading even and odd channels as two tiles so
int4 can pack channel pair ``(2i, 2i+1)`` into one byte without a reshape:

* keys (``axis="channel"``): program per (layer*head, token group, channel block); min/max
  over the ``G`` tokens of each channel;
* values (``axis="token"``): program per (layer*head, token block, channel group); min/max over
  the ``G`` channels of each token.

Division uses ``tl.div_rn`` (IEEE) so codes match the torch reference bit for bit.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kvtierd.kernels._tl_common import block_d, check_device
from kvtierd.kernels.results import QuantAxis, QuantizedTensor

BLOCK_T = 32


@triton.jit
def _div_rn(x, c: tl.constexpr):
    return tl.div_rn(x, tl.full(x.shape, c, tl.float32))


@triton.jit
def _codes(x, zero, scale, QMAX: tl.constexpr):
    q = tl.floor(tl.div_rn(x - zero, tl.where(scale > 0, scale, 1.0)) + 0.5)
    q = tl.where(scale > 0, q, 0.0)
    return tl.minimum(tl.maximum(q, 0.0), QMAX).to(tl.uint8)


@triton.jit
def _store_codes(c_ptr, row, i, ce, co, mask_e, mask_o, cs_d, BITS: tl.constexpr):
    i64 = i.to(tl.int64)
    if BITS == 4:
        packed = ce | (co << 4)
        tl.store(c_ptr + row + i64[None, :] * cs_d, packed, mask=mask_e)
    else:
        tl.store(c_ptr + row + (2 * i64)[None, :] * cs_d, ce, mask=mask_e)
        tl.store(c_ptr + row + (2 * i64 + 1)[None, :] * cs_d, co, mask=mask_o)


@triton.jit
def _quant_kernel(
    x_ptr, c_ptr, s_ptr, z_ptr, H, N, D,
    xs_l, xs_h, xs_n, xs_d, cs_l, cs_h, cs_n, cs_d, ps_l, ps_h, ps_r, ps_c,
    BITS: tl.constexpr, G: tl.constexpr, PER_CHANNEL: tl.constexpr,
    ROWS: tl.constexpr, HALF: tl.constexpr,
):  # fmt: skip
    lh = tl.program_id(0)
    l_ = (lh // H).to(tl.int64)
    h_ = (lh % H).to(tl.int64)
    r = tl.program_id(1) * ROWS + tl.arange(0, ROWS)  # tokens
    i = tl.program_id(2) * HALF + tl.arange(0, HALF)  # channel pairs
    de, do = 2 * i, 2 * i + 1
    rm = r < N
    me = rm[:, None] & (de < D)[None, :]
    mo = rm[:, None] & (do < D)[None, :]
    base = x_ptr + l_ * xs_l + h_ * xs_h + r.to(tl.int64)[:, None] * xs_n
    xe = tl.load(base + de.to(tl.int64)[None, :] * xs_d, mask=me, other=0.0).to(tl.float32)
    xo = tl.load(base + do.to(tl.int64)[None, :] * xs_d, mask=mo, other=0.0).to(tl.float32)
    QMAX: tl.constexpr = 2**BITS - 1
    if PER_CHANNEL:  # one group = the ROWS (= G) tokens of this program, per channel
        lo_e = tl.min(tl.where(me, xe, float("inf")), axis=0)
        hi_e = tl.max(tl.where(me, xe, float("-inf")), axis=0)
        lo_o = tl.min(tl.where(mo, xo, float("inf")), axis=0)
        hi_o = tl.max(tl.where(mo, xo, float("-inf")), axis=0)
        ze = lo_e.to(tl.float16).to(tl.float32)
        se = _div_rn(hi_e - lo_e, QMAX).to(tl.float16).to(tl.float32)
        zo = lo_o.to(tl.float16).to(tl.float32)
        so = _div_rn(hi_o - lo_o, QMAX).to(tl.float16).to(tl.float32)
        g = tl.program_id(1).to(tl.int64)
        pbase = l_ * ps_l + h_ * ps_h + g * ps_r
        tl.store(s_ptr + pbase + de * ps_c, se.to(tl.float16), mask=de < D)
        tl.store(z_ptr + pbase + de * ps_c, ze.to(tl.float16), mask=de < D)
        tl.store(s_ptr + pbase + do * ps_c, so.to(tl.float16), mask=do < D)
        tl.store(z_ptr + pbase + do * ps_c, zo.to(tl.float16), mask=do < D)
        ce = _codes(xe, ze[None, :], se[None, :], QMAX)
        co = _codes(xo, zo[None, :], so[None, :], QMAX)
    else:  # one group = the 2*HALF (= G) channels of this program, per token
        lo = tl.minimum(
            tl.min(tl.where(me, xe, float("inf")), axis=1),
            tl.min(tl.where(mo, xo, float("inf")), axis=1),
        )
        hi = tl.maximum(
            tl.max(tl.where(me, xe, float("-inf")), axis=1),
            tl.max(tl.where(mo, xo, float("-inf")), axis=1),
        )
        z = lo.to(tl.float16).to(tl.float32)
        s = _div_rn(hi - lo, QMAX).to(tl.float16).to(tl.float32)
        g = tl.program_id(2).to(tl.int64)
        pbase = l_ * ps_l + h_ * ps_h + r.to(tl.int64) * ps_r + g * ps_c
        tl.store(s_ptr + pbase, s.to(tl.float16), mask=rm)
        tl.store(z_ptr + pbase, z.to(tl.float16), mask=rm)
        ce = _codes(xe, z[:, None], s[:, None], QMAX)
        co = _codes(xo, z[:, None], s[:, None], QMAX)
    crow = c_ptr + l_ * cs_l + h_ * cs_h + r.to(tl.int64)[:, None] * cs_n
    _store_codes(crow, 0, i, ce, co, me, mo, cs_d, BITS)


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
    if per_channel:
        rows, half = g, max(8, block_d(d) // 2)
        grid = (lyr * h, triton.cdiv(n, g), triton.cdiv(d, 2 * half))
    else:
        rows, half = BLOCK_T, g // 2
        grid = (lyr * h, triton.cdiv(n, BLOCK_T), triton.cdiv(d, g))
    _quant_kernel[grid](
        x, codes, scale, zero, h, n, d, *x.stride(), *codes.stride(), *scale.stride(),
        BITS=bits, G=g, PER_CHANNEL=per_channel, ROWS=rows, HALF=half,
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
