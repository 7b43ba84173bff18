"""``paged_eviction``: PagedEviction's attention-free score (Chitty-Venkata et al., §4.1, Alg. 1).

Token score ``S_i = ||V_i||_2 / max(||K_i||_2, 1e-12)`` in float32; the lowest scores are
evicted ("tokens with lower scores are considered less critical", §4.2).

* ``paged_eviction`` (token mode, Alg. 2 prefill eviction): keep the top-M tokens by ``S_i``.
  ``sinks`` (default 0, the paper's rule): the first ``sinks`` tokens always stay. The rule
  alone evicts the attention sink of SmolLM2 (its value norm is small), docs/kernels.md.
* ``paged_eviction_block`` (block mode, Alg. 1 block branch, Alg. 3's page rule): pages of
  ``page`` (default 16) consecutive tokens; page score = mean of its tokens' ``S_i``; whole
  pages are kept or dropped, no page is forced. The trailing ``N mod page`` tokens are not a
  full page yet (the page vLLM is still filling; Alg. 3 evicts only once it is full) and stay.
  ``keep_ends=1``: the first and the last (possibly partial) page always stay instead. The kept
  count is whole pages (``variants.py`` rule 4).
"""

from __future__ import annotations

import torch

from kvtierd.kernels.base import TokenDropMethod
from kvtierd.kernels.knorm import key_norms
from kvtierd.kernels.layout import KVSource
from kvtierd.variants import canonical_options, option_default

NORM_EPS = 1e-12


def value_key_ratio(keys: torch.Tensor, values: torch.Tensor) -> torch.Tensor:
    """``||V_i|| / ||K_i||``: ``[L, H, N, D]`` x2 -> float32 ``[L, H, N]``."""
    return key_norms(values) / key_norms(keys).clamp_min(NORM_EPS)


def page_scores(token_scores: torch.Tensor, page: int, keep_ends: bool) -> torch.Tensor:
    """Broadcast each page's mean token score to its tokens. ``+inf`` for what always stays:
    the partial last page, or with ``keep_ends`` the first and the last page."""
    lyr, h, n = token_scores.shape
    pages = -(-n // page)
    pad = pages * page - n
    padded = torch.nn.functional.pad(token_scores, (0, pad))
    counts = torch.full((pages,), float(page), device=token_scores.device)
    counts[-1] = float(page - pad)
    mean = padded.view(lyr, h, pages, page).sum(dim=-1) / counts
    if keep_ends:
        mean[..., 0] = float("inf")
    if keep_ends or pad:
        mean[..., -1] = float("inf")
    return mean.repeat_interleave(page, dim=-1)[..., :n].contiguous()


class PagedEvictionMethod(TokenDropMethod):
    name = "paged_eviction"

    def __init__(self, sinks: int = option_default("paged_eviction", "sinks")) -> None:
        canonical_options(self.name, {"sinks": sinks})
        self.sinks = sinks

    def option_values(self) -> dict[str, int]:
        return {"sinks": self.sinks}

    def _with_sinks(self, scores: torch.Tensor) -> torch.Tensor:
        scores[..., : self.sinks] = float("inf")
        return scores

    def score_reference(
        self, keys: torch.Tensor, values: torch.Tensor, queries: torch.Tensor | None
    ) -> torch.Tensor:
        return self._with_sinks(value_key_ratio(keys, values))

    def score_triton(self, source: KVSource, queries: torch.Tensor | None) -> torch.Tensor:
        from kvtierd.kernels import _tl_score

        return self._with_sinks(_tl_score.norm_scores(source, _tl_score.MODE_VK_RATIO))


class PagedEvictionBlockMethod(TokenDropMethod):
    name = "paged_eviction_block"

    def __init__(
        self,
        page: int = option_default("paged_eviction_block", "page"),
        keep_ends: int = option_default("paged_eviction_block", "keep_ends"),
    ) -> None:
        canonical_options(self.name, {"page": page, "keep_ends": keep_ends})
        self.page = page
        self.keep_ends = keep_ends

    def option_values(self) -> dict[str, int]:
        return {"page": self.page, "keep_ends": self.keep_ends}

    def score_reference(
        self, keys: torch.Tensor, values: torch.Tensor, queries: torch.Tensor | None
    ) -> torch.Tensor:
        return page_scores(value_key_ratio(keys, values), self.page, bool(self.keep_ends))

    def score_triton(self, source: KVSource, queries: torch.Tensor | None) -> torch.Tensor:
        from kvtierd.kernels import _tl_score

        token = _tl_score.norm_scores(source, _tl_score.MODE_VK_RATIO)
        return page_scores(token, self.page, bool(self.keep_ends))
