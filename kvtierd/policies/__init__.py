"""Placement policies: the placer interface, EvicPress's greedy placer, baselines, solvers.

The built-in placers — ``lru``, ``lfu``, ``fixed``, ``prefill`` and ``evicpress`` (see
``docs/policies.md``) — are found by name in :data:`PLACERS` and imported on first use. Build
one with :func:`make_placer`.
"""

from kvtierd.policies.base import PLACERS, Placer, PlacerParams, make_placer, placer_class

__all__ = ["PLACERS", "Placer", "PlacerParams", "make_placer", "placer_class"]
