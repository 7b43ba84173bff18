"""Labels to judge quality estimators by (issue 26, item 1).

    .venv/bin/python -m benchmarks.quality.quality_labels          # label (resumable), then table
    .venv/bin/python -m benchmarks.quality.quality_labels --table  # the table of what is there

For RULER-style cases of the quality benchmark (``quality_tasks.py``) at 1-2k tokens, the real
model (SmolLM2-135M-Instruct) answers the case's question over its full KV and over every
variant of the grid the default policy uses (``configs/policies/evicpress.yaml``: its methods at
its ratios, kept counts in whole 16-token chunks as the daemon stores them) plus
``streamingllm`` at a few ratios, a known-bad control. Two labels per case and variant:

* ``accuracy``: the share of the planted facts the answer holds (RULER, ``quality_tasks.accuracy``);
* ``exact``: 1 when the greedy answer is token-identical to the full KV's over its first
  ``MAX_NEW_TOKENS`` tokens (both cut at EOS), else 0.

Only cases the full KV answers correctly (accuracy 1.0) are labelled; the others are recorded as
such (so a resumed run skips them) and left out of every table. Per case, the fewest forward
passes: one prefill of the context, one decode of the full KV's answer (the filter), then the
variants compressed by the kernels and decoded in batches (``AnswerEvaluator.answer_ids``).

The data file (``benchmarks/data/quality_labels.jsonl``, one JSON line per case, appended as each
case finishes, so a kill loses at most one case) holds what regenerates the case exactly — task,
length, seed (``quality_tasks.make_case``), the prompt's token count, context length and a
SHA-256 of its token ids (:func:`check_split` compares them) — and per variant the two labels,
plus the answer text where it differs from the full KV's (the ``answer`` evaluator's MiniLM
score of the case's own question is then computable without decoding again).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import math
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from benchmarks._support.common import REPO, machine, read_jsonl
from benchmarks.quality.quality_tasks import (
    TASKS,
    Case,
    PromptSplit,
    accuracy,
    make_case,
    split_prompt,
)

LABELS = REPO / "benchmarks/data/quality_labels.jsonl"
POLICY = REPO / "configs/policies/evicpress.yaml"
CONTROLS = ("streamingllm@0.5", "streamingllm@0.25", "streamingllm@0.1")
MAX_NEW_TOKENS = 16
CHUNK = 16  # LMCache's chunk size: kept counts in whole chunks, as the daemon stores variants
WINDOW = 64  # window queries captured at prefill (the `attention` evaluator's probes)


def policy_grid(ratios: Sequence[float] | None = None) -> list[str]:
    """The default policy's variants (``none`` left out), at its ratios or at ``ratios``."""
    import yaml

    from kvtierd.variants import expand_variants

    doc = yaml.safe_load(POLICY.read_text())["variants"]
    grid = expand_variants(doc["methods"], list(ratios) if ratios else doc["ratios"])
    return [v for v in grid if v != "none"]


def label_variants(ratios: Sequence[float] | None = None) -> list[str]:
    return [*policy_grid(ratios), *CONTROLS]


def ids_digest(ids: Sequence[int]) -> str:
    return hashlib.sha256(",".join(map(str, ids)).encode()).hexdigest()


@dataclass(frozen=True, slots=True)
class LabelledCase:
    """One labelled case as the data file holds it."""

    name: str
    task: str
    length: int
    seed: int
    prompt_tokens: int
    context_tokens: int
    digest: str
    accuracy: dict[str, float]
    exact: dict[str, int]
    answers: dict[str, str]
    row: dict[str, Any]

    @classmethod
    def of(cls, row: dict[str, Any]) -> LabelledCase:
        full = row["full_answer"]
        answers = {v: row.get("answers", {}).get(v, full) for v in row["accuracy"]}
        return cls(
            name=row["case"], task=row["task"], length=row["length"], seed=row["seed"],
            prompt_tokens=row["prompt_tokens"], context_tokens=row["context_tokens"],
            digest=row["sha256"], accuracy=row["accuracy"], exact=row["exact"],
            answers={"none": full, **answers}, row=row,
        )  # fmt: skip

    def case(self, tokenizer: Any) -> Case:
        return make_case(tokenizer, self.task, self.length, self.seed)

    def split(self, tokenizer: Any) -> PromptSplit:
        """The case's prompt, regenerated and checked against the recorded digest."""
        split = split_prompt(tokenizer, self.case(tokenizer))
        check_split(self.row, split)
        return split


