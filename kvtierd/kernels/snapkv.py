"""``snapkv``: keep the tokens the last window of queries attends to (Li et al. 2024; kvpress
SnapKVPress, whose scores and kept sets ``tests/kernels/test_kernels_kvpress.py`` holds this
method to).

Inputs: ``queries`` float ``[L, Hq, Wq, D]`` — the RoPE-applied queries of the last ``Wq >=
window`` context tokens (the last ``window`` of them are used), ``Hq = G * H`` (GQA: query head
``j`` reads KV head ``j // G``). Options: ``window`` ``W`` (default 64) and ``pool`` (default 5,
odd; kvpress's ``kernel_size``). Per layer and query head, in float32::

    p      = softmax(q k^T / sqrt(D))     # window query i (position N - W + i) over all keys
                                          # t <= N - W + i (the causal mask of the prefill)
    s      = mean over the W window queries of p[:, t] for the N - W prefix keys t < N - W
    s      = avg_pool1d(s, pool, stride 1, padding pool // 2, count_include_pad)
    score  = mean of s over the G query heads of each KV head

The window's own tokens rank above every prefix token (prefix scores are <= 1, window token
``N - W + i`` scores ``2 + i / W``): kept whenever ``M >= W``; below that, the most recent
window tokens are kept (kvpress ties them at ``max + 1`` and keeps ``topk``'s pick). With
``N <= W`` every token is in the window. vLLM's paged cache holds no queries; without them this
method raises — it never falls back.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from kvtierd.errors import InvalidArgumentError
from kvtierd.kernels.base import TokenDropMethod
from kvtierd.kernels.layout import KVSource
from kvtierd.variants import canonical_options, option_default

WINDOW_SCORE = 2.0  # above any prefix score: a mean of softmax probabilities is <= 1


def window_scores(num_tokens: int, window: int, device: torch.device) -> torch.Tensor:
    """Scores of the last ``min(window, N)`` tokens: ``2 + i / W``, the most recent highest."""
    w = min(window, num_tokens)
    return WINDOW_SCORE + torch.arange(w, dtype=torch.float32, device=device) / w


def pool_and_pad(raw: torch.Tensor, window: int, pool: int) -> torch.Tensor:
    """avg-pool ``[L, H, N - W]`` raw scores along tokens and append the window's scores."""
    lyr, h, n_ctx = raw.shape
    pooled = F.avg_pool1d(raw.reshape(lyr * h, 1, n_ctx), pool, stride=1, padding=pool // 2)
    tail = window_scores(n_ctx + window, window, raw.device).expand(lyr, h, window)
    return torch.cat([pooled.reshape(lyr, h, n_ctx), tail], dim=-1)


def window_attention_reference(keys: torch.Tensor, queries: torch.Tensor) -> torch.Tensor:
    """Torch spec of the raw scores: ``keys`` ``[L, H, N, D]``, ``queries`` ``[L, Hq, W, D]``
    (``N > W``) -> float32 ``[L, H, N - W]``, the window's mean softmax probability of each
    prefix key, averaged over each GQA group (before pooling)."""
    lyr, h, n, d = keys.shape
    hq, w = queries.shape[1], queries.shape[2]
    g = hq // h
    # window query i sees keys t <= n - w + i: mask t - i > n - w
    t = torch.arange(n, device=keys.device)
    i = torch.arange(w, device=keys.device)
    masked = (t[None, :] - i[:, None]) > (n - w)
    raws = []
    for layer in range(lyr):  # one layer at a time: the [Hq, W, N] logits are large
        k = keys[layer].to(torch.float32).repeat_interleave(g, dim=0)
        q = queries[layer].to(torch.float32)
        logits = (q @ k.transpose(-1, -2) / math.sqrt(d)).masked_fill(masked, float("-inf"))
        p = torch.softmax(logits, dim=-1)[..., : n - w]
        raws.append(p.mean(dim=1).view(h, g, n - w).mean(dim=1))
    return torch.stack(raws)


class SnapKVMethod(TokenDropMethod):
    name = "snapkv"
    needs_queries = True

    def __init__(
        self,
        window: int = option_default("snapkv", "window"),
        pool: int = option_default("snapkv", "pool"),
    ) -> None:
        canonical_options(self.name, {"window": window, "pool": pool})
        self.window = window
        self.pool = pool

    def option_values(self) -> dict[str, int]:
        return {"window": self.window, "pool": self.pool}

    def check_queries(self, source: KVSource, queries: torch.Tensor | None) -> None:
        need = min(self.window, source.num_tokens)
        if queries is None:
            raise InvalidArgumentError(
                f"snapkv needs the queries of the last {need} context tokens "
                "([L, Hq, W, D]); none were given (vLLM's paged cache keeps no queries) — "
                "choose a query-free method such as knorm or keydiff instead"
            )
        lyr, h, d = source.num_layers, source.num_kv_heads, source.head_dim
        shape = tuple(queries.shape)
        if queries.dim() != 4 or shape[0] != lyr or shape[3] != d or shape[1] % h:
            raise InvalidArgumentError(
                f"queries must be [L={lyr}, Hq=G*{h}, W>={need}, D={d}], got {shape}"
            )
        if shape[2] < need:
            raise InvalidArgumentError(
                f"queries cover {shape[2]} tokens, the snapkv window is {self.window} "
                f"(needs the last {need})"
            )
        if queries.device != source.device or not queries.is_floating_point():
            raise InvalidArgumentError(
                f"queries must be floating point on {source.device}, got {queries.dtype} on "
                f"{queries.device}"
            )

    def score_reference(
        self, keys: torch.Tensor, values: torch.Tensor, queries: torch.Tensor | None
    ) -> torch.Tensor:
        lyr, h, n, _ = keys.shape
        if n <= self.window:
            return window_scores(n, self.window, keys.device).expand(lyr, h, n).contiguous()
        if queries is None:
            raise InvalidArgumentError("snapkv needs queries")
        raw = window_attention_reference(keys, queries[:, :, -self.window :])
        return pool_and_pad(raw, self.window, self.pool)

    def score_triton(self, source: KVSource, queries: torch.Tensor | None) -> torch.Tensor:
        from kvtierd.kernels import _tl_snapkv

        lyr, h, n = source.num_layers, source.num_kv_heads, source.num_tokens
        if n <= self.window:
            return window_scores(n, self.window, source.device).expand(lyr, h, n).contiguous()
        if queries is None:
            raise InvalidArgumentError("snapkv needs queries")
        raw = _tl_snapkv.window_attention(source, queries[:, :, -self.window :])
        return pool_and_pad(raw, self.window, self.pool)
