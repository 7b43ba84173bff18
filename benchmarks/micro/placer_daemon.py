"""The daemon's own rebalance path, timed in a real engine (issue 28), for ``bench_placer``.

A real :class:`~kvtierd.engine.Engine` (tiers started, index, context options, profiler,
placing) holds ``n`` contexts of 1-16 chunks of 256 tokens (a SmolLM2-like KV: 30 layers,
3 KV heads, head dim 64, bf16), each with a trusted profile of every variant of the grid and
a decayed access frequency. Tiers: the CPU arena at 5% of the bytes, an SSD at 30%, a second
SSD directory holding the rest. Timed: ``Placing.rebalance`` — from the call that starts a
rebalance (``AdminOps.rebalance`` calls it once the executor is idle) to the plan the
executor receives — first when every context's option row is built, then again after 1% of
the contexts were re-profiled and every frequency moved (the steady state: rows kept). The
phases of the second are timed apart: gathering the options, the placer, the reconcile.
Memory: the process's peak RSS and the bytes of the kept rows.
"""

from __future__ import annotations

import asyncio
import gc
import resource
import tempfile
import time
from dataclasses import dataclass, replace
from pathlib import Path

import numpy as np

from kvtierd.config import DaemonConfig, TierConfig
from kvtierd.engine import Engine
from kvtierd.engine.state import ObjectRecord
from kvtierd.kernels.chunk_codec import ChunkFormat
from kvtierd.kernels.placeholder import ModelCard
from kvtierd.kernels.rope import RopeSpec
from kvtierd.policies.loader import parse_policy
from kvtierd.profiler import Profiler
from kvtierd.profiler.store import ProfileRecord
from kvtierd.types import ContextProfile, ObjectMeta, VariantProfile

LAYERS, HEADS, HEAD_DIM, CHUNK_TOKENS = 30, 3, 64, 256
MODEL = "HuggingFaceTB/SmolLM2-135M-Instruct"
CHUNK_BYTES = 2 * LAYERS * CHUNK_TOKENS * HEADS * HEAD_DIM * 2

GRIDS = {
    "default grid (30 variants)": "configs/policies/evicpress.yaml",
    "60-variant grid": (
        "placer: evicpress\nvariants:\n  methods: [knorm, keydiff, int8, int4, knorm+int8]\n"
        "  ratios: [0.95, 0.9, 0.85, 0.8, 0.75, 0.7, 0.65, 0.6, 0.55, 0.5, 0.45, 0.4, 0.35,"
        " 0.3, 0.25, 0.2, 0.15, 0.1, 0.05]\n"
    ),
}
"""The grids measured: the shipped policy's, and one of 60 variants (the issue's check)."""


@dataclass(frozen=True, slots=True)
class DaemonRebalance:
    """Seconds of one engine's rebalances and what they held."""

    n: int
    n_variants: int
    first_s: float  # every option row built in it
    again_s: float  # rows kept; 1% re-profiled, frequencies moved
    again_cpu_s: float  # the same in CPU seconds of this process (other processes excluded)
    fresh_cpu_s: float  # CPU seconds of the phases below (every row fresh)
    gather_s: float  # of again_s: the options as arrays
    placer_s: float  # of again_s: EvicPressPlacer.rebalance_options
    reconcile_s: float  # of again_s: the plan for the executor
    operations: int
    rows_bytes: int
    peak_rss_bytes: int


def policy_text(grid: str) -> str:
    return Path(grid).read_text() if grid.endswith(".yaml") else grid


async def _engine(tmp: Path, n: int, total_bytes: int, grid: str) -> Engine:
    tiers = (
        TierConfig("cpu", "cpu", int(0.05 * total_bytes), options={"staging_bytes": "64MiB"}),
        TierConfig("ssd", "ssd", int(0.3 * total_bytes), str(tmp / "ssd")),
        TierConfig("disk", "ssd", 4 * total_bytes, str(tmp / "disk")),
    )
    config = DaemonConfig(socket_path=str(tmp / "s"), data_dir=str(tmp / "data"), tiers=tiers)
    engine = Engine(config)
    await engine.start()
    await engine.apply_policy(parse_policy(policy_text(grid), "bench.yaml"))
    return engine


