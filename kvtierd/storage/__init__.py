"""Tiers: gpu (CUDA pool), cpu (shared-memory arena), ssd (object files), remote (Redis).

Built by ``kind`` from :data:`TIERS` (each imported on first use): importing this package
loads no tier module but the CPU tier's.
"""

from kvtierd.storage.base import TIERS, Tier, create_tier
from kvtierd.storage.cpu import CpuTier

__all__ = ["TIERS", "CpuTier", "Tier", "create_tier"]
