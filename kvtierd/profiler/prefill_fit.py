"""The prefill speed of the LLM server (vLLM), learned from the requests it served (issue 13.3).

EvicPress weighs loading a stored context against recomputing it, so the prefill term of the
TTFT model must be this server's, on this hardware: a static ``prefill_tokens_per_s`` of 5,000
priced a 4k-token miss at 0.8 s where vLLM-CPU on 2 cores took 6 s. The router reports, per
served request, the prompt's tokens, how many of them vLLM had cached (its own prefix cache
plus what the connector loaded: vLLM's ``usage.prompt_tokens_details.cached_tokens``) and the
time to the first streamed token. A request that computed most of its prompt is a prefill
sample; a least-squares line through them,

    ttft_s ≈ overhead_s + computed_tokens / tokens_per_s

gives the rate (the slope) and the fixed cost of any request (the intercept: HTTP, scheduling,
the first decode step; it is paid by hits too, so only the slope prices a recompute).
"""

from __future__ import annotations

import math
import threading
from collections import deque
from dataclasses import dataclass

from kvtierd.errors import InvalidArgumentError

MAX_CACHED_SHARE = 0.25  # a sample loads at most this share of its prompt (its load is small)
MIN_COMPUTED_TOKENS = 32  # shorter prefills are all overhead: they say nothing about the slope
MIN_SAMPLES = 8
MIN_SPREAD = 1.5  # longest / shortest computed prompt for a slope to be told from noise
MAX_TTFT_S = 3600.0


@dataclass(frozen=True, slots=True)
class PrefillEstimate:
    tokens_per_s: float
    overhead_s: float
    samples: int


class PrefillFit:
    """Prefill samples of the newest ``window`` requests and the line through them."""

    def __init__(self, window: int = 256) -> None:
        self._samples: deque[tuple[int, float]] = deque(maxlen=window)
        self._lock = threading.Lock()
        self._estimate: PrefillEstimate | None = None  # refitted per sample (read per placement)
        self.reported = 0

    def observe(self, prompt_tokens: int, cached_tokens: int, ttft_s: float) -> bool:
        """One served request; ``True`` if it is a prefill sample (few of its tokens cached)."""
        if not (0 <= cached_tokens <= prompt_tokens):
            raise InvalidArgumentError(
                f"cached_tokens must be between 0 and prompt_tokens ({prompt_tokens}), "
                f"got {cached_tokens}"
            )
        if not (math.isfinite(ttft_s) and 0 < ttft_s <= MAX_TTFT_S):
            raise InvalidArgumentError(
                f"ttft_s must be a number of seconds in (0, {MAX_TTFT_S:g}], got {ttft_s}"
            )
        computed = prompt_tokens - cached_tokens
        with self._lock:
            self.reported += 1
            if computed < MIN_COMPUTED_TOKENS or cached_tokens > MAX_CACHED_SHARE * prompt_tokens:
                return False
            self._samples.append((computed, ttft_s))
            self._estimate = _fit(list(self._samples))
            return True

    @property
    def samples(self) -> int:
        """Prefill samples in the window (the fit needs MIN_SAMPLES, spread MIN_SPREAD)."""
        return len(self._samples)

    def estimate(self) -> PrefillEstimate | None:
        """The fitted line, or ``None`` while the samples cannot give a positive slope."""
        return self._estimate


def _fit(samples: list[tuple[int, float]]) -> PrefillEstimate | None:
    if len(samples) < MIN_SAMPLES:
        return None
    xs = [float(n) for n, _ in samples]
    ys = [t for _, t in samples]
    if max(xs) < MIN_SPREAD * min(xs):
        return None
    mx, my = sum(xs) / len(xs), sum(ys) / len(ys)
    sxx = sum((x - mx) ** 2 for x in xs)
    slope = sum((x - mx) * (y - my) for x, y in zip(xs, ys, strict=True)) / sxx
    if slope <= 0:  # noise larger than the prefill itself: nothing to learn yet
        return None
    return PrefillEstimate(1.0 / slope, max(0.0, my - slope * mx), len(samples))
