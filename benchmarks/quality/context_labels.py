"""Per-context labels where contexts differ (issue 39, item 1).

    .venv/bin/python -m benchmarks.quality.context_labels           # label (resumable), then tables
    .venv/bin/python -m benchmarks.quality.context_labels --table   # the tables of what is there

For the contexts of :mod:`.context_kinds` (six kinds, 1k and 2k tokens), the real model
(SmolLM2-135M-Instruct) answers each of a context's questions over its full KV; the questions
it answers right (the answer text holds the expected value) are asked again over every variant
of :data:`VARIANTS` (compressed by the kernels, kept counts in whole 16-token chunks as the
daemon stores them). Per (context, variant), per question: ``exact`` (the greedy answer is
token-identical to the full KV's over its first :data:`MAX_NEW_TOKENS` tokens) and ``answered``
(it still holds the expected value). A context's label for a variant is the share of its
questions kept, by either rule. Contexts with fewer than :data:`MIN_QUESTIONS` answered
questions are recorded (so a resumed run skips them) and left out of every table.

Contexts are split by seed: even seeds are the *fit* half, odd seeds the *held-out* half
(:func:`half`); nothing may be fitted on the held-out half.

``--table`` prints, per variant: the labels' mean and spread across contexts (standard
deviation, interquartile range), the mean per kind, and the split-half reliability (each
context's questions split in two alternately; Spearman across contexts between the halves'
shares, and the Spearman-Brown estimate for the whole set).
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from benchmarks._support.common import REPO, machine, read_jsonl
from benchmarks.quality.context_kinds import (
    KINDS,
    KindCase,
    Redundancy,
    draw_redundancy,
    make_kind_case,
)
from benchmarks.quality.quality_labels import CHUNK, WINDOW, ids_digest
from benchmarks.quality.quality_tasks import Case, split_prompt
from benchmarks.quality.ranking import spearman

LABELS = REPO / "benchmarks/data/context_labels.jsonl"
REDUNDANT_LABELS = REPO / "benchmarks/data/context_labels_redundancy.jsonl"
"""The set made with ``--redundancy``: every context's redundancy drawn from its seed
(:func:`~.context_kinds.draw_redundancy`), so that contexts of one kind differ; every fact
asked about."""
VARIANTS = ("int4", "knorm@0.7", "knorm@0.5", "keydiff@0.7", "keydiff@0.5", "snapkv@0.5")
"""The variants the estimator's bar is judged on: int4 (quantization), and one and two
steps of each token-dropping method of the default grid. (In a first run knorm@0.5+int8
answered as knorm@0.5 did, and keydiff@0.3 kept almost nothing in any context.)"""
MAX_NEW_TOKENS = 8
DTYPE = "bfloat16"
"""The model's dtype for labels and for the benchmarks that score them (the KV they compare
must be the same): what vLLM-CPU serves in on a CPU with bf16 instructions, and 2.3x faster
than float32 in a prefill on this AMX CPU."""
MIN_QUESTIONS = 4
CHECKED_QUESTIONS = 12
"""Questions per context that ``--check`` decodes both ways (one at a time is the slow way)."""
RULES = ("exact", "answered")


def half(seed: int) -> str:
    """``"fit"`` for even seeds, ``"held-out"`` for odd ones."""
    return "fit" if seed % 2 == 0 else "held-out"


@dataclass(frozen=True, slots=True)
class ContextLabels:
    """One labelled context as the data file holds it: per variant and rule, one 0/1 per
    answered question (in the order of ``questions``)."""

    name: str
    kind: str
    length: int
    seed: int
    fact_share: float
    context_tokens: int
    digest: str  # SHA-256 of the context's token ids
    questions: tuple[str, ...]
    kept: dict[str, dict[str, tuple[int, ...]]]  # rule -> variant -> per question
    redundancy: Redundancy | None = None  # how the context was made, None: the kind's own

    @classmethod
    def of(cls, row: dict[str, Any]) -> ContextLabels:
        knob = row.get("redundancy")
        return cls(
            name=row["case"], kind=row["kind"], length=row["length"], seed=row["seed"],
            fact_share=row["fact_share"], context_tokens=row["context_tokens"],
            digest=row["sha256"], questions=tuple(row["asked"]),
            kept={r: {v: tuple(x) for v, x in row[r].items()} for r in RULES},
            redundancy=None if knob is None else Redundancy(knob[0], knob[1]),
        )  # fmt: skip

    def case(self, tokenizer: Any) -> KindCase:
        """The context regenerated (its digest is checked by whoever reads its KV)."""
        return make_kind_case(tokenizer, self.kind, self.length, self.seed, self.redundancy)

    @property
    def half(self) -> str:
        return half(self.seed)

    def share(self, variant: str, rule: str = "exact") -> float:
        """The share of this context's questions kept by ``variant``."""
        xs = self.kept[rule][variant]
        return sum(xs) / len(xs)


