"""Graceful stop and restart at many small objects (issue 42.4 and 42.5), through a real daemon.

Puts ``--objects`` contexts of one ``--size`` object each (defaults: 50,000 x 16 KiB, the issue's
operator: CPU tier 256 MiB, SSD tier 2 GiB, the embedded EvicPress policy), then:

* graceful stop (SIGTERM): the share of the CPU tier, by contexts and by bytes, that the
  shutdown flush wrote to the SSD tier within the default ``shutdown_flush_s`` (5 s); goal
  >= 0.9 by both (before issue 42: 5,608 of 16,384 contexts, one fsync'd file per object);
* restart to SERVING (the start command to the first answered call) with the index
  checkpoint the stop wrote, then again with it removed (the header scan of every file), the
  ratio of the two measured in the same run.

    .venv/bin/python -m benchmarks.micro.bench_flush [--objects 50000] [--size 16384] [--policy lru]
"""

from __future__ import annotations

import argparse
import re
import tempfile
import threading
import time
from pathlib import Path

from benchmarks._support.common import print_machine, verdict
from benchmarks._support.daemon_proc import DaemonProcess, write_config
from kvtierd.client import KVClient
from kvtierd.errors import CapacityError

GOAL_SHARE = 0.9
FLUSH_LINE = re.compile(
    r"shutdown flush: wrote (\d+) of (\d+) cpu-tier contexts \(([\d.]+) MB\) to \S+ in ([\d.]+) s"
)


REFUSED: list[int] = []  # puts refused with the arena full, one entry each (then retried)


def _put_range(socket_path: str, start: int, stop: int, size: int) -> None:
    data = bytes(range(256)) * (size // 256) + bytes(size % 256)
    with KVClient(socket_path, timeout_s=60) as c:
        for i in range(start, stop):
            while True:
                try:
                    c.put(f"k{i}", data, context_id=f"c{i}")
                    break
                except CapacityError:  # puts outran the moves down: retry, as a client would
                    REFUSED.append(i)
                    time.sleep(0.05)


def _restart_s(d: DaemonProcess) -> float:
    started = time.perf_counter()
    d.start(timeout_s=1800)
    return time.perf_counter() - started


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--objects", type=int, default=50_000)
    ap.add_argument("--size", type=int, default=16 << 10)
    ap.add_argument("--threads", type=int, default=2, help="clients putting at once")
    ap.add_argument("--cpu", default="256MiB", help="the CPU tier's capacity")
    ap.add_argument(
        "--policy",
        choices=("evicpress", "lru"),
        default="evicpress",
        help="the placer while putting (the flush writes the CPU tier either way)",
    )
    args = ap.parse_args()
    print_machine("bench_flush")
    with tempfile.TemporaryDirectory(prefix="bench-flush-") as tmp:
        directory = Path(tmp)
        policy = "" if args.policy == "evicpress" else None  # "": the embedded EvicPress
        settings = {"policy_file": policy} if policy is not None else {}
        config = write_config(directory, cpu=args.cpu, ssd="2GiB", **settings)
        d = DaemonProcess(config, str(directory / "kvtierd.sock"), directory / "daemon.log")
        d.start()
        try:
            t0 = time.perf_counter()
            step = -(-args.objects // args.threads)
            workers = [
                threading.Thread(target=_put_range, args=(d.socket_path, s,
                                 min(s + step, args.objects), args.size))
                for s in range(0, args.objects, step)
            ]  # fmt: skip
            for w in workers:
                w.start()
            for w in workers:
                w.join()
            put_s = time.perf_counter() - t0
            with KVClient(d.socket_path, timeout_s=60) as c:
                deadline = time.monotonic() + 120
                while c.status().pending_plans and time.monotonic() < deadline:
                    time.sleep(0.2)
                cpu = {t.name: t for t in c.tiers()}["cpu"]
            print(f"puts: {args.objects} x {args.size} B in {put_s:.1f} s "
                  f"({args.objects / put_s:.0f}/s; {len(REFUSED)} refused with the arena full, "
                  f"retried); cpu tier {cpu.object_count} objects, "
                  f"{cpu.used_bytes / 1e6:.1f} MB", flush=True)  # fmt: skip
            t0 = time.perf_counter()
            assert d.stop(timeout_s=600) == 0
            stop_s = time.perf_counter() - t0
            m = FLUSH_LINE.search(d.logs())
            assert m is not None, d.logs()[-3000:]
            wrote, of, mb, flush_s = int(m[1]), int(m[2]), float(m[3]), float(m[4])
            by_count, by_bytes = wrote / of, mb * 1e6 / cpu.used_bytes
            print(f"graceful stop {stop_s:.1f} s; flush wrote {wrote} of {of} contexts, "
                  f"{mb:.1f} of {cpu.used_bytes / 1e6:.1f} MB in {flush_s:.2f} s: share by count "
                  f"{by_count:.3f}, by bytes {by_bytes:.3f} (goal >= {GOAL_SHARE}) "
                  f"{verdict(min(by_count, by_bytes), GOAL_SHARE)}", flush=True)  # fmt: skip
            with_ckpt = _restart_s(d)
            line = [ln for ln in d.logs().splitlines() if "ssd tier ssd at" in ln][-1]
            print(f"restart to SERVING with the index checkpoint: {with_ckpt:.1f} s "
                  f"[{line.split(': ', 1)[1][:160]}]", flush=True)  # fmt: skip
            d.kill()  # SIGKILL: the next start has no fresher checkpoint than this one
            (directory / "ssd" / "index.ckpt").unlink()
            without = _restart_s(d)
            line = [ln for ln in d.logs().splitlines() if "ssd tier ssd at" in ln][-1]
            print(f"restart to SERVING without it (header scan): {without:.1f} s "
                  f"[{line.split(': ', 1)[1][:160]}]", flush=True)  # fmt: skip
            print(f"restart ratio with/without checkpoint: {with_ckpt / without:.2f}")
        finally:
            d.kill()


if __name__ == "__main__":
    main()
