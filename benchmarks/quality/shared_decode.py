"""Many questions decoded at once over one context's (compressed) KV, the KV shared, not copied.

:func:`kvtierd.profiler.greedy.greedy_decode` batches *variants* of one context for one
question; a label set asks dozens of questions per context, one decode each (about 0.1 s per
token on a CPU core, most of it the model's per-step overhead). Here the batch's rows are
*questions* over one variant's KV: the KV ``[L, H, M, D]`` is read in place by every row (no
per-row copy, no padding: one variant, one kept count), and only the rows' own tokens (the
question and the answer so far) live in a cache of their own. Positions continue from the
original context length as in ``greedy_decode``, so a row's answer is the one an unbatched
decode of that question gives, up to bfloat16 rounding in batched matrix products (measured by
``context_labels --check``).

Rows must have equal token lengths (they share one forward); :func:`answer_questions` groups
them by length.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Sequence
from typing import Any

import torch

from kvtierd.profiler.greedy import causal_rows

SHARED = "kvtierd_shared_prefix"
_PREFIX: list[tuple[torch.Tensor, torch.Tensor]] = []
"""Per layer, the shared KV (``[H, M, D]`` keys and values) of the decode in progress."""


def shared_prefix_attention(
    module: Any,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    *,
    scaling: float | None = None,
    **kwargs: Any,
) -> tuple[torch.Tensor, None]:
    """Attention of ``query`` ``[B, Hq, Tq, D]`` over the layer's shared KV (every position
    visible) followed by the rows' own ``key`` / ``value`` ``[B, H, T, D]`` (causal: the queries
    are the last ``Tq`` of the ``T``), returned as ``[B, Tq, Hq, D]``."""
    pk, pv = _PREFIX[module.layer_idx]
    b, hq, tq, d = (int(s) for s in query.shape)
    h, t = int(key.shape[1]), int(key.shape[2])
    g = hq // h
    q = query.reshape(b, h, g * tq, d)  # rows: (group member, token)
    scale = scaling if scaling is not None else d**-0.5
    shared = (q @ pk.transpose(-1, -2).unsqueeze(0)) * scale  # [B, H, G*Tq, M]
    own = (q @ key.transpose(-1, -2)) * scale  # [B, H, G*Tq, T]
    if tq > 1:
        own = own.masked_fill(~causal_rows(tq, t, g, q.device), float("-inf"))
    weights = torch.softmax(torch.cat([shared, own], dim=-1), dim=-1)
    m = int(pk.shape[1])
    out = weights[..., :m] @ pv.unsqueeze(0) + weights[..., m:] @ value
    return out.reshape(b, hq, tq, d).transpose(1, 2).contiguous(), None


def _register() -> None:
    from transformers import AttentionInterface
    from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS

    if SHARED not in AttentionInterface._global_mapping:
        AttentionInterface.register(SHARED, shared_prefix_attention)
    if SHARED not in ALL_MASK_ATTENTION_FUNCTIONS._global_mapping:
        # no mask: the attention above is causal over the rows' own tokens by construction
        ALL_MASK_ATTENTION_FUNCTIONS.register(SHARED, lambda *a, **k: None)


@contextlib.contextmanager
def _shared(model: Any, keys: torch.Tensor, values: torch.Tensor) -> Iterator[None]:
    _register()
    config = model.config
    before = config._attn_implementation
    config._attn_implementation = SHARED
    _PREFIX[:] = [(keys[i], values[i]) for i in range(int(keys.shape[0]))]
    try:
        yield
    finally:
        config._attn_implementation = before
        _PREFIX.clear()


@torch.inference_mode()
def decode_rows(
    model: Any,
    keys: torch.Tensor,
    values: torch.Tensor,
    rows: Sequence[Sequence[int]],
    *,
    context_tokens: int,
    max_new_tokens: int,
    eos_token_ids: frozenset[int],
) -> list[list[int]]:
    """Greedy answers of ``rows`` (token ids, all of one length) over the shared KV ``keys`` /
    ``values`` ``[L, H, M, D]`` of a context of ``context_tokens`` tokens, each cut before its
    first EOS."""
    from transformers import DynamicCache

    if not rows or len({len(r) for r in rows}) != 1:
        raise ValueError("decode_rows needs one or more rows of equal length")
    b, q = len(rows), len(rows[0])
    device = keys.device
    ids = torch.tensor([list(r) for r in rows], dtype=torch.long, device=device)
    positions = torch.arange(context_tokens, context_tokens + q, device=device).expand(b, -1)
    cache = DynamicCache()
    answers: list[list[int]] = [[] for _ in range(b)]
    done = [False] * b
    with _shared(model, keys, values):
        for step in range(max_new_tokens):
            out = model(input_ids=ids, past_key_values=cache, position_ids=positions,
                        use_cache=True, logits_to_keep=1)  # fmt: skip
            nxt = out.logits[:, -1].argmax(-1)
            for row, tok in enumerate(nxt.tolist()):
                if not done[row]:
                    if tok in eos_token_ids:
                        done[row] = True
                    else:
                        answers[row].append(tok)
            if all(done) or step == max_new_tokens - 1:
                break
            ids = nxt[:, None]
            positions = positions[:, -1:] + 1
    return answers


def answer_questions(
    evaluator: Any,
    kv: Any,
    variants: Sequence[str],
    queries: Sequence[Sequence[int]],
    *,
    form: Any,
    max_rows: int = 32,
) -> list[list[list[int]]]:
    """Greedy answer ids ``[query][variant]``, as ``AnswerEvaluator.answer_ids`` returns them:
    each variant compressed once, its questions decoded in batches of up to ``max_rows`` rows of
    equal length."""
    from kvtierd.profiler.answer import _on
    from kvtierd.profiler.variant_kv import variant_kvs

    model, _ = evaluator.load()
    eos = model.generation_config.eos_token_id
    eos_ids = frozenset([eos] if isinstance(eos, int) else (eos or []))
    kv = _on(kv, evaluator.device, model.dtype)
    by_length: dict[int, list[int]] = {}
    for i, q in enumerate(queries):
        by_length.setdefault(len(q), []).append(i)
    out: list[list[list[int]]] = [[[] for _ in variants] for _ in queries]
    for j, item in enumerate(variant_kvs(kv, variants, form)):
        for members in by_length.values():
            for start in range(0, len(members), max_rows):
                part = members[start : start + max_rows]
                got = decode_rows(
                    model, item.keys, item.values, [queries[i] for i in part],
                    context_tokens=kv.num_tokens, max_new_tokens=evaluator.max_new_tokens,
                    eos_token_ids=eos_ids,
                )  # fmt: skip
                for i, ans in zip(part, got, strict=True):
                    out[i][j] = ans
    return out
