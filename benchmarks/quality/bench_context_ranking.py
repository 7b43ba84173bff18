"""Estimators judged by how they rank contexts within a variant (issue 39, items 2 and 3).

    .venv/bin/python -m benchmarks.quality.bench_context_ranking           # score (resumable)
    .venv/bin/python -m benchmarks.quality.bench_context_ranking --report  # the report only

Every labelled context of ``benchmarks/data/context_labels.jsonl`` (:mod:`.context_labels`; its
prompt regenerated and checked against the recorded digest) is prefilled once on the real model,
then each candidate scores :data:`~.context_labels.VARIANTS`, timed in CPU seconds of this
single-threaded process against a serving prefill of the same context (the model in bfloat16,
the last position's logits only: the cheaper of the two dtypes on an AMX CPU, so the ratio is
the conservative one). Three readings, as the daemon meets them:

* **first put** (no question known): ``window`` (the context's last 32 queries recomputed from
  the weights, the daemon's reading today), ``keys`` (its last 32 keys, the fallback without a
  model), ``recon`` (the context's own spans read again after it, :mod:`kvtierd.profiler.
  reconstruction`), ``ngram`` (the share of the context's token 4-grams that occur more than
  once: redundancy, model-free); ``fitted`` (coverage4, ngram, recon, window and keys combined
  by a ridge regression fitted on the fit half only, :func:`fitted_scores`);
* **after traffic** (the context's first answered question known, judged on the others):
  ``question`` (``query_attention`` on that question);
* **refined** (the same question decoded over every variant, the ``answer`` evaluator's exact
  match): ``answer``, judged on the others.

``prior`` (per variant, the fit half's mean label: blind to the context) is the floor: within a
variant it is a constant, so its across-context AUC is 0.5 and it has no Spearman. ``fact_share``
(1 minus the share of the document that is facts, known to the generator only) is the
reference the issue names, not an estimator, and ``tellings`` (how often each fact is told, where
the generator drew it: ``--redundancy``) its other knob; ``kind`` (the fit half's mean label of the
context's kind, per variant: the generator's knowledge again) shows how much of the labels'
spread is the kinds'. The report's figures are on the held-out half
(odd seeds); nothing is fitted on it.
"""

from __future__ import annotations

import argparse
import json
import statistics
from collections import Counter, defaultdict
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from benchmarks._support.common import REPO, machine, read_jsonl
from benchmarks.quality.bench_estimators import serving_prefill_cpu_s, timed
from benchmarks.quality.context_labels import (
    DTYPE,
    LABELS,
    VARIANTS,
    ContextLabels,
    load_context_labels,
    prompts,
)
from benchmarks.quality.quality_labels import CHUNK, ids_digest
from benchmarks.quality.ranking import bootstrap_auc, context_auc, context_spearman, mean_spearman
from kvtierd.variants import parse_variant

SCORES = REPO / "benchmarks/data/context_scores.jsonl"
FIRST_PUT = ("window", "keys", "recon", "recon8x16", "recon16x4", "ngram", "coverage1",
             "coverage2", "coverage3", "coverage4")  # fmt: skip
AFTER_TRAFFIC = ("question", "answer")
REFERENCES = ("prior", "fact_share", "tellings", "kind")
BOOTSTRAPPED = ("window", "ngram", "coverage4", "fitted", "kind", "question", "answer")
"""Readings whose AUC gets a 95% bootstrap interval over contexts (the report's cost)."""
CHOSEN = "coverage4"
"""The first-put reading the daemon uses (``first_put="coverage"``, 4-grams): chosen on the fit
half (the best across-context AUC there with coverage3, and the better mean Spearman)."""


def ngram_redundancy(ids: Sequence[int], n: int = 4) -> float:
    """The share of the token ``n``-grams of ``ids`` that occur more than once in it."""
    grams = [tuple(ids[i : i + n]) for i in range(len(ids) - n + 1)]
    if not grams:
        return 0.0
    counts = Counter(grams)
    return sum(counts[g] > 1 for g in grams) / len(grams)


