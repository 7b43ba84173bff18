"""``paged_eviction``: PagedEviction's attention-free score (Chitty-Venkata et al., §4.1, Alg. 1).

Token score ``S_i = ||V_i||_2 / max(||K_i||_2, 1e-12)`` in float32.

* ``paged_eviction`` (token mode, Alg. 2 prefill eviction): keep the top-M tokens by ``S_i``.
* ``paged_eviction_block`` (block mode): pages of ``page_tokens`` (default 16) consecutive
  tokens; page score = mean of its tokens' ``S_i`` (the last page may be partial: mean over
  its tokens); whole pages are kept or dropped, and the first and the most recent page are
  always kept (score ``+inf``). The kept count is whole pages (``variants.py`` rule 4).
"""

from __future__ import annotations

import torch

from kvtierd.kernels.base import TokenDropMethod
from kvtierd.kernels.knorm import key_norms
from kvtierd.kernels.layout import KVSource
from kvtierd.kernels.variants import COUNT_RULES, CountRule

NORM_EPS = 1e-12


def value_key_ratio(keys: torch.Tensor, values: torch.Tensor) -> torch.Tensor:
    """``||V_i|| / ||K_i||``: ``[L, H, N, D]`` x2 -> float32 ``[L, H, N]``."""
    return key_norms(values) / key_norms(keys).clamp_min(NORM_EPS)


def page_scores(token_scores: torch.Tensor, page_tokens: int) -> torch.Tensor:
    """Broadcast each page's mean token score to its tokens; first and last page ``+inf``."""
    lyr, h, n = token_scores.shape
    pages = -(-n // page_tokens)
    pad = pages * page_tokens - n
    padded = torch.nn.functional.pad(token_scores, (0, pad))
    counts = torch.full((pages,), float(page_tokens), device=token_scores.device)
    counts[-1] = float(page_tokens - pad)
    mean = padded.view(lyr, h, pages, page_tokens).sum(dim=-1) / counts
    mean[..., 0] = float("inf")
    mean[..., -1] = float("inf")
    return mean.repeat_interleave(page_tokens, dim=-1)[..., :n].contiguous()


class PagedEvictionMethod(TokenDropMethod):
    name = "paged_eviction"

    def score_reference(
        self, keys: torch.Tensor, values: torch.Tensor, queries: torch.Tensor | None
    ) -> torch.Tensor:
        return value_key_ratio(keys, values)

    def score_triton(self, source: KVSource, queries: torch.Tensor | None) -> torch.Tensor:
        from kvtierd.kernels import _tl_score

        return _tl_score.norm_scores(source, _tl_score.MODE_VK_RATIO)


class PagedEvictionBlockMethod(TokenDropMethod):
    name = "paged_eviction_block"

    def __init__(self, page_tokens: int = COUNT_RULES["paged_eviction_block"].page_tokens) -> None:
        if page_tokens < 1:
            raise ValueError(f"page_tokens must be >= 1, got {page_tokens}")
        self.page_tokens = page_tokens

    def count_rule(self) -> CountRule:
        return CountRule(page_tokens=self.page_tokens)

    def score_reference(
        self, keys: torch.Tensor, values: torch.Tensor, queries: torch.Tensor | None
    ) -> torch.Tensor:
        return page_scores(value_key_ratio(keys, values), self.page_tokens)

    def score_triton(self, source: KVSource, queries: torch.Tensor | None) -> torch.Tensor:
        from kvtierd.kernels import _tl_score

        token = _tl_score.norm_scores(source, _tl_score.MODE_VK_RATIO)
        return page_scores(token, self.page_tokens)
