"""``int8`` / ``int4``: KIVI-style asymmetric quantization (Liu et al. 2024, KIVI).

Keys are quantized per channel in groups of ``G`` tokens (``axis="channel"``), values per token
in groups of ``G`` channels (``axis="token"``) — keys have outlier channels, values do not.
Per group, in float32::

    zero  = fp16(min(x))          scale = fp16((max(x) - min(x)) / (2**bits - 1))
    code  = clamp(floor((x - zero) / scale + 0.5), 0, 2**bits - 1)   (0 where scale == 0)
    x'    = code * scale + zero   (float32, cast to the original dtype)

Shape-preserving: ``N`` and ``D`` stay; layout in :class:`~kvtierd.kernels.results.QuantizedTensor`.
int4 packs two codes per byte (channel ``2i`` low nibble), so it needs an even ``D``. The round
trip error is at most ``scale / 2`` plus the fp16 rounding of ``zero`` and ``scale`` (tests).
Values must lie in fp16's range (true of KV in practice); the group size defaults to 32.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from kvtierd.errors import InvalidArgumentError
from kvtierd.kernels.base import Backend, resolve_backend
from kvtierd.kernels.layout import SUPPORTED_DTYPES
from kvtierd.kernels.results import QuantAxis, QuantizedTensor
from kvtierd.sizes import DEFAULT_GROUP_SIZE


def check_quant_args(x: torch.Tensor, bits: int, group_size: int, axis: str) -> None:
    if not isinstance(x, torch.Tensor) or x.dim() != 4:
        raise InvalidArgumentError(f"quantize needs a [L, H, N, D] tensor, got {x!r:.80}")
    if x.dtype not in SUPPORTED_DTYPES:
        raise InvalidArgumentError(f"quantize: dtype {x.dtype} not in {SUPPORTED_DTYPES}")
    if bits not in (4, 8):
        raise InvalidArgumentError(f"bits must be 8 or 4, got {bits}")
    if group_size < 2 or group_size & (group_size - 1):
        raise InvalidArgumentError(f"group_size must be a power of two >= 2, got {group_size}")
    if axis not in ("channel", "token"):
        raise InvalidArgumentError(f"axis must be 'channel' or 'token', got {axis!r}")
    if bits == 4 and x.shape[-1] % 2:
        raise InvalidArgumentError(
            f"int4 packs channel pairs: head_dim must be even, got {x.shape[-1]}"
        )
    if min(x.shape) < 1:
        raise InvalidArgumentError(f"quantize: empty tensor {tuple(x.shape)}")


def _group_min_max_last(x: torch.Tensor, g: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Min and max over groups of ``g`` along the last dim (partial last group): ``[..., ng]``."""
    n = x.shape[-1]
    ng = -(-n // g)
    pad = ng * g - n
    lo = F.pad(x, (0, pad), value=float("inf")).reshape(*x.shape[:-1], ng, g).amin(-1)
    hi = F.pad(x, (0, pad), value=float("-inf")).reshape(*x.shape[:-1], ng, g).amax(-1)
    return lo, hi


def _expand_last(p: torch.Tensor, g: int, n: int) -> torch.Tensor:
    return p.to(torch.float32).repeat_interleave(g, dim=-1)[..., :n]


def quantize_reference(
    x: torch.Tensor, bits: int, group_size: int = DEFAULT_GROUP_SIZE, axis: QuantAxis = "token"
) -> QuantizedTensor:
    """Torch spec of the quantizer (module docstring)."""
    check_quant_args(x, bits, group_size, axis)
    qmax = float(2**bits - 1)
    xf = x.to(torch.float32)
    xg = xf.transpose(-1, -2) if axis == "channel" else xf  # grouped axis last
    lo, hi = _group_min_max_last(xg, group_size)
    zero = lo.to(torch.float16)
    scale = ((hi - lo) / qmax).to(torch.float16)
    n = xg.shape[-1]
    z32, s32 = _expand_last(zero, group_size, n), _expand_last(scale, group_size, n)
    codes = torch.floor((xg - z32) / s32 + 0.5)
    codes = torch.where(s32 > 0, codes, torch.zeros_like(codes)).clamp(0.0, qmax).to(torch.uint8)
    if axis == "channel":
        codes, zero, scale = (
            codes.transpose(-1, -2),
            zero.transpose(-1, -2),
            scale.transpose(-1, -2),
        )
    if bits == 4:
        codes = codes[..., 0::2] | (codes[..., 1::2] << 4)
    return QuantizedTensor(
        codes=codes.contiguous(),
        scale=scale.contiguous(),
        zero=zero.contiguous(),
        bits=bits,
        group_size=group_size,
        axis=axis,
        head_dim=int(x.shape[-1]),
        dtype=x.dtype,
    )


def unpack_codes(q: QuantizedTensor) -> torch.Tensor:
    """uint8 codes ``[L, H, N, D]`` (int4 nibbles unpacked)."""
    if q.bits == 8:
        return q.codes
    lo, hi = q.codes & 0xF, q.codes >> 4
    return torch.stack([lo, hi], dim=-1).flatten(-2)[..., : q.head_dim]


def dequantize_reference(q: QuantizedTensor) -> torch.Tensor:
    codes = unpack_codes(q).to(torch.float32)
    g = q.group_size
    if q.axis == "channel":
        n = codes.shape[-2]
        s = _expand_last(q.scale.transpose(-1, -2), g, n).transpose(-1, -2)
        z = _expand_last(q.zero.transpose(-1, -2), g, n).transpose(-1, -2)
    else:
        s = _expand_last(q.scale, g, q.head_dim)
        z = _expand_last(q.zero, g, q.head_dim)
    return (codes * s + z).to(q.dtype)


def quantize(
    x: torch.Tensor,
    bits: int,
    group_size: int = DEFAULT_GROUP_SIZE,
    axis: QuantAxis = "token",
    backend: Backend = "auto",
) -> QuantizedTensor:
    if resolve_backend(backend, x.device) == "torch":
        return quantize_reference(x, bits, group_size, axis)
    from kvtierd.kernels import _tl_quant

    check_quant_args(x, bits, group_size, axis)
    return _tl_quant.quantize(x, bits, group_size, axis)


def dequantize(q: QuantizedTensor, backend: Backend = "auto") -> torch.Tensor:
    if resolve_backend(backend, q.codes.device) == "torch":
        return dequantize_reference(q)
    from kvtierd.kernels import _tl_quant

    return _tl_quant.dequantize(q)


def quantize_kv(
    keys: torch.Tensor,
    values: torch.Tensor,
    bits: int,
    group_size: int = DEFAULT_GROUP_SIZE,
    backend: Backend = "auto",
) -> tuple[QuantizedTensor, QuantizedTensor]:
    """Keys per channel (``axis="channel"``), values per token (``axis="token"``)."""
    return (
        quantize(keys, bits, group_size, "channel", backend),
        quantize(values, bits, group_size, "token", backend),
    )
