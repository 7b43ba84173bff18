"""Validate the daemon's TTFT model: predicted vs measured load time, CPU and SSD tiers.

    .venv/bin/python -m benchmarks.micro.bench_ttft_model [--reps 8]

A real daemon (``benchmarks/_support/daemon_proc.py``) is started; objects of several sizes are
put through ``KVClient`` and read back with ``KVClient.get`` into a preallocated buffer (the load
path of a co-located client), sizes interleaved. Objects reach the SSD tier by draining the CPU tier
and are then pinned: otherwise each read promotes its object, and that background copy (a
second SSD read) overlaps the next timed load. Each SSD object is read once.

The prediction for each load is taken from the daemon just before it: the ``ttft_s`` of the
object's tier in ``DescribeContext`` — the placer's own figure, from the tiers' read fits
(per-load overhead + bandwidth, calibrated at start and refitted from every real read; for the
SSD tier, its read into the arena and then the copy out of it) — plus one constant the daemon
cannot see: the client's request round trips (``Get`` + ``Release``), taken as the median
``get`` of a 4 KiB object from the CPU tier (no transfer to speak of; not among the sizes
compared). Nothing is fitted here. "at start" is the daemon's figure before the first load of
that tier, i.e. from its start-up calibration alone.
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from benchmarks._support.common import print_machine
from benchmarks._support.daemon_proc import DaemonProcess, write_config
from kvtierd.client import KVClient
from kvtierd.rpc import kvtier_pb2 as pb

MIB = 1 << 20
SIZES = (4 * MIB, 16 * MIB, 64 * MIB)
TINY = 4096
GOAL = 0.20  # |predicted / measured - 1|


@dataclass
class Loads:
    """Per size: measured seconds, and the daemon's predicted seconds before each load."""

    measured: dict[int, list[float]] = field(default_factory=dict)
    predicted: dict[int, list[float]] = field(default_factory=dict)
    at_start: dict[int, float] = field(default_factory=dict)

    def add(self, size: int, measured_s: float, predicted_s: float) -> None:
        self.measured.setdefault(size, []).append(measured_s)
        self.predicted.setdefault(size, []).append(predicted_s)


def daemon_ttft_s(c: KVClient, key: str, tier: str) -> float:
    """The daemon's predicted load seconds of ``key``'s context from ``tier``."""
    resp = c.call(c.admin.DescribeContext, pb.DescribeContextRequest(context_id=key))
    return next(o.ttft_s for o in resp.options if o.tier == tier)


def put_all(c: KVClient, reps: int) -> dict[int, list[str]]:
    keys: dict[int, list[str]] = {}
    for size in (TINY, *SIZES):
        data = np.random.default_rng(size).integers(0, 255, size, dtype=np.uint8)
        keys[size] = [f"obj-{size}-{r}" for r in range(reps)]
        for key in keys[size]:
            c.put(key, data, context_id=key)
    return keys


def measure(c: KVClient, tier: str, keys: dict[int, list[str]], repeat: int) -> Loads:
    """Each object ``repeat`` times (1 on a tier that promotes), sizes interleaved."""
    loads = Loads(at_start={s: daemon_ttft_s(c, ks[0], tier) for s, ks in keys.items()})
    bufs = {size: np.empty(size, dtype=np.uint8) for size in keys}
    for buf in bufs.values():
        buf.fill(0)  # touch the pages once: a fresh buffer would time page faults, not loads
    for _ in range(repeat):
        for r in range(len(keys[SIZES[0]])):
            for size, ks in keys.items():
                predicted = daemon_ttft_s(c, ks[r], tier)
                t0 = time.perf_counter()
                c.get(ks[r], out=bufs[size])
                loads.add(size, time.perf_counter() - t0, predicted)
    return loads


def report(tier: str, bandwidth: float, loads: Loads, request_s: float) -> list[float]:
    """Print the tier's table; return predicted / measured per size."""
    print(f"\n{tier}: daemon-reported read bandwidth {bandwidth / 1e9:.2f} GB/s (ListTiers); "
          f"request round trips {request_s * 1e3:.2f} ms")  # fmt: skip
    print("| size | measured ms | predicted ms | predicted / measured | at start / measured |")
    print("|---|---|---|---|---|")
    ratios = []
    for size in SIZES:
        measured = statistics.median(loads.measured[size])
        predicted = statistics.median(loads.predicted[size]) + request_s
        ratios.append(predicted / measured)
        at_start = (loads.at_start[size] + request_s) / measured
        print(f"| {size // MIB} MiB | {measured * 1e3:.2f} | {predicted * 1e3:.2f} | "
              f"{ratios[-1]:.2f} | {at_start:.2f} |")  # fmt: skip
    return ratios


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--reps", type=int, default=8)
    args = ap.parse_args()
    print_machine("bench_ttft_model")
    with tempfile.TemporaryDirectory() as tmp:
        d = Path(tmp)
        cfg = write_config(d, cpu="1GiB", ssd="2GiB")
        daemon = DaemonProcess(cfg, str(d / "kvtierd.sock"), d / "daemon.log").start()
        try:
            with KVClient(daemon.socket_path) as c:
                keys = put_all(c, args.reps)
                cpu = measure(c, "cpu", keys, repeat=3)
                bw = {t.name: t.read_bandwidth_bytes_per_s for t in c.tiers()}
                c.drain("cpu")
                ssd_keys = [k for s in SIZES for k in keys[s]]
                c.call(c.admin.Pin, pb.PinRequest(context_ids=ssd_keys))
                ssd = measure(c, "ssd", {s: keys[s] for s in SIZES}, repeat=1)
                bw["ssd"] = {t.name: t.read_bandwidth_bytes_per_s for t in c.tiers()}["ssd"]
        finally:
            daemon.stop()
    request_s = statistics.median(cpu.measured[TINY])
    ratios = report("cpu", bw["cpu"], cpu, request_s) + report("ssd", bw["ssd"], ssd, request_s)
    worst = max(abs(r - 1) for r in ratios)
    verdict = "PASS" if worst <= GOAL else "FAIL"
    print(f"\nworst |predicted/measured - 1| = {worst:.2f} (goal <= {GOAL:.2f}): {verdict}")


if __name__ == "__main__":
    main()
