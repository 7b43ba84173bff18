"""Step ``daemon``: a daemon with gpu (64 MiB), cpu (256 MiB) and ssd (512 MiB) tiers.

Checks: put/get byte-exact (objects of 1 B to 16 MiB + 5, read back while in the gpu tier);
a read through CUDA IPC from a second process (``ipc_reader.py``: in place, byte-exact);
lease and release (the daemon counts the lease, a delete under it keeps the bytes, release
returns the count to 0); the gpu tier's eviction to cpu under pressure (twice its capacity
written, the gpu tier stays within capacity, every object still byte-exact wherever it went).
"""

from __future__ import annotations

import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import yaml

from benchmarks._support.daemon_proc import DaemonProcess
from benchmarks.gpu.ipc_reader import payload
from benchmarks.gpu.record import Recorder, step_args
from kvtierd.client import KVClient

MiB = 1 << 20
GPU_BYTES = 64 * MiB


def start(tmp: Path) -> DaemonProcess:
    lru = tmp / "lru.yaml"
    lru.write_text("name: lru\nplacer: lru\n")
    doc = {
        "socket_path": str(tmp / "kvtierd.sock"),
        "data_dir": str(tmp / "data"),
        "policy_file": str(lru),
        "tiers": [
            {"name": "gpu", "kind": "gpu", "capacity": "64MiB"},
            {"name": "cpu", "kind": "cpu", "capacity": "256MiB"},
            {"name": "ssd", "kind": "ssd", "capacity": "512MiB", "path": str(tmp / "ssd")},
        ],
    }
    (tmp / "kvtierd.yaml").write_text(yaml.safe_dump(doc))
    d = DaemonProcess(tmp / "kvtierd.yaml", str(tmp / "kvtierd.sock"), tmp / "daemon.log")
    return d.start(timeout_s=60)


def until_in(c: KVClient, key: str, tier: str, timeout_s: float = 20.0) -> float:
    t0 = time.monotonic()
    while c.lookup([key]).tiers != (tier,):
        if time.monotonic() - t0 > timeout_s:
            raise TimeoutError(f"{key!r} is in {c.lookup([key]).tiers}, never reached {tier}")
        time.sleep(0.02)
    return time.monotonic() - t0


def used(c: KVClient, tier: str) -> int:
    return next(t.used_bytes for t in c.tiers() if t.name == tier)


def run_checks(rec: Recorder, c: KVClient, socket_path: str) -> None:
    sizes = {"one": 1, "odd": 4097, "mid": MiB + 3, "big": 16 * MiB + 5}

    def put_get() -> tuple[bool, str, str]:
        t0, wrong, moved = time.perf_counter(), [], 0
        for i, (key, size) in enumerate(sizes.items()):
            c.put(key, payload(i, size))
            until_in(c, key, "gpu")
            if not np.array_equal(c.get(key), payload(i, size)):
                wrong.append(key)
            moved += size
        secs = time.perf_counter() - t0
        fig = f"{len(sizes)} objects, {moved / MiB:.1f} MiB put+get in {secs:.2f} s"
        return not wrong, fig, f"not byte-exact: {wrong}" if wrong else "read from the gpu tier"

    rec.run("put/get byte-exact (gpu tier)", put_get)

    def ipc() -> tuple[bool, str, str]:
        cmd = [
            sys.executable,
            "-m",
            "benchmarks.gpu.ipc_reader",
            "--socket",
            socket_path,
            "--key",
            "big",
            "--seed",
            "3",
            "--size",
            str(sizes["big"]),
        ]
        done = subprocess.run(cmd, capture_output=True, text=True, timeout=60, check=False)
        if done.returncode != 0:
            return False, f"reader exited {done.returncode}", done.stderr[-500:]
        r = json.loads(done.stdout.strip().splitlines()[-1])
        fig = (
            f"in place: {r['is_cuda']}, byte-exact: {r['equal']}, lease {r['lease_s'] * 1e3:.1f}"
            f" ms, read {r['read_bytes_per_s'] / 1e9:.0f} GB/s"
        )
        return bool(r["is_cuda"] and r["equal"]), fig, "second process, CUDA IPC"

    rec.run("read through CUDA IPC from a second process", ipc)

    def lease_release() -> tuple[bool, str, str]:
        before = used(c, "gpu")
        with c.device_lease("mid") as (_, view):
            in_place = bool(view.is_cuda)
            held = c.status().leases
            c.delete(["mid"])  # the reader keeps its bytes until it releases
            gone = not c.lookup(["mid"]).found[0]
            c.put("fresh", np.full(sizes["mid"], 7, np.uint8))
            kept = bool(np.array_equal(view.cpu().numpy(), payload(2, sizes["mid"])))
        after, now_used = c.status().leases, used(c, "gpu")
        fig = (
            f"in place {in_place}; leases {held} while held, {after} after; delete under "
            f"lease: gone from index {gone}, bytes kept {kept}; gpu used {before} -> {now_used}"
        )
        return in_place and held == 1 and after == 0 and gone and kept, fig, ""

    rec.run("lease and release", lease_release)

    def eviction() -> tuple[bool, str, str]:
        n, size = 8, 16 * MiB  # twice the gpu tier
        t0 = time.perf_counter()
        for i in range(n):
            c.put(f"p{i}", payload(100 + i, size))
        deadline = time.monotonic() + 20
        while used(c, "gpu") > GPU_BYTES and time.monotonic() < deadline:
            time.sleep(0.05)
        places = c.lookup([f"p{i}" for i in range(n)]).tiers
        wrong = [i for i in range(n) if not np.array_equal(c.get(f"p{i}"), payload(100 + i, size))]
        gpu_used = used(c, "gpu")
        below = [t for t in places if t != "gpu"]
        fig = (
            f"{n} x 16 MiB into a 64 MiB gpu tier in {time.perf_counter() - t0:.2f} s: "
            f"tiers {list(places)}, gpu used {gpu_used / MiB:.1f} MiB"
        )
        ok = not wrong and gpu_used <= GPU_BYTES and "cpu" in below
        return ok, fig, f"not byte-exact: {wrong}" if wrong else "evicted to cpu, byte-exact"

    rec.run("gpu tier evicts to cpu under pressure", eviction)


def main() -> None:
    args = step_args(__doc__.split("\n\n")[0])
    rec = Recorder(args.result)
    with tempfile.TemporaryDirectory(prefix="gpu-check-daemon-") as tmp:
        started: list[DaemonProcess] = []

        def launch() -> tuple[bool, str, str]:
            t0 = time.perf_counter()
            started.append(start(Path(tmp)))
            return True, f"answered in {time.perf_counter() - t0:.1f} s", "gpu + cpu + ssd tiers"

        rec.run("start the daemon", launch)
        if not started:
            return
        d = started[0]
        try:
            with KVClient(d.socket_path) as c:
                run_checks(rec, c, d.socket_path)
        finally:
            d.stop()
            print(d.logs()[-3000:], flush=True)


if __name__ == "__main__":
    main()
