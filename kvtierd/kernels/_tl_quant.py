# ruff: noqa: N803, N806, PLR0917
# mypy: disable-error-code="untyped-decorator,no-untyped-def"
# Triton kernels: upper-case constexpr names and long positional argument lists are the
# Triton idiom; their parameters cannot carry Python type annotations.
"""Triton KIVI quantize / dequantize kernels (spec: ``quant.py``).

Each program reads a tile of one (layer, head) — rows contiguous, so the loads and the code
stores are vectorized — once, keeps it in registers for both the min/max and the encoding, and
owns every quantization group in it:

* keys (``axis="channel"``, ``_quant_keys_kernel``): program per (layer*head, group of ``G``
  tokens, block of ``BLOCK_C`` channels); min/max over the tile's rows (the ``G`` tokens) of
  each channel;
* values (``axis="token"``, ``_quant_values_kernel``): program per (layer*head, block of
  ``ROWS`` tokens) over whole rows; the tile is viewed as ``[ROWS, BLOCK_C / GB, GB]``
  (``GB = min(G, BLOCK_D)``) and reduced over the last axis: min/max over the ``G`` channels of
  each token.

int4 packs channel pair ``(2i, 2i+1)`` by viewing the codes as ``[..., 2]`` pairs and
splitting them. One launch covers every layer and head. The quotient ``(x - zero) / scale`` is
the IEEE one, so codes match the torch reference bit for bit, but it costs no division per
element (``_codes``) and none of the IEEE kind per group (``_zero_scale_recip``).

These kernels are bound by instruction issue, not memory, unless each element costs few
instructions (the H200 moves a bf16 element in ~0.5 ns of copy time, in which its 132 SMs
issue ~16 warp instructions per 32 elements): sm_90 SASS, counted with Triton's ``ptxas`` and
``cuobjdump`` on a [32, 128] bf16 tile, 33-39 instructions an element before
``_codes``/``_zero_scale_recip`` and the mask-free ``EVEN`` tiles, 16-19 after.

(The first version loaded even and odd channels as two stride-2 tiles and stored int8 codes
byte by byte at stride 2, with values' programs a ``[32, G]`` sliver: 4-7 % of the copy
bandwidth on an H200, gpu-check 2026-11-26.)
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl
from triton.language.extra import libdevice

from kvtierd.kernels._tl_common import block_d, check_device
from kvtierd.kernels.results import QuantAxis, QuantizedTensor

BLOCK_T = 32
TILE_BYTES_PER_WARP = 8192  # of x, per warp of a program (registers: ~200 a thread at 8 KiB)
# One warp a [32, 128] tile, keys and values, int8 and int4. Keys: the min/max down the token
# axis then needs no shared-memory round trip between warps (measured on an H200 at 8k tokens,
# issue 31: 41 % of the copy with 1 warp, 22 % with 4, before the instruction cuts). Values:
# with a whole [32, 128] tile a thread holds 16 channels of a token's group, not 8, so the
# group's reductions and parameters cost half as much an element (sm_90 SASS: 15.9
# instructions an element, 18.4 with 4 warps, 23.9 with int4's [16, 128] and 2 warps before).
KEY_CHANNELS = 128
VALUE_ROWS = 32


@triton.jit
def _codes(x, zero, scale, recip, QMAX: tl.constexpr, FLOOR_BY_ADD: tl.constexpr):
    """``floor((x - zero) / scale + 0.5)`` clamped to ``[0, QMAX]`` (0 where ``scale`` is 0),
    as int32 whose low byte is the code.

    The quotient is the IEEE one (``div.rn``) without a division per element: ``recip`` is the
    correctly rounded ``1 / scale`` of the element's group (one division per group, 0 where
    ``scale`` is not > 0); ``q0 = a * recip`` is within one ulp of ``a / scale``, the remainder
    ``a - q0 * scale`` is exact in one fma, and ``q0 + rem * recip`` rounded once is the
    correctly rounded quotient (Markstein's theorem). With ``recip`` 0 the quotient comes out
    0 (``scale`` 0) or NaN (``scale`` inf or NaN: the remainder is NaN), and the clamp's
    ``max`` turns NaN into 0: the reference's codes in both cases, without a select per
    element. Clamped to ``[0, QMAX]``, ``floor`` is the truncation, done as ``2**23 + y``
    rounded down (``add.rm``: an add on the fma pipe, the code in the low bits) rather than a
    float-to-int conversion (1/8 of the fma rate, as ``floor`` itself was); the interpreter,
    which has no libdevice, converts.

    Issue-bound before (H200): 33-39 SASS instructions an element, 16 of them on the ALU pipe
    (half rate: min/max, selects, compares, masks) plus ``floor`` and ``cvt`` on the 1/8-rate
    pipe; a select per element alone had held the values' kernel at 58 % (79 % without it).
    """
    a = x - zero
    q0 = a * recip
    rem = tl.fma(-q0, scale, a)
    q = tl.fma(rem, recip, q0)
    y = tl.minimum(tl.maximum(q + 0.5, 0.0), QMAX)
    if FLOOR_BY_ADD:
        return libdevice.add_rd(y, 8388608.0).to(tl.int32, bitcast=True)
    return y.to(tl.int32)


@triton.jit
def _div_by(d, QMAX: tl.constexpr):
    """Correctly rounded ``d / QMAX`` without a division: ``1 / QMAX`` rounded (a constant),
    then Markstein's correction as in ``_codes`` (the quotient itself where ``d`` is inf)."""
    C: tl.constexpr = 1.0 / QMAX
    q0 = d * C
    rem = tl.fma(-q0, QMAX, d)
    return tl.where(rem == rem, tl.fma(rem, C, q0), q0)  # noqa: PLR0124 (rem is not NaN)


@triton.jit
def _zero_scale_recip(lo, hi, QMAX: tl.constexpr):
    """fp16 ``zero`` and ``scale`` of groups with extremes ``lo``, ``hi``, as float32, and the
    correctly rounded ``1 / scale`` (0 where ``scale`` is 0, NaN where inf: see ``_codes``).

    Per group, but a group is only 8 (values) or 16 (keys) of a thread's elements, so this is
    kept to a few fma: ``1 / scale`` is an approximate reciprocal and one Newton step, which
    rounds correctly here because ``scale`` is an fp16 value: ``1 / scale`` lies at least
    ``2**-25`` (relative) from a float32 rounding midpoint, the step leaves an error near
    ``2**-42`` (the IEEE division with its range checks and slow-path branch cost ~12
    instructions a group, twice)."""
    lo = lo.to(tl.float32)
    z = lo.to(tl.float16).to(tl.float32)
    s = _div_by(hi.to(tl.float32) - lo, QMAX).to(tl.float16).to(tl.float32)
    pos = s > 0
    sv = tl.where(pos, s, 1.0)
    y0 = 1.0 / sv
    r = tl.fma(y0, tl.fma(-sv, y0, 1.0), y0)
    return z, s, tl.where(pos, r, 0.0)


@triton.jit
def _pack(pairs):
    """int32 codes ``[..., k, 2]`` (code in the low byte) -> uint8 ``[..., k]``: int4 packs
    channel pair ``(2i, 2i+1)`` into byte ``i`` (low nibble first; the bits above 8 drop)."""
    even, odd = tl.split(pairs)
    return (even | (odd << 4)).to(tl.uint8)


@triton.jit
def _tile_start(x_ptr, c_ptr, H, xs_l, xs_h, xs_n, xs_d, cs_l, cs_h, cs_n,
                ROWS: tl.constexpr, BLOCK_C: tl.constexpr, BITS: tl.constexpr):  # fmt: skip
    """Pointers to the first element of this program's tile and its first code byte; 64-bit
    offsets once per tile, 32-bit inside it (the launcher checks that they fit)."""
    lh = tl.program_id(0)
    l_ = (lh // H).to(tl.int64)
    h_ = (lh % H).to(tl.int64)
    r0 = tl.program_id(1).to(tl.int64) * ROWS
    c0 = tl.program_id(2).to(tl.int64) * BLOCK_C
    x_ptr += l_ * xs_l + h_ * xs_h + r0 * xs_n + c0 * xs_d
    c_ptr += l_ * cs_l + h_ * cs_h + r0 * cs_n + c0 * BITS // 8
    return x_ptr, c_ptr, lh.to(tl.int64)


@triton.jit
def _quant_keys_kernel(
    x_ptr, c_ptr, s_ptr, z_ptr, H, N, D,
    xs_l, xs_h, xs_n, xs_d, cs_l, cs_h, cs_n, ps_lh, ps_r,
    BITS: tl.constexpr, ROWS: tl.constexpr, BLOCK_C: tl.constexpr,
    EVEN: tl.constexpr, FLOOR_BY_ADD: tl.constexpr,
):  # fmt: skip
    """Keys, per channel: one group (``ROWS = G`` tokens) x ``BLOCK_C`` channels of one
    (layer, head) a program. ``EVEN``: the tile lies wholly inside ``[N, D]`` (no masks: a
    mask costs selects and compares per element).

    The tile is ``[ROWS, BLOCK_C / 8, 8]``: runs of 8 channels, so that a thread holds 8
    channels of a row, not the 16 that a 16-byte store of int8 codes would give it; the 32
    tokens of a group then span 2 threads rather than 4, and each thread's 16 elements of a
    group (not 8) share the group's shuffles and its zero, scale and reciprocal."""
    x_ptr, c_ptr, lh = _tile_start(
        x_ptr, c_ptr, H, xs_l, xs_h, xs_n, xs_d, cs_l, cs_h, cs_n, ROWS, BLOCK_C, BITS
    )
    NB: tl.constexpr = BLOCK_C // 8
    QMAX: tl.constexpr = 2**BITS - 1
    rr = tl.arange(0, ROWS)[:, None, None]
    ch = tl.arange(0, NB)[:, None] * 8 + tl.arange(0, 8)[None, :]  # [NB, 8]
    c0 = tl.program_id(2) * BLOCK_C
    cm = c0 + ch < D
    xp = x_ptr + rr * xs_n + ch[None, :, :] * xs_d
    if EVEN:
        x = tl.load(xp)
        lo, hi = tl.min(x, axis=0), tl.max(x, axis=0)
    else:
        m = (tl.program_id(1) * ROWS + rr < N) & cm[None, :, :]
        x = tl.load(xp, mask=m, other=0.0)
        lo = tl.min(tl.where(m, x, float("inf")), axis=0)
        hi = tl.max(tl.where(m, x, float("-inf")), axis=0)
    z, s, recip = _zero_scale_recip(lo, hi, QMAX)  # [NB, 8]
    p = lh * ps_lh + tl.program_id(1).to(tl.int64) * ps_r + c0 + ch
    tl.store(s_ptr + p, s.to(tl.float16), mask=cm)
    tl.store(z_ptr + p, z.to(tl.float16), mask=cm)
    codes = _codes(x.to(tl.float32), z[None], s[None], recip[None], QMAX, FLOOR_BY_ADD)
    if BITS == 4:
        cp = c_ptr + rr * cs_n + (tl.arange(0, NB)[:, None] * 4 + tl.arange(0, 4)[None, :])[None]
        codes = _pack(tl.reshape(codes, [ROWS, NB, 4, 2]))
    else:
        cp = c_ptr + rr * cs_n + ch[None, :, :]
    if EVEN:
        tl.store(cp, codes)
    elif BITS == 4:
        ch2 = tl.arange(0, NB)[:, None] * 8 + tl.arange(0, 4)[None, :] * 2  # even channels
        tl.store(cp, codes, mask=(tl.program_id(1) * ROWS + rr < N) & (c0 + ch2 < D)[None])
    else:
        tl.store(cp, codes, mask=m)


@triton.jit
def _quant_values_kernel(
    x_ptr, c_ptr, s_ptr, z_ptr, H, N, D,
    xs_l, xs_h, xs_n, xs_d, cs_l, cs_h, cs_n, ps_lh, ps_r,
    BITS: tl.constexpr, G: tl.constexpr, ROWS: tl.constexpr, BLOCK_C: tl.constexpr,
    GB: tl.constexpr, EVEN: tl.constexpr, FLOOR_BY_ADD: tl.constexpr,
):  # fmt: skip
    """Values, per token: ``ROWS`` whole rows (``BLOCK_C = BLOCK_D``) of one (layer, head) a
    program, viewed as ``[ROWS, BLOCK_C / GB, GB]`` (``GB = min(G, BLOCK_D)``) and reduced over
    the last axis: min/max over the ``G`` channels of each token. ``EVEN`` as for keys."""
    x_ptr, c_ptr, lh = _tile_start(
        x_ptr, c_ptr, H, xs_l, xs_h, xs_n, xs_d, cs_l, cs_h, cs_n, ROWS, BLOCK_C, BITS
    )
    NG: tl.constexpr = BLOCK_C // GB
    QMAX: tl.constexpr = 2**BITS - 1
    rr = tl.arange(0, ROWS)
    dd = tl.arange(0, BLOCK_C)
    rm = tl.program_id(1) * ROWS + rr < N
    xp = x_ptr + rr[:, None] * xs_n + dd[None, :] * xs_d
    if EVEN:
        x = tl.reshape(tl.load(xp), [ROWS, NG, GB])
        lo, hi = tl.min(x, axis=2), tl.max(x, axis=2)
    else:
        m = rm[:, None] & (dd < D)[None, :]
        m3 = tl.reshape(m, [ROWS, NG, GB])
        x = tl.reshape(tl.load(xp, mask=m, other=0.0), [ROWS, NG, GB])
        lo = tl.min(tl.where(m3, x, float("inf")), axis=2)
        hi = tl.max(tl.where(m3, x, float("-inf")), axis=2)
    z, s, recip = _zero_scale_recip(lo, hi, QMAX)  # [ROWS, NG]
    j = tl.arange(0, NG)
    r = tl.program_id(1).to(tl.int64) * ROWS + rr
    p = lh * ps_lh + r[:, None] * ps_r + j[None, :]
    pm = rm[:, None] & (j * G < D)[None, :]
    tl.store(s_ptr + p, s.to(tl.float16), mask=pm)
    tl.store(z_ptr + p, z.to(tl.float16), mask=pm)
    codes3 = _codes(
        x.to(tl.float32), z[:, :, None], s[:, :, None], recip[:, :, None], QMAX, FLOOR_BY_ADD
    )
    codes = tl.reshape(codes3, [ROWS, BLOCK_C])
    if BITS == 4:
        i = tl.arange(0, BLOCK_C // 2)
        cp = c_ptr + rr[:, None] * cs_n + i[None, :]
        cm = rm[:, None] & (2 * i < D)[None, :]
        codes = _pack(tl.reshape(codes, [ROWS, BLOCK_C // 2, 2]))
    else:
        cp = c_ptr + rr[:, None] * cs_n + dd[None, :]
        cm = rm[:, None] & (dd < D)[None, :]
    if EVEN:
        tl.store(cp, codes)
    else:
        tl.store(cp, codes, mask=cm)


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
    per_channel = axis == "channel"
    bd = block_d(d)
    rows, bc = (g, min(bd, KEY_CHANNELS)) if per_channel else (VALUE_ROWS, bd)
    warps = max(1, min(8, rows * bc * x.element_size() // TILE_BYTES_PER_WARP))
    if rows * abs(x.stride(2)) + bc * abs(x.stride(3)) >= 2**31:
        x = x.contiguous()  # a tile's offsets are 32-bit (never so for a KV cache's strides)
    codes = torch.empty((lyr, h, n, -(-d * bits // 8)), dtype=torch.uint8, device=x.device)
    pshape = (lyr, h, -(-n // g), d) if per_channel else (lyr, h, n, -(-d // g))
    scale = torch.empty(pshape, dtype=torch.float16, device=x.device)
    zero = torch.empty(pshape, dtype=torch.float16, device=x.device)
    grid = (lyr * h, triton.cdiv(n, rows), triton.cdiv(d, bc))
    args = (
        x, codes, scale, zero, h, n, d, *x.stride(), *codes.stride()[:3],
        scale.stride(1), scale.stride(2),
    )  # fmt: skip
    even = n % rows == 0 and d % bc == 0
    floor_by_add = os.environ.get("TRITON_INTERPRET") != "1"
    if per_channel:
        _quant_keys_kernel[grid](
            *args, BITS=bits, ROWS=rows, BLOCK_C=bc, EVEN=even, FLOOR_BY_ADD=floor_by_add,
            num_warps=warps,
        )  # fmt: skip
    else:
        _quant_values_kernel[grid](
            *args, BITS=bits, G=g, ROWS=rows, BLOCK_C=bc, GB=min(g, bd), EVEN=even,
            FLOOR_BY_ADD=floor_by_add, num_warps=warps,
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
