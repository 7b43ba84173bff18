"""Step ``throughput``: each Triton kernel's bytes/s as a fraction of this device's own
device-to-device copy, measured in the same run (32 layers, 8 KV heads, head_dim 128, bf16,
8192 and 32768 tokens). Goal: >= 80 % at the largest size (32768 tokens) for the score
(knorm, keydiff, paged_eviction), gather and quantize kernels; the smaller size, where a call's
host time is a visible share, is reported without a goal, as are top-k compaction, dequantize
and snapkv (compute-bound).

Bytes are the minimum a kernel must move, reads plus writes (benchmarks/micro/bench_kernels.py's
accounting); the copy counts its read and its write. Each row prints the bytes it counts and of
what (``counts``), so a figure can be checked against the kernel. Times are the median of
CUDA-event-timed repeats after a warm-up that compiles.

snapkv is held to no bandwidth goal: its cost is a ``W x N`` attention per layer and query head
(the window's softmax statistics, then its probabilities: ``2 * 2 * L * Hq * W * N * D`` flops),
so besides its bytes (K, the queries and the scores, each once) its row gives the flop rate
(``TFLOP/s``) that this card's float32-accumulating tensor cores bound.
"""

from __future__ import annotations

import os

os.environ.setdefault("TRITON_INTERPRET", "0")

import statistics
from collections.abc import Callable
from typing import NamedTuple

import torch

from benchmarks.gpu.record import Recorder, step_args
from kvtierd.kernels.base import gather_kv, select_kept
from kvtierd.kernels.layout import KVSource
from kvtierd.kernels.quant import dequantize, quantize_kv
from kvtierd.kernels.registry import get_method
from kvtierd.kernels.rope import RopeSpec

GOAL = 0.80  # of the copy bandwidth, at the largest token count
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


class Case(NamedTuple):
    kernel: str
    held: bool  # to the goal
    nbytes: int  # moved, reads + writes
    counts: str  # what nbytes is made of
    call: Callable[[], object]
    flops: int = 0  # for compute-bound kernels (snapkv)


def _mib(n: int) -> str:
    mib = n / (1 << 20)
    return f"{mib:.0f} MiB" if mib >= 100 else f"{mib:.3g} MiB"


def cases(layers: int, tokens: int) -> list[Case]:
    """Every kernel's case at one geometry."""
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
    q_b = q.numel() * b
    k_, s_, g_ = _mib(one), _mib(scores_b), _mib(gathered // 2)
    p_, m_ = _mib(params), _mib(layers * HEADS * m * 4)
    snap_flops = 2 * 2 * layers * QUERY_HEADS * WINDOW * tokens * DIM
    return [
        Case(
            "score knorm", True, one + scores_b, f"K {k_} + scores {s_}",
            lambda: get_method("knorm").score(src, backend="triton"),
        ),
        Case(
            "score keydiff", True, 2 * one + scores_b, f"K twice {k_} + scores {s_}",
            lambda: get_method("keydiff").score(src, backend="triton"),
        ),
        Case(
            "score paged_eviction", True, 2 * one + scores_b, f"K {k_} + V {k_} + scores {s_}",
            lambda: get_method("paged_eviction").score(src, backend="triton"),
        ),
        Case(
            "gather M=N/2", True, gathered, f"K+V rows read {g_} + written {g_}",
            lambda: gather_kv(src, kept, backend="triton"),
        ),
        Case(
            "gather+rope M=N/2", True, gathered, f"K+V rows read {g_} + written {g_}",
            lambda: gather_kv(src, kept, rope=rope, delta=m - tokens, backend="triton"),
        ),
        Case(
            "quantize int8 K+V", True, 2 * one + one + params,
            f"K+V read {_mib(2 * one)} + codes {k_} + scales/zeros {p_}",
            lambda: quantize_kv(k, v, 8, backend="triton"),
        ),
        Case(
            "quantize int4 K+V", True, 2 * one + one // 2 + params,
            f"K+V read {_mib(2 * one)} + codes {_mib(one // 2)} + scales/zeros {p_}",
            lambda: quantize_kv(k, v, 4, backend="triton"),
        ),
        Case(
            "dequantize int8 K", False, one // 2 + qk.scale.nbytes * 2 + one,
            f"codes {_mib(one // 2)} + scales/zeros {_mib(qk.scale.nbytes * 2)} + K {k_}",
            lambda: dequantize(qk, "triton"),
        ),
        Case(
            "select top-k M=N/2", False, scores_b + layers * HEADS * m * 4,
            f"scores {s_} + kept {m_}",
            lambda: select_kept(scores, m, backend="triton"),
        ),
        Case(
            "score snapkv W=64", False, one + q_b + scores_b,
            f"K {k_} + queries {_mib(q_b)} + scores {s_}; {snap_flops / 1e12:.2f} TFLOP",
            lambda: get_method("snapkv").score(src, q, backend="triton"),
            flops=snap_flops,
        ),
    ]  # fmt: skip


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
        for case in cases(layers, tokens):

            def one(case: Case = case, tokens: int = tokens) -> tuple[bool, str, str]:
                t = median_s(case.call, repeat if case.held else min(repeat, 3))
                ratio = case.nbytes / t / copy_bw
                rows = rec.figures["rows"]
                assert isinstance(rows, list)
                rows.append(
                    {
                        "kernel": case.kernel,
                        "tokens": tokens,
                        "time_s": t,
                        "bytes": case.nbytes,
                        "counts": case.counts,
                        "bytes_per_s": case.nbytes / t,
                        "vs_copy": ratio,
                        "flops_per_s": case.flops / t,
                    }
                )
                figure = (
                    f"{t * 1e3:.3f} ms, {case.nbytes / t / 1e9:.0f} GB/s = {ratio:.0%} of copy "
                    f"({case.counts})"
                )
                if case.flops:
                    figure += f", {case.flops / t / 1e12:.1f} TFLOP/s"
                held = case.held and tokens == max(token_counts)
                goal = f"goal >= {GOAL:.0%}" if held else "no goal (reported)"
                return (ratio >= GOAL or not held), figure, goal

            rec.run(f"N={tokens} {case.kernel}", one)
        if torch.cuda.is_available():
            torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
