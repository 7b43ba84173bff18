"""EvicPress against the frontier of fixed policies (issue 39, item 5).

A fixed policy (every context stored as one variant: int8, int4, keydiff@0.7+int8, ...) is a
point: the share of its answers identical to the full KV's (``exact_share``) and its mean
TTFT. Mixing two fixed policies reaches, roughly, any point on the straight line between
them, so what a placer adds over fixed policies is its distance from the piecewise-linear
frontier through the fixed policies that no other fixed policy beats on both axes
(:func:`frontier`), read two ways (:func:`judge`):

* **TTFT at equal answers**: the frontier's TTFT at EvicPress's exact-match share, over
  EvicPress's TTFT (``speedup`` > 1: EvicPress is faster than the fixed policies giving as
  many identical answers);
* **answers at equal TTFT**: EvicPress's exact-match share less the frontier's at
  EvicPress's TTFT (``share_gain`` > 0: more identical answers than the fixed policies as
  fast).

Outside the frontier's span there is nothing to interpolate between: the reading is then the
nearest end's value and says so (:class:`Span`), a bound rather than an estimate. Above the
most-answering fixed policy's share, for one, no fixed policy gives as many identical answers,
and its TTFT is a lower bound of what one would need.

:func:`judge_bootstrap` gives both readings 95% intervals over one run's requests, resampled
in the same draw for every system (each served the same requests).
"""

from __future__ import annotations

import enum
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from benchmarks.e2e.e2e_stats import Interval


@dataclass(frozen=True, slots=True)
class Point:
    """One system on one run: its share of answers identical to the full KV's, its mean
    TTFT."""

    name: str
    exact_share: float
    ttft_s: float


class Span(enum.Enum):
    """Where a reading's coordinate lies against the frontier."""

    INSIDE = "inside"  # between two fixed policies (or on one): interpolated
    BELOW = "below"  # below the frontier's lowest point: that point's value, a bound
    ABOVE = "above"  # above its highest point: that point's value, a bound


@dataclass(frozen=True, slots=True)
class Reading:
    """The frontier's value at a coordinate, and where the coordinate lay (:class:`Span`)."""

    value: float
    span: Span

    def __str__(self) -> str:
        return f"{self.value:.3f}" + ("" if self.span is Span.INSIDE else f" ({self.span.value})")


@dataclass(frozen=True, slots=True)
class Judgment:
    """One system against the frontier (module docstring)."""

    ours: Point
    front: tuple[Point, ...]  # the frontier (:func:`frontier`), by TTFT ascending
    ttft_at_share: Reading  # the frontier's TTFT (s) at our exact-match share
    share_at_ttft: Reading  # the frontier's exact-match share at our TTFT

    @property
    def speedup(self) -> float:
        """The frontier's TTFT at our share over ours: > 1, we are faster at equal answers."""
        return self.ttft_at_share.value / self.ours.ttft_s

    @property
    def share_gain(self) -> float:
        """Our exact-match share less the frontier's at our TTFT: > 0, more answers as fast."""
        return self.ours.exact_share - self.share_at_ttft.value


def frontier(points: Sequence[Point]) -> tuple[Point, ...]:
    """The points no other point beats on both axes (at least the share at no more TTFT, one
    of them strictly), by TTFT ascending; shares then ascend strictly too. ``ValueError`` for
    no points."""
    if not points:
        raise ValueError("a frontier needs at least one fixed policy, got none")
    out: list[Point] = []
    for p in sorted(points, key=lambda p: (p.ttft_s, -p.exact_share)):
        if not out or p.exact_share > out[-1].exact_share:  # else a faster one answers as well
            out.append(p)
    return tuple(out)


def _interpolate(xs: Sequence[float], ys: Sequence[float], x: float) -> Reading:
    """Piecewise-linear ``y`` at ``x`` through ``(xs, ys)`` (``xs`` ascending strictly)."""
    if x < xs[0]:
        return Reading(ys[0], Span.BELOW)
    if x > xs[-1]:
        return Reading(ys[-1], Span.ABOVE)
    return Reading(float(np.interp(x, xs, ys)), Span.INSIDE)


