"""Batched greedy decoding of one query over many KV variants of one context (kvpress-style).

Row ``b`` of the batch continues the context from variant ``b``'s KV. The KV holds ``M_b``
entries but the query's positions continue from the ORIGINAL context length ``N`` (position ids
``N, N+1, ...``, as kvpress's pipeline does), so RoPE distances to the kept keys — which sit at
their original positions — are those of the uncompressed run. Rows are left-padded to ``M_max``
and the padding is masked out with a 2-D attention mask; Hugging Face derives the cache slots
(``cache_position``) from the cache length, which is what the mask indexes.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from kvtierd.profiler.variant_kv import PaddedBatch


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
