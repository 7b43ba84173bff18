"""SSD tier throughput vs raw O_DIRECT I/O of the same bytes at the same queue depth.

Goals (issue 2): tier read >= 0.8x a raw O_DIRECT ``preadv`` read; tier write >= 0.7x a raw
O_DIRECT ``pwritev`` write. Each figure is a ratio to a limit measured in the same run, rounds
interleaved so that the noise of a shared virtual disk hits both sides alike.

Also measures the aiofiles alternative (DESIGN.md §3.10): the same 4 MiB O_DIRECT chunks through
``aiofiles`` file objects (seek + readinto / write, one handle per queue slot).

    .venv/bin/python benchmarks/bench_ssd.py [--objects 8] [--rounds 5] [--queue-depth 4]
"""

from __future__ import annotations

import argparse
import asyncio
import mmap
import os
import shutil
import statistics
import sys
import tempfile
import time
from collections.abc import Awaitable, Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import aiofiles
import numpy as np

from kvtierd.config import TierConfig
from kvtierd.storage.ssd import SsdTier
from kvtierd.types import ObjectMeta

OBJECT_BYTES = 64 << 20
CHUNK = 4 << 20
HEADER = 4096  # the tier's data offset for these objects: raw reads read the same bytes


def aligned(nbytes: int) -> memoryview:
    view = memoryview(mmap.mmap(-1, nbytes))
    view[:] = np.random.default_rng(1).bytes(nbytes)  # touched and incompressible
    return view


def drop_caches() -> bool:
    """Drop the guest page cache (root only). O_DIRECT bypasses it anyway; the host's cache
    under the VM cannot be dropped from here."""
    try:
        os.sync()
        Path("/proc/sys/vm/drop_caches").write_text("3\n")
    except OSError:
        return False
    return True


# -- raw O_DIRECT baselines (plain threads, no asyncio, no checksum, no header) ---------------


def raw_write(pool: ThreadPoolExecutor, path: str, src: memoryview, fsync: bool) -> None:
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_DIRECT, 0o600)
    try:
        offsets = range(0, src.nbytes, CHUNK)
        list(pool.map(lambda o: os.pwritev(fd, [src[o : o + CHUNK]], HEADER + o), offsets))
        if fsync:
            os.fsync(fd)
    finally:
        os.close(fd)


def raw_read(pool: ThreadPoolExecutor, path: str, dst: memoryview) -> None:
    fd = os.open(path, os.O_RDONLY | os.O_DIRECT)
    try:
        offsets = range(0, dst.nbytes, CHUNK)
        got = sum(pool.map(lambda o: os.preadv(fd, [dst[o : o + CHUNK]], HEADER + o), offsets))
        if got != dst.nbytes:
            raise RuntimeError(f"raw read of {path}: {got} of {dst.nbytes} bytes")
    finally:
        os.close(fd)


# -- aiofiles alternative ----------------------------------------------------------------------


def _o_direct_opener(path: str, flags: int) -> int:
    return os.open(path, flags | os.O_DIRECT, 0o600)


async def aio_transfer(path: str, buf: memoryview, depth: int, write: bool) -> None:
    mode = "wb" if write else "rb"
    handles = [
        await aiofiles.open(path, mode if i == 0 or not write else "r+b", buffering=0,
                            opener=_o_direct_opener)
        for i in range(depth)
    ]  # fmt: skip

    async def lane(i: int) -> None:
        f = handles[i]
        for off in range(i * CHUNK, buf.nbytes, depth * CHUNK):
            await f.seek(HEADER + off)
            piece = buf[off : off + CHUNK]
            n = await (f.write(piece) if write else f.readinto(piece))
            if n != piece.nbytes:
                raise RuntimeError(f"aiofiles short transfer: {n} of {piece.nbytes}")

    try:
        await asyncio.gather(*(lane(i) for i in range(depth)))
        if write:
            await handles[0].flush()
    finally:
        for f in handles:
            await f.close()


# -- the run -----------------------------------------------------------------------------------


async def timed(n_bytes: int, fn: Callable[[], Awaitable[object]]) -> float:
    start = time.perf_counter()
    await fn()
    return n_bytes / (time.perf_counter() - start) / 1e9


