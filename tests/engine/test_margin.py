"""The placer's margin on a context, in quality (``engine/margin.py``): what a refinement of
the cheap estimator's qualities could change."""

from __future__ import annotations

import math

import pytest

from kvtierd.engine.margin import decision_margin, room_bytes
from kvtierd.types import DROPPED, ContextProfile, Placement, TierModel, VariantProfile

FAST = TierModel("cpu", 1000, 1000.0)  # 1000 bytes/s: a 500-byte variant loads in 0.5 s
SLOW = TierModel("ssd", None, 100.0)


def _profile(quality: float, prefill_s: float = 100.0) -> ContextProfile:
    return ContextProfile(
        "c", (VariantProfile("none", 1000), VariantProfile("knorm@0.5", 500, quality)),
        frequency=3.0, prefill_s=prefill_s,
    )  # fmt: skip


def test_the_margin_is_the_quality_error_that_would_swap_the_two_best() -> None:
    # knorm@0.5 in cpu: 0.5 s at quality 0.9; none in cpu: 1 s at 1.0. alpha 2: utilities
    # (2*0.9 - 0.5) and (2*1 - 1) per read: knorm wins by 0.3 = 2 * 0.15 quality
    margin = decision_margin(_profile(0.9), Placement("knorm@0.5", "cpu"), [FAST, SLOW], 2.0)
    assert margin == pytest.approx(0.15)


def test_options_of_the_same_quality_or_both_exact_do_not_count() -> None:
    profile = ContextProfile("c", (VariantProfile("none", 1000),), prefill_s=100.0)
    # none in cpu against none in ssd or a recompute: no estimate decides it
    assert decision_margin(profile, Placement("none", "cpu"), [FAST, SLOW], 1.0) == math.inf
    # knorm@0.5 in cpu against knorm@0.5 in ssd (5 s): quality cancels, so only none counts
    lossy = decision_margin(_profile(0.5), Placement("knorm@0.5", "cpu"), [FAST, SLOW], 1.0)
    assert lossy == pytest.approx((0.5 - 1.0) - (0.5 - 1.0))  # against none in cpu


def test_an_option_that_does_not_fit_the_room_left_is_not_an_alternative() -> None:
    profile, chosen = _profile(0.9), Placement("knorm@0.5", "cpu")
    room = room_bytes(profile, chosen, [FAST, SLOW], used=[900.0, 0.0])
    assert room == [600.0, math.inf]  # 100 free, and the 500 it holds itself
    # none (1000 bytes) fits only the ssd: 10 s there, against 0.5 s for knorm in cpu
    margin = decision_margin(profile, chosen, [FAST, SLOW], 1.0, room)
    assert margin == pytest.approx((0.9 - 1.0) - (0.5 - 10.0))


def test_a_dropped_context_against_its_variants() -> None:
    # dropped: a recompute of 1 s at quality 1; knorm@0.5 in cpu: 0.5 s at quality 0.2
    margin = decision_margin(_profile(0.2, prefill_s=1.0), DROPPED, [FAST], 1.0)
    assert margin == pytest.approx((1.0 - 0.2) - (1.0 - 0.5))
