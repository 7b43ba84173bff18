"""The daemon's profile on the real model beside the quality benchmark's accuracy (issue 12.6).

    flock /tmp/kvtierd-heavy.lock .venv/bin/python -m benchmarks.quality.bench_profile_quality
    .venv/bin/python -m benchmarks.quality.bench_profile_quality --tasks niah_single --per 1
    .venv/bin/python -m benchmarks.quality.bench_profile_quality --served   # + the served evaluator

For cases of the quality benchmark (``quality_tasks.py``), SmolLM2-135M-Instruct
(``kvtierd model fetch``) prefills the context and its KV is put into a daemon engine
(in-process, real CPU and SSD tiers) as LMCache ``KV_2LTD`` chunks of 16 tokens, as the plugin
puts them. Every question of the case then takes the path a routed prompt takes: its prompt is
registered and linked to the context (``note_prompt`` + ``link_prompt``: the daemon learns the
context's tokens and keeps the tokens past the context — document tail, question, chat
template — as a real-traffic query). The daemon then profiles the context as Admin ``Profile``
does (``profile_context``), with the policy's ``answer`` evaluator on the same model: its
profile score per variant is the mean MiniLM similarity of the variant's answers to the full
KV's, over the case's questions. Beside it, ``bench_quality.run_case`` scores the same cases and
questions in-process (accuracy: the answer holds the planted facts; its own similarity).

With ``--served`` the same cases are also scored by the ``served`` evaluator — the same metric
with vLLM's answers, each variant stored through ``kvtierd stack``'s router (vLLM-CPU + LMCache +
daemon, chunks of 16 tokens) and served from it — as the daemon's profiler calls it.

The check: for every pair of variants whose benchmark accuracy differs by at least
``--gap`` (on all cases together), does the daemon's profile order them the same way? Printed
as ``agreed / pairs``; pairs within the gap are accuracy noise and not counted.
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import json
import time
from collections import defaultdict
from collections.abc import Sequence
from dataclasses import replace
from pathlib import Path
from typing import Any

from benchmarks._support.common import REPO, machine
from benchmarks.quality.quality_tasks import TASKS, Case, make_cases, split_prompt

CHUNK = 16  # LMCache's chunk_size in the serving stack
VARIANTS = ("knorm@0.5", "keydiff@0.5", "streamingllm@0.5",
            "knorm@0.25", "keydiff@0.25", "streamingllm@0.25")  # fmt: skip
POLICY = """\
name: profile-quality
placer: evicpress
variants:
  methods: [{methods}]
  ratios: [{ratios}]
profiling:
  evaluator: answer
  model_dir: {model}
  min_queries: 1
"""


def policy_text(model: Path, variants: Sequence[str]) -> str:
    """An EvicPress policy whose grid is ``variants`` (methods x ratios: give a full grid)."""
    from kvtierd.variants import parse_variant

    parsed = [parse_variant(v) for v in variants]
    methods = dict.fromkeys(v.drop_method for v in parsed)
    ratios = dict.fromkeys(f"{v.ratio:g}" for v in parsed)
    grid = {f"{m}@{r}" for m in methods for r in ratios}
    if grid != set(variants):
        raise ValueError(f"variants must be a methods x ratios grid, got {sorted(variants)}")
    return POLICY.format(methods=", ".join(methods), ratios=", ".join(ratios), model=model)


async def start_engine(directory: Path, model: Path, variants: Sequence[str]) -> Any:
    """A daemon engine with a 1 GiB CPU tier and an unbounded SSD tier, profiling with
    ``answer`` on ``model``. Only explicit profiles run (``settle_s``: never on its own), so
    each context is profiled once, on the questions linked to it."""
    from kvtierd.config import DaemonConfig, TierConfig
    from kvtierd.engine import Engine
    from kvtierd.policies.loader import parse_policy

    tiers = (TierConfig("cpu", "cpu", 1 << 30), TierConfig("ssd", "ssd", 0, str(directory / "ssd")))
    config = DaemonConfig(socket_path=str(directory / "s"), data_dir=str(directory / "data"),
                          tiers=tiers)  # fmt: skip
    engine = Engine(config)
    await engine.start()
    engine.profiling.settle_s = float("inf")
    await engine.apply_policy(parse_policy(policy_text(model, variants), "profile-quality.yaml"))
    return engine


async def put_context(engine: Any, context_id: str, keys: Any, values: Any) -> None:
    """``[L, H, N, D]`` KV put as the LMCache plugin puts it: bf16 ``KV_2LTD`` chunks of
    :data:`CHUNK` tokens, one object each."""
    import torch

    from kvtierd.kernels.api import to_kv_2ltd
    from kvtierd.kernels.chunk_codec import ChunkFormat
    from kvtierd.types import ObjectMeta

    kv = to_kv_2ltd(keys, values).to(torch.bfloat16)
    heads = int(keys.shape[1])
    for i in range(0, kv.shape[2], CHUNK):
        x = kv[:, :, i : i + CHUNK].contiguous()
        two, layers, tokens, width = (int(s) for s in x.shape)
        shape = (two, layers, tokens, width)
        data = memoryview(x.view(torch.uint8).numpy().tobytes())
        meta = ObjectMeta(key=f"{context_id}/{i // CHUNK}", size_bytes=len(data),
                          context_id=context_id, dtype="bfloat16", shape=shape,
                          layout=ChunkFormat(shape, "bfloat16", heads).layout(),
                          token_count=tokens)  # fmt: skip
        await engine.put_bytes(meta, data)
    await engine.executor.idle()


async def profile_case(engine: Any, evaluator: Any, tokenizer: Any, case: Case) -> dict[str, float]:
    """The daemon's profile of ``case`` (module docstring): quality per variant."""
    split = split_prompt(tokenizer, case)
    kv = evaluator.encode_context(split.context)
    await put_context(engine, case.name, kv.keys, kv.values)
    for i, (question, _) in enumerate(case.questions):
        prompt = split_prompt(tokenizer, case, question=question)
        if prompt.context != split.context:
            raise ValueError(f"{case.name}: question {i} changes the context")
        request = f"{case.name}#{i}"
        engine.profiling.inputs.note_prompt("", request, prompt.ids)
        await engine.profiling.inputs.link_prompt(case.name, request)
    if not await engine.profiling.profile_context(engine.contexts[case.name]):
        raise RuntimeError(f"{case.name}: profiling failed: {engine.profiling.last_error}")
    record = engine.profiling.record(case.name)
    if record.num_queries != len(case.questions) or record.query_source != "traffic":
        raise RuntimeError(f"{case.name}: profiled on {record.num_queries} {record.query_source}")
    return {v.variant: v.quality for v in record.profile.variants}


