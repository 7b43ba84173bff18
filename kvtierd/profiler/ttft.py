"""TTFT model: predicted seconds to make a stored variant usable (EvicPress §4.2, delay term).

    ttft_s(variant, tier) = size_bytes / load_bandwidth_bytes_per_s(tier)   # transfer
                          + load_overhead_s(tier)                          # per-load fixed cost
                          + restore_s(variant, size_bytes)                 # dequantize / rotate
    prefill_s(tokens)     = tokens / prefill_tokens_per_s                  # a dropped context

The paper assumes tier bandwidths fixed; here both load terms are fitted from the tiers' real
reads (``kvtierd.storage.base.TransferMeter``: per-load overhead + bandwidth, calibrated at
start with reads of a few MiB, refitted from every read after). The engine builds this model
from ``Engine.tier_models()``, the placer's figures (:meth:`TtftModel.update_tier` takes newer
ones); the profiler never imports the storage layer. Restore costs are
*measured* on this host (:class:`RestoreCost`) once per kind and scaled linearly with bytes.
The policies' :func:`kvtierd.policies.model.load_ttft_s` is the same formula over
:meth:`TtftModel.tier_models` plus ``VariantProfile.restore_s``.
"""

from __future__ import annotations

import math
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace

from kvtierd.errors import InvalidArgumentError, NotFoundError
from kvtierd.kernels.variants import DEFAULT_GROUP_SIZE, as_variant
from kvtierd.types import TierModel


@dataclass(frozen=True, slots=True)
class TierLoad:
    """A tier as the TTFT model sees it; ``capacity_bytes=None`` is unbounded."""

    name: str
    load_bandwidth_bytes_per_s: float
    load_overhead_s: float = 0.0
    capacity_bytes: int | None = None

    def __post_init__(self) -> None:
        bw, ov = self.load_bandwidth_bytes_per_s, self.load_overhead_s
        if not (bw > 0 and math.isfinite(bw)) or not (ov >= 0 and math.isfinite(ov)):
            raise InvalidArgumentError(
                f"tier {self.name!r}: need bandwidth > 0 and overhead >= 0, got {bw} B/s, {ov} s"
            )