def load_context_labels(path: Path = LABELS) -> list[ContextLabels]:
    """The labelled contexts (those with at least :data:`MIN_QUESTIONS` answered questions)."""
    return [
        ContextLabels.of(r) for r in read_jsonl(path) if len(r.get("asked", ())) >= MIN_QUESTIONS
    ]


def prompts(tokenizer: Any, case: KindCase) -> tuple[list[int], list[list[int]]]:
    """The context's token ids (the chat prompt through the document, whole chunks) and each
    question's ids after it (the document's tail in the last partial chunk, the question and
    the template's end)."""
    context: list[int] = []
    queries = []
    for question, lead, answer in case.questions:
        as_case = Case(case.kind, case.length, case.seed, case.document, question, (answer,), 0.0)
        split = split_prompt(tokenizer, as_case, CHUNK)
        if context and split.context != context:
            raise ValueError(f"{case.name}: questions split the prompt at different tokens")
        context = split.context
        queries.append(split.query + tokenizer(lead, add_special_tokens=False)["input_ids"])
    return context, queries


def label_context(
    evaluator: Any, tokenizer: Any, case: KindCase, redundancy: Redundancy | None = None,
    batched: bool = False,
) -> dict[str, Any]:  # fmt: skip
    """One context's row (module docstring); ``batched``: a context's questions decoded at
    once over each variant (:mod:`.shared_decode`), else one decode per question."""
    from benchmarks.quality.shared_decode import answer_questions
    from kvtierd.profiler.quality import ProfilingQuery, StoredForm

    context, queries = prompts(tokenizer, case)
    form = StoredForm(chunk_tokens=CHUNK)

    def answer_ids(variants: list[str], which: list[int]) -> list[list[list[int]]]:
        if batched:
            return answer_questions(evaluator, kv, variants, [queries[i] for i in which],
                                    form=form)  # fmt: skip
        asked = [ProfilingQuery(token_ids=tuple(queries[i])) for i in which]
        return list(evaluator.answer_ids(kv, variants, asked, form=form))

    t0 = time.perf_counter()
    kv = evaluator.encode_context(context, window=WINDOW)
    t1 = time.perf_counter()
    full = [ids[0] for ids in answer_ids(["none"], list(range(len(queries))))]
    texts = [_text(tokenizer, a) for a in full]
    right = [i for i, (t, (*_, want)) in enumerate(zip(texts, case.questions, strict=True))
             if want.lower() in t.lower()]  # fmt: skip
    t2 = time.perf_counter()
    row: dict[str, Any] = {
        "case": case.name, "kind": case.kind, "length": case.length, "seed": case.seed,
        "fact_share": round(case.fact_share, 4), "context_tokens": len(context),
        "sha256": ids_digest(context), "questions": len(case.questions),
        "asked": [case.questions[i][0] for i in right],
        "prefill_s": round(t1 - t0, 3), "full_decode_s": round(t2 - t1, 3),
    }  # fmt: skip
    if redundancy is not None:
        row["redundancy"] = [redundancy.tellings, redundancy.fact_share]
        row["decode"] = "batched" if batched else "per question"
    if len(right) < MIN_QUESTIONS:
        return row
    ids = answer_ids(list(VARIANTS), right)
    row["variants_s"] = round(time.perf_counter() - t2, 3)
    row["exact"] = {v: [int(per_q[j] == full[i]) for per_q, i in zip(ids, right, strict=True)]
                    for j, v in enumerate(VARIANTS)}  # fmt: skip
    row["answered"] = {
        v: [int(case.questions[i][2].lower() in _text(tokenizer, per_q[j]).lower())
            for per_q, i in zip(ids, right, strict=True)]
        for j, v in enumerate(VARIANTS)
    }  # fmt: skip
    return row


