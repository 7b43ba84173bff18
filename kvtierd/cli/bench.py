"""``bench``: a quick data-path check of the running daemon against this machine's memory.

Both sides move the same bytes twice, measured in the same run (these machines are noisy):

* baseline: two ``memcpy`` into already-touched buffers (source -> middle -> destination);
* daemon: ``KVClient.put`` then ``KVClient.get(out=...)`` of one N MiB object, co-located
  through the shared-memory arena; with ``--stream`` also ``KVClient(socket, stream=True)``
  (gRPC streams over the Unix socket, the path a client on another host takes).

Each figure is the best of ``--repeat`` runs; GB/s counts 2 x N MiB per round trip, so the
ratio daemon / memcpy is the share of the machine's copy bandwidth the data path delivers.
The full benchmark (raw-gRPC baselines, lookups, memory) is ``benchmarks/micro/bench_daemon.py``.
"""

from __future__ import annotations

import argparse
import os
import time
from collections.abc import Callable

import numpy as np
import numpy.typing as npt

from kvtierd.cli.admin import connect
from kvtierd.cli.exit_codes import CliError, ExitCode, exit_code_of
from kvtierd.cli.output import Output
from kvtierd.client import KVClient
from kvtierd.errors import (
    KvtierError,
)
from kvtierd.rpc import kvtier_pb2 as pb

MiB = 1 << 20
Bytes = npt.NDArray[np.uint8]


def _best(fn: Callable[[], float], repeat: int) -> float:
    fn()  # warm-up: touches pages, maps the arena region
    return min(fn() for _ in range(repeat))


def memcpy_s(src: Bytes, repeat: int) -> float:
    mid, dst = np.empty_like(src), np.empty_like(src)

    def two_copies() -> float:
        t0 = time.perf_counter()
        np.copyto(mid, src)
        np.copyto(dst, mid)
        return time.perf_counter() - t0

    return _best(two_copies, repeat)


def put_get_s(client: KVClient, src: Bytes, repeat: int) -> float:
    dst = np.empty_like(src)
    prefix = f"kvtierctl-bench/{os.getpid()}-{time.monotonic_ns()}"
    n = 0

    def round_trip() -> float:
        nonlocal n
        key = f"{prefix}/{n}"
        n += 1
        dst.fill(0)
        t0 = time.perf_counter()
        client.put(key, src)
        client.get(key, out=dst)
        seconds = time.perf_counter() - t0
        client.delete([key])  # untimed; the next put reuses the freed block
        if not np.array_equal(dst, src):
            raise CliError(ExitCode.ERROR, f"bench: {key} came back different from what was put")
        return seconds

    return _best(round_trip, repeat)


def _client_error(e: KvtierError, socket_path: str) -> CliError:
    return CliError(exit_code_of(e), f"bench via unix:{socket_path}: {type(e).__name__}: {e}")


def _measure(
    out: Output, args: argparse.Namespace, socket_path: str, src: Bytes
) -> list[tuple[str, float]]:
    paths = [("arena", False)] + ([("stream", True)] if args.stream else [])
    results = []
    with out.progress("bench", len(paths)) as step:
        for name, stream in paths:
            try:
                with KVClient(socket_path, stream=stream, timeout_s=args.timeout) as c:
                    results.append((name, put_get_s(c, src, args.repeat)))
            except KvtierError as e:
                raise _client_error(e, socket_path) from e
            step(name)
    return results


def run_bench(args: argparse.Namespace, out: Output) -> ExitCode:
    if args.address:
        raise CliError(ExitCode.USAGE, "bench is co-located only: use --socket, not --address")
    if args.mib <= 0 or args.repeat <= 0:
        raise CliError(ExitCode.USAGE, "--mib and --repeat must be > 0")
    with connect(args) as conn:  # one line naming the socket (exit 3) when nobody answers
        status = conn.call(conn.stub.Status, pb.StatusRequest())
        socket_path = conn.target.socket_path
    size = args.mib * MiB
    src = np.random.default_rng(0).integers(0, 255, size, dtype=np.uint8)
    base = memcpy_s(src, args.repeat)
    paths = _measure(out, args, socket_path, src)
    return _print(out, args, status.version, base, paths)


def _print(
    out: Output, args: argparse.Namespace, version: str, base: float, paths: list[tuple[str, float]]
) -> ExitCode:
    moved = 2 * args.mib * MiB / 1e9  # GB per round trip
    rows = [
        {"path": name, "seconds": s, "gb_per_s": moved / s, "ratio": base / s} for name, s in paths
    ]
    if out.as_json:
        out.json(
            {
                "mib": args.mib,
                "repeat": args.repeat,
                "daemon_version": version,
                "memcpy_seconds": base,
                "memcpy_gb_per_s": moved / base,
                "paths": rows,
            }
        )
        return ExitCode.OK
    out.table(
        f"put + get of {args.mib} MiB vs 2 memcpys, best of {args.repeat} (kvtierd {version})",
        ("path", "GB/s", "memcpy GB/s", "ratio"),
        [
            [r["path"], f"{r['gb_per_s']:.2f}", f"{moved / base:.2f}", f"{r['ratio']:.2f}"]
            for r in rows
        ],
    )
    return ExitCode.OK
