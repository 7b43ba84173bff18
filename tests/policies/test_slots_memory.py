"""Issue 42: the placer's slots at a million contexts. The utilities' array is sized for the
widest grid of variants, and doubles as contexts arrive; the rows no context has taken yet
are left unwritten, so their pages are not resident, and no list names every free slot."""

from __future__ import annotations

import os
import sys

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from kvtierd.policies.base import PlacerParams
from kvtierd.policies.evicpress import EvicPressPlacer
from kvtierd.policies.greedy_state import (
    SCORE_SHIFT,
    SEQ_SHIFT,
    entry_slot,
    key_score,
    score_key,
    score_keys,
)
from kvtierd.policies.model import UtilityTable
from kvtierd.policies.slots import Slots
from kvtierd.types import ContextProfile, TierModel, VariantProfile


def _rss_bytes() -> int:
    with open(f"/proc/{os.getpid()}/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc")
def test_slots_grown_for_a_million_contexts_keep_untaken_rows_off_memory() -> None:
    slots = Slots(2, 30, capacity=16)
    before = _rss_bytes()
    slots._grow(1 << 20, 30)
    slots._grow_wide(1 << 20, 30)
    grown = _rss_bytes() - before
    # 503 MB of wide utilities (1M x 30 variants x 2 tiers): written in full, as they were,
    # the growth was ~610 MB; now the small per-slot arrays and lists, ~105 MB
    assert slots.wutil.nbytes > 500e6
    assert grown < slots.wutil.nbytes / 2, grown
    assert not slots._free and slots._fresh == 0


def test_released_slots_are_taken_again_first_then_fresh_ones_in_order() -> None:
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


def _table(widths: list[int]) -> UtilityTable:
    """Contexts of ``widths[i]`` variants each (sizes and qualities distinct), two tiers."""
    tiers = [TierModel("cpu", 10_000, 1e9, 0.0), TierModel("ssd", 10**9, 1e8, 0.0)]
    profiles = [
        ContextProfile(
            f"c{i}",
            tuple(VariantProfile(f"v{v}", 100 * (i + 1) + v, 1.0 - v / 50) for v in range(k)),
            1.0 + i,
            1.0,
        )
        for i, k in enumerate(widths)
    ]
    return UtilityTable.from_profiles(profiles, tiers, 1.0)


def _dense_row(table: UtilityTable, i: int, width: int) -> tuple[list[float], list[list[float]]]:
    size = [0.0] * width
    util = [[-np.inf] * table.n_tiers for _ in range(width)]
    for v in range(len(table.variant_names[i])):
        size[v] = float(table.size_bytes[i, v])
        util[v] = table.util[i, v].tolist()
    return size, util


@pytest.mark.parametrize("added", [False, True])
def test_ragged_rows_read_back_as_the_dense_table(added: bool) -> None:
    """One-variant contexts keep 24 bytes, wide ones a row of ``wsize``/``wutil``: ``row``,
    ``gather``, ``size_of`` and ``chosen`` give what the dense table holds (padding: size 0,
    utility -inf), whether the slots were made by ``add`` or installed by ``from_table``."""
    widths = [1, 5, 1, 1, 3, 1, 5, 1]
    table = _table(widths)
    variant = np.array([0, 4, 0, 0, 2, 0, 1, 0])
    tier = np.array([0, 1, -1, 1, 0, 0, 1, -1])
    if added:
        slots = Slots(2)
        for i, names in enumerate(table.variant_names):
            assert slots.add(f"c{i}", names, table, i) == i
        slots.variant[:8], slots.tier[:8] = variant, tier
    else:
        slots = Slots.from_table(table, variant, tier)
    assert int((slots.wide_at[:8] >= 0).sum()) == 3  # only the wide contexts take wide rows
    width = max(widths)
    for i in range(8):
        size, util = slots.row(i)
        want_size, want_util = _dense_row(table, i, width)
        k = size.shape[0]
        assert size.tolist() == want_size[:k] and util.tolist() == want_util[:k]
        assert all(s == 0.0 for s in want_size[k:])  # a shorter row only drops padding
        assert slots.size_of(i, int(variant[i])) == want_size[variant[i]]
    at = np.array([3, 1, 0, 6])
    size, util = slots.gather(at)
    for j, i in enumerate(at):
        want_size, want_util = _dense_row(table, int(i), width)
        assert size[j].tolist() == want_size and util[j].tolist() == want_util
    chosen_size, chosen_util = slots.chosen(np.arange(8))
    for i in range(8):
        want_size, want_util = _dense_row(table, i, width)
        assert chosen_size[i] == want_size[variant[i]]
        assert chosen_util[i] == want_util[variant[i]][max(tier[i], 0)]
    slots.rescale(1, 2 * float(slots.freq[1]))  # a wide row scales in place
    assert slots.row(1)[1][0].tolist() == (2 * table.util[1, 0]).tolist()
    assert table.util[1, 0].tolist() == _dense_row(table, 1, width)[1][0]  # the table's own
    taken = slots.wsize.shape[0] - len(slots._wide_free)
    slots.release("c1")
    assert slots.wide_at[1] == -1
    assert slots.wsize.shape[0] - len(slots._wide_free) == taken - 1