class RestoreCost:
    """Measured seconds per stored byte to restore a variant on load, cached per kind.

    Kinds: ``int8``/``int4`` (dequantize, :func:`kvtierd.kernels.api.dense_kv`) and ``rotate``
    (RoPE delta rotation of the keys, only when keys are stored unrotated). Each is timed once,
    on ``reference_tokens`` tokens of fp16 ``[1, 8, T, 128]`` K and V on CPU (best of
    ``repeats``), the first time it is asked for; :meth:`set` overrides a figure (a GPU host).
    """

    def __init__(self, reference_tokens: int = 4096, repeats: int = 3) -> None:
        self.reference_tokens = reference_tokens
        self.repeats = repeats
        self._s_per_byte: dict[str, float] = {}
        self._lock = threading.Lock()

    def set(self, kind: str, seconds_per_byte: float) -> None:
        self._s_per_byte[kind] = seconds_per_byte

    def seconds_per_byte(self, kind: str) -> float:
        with self._lock:
            if kind not in self._s_per_byte:
                self._s_per_byte[kind] = self._measure(kind)
            return self._s_per_byte[kind]

    def restore_s(self, variant: str, size_bytes: int, *, rotate_on_load: bool = False) -> float:
        v = as_variant(variant)
        s = 0.0
        if v.quant:
            s += self.seconds_per_byte(v.quant) * size_bytes
        if rotate_on_load and v.drops_tokens:
            s += self.seconds_per_byte("rotate") * size_bytes
        return s

    def _measure(self, kind: str) -> float:
        import torch

        from kvtierd.kernels.api import dense_kv
        from kvtierd.kernels.quant import quantize_kv
        from kvtierd.kernels.results import CompressedKV
        from kvtierd.kernels.rope import RopeSpec, rotate_keys
        from kvtierd.kernels.variants import QUANT_BITS

        n = self.reference_tokens
        gen = torch.Generator().manual_seed(0)
        k = torch.randn((1, 8, n, 128), generator=gen).half()
        v = torch.randn((1, 8, n, 128), generator=gen).half()
        if kind == "rotate":
            spec = RopeSpec.standard(128)
            return _best_of(self.repeats, lambda: rotate_keys(k, spec, -n // 2)) / (2 * k.nbytes)
        if kind not in QUANT_BITS:
            raise InvalidArgumentError(f"unknown restore kind {kind!r}; known: rotate, int8, int4")
        qk, qv = quantize_kv(k, v, QUANT_BITS[kind], DEFAULT_GROUP_SIZE, "torch")
        kept = torch.arange(n, dtype=torch.int32).expand(1, 8, n)
        c = CompressedKV(keys=qk, values=qv, kept=kept, num_tokens=n, variant=kind)
        return _best_of(self.repeats, lambda: dense_kv(c)) / c.payload_bytes


def _best_of(repeats: int, fn: Callable[[], object]) -> float:
    fn()  # warm-up: first call pays allocator and dispatch set-up
    best = math.inf
    for _ in range(max(1, repeats)):
        t0 = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t0)
    return best


class TtftModel:
    """Predicted load / restore / prefill times (module docstring). Thread-safe updates."""

    def __init__(
        self,
        tiers: Sequence[TierLoad],
        *,
        prefill_tokens_per_s: float,
        restore: RestoreCost | None = None,
        rotate_on_load: bool = False,
    ) -> None:
        if not (prefill_tokens_per_s > 0):
            raise InvalidArgumentError(
                f"prefill_tokens_per_s must be > 0, got {prefill_tokens_per_s}"
            )
        self._tiers = {t.name: t for t in tiers}
        if len(self._tiers) != len(tiers):
            raise InvalidArgumentError(f"duplicate tier names in {[t.name for t in tiers]}")
        self.prefill_tokens_per_s = prefill_tokens_per_s
        self.restore = restore or RestoreCost()
        self.rotate_on_load = rotate_on_load
        self._lock = threading.Lock()

    def tier(self, name: str) -> TierLoad:
        try:
            return self._tiers[name]
        except KeyError:
            raise NotFoundError(f"unknown tier {name!r}; known: {', '.join(self._tiers)}") from None

    def update_tier(
        self,
        name: str,
        *,
        load_bandwidth_bytes_per_s: float | None = None,
        load_overhead_s: float | None = None,
    ) -> None:
        """Take a tier's current fitted figures (``Engine.tier_models()``)."""
        with self._lock:
            t = self.tier(name)
            self._tiers[name] = replace(
                t,
                load_bandwidth_bytes_per_s=t.load_bandwidth_bytes_per_s
                if load_bandwidth_bytes_per_s is None
                else load_bandwidth_bytes_per_s,
                load_overhead_s=t.load_overhead_s if load_overhead_s is None else load_overhead_s,
            )

    def load_s(self, size_bytes: int, tier: str) -> float:
        """Transfer + per-load overhead of ``size_bytes`` from ``tier``."""
        t = self.tier(tier)
        return size_bytes / t.load_bandwidth_bytes_per_s + t.load_overhead_s

    def restore_s(self, variant: str, size_bytes: int) -> float:
        return self.restore.restore_s(variant, size_bytes, rotate_on_load=self.rotate_on_load)

    def ttft_s(self, variant: str, size_bytes: int, tier: str) -> float:
        return self.load_s(size_bytes, tier) + self.restore_s(variant, size_bytes)

    def prefill_s(self, num_tokens: int) -> float:
        return num_tokens / self.prefill_tokens_per_s

    def tier_models(self) -> tuple[TierModel, ...]:
        """The tiers as the placer takes them (``kvtierd.types.TierModel``), in given order."""
        return tuple(
            TierModel(t.name, t.capacity_bytes, t.load_bandwidth_bytes_per_s, t.load_overhead_s)
            for t in self._tiers.values()
        )
