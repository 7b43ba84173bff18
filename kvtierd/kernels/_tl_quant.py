# ruff: noqa: N803, N806, PLR0917
# mypy: disable-error-code="untyped-decorator,no-untyped-def"
# Triton kernels: upper-case constexpr names and long positional argument lists are the
# Triton idiom; their parameters cannot carry Python type annotations.
"""Triton KIVI quantize / dequantize kernels (spec: ``quant.py``).

Each program reads a tile ``[ROWS, BLOCK_C]`` of one (layer, head) — rows contiguous, so the
loads and the code stores are vectorized — once, keeps it in registers for both the min/max and
the encoding, and owns every quantization group in it:

* keys (``axis="channel"``): program per (layer*head, group of ``G`` tokens, block of
  ``BLOCK_C`` channels); min/max over the tile's rows (the ``G`` tokens) of each channel;
* values (``axis="token"``): program per (layer*head, block of ``ROWS`` tokens) over whole rows
  (``BLOCK_C = BLOCK_D``); the tile is viewed as ``[ROWS, BLOCK_C / GB, GB]``
  (``GB = min(G, BLOCK_D)``) and reduced over the last axis: min/max over the ``G`` channels of
  each token.

int4 packs channel pair ``(2i, 2i+1)`` by viewing the codes as ``[ROWS, BLOCK_C / 2, 2]`` and
splitting the pair. One launch covers every layer and head. The quotient
``(x - zero) / scale`` is the IEEE one, so codes match the torch reference bit for bit, but it
costs one division per group, not per element (``_codes``).

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
# Tile shapes and warps measured on an H200 at 32 layers x 8 heads x 128, 8k tokens, G = 32
# (issue 31), by bits. Keys: the whole row, 1 warp (int8) / 2 warps (int4) a [32, 128] tile:
# 41 % / 33 % of the copy bandwidth, against 22 % / 20 % with the 4 warps before: with fewer
# warps the min/max down the token axis needs fewer (none, with 1 warp) shared-memory round trips
# and barriers between warps; sm_90 compiles the 1-warp tile to 218 registers a thread, no spills.
# 64-channel tiles came to 26-32 %. Values: int8 [32, 128] with 4 warps 58 %; int4 [16, 128]
# with 2 warps 41 % (29 % before).
KEY_CHANNELS = 128
KEY_TILE_PER_WARP = {8: 4096, 4: 2048}  # elements of a keys' tile per warp
VALUE_ROWS = {8: 32, 4: 16}
VALUE_WARPS = {8: 4, 4: 2}


@triton.jit
def _div_rn(x, c: tl.constexpr):
    return tl.div_rn(x, tl.full(x.shape, c, tl.float32))


@triton.jit
def _codes(x, zero, scale, recip, QMAX: tl.constexpr):
    """``floor((x - zero) / scale + 0.5)`` clamped to ``[0, QMAX]`` (0 where ``scale`` is 0).

    The quotient is the IEEE one (``div.rn``) without a division per element: ``recip`` is the
    correctly rounded ``1 / scale`` of the element's group (one division per group); ``q0 = a
    * recip`` is within one ulp of ``a / scale``, the remainder ``a - q0 * scale`` is exact in
    one fma, and ``q0 + rem * recip`` rounded once is the correctly rounded quotient (Markstein's
    theorem). Where the remainder is NaN (``scale`` or ``a`` infinite) ``q0`` already is what
    the division gives (0 or inf). Per element: a mul and two fma instead of ``div.rn``'s
    reciprocal on the special-function unit (1/8 of the fma rate) and its refinement, which
    held the values' kernel to 37 % of the copy bandwidth on an H200 (79 % with an
    approximate division in its place, 52-65 % with this).
    """
    a = x - zero
    q0 = a * recip
    rem = tl.fma(-q0, scale, a)
    q = tl.where(rem == rem, tl.fma(rem, recip, q0), q0)  # noqa: PLR0124 (rem is not NaN)
    q = tl.floor(q + 0.5)
    q = tl.where(scale > 0, q, 0.0)
    return tl.minimum(tl.maximum(q, 0.0), QMAX).to(tl.uint8)


@triton.jit
def _recip(scale):
    """Correctly rounded ``1 / scale`` (1 where ``scale`` is 0: those codes are 0 anyway)."""
    return tl.div_rn(tl.full(scale.shape, 1.0, tl.float32), tl.where(scale > 0, scale, 1.0))


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
    ROWS: tl.constexpr, BLOCK_C: tl.constexpr, GB: tl.constexpr,
):  # fmt: skip
    lh = tl.program_id(0)
    l_ = (lh // H).to(tl.int64)
    h_ = (lh % H).to(tl.int64)
    r = tl.program_id(1) * ROWS + tl.arange(0, ROWS)  # tokens
    d = tl.program_id(2) * BLOCK_C + tl.arange(0, BLOCK_C)  # channels
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
        codes = _codes(x, z[None, :], s[None, :], _recip(s)[None, :], QMAX)
    else:  # groups of G channels per token: the row viewed as [BLOCK_D // GB, GB]
        NG: tl.constexpr = BLOCK_C // GB
        x3 = tl.reshape(x, [ROWS, NG, GB])
        m3 = tl.reshape(m, [ROWS, NG, GB])
        lo = tl.min(tl.where(m3, x3, float("inf")), axis=2)
        hi = tl.max(tl.where(m3, x3, float("-inf")), axis=2)
        z, s = _zero_scale(lo, hi, QMAX)  # [ROWS, NG]
        j = tl.program_id(2) * NG + tl.arange(0, NG)
        p = pbase + r64[:, None] * ps_r + j.to(tl.int64)[None, :] * ps_c
        pm = rm[:, None] & (j * G < D)[None, :]
        tl.store(s_ptr + p, s.to(tl.float16), mask=pm)
        tl.store(z_ptr + p, z.to(tl.float16), mask=pm)
        codes3 = _codes(x3, z[:, :, None], s[:, :, None], _recip(s)[:, :, None], QMAX)
        codes = tl.reshape(codes3, [ROWS, BLOCK_C])
    crow = c_ptr + l_ * cs_l + h_ * cs_h + r64[:, None] * cs_n
    if BITS == 4:
        even, odd = tl.split(tl.reshape(codes, [ROWS, BLOCK_C // 2, 2]))
        i = tl.program_id(2) * (BLOCK_C // 2) + tl.arange(0, BLOCK_C // 2)
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
    if per_channel:
        rows, bc = g, min(bd, KEY_CHANNELS)
        warps = max(1, min(8, rows * bc // KEY_TILE_PER_WARP[bits]))
    else:
        rows, bc = VALUE_ROWS[bits], bd
        warps = 8 if rows * bd > MAX_TILE else VALUE_WARPS[bits]
    grid = (lyr * h, triton.cdiv(n, rows), triton.cdiv(d, bc))
    _quant_kernel[grid](
        x, codes, scale, zero, h, n, d, *x.stride(), *codes.stride(), *scale.stride(),
        BITS=bits, G=g, PER_CHANNEL=per_channel, ROWS=rows, BLOCK_C=bc, GB=min(g, bd),
        num_warps=warps,
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
