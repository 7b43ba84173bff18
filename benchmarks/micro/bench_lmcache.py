"""kvtierd's LMCache storage plugin vs LMCache's own local CPU and local disk backends (issue 6).

The same LMCache ``MemoryObj`` chunks (``KV_2LTD`` ``[2, L, chunk_tokens, H*D]``, bf16, random
values; default Llama-3.1-8B geometry: 32 layers, 8 KV heads, head dim 128, 256-token chunks =
32 MiB a chunk) go, in-process through each backend's Python API, into

* ``LocalCPUBackend`` (``local_cpu: true``): ``batched_submit_put_task`` / ``get_blocking``;
* ``LocalDiskBackend``: ``batched_submit_put_task`` (asynchronous; timed until every key's
  completion callback ran) / ``batched_get_blocking``; loads read files just written (page
  cache), and again after each file was fsynced and dropped from the page cache
  (``POSIX_FADV_DONTNEED``, untimed) — "cold";
* ``KvtierdStoragePlugin`` on a real ``kvtierd serve`` (benchmarks/_support/daemon_proc.py), CPU
  tier:
  ``batched_submit_put_task`` / ``batched_get_blocking``;
* a reference: one memcpy (``np.copyto``) of the same bytes into reused buffers.

One "request" of ``--chunks`` chunks is stored, then loaded, per case; the cases interleave in
every repetition (after one untimed warm-up) and every load is checked bit for bit. Keys are
new each repetition and removed after it, untimed. Prints GB/s (1e9 bytes/s), median [min-max],
and the plugin's ratios (benchmarks/RESULTS.md, "vLLM + LMCache integration (issue 6)").

    .venv/bin/python -m benchmarks.micro.bench_lmcache [--reps 5] [--chunks 8] [--layers 32]
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import tempfile
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
import yaml

from benchmarks._support.common import machine
from benchmarks._support.daemon_proc import DaemonProcess, write_config

GiB = 1 << 30
MODEL = "bench-llama-3.1-8b"


@dataclass(frozen=True, slots=True)
class Geometry:
    layers: int
    kv_heads: int
    head_dim: int
    chunk_tokens: int

    @property
    def shape(self) -> torch.Size:
        return torch.Size([2, self.layers, self.chunk_tokens, self.kv_heads * self.head_dim])

    @property
    def chunk_bytes(self) -> int:
        return self.shape.numel() * 2  # bf16


@dataclass(frozen=True, slots=True)
class Case:
    """How one backend stores a request's chunks, loads them back, and forgets them."""

    store: Callable[[list[Any], list[Any]], object]
    load: Callable[[list[Any]], list[Any]]
    forget: Callable[[list[Any]], object]
    before_load: Callable[[list[Any]], None] = lambda keys: None


