"""Validate the profiler's TTFT model: predicted vs measured load time, CPU and SSD tiers.

    .venv/bin/python benchmarks/bench_ttft_model.py [--reps 5]

A real daemon (``tests/daemon_proc.py``) is started; objects of several sizes are put through
``KVClient`` and read back with ``KVClient.get`` into a preallocated buffer (the load path of a
co-located client). The prediction is the profiler's :class:`~kvtierd.profiler.TtftModel`
(``size / load_bandwidth + load_overhead``) fed with the *daemon-reported* read bandwidth of each
tier (``KVClient.tiers()``, calibrated at start + EWMA) and a per-load overhead measured as the
median load time of 4 KiB objects from that tier. Objects reach the SSD tier by draining the CPU
tier; each SSD object is read once (a read may promote it).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from kvtierd.client import KVClient
from kvtierd.profiler import TierLoad, TtftModel
from tests.daemon_proc import DaemonProcess, write_config

MIB = 1 << 20
SIZES = (4 * MIB, 16 * MIB, 64 * MIB)
TINY = 4096


def timed_get(c: KVClient, key: str, out: np.ndarray) -> float:
    t0 = time.perf_counter()
    c.get(key, out=out)
    return time.perf_counter() - t0


def put_all(c: KVClient, reps: int) -> dict[int, list[str]]:
    keys: dict[int, list[str]] = {}
    for size in (TINY, *SIZES):
        data = np.random.default_rng(size).integers(0, 255, size, dtype=np.uint8)
        keys[size] = []
        for r in range(reps):
            key = f"obj-{size}-{r}"
            c.put(key, data, context_id=key)
            keys[size].append(key)
    return keys


def measure(c: KVClient, keys: dict[int, list[str]], repeat: int) -> dict[int, float]:
    """Median load seconds per size (``repeat`` reads per object; 1 on a tier that promotes)."""
    out = {}
    for size, ks in keys.items():
        buf = np.empty(size, dtype=np.uint8)
        buf.fill(0)  # touch the pages once: a fresh buffer would time page faults, not loads
        out[size] = statistics.median(timed_get(c, k, buf) for k in ks for _ in range(repeat))
    return out


def report(tier: str, bw: float, measured: dict[int, float]) -> list[float]:
    model = TtftModel([TierLoad(tier, bw, measured[TINY])], prefill_tokens_per_s=1.0)
    print(f"\n{tier}: daemon-reported read bandwidth {bw / 1e9:.2f} GB/s, "
          f"per-load overhead {measured[TINY] * 1e3:.2f} ms (4 KiB loads)")  # fmt: skip
    print("| size | measured ms | predicted ms | predicted / measured |")
    print("|---|---|---|---|")
    ratios = []
    for size in SIZES:
        pred = model.load_s(size, tier)
        ratios.append(pred / measured[size])
        print(f"| {size // MIB} MiB | {measured[size] * 1e3:.2f} | {pred * 1e3:.2f} | "
              f"{ratios[-1]:.2f} |")  # fmt: skip
    return ratios


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--reps", type=int, default=5)
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        d = Path(tmp)
        cfg = write_config(d, cpu="1GiB", ssd="2GiB")
        daemon = DaemonProcess(cfg, str(d / "kvtierd.sock"), d / "daemon.log").start()
        try:
            with KVClient(daemon.socket_path) as c:
                keys = put_all(c, args.reps)
                bw = {t.name: t.read_bandwidth_bytes_per_s for t in c.tiers()}
                cpu = measure(c, keys, repeat=3)
                c.drain("cpu")
                bw_ssd = {t.name: t.read_bandwidth_bytes_per_s for t in c.tiers()}["ssd"]
                ssd = measure(c, keys, repeat=1)
        finally:
            daemon.stop()
    ratios = report("cpu", bw["cpu"], cpu) + report("ssd", bw_ssd, ssd)
    worst = max(abs(r - 1) for r in ratios)
    print(f"\nworst |predicted/measured - 1| = {worst:.2f} (goal <= 0.20)")


if __name__ == "__main__":
    main()
