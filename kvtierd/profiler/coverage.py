"""Coverage: the share of a context's distinct token ``n``-grams that a token-dropping variant
still holds somewhere, whole (issue 39: per-context quality at the first put, without a model
pass).

A token-dropping method keeps, per layer and KV head, the ``M`` entries its own score ranks
highest (:mod:`kvtierd.kernels.base`); which entries those are is known from the stored KV
alone. What a later question needs is some piece of the context — a name and its number, a key
and its value — and the answer survives if *one* occurrence of that piece is kept whole. A
context that says each thing once (a table, a config file) loses a piece with each dropped
occurrence; one that repeats itself (logs, a story retold) keeps it while any copy is kept.
Counting, per layer and head, the distinct ``n``-grams of the context's token ids with at
least one occurrence whose ``n`` entries are all kept measures exactly that, and its mean over
layers and heads is the variant's coverage in ``[0, 1]``. The method's scores of the stored KV
are the whole cost: no model pass, and no question.

A variant that keeps every entry (the original, ``int8``, ``int4``) covers everything; its
quality is the quantization's, which coverage cannot see (:mod:`.query_attention` probes it).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from kvtierd.errors import InvalidArgumentError
from kvtierd.profiler.quality import DEFAULT_FORM, ContextKV, StoredForm
from kvtierd.profiler.query_attention import keep_plans

NGRAM = 4
LAYER_STRIDE = 5
"""Every fifth layer (0, 5, .., 25 of SmolLM2's 30): the methods' scores, most of the cost, for
a fifth of the layers, as ``query_attention`` reads its errors."""


def ngram_coverage(
    kv: ContextKV,
    variants: Sequence[str],
    form: StoredForm = DEFAULT_FORM,
    n: int = NGRAM,
    layer_stride: int = LAYER_STRIDE,
) -> dict[str, float]:
    """Per variant, the mean over every ``layer_stride``-th layer (0, k, 2k, ..) and its KV
    heads of the share of the context's distinct token ``n``-grams kept whole at one
    occurrence at least (module docstring). Needs the context's token ids (``kv.token_ids``,
    at least ``kv.num_tokens`` of them)."""
    num = kv.num_tokens
    if n < 1 or layer_stride < 1:
        raise InvalidArgumentError(f"n and layer_stride must be >= 1, got {n}, {layer_stride}")
    if layer_stride > 1:  # a method's keep order in a layer depends on that layer only
        wq = None if kv.window_queries is None else kv.window_queries[::layer_stride]
        kv = ContextKV(kv.keys[::layer_stride], kv.values[::layer_stride], wq, kv.token_ids)
    if len(kv.token_ids) < num:
        raise InvalidArgumentError(
            f"coverage needs the context's {num} token ids, got {len(kv.token_ids)}"
        )
    width = min(n, num)
    grams = torch.tensor(kv.token_ids[:num], dtype=torch.long).unfold(0, width, 1)
    _, which = torch.unique(grams, dim=0, return_inverse=True)  # distinct n-gram of each start
    distinct = int(which.max()) + 1
    out: dict[str, float] = {}
    for plan in keep_plans(kv, variants, form):
        if plan.order is None:
            out.update(dict.fromkeys((v for names in plan.by_count for v in names), 1.0))
            continue
        lyr, heads, _ = (int(s) for s in plan.order.shape)
        # rank of every entry in its (layer, head)'s keep order: kept at count c iff rank < c
        rank = torch.empty_like(plan.order)
        rank.scatter_(-1, plan.order, torch.arange(num).expand(lyr, heads, num).contiguous())
        index = which.expand(lyr, heads, -1)
        for count, names in zip(plan.counts, plan.by_count, strict=True):
            whole = (rank < count).unfold(-1, width, 1).all(dim=-1).float()  # [L, H, N-n+1]
            covered = torch.zeros(lyr, heads, distinct).scatter_reduce_(-1, index, whole, "amax")
            out.update(dict.fromkeys(names, float(covered.mean())))
    return out