class Rig:
    """LMCache's config, metadata and backends, and the plugin on a kvtierd daemon."""

    def __init__(self, work: Path, geom: Geometry, n_chunks: int, reps: int) -> None:
        from lmcache.v1.config import LMCacheEngineConfig
        from lmcache.v1.metadata import LMCacheMetadata
        from lmcache.v1.storage_backend.local_cpu_backend import LocalCPUBackend
        from lmcache.v1.storage_backend.local_disk_backend import LocalDiskBackend

        from kvtierd.integrations.lmcache_plugin import KvtierdStoragePlugin

        self.geom = geom
        request_gib = n_chunks * geom.chunk_bytes / GiB
        self.daemon = _start_daemon(work / "daemon", n_chunks * geom.chunk_bytes)
        config = LMCacheEngineConfig.from_defaults(
            chunk_size=geom.chunk_tokens,
            local_cpu=True,
            # sources + one request loaded back + slack
            max_local_cpu_size=3 * request_gib + 0.25,
            local_disk=str(work / "lmcache-disk"),
            # LocalDiskBackend.remove() does not lower its size counter, and a put that finds
            # no room is dropped silently: room for every pass of both disk cases
            max_local_disk_size=2 * (reps + 1) * request_gib + 1,
            lmcache_instance_id="bench",
            extra_config={"kvtierd.socket_path": self.daemon.socket_path},
        )
        metadata = LMCacheMetadata(
            model_name=MODEL,
            world_size=1,
            local_world_size=1,
            worker_id=0,
            local_worker_id=0,
            kv_dtype=torch.bfloat16,
            kv_shape=(geom.layers, 2, geom.chunk_tokens, geom.kv_heads, geom.head_dim),
            chunk_size=geom.chunk_tokens,
        )
        self.loop = asyncio.new_event_loop()
        self._loop_thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self._loop_thread.start()
        self.cpu = LocalCPUBackend(config, metadata, dst_device="cpu")
        self.disk = LocalDiskBackend(config, self.loop, self.cpu, "cpu", None, metadata)
        self.plugin = KvtierdStoragePlugin("cpu", config, metadata, self.cpu, self.loop)

    def sources(self, n: int) -> list[Any]:
        from lmcache.v1.memory_management import MemoryFormat

        g = torch.Generator().manual_seed(0)
        objs = []
        for _ in range(n):
            obj = self.cpu.allocate(self.geom.shape, torch.bfloat16, MemoryFormat.KV_2LTD)
            if obj is None:
                raise RuntimeError("LMCache's CPU allocator is full; lower --chunks")
            obj.tensor.copy_(torch.randn(self.geom.shape, generator=g).to(torch.bfloat16))
            objs.append(obj)
        return objs

    def cases(self, n: int) -> dict[str, Case]:
        scratch = [torch.empty(self.geom.shape, dtype=torch.bfloat16) for _ in range(n)]
        copied = [torch.empty_like(s) for s in scratch]
        disk = Case(self._disk_store, self.disk.batched_get_blocking, self._disk_forget)
        return {
            "LMCache LocalCPUBackend": Case(
                self.cpu.batched_submit_put_task,
                lambda keys: [self.cpu.get_blocking(k) for k in keys],
                lambda keys: [self.cpu.remove(k) for k in keys],
            ),
            "LMCache LocalDiskBackend (page cache)": disk,
            "LMCache LocalDiskBackend (cold)": Case(
                disk.store, disk.load, disk.forget, before_load=self._drop_page_cache
            ),
            "kvtierd plugin (daemon CPU tier)": Case(
                self.plugin.batched_submit_put_task,
                self.plugin.batched_get_blocking,
                lambda keys: [self.plugin.remove(k) for k in keys],
            ),
            "reference: one memcpy (np.copyto)": Case(
                lambda keys, objs: _copy_all([o.tensor for o in objs], scratch),
                lambda keys: _copy_all(scratch, copied),
                lambda keys: None,
            ),
        }

    def _disk_store(self, keys: list[Any], objs: list[Any]) -> None:
        done = threading.Semaphore(0)
        self.disk.batched_submit_put_task(keys, objs, on_complete_callback=lambda k: done.release())
        for _ in keys:
            if not done.acquire(timeout=60):
                raise TimeoutError("LocalDiskBackend did not finish its writes in 60 s (dropped?)")

    def _disk_forget(self, keys: list[Any]) -> None:
        for k in keys:
            if not self.disk.remove(k):
                raise RuntimeError(f"LocalDiskBackend lost {k}")

    def _drop_page_cache(self, keys: list[Any]) -> None:
        for k in keys:
            fd = os.open(self.disk._key_to_path(k), os.O_RDONLY)
            try:
                os.fsync(fd)
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            finally:
                os.close(fd)

    def close(self) -> None:
        self.plugin.close()
        self.disk.close()
        self.cpu.close()
        self.loop.call_soon_threadsafe(self.loop.stop)
        self._loop_thread.join(10)
        self.daemon.stop()


