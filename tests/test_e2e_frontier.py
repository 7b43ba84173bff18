"""EvicPress against the frontier of fixed policies (benchmarks/e2e/e2e_frontier.py, issue 39),
on points worked by hand."""

from __future__ import annotations

import pytest

from benchmarks.e2e.e2e_frontier import (
    Point,
    Served,
    Span,
    frontier,
    judge,
    judge_bootstrap,
    share_at_ttft,
    ttft_at_share,
)

# issue 39's seed 7, rounded: fixed int4 fast and lossy, fixed int8 slow and faithful
INT4 = Point("fixed-int4", 0.62, 0.276)
INT8 = Point("fixed-int8", 0.87, 0.456)
LRU = Point("lru", 0.97, 0.90)
SLOWER_AND_WORSE = Point("fixed-knorm@0.5", 0.60, 0.50)  # beaten by int8 on both axes


def test_the_frontier_keeps_what_no_other_point_beats_on_both_axes() -> None:
    assert frontier([LRU, SLOWER_AND_WORSE, INT8, INT4]) == (INT4, INT8, LRU)
    # as fast but fewer answers: beaten; as many answers but slower: beaten
    same_time = Point("a", 0.5, 0.276)
    same_share = Point("b", 0.62, 0.3)
    assert frontier([same_time, INT4, same_share]) == (INT4,)
    with pytest.raises(ValueError, match="at least one fixed policy"):
        frontier([])


def test_ttft_at_a_share_is_interpolated_between_the_fixed_policies() -> None:
    front = frontier([INT4, INT8, LRU])
    # 110 of 150 identical answers: 0.7333, a third of the way from int4 to int8... by share
    at = ttft_at_share(front, 110 / 150)
    expected = 0.276 + (110 / 150 - 0.62) / (0.87 - 0.62) * (0.456 - 0.276)
    assert at.span is Span.INSIDE and at.value == pytest.approx(expected)  # 0.3576 s
    assert ttft_at_share(front, 0.87).value == pytest.approx(0.456)  # on a policy: its TTFT
    assert ttft_at_share(front, 0.92).value == pytest.approx((0.456 + 0.90) / 2)
    # outside the span: the nearest end's TTFT, marked as a bound
    assert ttft_at_share(front, 0.5) == type(at)(0.276, Span.BELOW)
    assert ttft_at_share(front, 0.99) == type(at)(0.90, Span.ABOVE)


def test_share_at_a_ttft_is_interpolated_the_other_way() -> None:
    front = frontier([INT4, INT8, LRU])
    at = share_at_ttft(front, 0.331)
    assert at.span is Span.INSIDE
    assert at.value == pytest.approx(0.62 + (0.331 - 0.276) / (0.456 - 0.276) * 0.25)  # 0.696
    assert share_at_ttft(front, 0.2).span is Span.BELOW  # faster than every fixed policy
    assert share_at_ttft(front, 1.5).value == pytest.approx(0.97)
    assert share_at_ttft(front, 1.5).span is Span.ABOVE


def test_judgment_reads_both_ways() -> None:
    ours = Point("evicpress-a2", 110 / 150, 0.331)
    j = judge(ours, [INT8, INT4, LRU, SLOWER_AND_WORSE])
    assert [p.name for p in j.front] == ["fixed-int4", "fixed-int8", "lru"]
    assert j.speedup == pytest.approx(0.35760 / 0.331, rel=1e-4)  # ~1.08x at equal answers
    assert j.share_gain == pytest.approx(110 / 150 - 0.69639, abs=1e-4)  # ~+0.037 as fast
    on_the_line = judge(Point("mix", 0.745, 0.366), [INT4, INT8])
    assert on_the_line.speedup == pytest.approx(1.0) and on_the_line.share_gain == pytest.approx(0)
    # one fixed policy: a point, never interpolated
    alone = judge(Point("x", 0.7, 0.3), [INT8])
    assert alone.ttft_at_share.span is Span.BELOW and alone.share_at_ttft.span is Span.BELOW
    assert str(alone.ttft_at_share) == "0.456 (below)"


def test_judge_bootstrap_pairs_the_requests() -> None:
    n = 40
    # int4: every request at 0.3 s, half its answers identical; int8: 0.5 s, all identical;
    # ours: 0.35 s, three quarters identical: on the line at 0.4 s, so 0.4 / 0.35 faster
    fixed = {"fixed-int4": Served([i % 2 == 0 for i in range(n)], [0.3] * n),
             "fixed-int8": Served([True] * n, [0.5] * n)}  # fmt: skip
    ours = Served([i % 4 != 3 for i in range(n)], [0.35] * n)
    got = judge_bootstrap("evicpress-a2", list(fixed), {"evicpress-a2": ours, **fixed},
                          resamples=500, seed=1)  # fmt: skip
    assert got.judgment.ttft_at_share.value == pytest.approx(0.4)
    assert got.speedup.point == pytest.approx(0.4 / 0.35)
    assert got.share_gain.point == pytest.approx(0.75 - 0.625)
    assert got.speedup.low < got.speedup.point < got.speedup.high
    assert got.share_gain.low < got.share_gain.point < got.share_gain.high
    same = judge_bootstrap("evicpress-a2", list(fixed), {"evicpress-a2": ours, **fixed},
                           resamples=500, seed=1)  # fmt: skip
    assert same == got  # deterministic in its seed


@pytest.mark.parametrize(
    ("served", "match"),
    [
        ({"ours": Served([True], [0.1])}, "no requests of fixed"),
        ({"ours": Served([True], [0.1]), "fixed": Served([True, True], [0.1, 0.2])},
         "the same requests"),
        ({"ours": Served([], []), "fixed": Served([], [])}, "at least one request"),
    ],
)  # fmt: skip
def test_judge_bootstrap_refuses_what_it_cannot_pair(served: dict[str, Served], match: str) -> None:
    with pytest.raises(ValueError, match=match):
        judge_bootstrap("ours", ["fixed"], served)
