"""Write advice: the variant a writer should store a context in (``KVStore.Advise``; "advice",
not "plan": a :class:`~kvtierd.types.Plan` is the placer's list of operations).

A writer that holds the KV on its own device (the LMCache plugin beside vLLM) can compress it
there and ship only the compressed bytes, if it knows what the placer will do with the context:

* a context the daemon holds: its current placement (``placed``) — the placer already chose;
* a new context under a quality-seeking placer, once some contexts are profiled: the option
  with the best EvicPress utility ``(alpha * quality - ttft) * frequency`` for a context of the
  given size, with each variant's quality and size ratio averaged over the profiled contexts
  of the same tenant (``prior``: one tenant's advice never reads another's profiles), less
  what making room for it would cost in a full tier (the placer's price of
  room, ``EvicPressPlacer.room_cost``: its next operation there, per byte short). Without
  that price the advice was the unconstrained first choice, the original in the fastest
  tier: in bench_e2e's full tiers every put was shipped whole (35-83 MB of float32) and
  compressed by the daemon on the cores vLLM serves with, and a context kept whole there
  pushed others out. The placer still decides when the context arrives, and profiles it
  like any other. **The original is advised only in a tier with room for it as it is**: a
  new context arrives unprofiled, and until its profile the placer can keep it only in the
  form it arrived in (its other variants count as quality 0, ``ContextOptions.grid_row``).
  Shipped whole into a full tier it competes at its full size with frequency 1 and is
  often dropped on arrival; the profile that would have kept it quantized comes too late
  (bench_e2e with the 1,024-token system prompt: warm-up documents dropped as they arrived
  and missed at their first timed request, while those shipped int8 on the same advice
  were kept). The room price alone did not prevent it: compressing others to int8 costs
  them almost nothing in utility, so the original looked nearly free there;
* otherwise what the policy stores new contexts as (``default``): the original, or the fixed
  placer's variant.
"""

from __future__ import annotations

from dataclasses import dataclass

from kvtierd.engine.context_options import ContextOptions
from kvtierd.engine.index import ContextIndex
from kvtierd.engine.placing import Placing
from kvtierd.engine.state import RunningPolicy
from kvtierd.types import ORIGINAL_VARIANT
from kvtierd.utility import dropped_utility, load_ttft_s, utility

MAX_PRIORS = 1024  # tenants' priors kept between changes of the profiles


@dataclass(frozen=True, slots=True)
class WriteAdvice:
    context_id: str
    variant: str
    tier: str  # "" = the placer would not store it
    source: str  # placed | prior | default
    reason: str


@dataclass(frozen=True, slots=True)
class VariantPrior:
    """A variant's mean quality, size relative to the original, and restore seconds."""

    quality: float
    size_ratio: float
    restore_s: float


