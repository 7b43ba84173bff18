"""Kernel throughput: achieved bytes/s vs a copy measured in the same run, and Triton vs torch.

    .venv/bin/python -m benchmarks.micro.bench_kernels                 # CUDA if present, else CPU
    .venv/bin/python -m benchmarks.micro.bench_kernels --tokens 8192 32768 --layers 32

On CUDA each kernel runs with ``backend="triton"`` and ``backend="torch"``; the report gives
the Triton kernel's bytes/s as a fraction of a device-to-device copy of the same KV (goal >= 60%
for the bandwidth-bound kernels) and its speedup over the torch reference (goal >= 3x). On CPU
(no Triton outside the interpreter) it reports the torch reference against a plain copy.
Bytes are the minimum a kernel must move (reads + writes), not what it happens to move.
Geometry defaults to Llama-3.1-8B: 8 KV heads, head_dim 128, 32 query heads, bf16.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass

import torch

from benchmarks._support.common import print_machine
from kvtierd.kernels.base import gather_kv, select_kept
from kvtierd.kernels.layout import KVSource
from kvtierd.kernels.quant import dequantize, quantize_kv
from kvtierd.kernels.registry import get_method
from kvtierd.kernels.rope import RopeSpec


@dataclass(frozen=True, slots=True)
class Row:
    kernel: str
    tokens: int
    backend: str
    time_s: float
    bytes_moved: int
    bytes_per_s: float
    vs_copy: float
    speedup_vs_torch: float


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize()


def timed(fn: Callable[[], object], device: torch.device, repeat: int) -> float:
    fn()  # warm-up (Triton compiles here)
    times = []
    for _ in range(repeat):
        _sync(device)
        t0 = time.perf_counter()
        fn()
        _sync(device)
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def copy_bytes_per_s(nbytes: int, device: torch.device, repeat: int) -> float:
    src = torch.empty(nbytes, dtype=torch.uint8, device=device).random_(0, 255)
    dst = torch.empty_like(src)
    t = timed(lambda: dst.copy_(src), device, repeat)
    return 2 * nbytes / t  # read + write


def run(tokens: int, layers: int, device: torch.device, repeat: int, copy_bw: float) -> list[Row]:
    h, d, hq, w, dtype = 8, 128, 32, 64, torch.bfloat16
    b = torch.finfo(dtype).bits // 8
    g = torch.Generator(device=device).manual_seed(0)
    k = torch.randn(layers, h, tokens, d, generator=g, device=device).to(dtype)
    v = torch.randn(layers, h, tokens, d, generator=g, device=device).to(dtype)
    q = torch.randn(layers, hq, w, d, generator=g, device=device).to(dtype)
    src = KVSource.from_contiguous(k, v)
    one = layers * h * tokens * d * b  # bytes of K (or V)
    scores_b = layers * h * tokens * 4
    m = tokens // 2
    kept = get_method("knorm").select(src, 0.5, backend="torch")
    scores = get_method("knorm").score(src, backend="torch")
    rope = RopeSpec.standard(d, theta=500000.0)
    qk = quantize_kv(k, v, 8, backend="torch")
    gathered = 2 * 2 * layers * h * m * d * b
    codes8 = 2 * one // b + qk[0].scale.nbytes * 2 + qk[1].scale.nbytes * 2
    cases: list[tuple[str, int, Callable[[str], object]]] = [
        ("score knorm", one + scores_b, lambda be: get_method("knorm").score(src, backend=be)),
        ("score keydiff", 2 * one + scores_b,
         lambda be: get_method("keydiff").score(src, backend=be)),
        ("score paged_eviction", 2 * one + scores_b,
         lambda be: get_method("paged_eviction").score(src, backend=be)),
        ("select top-k M=N/2", scores_b + layers * h * m * 4,
         lambda be: select_kept(scores, m, backend=be)),
        ("gather M=N/2", gathered, lambda be: gather_kv(src, kept, backend=be)),
        ("gather+rope M=N/2", gathered,
         lambda be: gather_kv(src, kept, rope=rope, delta=m - tokens, backend=be)),
        ("quantize int8 K+V", 2 * one + codes8, lambda be: quantize_kv(k, v, 8, backend=be)),
        ("quantize int4 K+V", 2 * one + codes8 // 2, lambda be: quantize_kv(k, v, 4, backend=be)),
        ("dequantize int8 K", one + codes8 // 2, lambda be: dequantize(qk[0], be)),
        ("score snapkv (W=64, compute)", one + scores_b,
         lambda be: get_method("snapkv").score(src, q, backend=be)),
    ]  # fmt: skip
    backends = ["triton", "torch"] if device.type == "cuda" else ["torch"]
    rows: list[Row] = []
    for name, nbytes, fn in cases:
        times = {be: timed(lambda be=be, fn=fn: fn(be), device, repeat) for be in backends}
        for be, t in times.items():
            bps = nbytes / t
            speed = times["torch"] / t
            rows.append(Row(name, tokens, be, t, nbytes, bps, bps / copy_bw, speed))
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--tokens", type=int, nargs="+", default=None)
    ap.add_argument("--layers", type=int, default=None)
    ap.add_argument("--repeat", type=int, default=5)
    ap.add_argument("--json", default="", help="also write the rows to this file")
    a = ap.parse_args()
    print_machine("bench_kernels")
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    tokens = a.tokens or ([8192, 32768] if device.type == "cuda" else [8192])
    layers = a.layers or (32 if device.type == "cuda" else 4)
    copy_bw = copy_bytes_per_s(2 * layers * 8 * max(tokens) * 128 * 2, device, a.repeat)
    name = torch.cuda.get_device_name() if device.type == "cuda" else "cpu"
    print(f"device {name}; layers {layers}; copy (read+write) {copy_bw / 1e9:.1f} GB/s")
    print(
        f"{'kernel':32} {'N':>6} {'backend':8} {'ms':>9} {'GB/s':>7} {'vs copy':>8} {'x torch':>8}"
    )
    rows: list[Row] = []
    for n in tokens:
        for r in run(n, layers, device, a.repeat, copy_bw):
            rows.append(r)
            print(
                f"{r.kernel:32} {r.tokens:6d} {r.backend:8} {r.time_s * 1e3:9.2f} "
                f"{r.bytes_per_s / 1e9:7.2f} {r.vs_copy:8.0%} {r.speedup_vs_torch:8.2f}"
            )
    if a.json:
        with open(a.json, "w") as f:
            json.dump(
                {"device": name, "copy_bytes_per_s": copy_bw, "rows": [asdict(r) for r in rows]},
                f,
                indent=1,
            )


if __name__ == "__main__":
    main()
