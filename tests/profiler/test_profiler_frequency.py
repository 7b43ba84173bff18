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
