"""Typed results of compression: a context's KV after token dropping and/or quantization."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import torch

QuantAxis = Literal["channel", "token"]


@dataclass(frozen=True, slots=True)
class QuantizedTensor:
    """KIVI-style asymmetric quantization of one ``[L, H, N, D]`` tensor (``quant.py``).

    ``codes``: uint8 ``[L, H, N, ceil(D * bits / 8)]``; with 4 bits, channel ``2i`` is the low
    nibble and ``2i + 1`` the high nibble of byte ``i``. ``axis="channel"`` (keys): ``scale`` /
    ``zero`` fp16 ``[L, H, ceil(N / G), D]``, one per channel per group of ``G`` tokens.
    ``axis="token"`` (values): ``[L, H, N, ceil(D / G)]``, one per token per group of ``G``
    channels. ``x ~= code * scale + zero``.
    """

    codes: torch.Tensor
    scale: torch.Tensor
    zero: torch.Tensor
    bits: int
    group_size: int
    axis: QuantAxis
    head_dim: int
    dtype: torch.dtype

    @property
    def shape(self) -> tuple[int, int, int, int]:
        lyr, h, n, _ = (int(x) for x in self.codes.shape)
        return lyr, h, n, self.head_dim

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (self.codes, self.scale, self.zero))


KVTensor = torch.Tensor | QuantizedTensor


@dataclass(frozen=True, slots=True)
class CompressedKV:
    """One context's KV in a variant's form.

    ``keys`` / ``values``: dense ``[L, H, M, D]`` in the input dtype, or :class:`QuantizedTensor`
    for ``+int8`` / ``+int4`` variants. ``kept``: int32 ``[L, H, M]``, ascending original
    positions of the kept tokens (``arange(N)`` for shape-preserving variants). ``rope_delta``:
    positions the keys were rotated by (``M - N`` when a rope spec was given, else 0).
    """

    keys: KVTensor
    values: KVTensor
    kept: torch.Tensor
    num_tokens: int
    variant: str
    rope_delta: int = 0

    @property
    def num_kept(self) -> int:
        return int(self.kept.shape[-1])

    @property
    def payload_bytes(self) -> int:
        """Bytes of keys + values (+ scales/zeros); equals ``variant_size_bytes``."""
        return sum(
            t.nbytes if isinstance(t, QuantizedTensor) else t.numel() * t.element_size()
            for t in (self.keys, self.values)
        )
