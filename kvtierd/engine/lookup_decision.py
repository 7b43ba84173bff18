"""Load or recompute, per lookup (issue 41): of the chunks a lookup found, report only the
prefix whose load beats prefilling its tokens.

The costs are the placer's: a chunk's load is :func:`kvtierd.utility.load_seconds` over its
tier's read fit (``placing.tier_models``: each tier's overhead once per lookup that loads from
it) plus its share of its context's profiled restore (the placer's ``restore_s`` of the
context's variant, by bytes; 0 while unprofiled, as the placer prices it); its prefill is its
tokens at vLLM's prefill speed (``TtftModel.prefill_tokens_per_s``: learned from served
requests, ``prefill_fit.py``, else the configured ``prefill_tokens_per_s``). The choice is
:func:`kvtierd.utility.loaded_prefix`, the function the simulator's replay calls too.

Chunks whose token count nobody told the daemon cannot be priced as a prefill: such a lookup
loads what it found (reason says so), as before the rule.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

import numpy as np

from kvtierd.engine.state import ObjectRecord
from kvtierd.types import TierModel
from kvtierd.utility import LOAD_MARGIN, load_seconds, loaded_prefix

LOAD, RECOMPUTE, SPLIT = "load", "recompute", "split"
DECISIONS = (LOAD, RECOMPUTE, SPLIT)


@dataclass(frozen=True, slots=True)
class LookupDecision:
    """``chunks``: the leading chunks to report (load), of ``found``; ``decision``: ``load``
    (all), ``recompute`` (none) or ``split`` (a prefix), ``""`` when nothing was found;
    ``reason``: the predicted costs behind it, for the plugin's DEBUG log."""

    found: int
    chunks: int
    decision: str
    reason: str


def decide(
    found: Sequence[ObjectRecord],
    tiers: Sequence[TierModel],
    *,
    restore_s: Callable[[ObjectRecord], float],
    prefill_tokens_per_s: float | None,
    mode: str = "decide",
    margin: float = LOAD_MARGIN,
) -> LookupDecision:
    """The decision for a lookup whose leading ``found`` chunks are stored (module docstring).
    ``mode``: the config's ``lookup_decision`` (``load``/``recompute`` force the answer)."""
    n = len(found)
    if n == 0:
        return LookupDecision(0, 0, "", "nothing found")
    if mode == LOAD:
        return LookupDecision(n, n, LOAD, "lookup_decision: load (always)")
    if mode == RECOMPUTE:
        return LookupDecision(n, 0, RECOMPUTE, "lookup_decision: recompute (always)")
    tokens = np.array([rec.meta.token_count for rec in found], dtype=np.float64)
    if prefill_tokens_per_s is None or not (tokens > 0).all():
        why = "no profiler yet" if prefill_tokens_per_s is None else "chunk tokens unknown"
        return LookupDecision(n, n, LOAD, f"{why}: the prefill cannot be priced, loading")
    by_name: Mapping[str, TierModel] = {t.name: t for t in tiers}
    models = [by_name[rec.tier] for rec in found]
    size = np.array([rec.meta.size_bytes for rec in found], dtype=np.float64)
    restore = np.array([restore_s(rec) for rec in found], dtype=np.float64)
    bw = np.array([m.load_bandwidth_bytes_per_s for m in models])
    first_in_tier = np.array([rec.tier not in {r.tier for r in found[:i]}
                              for i, rec in enumerate(found)])  # fmt: skip
    overhead = np.where(first_in_tier, [m.load_overhead_s for m in models], 0.0)
    load = np.cumsum(load_seconds(size, restore, bw, overhead))
    saved = np.cumsum(tokens) / prefill_tokens_per_s
    k = int(loaded_prefix(load, saved, margin))
    decision = LOAD if k == n else RECOMPUTE if k == 0 else SPLIT
    tiers_used = ",".join(dict.fromkeys(rec.tier for rec in found))
    reason = (
        f"{n} chunks found ({tiers_used}): load {load[-1]:.4g} s vs prefill {saved[-1]:.4g} s "
        f"of {int(tokens.sum())} tokens at {prefill_tokens_per_s:.4g} tokens/s (margin "
        f"{margin:.0%}); loading {k}"
    )
    if decision == SPLIT:
        reason += f" (load {load[k - 1]:.4g} s vs prefill {saved[k - 1]:.4g} s)"
    return LookupDecision(n, k, decision, reason)


def restore_share(rec: ObjectRecord, context_bytes: int, context_restore_s: float | None) -> float:
    """A chunk's share of its context's profiled restore seconds, by bytes (0: unprofiled)."""
    if not context_restore_s or context_bytes <= 0:
        return 0.0
    return context_restore_s * rec.meta.size_bytes / context_bytes