def _fill(engine: Engine, chunks: np.ndarray, seed: int) -> None:
    """``len(chunks)`` contexts with their objects (spread over the tiers), trusted profiles
    of every grid variant and decayed frequencies (Zipf)."""
    rng = np.random.default_rng(seed)
    profiler = engine.profiling.profiler
    if profiler is None:
        raise RuntimeError("the engine's profiler is not configured")
    layout = ChunkFormat((2, LAYERS, CHUNK_TOKENS, HEADS * HEAD_DIM), "bfloat16", HEADS).layout()
    # Token-dropped variants are options only where they can be served: LMCache chunk keys of
    # a model whose card the plugin registered, and token ids agreed for the context.
    engine.model_cards[MODEL] = ModelCard(MODEL, HEAD_DIM, RopeSpec.standard(HEAD_DIM).inv_freq,
                                          49152, (0,))  # fmt: skip
    servable = engine.profiling.servable
    names = [v for v in engine.policy.variants if v != "none"]
    tier_names = list(engine.tiers)
    hits = rng.zipf(1.5, chunks.size).clip(max=1000)
    sens = rng.uniform(0.05, 0.9, chunks.size)
    min_queries = engine.policy.min_queries
    for i, k in enumerate(chunks.tolist()):
        cid = f"ctx{i}"
        tier = tier_names[int(rng.integers(0, len(tier_names)))]
        for c in range(k):
            meta = ObjectMeta(key=f"{MODEL}@1@0@{cid}h{c}@bfloat16", size_bytes=CHUNK_BYTES,
                              context_id=cid, layout=layout,
                              token_count=CHUNK_TOKENS)  # fmt: skip
            engine.index.add(ObjectRecord(meta, tier))
        servable.agree(cid, profiler.queries, range(k * CHUNK_TOKENS), prompt=False)
        _profile(profiler, cid, names, float(sens[i]), queries=min_queries,
                 tokens=k * CHUNK_TOKENS)  # fmt: skip
        profiler.record_access(cid, float(hits[i]))


def _profile(profiler: Profiler, cid: str, names: list[str], sens: float, *, queries: int,
             tokens: int) -> None:  # fmt: skip
    """A trusted profile: quality falls with the kept share, steeper for a sensitive context
    (sizes are the options' own: the profile's are not read by the placer)."""
    from kvtierd.variants import parse_variant

    variants = [VariantProfile("none", 0, 1.0)]
    for name in names:
        v = parse_variant(name)
        kept = v.ratio * (0.5 if v.quant == "int8" else 0.25 if v.quant == "int4" else 1.0)
        variants.append(VariantProfile(name, 0, 1.0 - sens * (1.0 - kept) ** 1.6))
    record = ProfileRecord(
        profile=ContextProfile(cid, tuple(variants), prefill_s=tokens / 5000.0),
        evaluator="attention", query_source="bench", num_queries=queries,
        num_tokens=tokens, profiled_at_s=time.time(),
    )  # fmt: skip
    # The profiler's records are what a profiling run leaves; the benchmark writes them
    # directly rather than running an evaluator on 100,000 contexts.
    profiler._records[cid] = record


