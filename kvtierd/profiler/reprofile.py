"""When to re-profile a context (EvicPress §4.3, §6.3): drift, idleness, rate limit.

A context is re-profiled when the quality measured on a sample of its recent real queries (for
the variant it is stored as) is below the quality its profile promised by more than
``threshold`` (policy ``profiling.reprofile_threshold``, absolute), **and** the daemon is idle
(the engine's ``is_busy()`` says no loads are queued — the paper's "free GPU cycles"), **and** a
token bucket allows it (at most ``burst`` back to back, ``rate_per_s`` sustained), so a burst of
drift cannot turn the daemon into a profiling farm.

:class:`ReprofileScheduler` is the pure decision; :class:`ReprofileLoop` runs it every
``interval_s`` (policy ``profiling.interval_s``) on the engine's event loop.
"""

from __future__ import annotations

import asyncio
import enum
import logging
import math
import time
from collections.abc import Awaitable, Callable, Iterable
from dataclasses import dataclass

from kvtierd.errors import InvalidArgumentError

logger = logging.getLogger(__name__)


class TokenBucket:
    """``capacity`` tokens, refilled at ``rate_per_s``; starts full."""

    def __init__(self, rate_per_s: float, capacity: float, now_s: float) -> None:
        if not (rate_per_s > 0 and math.isfinite(rate_per_s)) or capacity < 1:
            raise InvalidArgumentError(
                f"need rate_per_s > 0 and capacity >= 1, got {rate_per_s}, {capacity}"
            )
        self.rate_per_s = rate_per_s
        self.capacity = capacity
        self.tokens = capacity
        self._t = now_s

    def _refill(self, now_s: float) -> None:
        if now_s > self._t:
            self.tokens = min(self.capacity, self.tokens + (now_s - self._t) * self.rate_per_s)
            self._t = now_s

    def try_take(self, now_s: float) -> bool:
        self._refill(now_s)
        if self.tokens >= 1.0:
            self.tokens -= 1.0
            return True
        return False


class Decision(enum.Enum):
    REPROFILE = "reprofile"
    NO_SAMPLE = "no_sample"
    NO_DRIFT = "no_drift"
    BUSY = "busy"
    RATE_LIMITED = "rate_limited"


@dataclass(frozen=True, slots=True)
class DriftSample:
    """Quality of ``variant`` as profiled vs as measured on ``num_queries`` recent queries."""

    context_id: str
    variant: str
    profiled_quality: float
    online_quality: float
    num_queries: int

    @property
    def drop(self) -> float:
        return self.profiled_quality - self.online_quality


class ReprofileScheduler:
    """The decision of the module docstring; ``clock`` is monotonic seconds."""

    def __init__(
        self,
        threshold: float,
        is_busy: Callable[[], bool],
        *,
        rate_per_s: float = 1 / 60,
        burst: float = 4,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        if not 0 <= threshold < 1:
            raise InvalidArgumentError(f"threshold must be in [0, 1), got {threshold}")
        self.threshold = threshold
        self.is_busy = is_busy
        self.clock = clock
        self.bucket = TokenBucket(rate_per_s, burst, clock())

    def decide(self, sample: DriftSample | None) -> Decision:
        """Cheap checks first; a token is spent only on a REPROFILE answer."""
        if sample is None or sample.num_queries == 0:
            return Decision.NO_SAMPLE
        if sample.drop <= self.threshold:
            return Decision.NO_DRIFT
        if self.is_busy():
            return Decision.BUSY
        if not self.bucket.try_take(self.clock()):
            return Decision.RATE_LIMITED
        return Decision.REPROFILE


@dataclass(frozen=True, slots=True)
class LoopStep:
    context_id: str
    decision: Decision
    sample: DriftSample | None = None


class ReprofileLoop:
    """Every ``interval_s``: for each candidate context, while the daemon is idle, measure drift
    (``measure``, the engine's coroutine: fetch the KV, run :meth:`Profiler.check_drift` off the
    event loop) and re-profile (``reprofile``) when the scheduler says so.

    A pass stops at the first busy check: measuring drift costs model time too. Exceptions from
    ``measure``/``reprofile`` propagate out of :meth:`run_forever` (the engine's task
    done-callback reports them; a silently dead loop would stop adaptation unnoticed).
    """

    def __init__(
        self,
        scheduler: ReprofileScheduler,
        *,
        candidates: Callable[[], Iterable[str]],
        measure: Callable[[str], Awaitable[DriftSample | None]],
        reprofile: Callable[[str], Awaitable[None]],
        interval_s: float,
    ) -> None:
        if not interval_s > 0:
            raise InvalidArgumentError(f"interval_s must be > 0, got {interval_s}")
        self.scheduler = scheduler
        self.candidates = candidates
        self.measure = measure
        self.reprofile = reprofile
        self.interval_s = interval_s

    async def run_once(self) -> list[LoopStep]:
        steps: list[LoopStep] = []
        for cid in list(self.candidates()):
            if self.scheduler.is_busy():
                steps.append(LoopStep(cid, Decision.BUSY))
                break
            sample = await self.measure(cid)
            decision = self.scheduler.decide(sample)
            steps.append(LoopStep(cid, decision, sample))
            if decision is Decision.REPROFILE and sample is not None:
                logger.info(
                    "re-profiling %s: quality %.3f -> %.3f",
                    cid,
                    sample.profiled_quality,
                    sample.online_quality,
                )
                await self.reprofile(cid)
        return steps

    async def run_forever(self) -> None:
        while True:
            await asyncio.sleep(self.interval_s)
            await self.run_once()
