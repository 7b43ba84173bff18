"""Decayed access counts: exact math against the definition."""

from __future__ import annotations

import math

import pytest
from hypothesis import given
from hypothesis import strategies as st

from kvtierd.errors import InvalidArgumentError
from kvtierd.profiler import DecayedCounter, FrequencyTracker


def test_one_access_halves_every_half_life() -> None:
    c = DecayedCounter(half_life_s=10.0)
    c.add(100.0)
    assert c.value_at(100.0) == 1.0
    assert c.value_at(110.0) == 0.5
    assert c.value_at(130.0) == 0.125


def test_accesses_sum_with_their_own_ages() -> None:
    c = DecayedCounter(half_life_s=10.0)
    c.add(0.0)
    c.add(10.0, weight=2.0)
    assert c.value_at(10.0) == 2.5
    assert c.value_at(20.0) == 1.25


def test_late_access_is_aged_not_moved_forward() -> None:
    c = DecayedCounter(half_life_s=10.0)
    c.add(20.0)
    c.add(10.0)  # arrives after the access at 20 s but happened earlier
    assert c.value_at(20.0) == 1.5
    assert c.t_ref_s == 20.0


@given(
    st.lists(st.tuples(st.floats(0, 1e5), st.floats(0, 10)), min_size=1, max_size=30),
    st.floats(1, 1e4),
)
def test_equals_the_sum_over_accesses(accesses: list[tuple[float, float]], half: float) -> None:
    c = DecayedCounter(half_life_s=half)
    for t, w in accesses:
        c.add(t, w)
    now = max(t for t, _ in accesses) + 7.0
    want = sum(w * 2 ** (-(now - t) / half) for t, w in accesses)
    assert math.isclose(c.value_at(now), want, rel_tol=1e-9, abs_tol=1e-12)


def test_tracker_per_context_and_half_life_switch() -> None:
    f = FrequencyTracker(half_life_s=100.0)
    f.record("a", 0.0)
    f.record("a", 0.0)
    f.record("b", 50.0)
    assert f.frequency("a", 100.0) == 1.0
    assert f.frequency("never", 100.0) == 0.0
    f.set_half_life(10.0, now_s=100.0)
    assert f.frequency("a", 100.0) == 1.0  # the value at the switch is kept
    assert f.frequency("a", 110.0) == 0.5  # and decays at the new rate
    f.forget("a")
    assert f.frequency("a", 110.0) == 0.0
    assert set(f) == {"b"}
    assert "b" in f and "a" not in f


@pytest.mark.parametrize("bad", [0.0, -1.0, math.inf, math.nan])
def test_bad_half_life(bad: float) -> None:
    with pytest.raises(InvalidArgumentError, match="half_life_s"):
        DecayedCounter(half_life_s=bad)
    with pytest.raises(InvalidArgumentError):
        DecayedCounter(half_life_s=1.0).add(0.0, weight=-1.0)


def test_frequencies_are_frequency_bit_for_bit() -> None:
    """The array form a rebalance reads (issue 28) gives each context's :meth:`frequency`
    exactly: numpy's vectorised exp2 differs from ``math.exp2`` in the last bit on a few
    percent of ages, so a vectorised decay would fail this; unknown contexts are 0, and a
    half-life switch is honoured."""
    import numpy as np

    rng = np.random.default_rng(7)
    f = FrequencyTracker(half_life_s=600.0)
    ids = [f"c{i}" for i in range(3000)]
    for cid in ids[:2500]:
        for t in rng.uniform(0.0, 5e4, int(rng.integers(1, 4))).tolist():
            f.record(cid, t, float(rng.uniform(0.1, 3.0)))
    f.set_half_life(317.3, now_s=4e4)
    f.record("c0", 4.5e4)
    asked = [*ids, "never"]
    now = 5.1e4 + 0.123
    got = f.frequencies(asked, now)
    want = np.array([f.frequency(cid, now) for cid in asked])
    assert got.tobytes() == want.tobytes()
    assert got[-1] == 0.0 and np.all(got[2500:3000] == 0.0) and np.all(got[:2500] > 0)
    assert f.frequencies([], now).shape == (0,)


def test_a_context_count_is_one_small_object() -> None:
    """Issue 42: a daemon of a million contexts keeps a decayed count for each. A counter
    object with its time's float took ~100 bytes a context besides the map's entry; one complex
    (value and time) takes 32."""
    import tracemalloc

    ids = [f"c{i}" for i in range(20_000)]
    f = FrequencyTracker(half_life_s=600.0)
    tracemalloc.start()
    try:
        for i, cid in enumerate(ids):
            f.record(cid, 1000.0 + i, 1.0)
        traced, _ = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert traced / len(ids) < 80  # the map's entry (~33 B at 20k) and the count's 32
    assert f.frequency("c5", 1005.0) == 1.0 and f.frequency("c5", 1605.0) == 0.5
