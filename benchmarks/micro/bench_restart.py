"""Restart to SERVING of a daemon whose SSD tier holds many small objects (issue 42.5), with the
SSD tier's index checkpoint and without it (the header scan of every file), measured in the same
run. Goal of the issue: <= 30 s at 1M objects.

The SSD tier is filled in-process through ``SsdTier.put_many`` (``--objects`` of ``--size``
bytes, one context each: what a daemon's flush or puts leave there, without the hours of puts
a loaded 2-vCPU machine would take), closed (which writes the checkpoint), then a real daemon
is started on it twice: once as it is, once with the checkpoint removed.

    .venv/bin/python -m benchmarks.micro.bench_restart [--objects 100000] [--size 16384]
"""

from __future__ import annotations

import argparse
import asyncio
import tempfile
import time
from pathlib import Path

from benchmarks._support.common import print_machine, verdict
from benchmarks._support.daemon_proc import DaemonProcess, write_config
from kvtierd.config import TierConfig
from kvtierd.storage.ssd import SsdTier
from kvtierd.storage.ssd_checkpoint import checkpoint_path
from kvtierd.storage.ssd_files import Layout
from kvtierd.types import ObjectMeta

GOAL_S = 30.0
BATCH = 1024


async def fill(path: Path, objects: int, size: int) -> float:
    tier = SsdTier(TierConfig("ssd", "ssd", 0, str(path), {}))
    await tier.start()
    data = memoryview(bytes(range(256)) * (size // 256) + bytes(size % 256))
    started = time.perf_counter()
    for first in range(0, objects, BATCH):
        await tier.put_many([
            (ObjectMeta(key=f"k{i}", size_bytes=size, context_id=f"c{i}"), data)
            for i in range(first, min(first + BATCH, objects))
        ])  # fmt: skip
    await tier.close()
    return time.perf_counter() - started


def restart_s(d: DaemonProcess) -> tuple[float, str]:
    started = time.perf_counter()
    d.start(timeout_s=3600)
    took = time.perf_counter() - started
    line = [ln for ln in d.logs().splitlines() if "ssd tier ssd at" in ln][-1]
    d.kill()
    return took, line.split("bytes (", 1)[1].split(", in ")[0] + ", " + line.split(", in ")[
        1
    ].split(")")[0]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--objects", type=int, default=100_000)
    ap.add_argument("--size", type=int, default=16 << 10)
    args = ap.parse_args()
    print_machine("bench_restart")
    with tempfile.TemporaryDirectory(prefix="bench-restart-") as tmp:
        directory = Path(tmp)
        fill_s = asyncio.run(fill(directory / "ssd", args.objects, args.size))
        print(f"filled: {args.objects} x {args.size} B in {fill_s:.1f} s", flush=True)
        ssd = f"{(args.objects * args.size >> 30) + 1}GiB"
        config = write_config(directory, cpu="64MiB", ssd=ssd)
        d = DaemonProcess(config, str(directory / "kvtierd.sock"), directory / "daemon.log")
        try:
            with_ckpt, how = restart_s(d)
            print(f"restart to SERVING with the checkpoint: {with_ckpt:.1f} s [{how}]", flush=True)
            checkpoint_path(Layout(directory / "ssd")).unlink()
            without, how = restart_s(d)
            print(f"restart to SERVING without it: {without:.1f} s [{how}]", flush=True)
        finally:
            d.kill()
        print(f"ratio with/without checkpoint: {with_ckpt / without:.2f}; with the checkpoint "
              f"{with_ckpt:.1f} s vs the goal {GOAL_S:.0f} s (at 1M; here {args.objects}) "
              f"{verdict(with_ckpt, GOAL_S, higher_is_better=False)}")  # fmt: skip


if __name__ == "__main__":
    main()
