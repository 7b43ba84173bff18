"""Plan executor throughput, and what its work costs the load path (issue 5).

    .venv/bin/python -m benchmarks.micro.bench_executor [--contexts 6]

An engine in this process with real tiers (cpu arena, ssd files; the ssd tier unbounded, so it
keeps originals as EvicPress's reference copies). Contexts of 4 chunks x 256 tokens, 8 layers x
8 KV heads x 128 dims, bf16 (32 MiB each). Each plan kind is timed through the executor
(``Executor.submit`` + ``idle``) and against the same work done directly in the same run:

* compress (int8, knorm@0.5): ``decode_context`` + ``encode_variant`` + a tier ``put`` of the
  encoded objects and of the reference copy — the executor's work without its bookkeeping,
  manifest and crash-safe ordering;
* demote (cpu -> ssd): a tier ``put`` of the same bytes from page-aligned huge-page buffers
  (as the arena's blocks are); promote (ssd -> cpu): a tier ``read_into`` such buffers (already
  faulted in) plus the ``delete`` of the source files that a move does.

Then the load path: ``Engine.get`` + ``release`` of an 8 MiB CPU-tier chunk, p50/p99/max while
the executor compresses contexts (measured only while plans are pending) vs while it is idle.
"""

from __future__ import annotations

import argparse
import asyncio
import mmap
import statistics
import tempfile
import time
from functools import partial
from pathlib import Path

import numpy as np
import torch

from benchmarks._support.common import machine, verdict
from kvtierd.config import DaemonConfig, TierConfig
from kvtierd.engine import Engine
from kvtierd.engine.context_kv import chunk_formats, decode_context, encode_variant
from kvtierd.kernels.chunk_codec import ChunkFormat
from kvtierd.kernels.placeholder import ModelCard, model_card_key
from kvtierd.kernels.rope import RopeSpec
from kvtierd.policies.loader import parse_policy
from kvtierd.types import ObjectMeta, Operation, OpKind, Placement, Plan

L, H, D, T, CHUNKS = 8, 8, 128, 256, 4
CHUNK_BYTES = 2 * L * T * H * D * 2
CTX_BYTES = CHUNKS * CHUNK_BYTES
MODEL = "bench-model"


def config(tmp: Path) -> DaemonConfig:
    tiers = (
        TierConfig("cpu", "cpu", 2 << 30, options={"staging_bytes": "512MiB"}),
        TierConfig("ssd", "ssd", 0, str(tmp / "ssd")),
    )
    return DaemonConfig(socket_path=str(tmp / "s"), data_dir=str(tmp / "data"), tiers=tiers)


async def put_context(engine: Engine, cid: str, seed: int) -> None:
    """A context of LMCache-named chunks (model@world@worker@hash@dtype) whose token ids and
    model card the daemon knows: what it needs to write a token-dropped variant in the form
    vLLM loads (engine/servable.py), as the plugin and the router give them in production."""
    layout = ChunkFormat((2, L, T, H * D), "bfloat16", H).layout()
    g = torch.Generator().manual_seed(seed)
    for i in range(CHUNKS):
        x = torch.randn(2, L, T, H * D, generator=g).to(torch.bfloat16)
        data = memoryview(x.view(torch.uint8).numpy().tobytes())
        chunk_hash = f"{cid.replace('@', '-')}-{i}"  # the model is what precedes 4 '@'
        meta = ObjectMeta(key=f"{MODEL}@1@0@{chunk_hash}@bfloat16", size_bytes=len(data),
                          context_id=cid, dtype="bfloat16", shape=tuple(x.shape), layout=layout,
                          token_count=T)  # fmt: skip
        await engine.put_bytes(meta, data)
    await engine.profiling.inputs.set_tokens(cid, [seed % 1000 + j for j in range(CHUNKS * T)])


