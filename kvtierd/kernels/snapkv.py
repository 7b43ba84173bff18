"""``snapkv``: keep the tokens the last window of queries attends to (Li et al. 2024; kvpress
SnapKVPress).

Inputs: ``queries`` float ``[L, Hq, W, D]`` — the (RoPE-applied) queries of the last ``W =
window`` context tokens, ``Hq = G * H`` (GQA: query head ``j`` reads KV head ``j // G``).
Per layer and query head, over the ``N - W`` non-window keys, in float32::

    p      = softmax(q k^T / sqrt(D))            # over the N - W non-window keys only
    s      = mean over the W window queries of p
    s      = avg_pool1d(s, kernel 5, stride 1, padding 2, count_include_pad)   # divides by 5
    score  = mean of s over the G query heads of each KV head; window tokens +inf.

kvpress normalises the softmax over all keys under a causal mask and then drops the window
columns; restricting it to the non-window keys (this spec) rescales each query's row by a
constant, so the two rank tokens alike whenever the window's attention mass on itself is even.
vLLM's paged cache holds no queries; without them this method raises — it never falls back.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from kvtierd.errors import InvalidArgumentError
from kvtierd.kernels.base import TokenDropMethod
from kvtierd.kernels.layout import KVSource
from kvtierd.kernels.variants import COUNT_RULES, CountRule

POOL_KERNEL = 5


def pool_and_pad(raw: torch.Tensor, window: int) -> torch.Tensor:
    """avg-pool ``[L, H, N - W]`` raw scores along tokens and append ``+inf`` for the window."""
    lyr, h, n_ctx = raw.shape
    pooled = F.avg_pool1d(
        raw.reshape(lyr * h, 1, n_ctx), POOL_KERNEL, stride=1, padding=POOL_KERNEL // 2
    ).reshape(lyr, h, n_ctx)
    inf = torch.full((lyr, h, window), float("inf"), device=raw.device)
    return torch.cat([pooled, inf], dim=-1)


class SnapKVMethod(TokenDropMethod):
    name = "snapkv"
    needs_queries = True

    def __init__(self, window: int = COUNT_RULES["snapkv"].min_kept) -> None:
        if window < 1:
            raise ValueError(f"window must be >= 1, got {window}")
        self.window = window

    def count_rule(self) -> CountRule:
        return CountRule(min_kept=self.window)

    def check_queries(self, source: KVSource, queries: torch.Tensor | None) -> None:
        if queries is None:
            raise InvalidArgumentError(
                f"snapkv needs the queries of the last {self.window} context tokens "
                "([L, Hq, W, D]); none were given (vLLM's paged cache keeps no queries) — "
                "choose a query-free method such as knorm or keydiff instead"
            )
        lyr, h, d = source.num_layers, source.num_kv_heads, source.head_dim
        shape = tuple(queries.shape)
        if queries.dim() != 4 or shape[0] != lyr or shape[3] != d or shape[1] % h:
            raise InvalidArgumentError(
                f"queries must be [L={lyr}, Hq=G*{h}, W={self.window}, D={d}], got {shape}"
            )
        if shape[2] != self.window:
            raise InvalidArgumentError(
                f"queries cover {shape[2]} tokens, the snapkv window is {self.window}"
            )
        if queries.device != source.device or not queries.is_floating_point():
            raise InvalidArgumentError(
                f"queries must be floating point on {source.device}, got {queries.dtype} on "
                f"{queries.device}"
            )

    def score_reference(
        self, keys: torch.Tensor, values: torch.Tensor, queries: torch.Tensor | None
    ) -> torch.Tensor:
        if queries is None:
            raise InvalidArgumentError("snapkv needs queries")
        lyr, h, n, d = keys.shape
        w = self.window
        if n <= w:
            return torch.full((lyr, h, n), float("inf"), device=keys.device)
        g = queries.shape[1] // h
        raws = []
        for layer in range(lyr):  # one layer at a time: the [Hq, W, N] logits are large
            k = keys[layer, :, : n - w].to(torch.float32).repeat_interleave(g, dim=0)
            q = queries[layer].to(torch.float32)
            p = torch.softmax(q @ k.transpose(-1, -2) / math.sqrt(d), dim=-1)
            raws.append(p.mean(dim=1).view(h, g, n - w))
        raw = torch.stack(raws)  # [L, H, G, N - W]
        lg = raw.reshape(lyr, h * g, n - w)
        pooled = pool_and_pad(lg, 0).view(lyr, h, g, n - w).mean(dim=2)
        inf = torch.full((lyr, h, w), float("inf"), device=keys.device)
        return torch.cat([pooled, inf], dim=-1)

    def score_triton(self, source: KVSource, queries: torch.Tensor | None) -> torch.Tensor:
        from kvtierd.kernels import _tl_snapkv

        if queries is None:
            raise InvalidArgumentError("snapkv needs queries")
        if source.num_tokens <= self.window:
            shape = (source.num_layers, source.num_kv_heads, source.num_tokens)
            return torch.full(shape, float("inf"), device=source.device)
        raw = _tl_snapkv.window_attention(source, queries)  # [L, H, N - W], mean over group
        return pool_and_pad(raw, self.window)
