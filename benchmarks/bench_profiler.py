"""Profiling cost: variants profiled per second vs context length (EvicPress §6.3 overhead).

    .venv/bin/python benchmarks/bench_profiler.py [--quick]

``attention``: KV of 4 layers x 8 KV heads x 128 dims (32 query heads, 64 window probes), fp16
(cast to fp32 inside), the default policy grid minus snapkv (knorm, int8, knorm+int8 x 10 ratios
= 19 variants, ``none`` excluded). ``answer``: the tiny local Llama of the tests (2 layers,
2 KV heads x 16 dims), 8 variants, 2 queries, 8 new tokens each — its cost is dominated by
MiniLM and the decode loop, not the model, so it shows the evaluator's overhead. Attention is
also given as a ratio to one attention pass over the full KV (same process).
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
os.environ["HF_HUB_OFFLINE"] = "1"

from kvtierd.policy_config import expand_variants
from kvtierd.profiler import ContextKV, ProfilingQuery, make_evaluator
from tests.profiler.tiny_models import build_tiny_llama

VARIANTS = [v for v in expand_variants(("knorm", "int8", "knorm+int8"),
                                       (1.0, 0.9, 0.8, 0.7, 0.6, 0.5, 0.4, 0.3, 0.2, 0.1))
            if v != "none"]  # fmt: skip


def attention_row(n: int) -> None:
    g = torch.Generator().manual_seed(n)
    keys = torch.randn(4, 8, n, 128, generator=g).half()
    values = torch.randn(4, 8, n, 128, generator=g).half()
    probes = torch.randn(4, 32, 64, 128, generator=g).half()
    kv = ContextKV(keys=keys, values=values, window_queries=probes)
    ev = make_evaluator("attention")
    ev.evaluate(kv, VARIANTS[:1])  # warm-up
    t0 = time.perf_counter()
    ev.evaluate(kv, VARIANTS)
    dt = time.perf_counter() - t0
    q = probes.float().reshape(4, 8, 4 * 64, 128)
    t1 = time.perf_counter()
    torch.softmax(q @ keys.float().transpose(-1, -2) / 128**0.5, -1) @ values.float()
    base = time.perf_counter() - t1
    print(f"| attention | {n} | {len(VARIANTS)} | {dt:.3f} | {len(VARIANTS) / dt:.1f} | "
          f"{dt / len(VARIANTS) / base:.1f} |")  # fmt: skip


def answer_row(model_dir: Path, n: int) -> None:
    ev = make_evaluator("answer", {"model_path": str(model_dir), "max_new_tokens": 8})
    ids = list(torch.randint(1000, 20000, (n,), generator=torch.Generator().manual_seed(n)))
    kv = ev.encode_context([int(i) for i in ids])  # type: ignore[attr-defined]
    names = VARIANTS[:8]
    qs = [ProfilingQuery(text="What is this about?"), ProfilingQuery(text="Who is named?")]
    ev.evaluate(kv, names[:1], qs[:1])  # warm-up: loads the model and MiniLM
    t0 = time.perf_counter()
    ev.evaluate(kv, names, qs)
    dt = time.perf_counter() - t0
    print(f"| answer (tiny Llama, 2 queries) | {n} | {len(names)} | {dt:.3f} | "
          f"{len(names) / dt:.1f} | - |")  # fmt: skip


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true")
    args = ap.parse_args()
    torch.manual_seed(0)
    lengths = (512, 2048) if args.quick else (512, 2048, 8192)
    print("| evaluator | context tokens | variants | seconds | variants/s | "
          "x one full attention pass per variant |")  # fmt: skip
    print("|---|---|---|---|---|---|")
    for n in lengths:
        attention_row(n)
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = build_tiny_llama(Path(tmp) / "tiny")
        for n in (128, 512) if args.quick else (128, 512, 2048):
            answer_row(model_dir, n)


if __name__ == "__main__":
    main()
