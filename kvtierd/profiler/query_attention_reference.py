"""``query_attention``'s errors computed as before issue 26's speed-up: the reference that the
fast path (:meth:`.QueryAttentionEvaluator.errors`) must match up to float rounding (tests),
and the "before" of the benchmark's cost comparison (``benchmarks/quality/bench_estimators.py``).

The straightforward form: per quantization the softmax terms ``e`` ``[L', H, G*T, N]``, per
keep order a ``gather`` of ``e`` and of the values, prefix sums at the kept counts, and one more
pass in place for the full KV and for each quantization without a drop.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from kvtierd.profiler.quality import ContextKV, StoredForm
from kvtierd.profiler.quant_round_trip import round_trips
from kvtierd.profiler.query_attention import (
    Probes,
    _Own,
    _own_terms,
    _relative_error,
    _scaled,
    keep_plans,
)


def reference_errors(
    kv: ContextKV,
    variants: Sequence[str],
    probes: Probes,
    form: StoredForm,
    layers_per_step: int = 10,
) -> dict[str, torch.Tensor]:
    """The same ``[L, H, G*T]`` errors as :meth:`.QueryAttentionEvaluator.errors` (every
    layer), the old way (module docstring)."""
    plans = keep_plans(kv, variants, form)
    bits = sorted({p.bits for p in plans} | {0})
    per_step: dict[str, list[torch.Tensor]] = {v: [] for v in variants}
    layers = int(kv.keys.shape[0])
    for first in range(0, layers, layers_per_step):
        at = slice(first, min(layers, first + layers_per_step))
        q = _scaled(probes.queries[at], int(kv.keys.shape[1]))
        own = _own_terms(q, probes, at, kv)
        k, v = kv.keys[at].float(), kv.values[at].float()
        lossy = [b for b in bits if b]
        ks = {0: k, **round_trips(k, lossy, form.group_size, "channel")}
        vs = {0: v, **round_trips(v, lossy, form.group_size, "token")}
        terms = {b: _OldTerms.of(q, (ks[b], vs[b]), own) for b in bits}
        full = terms[0].outputs(None, [kv.num_tokens])[0]
        for plan in plans:
            order = None if plan.order is None else plan.order[at]
            outs = terms[plan.bits].outputs(order, plan.counts)
            for names, o in zip(plan.by_count, outs, strict=True):
                err = _relative_error(o, full)
                for name in names:
                    per_step[name].append(err)
    return {v: torch.cat(errs) for v, errs in per_step.items()}


@dataclass(frozen=True, slots=True, eq=False)
class _OldTerms:
    """``e`` ``[L', H, G*T, N]``, values ``[L', H, N, D]``, own numerator and denominator."""

    e: torch.Tensor
    values: torch.Tensor
    own_num: torch.Tensor
    own_den: torch.Tensor

    @classmethod
    def of(cls, q: torch.Tensor, kv: tuple[torch.Tensor, torch.Tensor], own: _Own) -> _OldTerms:
        k, v = kv
        logits = q @ k.transpose(-1, -2)
        top = logits.amax(dim=-1)
        if own is None:
            e = torch.exp(logits - top[..., None])
            return cls(e, v, torch.zeros_like(q), torch.zeros(q.shape[:-1]))
        own_logits, own_values, own_top = own
        top = torch.maximum(top, own_top)
        e = torch.exp(logits - top[..., None])
        e_own = torch.exp(own_logits - top[..., None])
        return cls(e, v, e_own @ own_values, e_own.sum(dim=-1))

    def outputs(self, order: torch.Tensor | None, counts: Sequence[int]) -> list[torch.Tensor]:
        e, v = self.e, self.values
        if order is not None:
            e = e.gather(-1, order[:, :, None, :].expand(-1, -1, e.shape[2], -1))
            v = v.gather(2, order[..., None].expand(-1, -1, -1, v.shape[-1]))
        num, den = self.own_num, self.own_den
        outs, start = [], 0
        for c in counts:
            num = num + e[..., start:c] @ v[:, :, start:c]
            den = den + e[..., start:c].sum(dim=-1)
            outs.append(num / den[..., None])
            start = c
        return outs
