"""Tiers: gpu (CUDA pool), cpu (shared-memory arena), ssd (object files), remote (Redis)."""

from kvtierd.storage import cpu as _cpu  # noqa: F401  (registers the tier)
from kvtierd.storage import gpu as _gpu  # noqa: F401
from kvtierd.storage import remote as _remote  # noqa: F401
from kvtierd.storage import ssd as _ssd  # noqa: F401
from kvtierd.storage.base import TIERS, Tier, create_tier, register_tier, tier_class
from kvtierd.storage.cpu import CpuTier

__all__ = ["TIERS", "CpuTier", "Tier", "create_tier", "register_tier", "tier_class"]
