"""SSD tier throughput vs raw O_DIRECT I/O of the same bytes at the same queue depth.

Goals (issue 2): tier read >= 0.8x a raw O_DIRECT ``preadv`` read; tier write >= 0.7x a raw
O_DIRECT ``pwritev`` write. Each figure is a ratio to a limit measured in the same run, rounds
interleaved so that the noise of a shared virtual disk hits both sides alike.

Also measures the aiofiles alternative (DESIGN.md §3.10): the same 4 MiB O_DIRECT parts through
``aiofiles`` file objects (seek + readinto / write, one handle per queue slot).

    .venv/bin/python -m benchmarks.micro.bench_ssd [--objects 8] [--rounds 5] [--queue-depth 4]
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

from benchmarks._support.common import print_machine
from kvtierd.config import TierConfig
from kvtierd.storage.ssd import SsdTier
from kvtierd.types import ObjectMeta

OBJECT_BYTES = 64 << 20
PART = 4 << 20
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
        offsets = range(0, src.nbytes, PART)
        list(pool.map(lambda o: os.pwritev(fd, [src[o : o + PART]], HEADER + o), offsets))
        if fsync:
            os.fsync(fd)
    finally:
        os.close(fd)


def raw_read(pool: ThreadPoolExecutor, path: str, dst: memoryview) -> None:
    fd = os.open(path, os.O_RDONLY | os.O_DIRECT)
    try:
        offsets = range(0, dst.nbytes, PART)
        got = sum(pool.map(lambda o: os.preadv(fd, [dst[o : o + PART]], HEADER + o), offsets))
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
        for off in range(i * PART, buf.nbytes, depth * PART):
            await f.seek(HEADER + off)
            piece = buf[off : off + PART]
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


class Bench:
    """One run's buffers, tier, raw thread pool and results (GB/s per case, one per round)."""

    def __init__(self, root: Path, tier: SsdTier, depth: int, objects: int) -> None:
        self.root, self.tier, self.depth, self.objects = root, tier, depth, objects
        self.total = objects * OBJECT_BYTES
        self.pool = ThreadPoolExecutor(depth)
        self.src, self.dst = aligned(OBJECT_BYTES), aligned(OBJECT_BYTES)
        self.odd = memoryview(bytearray(OBJECT_BYTES + 1))[1:]  # unaligned: the bounce path
        self.res: dict[str, list[float]] = {}
        self.dropped = False

    async def case(
        self, name: str, each: Callable[[str], Awaitable[object]], items: list[str]
    ) -> None:
        async def all_items() -> None:
            for item in items:
                await each(item)

        start = time.perf_counter()
        await all_items()
        self.res.setdefault(name, []).append(self.total / (time.perf_counter() - start) / 1e9)

    async def round(self, r: int) -> None:
        loop, tier = asyncio.get_running_loop(), self.tier
        raws = [str(self.root / "raw" / f"{i}") for i in range(self.objects)]
        aios = [str(self.root / "aio" / f"{i}") for i in range(self.objects)]
        keys = [f"r{r}o{i}" for i in range(self.objects)]
        paths = [tier.layout.object_path("", k) for k in keys]

        async def aio_write(p: str) -> None:
            await aio_transfer(p, self.src, self.depth, write=True)
            await loop.run_in_executor(None, _fsync_path, p)

        def raw_w(fsync: bool) -> Callable[[str], Awaitable[None]]:
            return lambda p: loop.run_in_executor(None, raw_write, self.pool, p, self.src, fsync)

        await self.case("write raw O_DIRECT", raw_w(False), raws)
        await self.case("write raw O_DIRECT + fsync", raw_w(True), raws)
        await self.case(
            "write tier (O_DIRECT, fsync)",
            lambda k: tier.put(ObjectMeta(key=k, size_bytes=OBJECT_BYTES), self.src),
            keys,
        )
        await self.case("write aiofiles O_DIRECT + fsync", aio_write, aios)
        reads: list[tuple[str, Callable[[str], Awaitable[object]], list[str]]] = [
            ("read raw O_DIRECT",
             lambda p: loop.run_in_executor(None, raw_read, self.pool, p, self.dst), paths),
            ("read tier", lambda k: tier.read_into(k, self.dst), keys),
            ("read tier, unaligned dst", lambda k: tier.read_into(k, self.odd), keys),
            ("read aiofiles O_DIRECT",
             lambda p: aio_transfer(p, self.dst, self.depth, write=False), paths),
        ]  # fmt: skip
        for name, each, items in reads:
            self.dropped = drop_caches()
            await self.case(name, each, items)
        for k in keys:  # every pass writes fresh files, as the tier does
            await tier.delete(k)
        for p in raws + aios:
            os.unlink(p)


async def run(args: argparse.Namespace) -> int:
    root = Path(tempfile.mkdtemp(prefix="kvtierd-bench-ssd-", dir=args.dir))
    depth = args.queue_depth
    tier = SsdTier(TierConfig("ssd", "ssd", 1 << 40, str(root / "tier"), {"queue_depth": depth}))
    await tier.start()
    try:
        if not tier.direct:
            print("the filesystem refuses O_DIRECT: nothing to compare", file=sys.stderr)
            return 2
        (root / "raw").mkdir()
        (root / "aio").mkdir()
        bench = Bench(root, tier, depth, args.objects)
        for r in range(args.rounds):
            await bench.round(r)
        bench.pool.shutdown()
    finally:
        await tier.close()
        shutil.rmtree(root)
    report(bench.res, args, bench.dropped)
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
        f"{args.rounds} rounds, queue depth {args.queue_depth}, {PART >> 20} MiB parts; "
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
    args = parser.parse_args()
    print_machine("bench_ssd")
    return asyncio.run(run(args))


if __name__ == "__main__":
    raise SystemExit(main())
