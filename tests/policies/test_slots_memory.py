"""Issue 42: the placer's slots at a million contexts. The utilities' array is sized for the
widest grid of variants, and doubles as contexts arrive; the rows no context has taken yet
are left unwritten, so their pages are not resident, and no list names every free slot."""

from __future__ import annotations

import os
import sys

import pytest

from kvtierd.policies.slots import Slots


def _rss_bytes() -> int:
    with open(f"/proc/{os.getpid()}/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc")
def test_slots_grown_for_a_million_contexts_keep_untaken_rows_off_memory() -> None:
    slots = Slots(2, 30, capacity=16)
    before = _rss_bytes()
    slots._grow(1 << 20, 30)
    grown = _rss_bytes() - before
    # 503 MB of utilities (1M x 30 variants x 2 tiers): written in full, as they were, the
    # growth was ~610 MB; now the small per-slot arrays and lists, ~105 MB
    assert slots.util.nbytes > 500e6
    assert grown < slots.util.nbytes / 2, grown
    assert not slots._free and slots._fresh == 0


def test_released_slots_are_taken_again_first_then_fresh_ones_in_order() -> None:
    from kvtierd.policies.model import UtilityTable
    from kvtierd.types import ContextProfile, TierModel, VariantProfile

    tiers = [TierModel("cpu", 1000, 1e9, 0.0)]
    table = UtilityTable.from_profiles(
        [ContextProfile(f"c{i}", (VariantProfile("none", 10, 1.0),), 1.0, 1.0) for i in range(3)],
        tiers,
        1.0,
    )
    slots = Slots(1)
    taken = [slots.add(f"c{i}", ("none",), table, i) for i in range(3)]
    assert taken == [0, 1, 2]
    slots.release("c1")
    slots.release("c0")
    assert [slots.add(k, ("none",), table, 0) for k in ("x", "y", "z")] == [0, 1, 3]