def register_card(engine: Engine) -> None:
    card = ModelCard(MODEL, D, RopeSpec.standard(D).inv_freq, 32000, (0, 1, 2))
    engine.learn_card(ObjectMeta(key=model_card_key(MODEL), size_bytes=1), card.to_bytes())


async def through_executor(engine: Engine, ops: list[Operation]) -> float:
    t0 = time.perf_counter()
    for op in ops:
        engine.executor.submit(Plan((op,)))
    await engine.executor.idle()
    assert not engine.executor.failed, engine.executor.failed
    return time.perf_counter() - t0


def op(kind: OpKind, cid: str, source: Placement, target: Placement) -> Operation:
    return Operation(kind, cid, source, target, "benchmark")


async def direct_compress(engine: Engine, cid: str, variant: str) -> float:
    """The executor's compression work without the executor: read, decode, encode, store."""
    ctx = engine.contexts[cid]
    ssd, cpu = engine.tiers["ssd"], engine.tiers["cpu"]
    t0 = time.perf_counter()
    metas, payloads = await engine.mover.read_context_bytes(ctx)
    formats = chunk_formats(metas)
    kv = await asyncio.to_thread(decode_context, payloads, formats)
    form = engine.profiling.options.servable_form(ctx, variant) if "@" in variant else None
    encoded = await asyncio.to_thread(
        partial(encode_variant, cid, metas, kv, formats, variant, form=form)
    )
    objects = encoded.objects
    for meta, data in zip(metas, payloads, strict=True):  # the reference copy
        await ssd.put(_renamed(meta, "ref"), memoryview(data))
    for o in objects:
        await cpu.put(_renamed(o.meta, "enc"), memoryview(o.data))
    dt = time.perf_counter() - t0
    for meta in metas:
        await ssd.delete(_renamed(meta, "ref").key)
    for o in objects:
        await cpu.delete(_renamed(o.meta, "enc").key)
    return dt


def _aligned(n: int) -> memoryview:
    """Page-aligned memory with transparent huge pages, as the arena's blocks have (O_DIRECT
    into 4 KiB pages runs markedly slower here, docs/daemon.md)."""
    m = mmap.mmap(-1, n)
    advice = getattr(mmap, "MADV_HUGEPAGE", None)
    if advice is not None:
        m.madvise(advice)
    return memoryview(m)


def _renamed(meta: ObjectMeta, tag: str) -> ObjectMeta:

    return meta.replace(key=f"bench-{tag}/{meta.key}")


async def direct_copy(engine: Engine, cid: str, to_ssd: bool) -> float:
    """A demote/promote's bytes through the tier interface alone."""
    metas, payloads = await engine.mover.read_context_bytes(engine.contexts[cid])
    ssd = engine.tiers["ssd"]
    keys = [_renamed(m, "mv") for m in metas]
    bufs = [_aligned(len(p)) for p in payloads]
    for b, p in zip(bufs, payloads, strict=True):
        b[:] = p
    payloads = bufs
    if to_ssd:
        t0 = time.perf_counter()
        for m, p in zip(keys, payloads, strict=True):
            await ssd.put(m, p)
        dt = time.perf_counter() - t0
    else:
        for m, p in zip(keys, payloads, strict=True):
            await ssd.put(m, p)
        t0 = time.perf_counter()
        for m, b in zip(keys, bufs, strict=True):
            await ssd.read_into(m.key, b)
        for m in keys:  # a move deletes its source
            await ssd.delete(m.key)
        return time.perf_counter() - t0
    for m in keys:
        await ssd.delete(m.key)
    return dt


async def load_latencies(engine: Engine, key: str, seconds: float, busy: bool) -> list[float]:
    """Get + Release latencies for ``seconds`` (idle) or while the executor has plans (busy)."""
    out = []
    deadline = time.perf_counter() + seconds
    while engine.executor.pending > 0 if busy else time.perf_counter() < deadline:
        t0 = time.perf_counter()
        (lease,) = await engine.get([key])
        engine.release([lease.lease_id])
        out.append(time.perf_counter() - t0)
        await asyncio.sleep(0.002)
    return out