def benchmark_case(evaluator: Any, tokenizer: Any, case: Case, variants: list[str]) -> list[Any]:
    """``bench_quality.run_case`` on every question of ``case`` (one row per question)."""
    from benchmarks.quality.bench_quality import run_case

    return [run_case(evaluator, tokenizer, replace(case, question=q, answers=a), variants)
            for q, a in case.questions]  # fmt: skip


def served_scores(
    out: Path, model: Path, tokenizer: Any, cases: list[Case], variants: Sequence[str]
) -> dict[str, dict[str, float]]:
    """The ``served`` evaluator's quality per case and variant, on the case's questions,
    through a ``kvtierd stack`` on ``model``."""
    import torch

    from benchmarks._support.daemon_proc import write_config
    from kvtierd.integrations.served_eval import ServedEvaluator
    from kvtierd.integrations.stack import Stack, StackConfig
    from kvtierd.profiler import ContextKV, ProfilingQuery

    work = out / "stack"
    config = StackConfig(
        model=model, work_dir=work, chunk_size=CHUNK, max_model_len=8192, kv_cache_gib=2,
        daemon_config=write_config(work / "daemon", cpu="8GiB", ssd="16GiB"),
        vllm_port=0, router_port=0, prefix_caching=False,
    )  # fmt: skip
    scores = {}
    with Stack(config) as stack:
        evaluator = ServedEvaluator(stack.router_url, vllm_url=stack.vllm_url,
                                    daemon_socket=stack.socket_path, max_concurrency=2,
                                    timeout_s=900)  # fmt: skip
        for case in cases:
            split = split_prompt(tokenizer, case)
            empty = torch.zeros(1, 1, split.context_tokens, 1)  # the KV is not read
            kv = ContextKV(keys=empty, values=empty, token_ids=tuple(split.context))
            prompts = [split_prompt(tokenizer, case, question=q) for q, _ in case.questions]
            queries = [ProfilingQuery(token_ids=tuple(p.query)) for p in prompts]
            result = evaluator.evaluate(kv, list(variants), queries)
            scores[case.name] = dict(result.quality)
            print(
                f"served {case.name}: {result.elapsed_s:.0f} s, "
                + ", ".join(f"{v} {q:.3f}" for v, q in result.quality.items()),
                flush=True,
            )
    return scores


def agreement(
    accuracy: dict[str, float], profile: dict[str, float], gap: float
) -> tuple[int, int, list[str]]:
    """Pairs of variants whose accuracy differs by ``gap`` or more, how many the profile orders
    the same way, and the pairs it orders otherwise."""
    agreed, pairs, wrong = 0, 0, []
    for a, b in itertools.combinations(accuracy, 2):
        if abs(accuracy[a] - accuracy[b]) < gap:
            continue
        pairs += 1
        hi, lo = (a, b) if accuracy[a] > accuracy[b] else (b, a)
        if profile[hi] > profile[lo]:
            agreed += 1
        else:
            wrong.append(f"{hi} > {lo}")
    return agreed, pairs, wrong


SCORES = {"profile": "daemon profile (answer)", "served": "served evaluator"}