def check_split(row: dict[str, Any], split: PromptSplit) -> None:
    got = (len(split.ids), split.context_tokens, ids_digest(split.ids))
    want = (row["prompt_tokens"], row["context_tokens"], row["sha256"])
    if got != want:
        raise ValueError(
            f"{row['case']}: regenerated prompt (tokens, context, sha256) {got} differs from "
            f"the labels' {want}: the task generator or the tokenizer changed"
        )


def read_rows(path: Path = LABELS) -> list[dict[str, Any]]:
    return read_jsonl(path)


def load_labels(path: Path = LABELS) -> list[LabelledCase]:
    """The labelled cases (those the full KV answers), in file order."""
    return [LabelledCase.of(r) for r in read_rows(path) if r["full_accuracy"] == 1.0]


def case_order(
    tasks: Sequence[str], lengths: Sequence[int], seeds: int, first_seed: int = 0
) -> Iterator[tuple[str, int, int]]:
    """Seeds outermost, so a run cut short still covers every task and length."""
    for seed in range(first_seed, seeds):
        for length in lengths:
            for task in tasks:
                yield task, length, seed


def label_case(
    evaluator: Any, tokenizer: Any, case: Case, variants: Sequence[str]
) -> dict[str, Any]:
    """One case's labels (module docstring): a row for the data file."""
    from kvtierd.profiler.quality import ProfilingQuery, StoredForm

    split = split_prompt(tokenizer, case)
    query = [ProfilingQuery(token_ids=tuple(split.query))]
    form = StoredForm(chunk_tokens=CHUNK)
    t0 = time.perf_counter()
    kv = evaluator.encode_context(split.context, window=WINDOW)
    t1 = time.perf_counter()
    (full,) = evaluator.answer_ids(kv, ["none"], query, form=form)[0]
    t2 = time.perf_counter()
    text = _text(tokenizer, full)
    row: dict[str, Any] = {
        "case": case.name, "task": case.task, "length": case.length, "seed": case.seed,
        "prompt_tokens": len(split.ids), "context_tokens": split.context_tokens,
        "sha256": ids_digest(split.ids), "answers_expected": list(case.answers),
        "full_answer": text, "full_accuracy": accuracy(case, text),
        "prefill_s": round(t1 - t0, 3), "full_decode_s": round(t2 - t1, 3),
    }  # fmt: skip
    if row["full_accuracy"] < 1.0:
        return row
    ids = evaluator.answer_ids(kv, list(variants), query, form=form)[0]
    texts = {v: _text(tokenizer, a) for v, a in zip(variants, ids, strict=True)}
    row["variants_s"] = round(time.perf_counter() - t2, 3)
    row["accuracy"] = {v: accuracy(case, t) for v, t in texts.items()}
    row["exact"] = {v: int(a == full) for v, a in zip(variants, ids, strict=True)}
    row["answers"] = {v: t for v, t in texts.items() if t != text}
    return row


def _text(tokenizer: Any, ids: list[int]) -> str:
    return str(tokenizer.decode(ids, skip_special_tokens=True)).strip()


def wilson(successes: float, n: int, z: float = 1.96) -> tuple[float, float]:
    """Wilson score 95% interval of a proportion (fractional successes allowed: accuracy is a
    share of facts per case)."""
    if n == 0:
        return (0.0, 1.0)
    p = successes / n
    centre = (p + z * z / (2 * n)) / (1 + z * z / n)
    half = z * math.sqrt(p * (1 - p) / n + z * z / (4 * n * n)) / (1 + z * z / n)
    return (max(0.0, centre - half), min(1.0, centre + half))


