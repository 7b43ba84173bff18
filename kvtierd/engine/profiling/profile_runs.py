"""The daemon's newest profile runs: when each ran (wall clock), with which evaluator and why.

``Admin.ProfileStatus`` reports them, so that a benchmark can set them beside its requests'
send and first-token times (``benchmarks/e2e/bench_e2e.py``: no profile inside the timed window
while vLLM has a request in flight; every context profiled by its second request).
"""

from __future__ import annotations

import enum
from collections import deque
from dataclasses import dataclass

KEPT_RUNS = 4096


class RunKind(enum.Enum):
    FIRST = "first"  # the estimator, once a put has settled (every context)
    REFINE = "refine"  # the refining evaluator, where a decision is close, while vLLM is idle
    ASKED = "asked"  # Admin.Profile (kvtierctl profile run): the refiner when there is one
    DRIFT = "drift"  # the drift check found the profile stale (no refiner configured)


@dataclass(frozen=True, slots=True)
class ProfileRun:
    context_id: str
    evaluator: str
    kind: RunKind
    started_unix_s: float
    ended_unix_s: float
    waited_s: float  # of it, steps waiting while requests were served (YieldGate)
    ok: bool


class RunLog:
    """The newest :data:`KEPT_RUNS` runs, oldest first."""

    def __init__(self, kept: int = KEPT_RUNS) -> None:
        self._runs: deque[ProfileRun] = deque(maxlen=kept)

    def add(self, run: ProfileRun) -> None:
        self._runs.append(run)

    def runs(self) -> list[ProfileRun]:
        return list(self._runs)
