"""The placement problem as dense arrays: TTFT and utility of every (variant, tier) per context.

EvicPress §4.2, priced by :mod:`kvtierd.utility` (``(alpha * quality - TTFT) * frequency``; the
TTFT of a cached placement is its load, of ``dropped`` the context's prefill; the query's own
prefill is left out, it never changes a decision).

A :class:`UtilityTable` holds ``n`` contexts x ``V`` variant slots x ``T`` tiers. Contexts with
fewer variants are padded: a padded slot has ``valid == False`` and utility ``-inf``, so no
solver ever picks it. Sizes are float64 bytes (exact for sizes below 2**53).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import numpy.typing as npt

from kvtierd.types import ContextProfile, TierModel, VariantProfile
from kvtierd.utility import check_tiers, dropped_utility

FloatArray = npt.NDArray[np.float64]
IntArray = npt.NDArray[np.int64]
BoolArray = npt.NDArray[np.bool_]


def _check_array(name: str, values: FloatArray, low: float, *, low_ok: bool = True) -> None:
    """Every entry finite and >= ``low`` (> ``low`` without ``low_ok``), else ``ValueError``
    naming the array, the first bad index and value."""
    ok = np.isfinite(values) & ((values >= low) if low_ok else (values > low))
    if not ok.all():
        at = tuple(int(i) for i in np.argwhere(~ok)[0])
        rule = ">=" if low_ok else ">"
        raise ValueError(
            f"{name} must be finite and {rule} {low:g}; {name}[{', '.join(map(str, at))}] is "
            f"{values[at]!r}"
        )


def capacity_array(capacity_bytes: Sequence[int | None]) -> FloatArray:
    """Tier capacities as floats, ``inf`` for an unbounded tier, shape ``(T,)``."""
    return np.array([np.inf if c is None else float(c) for c in capacity_bytes])


def _check_inputs(
    alpha: float,
    tiers: Sequence[TierModel],
    *,
    size: FloatArray,
    quality: FloatArray,
    restore_s: FloatArray,
    frequency: FloatArray,
    prefill_s: FloatArray,
) -> None:
    """:meth:`UtilityTable.from_arrays`' refusals (padding slots are not checked)."""
    if not (math.isfinite(alpha) and alpha > 0):
        raise ValueError(f"alpha must be a finite number > 0, got {alpha!r}")
    check_tiers(tiers)
    _check_array("size_bytes", size, 0.0)
    _check_array("quality", quality, -math.inf, low_ok=False)
    _check_array("restore_s", restore_s, 0.0)
    _check_array("frequency", frequency, 0.0)
    _check_array("prefill_s", np.asarray(prefill_s, dtype=np.float64), 0.0)


UTILITY_BLOCK_ROWS = 4096
"""Rows priced at a time by :func:`_utilities`: its two ``(rows, V)`` work buffers stay in
the cache and are reused, where whole-table buffers were 48 MB of fresh pages each at
100,000 x 60 (pages the kernel zeroes: issue 28)."""


def _utilities(
    alpha: float,
    tiers: Sequence[TierModel],
    *,
    size: FloatArray,
    quality: FloatArray,
    restore_s: FloatArray,
    frequency: FloatArray,
    valid: BoolArray,
    best: FloatArray | None = None,
) -> FloatArray:
    """``utility(alpha, quality, load_ttft_s(size, restore_s, tier), frequency)`` of every
    tier, ``(n, V, T)``, ``-inf`` where not ``valid``. The same operations in the same order as
    those functions (bit for bit the same values), but into two reused work buffers of
    :data:`UTILITY_BLOCK_ROWS` rows (issue 28). ``best``, when given, receives each cell's
    maximum over the tiers (``util.max(axis=2)``, exactly: a maximum does not round), taken
    while each tier's values are at hand."""
    n, n_var = size.shape
    util = np.empty((n, n_var, len(tiers)), dtype=np.float64)
    for tier in tiers:
        check_tiers((tier,))
    rows = max(1, min(n, UTILITY_BLOCK_ROWS))
    scaled_buf = np.empty((rows, n_var), dtype=np.float64)
    ttft_buf = np.empty((rows, n_var), dtype=np.float64)
    for b0 in range(0, n, rows):
        b1 = min(n, b0 + rows)
        scaled, ttft = scaled_buf[: b1 - b0], ttft_buf[: b1 - b0]
        # utility()'s alpha * quality: the same for every tier.
        np.multiply(alpha, quality[b0:b1], out=scaled)
        freq = frequency[b0:b1, None]
        invalid = ~valid[b0:b1]
        for t, tier in enumerate(tiers):
            # load_seconds: size / bandwidth + overhead + restore, left to right.
            np.divide(size[b0:b1], tier.load_bandwidth_bytes_per_s, out=ttft)
            np.add(ttft, tier.load_overhead_s, out=ttft)
            np.add(ttft, restore_s[b0:b1], out=ttft)
            # utility: (alpha * quality - ttft) * frequency.
            np.subtract(scaled, ttft, out=ttft)
            np.multiply(ttft, freq, out=ttft)
            ttft[invalid] = -np.inf
            util[b0:b1, :, t] = ttft
            if best is not None:
                if t == 0:
                    np.copyto(best[b0:b1], ttft)
                else:
                    np.maximum(best[b0:b1], ttft, out=best[b0:b1])
    return util


