"""Profiling cost: variants profiled per second vs context length (EvicPress §6.3 overhead).

    .venv/bin/python -m benchmarks.micro.bench_profiler [--quick]

``attention``: KV of 4 layers x 8 KV heads x 128 dims (32 query heads, 64 window probes), fp16
(cast to fp32 inside), the default policy grid (knorm, int8, knorm+int8 x 10 ratios
= 19 variants, ``none`` excluded). ``answer``: the tiny local Llama of the tests (2 layers,
2 KV heads x 16 dims), 8 variants, 2 queries, 8 new tokens each — its cost is dominated by
MiniLM and the decode loop, not the model, so it shows the evaluator's overhead. Attention is
also given as a ratio to one attention pass over the full KV (same process).

``--served`` (needs the vllm extra; run under ``flock /tmp/kvtierd-heavy.lock``): ``served``
against ``answer`` on one model — the vLLM tests' tiny Llama (2 layers, 2 KV heads x 64 dims,
bf16) served by a real daemon + ``vllm serve`` (CPU) + ``kvtierd router`` — 4 token-dropping
variants, 2 queries, 8 new tokens; seconds per variant and both evaluators' qualities.
"""

from __future__ import annotations

import argparse
import os
import tempfile
import time
from pathlib import Path

import torch

os.environ["HF_HUB_OFFLINE"] = "1"

from benchmarks._support.common import print_machine
from benchmarks._support.tiny_llama import build_tiny_llama
from kvtierd.profiler import ContextKV, ProfilingQuery, make_evaluator
from kvtierd.variants import expand_variants

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


SERVED_VARIANTS = ["knorm@0.5", "keydiff@0.5", "knorm@0.25", "streamingllm@0.25"]


def served_vs_answer(lengths: tuple[int, ...]) -> None:
    from benchmarks._support.servers import router_stack
    from benchmarks._support.tiny_vllm_model import build_tiny_llama as build_vllm_llama

    print("| context tokens | variants | served s/variant | answer s/variant | served / answer | "
          "quality served | quality answer |")  # fmt: skip
    print("|---|---|---|---|---|---|---|")
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        model = build_vllm_llama(work / "model")
        with router_stack(work, model) as stack:
            served = make_evaluator("served", {"router_url": stack["router"],
                                               "daemon_socket": stack["socket"],
                                               "max_new_tokens": 8})  # fmt: skip
            answer = make_evaluator("answer", {"model_path": str(model), "max_new_tokens": 8})
            qs = [ProfilingQuery(token_ids=(500, 600, 700)), ProfilingQuery(token_ids=(9, 99))]
            for n in lengths:
                g = torch.Generator().manual_seed(n)
                ids = [int(i) for i in torch.randint(3, 1024, (n,), generator=g)]
                kv = answer.encode_context(ids)  # type: ignore[attr-defined]
                answer.evaluate(kv, SERVED_VARIANTS[:1], qs[:1])  # warm-up (model, MiniLM)
                served.evaluate(kv, SERVED_VARIANTS[:1], qs[:1])
                t0 = time.perf_counter()
                qa = answer.evaluate(kv, SERVED_VARIANTS, qs)
                ta = (time.perf_counter() - t0) / len(SERVED_VARIANTS)
                t0 = time.perf_counter()
                qe = served.evaluate(kv, SERVED_VARIANTS, qs)
                te = (time.perf_counter() - t0) / len(SERVED_VARIANTS)
                fmt = " ".join(f"{qe[v]:.3f}" for v in SERVED_VARIANTS)
                fma = " ".join(f"{qa[v]:.3f}" for v in SERVED_VARIANTS)
                print(f"| {n} | {len(SERVED_VARIANTS)} | {te:.3f} | {ta:.3f} | {te / ta:.1f} | "
                      f"{fmt} | {fma} |")  # fmt: skip


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--served", action="store_true", help="served vs answer (real vLLM)")
    args = ap.parse_args()
    print_machine("bench_profiler")
    torch.manual_seed(0)
    if args.served:
        served_vs_answer((256, 1024) if args.quick else (256, 1024, 1792))
        return
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
