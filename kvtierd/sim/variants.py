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
* **Sizes** (own formula; kvtierd.kernels has the exact one but policies may not import it):
  token dropping keeps ``round(r * N)`` tokens; int8/int4 store ``b / 8`` bytes per element plus
  4 bytes (fp16 scale + zero) per group of 32 elements, i.e. 0.5625 / 0.3125 of fp16.
* **Restore:** dequantization at 300 GB/s and the RoPE re-rotation of kept keys at 500 GB/s of
  the restored fp16 bytes (GPU kernels; small next to loading, as in §2.2).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from kvtierd.policies.model import FloatArray
from kvtierd.sim.workload import DATASETS, Workload
from kvtierd.types import ORIGINAL_VARIANT

METHOD_MEDIAN = {"keydiff": 1.0, "snapkv": 1.1, "knorm": 1.2}
QUANT_BITS = {"int8": 8, "int4": 4}
QUANT_COST = {"int8": 0.02, "int4": 0.15}
QUANT_GROUP = 32
SCALE_ZERO_BYTES = 4
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
    return (QUANT_BITS[quant] / 8 + SCALE_ZERO_BYTES / QUANT_GROUP) / dtype_bytes


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
    tokens = workload.context_tokens.astype(np.float64)
    per_token = float(workload.model.kv_bytes_per_token)
    size = np.empty((n, len(names)))
    qual = np.empty((n, len(names)))
    rest = np.zeros((n, len(names)))
    kept = np.empty((n, len(names)))
    for j, name in enumerate(names):
        drop_part, _, quant = name.partition("+")
        if drop_part in QUANT_BITS:
            drop_part, quant = ORIGINAL_VARIANT, drop_part
        keep: FloatArray = np.ones(n)
        q: FloatArray = np.ones(n)
        if drop_part != ORIGINAL_VARIANT:
            method, _, ratio_s = drop_part.partition("@")
            ratio = float(ratio_s)
            keep = np.maximum(np.round(ratio * tokens), 1.0) / tokens
            removed = ((1.0 - ratio) / 0.9) ** CURVE_EXPONENT
            q = q * np.clip(1.0 - sigma * mult[method] * removed, 0.0, 1.0)
            rest[:, j] += keep * tokens * per_token / 2 / ROTATE_BYTES_PER_S
        byte_ratio = keep.copy()
        if quant:
            byte_ratio *= quant_ratio(quant, workload.model.dtype_bytes)
            q = q * np.clip(1.0 - QUANT_COST[quant] * sigma, 0.0, 1.0)
            rest[:, j] += keep * tokens * per_token / DEQUANT_BYTES_PER_S
        kept[:, j] = keep * tokens
        size[:, j] = np.ceil(byte_ratio * tokens * per_token)
        qual[:, j] = q
    return VariantTable(names, size, qual, rest, kept)
