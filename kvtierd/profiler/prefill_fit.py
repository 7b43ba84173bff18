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

Reports are a client's word, so (issue 27.1: 256 crafted reports from one tenant priced every
recompute at 3.2e7 tokens/s, or infinity, and the placer dropped another tenant's contexts):
each is checked against what a server can do (:data:`MIN_TTFT_S`, :data:`MAX_PROMPT_TOKENS`,
:data:`MAX_TOKENS_PER_S`); the line is the Theil-Sen fit (the median of the slopes between
pairs of samples, the median intercept), which a minority of samples cannot move; and
:class:`ServedReports` keeps a window per tenant, rate-limited: only the default tenant's
reports (the daemon's own user, or its token: the router) price the contexts of all; a named
tenant's fit is its own, shown to it and used for nothing else.
"""

from __future__ import annotations

import math
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from kvtierd.errors import CapacityError, InvalidArgumentError

MAX_CACHED_SHARE = 0.25  # a sample loads at most this share of its prompt (its load is small)
MIN_COMPUTED_TOKENS = 32  # shorter prefills are all overhead: they say nothing about the slope
MIN_SAMPLES = 8
MIN_SPREAD = 1.5  # longest / shortest computed prompt for a slope to be told from noise
MAX_TTFT_S = 3600.0
MIN_TTFT_S = 1e-3  # an HTTP request through the router and vLLM takes at least this
MAX_PROMPT_TOKENS = 1 << 22  # above any served model's context length
MAX_TOKENS_PER_S = 1e7  # computed tokens per second of TTFT: above any server's prefill
REPORTS_PER_S = 50.0  # per tenant, sustained (a router reports once per streamed request)
REPORT_BURST = 500
MAX_TENANT_FITS = 1024  # named tenants are configured; this bounds the table regardless


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
        if prompt_tokens > MAX_PROMPT_TOKENS:
            raise InvalidArgumentError(
                f"prompt_tokens must be at most {MAX_PROMPT_TOKENS}, got {prompt_tokens}"
            )
        if not (0 <= cached_tokens <= prompt_tokens):
            raise InvalidArgumentError(
                f"cached_tokens must be between 0 and prompt_tokens ({prompt_tokens}), "
                f"got {cached_tokens}"
            )
        if not (math.isfinite(ttft_s) and MIN_TTFT_S <= ttft_s <= MAX_TTFT_S):
            raise InvalidArgumentError(
                f"ttft_s must be a number of seconds in [{MIN_TTFT_S:g}, {MAX_TTFT_S:g}], "
                f"got {ttft_s}"
            )
        computed = prompt_tokens - cached_tokens
        if computed / ttft_s > MAX_TOKENS_PER_S:
            raise InvalidArgumentError(
                f"{computed} tokens computed in {ttft_s:g} s is faster than any server "
                f"(at most {MAX_TOKENS_PER_S:g} tokens/s)"
            )
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
    """Theil-Sen: the median slope over pairs of samples of different lengths, the median
    intercept; ``None`` while it gives no plausible positive slope."""
    if len(samples) < MIN_SAMPLES:
        return None
    xs = np.array([float(n) for n, _ in samples])
    ys = np.array([t for _, t in samples])
    if xs.max() < MIN_SPREAD * xs.min():
        return None
    dx = xs[None, :] - xs[:, None]
    pairs = dx > 0
    slope = float(np.median((ys[None, :] - ys[:, None])[pairs] / dx[pairs]))
    if not slope > 1.0 / MAX_TOKENS_PER_S:  # noise larger than the prefill: nothing learned
        return None
    overhead = float(np.median(ys - slope * xs))
    return PrefillEstimate(1.0 / slope, max(0.0, overhead), len(samples))


class ServedReports:
    """Served-request reports by tenant: the default tenant's feed ``shared`` (the fit that
    prices every context), a named tenant's its own window; each tenant at most
    :data:`REPORTS_PER_S` (bursts of :data:`REPORT_BURST`), beyond which a report is refused
    (``CapacityError``: RESOURCE_EXHAUSTED)."""

    def __init__(self, shared: PrefillFit, clock: Callable[[], float] = time.monotonic) -> None:
        self.shared = shared
        self._own: dict[str, PrefillFit] = {}
        self._allowance: dict[str, tuple[float, float]] = {}  # tenant -> (reports, at_s)
        self._clock = clock
        self._lock = threading.Lock()

    def observe(self, tenant: str, prompt_tokens: int, cached_tokens: int, ttft_s: float) -> bool:
        self._take(tenant)
        return self.fit(tenant).observe(prompt_tokens, cached_tokens, ttft_s)

    def fit(self, tenant: str) -> PrefillFit:
        """The window ``tenant``'s reports go to."""
        if not tenant:
            return self.shared
        with self._lock:
            fit = self._own.get(tenant)
            if fit is None:
                if len(self._own) >= MAX_TENANT_FITS:
                    self._own.pop(next(iter(self._own)))
                fit = self._own[tenant] = PrefillFit()
            return fit

    def _take(self, tenant: str) -> None:
        now = self._clock()
        with self._lock:
            left, at = self._allowance.get(tenant, (float(REPORT_BURST), now))
            left = min(float(REPORT_BURST), left + (now - at) * REPORTS_PER_S)
            if left < 1.0:
                self._allowance[tenant] = (left, now)
                raise CapacityError(
                    f"tenant {tenant!r} reports served requests faster than "
                    f"{REPORTS_PER_S:g} per second (bursts of {REPORT_BURST}): report refused"
                )
            self._allowance[tenant] = (left - 1.0, now)
