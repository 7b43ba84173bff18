"""The kernels' KIVI quantization round trip (:mod:`kvtierd.kernels.quant`) without packing
codes, for every bit width at once: what an estimator attends over for a quantized variant."""

from __future__ import annotations

from collections.abc import Sequence

import torch


def round_trips(
    x: torch.Tensor, bits: Sequence[int], group_size: int, axis: str
) -> dict[int, torch.Tensor]:
    """float32 ``x`` ``[..., N, D]`` quantized and dequantized at each of ``bits`` as the
    kernels' KIVI quantizer does (:mod:`kvtierd.kernels.quant`: the same float32 arithmetic, so
    the same values), without packing codes, the groups' min and max found once for every
    ``bits``: keys per channel in groups of ``group_size`` tokens (``axis="channel"``), values
    per token in groups of channels (``"token"``)."""
    dim = -2 if axis == "channel" else -1  # the grouped axis
    n = int(x.shape[dim])
    groups = -(-n // group_size)
    pad = groups * group_size - n
    if pad:  # the last entry again: a partial group's min and max are its own
        last = x.narrow(dim, n - 1, 1)
        x = torch.cat([x, last.expand(*(pad if i == x.dim() + dim else s for i, s in
                                         enumerate(x.shape)))], dim=dim)  # fmt: skip
    if axis == "channel":
        grouped = x.reshape(*x.shape[:-2], groups, group_size, x.shape[-1])
    else:
        grouped = x.reshape(*x.shape[:-1], groups, group_size)
    at = dim  # the within-group axis of `grouped` (-2: tokens of a channel group; -1: channels)
    lo, hi = grouped.amin(at, keepdim=True), grouped.amax(at, keepdim=True)
    zero = lo.to(torch.float16).to(torch.float32)
    out = {}
    for b in bits:
        qmax = float(2**b - 1)
        scale = ((hi - lo) / qmax).to(torch.float16).to(torch.float32)
        # a group of one value has scale 0 and dequantizes to ``zero`` whatever its codes (the
        # kernels zero them): dividing by 1 there keeps them finite, in place, with no mask
        safe = torch.where(scale > 0, scale, 1.0)
        codes = torch.sub(grouped, zero).div_(safe).add_(0.5).floor_().clamp_(0.0, qmax)
        out[b] = codes.mul_(scale).add_(zero).reshape(x.shape).narrow(dim, 0, n)
    return out
