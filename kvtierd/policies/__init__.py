"""Placement policies: the placer interface, EvicPress's greedy placer, baselines, solvers."""

from kvtierd.policies import lru as _lru  # noqa: F401  (registers the placer)
from kvtierd.policies.base import PLACERS, Placer, PlacerParams, placer_class, register_placer

__all__ = ["PLACERS", "Placer", "PlacerParams", "placer_class", "register_placer"]