def score_context(
    model_dir: str, answer: Any, tokenizer: Any, lc: ContextLabels,
    readings: Sequence[str] = (*FIRST_PUT, "question"),
) -> dict[str, Any]:  # fmt: skip
    """One context's scores and costs (module docstring), of ``readings`` only."""
    import torch

    from kvtierd.profiler.coverage import ngram_coverage
    from kvtierd.profiler.quality import ContextKV, StoredForm
    from kvtierd.profiler.query_attention import QueryAttentionEvaluator
    from kvtierd.profiler.reconstruction import reconstruction_ids

    case = lc.case(tokenizer)
    context, queries = prompts(tokenizer, case)
    if ids_digest(context) != lc.digest:
        raise ValueError(f"{lc.name}: the regenerated context differs from the labelled one")
    known = next(q for (text, _, _), q in zip(case.questions, queries, strict=True)
                 if text == lc.questions[0])  # fmt: skip
    form = StoredForm(chunk_tokens=CHUNK)
    kv = answer.encode_context(context, window=64)
    prefill_s = bf16_prefill_cpu_s(answer, context)
    variants = list(VARIANTS)
    qa = QueryAttentionEvaluator(model_dir, calibrate=False)
    bare = ContextKV(kv.keys, kv.values, kv.window_queries, tuple(context))

    def window() -> dict[str, float]:
        probes = QueryAttentionEvaluator(model_dir, calibrate=False).probes(
            ContextKV(kv.keys, kv.values, None, tuple(context))
        )
        return qa.raw_scores(bare, variants, probes, form)

    def keys() -> dict[str, float]:
        probes = QueryAttentionEvaluator("", calibrate=False).probes(
            ContextKV(kv.keys, kv.values, None, ())
        )
        return qa.raw_scores(bare, variants, probes, form)

    def recon(spans: int, width: int) -> Callable[[], dict[str, float]]:
        def run() -> dict[str, float]:
            probes = qa.question_probes(bare, reconstruction_ids(context, spans, width))
            errors = qa.errors(bare, variants, probes, form)
            for v, e in errors.items():  # other aggregations of the same errors, for the fit half
                extra[f"recon{spans}x{width}/headmax"][v] = 1 - float(e.amax(dim=1).mean())
                extra[f"recon{spans}x{width}/frac30"][v] = 1 - float((e > 0.3).float().mean())
            return {v: 1 - float(e.mean()) for v, e in errors.items()}

        return run

    extra: dict[str, dict[str, float]] = defaultdict(dict)

    def ngram() -> dict[str, float]:
        r = ngram_redundancy(context)
        return dict.fromkeys(variants, r)

    def coverage(n: int) -> Callable[[], dict[str, float]]:
        def run() -> dict[str, float]:
            return ngram_coverage(bare, variants, form, n)

        return run

    def question() -> dict[str, float]:
        return qa.raw_scores(bare, variants, qa.question_probes(bare, known), form)

    row: dict[str, Any] = {"case": lc.name, "prefill_cpu_s": round(prefill_s, 4), "scores": {},
                           "cpu_s": {}}  # fmt: skip
    with torch.inference_mode():
        for name, fn in (("window", window), ("keys", keys), ("recon", recon(4, 16)),
                         ("recon8x16", recon(8, 16)), ("recon16x4", recon(16, 4)),
                         ("ngram", ngram), ("coverage1", coverage(1)), ("coverage2", coverage(2)),
                         ("coverage3", coverage(3)), ("coverage4", coverage(4)),
                         ("question", question)):  # fmt: skip
            if name not in readings:
                continue
            scores, cpu = timed(fn)
            row["scores"][name] = {v: round(s, 6) for v, s in scores.items()}
            row["cpu_s"][name] = round(cpu, 4)
    for name, scores in extra.items():
        row["scores"][name] = {v: round(s, 6) for v, s in scores.items()}
    return row


