"""Data-path benchmark of the daemon core (issue 2), each figure a ratio to a limit measured in
the same run on the same machine:

* co-located put + get of 64 MiB objects through the arena vs two reused-buffer memcpys;
* streaming Put/Get (protobuf stream parts over the Unix socket) vs a raw-bytes gRPC stream;
* batched Lookup of 1,000 keys (p99) and a single Lookup (p50) vs an empty gRPC call;
* daemon memory overhead above the bytes it holds.

Run: ``.venv/bin/python -m benchmarks.micro.bench_daemon`` (about a minute).
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import grpc
import numpy as np

from benchmarks._support.common import REPO, best_of, machine, verdict
from benchmarks._support.daemon_proc import DaemonProcess, write_config
from kvtierd.client import KVClient

MiB = 1 << 20
OBJECT = 64 * MiB
PART = 4 * MiB


def arena_round_trip(c: KVClient) -> tuple[float, float]:
    src = np.random.default_rng(0).integers(0, 255, OBJECT, dtype=np.uint8)
    dst = np.empty_like(src)
    mid = np.empty_like(src)

    def memcpys() -> None:
        np.copyto(mid, src)
        np.copyto(dst, mid)

    def put_get(key: str) -> float:
        t0 = time.perf_counter()
        c.put(key, src)
        c.get(key, out=dst)
        seconds = time.perf_counter() - t0
        c.delete([key])  # untimed: the next put reuses the freed (already touched) block
        return seconds

    put_get("warm")
    assert np.array_equal(dst, src)
    return best_of(memcpys, 10), min(put_get(f"bench{i}") for i in range(10))


def streams(socket_path: str, raw_socket: str) -> tuple[float, float, float, float]:
    """The client library's streaming path (what a client on another host uses) vs raw bytes."""
    raw = grpc.insecure_channel(f"unix:{raw_socket}", options=_OPTS)
    raw_put = raw.stream_unary("/raw.Raw/Put")
    raw_get = raw.unary_stream("/raw.Raw/Get")
    payload = np.frombuffer(os.urandom(OBJECT), np.uint8)
    view = memoryview(payload)
    out = np.empty_like(payload)
    c = KVClient(socket_path, stream=True)

    def our_put() -> None:
        c.put("s", payload)
        c.delete(["s"])

    def base_put() -> None:
        raw_put(bytes(view[i : i + PART]) for i in range(0, OBJECT, PART))

    c.put("g", payload)

    def our_get() -> None:
        c.get("g", out=out)

    def base_get() -> None:
        n = sum(len(m) for m in raw_get(str(OBJECT).encode()))
        assert n == OBJECT

    our_get()
    assert np.array_equal(out, payload)
    result = best_of(base_put, 5), best_of(our_put, 5), best_of(base_get, 5), best_of(our_get, 5)
    c.close()
    return result


_OPTS = [("grpc.max_receive_message_length", 64 * MiB), ("grpc.max_send_message_length", 64 * MiB)]


def lookups(c: KVClient, raw_socket: str) -> tuple[float, float, float]:
    keys = [f"lk{i}" for i in range(1000)]
    for k in keys:
        c.put(k, b"x" * 64)
    batched = []
    for _ in range(300):
        t0 = time.perf_counter()
        r = c.lookup(keys)
        batched.append(time.perf_counter() - t0)
        assert r.prefix_hits == 1000
    single, empty = [], []
    empty_call = grpc.insecure_channel(f"unix:{raw_socket}").unary_unary("/raw.Raw/Empty")
    for _ in range(2000):  # interleaved so both see the same machine noise
        t0 = time.perf_counter()
        c.lookup(keys[:1])
        single.append(time.perf_counter() - t0)
        t0 = time.perf_counter()
        empty_call(b"")
        empty.append(time.perf_counter() - t0)
    p99 = float(np.percentile(batched, 99))
    return p99, statistics.median(single), statistics.median(empty)