def _text(tokenizer: Any, ids: list[int]) -> str:
    return str(tokenizer.decode(ids, skip_special_tokens=True)).strip()


def split_half(contexts: Sequence[ContextLabels], variant: str, rule: str) -> float | None:
    """Spearman across contexts between the shares of each context's odd and even questions."""
    a = [_mean(c.kept[rule][variant][0::2]) for c in contexts]
    b = [_mean(c.kept[rule][variant][1::2]) for c in contexts]
    return spearman(a, b)


def _mean(xs: Sequence[int]) -> float:
    return sum(xs) / len(xs) if xs else 0.0


def table(contexts: Sequence[ContextLabels], rule: str = "exact") -> str:
    """Markdown: per variant, the labels' spread across contexts and their reliability."""
    kinds = [k for k in KINDS if any(c.kind == k for c in contexts)]
    per_kind = ", ".join(f"{k} {sum(c.kind == k for c in contexts)}" for k in kinds)
    questions = [len(c.questions) for c in contexts]
    lines = [
        f"{len(contexts)} contexts ({per_kind}; fit half {sum(c.half == 'fit' for c in contexts)}"
        f"), {statistics.fmean(questions):.1f} answered questions each (min {min(questions)}); "
        f"label: share of questions kept ({rule}).\n",
        "| variant | mean | sd across contexts | IQR | "
        + " | ".join(kinds)
        + " | split-half rho | Spearman-Brown |",
        "|---|---|---|---|" + "---|" * len(kinds) + "---|---|",
    ]
    for v in VARIANTS:
        shares = [c.share(v, rule) for c in contexts]
        q = statistics.quantiles(shares, n=4) if len(shares) > 1 else [shares[0]] * 3
        by_kind = [statistics.fmean(c.share(v, rule) for c in contexts if c.kind == k)
                   for k in kinds]  # fmt: skip
        rho = split_half(contexts, v, rule)
        sb = None if rho is None or rho <= -1 else 2 * rho / (1 + rho)
        cells = [f"{statistics.fmean(shares):.2f}", f"{statistics.pstdev(shares):.2f}",
                 f"{q[0]:.2f}-{q[2]:.2f}", *(f"{x:.2f}" for x in by_kind), _f(rho),
                 _f(sb)]  # fmt: skip
        lines.append(f"| {v} | " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def _f(x: float | None) -> str:
    return "-" if x is None else f"{x:.2f}"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--out",
        type=Path,
        default=None,
        help=f"default {LABELS.name}, with --redundancy {REDUNDANT_LABELS.name}",
    )
    parser.add_argument(
        "--redundancy",
        action="store_true",
        help="draw each context's redundancy from its seed; questions batched",
    )
    parser.add_argument(
        "--check",
        type=int,
        default=0,
        metavar="N",
        help="only compare batched with per-question answers on N contexts",
    )
    parser.add_argument("--kinds", nargs="+", default=list(KINDS), choices=KINDS)
    parser.add_argument("--lengths", type=int, nargs="+", default=[1024, 2048])
    parser.add_argument("--seeds", type=int, default=8, help="seeds per kind and length")
    parser.add_argument("--first-seed", type=int, default=0)
    parser.add_argument("--batch", type=int, default=8, help="variants decoded at once")
    parser.add_argument("--threads", type=int, default=1, help="torch threads")
    parser.add_argument("--table", action="store_true", help="only print the tables")
    args = parser.parse_args()
    if args.out is None:
        args.out = REDUNDANT_LABELS if args.redundancy else LABELS
    if args.check:
        check(args)
        return
    if not args.table:
        run(args)
    contexts = load_context_labels(args.out)
    if contexts:
        for rule in RULES:
            print(table(contexts, rule))