async def run(args: argparse.Namespace) -> int:
    root = Path(tempfile.mkdtemp(prefix="kvtierd-bench-ssd-", dir=args.dir))
    depth, n = args.queue_depth, args.objects
    total = n * OBJECT_BYTES
    loop = asyncio.get_running_loop()
    pool = ThreadPoolExecutor(depth)
    src, dst = aligned(OBJECT_BYTES), aligned(OBJECT_BYTES)
    odd = memoryview(bytearray(OBJECT_BYTES + 1))[1:]  # not page-aligned: the bounce path
    tier = SsdTier(TierConfig("ssd", "ssd", 1 << 40, str(root / "tier"), {"queue_depth": depth}))
    await tier.start()
    if not tier.direct:
        print("the filesystem refuses O_DIRECT: nothing to compare", file=sys.stderr)
        return 2
    (root / "raw").mkdir()
    (root / "aio").mkdir()
    res: dict[str, list[float]] = {}
    dropped = False

    def add(name: str, gbps: float) -> None:
        res.setdefault(name, []).append(gbps)

    for r in range(args.rounds):
        raws = [str(root / "raw" / f"{i}") for i in range(n)]
        aios = [str(root / "aio" / f"{i}") for i in range(n)]
        keys = [f"r{r}o{i}" for i in range(n)]

        async def raw_w(fsync: bool, paths: list[str] = raws) -> None:
            for p in paths:
                await loop.run_in_executor(None, raw_write, pool, p, src, fsync)

        async def tier_w(ks: list[str] = keys) -> None:
            for k in ks:
                await tier.put(ObjectMeta(key=k, size_bytes=OBJECT_BYTES), src)

        async def aio_w(paths: list[str] = aios) -> None:
            for p in paths:
                await aio_transfer(p, src, depth, write=True)
                await loop.run_in_executor(None, _fsync_path, p)

        add("write raw O_DIRECT", await timed(total, lambda: raw_w(False)))
        add("write raw O_DIRECT + fsync", await timed(total, lambda: raw_w(True)))
        add("write tier (O_DIRECT, fsync)", await timed(total, tier_w))
        add("write aiofiles O_DIRECT + fsync", await timed(total, aio_w))
        tier_paths = [tier.layout.object_path("", k) for k in keys]

        async def raw_r(paths: list[str] = tier_paths) -> None:
            for p in paths:
                await loop.run_in_executor(None, raw_read, pool, p, dst)

        async def tier_r(ks: list[str] = keys) -> None:
            for k in ks:
                await tier.read_into(k, dst)

        async def tier_r_odd(ks: list[str] = keys) -> None:
            for k in ks:
                await tier.read_into(k, odd)

        async def aio_r(paths: list[str] = tier_paths) -> None:
            for p in paths:
                await aio_transfer(p, dst, depth, write=False)

        for name, fn in [("read raw O_DIRECT", raw_r), ("read tier", tier_r),
                         ("read tier, unaligned dst", tier_r_odd),
                         ("read aiofiles O_DIRECT", aio_r)]:  # fmt: skip
            dropped = drop_caches()
            add(name, await timed(total, fn))
        for k in keys:  # every pass writes fresh files, as the tier does
            await tier.delete(k)
        for p in raws + aios:
            os.unlink(p)
    await tier.close()
    pool.shutdown()
    shutil.rmtree(root)
    report(res, args, dropped)
    return 0


def _fsync_path(path: str) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def report(res: dict[str, list[float]], args: argparse.Namespace, dropped: bool) -> None:
    med = {k: statistics.median(v) for k, v in res.items()}
    base = {"write": med["write raw O_DIRECT"], "read": med["read raw O_DIRECT"]}
    print(
        f"\nSSD tier, {OBJECT_BYTES >> 20} MiB objects x {args.objects} per pass, "
        f"{args.rounds} rounds, queue depth {args.queue_depth}, {CHUNK >> 20} MiB chunks; "
        f"guest page cache dropped before reads: {'yes' if dropped else 'no (not permitted)'}"
    )
    print(f"{'case':36} {'GB/s median [min-max]':>24} {'x raw O_DIRECT':>15}")
    for name, values in res.items():
        ratio = med[name] / base[name.split()[0]]
        spread = f"{med[name]:.2f} [{min(values):.2f}-{max(values):.2f}]"
        print(f"{name:36} {spread:>24} {ratio:>14.2f}x")
    print(
        f"goals: tier read >= 0.80x -> {med['read tier'] / base['read']:.2f}x; "
        f"tier write >= 0.70x -> {med['write tier (O_DIRECT, fsync)'] / base['write']:.2f}x"
    )


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--objects", type=int, default=8, help="64 MiB objects per pass")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--queue-depth", type=int, default=4)
    parser.add_argument("--dir", default=None, help="where to put files (an ext4 path)")
    return asyncio.run(run(parser.parse_args()))


if __name__ == "__main__":
    raise SystemExit(main())