def memory_overhead(d: DaemonProcess, c: KVClient) -> tuple[int, int]:
    """Marginal footprint per byte held: the daemon's private memory plus the arena pages in
    use, measured after one warm-up object and again after eight more."""
    detail = next(t.detail for t in c.tiers() if t.name == "cpu")
    arena = Path(detail.removeprefix("arena "))
    assert d.proc is not None

    def footprint() -> int:
        uss = 0
        with open(f"/proc/{d.proc.pid}/smaps_rollup") as f:  # type: ignore[union-attr]
            for line in f:
                if line.startswith(("Private_Clean:", "Private_Dirty:")):
                    uss += int(line.split()[1]) * 1024
        return uss + os.stat(arena).st_blocks * 512

    data = np.ones(OBJECT, np.uint8)
    c.put("mem-warm", data)
    before = footprint()
    for i in range(8):
        c.put(f"mem{i}", data)
    return footprint() - before, 8 * OBJECT


def main() -> None:
    fmt = argparse.RawDescriptionHelpFormatter
    argparse.ArgumentParser(description=__doc__, formatter_class=fmt).parse_args()
    tmp = Path(tempfile.mkdtemp(prefix="kvtierd-bench-"))
    config = write_config(tmp, cpu="2GiB", ssd="1GiB")
    d = DaemonProcess(config, str(tmp / "kvtierd.sock"), tmp / "daemon.log").start()
    raw_socket = str(tmp / "raw.sock")
    raw = subprocess.Popen(
        [sys.executable, "-m", "benchmarks.micro.raw_grpc", raw_socket], cwd=REPO
    )
    try:
        while not os.path.exists(raw_socket):
            time.sleep(0.05)
        with KVClient(d.socket_path) as c:
            grown, held = memory_overhead(d, c)
            c.delete(["mem-warm", *(f"mem{i}" for i in range(8))])
            memcpy_s, arena_s = arena_round_trip(c)
            bput, oput, bget, oget = streams(d.socket_path, raw_socket)
            p99, single, empty = lookups(c, raw_socket)
    finally:
        raw.kill()
        d.stop()
    gbs = OBJECT / 1e9
    rows = [
        ("arena put+get 64 MiB vs 2 memcpys", memcpy_s / arena_s, 0.8, True,
         f"{2 * gbs / arena_s:.2f} vs {2 * gbs / memcpy_s:.2f} GB/s"),
        ("stream Put 64 MiB vs raw-bytes stream", bput / oput, 0.7, True,
         f"{gbs / oput:.2f} vs {gbs / bput:.2f} GB/s"),
        ("stream Get 64 MiB vs raw-bytes stream", bget / oget, 0.7, True,
         f"{gbs / oget:.2f} vs {gbs / bget:.2f} GB/s"),
        ("Lookup 1,000 keys p99 (ms) vs 2 ms", p99 * 1e3, 2.0, False, f"{p99 * 1e3:.2f} ms"),
        ("single Lookup p50 vs empty call p50", single / empty, 1.3, False,
         f"{single * 1e6:.0f} vs {empty * 1e6:.0f} us"),
        ("memory overhead above bytes held", (grown - held) / held, 0.05, False,
         f"+{(grown - held) / MiB:.1f} MiB on {held / MiB:.0f} MiB"),
    ]  # fmt: skip
    thp = Path("/sys/kernel/mm/transparent_hugepage/shmem_enabled")
    shmem = thp.read_text().strip() if thp.exists() else "n/a"
    print(f"# bench_daemon  {time.strftime('%Y-%m-%d')}  {machine()}  shmem THP: {shmem}")
    print(f"{'case':45} {'ratio':>8} {'goal':>7}  verdict  detail")
    for name, ratio, goal, higher, detail in rows:
        sign = ">=" if higher else "<="
        ok = verdict(ratio, goal, higher)
        print(f"{name:45} {ratio:8.3f} {sign}{goal:5.2f}  {ok:7}  {detail}")


if __name__ == "__main__":
    main()
