"""``attention``: model-free quality — how much a variant changes attention outputs.

For probe queries ``q`` (``[L, Hq, Q, D]``, RoPE-applied) and every layer ``l``, query head
``j`` (reading KV head ``j // G``, GQA) and probe ``i``::

    o_full = softmax(q K^T / sqrt(D)) V            over the N original entries
    o_var  = softmax(q K_v^T / sqrt(D)) V_v        over the variant's M kept entries
    quality = mean over (l, j, i) of max(0, cos(o_full, o_var))

Kept keys stay at their original positions (:mod:`.variant_kv`), so the scores are those the
model would compute. Probes: the context's ``window_queries`` when known (the queries of its last
tokens — what snapkv uses); otherwise the keys of the last ``fallback_probes`` tokens, one probe
per KV head. Key probes are a weaker stand-in (a key is not a query), documented in
docs/profiler.md; the ``answer`` evaluator is the paper's metric.

Variants are batched per layer, in groups sized so one group's score tensor stays under
``max_batch_bytes``.
"""

from __future__ import annotations

import math
import time
from collections.abc import Sequence
from types import MappingProxyType

import torch

from kvtierd.errors import InvalidArgumentError
from kvtierd.profiler.quality import (
    DEFAULT_FORM,
    ContextKV,
    ProfilingQuery,
    QualityEvaluator,
    QualityResult,
    StoredForm,
)
from kvtierd.profiler.variant_kv import VariantKV, variant_kvs


class AttentionEvaluator(QualityEvaluator):
    """Cosine similarity of attention outputs over the full KV vs each variant's KV."""

    name = "attention"

    def __init__(
        self,
        fallback_probes: int = 32,
        max_batch_bytes: int = 256 << 20,
    ) -> None:
        if fallback_probes < 1 or max_batch_bytes < 1:
            raise InvalidArgumentError(
                "fallback_probes and max_batch_bytes must be >= 1, got "
                f"{fallback_probes}, {max_batch_bytes}"
            )
        self.fallback_probes = fallback_probes
        self.max_batch_bytes = max_batch_bytes

    def evaluate(
        self,
        kv: ContextKV,
        variants: Sequence[str],
        queries: Sequence[ProfilingQuery] = (),
        *,
        form: StoredForm = DEFAULT_FORM,
    ) -> QualityResult:
        """``queries`` (texts) are not used: this evaluator reads probe vectors (module doc)."""
        t0 = time.perf_counter()
        probes = self.probes(kv)
        items = variant_kvs(kv, variants, form)
        sums = torch.zeros(len(items), dtype=torch.float64)
        for layer in range(kv.keys.shape[0]):
            self.pause()
            sums += self._layer(kv, items, probes, layer)
        quality = (sums / kv.keys.shape[0]).clamp(0.0, 1.0).tolist()
        return QualityResult(
            evaluator=self.name,
            quality=MappingProxyType(dict(zip(variants, quality, strict=True))),
            num_queries=int(probes.shape[2]),
            elapsed_s=time.perf_counter() - t0,
        )

    def probes(self, kv: ContextKV) -> torch.Tensor:
        """``[L, Hq, Q, D]`` probe queries (module docstring)."""
        if kv.window_queries is not None:
            return kv.window_queries
        w = min(self.fallback_probes, kv.num_tokens)
        return kv.keys[:, :, kv.num_tokens - w :]

    def _layer(
        self, kv: ContextKV, items: Sequence[VariantKV], probes: torch.Tensor, layer: int
    ) -> torch.Tensor:
        """Mean clamped cosine per variant for one layer, float64 ``[B]``."""
        h = int(kv.keys.shape[1])
        hq, nq, d = (int(s) for s in probes.shape[1:])
        if hq % h:
            raise InvalidArgumentError(f"{hq} query heads are not a multiple of {h} KV heads")
        q = probes[layer].float().reshape(h, hq // h * nq, d) / math.sqrt(d)  # [H, G*Q, D]
        full = _attend(q, kv.keys[layer].float(), kv.values[layer].float(), None)
        m_max = max((x.num_kept for x in items), default=1)
        per_variant = max(1, 4 * h * q.shape[1] * m_max)
        group = max(1, self.max_batch_bytes // per_variant)
        out = []
        for start in range(0, len(items), group):
            chunk = items[start : start + group]
            keys, values, mask = _pad_layer(chunk, layer, m_max)
            o = _attend(q.unsqueeze(0), keys, values, mask)  # [b, H, G*Q, D]
            cos = torch.nn.functional.cosine_similarity(o, full.unsqueeze(0), dim=-1, eps=1e-12)
            out.append(cos.clamp(min=0.0).mean(dim=(1, 2)).double())
        return torch.cat(out) if out else torch.zeros(0, dtype=torch.float64)


def _attend(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None
) -> torch.Tensor:
    """``softmax(q k^T) v`` with ``q`` already scaled; ``mask`` [b, M] marks real entries."""
    scores = q @ k.transpose(-1, -2)
    if mask is not None:
        scores = scores.masked_fill(~mask[:, None, None, :], float("-inf"))
    return torch.softmax(scores, dim=-1) @ v


def _pad_layer(
    items: Sequence[VariantKV], layer: int, m_max: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """One layer of ``items`` as ``[b, H, M_max, D]`` float32 keys/values + ``[b, M_max]`` mask."""
    ref = items[0].keys[layer]
    h, _, d = (int(s) for s in ref.shape)
    keys = torch.zeros((len(items), h, m_max, d), dtype=torch.float32, device=ref.device)
    values = torch.zeros_like(keys)
    mask = torch.zeros((len(items), m_max), dtype=torch.bool, device=ref.device)
    for b, x in enumerate(items):
        m = x.num_kept
        keys[b, :, :m] = x.keys[layer]
        values[b, :, :m] = x.values[layer]
        mask[b, :m] = True
    return keys, values, mask