@dataclass(frozen=True, slots=True, eq=False)
class UtilityTable:
    """Dense utilities of every configuration of ``n`` contexts (EvicPress §4.2, §4.4).

    Shapes: ``size_bytes``, ``quality``, ``valid``: ``(n, V)``; ``util``: ``(n, V, T)``;
    ``drop_util``, ``frequency``: ``(n,)``. ``variant_names[i][v]`` names slot ``v`` of context
    ``i``. ``capacity_bytes[t]`` is ``None`` for an unbounded tier.
    """

    context_ids: tuple[str, ...]
    variant_names: tuple[tuple[str, ...], ...]
    size_bytes: FloatArray
    quality: FloatArray
    valid: BoolArray
    util: FloatArray
    drop_util: FloatArray
    frequency: FloatArray
    pinned: BoolArray
    capacity_bytes: tuple[int | None, ...]

    @property
    def n_contexts(self) -> int:
        return len(self.context_ids)

    @property
    def n_tiers(self) -> int:
        return len(self.capacity_bytes)

    @classmethod
    def from_arrays(
        cls,
        *,
        tiers: Sequence[TierModel],
        alpha: float,
        size_bytes: FloatArray,
        quality: FloatArray,
        restore_s: FloatArray,
        frequency: FloatArray,
        prefill_s: FloatArray,
        valid: BoolArray | None = None,
        context_ids: Sequence[str] | None = None,
        variant_names: Sequence[Sequence[str]] | None = None,
        pinned: BoolArray | None = None,
    ) -> UtilityTable:
        """Build a table from per-variant arrays ``(n, V)`` and per-context arrays ``(n,)``.

        This is the fast path for the profiler and the benchmarks: no Python object per variant.
        Non-finite or negative inputs (and ``alpha`` <= 0) raise ``ValueError`` naming them:
        a NaN or infinite utility would make every solver's choice meaningless.
        """
        size = np.asarray(size_bytes, dtype=np.float64)
        n, n_var = size.shape
        ok = np.ones((n, n_var), dtype=bool) if valid is None else np.asarray(valid, dtype=bool)
        freq = np.asarray(frequency, dtype=np.float64)
        qual = np.asarray(quality, dtype=np.float64)
        rest = np.asarray(restore_s, dtype=np.float64)
        every = bool(ok.all())  # then no (n, V) copy of the valid entries to check
        _check_inputs(alpha, tiers, size=size if every else size[ok],
                      quality=qual if every else qual[ok],
                      restore_s=rest if every else rest[ok],
                      frequency=freq, prefill_s=prefill_s)  # fmt: skip
        best = np.empty((n, n_var), dtype=np.float64)  # each cell's best tier (below)
        util = _utilities(alpha, tiers, size=size, quality=qual, restore_s=rest, frequency=freq,
                          valid=ok, best=best)  # fmt: skip
        drop = dropped_utility(alpha, np.asarray(prefill_s, dtype=np.float64), freq)
        ids = tuple(context_ids) if context_ids is not None else tuple(str(i) for i in range(n))
        names = (
            tuple(tuple(v) for v in variant_names)
            if variant_names is not None
            else tuple(tuple(str(v) for v in range(n_var)) for _ in range(n))
        )
        pin = np.zeros(n, dtype=bool) if pinned is None else np.asarray(pinned, dtype=bool)
        # A variant worth less than dropping in every tier is never in an optimum (dropping
        # frees its bytes too), but it steered the online insert's repair: a quality-0 variant
        # of one context changed where others went (tests/policies/test_properties.py). So it
        # is no option at all; the first variant (the original) and pinned contexts keep theirs.
        dominated = ok & (best < drop[:, None]) & ~pin[:, None]
        dominated[:, 0] = False
        util[dominated] = -np.inf
        ok = ok & ~dominated
        return cls(
            context_ids=ids,
            variant_names=names,
            size_bytes=np.where(ok, size, 0.0),
            quality=qual,
            valid=ok,
            util=util,
            drop_util=drop,
            frequency=freq,
            pinned=pin,
            capacity_bytes=tuple(t.capacity_bytes for t in tiers),
        )

    @classmethod
    def from_options(
        cls, options: OptionArrays, tiers: Sequence[TierModel], alpha: float
    ) -> UtilityTable:
        """Price ``options`` in ``tiers`` (the daemon's path: its options are kept as arrays)."""
        return cls.from_arrays(
            tiers=tiers,
            alpha=alpha,
            size_bytes=options.size_bytes,
            quality=options.quality,
            restore_s=options.restore_s,
            frequency=options.frequency,
            prefill_s=options.prefill_s,
            valid=options.valid,
            context_ids=options.context_ids,
            variant_names=options.variant_names,
            pinned=options.pinned,
        )

    @classmethod
    def from_profiles(
        cls, profiles: Sequence[ContextProfile], tiers: Sequence[TierModel], alpha: float
    ) -> UtilityTable:
        """Build a table from profiles (one Python object per variant: the slow, general path)."""
        return cls.from_options(OptionArrays.from_profiles(profiles), tiers, alpha)


