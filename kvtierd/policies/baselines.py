"""Paper baselines beside ``lru`` (EvicPress §6.1): ``fixed``, ``lfu`` and ``prefill``.

* ``fixed:<variant>`` — every context is stored as the same variant (e.g. ``fixed:knorm@0.5``,
  ``fixed:int8``) and evicted down the tiers by LRU, without adapting the variant: the paper's
  "(keydiff/knorm/snapkv) compression + LRU-based eviction". A context whose profile lacks the
  variant is stored as the original (a context too short to compress).
* ``lfu`` — eviction only, least frequently used (hit count, ties by recency) moves down first.
  A spill sorts the tier's contexts by count: ``O(n log n)`` per overflow, fine for a baseline.
* ``prefill`` — caches nothing: every context is dropped and every request is a full prefill.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping, Sequence
from dataclasses import replace
from typing import ClassVar

from kvtierd.errors import ConfigError, InvalidArgumentError
from kvtierd.policies.base import Placer, PlacerParams
from kvtierd.policies.lru import LruPlacer
from kvtierd.policy_config import PolicyConfig, PolicyDocument, check_snapkv_model, check_variant
from kvtierd.types import DROPPED, ORIGINAL_VARIANT, ContextProfile, Placement, Plan, TierModel
from kvtierd.variants import parse_variant


class FixedPlacer(LruPlacer):
    """One fixed variant for all contexts + LRU eviction (``params.fixed_variant``)."""

    name = "fixed"
    policy_keys: ClassVar[tuple[str, ...]] = ("variant", "profiling")
    policy_fields: ClassVar[tuple[str, ...]] = ("fixed_variant", "variants", "evaluator_model_dir")

    @classmethod
    def read_policy(cls, doc: PolicyDocument, policy: PolicyConfig) -> PolicyConfig:
        """``variant``, required: the one variant every context is stored as; ``profiling``:
        only ``model_dir``, which a snapkv variant needs (the daemon builds it)."""
        at = ("variant",)
        if not doc.has(at):
            raise ConfigError(f"{doc.where(at)}: placer 'fixed' requires key 'variant'")
        variant = check_variant(doc.text_value(at, ""), doc.where(at))
        doc.check_keys(("profiling",), ("model_dir",), "allowed keys for placer 'fixed'")
        model_dir = doc.text_value(("profiling", "model_dir"), "")
        # snapkv@1 was named none by check_variant: it keeps every token and needs nothing
        check_snapkv_model(doc, at, (variant,), (parse_variant(variant),), model_dir)
        grid = tuple(dict.fromkeys((ORIGINAL_VARIANT, variant)))
        return replace(policy, fixed_variant=variant, variants=grid, evaluator_model_dir=model_dir)

    def __init__(self, tiers: Sequence[TierModel], params: PlacerParams | None = None) -> None:
        super().__init__(tiers, params)
        if not self.params.fixed_variant:
            raise InvalidArgumentError(
                "placer 'fixed' needs a variant: 'fixed:<variant>' or params.fixed_variant, "
                "e.g. 'fixed:knorm@0.5'"
            )

    def _variant_for(self, profile: ContextProfile) -> str:
        wanted = self.params.fixed_variant
        if any(v.variant == wanted for v in profile.variants):
            return wanted
        return super()._variant_for(profile)  # the original, or the only form it has


class LfuPlacer(LruPlacer):
    """Eviction only; the least frequently used context of a full tier moves down first."""

    name = "lfu"

    def __init__(self, tiers: Sequence[TierModel], params: PlacerParams | None = None) -> None:
        super().__init__(tiers, params)
        self._hits: dict[str, int] = {}

    def _touch(self, cid: str) -> None:
        self._hits[cid] = self._hits.get(cid, 0) + 1

    def _victims(self, level: int) -> Iterator[str]:
        # The recency list is least recent first and sorted() is stable: ties go by recency.
        yield from sorted(self._lru[level], key=lambda c: self._hits.get(c, 0))

    def remove(self, context_id: str) -> None:
        super().remove(context_id)
        self._hits.pop(context_id, None)


class PrefillPlacer(Placer):
    """No cache: every context is dropped (the paper's full-prefill baseline)."""

    name = "prefill"

    def __init__(self, tiers: Sequence[TierModel], params: PlacerParams | None = None) -> None:
        super().__init__(tiers, params)
        self._known: set[str] = set()

    def insert(self, profile: ContextProfile) -> Plan:
        self._known.add(profile.context_id)
        return Plan()

    def access(self, context_id: str, now_s: float, fastest: str = "") -> Plan:
        return Plan()

    def remove(self, context_id: str) -> None:
        self._known.discard(context_id)

    def placement(self, context_id: str) -> Placement:
        if context_id not in self._known:
            raise KeyError(context_id)
        return DROPPED

    def rebalance(
        self, profiles: Sequence[ContextProfile], fastest: Mapping[str, str] | None = None
    ) -> Plan:
        self._known = {p.context_id for p in profiles}
        return Plan()
