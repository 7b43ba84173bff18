"""Variant sizes, quality and restore cost per context: a generator calibrated to EvicPress §3.1.

Calibration (documented in ``docs/policies.md``):

* **Sensitivity.** §3.1 / Fig. 3 gives, per dataset, the median "quality drop at compression
  ratio 0.9" (2wikimQA 0.681, NarrativeQA 0.340, ...) and a coefficient of variation of 0.078 to
  0.394 within a dataset. §4.2's worked example (2wikimQA, keydiff: quality 0.92 / 0.82 / 0.65 at
  "ratio" 0.2 / 0.4 / 0.6) only fits that drop if "ratio" there means the fraction *removed*, so
  a context's sensitivity ``sigma`` is its quality drop with 90% of tokens removed. ``sigma`` is
  lognormal around the dataset median with CoV ``sensitivity_cov`` (default 0.25, mid-range).
* **Curve.** quality of token dropping keeping a fraction ``r`` =
  ``1 - sigma * m * ((1 - r) / 0.9) ** 1.6``; the exponent 1.6 fits §4.2's three points
  (drops 0.08, 0.18, 0.35 at 20/40/60% removed, normalised by 0.68: exponents 1.42, 1.64, 1.64).
* **Methods.** ``m`` is a per-context, per-method multiplier, lognormal with medians keydiff
  1.0 < snapkv 1.1 < knorm 1.2 (§6.3: keydiff generally beats snapkv, which beats knorm) and a
  spread of 0.25, so every method is best for a sizeable share of contexts (Fig. 4: 40/40/20%).
* **Quantization** (not profiled in the paper): int8 costs ``0.02 * sigma``, int4
  ``0.15 * sigma`` of quality; composed variants multiply qualities.
* **Sizes** (a vectorised estimate over many contexts; :mod:`kvtierd.sizes` has the exact
  per-context formula): token dropping keeps ``round(r * N)`` tokens; int8/int4 store
  ``b / 8`` bytes per element plus 4 bytes (fp16 scale + zero) per group of 32 elements, i.e.
  0.5625 / 0.3125 of fp16.
* **Restore:** dequantization at 300 GB/s and the RoPE re-rotation of kept keys at 500 GB/s of
  the restored fp16 bytes (GPU kernels; small next to loading, as in §2.2).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from kvtierd.errors import InvalidArgumentError
from kvtierd.policies.model import FloatArray
from kvtierd.sim.workload import DATASETS, Workload
from kvtierd.sizes import (
    DEFAULT_GROUP_SIZE,
    SCALE_ZERO_BYTES,
    count_unit,
    variant_kept_tokens,
)
from kvtierd.types import ORIGINAL_VARIANT
from kvtierd.variants import QUANT_BITS, parse_variant

METHOD_MEDIAN = {"keydiff": 1.0, "snapkv": 1.1, "knorm": 1.2}
QUANT_COST = {"int8": 0.02, "int4": 0.15}
DEQUANT_BYTES_PER_S = 300e9
ROTATE_BYTES_PER_S = 500e9
CURVE_EXPONENT = 1.6


@dataclass(frozen=True, slots=True)
class VariantSpace:
    """Which variants exist: methods x ratios (+ ``none``), quantizations, composed ones."""

    methods: tuple[str, ...] = ("keydiff", "knorm", "snapkv")
    ratios: tuple[float, ...] = (0.9, 0.8, 0.7, 0.6, 0.5, 0.4, 0.3, 0.2, 0.1)
    quant: tuple[str, ...] = ("int8", "int4")
    compose_with: tuple[str, ...] = ()  # e.g. ("int8",) adds "knorm@0.5+int8", ...

    def names(self) -> tuple[str, ...]:
        drops = [f"{m}@{r:g}" for m in self.methods for r in self.ratios]
        composed = [f"{d}+{q}" for d in drops for q in self.compose_with]
        return (ORIGINAL_VARIANT, *drops, *self.quant, *composed)


def quant_ratio(quant: str, dtype_bytes: int = 2) -> float:
    """Stored bytes / original bytes of a quantized KV (codes + scale/zero per group)."""
    return (QUANT_BITS[quant] / 8 + SCALE_ZERO_BYTES / DEFAULT_GROUP_SIZE) / dtype_bytes


@dataclass(frozen=True, slots=True)
class Form:
    """A variant name as the simulator reads it: the token-dropping ``method`` (``""`` when
    no token is dropped), the kept ``ratio`` and the quantization ``quant`` (``""``: none)."""

    method: str
    ratio: float
    quant: str

    @classmethod
    def of(cls, name: str) -> Form:
        """``none``, ``int8``, ``knorm@0.5``, ``knorm@0.5+int8`` (method options such as
        ``snapkv-window=32@0.5`` are part of the method)."""
        try:
            v = parse_variant(name)
        except ValueError as e:
            raise InvalidArgumentError(str(e)) from e
        if v.drops_tokens and v.ratio >= 1.0:
            raise InvalidArgumentError(
                f"variant {name!r}: the simulator drops tokens at ratios in (0, 1); at ratio 1 "
                f"name it {str(v.canonical())!r}"
            )
        return cls(v.drop_method, v.ratio, v.quant)


@dataclass(frozen=True, slots=True, eq=False)
class Shape:
    """One variant of ``n`` contexts: kept tokens, stored bytes, restore seconds ``(n,)``."""

    kept_tokens: FloatArray
    size_bytes: FloatArray
    restore_s: FloatArray


def shape(
    form: Form, tokens: FloatArray, per_token: float, dtype_bytes: int, chunk_tokens: int = 1
) -> Shape:
    """Sizes and restore cost of ``form`` for contexts of ``tokens`` tokens (module doc). A
    context stored in chunks of ``chunk_tokens`` (> 1) keeps whole chunks of a token-dropped
    form, as the daemon stores and sizes it (:func:`kvtierd.sizes.variant_kept_tokens`: a
    1,792-token context's ``keydiff@0.5`` keeps 1,024 tokens in chunks of 256, not 896; issue
    26's daemon logged its ``keydiff@0.5+int8`` at 13,271,040 bytes, 1,024 tokens of int8)."""
    kept = tokens.copy()
    restore = np.zeros_like(tokens)
    if form.method:
        kept = _kept_tokens(form, tokens, chunk_tokens)
        restore += kept * per_token / 2 / ROTATE_BYTES_PER_S
    byte_ratio = kept / tokens
    if form.quant:
        byte_ratio = byte_ratio * quant_ratio(form.quant, dtype_bytes)
        restore += kept * per_token / DEQUANT_BYTES_PER_S
    return Shape(kept, np.ceil(byte_ratio * tokens * per_token), restore)


def _kept_tokens(form: Form, tokens: FloatArray, chunk_tokens: int) -> FloatArray:
    """Tokens a token-dropped ``form`` keeps of each context: ``round(r * N)`` (at least 1), or
    in chunks of ``chunk_tokens`` the daemon's count (:func:`shape`)."""
    if chunk_tokens <= 1:
        return np.maximum(np.round(form.ratio * tokens), 1.0)
    name = f"{form.method}@{form.ratio:g}"
    unit = count_unit(name, chunk_tokens)
    counts = [variant_kept_tokens(int(n), name, chunk_tokens=unit) for n in tokens.tolist()]
    return np.array(counts, dtype=np.float64)


@dataclass(frozen=True, slots=True, eq=False)
class VariantTable:
    """Per context x variant: ``size_bytes``, ``quality``, ``restore_s``, ``kept_tokens``."""

    names: tuple[str, ...]
    size_bytes: FloatArray
    quality: FloatArray
    restore_s: FloatArray
    kept_tokens: FloatArray


def make_variants(
    workload: Workload, space: VariantSpace, sensitivity_cov: float = 0.25, seed: int = 0
) -> VariantTable:
    """Sizes and calibrated qualities of every variant of every context (see module doc)."""
    rng = np.random.default_rng(seed + 1)
    n = workload.context_tokens.size
    median = np.array([DATASETS[d].sensitivity_median for d in workload.context_dataset])
    spread = math.sqrt(math.log1p(sensitivity_cov**2))
    sigma = np.clip(median * rng.lognormal(0.0, spread, n), 0.0, 1.0)
    mult = {m: METHOD_MEDIAN[m] * rng.lognormal(0.0, 0.25, n) for m in space.methods}
    names = space.names()
    # a context's variants are of its own KV: a shared prefix's is stored (and priced) once
    tokens = workload.own_tokens.astype(np.float64)
    model = workload.model
    size = np.empty((n, len(names)))
    qual = np.empty((n, len(names)))
    rest = np.empty((n, len(names)))
    kept = np.empty((n, len(names)))
    for j, name in enumerate(names):
        form = Form.of(name)
        q: FloatArray = np.ones(n)
        if form.method:
            removed = ((1.0 - form.ratio) / 0.9) ** CURVE_EXPONENT
            q = q * np.clip(1.0 - sigma * mult[form.method] * removed, 0.0, 1.0)
        if form.quant:
            q = q * np.clip(1.0 - QUANT_COST[form.quant] * sigma, 0.0, 1.0)
        sh = shape(form, tokens, float(model.kv_bytes_per_token), model.dtype_bytes)
        size[:, j], qual[:, j], rest[:, j], kept[:, j] = (
            sh.size_bytes,
            q,
            sh.restore_s,
            sh.kept_tokens,
        )
    return VariantTable(names, size, qual, rest, kept)