def table(rows: list[dict[str, Any]], variants: list[str], gap: float) -> str:
    """Markdown: per variant, the benchmark's accuracy and similarity and the daemon's scores
    (:data:`SCORES` the rows have; means over cases and questions), per task and overall; then
    the ordering check for each score."""
    scores = [k for k in SCORES if all(k in r for r in rows)]
    means: dict[tuple[str, str, str], list[float]] = defaultdict(list)
    for row in rows:
        for task, v in itertools.product((row["task"], "all"), variants):
            for key in scores:
                means[(key, task, v)].append(row[key][v])
            for q in row["bench"]:
                for key in ("accuracy", "similarity"):
                    means[(key, task, v)].append(q["results"][v][key])
    columns = ["accuracy", "similarity", *scores]
    tasks = [t for t in TASKS if any(r["task"] == t for r in rows)] + ["all"]
    names = ["accuracy (bench)", "similarity (bench)", *(SCORES[k] for k in scores)]
    lines = ["| task | variant | " + " | ".join(names) + " |", "|---" * (len(names) + 2) + "|"]
    mean = {k: sum(x) / len(x) for k, x in means.items()}
    for task, v in itertools.product(tasks, variants):
        cells = [f"{mean[(c, task, v)]:.{2 if c == 'accuracy' else 3}f}" for c in columns]
        lines.append(f"| {task} | {v} | " + " | ".join(cells) + " |")
    accuracy = {v: mean[("accuracy", "all", v)] for v in variants}
    for key in scores:
        agreed, pairs, wrong = agreement(accuracy, {v: mean[(key, "all", v)] for v in variants},
                                         gap)  # fmt: skip
        lines.append(f"\nOrdering: the {SCORES[key]} orders {agreed} of {pairs} variant pairs "
                     f"whose benchmark accuracy differs by >= {gap} as the benchmark does"
                     + (f"; not: {', '.join(wrong)}" if wrong else "") + ".")  # fmt: skip
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--length", type=int, default=1024)
    parser.add_argument("--tasks", nargs="+", default=list(TASKS), choices=TASKS)
    parser.add_argument("--per", type=int, default=2, help="cases per task")
    parser.add_argument("--variants", nargs="+", default=list(VARIANTS))
    parser.add_argument("--gap", type=float, default=0.25, help="accuracy gap that counts")
    parser.add_argument("--out", type=Path, default=REPO / "benchmarks/out/profile_quality")
    parser.add_argument(
        "--served", action="store_true",
        help="add the served evaluator's scores to the rows of an earlier run in --out",
    )  # fmt: skip
    args = parser.parse_args()
    if args.served:
        add_served(args)
    else:
        asyncio.run(run(args))


def add_served(args: argparse.Namespace) -> None:
    from transformers import AutoTokenizer

    from kvtierd.model_fetch import fetch_model

    path = args.out / "rows.jsonl"
    rows = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    model = fetch_model(log=print)
    tokenizer = AutoTokenizer.from_pretrained(model)
    by_name = {c.name: c for c in make_cases(tokenizer, args.tasks, [args.length], args.per)}
    cases = [by_name[r["case"]] for r in rows]
    scores = served_scores(args.out, model, tokenizer, cases, args.variants)
    for row in rows:
        row["served"] = scores[row["case"]]
    finish(args, rows)


def finish(args: argparse.Namespace, rows: list[dict[str, Any]]) -> None:
    (args.out / "rows.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    text = table(rows, args.variants, args.gap)
    (args.out / "summary.md").write_text(text)
    print(text)


async def run(args: argparse.Namespace) -> None:
    import torch
    from transformers import AutoTokenizer

    from kvtierd.model_fetch import fetch_model
    from kvtierd.profiler.answer import AnswerEvaluator

    torch.manual_seed(0)
    model = fetch_model(log=print)
    tokenizer = AutoTokenizer.from_pretrained(model)
    bench = AnswerEvaluator(str(model), max_new_tokens=28, max_batch=16)  # as bench_quality ran
    args.out.mkdir(parents=True, exist_ok=True)
    cases = make_cases(tokenizer, args.tasks, [args.length], args.per)
    print(f"{len(cases)} cases x {len(args.variants)} variants on {machine()}", flush=True)
    engine = await start_engine(args.out / "daemon", model, args.variants)
    rows = []
    try:
        for case in cases:
            t0 = time.perf_counter()
            answer = engine.profiling.profiler.evaluator_for(True)  # the refiner (issue 26)
            profile = await profile_case(engine, answer, tokenizer, case)
            t1 = time.perf_counter()
            bench_rows = benchmark_case(bench, tokenizer, case, args.variants)
            rows.append({"case": case.name, "task": case.task, "profile": profile,
                         "bench": bench_rows, "profile_s": t1 - t0,
                         "bench_s": time.perf_counter() - t1})  # fmt: skip
            accs = [sum(q["results"][v]["accuracy"] for q in bench_rows) for v in args.variants]
            print(f"{case.name}: {len(case.questions)} questions, profile {t1 - t0:.0f} s; "
                  + ", ".join(f"{v} {profile[v]:.3f}/{a:.0f}" for v, a in
                              zip(args.variants, accs, strict=True)), flush=True)  # fmt: skip
    finally:
        await engine.close()
    finish(args, rows)


if __name__ == "__main__":
    main()
