"""TTFT model: the profiler's half of the seconds to make a stored variant usable (EvicPress
§4.2, delay term).

    ttft_s(variant, tier) = size_bytes / load_bandwidth_bytes_per_s(tier)   # transfer
                          + load_overhead_s(tier)                          # per-load fixed cost
                          + restore_s(variant, size_bytes)                 # dequantize / rotate
    prefill_s(tokens)     = tokens / prefill_tokens_per_s                  # a dropped context

``prefill_tokens_per_s`` is configured until served requests teach the engine's own
(:mod:`kvtierd.profiler.prefill_fit`).

This module holds the terms a profile carries: ``restore_s`` per variant and ``prefill_s``.
Restore costs are *measured* on this host (:class:`RestoreCost`) once per kind and scaled
linearly with bytes. The load terms are the tiers' fits of their real reads
(``kvtierd.storage.base.TransferMeter``), which change while the daemon runs, so they are not
copied into profiles: :func:`kvtierd.policies.model.load_ttft_s` adds them over
``Engine.tier_models()`` whenever a placement is computed (placer, write planner,
``DescribeContext``).
"""

from __future__ import annotations

import math
import threading
import time
from collections.abc import Callable

from kvtierd.errors import InvalidArgumentError
from kvtierd.profiler.prefill_fit import PrefillFit
from kvtierd.sizes import DEFAULT_GROUP_SIZE
from kvtierd.variants import as_variant


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
        from kvtierd.variants import QUANT_BITS

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
    """Predicted restore and prefill times (module docstring)."""

    def __init__(
        self,
        *,
        prefill_tokens_per_s: float,
        restore: RestoreCost | None = None,
        rotate_on_load: bool = False,
        fit: PrefillFit | None = None,
    ) -> None:
        if not (prefill_tokens_per_s > 0 and math.isfinite(prefill_tokens_per_s)):
            raise InvalidArgumentError(
                f"prefill_tokens_per_s must be > 0, got {prefill_tokens_per_s}"
            )
        self.configured_tokens_per_s = prefill_tokens_per_s
        self.restore = restore or RestoreCost()
        self.rotate_on_load = rotate_on_load
        self.fit = fit or PrefillFit()  # the serving engine's own speed, once requests report it

    @property
    def prefill_tokens_per_s(self) -> float:
        """Learned from served requests (``prefill_fit.py``) once they allow it; else the
        configured ``prefill_tokens_per_s``."""
        learned = self.fit.estimate()
        return learned.tokens_per_s if learned is not None else self.configured_tokens_per_s

    def restore_s(self, variant: str, size_bytes: int) -> float:
        return self.restore.restore_s(variant, size_bytes, rotate_on_load=self.rotate_on_load)

    def prefill_s(self, num_tokens: int) -> float:
        return num_tokens / self.prefill_tokens_per_s