def bf16_prefill_cpu_s(answer: Any, ids: Sequence[int]) -> float:
    """:func:`~.bench_estimators.serving_prefill_cpu_s` with the model in bfloat16 (its
    kernels warmed by a short pass first), the model put back in its dtype after."""
    import torch

    model, _ = answer.load()
    dtype = model.dtype
    model.to(torch.bfloat16)
    try:
        with torch.inference_mode():  # warm the bf16 kernels
            model(input_ids=torch.tensor([list(ids[:64])]), use_cache=True, logits_to_keep=1)
        return serving_prefill_cpu_s(answer, ids)
    finally:
        model.to(dtype)


# -- the report ----------------------------------------------------------------------------


def label_tables(
    contexts: Sequence[ContextLabels], rule: str, skip_first: bool
) -> dict[str, dict[str, float]]:
    """Per context and variant, the share kept; ``skip_first``: without the context's first
    question (the one an after-traffic reading knows)."""
    out = {}
    for c in contexts:
        row = {}
        for v in VARIANTS:
            xs = c.kept[rule][v][1:] if skip_first else c.kept[rule][v]
            row[v] = sum(xs) / len(xs)
        out[c.name] = row
    return out


def half_tables(
    contexts: Sequence[ContextLabels], rule: str
) -> tuple[dict[str, dict[str, float]], dict[str, dict[str, float]]]:
    """Per context and variant, the share kept of its odd questions and of its even ones."""
    odd: dict[str, dict[str, float]] = {}
    even: dict[str, dict[str, float]] = {}
    for c in contexts:
        kept = c.kept[rule]
        odd[c.name] = {v: statistics.fmean(kept[v][0::2]) for v in VARIANTS}
        even[c.name] = {v: statistics.fmean(kept[v][1::2]) for v in VARIANTS}
    return odd, even


def mean_shares(contexts: Sequence[ContextLabels]) -> dict[str, float]:
    """Per variant, the mean share kept over ``contexts`` (the prior, on the fit half)."""
    return {v: statistics.fmean(c.share(v) for c in contexts) for v in VARIANTS}


def reading_scores(
    rows: dict[str, dict[str, Any]], contexts: Sequence[ContextLabels], fit: Sequence[ContextLabels]
) -> dict[str, dict[str, dict[str, float]]]:
    """Every candidate's scores, the prior and the reference, per context and variant."""
    prior = mean_shares(fit)
    by_kind = {k: mean_shares([f for f in fit if f.kind == k]) for k in {f.kind for f in fit}}
    out: dict[str, dict[str, dict[str, float]]] = {}
    for c in contexts:
        r = rows.get(c.name)
        if r is None:
            continue
        for name, scores in r["scores"].items():
            out.setdefault(name, {})[c.name] = scores
        out.setdefault("prior", {})[c.name] = dict(prior)
        out.setdefault("fact_share", {})[c.name] = dict.fromkeys(VARIANTS, 1 - c.fact_share)
        if c.redundancy is not None:
            tellings = float(c.redundancy.tellings)
            out.setdefault("tellings", {})[c.name] = dict.fromkeys(VARIANTS, tellings)
        if c.kind in by_kind:
            out.setdefault("kind", {})[c.name] = dict(by_kind[c.kind])
        out.setdefault("answer", {})[c.name] = {v: float(c.kept["exact"][v][0]) for v in VARIANTS}
    return out


FITTED = ("coverage4", "ngram", "recon", "window", "keys")
"""The first-put readings a ridge regression combines (:func:`fitted_scores`)."""


