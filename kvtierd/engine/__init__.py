"""The engine: index, leases, access statistics, and the plan executor."""

from kvtierd.engine.engine import Engine

__all__ = ["Engine"]
