"""Restart to SERVING of a daemon whose SSD tier holds many small objects (issue 42.5), with the
SSD tier's index checkpoint and without it (the header scan of every file), measured in the same
run. Goal of the issue: <= 30 s at 1M objects. With the checkpoint it also times the start
until the placer has adopted every context (done in the background after serving when there are
many, docs/daemon.md) and reads the daemon's anonymous RSS then, against a daemon on an empty SSD
tier: metadata bytes per object (goal <= 1 KB at 1M).

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
from dataclasses import dataclass
from pathlib import Path

from benchmarks._support.common import print_machine, verdict
from benchmarks._support.daemon_proc import DaemonProcess, rss_anon, write_config
from kvtierd.config import TierConfig
from kvtierd.storage.ssd import SsdTier
from kvtierd.storage.ssd_checkpoint import checkpoint_path
from kvtierd.storage.ssd_files import Layout
from kvtierd.types import ObjectMeta

GOAL_S = 30.0
RSS_GOAL_B = 1024  # metadata bytes per object at 1M
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


@dataclass
class Restart:
    serving_s: float  # start to answering
    index: str  # how the SSD tier found its index, and in how long (its start line)
    adopted_s: float = 0.0  # start to the placer knowing every context (0: not waited for)
    rss_anon_b: int = 0  # once adopted


def restart(d: DaemonProcess, adopted: bool = False) -> Restart:
    """Start ``d``, time it to answering (and, with ``adopted``, until the placer has every
    context: the background adoption's last line, or at once for a few contexts), then kill
    it."""
    seen = len(d.logs())  # the log file is appended to by every start (and kept by --dir)
    started = time.perf_counter()
    d.start(timeout_s=3600)
    serving = time.perf_counter() - started
    line = [ln for ln in d.logs()[seen:].splitlines() if "ssd tier ssd at" in ln][-1]
    index = (
        line.split("bytes (", 1)[1].split(", in ")[0] + ", " + line.split(", in ")[1].split(")")[0]
    )
    out = Restart(serving, index)
    if adopted:
        deadline = time.monotonic() + 3600
        while (
            "in the background" in d.logs()[seen:]
            and "contexts found at start in"
            not in (d.logs()[seen:].split("in the background", 1)[1])
        ):
            if time.monotonic() > deadline or (d.proc is not None and d.proc.poll() is not None):
                raise RuntimeError(f"the daemon did not finish adopting: {d.logs()[-2000:]}")
            time.sleep(0.2)
        out.adopted_s = time.perf_counter() - started
        out.rss_anon_b = rss_anon(d)
    d.kill()
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--objects", type=int, default=100_000)
    ap.add_argument("--size", type=int, default=16 << 10)
    ap.add_argument(
        "--dir",
        type=Path,
        help="keep the filled SSD tier here, and use the one "
        "there if it is there (a 1M fill takes minutes; the runs after use it)",
    )
    args = ap.parse_args()
    print_machine("bench_restart")
    with tempfile.TemporaryDirectory(prefix="bench-restart-") as tmp:
        directory = args.dir or Path(tmp)
        if args.dir is not None and (directory / "ssd").exists():
            print(f"using the SSD tier filled at {directory / 'ssd'}", flush=True)
        else:
            fill_s = asyncio.run(fill(directory / "ssd", args.objects, args.size))
            print(f"filled: {args.objects} x {args.size} B in {fill_s:.1f} s", flush=True)
        ssd = f"{(args.objects * args.size >> 30) + 1}GiB"
        empty = directory / "empty"
        base = DaemonProcess(write_config(empty, cpu="64MiB", ssd=ssd),
                             str(empty / "kvtierd.sock"), empty / "daemon.log")  # fmt: skip
        baseline = restart(base, adopted=True)
        print(f"an empty daemon (no object) to SERVING: {baseline.serving_s:.1f} s", flush=True)
        config = write_config(directory, cpu="64MiB", ssd=ssd)
        d = DaemonProcess(config, str(directory / "kvtierd.sock"), directory / "daemon.log")
        try:
            full = restart(d, adopted=True)
            with_ckpt = full.serving_s
            per_object = (full.rss_anon_b - baseline.rss_anon_b) / args.objects
            print(f"restart to SERVING with the checkpoint: {with_ckpt:.1f} s [{full.index}]; "
                  f"every context adopted at {full.adopted_s:.1f} s; anonymous RSS then "
                  f"{full.rss_anon_b / 1e6:.0f} MB against {baseline.rss_anon_b / 1e6:.0f} MB "
                  f"with an empty SSD tier: "
                  f"{per_object:.0f} B per object (goal at 1M: <= {RSS_GOAL_B} B) "
                  f"{verdict(per_object, RSS_GOAL_B, higher_is_better=False)}",
                  flush=True)  # fmt: skip
            ckpt = checkpoint_path(Layout(directory / "ssd"))
            ckpt.rename(saved := ckpt.with_suffix(".saved"))  # back after: --dir runs reuse it
            try:
                plain = restart(d)
            finally:
                saved.rename(ckpt)
            without = plain.serving_s
            print(f"restart to SERVING without it: {without:.1f} s [{plain.index}]", flush=True)
        finally:
            d.kill()
        print(f"ratio with/without checkpoint: {with_ckpt / without:.2f}; with the checkpoint "
              f"{with_ckpt:.1f} s vs the goal {GOAL_S:.0f} s (at 1M; here {args.objects}) "
              f"{verdict(with_ckpt, GOAL_S, higher_is_better=False)}")  # fmt: skip


if __name__ == "__main__":
    main()
