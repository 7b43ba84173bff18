"""``scripts/gpu-check [--prepare] [--out DIR] [--wheelhouse DIR] [--budget-s S]``."""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

from benchmarks.gpu import wheelhouse
from benchmarks.gpu.run import GPU_STEPS, Runner


def main() -> int:
    ap = argparse.ArgumentParser(
        prog="scripts/gpu-check",
        description="The GPU path in one command (docs/gpu-check.md): Triton kernels on CUDA, "
        "the gpu tier and CUDA IPC, the gpu tests. Without CUDA it checks that it would run.",
    )
    ap.add_argument(
        "--prepare",
        action="store_true",
        help="download the wheelhouse here (needs the package registry), then stop",
    )
    ap.add_argument("--wheelhouse", type=Path, default=wheelhouse.DEFAULT_DIR)
    ap.add_argument(
        "--out",
        type=Path,
        default=None,
        help="where gpu-check.json/.md/.log go (default $OUT, else benchmarks/out/gpu-check)",
    )
    ap.add_argument(
        "--budget-s",
        type=float,
        default=330.0,
        help="the whole run's deadline; each step's timeout is cut to fit it",
    )
    ap.add_argument(
        "--only",
        default="",
        help="comma-separated GPU steps to run: " + ",".join(s.name for s in GPU_STEPS),
    )
    ap.add_argument(
        "--quick",
        action="store_true",
        help="test sizes only (to try the harness with TRITON_INTERPRET=1)",
    )
    a = ap.parse_args()
    if a.prepare:
        wheelhouse.prepare(a.wheelhouse.resolve())
        return 0
    out = a.out or Path(os.environ.get("OUT") or wheelhouse.REPO / "benchmarks/out/gpu-check")
    only = {s for s in a.only.split(",") if s}
    unknown = only - {s.name for s in GPU_STEPS}
    if unknown:
        ap.error(f"--only: unknown steps {sorted(unknown)}; known: {[s.name for s in GPU_STEPS]}")
    return Runner(out.resolve(), a.wheelhouse.resolve(), a.budget_s, a.quick).run(only)


if __name__ == "__main__":
    sys.exit(main())
