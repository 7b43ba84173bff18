"""A context's variants as dense KV at their original positions, and a left-padded batch of them.

Evaluators compare the model over the original KV with the model over each variant's KV. They
compress with our kernels (:func:`kvtierd.kernels.api.compress_dense`) *without* the RoPE delta
rotation: kept keys stay at their original positions, so a later query at position ``p >= N``
sees every kept key at its true distance (the rotated form that vLLM loads is the same up to one
rounding, DESIGN.md §1). Quantized variants are dequantized (:func:`dense_kv`), so the quality
includes the quantization error.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from kvtierd.kernels.api import compress_dense, dense_kv
from kvtierd.profiler.quality import DEFAULT_FORM, ContextKV, StoredForm
from kvtierd.sizes import count_unit


@dataclass(frozen=True, slots=True, eq=False)
class VariantKV:
    """Dense ``[L, H, M, D]`` keys/values of one variant, keys at their original positions."""

    variant: str
    keys: torch.Tensor
    values: torch.Tensor

    @property
    def num_kept(self) -> int:
        return int(self.keys.shape[2])


@dataclass(frozen=True, slots=True, eq=False)
class PaddedBatch:
    """``B`` variants left-padded to ``M_max`` slots.

    ``keys``/``values``: ``[B, L, H, M_max, D]`` (zeros in padding); ``valid``: bool
    ``[B, M_max]`` (padding is at the left, so real entries are always the last ``M_b``).
    """

    keys: torch.Tensor
    values: torch.Tensor
    valid: torch.Tensor


def variant_kvs(
    kv: ContextKV, variants: Sequence[str], form: StoredForm = DEFAULT_FORM
) -> list[VariantKV]:
    """Compress ``kv`` into each variant with the kernels (snapkv gets ``kv.window_queries``)."""
    out = []
    for name in variants:
        c = compress_dense(
            kv.keys,
            kv.values,
            name,
            queries=kv.window_queries,
            chunk_tokens=count_unit(name, form.chunk_tokens),
            group_size=form.group_size,
        )
        k, v = dense_kv(c)
        out.append(VariantKV(variant=name, keys=k, values=v))
    return out


def pad_left(items: Sequence[VariantKV]) -> PaddedBatch:
    """Stack variants of different kept counts into one left-padded batch."""
    if not items:
        raise ValueError("pad_left needs at least one variant")
    m_max = max(x.num_kept for x in items)
    ref = items[0].keys
    lyr, h, _, d = (int(s) for s in ref.shape)
    keys = ref.new_zeros((len(items), lyr, h, m_max, d))
    values = ref.new_zeros((len(items), lyr, h, m_max, d))
    valid = torch.zeros((len(items), m_max), dtype=torch.bool, device=ref.device)
    for b, x in enumerate(items):
        start = m_max - x.num_kept
        keys[b, :, :, start:] = x.keys
        values[b, :, :, start:] = x.values
        valid[b, start:] = True
    return PaddedBatch(keys=keys, values=values, valid=valid)