def test_one_variant_contexts_take_no_wide_row() -> None:
    """100,000 one-variant contexts beside one of 30 variants: 1 wide row, not 100,001."""
    table = _table([30, 1])
    slots = Slots(2)
    slots.add("wide", table.variant_names[0], table, 0)
    for i in range(100_000):
        slots.add(f"n{i}", table.variant_names[1], table, 1)
    assert slots.wsize.shape[0] - len(slots._wide_free) == 1
    per_slot = (slots.size1.nbytes + slots.util1.nbytes + slots.wide_at.nbytes) / slots.capacity
    assert per_slot == 8 + 2 * 8 + 8  # bytes a slot for its row, where a padded row was 744


def test_contexts_of_one_grid_share_one_tuple_of_names() -> None:
    """Each insert's table makes its own tuple of variant names for its one context; the slots
    keep one tuple for equal names (issue 42: 49 bytes a one-variant context)."""
    tables = [_table([1]) for _ in range(3)]
    assert tables[0].variant_names[0] is not tables[1].variant_names[0]
    slots = Slots(2)
    taken = [slots.add(f"c{i}", t.variant_names[0], t, 0) for i, t in enumerate(tables)]
    assert slots.names[taken[0]] == ("v0",)
    assert all(slots.names[s] is slots.names[taken[0]] for s in taken)


def test_a_heap_entry_is_one_int_naming_its_score_slot_and_version() -> None:
    """Issue 42: the greedy's heaps hold an entry per placed context. ``(score, seq, slot,
    version)`` took ~180 bytes with its four number objects, ``(score, seq << 32 | slot)``
    ~116; one int holding the score's key, the push's number (the slot's version) and the slot
    takes 48 (and the list's pointer)."""
    tiers = [TierModel("cpu", 100 * 1000, 1e9, 0.0), TierModel("ssd", 10**9, 1e8, 0.0)]
    placer = EvicPressPlacer(tiers, PlacerParams(alpha=10.0))
    for i in range(300):  # 300 contexts of 1,000 bytes: the CPU tier holds 100 of them
        placer.insert(ContextProfile(f"c{i}", (VariantProfile("none", 1000, 1.0),), 1.0 + i, 1.0))
    state = placer._state
    s = state.slots
    live = 0
    for t, heap in enumerate(state._heaps):
        for entry in heap:
            slot, version = entry_slot(entry)
            if s.version[slot] == version and s.alive[slot] and s.tier[slot] == t:
                live += 1
                assert key_score(entry) == state.best_op(slot, t)[0]
            assert sys.getsizeof(entry) <= 48
    assert live == int(np.count_nonzero(s.alive & (s.tier >= 0)))  # one live entry each
    assert state.held == [100, 200]


@given(st.lists(st.floats(allow_nan=False), min_size=2, max_size=50))
def test_score_keys_order_as_their_scores_and_give_them_back(scores: list[float]) -> None:
    """A heap entry orders by its score first: keys order as their floats do (ties between
    equal floats, -0.0 and 0.0 among them, are equal keys), the vectorised keys are the same
    ints, and an entry gives its score back."""
    keys = [score_key(x) for x in scores]
    assert score_keys(np.array(scores)) == keys
    assert all(0 <= k < 1 << 64 for k in keys)
    for a, ka in zip(scores, keys, strict=True):
        for b, kb in zip(scores, keys, strict=True):
            assert (a < b) == (ka < kb) and (a == b) == (ka == kb)
        entry = ka << SCORE_SHIFT | 7 << SEQ_SHIFT | 3
        assert key_score(entry) == a and entry_slot(entry) == (3, 7)