def _reprofile(engine: Engine, share: float, seed: int) -> None:
    """``share`` of the contexts get a new profile (their rows go stale); every frequency
    moves (one more access on a tenth of the contexts; all decay with time)."""
    rng = np.random.default_rng(seed)
    profiler = engine.profiling.profiler
    assert profiler is not None
    ids = list(engine.index.contexts)
    for i in rng.choice(len(ids), max(1, int(share * len(ids))), replace=False).tolist():
        record = profiler.record(ids[i])
        assert record is not None
        profiler._records[ids[i]] = replace(record, profiled_at_s=time.time())
    for i in rng.choice(len(ids), max(1, len(ids) // 10), replace=False).tolist():
        profiler.record_access(ids[i])


async def measure(n: int, grid: str, seed: int = 0) -> DaemonRebalance:
    """One engine of ``n`` contexts under ``grid``: its first and second rebalance."""
    rng = np.random.default_rng(seed)
    chunks = rng.integers(1, 17, n)
    with tempfile.TemporaryDirectory(prefix="kvtierd-bench-placer-") as tmp:
        engine = await _engine(Path(tmp), n, int(chunks.sum()) * CHUNK_BYTES, grid)
        try:
            _fill(engine, chunks, seed)
            placing = engine.placing
            await engine.executor.idle()
            gc.collect()
            t0 = time.perf_counter()
            placing.rebalance()
            first = time.perf_counter() - t0
            _reprofile(engine, 0.01, seed + 1)
            gc.collect()
            t0, c0 = time.perf_counter(), time.process_time()
            plan = placing.rebalance()
            again, again_cpu = time.perf_counter() - t0, time.process_time() - c0
            # The same again, phase by phase (rows now fresh: what a third rebalance costs),
            # with the collector paused as Placing.rebalance pauses it.
            gc.disable()
            c0 = time.process_time()
            t0 = time.perf_counter()
            options = placing.placed_options()
            t1 = time.perf_counter()
            placing.placer.rebalance_options(options)
            t2 = time.perf_counter()
            placing.reconcile("rebalance")
            t3 = time.perf_counter()
            fresh_cpu = time.process_time() - c0
            gc.enable()
            rows_bytes = placing.rows.nbytes
            return DaemonRebalance(
                n=n, n_variants=len(engine.policy.variants), first_s=first, again_s=again,
                again_cpu_s=again_cpu, fresh_cpu_s=fresh_cpu,
                gather_s=t1 - t0, placer_s=t2 - t1, reconcile_s=t3 - t2,
                operations=len(plan.operations), rows_bytes=rows_bytes,
                peak_rss_bytes=resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
            )  # fmt: skip
        finally:
            await engine.close()


def growth_exponent(ns: list[int], seconds: list[float]) -> float:
    """Slope of log(seconds) against log(n): 1 is linear, ~1.1 is n log n at these sizes."""
    return float(np.polyfit(np.log(ns), np.log(seconds), 1)[0])


def run(ns: list[int], grids: list[str] | None = None) -> list[DaemonRebalance]:
    """Every grid (or those named) at every size, printed as rows; returns the measurements."""
    from kvtierd.server.main import tune_numpy

    out = []
    huge = tune_numpy()  # as the daemon runs (issue 28: numpy's huge-page advice cost ~0.6 s)
    print(f"\nnumpy huge-page advice: {'on' if huge else 'off'} (NUMPY_MADVISE_HUGEPAGE)")
    print("\ndaemon path: Placing.rebalance in a real engine (start of a rebalance -> the plan")
    print("the executor receives); 'again' = after 1% re-profiled and frequencies moved;")
    print("CPU = this process's CPU seconds (the machine is shared: wall time is inflated)")
    for label, grid in GRIDS.items():
        if grids is not None and label not in grids:
            continue
        rows = []
        for n in ns:
            r = asyncio.run(measure(n, grid))
            rows.append(r)
            print(
                f"  {label} n={n:6d}: first {r.first_s:7.3f} s, again {r.again_s:6.3f} s"
                f" ({r.again_cpu_s:.3f} s CPU); rows fresh {r.fresh_cpu_s:.3f} s CPU (wall: options"
                f" {r.gather_s:.3f}, placer {r.placer_s:.3f}, reconcile {r.reconcile_s:.3f});"
                f" {r.operations} operations;"
                f" rows {r.rows_bytes / 2**20:.0f} MiB, peak RSS {r.peak_rss_bytes / 2**20:.0f} MiB"
            )
        if len(ns) > 1:
            k = growth_exponent(ns, [r.again_cpu_s for r in rows])
            k_fresh = growth_exponent(ns, [r.fresh_cpu_s for r in rows])
            print(f"  {label}: growth exponent over n = {ns}: 'again' CPU {k:.2f},"
                  f" rows fresh CPU {k_fresh:.2f}")  # fmt: skip
        out += rows
    return out
