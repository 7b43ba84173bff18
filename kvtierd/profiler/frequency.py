"""Exponentially decayed access counts: the ``frequency`` term of the utility (EvicPress §4.2).

An access at time ``t_i`` with weight ``w_i`` counts ``w_i * 2 ** (-(t - t_i) / half_life_s)``
at time ``t``; the counter is the sum over accesses. It is kept as one value and the time it
refers to, so an access costs O(1) and the sum is exact (up to float rounding):

    value(t) = value(t_ref) * 2 ** (-(t - t_ref) / half_life_s)

Times are wall-clock seconds (``time.time()``), not monotonic: counts are persisted and must
keep decaying across a daemon restart.
"""

from __future__ import annotations

import math
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass

import numpy as np
import numpy.typing as npt

from kvtierd.errors import InvalidArgumentError

FloatArray = npt.NDArray[np.float64]


def _check_half_life(half_life_s: float) -> None:
    if not (half_life_s > 0 and math.isfinite(half_life_s)):
        raise InvalidArgumentError(f"half_life_s must be a positive number, got {half_life_s}")


def _decayed(value: float, t_ref_s: float, half_life_s: float, now_s: float) -> float:
    """A count ``value`` at ``t_ref_s``, at ``now_s``."""
    return value * math.exp2(-(now_s - t_ref_s) / half_life_s)


def _added(
    value: float, t_ref_s: float, half_life_s: float, now_s: float, weight: float
) -> tuple[float, float]:
    """A count ``value`` at ``t_ref_s`` with an access at ``now_s`` added: the new value and
    the time it refers to. A late (out-of-order) access is decayed to ``t_ref_s``."""
    if weight < 0:
        raise InvalidArgumentError(f"weight must be >= 0, got {weight}")
    if value == 0.0:  # nothing to decay (and no 2**(+large) for an earlier access)
        return weight, now_s
    if now_s >= t_ref_s:
        return _decayed(value, t_ref_s, half_life_s, now_s) + weight, now_s
    return value + _decayed(weight, now_s, half_life_s, t_ref_s), t_ref_s


@dataclass(slots=True)
class DecayedCounter:
    """A decayed count (module docstring). ``value`` is the count at ``t_ref_s``."""

    half_life_s: float
    value: float = 0.0
    t_ref_s: float = 0.0

    def __post_init__(self) -> None:
        _check_half_life(self.half_life_s)

    def add(self, now_s: float, weight: float = 1.0) -> None:
        """Record an access at ``now_s``; a late (out-of-order) access is decayed to ``t_ref``."""
        self.value, self.t_ref_s = _added(self.value, self.t_ref_s, self.half_life_s, now_s, weight)

    def value_at(self, now_s: float) -> float:
        """The count at ``now_s`` (never mutates)."""
        return _decayed(self.value, self.t_ref_s, self.half_life_s, now_s)


class FrequencyTracker:
    """Decayed counts per context, with a half-life the policy may change at run time.

    A context's count is one ``complex``: the value (real part) at the time it refers to
    (imaginary part). Two floats in one 32-byte object, where a :class:`DecayedCounter` with
    its time's float took ~100 bytes a context (issue 42: a million contexts).
    """

    def __init__(self, half_life_s: float) -> None:
        _check_half_life(half_life_s)
        self.half_life_s = half_life_s
        self._counts: dict[str, complex] = {}

    def record(self, context_id: str, now_s: float, weight: float = 1.0) -> None:
        c = self._counts.get(context_id, 0j)
        value, t_ref = _added(c.real, c.imag, self.half_life_s, now_s, weight)
        self._counts[context_id] = complex(value, t_ref)

    def frequency(self, context_id: str, now_s: float) -> float:
        """Decayed count; 0.0 for a context never recorded."""
        c = self._counts.get(context_id)
        return 0.0 if c is None else _decayed(c.real, c.imag, self.half_life_s, now_s)

    def frequencies(self, context_ids: Sequence[str], now_s: float) -> FloatArray:
        """:meth:`frequency` of each context, as an array: bit for bit the same values (the
        decay's ``exp2`` is ``math.exp2`` per context, which numpy's vectorised one is not
        always; the rest is the same IEEE operations), without a method call per context (a
        rebalance of 100,000 contexts asks for all of them, issue 28)."""
        get = self._counts.get
        counts = [get(cid) for cid in context_ids]
        at = np.fromiter((c is not None for c in counts), dtype=bool, count=len(counts))
        known = np.array([c for c in counts if c is not None], dtype=np.complex128)
        # _decayed: value * exp2(-(now - t_ref) / half_life), exp2 per context as there.
        exponent = -(now_s - known.imag) / self.half_life_s
        decay = np.fromiter(map(math.exp2, exponent.tolist()), dtype=np.float64, count=known.size)
        out = np.zeros(len(counts), dtype=np.float64)
        out[at] = known.real * decay
        return out

    def set_half_life(self, half_life_s: float, now_s: float) -> None:
        """Switch half-life: counts so far keep their value at ``now_s`` and decay at the new
        rate from then on (the past cannot be re-weighted: only the sum is kept)."""
        _check_half_life(half_life_s)
        for cid in self._counts:
            self._counts[cid] = complex(self.frequency(cid, now_s), now_s)
        self.half_life_s = half_life_s

    def forget(self, context_id: str) -> None:
        self._counts.pop(context_id, None)

    def __iter__(self) -> Iterator[str]:
        return iter(self._counts)

    def __contains__(self, context_id: object) -> bool:
        return context_id in self._counts

    def state(self, context_id: str) -> tuple[float, float]:
        """``(value, t_ref_s)`` for persistence."""
        c = self._counts[context_id]
        return c.real, c.imag

    def restore(self, states: Mapping[str, tuple[float, float]]) -> None:
        for cid, (value, t_ref) in states.items():
            self._counts[cid] = complex(float(value), float(t_ref))