def ttft_at_share(front: Sequence[Point], share: float) -> Reading:
    """The frontier's TTFT at an exact-match share (``front`` from :func:`frontier`)."""
    return _interpolate([p.exact_share for p in front], [p.ttft_s for p in front], share)


def share_at_ttft(front: Sequence[Point], ttft_s: float) -> Reading:
    """The frontier's exact-match share at a TTFT (``front`` from :func:`frontier`)."""
    return _interpolate([p.ttft_s for p in front], [p.exact_share for p in front], ttft_s)


def judge(ours: Point, fixed: Sequence[Point]) -> Judgment:
    """``ours`` against the frontier of ``fixed`` (module docstring)."""
    front = frontier(fixed)
    return Judgment(ours, front, ttft_at_share(front, ours.exact_share),
                    share_at_ttft(front, ours.ttft_s))  # fmt: skip


@dataclass(frozen=True, slots=True)
class Served:
    """One system's requests on one run, in request order: whether each answer was identical
    to the full KV's, and its TTFT (s)."""

    exact: Sequence[bool]
    ttft_s: Sequence[float]


@dataclass(frozen=True, slots=True)
class JudgedInterval:
    """:class:`Judgment` with the 95% intervals of its two readings (:func:`judge_bootstrap`)."""

    judgment: Judgment
    speedup: Interval
    share_gain: Interval


def judge_bootstrap(
    ours: str, fixed: Sequence[str], served: Mapping[str, Served], *, resamples: int = 2000,
    seed: int = 0,
) -> JudgedInterval:  # fmt: skip
    """:func:`judge` of system ``ours`` against systems ``fixed`` with 95% percentile-bootstrap
    intervals of ``speedup`` and ``share_gain``: each resample draws the requests once, for
    every system alike (module docstring); readings outside the frontier count as their
    bounds."""
    names = [ours, *fixed]
    if missing := [n for n in names if n not in served]:
        raise ValueError(f"no requests of {', '.join(missing)}; have: {', '.join(served)}")
    n = len(served[ours].exact)
    for name in names:
        s = served[name]
        if len(s.exact) != n or len(s.ttft_s) != n:
            raise ValueError(f"{name} served {len(s.exact)} requests, {ours} {n}: a paired "
                             "judgment needs the same requests")  # fmt: skip
    if n == 0:
        raise ValueError("a judgment needs at least one request, got none")
    if resamples < 100:
        raise ValueError(f"resamples must be >= 100 for a 95% interval, got {resamples}")
    exact = np.array([np.asarray(served[k].exact, dtype=np.float64) for k in names])
    ttft = np.array([np.asarray(served[k].ttft_s, dtype=np.float64) for k in names])
    point = _judge_columns(names, exact.mean(axis=1), ttft.mean(axis=1))
    pick = np.random.default_rng(seed).integers(0, n, size=(resamples, n))
    shares, means = exact[:, pick].mean(axis=2), ttft[:, pick].mean(axis=2)  # (systems, draws)
    draws = [_judge_columns(names, shares[:, i], means[:, i]) for i in range(resamples)]
    speed = np.percentile([d.speedup for d in draws], [2.5, 97.5])
    gain = np.percentile([d.share_gain for d in draws], [2.5, 97.5])
    return JudgedInterval(point, Interval(point.speedup, float(speed[0]), float(speed[1])),
                          Interval(point.share_gain, float(gain[0]), float(gain[1])))  # fmt: skip


def _judge_columns(
    names: Sequence[str], shares: np.ndarray[Any, Any], means: np.ndarray[Any, Any]
) -> Judgment:
    """:func:`judge` of ``names[0]`` against the rest, from their shares and mean TTFTs."""
    points = [Point(n, float(s), float(t)) for n, s, t in zip(names, shares, means, strict=True)]
    return judge(points[0], points[1:])
