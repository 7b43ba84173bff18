"""Helpers shared by the benchmarks: timing, the machine, a verdict against a goal."""

from __future__ import annotations

import platform
import time
from collections.abc import Callable
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def best_of(fn: Callable[[], object], repeat: int = 5) -> float:
    """Fastest of ``repeat`` runs, in seconds (the least disturbed by a noisy neighbour)."""
    times = []
    for _ in range(repeat):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return min(times)


def machine() -> str:
    import os

    return f"{platform.machine()}, {os.cpu_count()} vCPU, Python {platform.python_version()}"


def verdict(ratio: float, goal: float, higher_is_better: bool = True) -> str:
    ok = ratio >= goal if higher_is_better else ratio <= goal
    return "PASS" if ok else "FAIL"
