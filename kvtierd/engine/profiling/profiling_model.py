"""Which checkpoint the running policy's quality profiles read, and whether they read one at all
(issue 39: a daemon without ``profiling.model_dir`` profiled every context with the labels'
per-variant prior, silently, so EvicPress placed by variant class and frequency alone).

Where the policy names a ``profiling.model_dir``, that is it. Where it names none, the daemon
uses kvtierd's model cache — the checkpoint ``kvtierd model fetch`` converts
(``model_fetch.fetched_model_path``) — when three things hold:

* the placer uses quality (``Placer.uses_quality``): no other placer reads a profile;
* the checkpoint may be loaded by the rules a policy applied at run time is held to
  (``kvtierd/model_dirs.py``: inside the daemon's ``model_dirs``, else the cache; no other
  user can write it). Its path is the daemon's own, never one a tenant sends;
* its geometry (head dim, RoPE frequencies, vocabulary) is that of a model card the default
  tenant's plugin registered: the daemon then knows it profiles with the model vLLM serves.
  Another tenant's card moves nothing: profiles with a model change every tenant's placements.

Else the estimator falls back to the prior, and :class:`QualityProfiling` says so.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Collection, Mapping
from dataclasses import dataclass, replace

from kvtierd.config import DaemonConfig
from kvtierd.engine.servable import card_tenant
from kvtierd.errors import InvalidArgumentError, PermissionDeniedError
from kvtierd.kernels.placeholder import ModelCard, read_model_rope
from kvtierd.model_dirs import allowed_model_roots, check_model_dir
from kvtierd.model_fetch import fetched_model_path
from kvtierd.policies import placer_class
from kvtierd.policy_config import PolicyConfig

logger = logging.getLogger(__name__)

PRIOR_WITHOUT_MODEL: tuple[str, ...] = ("query_attention",)
"""Estimators that give the labels' per-variant prior, the same for every context, when no
model is known (``profiler/query_attention.py``); ``attention`` probes the context's own
keys instead."""


@dataclass(frozen=True, slots=True)
class QualityProfiling:
    """How the running policy's profiles are made (``Admin.Status``). ``estimator`` is ``""``
    when the placer does not use quality; ``model_from``: ``"policy"``, ``"model cache"`` or
    ``""`` (no model)."""

    estimator: str = ""
    refiner: str = ""
    model_dir: str = ""
    model_from: str = ""

    @property
    def prior_only(self) -> bool:
        """No model for an estimator that then falls back: to coverage for the token-dropping
        variants of contexts whose token ids are known, to the prior for the rest."""
        return self.estimator in PRIOR_WITHOUT_MODEL and not self.model_dir


class ProfilingModel:
    """The model cache's checkpoint as ``profiling.model_dir`` where the policy names none
    (module doc). ``cards``: the engine's model cards, by ``<tenant>/<model>``."""

    def __init__(self, config: DaemonConfig, cards: Mapping[str, ModelCard]) -> None:
        self._roots = allowed_model_roots(config.model_dirs)
        self._tenants = frozenset(t.name for t in config.tenants)
        self._cards = cards
        self._cached = ""  # the cache's checkpoint :meth:`resolve` gave the running policy

    def resolve(self, policy: PolicyConfig) -> PolicyConfig:
        """``policy`` with the model cache's checkpoint as its model when it names none and
        the checkpoint may serve as the served model's; else ``policy`` itself."""
        if policy.evaluator_model_dir:
            if policy.evaluator_model_dir != self._cached:
                self._cached = ""  # a policy that names its own
            return policy
        uses_quality = placer_class(policy.placer).uses_quality
        self._cached = self._matching_checkpoint() if uses_quality else ""
        return replace(policy, evaluator_model_dir=self._cached) if self._cached else policy

    def describe(self, policy: PolicyConfig) -> QualityProfiling:
        if not placer_class(policy.placer).uses_quality:
            return QualityProfiling()
        model = policy.evaluator_model_dir
        cached = bool(model) and model == self._cached
        return QualityProfiling(
            estimator=policy.estimator,
            refiner=policy.evaluator if policy.refines else "",
            model_dir=model,
            model_from=("model cache" if cached else "policy") if model else "",
        )

    def _matching_checkpoint(self) -> str:
        found = fetched_model_path()
        if found is None:
            return ""
        try:
            check_model_dir(str(found), self._roots)
            rope = read_model_rope(str(found))
        except (PermissionDeniedError, InvalidArgumentError, OSError, ValueError, KeyError) as e:
            logger.info("kvtierd's model cache holds %s, not used for profiles: %s", found, e)
            return ""
        inv_freq = [rope.theta ** (-2 * j / rope.rotary_dim) for j in range(rope.rotary_dim // 2)]
        for card in _default_tenants(self._cards, self._tenants):
            same_rope = len(card.inv_freq) == len(inv_freq) and all(
                math.isclose(a, b, rel_tol=1e-4)
                for a, b in zip(card.inv_freq, inv_freq, strict=True)
            )
            if (card.head_dim, card.vocab_size) == (rope.head_dim, rope.vocab_size) and same_rope:
                return str(found)
        return ""


def _default_tenants(cards: Mapping[str, ModelCard], tenants: Collection[str]) -> list[ModelCard]:
    """The default tenant's cards that describe a model (a refused card carries only why)."""
    return [c for name, c in cards.items() if not card_tenant(name, tenants) and not c.refused]
