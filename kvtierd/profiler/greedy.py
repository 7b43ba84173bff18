"""Batched greedy decoding of one query over many KV variants of one context (kvpress-style).

Row ``b`` of the batch continues the context from variant ``b``'s KV. The KV holds ``M_b``
entries but the query's positions continue from the ORIGINAL context length ``N`` (position ids
``N, N+1, ...``, as kvpress's pipeline does), so RoPE distances to the kept keys — which sit at
their original positions — are those of the uncompressed run. Rows are left-padded to ``M_max``
and the padding is masked out with a 2-D attention mask; Hugging Face derives the cache slots
(``cache_position``) from the cache length, which is what the mask indexes.

Attention runs through :func:`grouped_attention` (registered with transformers'
``AttentionInterface``): with a padding mask, transformers' ``sdpa`` copies every KV head once
per query head it serves (``repeat_kv``) at every layer and step — on a batch of long variants
most of a decode's time on CPU (issue 26: 21 of 44 s). Stacking a KV head's query heads into
one matrix attends to the KV in place instead.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import Any

import torch

from kvtierd.profiler.variant_kv import PaddedBatch

GROUPED = "kvtierd_grouped"


def causal_rows(tq: int, n: int, g: int, device: torch.device) -> torch.Tensor:
    """``[g * Tq, N]`` bool, True where a query row may see a position: the ``Tq`` queries are
    the last of ``N`` positions, and the rows repeat them for each of ``g`` group members (the
    row order of :func:`grouped_attention`)."""
    rows = torch.arange(tq, device=device) + (n - tq)
    return (torch.arange(n, device=device)[None, :] <= rows[:, None]).repeat(g, 1)


def grouped_attention(
    module: Any,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    *,
    scaling: float | None = None,
    **kwargs: Any,
) -> tuple[torch.Tensor, None]:
    """``softmax(q k^T * scaling + mask) v`` for ``query`` ``[B, Hq, Tq, D]`` over ``key`` /
    ``value`` ``[B, H, N, D]`` (query head ``j`` reads KV head ``j // (Hq / H)``), returned as
    ``[B, Tq, Hq, D]`` (what the model's attention module expects). ``attention_mask``: bool
    (True = attend) or additive, ``[B, 1, Tq, N]``; ``None`` means causal, the queries being
    the last ``Tq`` positions."""
    b, hq, tq, d = (int(s) for s in query.shape)
    h, n = int(key.shape[1]), int(key.shape[2])
    g = hq // h
    q = query.reshape(b, h, g * tq, d)  # rows: (group member, token)
    scores = (q @ key.transpose(-1, -2)) * (scaling if scaling is not None else d**-0.5)
    if attention_mask is None:
        if tq > 1:
            scores = scores.masked_fill(~causal_rows(tq, n, g, q.device), float("-inf"))
    else:
        mask = attention_mask.expand(b, 1, tq, n).repeat(1, 1, g, 1)  # rows as in q
        if mask.dtype == torch.bool:
            scores = scores.masked_fill(~mask, float("-inf"))
        else:
            scores = scores + mask
    out = torch.softmax(scores, dim=-1) @ value  # [B, H, G*Tq, D]
    return out.reshape(b, hq, tq, d).transpose(1, 2).contiguous(), None


def _register() -> None:
    from transformers import AttentionInterface
    from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, sdpa_mask

    if GROUPED not in AttentionInterface._global_mapping:
        AttentionInterface.register(GROUPED, grouped_attention)
    if GROUPED not in ALL_MASK_ATTENTION_FUNCTIONS._global_mapping:
        ALL_MASK_ATTENTION_FUNCTIONS.register(GROUPED, sdpa_mask)  # bool masks, as sdpa's


@contextlib.contextmanager
def _grouped(model: Any) -> Iterator[None]:
    _register()
    config = model.config
    before = config._attn_implementation
    config._attn_implementation = GROUPED
    try:
        yield
    finally:
        config._attn_implementation = before


@torch.inference_mode()
def greedy_decode(
    model: Any,
    batch: PaddedBatch,
    query_ids: list[int],
    *,
    context_tokens: int,
    max_new_tokens: int,
    eos_token_ids: frozenset[int],
    pause: Callable[[], object] = lambda: None,
) -> list[list[int]]:
    """Greedy answers, one token list per batch row, each cut before its first EOS; ``pause``
    runs before every forward step (the daemon's yield to serving, ``yield_gate.py``)."""
    from transformers import DynamicCache

    b = int(batch.keys.shape[0])
    layers = int(batch.keys.shape[1])
    cache = DynamicCache(
        ddp_cache_data=[(batch.keys[:, i], batch.values[:, i]) for i in range(layers)]
    )
    device = batch.keys.device
    ids = torch.tensor([query_ids], dtype=torch.long, device=device).expand(b, -1)
    q = len(query_ids)
    positions = torch.arange(context_tokens, context_tokens + q, device=device).expand(b, -1)
    mask = torch.cat([batch.valid.long(), torch.ones((b, q), dtype=torch.long, device=device)], 1)
    answers: list[list[int]] = [[] for _ in range(b)]
    done = torch.zeros(b, dtype=torch.bool)
    for step in range(max_new_tokens):
        pause()
        with _grouped(model):
            out = model(
                input_ids=ids, past_key_values=cache, position_ids=positions, attention_mask=mask
            )
        nxt = out.logits[:, -1].argmax(-1)
        for row, tok in enumerate(nxt.tolist()):
            if not done[row]:
                if tok in eos_token_ids:
                    done[row] = True
                else:
                    answers[row].append(tok)
        if bool(done.all()) or step == max_new_tokens - 1:
            break
        ids = nxt[:, None]
        positions = positions[:, -1:] + 1
        mask = torch.cat([mask, torch.ones((b, 1), dtype=torch.long, device=device)], 1)
    return answers
