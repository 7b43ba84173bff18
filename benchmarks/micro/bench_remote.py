"""Remote tier throughput vs raw redis-py on the same Redis Cluster, in the same run.

Starts a 3-master cluster on loopback (benchmarks/_support/redis_cluster.py), then, interleaved per
repetition, moves the same 64 MiB object through

* the tier (``RemoteTier.put`` / ``read_into``: checksum, staged parts, commit script, header),
* raw redis-py, synchronous cluster client, one pipeline of 4 MiB SET/GETs under one hash tag,
* raw redis-py, asyncio cluster client, the same pipeline.

Prints GB/s (1e9 bytes/s) as median [min-max] over the repetitions and the tier's ratio to the
faster raw client for each direction (benchmarks/RESULTS.md, "Remote tier on Redis Cluster").

    .venv/bin/python -m benchmarks.micro.bench_remote [--reps 7] [--size-mib 64]
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import tempfile
import time
from collections.abc import Awaitable, Callable
from pathlib import Path

import redis.asyncio.cluster as aio_cluster
import redis.cluster as sync_cluster

from benchmarks._support.common import print_machine
from benchmarks._support.redis_cluster import RedisClusterProcs
from kvtierd.config import TierConfig
from kvtierd.storage.remote import RemoteTier
from kvtierd.types import ObjectMeta

PART = 4 << 20


def _fmt(rates: list[float]) -> str:
    return f"{statistics.median(rates) / 1e9:.2f} [{min(rates) / 1e9:.2f}-{max(rates) / 1e9:.2f}]"


async def _timed(fn: Callable[[], Awaitable[object]], nbytes: int) -> float:
    start = time.perf_counter()
    await fn()
    return nbytes / (time.perf_counter() - start)


def _names(tag: str, count: int) -> list[str]:
    return [f"bench:{{{tag}}}:{i}" for i in range(count)]


def _raw_sync_put(client: sync_cluster.RedisCluster, tag: str, view: memoryview) -> None:
    pipe = client.pipeline(transaction=False)
    for i, name in enumerate(_names(tag, len(view) // PART)):
        pipe.set(name, view[i * PART : (i + 1) * PART])
    pipe.execute()


def _raw_sync_get(client: sync_cluster.RedisCluster, tag: str, out: memoryview) -> None:
    pipe = client.pipeline(transaction=False)
    for name in _names(tag, len(out) // PART):
        pipe.get(name)
    for i, value in enumerate(pipe.execute()):
        out[i * PART : (i + 1) * PART] = value


async def _raw_aio_put(client: aio_cluster.RedisCluster, tag: str, view: memoryview) -> None:
    pipe = client.pipeline(transaction=False)
    for i, name in enumerate(_names(tag, len(view) // PART)):
        pipe.set(name, view[i * PART : (i + 1) * PART])
    await pipe.execute()


async def _raw_aio_get(client: aio_cluster.RedisCluster, tag: str, out: memoryview) -> None:
    pipe = client.pipeline(transaction=False)
    for name in _names(tag, len(out) // PART):
        pipe.get(name)
    for i, value in enumerate(await pipe.execute()):
        out[i * PART : (i + 1) * PART] = value


def _cases(
    tier: RemoteTier,
    *,
    sync_client: sync_cluster.RedisCluster,
    aio_client: aio_cluster.RedisCluster,
    key: str,
    data: memoryview,
    out: memoryview,
) -> dict[str, Callable[[], Awaitable[object]]]:
    """One repetition: the same bytes through the tier and both raw clients."""
    loop = asyncio.get_running_loop()
    meta = ObjectMeta(key=key, size_bytes=len(data))
    return {
        "tier put": lambda: tier.put(meta, data),
        "tier get": lambda: tier.read_into(key, out),
        "raw sync put": lambda: loop.run_in_executor(None, _raw_sync_put, sync_client, key, data),
        "raw sync get": lambda: loop.run_in_executor(None, _raw_sync_get, sync_client, key, out),
        "raw async put": lambda: _raw_aio_put(aio_client, key + "a", data),
        "raw async get": lambda: _raw_aio_get(aio_client, key + "a", out),
    }


async def run(cluster: RedisClusterProcs, reps: int, size: int) -> dict[str, list[float]]:
    """Interleaved repetitions; returns bytes/s per case."""
    data = memoryview(os.urandom(size))
    out = memoryview(bytearray(size))  # reused and touched: no page faults in the timing
    nodes = [(n.split(":")[0], int(n.split(":")[1])) for n in cluster.addresses]
    tier = RemoteTier(TierConfig("remote", "remote", 0, "", {"nodes": cluster.addresses}))
    await tier.start()
    sync_client = sync_cluster.RedisCluster(
        startup_nodes=[sync_cluster.ClusterNode(h, p) for h, p in nodes]
    )
    aio_client = aio_cluster.RedisCluster(
        startup_nodes=[aio_cluster.ClusterNode(h, p) for h, p in nodes]
    )
    await aio_client.initialize()
    rates: dict[str, list[float]] = {}
    try:
        for rep in range(reps):
            key = f"obj{rep}"
            cases = _cases(
                tier, sync_client=sync_client, aio_client=aio_client, key=key, data=data, out=out
            )
            for name, fn in cases.items():
                rates.setdefault(name, []).append(await _timed(fn, size))
            if bytes(out) != bytes(data):
                raise AssertionError("raw async get returned other bytes")
            await tier.delete(key)
            sync_client.delete(*_names(key, size // PART))
            await aio_client.delete(*_names(key + "a", size // PART))
    finally:
        await aio_client.aclose()
        sync_client.close()
        await tier.close()
    return rates


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--reps", type=int, default=7)
    parser.add_argument("--size-mib", type=int, default=64)
    args = parser.parse_args()
    print_machine("bench_remote")
    with tempfile.TemporaryDirectory(prefix="bench-remote-") as base:
        cluster = RedisClusterProcs(Path(base))
        cluster.start()
        try:
            rates = asyncio.run(run(cluster, args.reps, args.size_mib << 20))
        finally:
            cluster.stop()
    print(f"{args.size_mib} MiB objects, {args.reps} reps, GB/s median [min-max]")
    print("| case | GB/s |\n|---|---|")
    for name, values in rates.items():
        print(f"| {name} | {_fmt(values)} |")
    for direction in ("put", "get"):
        tier = statistics.median(rates[f"tier {direction}"])
        raw = max(statistics.median(rates[f"raw {c} {direction}"]) for c in ("sync", "async"))
        print(f"tier/{direction} vs faster raw client: {tier / raw:.2f}")


if __name__ == "__main__":
    main()
