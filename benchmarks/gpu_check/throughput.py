"""Step ``throughput``: each Triton kernel's bytes/s as a fraction of this device's own
device-to-device copy, measured in the same run (32 layers, 8 KV heads, head_dim 128, bf16,
8192 and 32768 tokens). Goal: >= 60 % for the score (knorm, keydiff, paged_eviction), gather
and quantize kernels; top-k compaction, dequantize and snapkv (compute-bound) are reported
without a goal.

Bytes are the minimum a kernel must move, reads plus writes (benchmarks/bench_kernels.py's
accounting); the copy counts its read and its write. Times are the median of CUDA-event-timed
repeats after a warm-up that compiles.
"""

from __future__ import annotations

import os

os.environ.setdefault("TRITON_INTERPRET", "0")

import statistics
from collections.abc import Callable

import torch

from benchmarks.gpu_check.record import Recorder, step_args
from kvtierd.kernels.base import gather_kv, select_kept
from kvtierd.kernels.layout import KVSource
from kvtierd.kernels.quant import dequantize, quantize_kv
from kvtierd.kernels.registry import get_method
from kvtierd.kernels.rope import RopeSpec

GOAL = 0.60
HEADS, DIM, QUERY_HEADS, WINDOW = 8, 128, 32, 64


def median_s(fn: Callable[[], object], repeat: int) -> float:
    fn()  # warm-up: Triton compiles here
    if not torch.cuda.is_available():
        import time

        times = []
        for _ in range(repeat):
            t0 = time.perf_counter()
            fn()
            times.append(time.perf_counter() - t0)
        return statistics.median(times)
    torch.cuda.synchronize()
    times = []
    for _ in range(repeat):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / 1e3)
    return statistics.median(times)


def copy_bytes_per_s(nbytes: int, repeat: int) -> float:
    dev = "cuda" if torch.cuda.is_available() else "cpu"
    src = torch.empty(nbytes, dtype=torch.uint8, device=dev).random_(0, 255)
    dst = torch.empty_like(src)
    return 2 * nbytes / median_s(lambda: dst.copy_(src), repeat)


def cases(layers: int, tokens: int) -> list[tuple[str, bool, int, Callable[[], object]]]:
    """``(kernel, held to the goal, bytes moved, call)`` at one geometry."""
    dev = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    dtype, b = torch.bfloat16, 2
    g = torch.Generator(device=dev).manual_seed(0)
    shape = (layers, HEADS, tokens, DIM)
    k = torch.randn(shape, generator=g, device=dev).to(dtype)
    v = torch.randn(shape, generator=g, device=dev).to(dtype)
    q = torch.randn(layers, QUERY_HEADS, WINDOW, DIM, generator=g, device=dev).to(dtype)
    src = KVSource.from_contiguous(k, v)
    one = k.numel() * b  # bytes of K (or V)
    scores_b = layers * HEADS * tokens * 4
    m = tokens // 2
    scores = get_method("knorm").score(src, backend="torch")
    kept = select_kept(scores, m, backend="torch")
    rope = RopeSpec.standard(DIM, theta=500000.0)
    qk, qv = quantize_kv(k, v, 8, backend="torch")
    params = sum(t.nbytes for t in (qk.scale, qk.zero, qv.scale, qv.zero))
    gathered = 2 * 2 * layers * HEADS * m * DIM * b
    return [
        (
            "score knorm",
            True,
            one + scores_b,
            lambda: get_method("knorm").score(src, backend="triton"),
        ),
        (
            "score keydiff",
            True,
            2 * one + scores_b,
            lambda: get_method("keydiff").score(src, backend="triton"),
        ),
        (
            "score paged_eviction",
            True,
            2 * one + scores_b,
            lambda: get_method("paged_eviction").score(src, backend="triton"),
        ),
        ("gather M=N/2", True, gathered, lambda: gather_kv(src, kept, backend="triton")),
        (
            "gather+rope M=N/2",
            True,
            gathered,
            lambda: gather_kv(src, kept, rope=rope, delta=m - tokens, backend="triton"),
        ),
        (
            "quantize int8 K+V",
            True,
            2 * one + one + params,
            lambda: quantize_kv(k, v, 8, backend="triton"),
        ),
        (
            "quantize int4 K+V",
            True,
            2 * one + one // 2 + params,
            lambda: quantize_kv(k, v, 4, backend="triton"),
        ),
        (
            "dequantize int8 K",
            False,
            one // 2 + qk.scale.nbytes * 2 + one,
            lambda: dequantize(qk, "triton"),
        ),
        (
            "select top-k M=N/2",
            False,
            scores_b + layers * HEADS * m * 4,
            lambda: select_kept(scores, m, backend="triton"),
        ),
        (
            "score snapkv W=64",
            False,
            one + scores_b,
            lambda: get_method("snapkv").score(src, q, backend="triton"),
        ),
    ]


def main() -> None:
    args = step_args(__doc__.split("\n\n")[0])
    rec = Recorder(args.result)
    layers, token_counts, repeat = (2, [256], 2) if args.quick else (32, [8192, 32768], 10)
    copy_n = 2 * layers * HEADS * max(token_counts) * DIM * 2  # K+V at the largest size
    copy_bw = copy_bytes_per_s(copy_n, repeat)
    rec.figures["copy_bytes_per_s"] = copy_bw
    rec.figures["rows"] = []
    print(f"  device-to-device copy: {copy_bw / 1e9:.0f} GB/s (read + write, {copy_n >> 20} MiB)")
    for tokens in token_counts:
        for name, held, nbytes, fn in cases(layers, tokens):

            def one(
                name=name, held=held, nbytes=nbytes, fn=fn, tokens=tokens
            ) -> tuple[bool, str, str]:
                t = median_s(fn, repeat if held else min(repeat, 3))
                ratio = nbytes / t / copy_bw
                rows = rec.figures["rows"]
                assert isinstance(rows, list)
                rows.append(
                    {
                        "kernel": name,
                        "tokens": tokens,
                        "time_s": t,
                        "bytes": nbytes,
                        "bytes_per_s": nbytes / t,
                        "vs_copy": ratio,
                    }
                )
                figure = f"{t * 1e3:.3f} ms, {nbytes / t / 1e9:.0f} GB/s = {ratio:.0%} of copy"
                goal = f"goal >= {GOAL:.0%}" if held else "no goal (reported)"
                return (ratio >= GOAL or not held), figure, goal

            rec.run(f"N={tokens} {name}", one)
        if torch.cuda.is_available():
            torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