async def main(n: int) -> None:
    tmp = Path(tempfile.mkdtemp(prefix="kvtierd-bench-exec-"))
    engine = Engine(config(tmp))
    await engine.start()
    await engine.apply_policy(parse_policy("name: lru\nplacer: lru\n", "bench.yaml"))
    register_card(engine)
    rows = []
    try:
        cpu, ssd, orig = "cpu", "ssd", "none"
        for variant in ("int8", "knorm@0.5"):
            cids = [f"{variant}-{i}" for i in range(n)]
            for i, cid in enumerate(cids):
                await put_context(engine, cid, i)
            direct = statistics.median(
                [await direct_compress(engine, cid, variant) for cid in cids]
            )
            ops = [op(OpKind.COMPRESS, c, Placement(orig, cpu), Placement(variant, cpu))
                   for c in cids]  # fmt: skip
            dt = await through_executor(engine, ops) / n
            rows.append((f"compress to {variant}", direct / dt, dt, direct))
            await engine.delete([k for c in cids for k in list(engine.contexts[c].keys)])

        cids = [f"mv-{i}" for i in range(n)]
        for i, cid in enumerate(cids):
            await put_context(engine, cid, 100 + i)
        direct = statistics.median([await direct_copy(engine, c, True) for c in cids])
        ops = [op(OpKind.MOVE, c, Placement(orig, cpu), Placement(orig, ssd)) for c in cids]
        dt = await through_executor(engine, ops) / n
        rows.append(("demote cpu -> ssd", direct / dt, dt, direct))
        direct = statistics.median([await direct_copy(engine, c, False) for c in cids])
        ops = [op(OpKind.MOVE, c, Placement(orig, ssd), Placement(orig, cpu)) for c in cids]
        dt = await through_executor(engine, ops) / n
        rows.append(("promote ssd -> cpu", direct / dt, dt, direct))

        # The load path while the executor works.
        await put_context(engine, "hot", 999)
        hot = next(iter(engine.contexts["hot"].keys))
        idle = await load_latencies(engine, hot, 2.0, busy=False)
        work = [f"busy-{i}" for i in range(n)]
        for i, cid in enumerate(work):
            await put_context(engine, cid, 200 + i)
        for cid in work:
            engine.executor.submit(Plan((op(OpKind.COMPRESS, cid, Placement(orig, cpu),
                                            Placement("knorm@0.5", cpu)),)))  # fmt: skip
        busy = await load_latencies(engine, hot, 0.0, busy=True)
    finally:
        await engine.close()

    print(f"# bench_executor  {time.strftime('%Y-%m-%d')}  {machine()}  "
          f"{n} contexts x {CTX_BYTES >> 20} MiB")  # fmt: skip
    print(f"{'plan operation':24} {'direct/executor':>15} {'goal':>7}  verdict  s per context")
    for name, ratio, dt, direct in rows:
        print(
            f"{name:24} {ratio:15.3f} {'>= 0.80':>7}  {verdict(ratio, 0.8):7}  "
            f"{dt:.3f} (direct {direct:.3f}; {CTX_BYTES / dt / 1e9:.2f} GB/s in)"
        )
    p = {k: np.percentile(np.array(v) * 1e3, [50, 99, 100])
         for k, v in (("idle", idle), ("busy", busy))}  # fmt: skip
    print("Get+Release of an 8 MiB CPU-tier chunk, ms (p50 / p99 / max): idle "
          f"{p['idle'][0]:.3f} / {p['idle'][1]:.3f} / {p['idle'][2]:.2f}; while the executor "
          f"compresses {n} contexts {p['busy'][0]:.3f} / {p['busy'][1]:.3f} / "
          f"{p['busy'][2]:.2f} ({len(busy)} loads)")  # fmt: skip


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--contexts", type=int, default=6)
    asyncio.run(main(ap.parse_args().contexts))