def fitted_scores(
    rows: dict[str, dict[str, Any]], fit: Sequence[ContextLabels],
    held: Sequence[ContextLabels], features: Sequence[str] = FITTED, ridge: float = 1.0,
) -> dict[str, dict[str, float]]:  # fmt: skip
    """A candidate fitted on the fit half only (issue 39, item 3: "weights fitted on the fit
    half"): per variant, each reading's scores standardised by the fit half's mean and
    deviation; one ridge regression, pooled over the variants, of a context's share kept less
    its variant's fit-half mean; applied unchanged to ``held``. Empty if a context of either
    half lacks a reading."""
    import numpy as np

    def has_all(c: ContextLabels) -> bool:
        return c.name in rows and all(f in rows[c.name]["scores"] for f in features)

    if not all(map(has_all, fit)) or not all(map(has_all, held)):
        return {}
    scale = {}
    for v in VARIANTS:
        xs = np.array([[rows[c.name]["scores"][f][v] for f in features] for c in fit])
        scale[v] = (xs.mean(axis=0), xs.std(axis=0) + 1e-9)

    def x(c: ContextLabels, v: str) -> list[float]:
        mean, std = scale[v]
        raw = np.array([rows[c.name]["scores"][f][v] for f in features])
        return list((raw - mean) / std)

    prior = mean_shares(fit)
    design = np.array([x(c, v) for c in fit for v in VARIANTS])
    target = np.array([c.share(v) - prior[v] for c in fit for v in VARIANTS])
    weights = np.linalg.solve(design.T @ design + ridge * np.eye(len(features)), design.T @ target)
    return {c.name: {v: prior[v] + float(np.dot(weights, x(c, v))) for v in VARIANTS}
            for c in held}  # fmt: skip


def report(
    scores_path: Path = SCORES, labels_path: Path = LABELS, rule: str = "exact",
    half: str = "held-out",
) -> str:  # fmt: skip
    """The table of every reading on the contexts of ``half`` (the prior from the fit half)."""
    contexts = load_context_labels(labels_path)
    rows = {r["case"]: r for r in read_jsonl(scores_path)}
    fit = [c for c in contexts if c.half == "fit"]
    held = [c for c in contexts if c.half == half and c.name in rows]
    if not held or not fit:
        return f"no {half} context scored yet\n"
    tables = reading_scores(rows, held, fit)
    fitted = fitted_scores(rows, fit, held)
    if fitted:
        tables["fitted"] = fitted
    labels_all = label_tables(held, rule, skip_first=False)
    labels_rest = label_tables(held, rule, skip_first=True)
    odd, even = half_tables(held, rule)
    ceiling = context_auc(even, odd, VARIANTS) + context_auc(odd, even, VARIANTS)
    lines = [
        f"The labels' own ceiling: each context's odd questions' share as the score of its even "
        f"questions' share and the reverse: across-context AUC {_f(ceiling.auc)} (an estimator "
        "judged on labels this noisy cannot rank far above it).\n",
        f"{len(held)} {half} contexts (of {len(contexts)} labelled; label: share of questions "
        f"kept, {rule}); across-context AUC pooled over the variants' pairs, Spearman per "
        "variant across contexts. After-traffic readings are judged on each context's other "
        "questions.\n",
        "| reading | estimator | across-context AUC [95% bootstrap] | mean Spearman | "
        + " | ".join(VARIANTS)
        + " | cost / serving prefill (median, p90) |",
        "|---|---|---|---|" + "---|" * len(VARIANTS) + "---|",
    ]
    ratios = {n: [r["cpu_s"][n] / r["prefill_cpu_s"] for r in rows.values() if n in r["cpu_s"]]
              for n in (*FIRST_PUT, "question")}  # fmt: skip
    ratios["fitted"] = [sum(r["cpu_s"][f] for f in FITTED) / r["prefill_cpu_s"]
                        for r in rows.values() if all(f in r["cpu_s"] for f in FITTED)]  # fmt: skip
    aggregations = sorted(n for n in tables if "/" in n)
    for reading, names in (("first put", (*FIRST_PUT, "fitted", *aggregations, *REFERENCES)),
                           ("after traffic", AFTER_TRAFFIC)):  # fmt: skip
        labels = labels_all if reading == "first put" else labels_rest
        for name in names:
            if name not in tables:
                continue
            auc = context_auc(labels, tables[name], VARIANTS).auc
            ci = bootstrap_auc(labels, tables[name], VARIANTS) if name in BOOTSTRAPPED else None
            rho = mean_spearman(labels, tables[name], VARIANTS)
            per = [context_spearman(labels, tables[name], v) for v in VARIANTS]
            cost = "-"
            if ratios.get(name):
                xs = sorted(ratios[name])
                cost = f"{statistics.median(xs):.3f}, {xs[int(0.9 * (len(xs) - 1))]:.3f}"
            lines.append(
                f"| {reading} | {name} | {_f(auc)}{_interval(ci)} | {_f(rho)} | "
                + " | ".join(_f(x) for x in per)
                + f" | {cost} |"
            )
    return "\n".join(lines) + "\n"


