"""``keydiff``: keep the keys least similar to the average key direction (Park et al. 2025;
kvpress KeyDiffPress).

Per (layer, KV head): anchor ``a = mean_t(k_t / max(||k_t||, 1e-12))``; score
``-cos(k_t, a) = -(k_t . a) / max(||k_t|| * ||a||, 1e-12)``, all in float32.
"""

from __future__ import annotations

import torch

from kvtierd.kernels.base import TokenDropMethod
from kvtierd.kernels.knorm import key_norms
from kvtierd.kernels.layout import KVSource

NORM_EPS = 1e-12


def keydiff_anchor(keys: torch.Tensor) -> torch.Tensor:
    """Mean unit key, float32 ``[L, H, D]``."""
    kf = keys.to(torch.float32)
    unit = kf / key_norms(keys).clamp_min(NORM_EPS).unsqueeze(-1)
    return unit.mean(dim=2)


class KeyDiffMethod(TokenDropMethod):
    name = "keydiff"

    def score_reference(
        self, keys: torch.Tensor, values: torch.Tensor, queries: torch.Tensor | None
    ) -> torch.Tensor:
        anchor = keydiff_anchor(keys)
        kf = keys.to(torch.float32)
        dot = (kf * anchor.unsqueeze(2)).sum(dim=-1)
        a_norm = torch.sqrt((anchor * anchor).sum(dim=-1)).unsqueeze(-1)
        return -dot / (key_norms(keys) * a_norm).clamp_min(NORM_EPS)

    def score_triton(self, source: KVSource, queries: torch.Tensor | None) -> torch.Tensor:
        from kvtierd.kernels import _tl_score

        return _tl_score.keydiff_scores(source)
