"""Fixtures for placer tests."""

from __future__ import annotations

import pytest

from kvtierd.types import TierModel


@pytest.fixture
def two_tiers() -> list[TierModel]:
    """A 100-byte fast tier at 100 B/s over an unbounded slow tier at 10 B/s."""
    return [TierModel("fast", 100, 100.0), TierModel("slow", None, 10.0)]