class WriteAdvisor:
    """Answers ``KVStore.Advise`` for the contexts of ``index`` (module docstring)."""

    def __init__(
        self,
        *,
        index: ContextIndex,
        options: ContextOptions,
        placing: Placing,
        policy: RunningPolicy,
    ) -> None:
        self._index = index
        self._options = options
        self._placing = placing
        self._policy = policy
        # per tenant: the options' version it was computed at, the prior, contexts counted
        self._priors: dict[str, tuple[int, dict[str, VariantPrior], int]] = {}

    def advise(
        self, context_id: str, num_tokens: int, size_bytes: int, tenant: str = ""
    ) -> WriteAdvice:
        """Advice for ``tenant``'s context ``context_id`` (a scoped name), from that tenant's
        own contexts only: no answer tells one tenant about another's (issue 40.8)."""
        ctx = self._index.contexts.get(context_id)
        if ctx is not None:
            where = self._index.placement_of(ctx)
            return WriteAdvice(
                context_id, where.variant, where.tier or "", "placed",
                f"{self._placing.name}: the context is stored as {where.variant} in {where.tier}",
            )  # fmt: skip
        policy = self._policy.current
        if policy.fixed_variant:
            return WriteAdvice(
                context_id, policy.fixed_variant, "", "default",
                f"policy {policy.name!r} stores every context as {policy.fixed_variant}",
            )  # fmt: skip
        prior = self.prior(tenant)
        if len(prior) <= 1 or size_bytes <= 0:
            why = (
                "no context of yours is profiled yet"
                if len(self._options.variants()) > 1
                else f"placer {self._placing.name!r} does not compress"
            )
            return WriteAdvice(
                context_id, ORIGINAL_VARIANT, "", "default",
                f"{why}: store the original; it is profiled after it arrives",
            )  # fmt: skip
        return self._best(context_id, prior, num_tokens, size_bytes, self._priors[tenant][2])

    def _best(
        self,
        context_id: str,
        prior: dict[str, VariantPrior],
        num_tokens: int,
        size_bytes: int,
        count: int,
    ) -> WriteAdvice:
        alpha = self._policy.current.alpha
        prefill = self._options.prefill_tokens_s(num_tokens)
        # The frequency the placer will insert it with: 1, or what a dropped one kept.
        freq = self._options.frequency(context_id) or 1.0
        room = self._placing.placer.room_cost
        best = (dropped_utility(alpha, prefill, freq), ORIGINAL_VARIANT, "")  # recompute
        for tier in self._placing.tier_models():
            for name, p in prior.items():
                size = p.size_ratio * size_bytes
                if tier.capacity_bytes is not None and size > tier.capacity_bytes:
                    continue
                cost = room(tier.name, size)
                if name == ORIGINAL_VARIANT and cost > 0:
                    continue  # whole only where it fits as it is (module docstring)
                ttft = load_ttft_s(size, p.restore_s, tier)
                value = utility(alpha, p.quality, ttft, freq) - cost
                best = max(best, (value, name, tier.name))
        value, variant, tier_name = best
        where = f"in {tier_name}" if tier_name else "nowhere (recomputing is better)"
        return WriteAdvice(
            context_id, variant, tier_name, "prior",
            f"{self._placing.name}: best utility {value:.4g} as {variant} {where} (less the "
            f"room it takes from others), from the mean profile of {count} of your "
            "profiled contexts",
        )  # fmt: skip

    def prior(self, tenant: str = "") -> dict[str, VariantPrior]:
        """Each variant's quality and size ratio averaged over ``tenant``'s profiled contexts
        (another tenant's profiles, and their count in the reason, are not its to read);
        recomputed (a pass over every context) only once a profile or a context's form has
        changed since, not on every ``KVStore.Advise``."""
        options = self._options
        version = options.version
        kept = self._priors.get(tenant)
        if kept is not None and kept[0] == version:
            return kept[1]
        if len(self._priors) >= MAX_PRIORS:
            self._priors.clear()  # a cache: rebuilt on demand
        sums: dict[str, list[float]] = {}
        count = 0
        for ctx in self._index.contexts.values():
            if ctx.tenant != tenant:
                continue
            profiled = options.profiled(ctx.context_id)
            if not profiled:
                continue
            grid = {v.variant: v for v in options.grid(ctx)}
            original = grid.get(ORIGINAL_VARIANT)
            if original is None or original.size_bytes <= 0:
                continue
            count += 1
            for name, v in grid.items():
                known = profiled.get(name)
                quality, restore = (known.quality, known.restore_s) if known else (1.0, 0.0)
                if name != ORIGINAL_VARIANT and known is None:
                    continue
                acc = sums.setdefault(name, [0.0, 0.0, 0.0, 0.0])
                acc[0] += quality
                acc[1] += v.size_bytes / original.size_bytes
                acc[2] += restore
                acc[3] += 1
        prior = {name: VariantPrior(q / n, r / n, s / n) for name, (q, r, s, n) in sums.items()}
        self._priors[tenant] = (version, prior, count)
        return prior
