"""``knorm``: keep the keys with the smallest L2 norm (Devoto et al. 2024; kvpress KnormPress).

Score ``-||k_t||_2`` in float32 per (layer, KV head, token); low-norm keys draw the most
attention, so they are kept.
"""

from __future__ import annotations

import torch

from kvtierd.kernels.base import TokenDropMethod
from kvtierd.kernels.layout import KVSource


def key_norms(keys: torch.Tensor) -> torch.Tensor:
    """``||k||_2`` in float32: ``[L, H, N, D]`` -> ``[L, H, N]``."""
    kf = keys.to(torch.float32)
    return torch.sqrt((kf * kf).sum(dim=-1))


class KnormMethod(TokenDropMethod):
    name = "knorm"

    def score_reference(
        self, keys: torch.Tensor, values: torch.Tensor, queries: torch.Tensor | None
    ) -> torch.Tensor:
        return -key_norms(keys)

    def score_triton(self, source: KVSource, queries: torch.Tensor | None) -> torch.Tensor:
        from kvtierd.kernels import _tl_score

        return _tl_score.norm_scores(source, _tl_score.MODE_KNORM)