def _load(args: argparse.Namespace) -> tuple[Any, Any]:
    import torch
    from transformers import AutoTokenizer

    from kvtierd.model_fetch import fetch_model
    from kvtierd.profiler.answer import AnswerEvaluator

    torch.set_num_threads(args.threads)  # one: two threads on two shared cores thrash
    model = fetch_model(log=print)
    tokenizer = AutoTokenizer.from_pretrained(model)
    evaluator = AnswerEvaluator(str(model), max_new_tokens=MAX_NEW_TOKENS, max_batch=args.batch)
    evaluator.load()[0].to(getattr(torch, DTYPE))
    return evaluator, tokenizer


def check(args: argparse.Namespace) -> None:
    """Batched against per-question decoding: on the first ``args.check`` contexts of the
    redundancy set (seed 0 up, the kinds in turn, the first length), the share of (question,
    variant) answers that are token-identical, and of the labels (exact rule) that agree."""
    from benchmarks.quality.shared_decode import answer_questions
    from kvtierd.profiler.quality import ProfilingQuery, StoredForm

    evaluator, tokenizer = _load(args)
    form = StoredForm(chunk_tokens=CHUNK)
    variants = ["none", *VARIANTS]
    same = labels_same = total = labels_total = 0
    cpu = [0.0, 0.0]
    for i in range(args.check):
        kind, seed = args.kinds[i % len(args.kinds)], args.first_seed + i // len(args.kinds)
        knob = draw_redundancy(kind, args.lengths[0], seed)
        case = make_kind_case(tokenizer, kind, args.lengths[0], seed, knob)
        context, queries = prompts(tokenizer, case)
        queries = queries[:CHECKED_QUESTIONS]
        kv = evaluator.encode_context(context, window=WINDOW)
        t0 = time.process_time()
        one = evaluator.answer_ids(kv, variants, [ProfilingQuery(token_ids=tuple(q))
                                                  for q in queries], form=form)  # fmt: skip
        t1 = time.process_time()
        many = answer_questions(evaluator, kv, variants, queries, form=form)
        cpu[0] += t1 - t0
        cpu[1] += time.process_time() - t1
        for a, b in zip(one, many, strict=True):
            same += sum(x == y for x, y in zip(a, b, strict=True))
            total += len(a)
            pairs = zip(a[1:], b[1:], strict=True)
            labels_same += sum((x == a[0]) == (y == b[0]) for x, y in pairs)
            labels_total += len(a) - 1
        print(f"{case.name} ({len(queries)} questions): so far answers identical {same}/"
              f"{total}, exact labels agree {labels_same}/{labels_total}", flush=True)  # fmt: skip
    print(f"{machine()}: batched answers identical to per-question ones {same}/{total} "
          f"({same / total:.3f}), exact labels {labels_same}/{labels_total} "
          f"({labels_same / labels_total:.3f}); decode CPU {cpu[0]:.1f} s one question at a "
          f"time, {cpu[1]:.1f} s batched ({cpu[0] / cpu[1]:.1f}x)")  # fmt: skip


def run(args: argparse.Namespace) -> None:
    evaluator, tokenizer = _load(args)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    done = {r["case"] for r in read_jsonl(args.out)}
    print(f"{len(VARIANTS)} variants on {machine()}; {len(done)} contexts already in {args.out}",
          flush=True)  # fmt: skip
    for seed in range(args.first_seed, args.seeds):
        for length in args.lengths:
            for kind in args.kinds:
                knob = draw_redundancy(kind, length, seed) if args.redundancy else None
                if f"{kind}/{length}/{seed}" in done:
                    continue
                case = make_kind_case(tokenizer, kind, length, seed, knob)
                row = label_context(evaluator, tokenizer, case, knob, batched=args.redundancy)
                with args.out.open("a") as f:
                    f.write(json.dumps(row) + "\n")
                kept = ""
                if "exact" in row:
                    kept = " ".join(f"{v}={sum(x) / len(x):.2f}" for v, x in row["exact"].items())
                print(f"{case.name}: {row['context_tokens']} tokens, {len(row['asked'])}/"
                      f"{row['questions']} answered, prefill {row['prefill_s']:.1f} s, "
                      f"variants {row.get('variants_s', 0):.1f} s {kept}", flush=True)  # fmt: skip


if __name__ == "__main__":
    main()