def coverage_calibration(
    scores_path: Path = SCORES, labels_path: Path = LABELS, reading: str = CHOSEN
) -> tuple[tuple[float, float], ...]:
    """:data:`~kvtierd.profiler.quality_tables.COVERAGE_CALIBRATION`: monotone knots from the
    chosen coverage reading to the exact-match share, over the token-dropping variants of the
    fit half only."""
    from benchmarks.quality.bench_estimators import fit_calibration

    rows = {r["case"]: r for r in read_jsonl(scores_path)}
    pairs = [
        (rows[c.name]["scores"][reading][v], c.share(v))
        for c in load_context_labels(labels_path)
        if c.half == "fit" and c.name in rows
        for v in VARIANTS
        if parse_variant(v).drops_tokens
    ]
    return fit_calibration(pairs)


def _interval(ci: tuple[float, float] | None) -> str:
    return "" if ci is None else f" [{ci[0]:.2f}, {ci[1]:.2f}]"


def _f(x: float | None) -> str:
    return "-" if x is None else f"{x:.2f}"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, default=SCORES)
    parser.add_argument("--labels", type=Path, default=LABELS)
    parser.add_argument("--report", action="store_true", help="only print the report")
    parser.add_argument(
        "--constants", action="store_true",
        help="print COVERAGE_CALIBRATION fitted on the fit half (no scoring)",
    )  # fmt: skip
    parser.add_argument("--rule", default="exact", choices=["exact", "answered"])
    parser.add_argument(
        "--readings", nargs="+", default=[*FIRST_PUT, "question"],
        choices=[*FIRST_PUT, "question"], help="the readings to score (default: all)",
    )  # fmt: skip
    parser.add_argument(
        "--halves", nargs="+", default=["fit", "held-out"], choices=["fit", "held-out"],
        help="the halves whose contexts are scored",
    )  # fmt: skip
    parser.add_argument(
        "--half", default="held-out", choices=["held-out", "fit"],
        help="contexts to report on (choices are made on the fit half)",
    )  # fmt: skip
    args = parser.parse_args()
    if args.constants:
        print(f"COVERAGE_CALIBRATION = {coverage_calibration(args.out, args.labels)}")
        return
    if not args.report:
        run(args)
    print(report(args.out, args.labels, args.rule, args.half))


def run(args: argparse.Namespace) -> None:
    import torch
    from transformers import AutoTokenizer

    from kvtierd.model_fetch import fetch_model
    from kvtierd.profiler.answer import AnswerEvaluator

    torch.set_num_threads(1)  # CPU time of one thread: the shared cores' load does not count
    model_dir = str(fetch_model(log=print))
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    answer = AnswerEvaluator(model_dir)
    answer.load()[0].to(getattr(torch, DTYPE))
    done = {r["case"] for r in read_jsonl(args.out)}
    contexts = load_context_labels(args.labels)
    print(f"{len(contexts)} labelled contexts, {len(done)} scored, on {machine()}", flush=True)
    for lc in contexts:
        if lc.name in done or lc.half not in args.halves:
            continue
        row = score_context(model_dir, answer, tokenizer, lc, args.readings)
        with args.out.open("a") as f:
            f.write(json.dumps(row) + "\n")
        print(
            f"{lc.name}: prefill {row['prefill_cpu_s']:.2f} s CPU, costs "
            + ", ".join(f"{k} {v:.2f}" for k, v in row["cpu_s"].items()),
            flush=True,
        )


if __name__ == "__main__":
    main()
