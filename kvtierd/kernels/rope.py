"""RoPE delta rotation: move already-rotated keys by a constant number of positions.

A token-dropped context keeps ``M`` of ``N`` entries; vLLM maps KV slot ``i`` to position ``i``,
so every kept key is rotated once by ``delta = M - N`` (DESIGN.md §1): RoPE is a rotation by
``position * inv_freq``, so rotating a key rotated at position ``p`` by ``delta`` gives the key
at ``p + delta`` and every distance to a later query is unchanged.

Only ``inv_freq`` enters (Llama-3 / linear scaling are folded into it by the model); a YaRN
``mscale`` multiplies cos/sin at the original rotation and is already in the keys, so it is not
re-applied. Not valid for ALiBi, dynamic-NTK/LongRoPE (frequencies depend on length), M-RoPE.

Pairing of channels (``r = rotary_dim``, channels ``>= r`` pass through unchanged):

* ``neox`` (Llama, HF ``rotate_half``): channel ``j`` pairs with ``j + r/2``, angle index ``j``;
* ``gptj``: channel ``2j`` pairs with ``2j + 1``, angle index ``j``.

Per channel ``d`` with partner ``p(d)``: ``out[d] = x[d] * cos[d] + x[p(d)] * sin_signed[d]``,
``sin_signed = -sin`` on the first member of a pair and ``+sin`` on the second, computed in
fp32 from tables made once in fp64 (:func:`rotation_tables`), then cast to the input dtype.
The Triton gather uses the same tables and formula.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import torch

from kvtierd.errors import InvalidArgumentError

RopeStyle = Literal["neox", "gptj"]


@dataclass(frozen=True, slots=True)
class RopeSpec:
    """A model's rotary embedding: ``inv_freq`` (``rotary_dim / 2`` values), style, dims."""

    inv_freq: tuple[float, ...]
    head_dim: int
    style: RopeStyle = "neox"

    def __post_init__(self) -> None:
        r = 2 * len(self.inv_freq)
        if r < 2 or r > self.head_dim:
            raise InvalidArgumentError(
                f"rotary_dim = 2 * len(inv_freq) = {r} must be in [2, head_dim={self.head_dim}]"
            )
        if self.style not in ("neox", "gptj"):
            raise InvalidArgumentError(f"rope style must be 'neox' or 'gptj', got {self.style!r}")

    @property
    def rotary_dim(self) -> int:
        return 2 * len(self.inv_freq)

    @classmethod
    def standard(
        cls,
        head_dim: int,
        *,
        theta: float = 10000.0,
        rotary_dim: int | None = None,
        style: RopeStyle = "neox",
    ) -> RopeSpec:
        """``inv_freq[j] = theta ** (-2j / rotary_dim)`` (no scaling)."""
        r = head_dim if rotary_dim is None else rotary_dim
        if r < 2 or r % 2 or r > head_dim:
            raise InvalidArgumentError(f"rotary_dim must be even in [2, {head_dim}], got {r}")
        inv = (theta ** (-torch.arange(0, r, 2, dtype=torch.float64) / r)).tolist()
        return cls(inv_freq=tuple(float(x) for x in inv), head_dim=head_dim, style=style)

    @classmethod
    def from_inv_freq(
        cls, inv_freq: torch.Tensor, head_dim: int, *, style: RopeStyle = "neox"
    ) -> RopeSpec:
        """From a model's ``rotary_emb.inv_freq`` buffer."""
        return cls(
            inv_freq=tuple(float(x) for x in inv_freq.detach().double().cpu().tolist()),
            head_dim=head_dim,
            style=style,
        )


@dataclass(frozen=True, slots=True)
class RotationTables:
    """Per-channel ``[D]`` fp32 ``cos``, ``sin_signed`` and int32 ``partner`` for one delta."""

    cos: torch.Tensor
    sin_signed: torch.Tensor
    partner: torch.Tensor


def rotation_tables(spec: RopeSpec, delta: int, device: torch.device) -> RotationTables:
    """Tables for rotating by ``delta`` positions (angles in fp64, stored fp32).

    Built on the host as one ``[3, D]`` float32 block (cos, signed sin, the partner indices'
    int32 bits) and moved in one copy: each copy from pageable memory waits for the device,
    and a gather with rotation waits before its launch, while the device idles."""
    d, half = spec.head_dim, spec.rotary_dim // 2
    ang = float(delta) * torch.tensor(spec.inv_freq, dtype=torch.float64)
    c, s = torch.cos(ang).to(torch.float32), torch.sin(ang).to(torch.float32)
    # the pairs as slices (index tensors cost ~20 us a write on the host)
    if spec.style == "neox":
        first, second = slice(0, half), slice(half, 2 * half)
    else:
        first, second = slice(0, 2 * half, 2), slice(1, 2 * half, 2)
    block = torch.zeros((3, d), dtype=torch.float32)
    block[0] = 1.0
    block[0, first], block[0, second] = c, c
    block[1, first], block[1, second] = -s, s
    channels = torch.arange(d, dtype=torch.int32)
    partner = channels.clone()
    partner[first], partner[second] = channels[second], channels[first]
    block[2] = partner.view(torch.float32)
    on_device = block.to(device)
    return RotationTables(
        cos=on_device[0], sin_signed=on_device[1], partner=on_device[2].view(torch.int32)
    )


def rotate_reference(x: torch.Tensor, tables: RotationTables) -> torch.Tensor:
    """Rotate ``[..., D]`` keys with ``tables`` (the spec the Triton gather is held to)."""
    xf = x.to(torch.float32)
    partner = xf.index_select(-1, tables.partner.to(torch.int64))
    return (xf * tables.cos + partner * tables.sin_signed).to(x.dtype)


def rotate_keys(x: torch.Tensor, spec: RopeSpec, delta: int) -> torch.Tensor:
    """Reference: keys ``[..., D]`` rotated by ``delta`` positions."""
    if x.shape[-1] != spec.head_dim:
        raise InvalidArgumentError(
            f"keys have head_dim {x.shape[-1]}, rope spec says {spec.head_dim}"
        )
    return rotate_reference(x, rotation_tables(spec, delta, x.device))