@dataclass(frozen=True, slots=True, eq=False)
class OptionArrays:
    """What a placer is told of ``n`` contexts, as arrays: :class:`ContextProfile` values
    without a Python object per variant (the daemon's rebalance of 100,000 contexts x 60
    variants would build six million).

    Shapes: ``size_bytes``, ``quality``, ``restore_s``, ``valid``: ``(n, V)`` (a context with
    fewer variants is padded: ``valid`` False, size 0); ``frequency``, ``prefill_s``,
    ``last_access_s``, ``pinned``: ``(n,)``. ``variant_names[i]`` names the valid slots of
    context ``i``, in order.
    """

    context_ids: tuple[str, ...]
    variant_names: tuple[tuple[str, ...], ...]
    size_bytes: FloatArray
    quality: FloatArray
    restore_s: FloatArray
    valid: BoolArray
    frequency: FloatArray
    prefill_s: FloatArray
    last_access_s: FloatArray
    pinned: BoolArray

    @property
    def n_contexts(self) -> int:
        return len(self.context_ids)

    @classmethod
    def from_profiles(cls, profiles: Sequence[ContextProfile]) -> OptionArrays:
        n = len(profiles)
        n_var = max((len(p.variants) for p in profiles), default=1)
        size = np.zeros((n, n_var))
        qual = np.zeros((n, n_var))
        rest = np.zeros((n, n_var))
        ok = np.zeros((n, n_var), dtype=bool)
        for i, p in enumerate(profiles):
            k = len(p.variants)
            size[i, :k] = [v.size_bytes for v in p.variants]
            qual[i, :k] = [v.quality for v in p.variants]
            rest[i, :k] = [v.restore_s for v in p.variants]
            ok[i, :k] = True
        return cls(
            context_ids=tuple(p.context_id for p in profiles),
            variant_names=tuple(tuple(v.variant for v in p.variants) for p in profiles),
            size_bytes=size,
            quality=qual,
            restore_s=rest,
            valid=ok,
            frequency=np.array([p.frequency for p in profiles], dtype=np.float64),
            prefill_s=np.array([p.prefill_s for p in profiles], dtype=np.float64),
            last_access_s=np.array([p.last_access_s for p in profiles], dtype=np.float64),
            pinned=np.array([p.pinned for p in profiles], dtype=bool),
        )

    def profiles(self) -> list[ContextProfile]:
        """One :class:`ContextProfile` per context (for a placer that reads objects)."""
        out = []
        for i, cid in enumerate(self.context_ids):
            names = self.variant_names[i]
            variants = tuple(
                VariantProfile(name, int(size), float(q), float(r))
                for name, size, q, r in zip(
                    names, self.size_bytes[i].tolist(), self.quality[i].tolist(),
                    self.restore_s[i].tolist(), strict=False,
                )
            )  # fmt: skip
            out.append(
                ContextProfile(
                    cid,
                    variants,
                    float(self.frequency[i]),
                    float(self.prefill_s[i]),
                    float(self.last_access_s[i]),
                    bool(self.pinned[i]),
                )
            )
        return out


@dataclass(frozen=True, slots=True, eq=False)
class Assignment:
    """A solution: per context a variant slot and a tier index; ``dropped[i]`` overrides both.

    Shapes ``(n,)``. For a dropped context ``variant`` and ``tier`` are 0 and meaningless.
    """

    variant: IntArray
    tier: IntArray
    dropped: BoolArray

    def total_utility(self, table: UtilityTable) -> float:
        """Sum of the utilities of the chosen configurations (the objective of §4.4)."""
        rows = np.arange(table.n_contexts)
        cached = table.util[rows, self.variant, self.tier]
        return float(np.where(self.dropped, table.drop_util, cached).sum())

    def tier_usage_bytes(self, table: UtilityTable) -> FloatArray:
        """Bytes used in each tier, shape ``(T,)``."""
        rows = np.arange(table.n_contexts)
        size = np.where(self.dropped, 0.0, table.size_bytes[rows, self.variant])
        return np.bincount(self.tier, weights=size, minlength=table.n_tiers).astype(np.float64)

    def feasible(self, table: UtilityTable) -> bool:
        """True when no finite tier is over capacity and no chosen slot is padding."""
        rows = np.arange(table.n_contexts)
        if not np.all(self.dropped | table.valid[rows, self.variant]):
            return False
        used = self.tier_usage_bytes(table)
        return all(c is None or used[t] <= c for t, c in enumerate(table.capacity_bytes))