def _start_daemon(directory: Path, request_bytes: int) -> DaemonProcess:
    mib = -(-request_bytes // (1 << 20))
    path = write_config(directory, cpu=f"{2 * mib}MiB", ssd=f"{2 * mib}MiB")
    # One put of a whole request is staged in the arena between Allocate and Commit.
    doc = yaml.safe_load(path.read_text())
    doc["tiers"][0]["options"]["staging_bytes"] = f"{2 * mib}MiB"
    path.write_text(yaml.safe_dump(doc))
    sock = str(directory / "kvtierd.sock")
    return DaemonProcess(path, sock, directory / "daemon.log").start()


def _copy_all(src: Sequence[torch.Tensor], dst: Sequence[torch.Tensor]) -> list[torch.Tensor]:
    """The plugin's put copies with ``np.copyto`` on byte views (daemon_io.put_many): the same."""
    for s, d in zip(src, dst, strict=True):
        np.copyto(d.view(torch.uint8).numpy(), s.view(torch.uint8).numpy())
    return list(dst)


def _keys(rep: int, case: int, n: int) -> list[Any]:
    from lmcache.utils import CacheEngineKey

    return [
        CacheEngineKey(MODEL, 1, 0, (rep * 100 + case) * 1000 + i, torch.bfloat16) for i in range(n)
    ]


def _one(case: Case, keys: list[Any], objs: list[Any], nbytes: int) -> tuple[float, float]:
    """Store then load one request; returns (store, load) bytes/s."""
    t0 = time.perf_counter()
    case.store(keys, objs)
    store_s = time.perf_counter() - t0
    case.before_load(keys)
    t0 = time.perf_counter()
    loaded = case.load(keys)
    load_s = time.perf_counter() - t0
    for got, want in zip(loaded, objs, strict=True):
        tensor = got if isinstance(got, torch.Tensor) else got.tensor
        if not torch.equal(tensor.view(torch.int16), want.tensor.view(torch.int16)):
            raise AssertionError("a loaded chunk differs from the stored one")
        if not isinstance(got, torch.Tensor):
            # a buffer the backend allocated for this load, or (LocalCPUBackend) the source
            # with the reference its get took
            got.ref_count_down()
    case.forget(keys)
    return nbytes / store_s, nbytes / load_s


def run(geom: Geometry, n_chunks: int, reps: int) -> dict[str, list[tuple[float, float]]]:
    rates: dict[str, list[tuple[float, float]]] = {}
    with tempfile.TemporaryDirectory(prefix="kvtierd-bench-lmcache-") as tmp:
        rig = Rig(Path(tmp), geom, n_chunks, reps)
        try:
            objs = rig.sources(n_chunks)
            cases = rig.cases(n_chunks)
            for rep in range(reps + 1):  # rep 0 warms every path up, untimed
                for ci, (name, case) in enumerate(cases.items()):
                    r = _one(case, _keys(rep, ci, n_chunks), objs, n_chunks * geom.chunk_bytes)
                    if rep:
                        rates.setdefault(name, []).append(r)
            stats = rig.plugin.stats
            if stats.errors or stats.put_chunks != (reps + 1) * n_chunks:
                raise AssertionError(f"plugin stats off: {stats}")
            for obj in objs:
                obj.ref_count_down()
        finally:
            rig.close()
    return rates


def _fmt(rates: list[float]) -> str:
    return f"{statistics.median(rates) / 1e9:.2f} [{min(rates) / 1e9:.2f}-{max(rates) / 1e9:.2f}]"


def report(rates: dict[str, list[tuple[float, float]]]) -> None:
    print("| case | store GB/s | load GB/s |\n|---|---|---|")
    for name, rs in rates.items():
        print(f"| {name} | {_fmt([s for s, _ in rs])} | {_fmt([lo for _, lo in rs])} |")
    med = {n: (statistics.median(s for s, _ in rs), statistics.median(lo for _, lo in rs))
           for n, rs in rates.items()}  # fmt: skip
    plugin = med["kvtierd plugin (daemon CPU tier)"]
    print("\nratios of medians, kvtierd plugin / other:\n| other | store | load |\n|---|---|---|")
    for name, (store, load) in med.items():
        if not name.startswith("kvtierd"):
            print(f"| {name} | {plugin[0] / store:.3g} | {plugin[1] / load:.3g} |")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--reps", type=int, default=5)
    p.add_argument("--chunks", type=int, default=8, help="chunks per request")
    p.add_argument("--layers", type=int, default=32)
    p.add_argument("--kv-heads", type=int, default=8)
    p.add_argument("--head-dim", type=int, default=128)
    p.add_argument("--chunk-tokens", type=int, default=256)
    args = p.parse_args()
    os.environ["LMCACHE_TRACK_USAGE"] = "false"
    os.environ.setdefault("LMCACHE_LOG_LEVEL", "ERROR")
    geom = Geometry(args.layers, args.kv_heads, args.head_dim, args.chunk_tokens)
    print(
        f"{machine()}; chunk {tuple(geom.shape)} bf16 = {geom.chunk_bytes / (1 << 20):.0f} MiB, "
        f"{args.chunks} chunks a request, {args.reps} reps"
    )
    report(run(geom, args.chunks, args.reps))


if __name__ == "__main__":
    main()
