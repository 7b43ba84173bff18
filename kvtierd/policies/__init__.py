"""Placement policies: the placer interface, EvicPress's greedy placer, baselines, solvers.

Importing the package registers the built-in placers: ``lru``, ``lfu``, ``fixed``, ``prefill``
and ``evicpress`` (see ``docs/policies.md``). Build one with :func:`make_placer`.
"""

from kvtierd.policies import baselines as _baselines  # noqa: F401  (registers placers)
from kvtierd.policies import evicpress as _evicpress  # noqa: F401  (registers the placer)
from kvtierd.policies import lru as _lru  # noqa: F401  (registers the placer)
from kvtierd.policies.base import (
    PLACERS,
    Placer,
    PlacerParams,
    make_placer,
    placer_class,
    register_placer,
)

__all__ = ["PLACERS", "Placer", "PlacerParams", "make_placer", "placer_class", "register_placer"]