def table(cases: Sequence[LabelledCase], variants: Sequence[str]) -> str:
    """Markdown: per variant, mean accuracy and exact-match share with Wilson 95% intervals."""
    n = len(cases)
    tasks = sorted({c.task for c in cases}, key=TASKS.index)
    per_task = ", ".join(f"{t} {sum(c.task == t for c in cases)}" for t in tasks)
    lines = [
        f"{n} cases the full KV answers ({per_task}); 95% Wilson intervals in brackets.\n",
        "| variant | accuracy | exact match (16 tokens) |",
        "|---|---|---|",
    ]
    for v in variants:
        have = [c for c in cases if v in c.accuracy]
        acc = sum(c.accuracy[v] for c in have)
        em = sum(c.exact[v] for c in have)
        lo_a, hi_a = wilson(acc, len(have))
        lo_e, hi_e = wilson(em, len(have))
        m = max(len(have), 1)
        cells = [f"{s / m:.2f} [{lo:.2f}, {hi:.2f}]" for s, lo, hi in
                 ((acc, lo_a, hi_a), (em, lo_e, hi_e))]  # fmt: skip
        lines.append(f"| {v} | " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, default=LABELS)
    parser.add_argument("--tasks", nargs="+", default=list(TASKS), choices=TASKS)
    parser.add_argument("--lengths", type=int, nargs="+", default=[1024, 2048])
    parser.add_argument("--seeds", type=int, default=12, help="seeds per task and length")
    parser.add_argument("--first-seed", type=int, default=0,
                        help="start at this seed (a second process on other cases)")  # fmt: skip
    parser.add_argument("--want", type=int, default=80, help="stop after this many labelled cases")
    parser.add_argument(
        "--ratios", type=float, nargs="+", default=None, help="the grid's ratios (policy's)"
    )
    parser.add_argument("--batch", type=int, default=17, help="variants decoded at once")
    parser.add_argument(
        "--dtype",
        default="float32",
        choices=["float32", "bfloat16"],
        help="the model's dtype (float32: 4.5x faster here than bfloat16)",
    )
    parser.add_argument("--threads", type=int, default=0, help="torch threads (0: default)")
    parser.add_argument("--table", action="store_true", help="only print the table")
    args = parser.parse_args()
    variants = label_variants(args.ratios)
    if not args.table:
        run(args, variants)
    print(table(load_labels(args.out), variants))


def run(args: argparse.Namespace, variants: list[str]) -> None:
    import torch
    from transformers import AutoTokenizer

    from kvtierd.model_fetch import fetch_model
    from kvtierd.profiler.answer import AnswerEvaluator

    if args.threads:
        torch.set_num_threads(args.threads)
    model = fetch_model(log=print)
    tokenizer = AutoTokenizer.from_pretrained(model)
    evaluator = AnswerEvaluator(str(model), max_new_tokens=MAX_NEW_TOKENS, max_batch=args.batch)
    evaluator.load()[0].to(getattr(torch, args.dtype))
    args.out.parent.mkdir(parents=True, exist_ok=True)
    rows = read_rows(args.out)
    done = {r["case"] for r in rows}
    labelled = sum(r["full_accuracy"] == 1.0 for r in rows)
    print(f"{len(variants)} variants on {machine()}, dtype {evaluator.load()[0].dtype}; "
          f"{labelled} labelled cases already in {args.out}", flush=True)  # fmt: skip
    for task, length, seed in case_order(args.tasks, args.lengths, args.seeds, args.first_seed):
        if labelled >= args.want:
            break
        case = make_case(tokenizer, task, length, seed)
        if case.name in done:
            continue
        row = label_case(evaluator, tokenizer, case, variants)
        with args.out.open("a") as f:
            f.write(json.dumps(row) + "\n")
        done.add(case.name)
        ok = row["full_accuracy"] == 1.0
        labelled += ok
        tail = ""
        if ok:
            acc = sum(row["accuracy"].values()) / len(variants)
            tail = f", variants {row['variants_s']:.1f} s, mean accuracy {acc:.2f}"
        print(
            f"[{labelled}] {case.name}: {row['context_tokens']} ctx tokens, full KV "
            f"{'right' if ok else 'wrong'} ({row['full_answer'][:30]!r}), prefill "
            f"{row['prefill_s']:.1f} s{tail}",
            flush=True,
        )


if __name__ == "__main__":
    main()
