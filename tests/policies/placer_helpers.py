"""Helpers for placer tests: tiny profiles and a plan replayer that checks capacity."""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from kvtierd.types import ContextProfile, Placement, Plan, TierModel, VariantProfile


def profile(
    cid: str,
    variants: Mapping[str, tuple[int, float]],
    *,
    frequency: float = 1.0,
    prefill_s: float = 20.0,
    pinned: bool = False,
) -> ContextProfile:
    """A profile from ``{variant: (size_bytes, quality)}``."""
    return ContextProfile(
        context_id=cid,
        variants=tuple(VariantProfile(n, s, q) for n, (s, q) in variants.items()),
        frequency=frequency,
        prefill_s=prefill_s,
        pinned=pinned,
    )


def replay(
    plan: Plan,
    state: dict[str, Placement],
    sizes: Mapping[str, Mapping[str, int]],
    tiers: Sequence[TierModel],
) -> None:
    """Execute ``plan`` on ``state`` (context -> placement), checking capacity after each op."""
    for op in plan.operations:
        current = state.get(op.context_id)
        if current is not None:
            assert current == op.source, (op, current)
        else:
            assert op.source.dropped, op
        state[op.context_id] = op.target
        for tier in tiers:
            if tier.capacity_bytes is None:
                continue
            used = sum(sizes[c][p.variant] for c, p in state.items() if p.tier == tier.name)
            assert used <= tier.capacity_bytes, (op, tier.name, used)
