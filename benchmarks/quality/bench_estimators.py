"""Quality estimators judged by the labels: agreement with accuracy, and cost (issue 26).

    .venv/bin/python -m benchmarks.quality.bench_estimators          # score the labelled cases
    .venv/bin/python -m benchmarks.quality.bench_estimators --report # table + plot of what is there

Every labelled case of ``benchmarks/data/quality_labels.jsonl`` (``quality_labels.py``; the
prompt regenerated and checked against its digest) is prefilled once on the real model
(SmolLM2-135M-Instruct, float32, the label run's thread count), timed: that is the context's
own prefill, the unit of cost. Then each estimator scores the label grid (the default policy's
variants and the streamingllm controls), each timed on the same cores in the same process:

* ``attention/window``: the ``attention`` evaluator on the context's last 64 queries (captured
  in the prefill, so free here; the daemon recomputes them: a pass of 64 tokens);
* ``attention/question``: the same on the question's own queries (query-aware: the router sees
  every question's tokens), the question's pass through the model included;
* ``attention/keys``: the same on the context's last 32 keys (its fallback today);
* ``query_attention/question``: the new estimator (``kvtierd/profiler/query_attention.py``),
  uncalibrated, its question pass included; with two other aggregations of the same errors
  (``/last``: the question's last token only; ``/last8``: its last 8 tokens; ``/headmax``: per
  layer and token the worst head; ``/stride2``, ``/stride3``: every second or third layer only,
  which would halve or third the cost of the errors)
  to judge the a-priori choice (the mean) on held-out cases;
* ``query_attention/window``: its fallback without a question — the context's last 32 queries,
  recomputed from the weights (a pass of 32 tokens after the stored prefix, timed);
* ``query_attention/keys``: its last fallback, the context's last 32 keys;
* ``answer/similarity``, ``answer/exact`` on the case's own question: the labels' answers (the
  label run decoded them), so their cost is the label run's decode time over its prefill time
  (same machine, same threads) plus MiniLM here; ``/exact`` *is* the exact-match label;
* ``answer/other-*``: the ``answer`` evaluator asked another question about the same document
  (the case's first other question): what a profile learns from one question about the next.
  Decoding the whole grid costs several prefills, so only ``--answer-cases`` cases get it;
* ``prior``: per variant, the mean accuracy of the other labelled cases (leave-one-out): free,
  and blind to the context.

``served`` (the same metric through vLLM + router + daemon) is not run: it needs the serving
stack and took 61 s per context for six variants (RESULTS.md, issue 26) — 32 variants on 60
cases would not fit this run; its agreement is ``answer``'s up to vLLM's numerics.

Scores go to ``benchmarks/data/estimator_scores.jsonl`` (a line per case, appended as it
finishes: resumable). ``--report`` prints the table — per estimator: of all pairs of variants of
one case whose accuracy differs, the share it orders the same way (ties count half), the same on
pairs whose accuracy differs by >= 0.25, the mean per-case Spearman (cases where every variant
has the same accuracy are left out), and cost as a multiple of the case's prefill (median, and
90th percentile; CPU time of this single-threaded process, which the other engineers' work on
the shared cores does not inflate as it does wall time; rows scored before CPU time was
recorded have no cost and are left out of it) — and draws ``benchmarks/figures/estimators.png``.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from benchmarks._support.common import REPO, machine, read_jsonl
from benchmarks.quality.quality_labels import (
    CHUNK,
    LABELS,
    WINDOW,
    LabelledCase,
    load_labels,
)
from benchmarks.quality.ranking import spearman

SCORES = REPO / "benchmarks/data/estimator_scores.jsonl"
FIGURE = REPO / "benchmarks/figures/estimators.png"
BIG_GAP = 0.25
Scorer = Callable[[], dict[str, float]]


def timed(fn: Scorer) -> tuple[dict[str, float], float]:
    """``fn()`` and the CPU time it took (this process's: one torch thread, so the cores it
    ran on for as long as it ran, whatever else the shared machine was doing)."""
    t0 = time.process_time()
    out = fn()
    return out, time.process_time() - t0


def serving_prefill_cpu_s(answer: Any, ids: Sequence[int]) -> float:
    """CPU seconds of the context's prefill as a server runs it: one forward pass in the
    model's dtype that keeps the KV and computes the logits of the last token only (vLLM
    samples from the last position). ``encode_context`` also computes every position's logits
    (a 49k-word LM head over the whole context) and the window queries, so its time
    overstates a prefill and understates every cost ratio taken against it."""
    import torch

    model, _ = answer.load()
    x = torch.tensor([list(ids)], dtype=torch.long)
    with torch.inference_mode():
        c0 = time.process_time()
        model(input_ids=x, use_cache=True, logits_to_keep=1)
        return time.process_time() - c0


def score_case(
    ctx: dict[str, Any], lc: LabelledCase, other_answer: bool, attention: bool
) -> dict[str, Any]:
    """Every estimator's scores of the case's labelled variants, with its cost (module doc)."""
    import torch

    from kvtierd.profiler.attention import AttentionEvaluator
    from kvtierd.profiler.quality import ContextKV, ProfilingQuery, StoredForm
    from kvtierd.profiler.query_attention import QueryAttentionEvaluator
    from kvtierd.profiler.window_queries import pass_for_context

    tok, answer, model_dir = ctx["tokenizer"], ctx["answer"], ctx["model_dir"]
    variants = list(lc.accuracy)
    split = lc.split(tok)
    form = StoredForm(chunk_tokens=CHUNK)
    t0, c0 = time.perf_counter(), time.process_time()
    kv = answer.encode_context(split.context, window=WINDOW)
    prefill_s, prefill_cpu_s = time.perf_counter() - t0, time.process_time() - c0
    bare = ContextKV(kv.keys, kv.values)  # what the daemon holds: no queries
    with_ids = ContextKV(kv.keys, kv.values, token_ids=kv.token_ids)
    attn = AttentionEvaluator()
    # every layer, the KV's dtype: the reading before issue 26's speed-up, whose errors the
    # aggregations below read in other ways (the default's: --query-attention-only)
    qa = QueryAttentionEvaluator(model_dir=model_dir, calibrate=False, layer_stride=1,
                                 question_dtype="")  # fmt: skip
    qa_keys = QueryAttentionEvaluator(calibrate=False, layer_stride=1)
    scores: dict[str, dict[str, float]] = {}
    cost: dict[str, float] = {}

    def run(name: str, fn: Scorer) -> None:
        scores[name], cost[name] = timed(fn)

    def quality(ev: Any, kv_: ContextKV, queries: Sequence[ProfilingQuery] = ()) -> Scorer:
        return lambda: dict(ev.evaluate(kv_, variants, queries, form=form).quality)

    def attention_question() -> dict[str, float]:
        seen = pass_for_context(model_dir, kv.keys, kv.values, split.query)
        return quality(attn, ContextKV(kv.keys, kv.values, seen.queries))()

    if attention:
        run("attention/window", quality(attn, kv))
        run("attention/keys", quality(attn, bare))
        run("attention/question", attention_question)
    errors: dict[str, torch.Tensor] = {}

    def qa_question() -> dict[str, float]:
        probes = qa.question_probes(kv, split.query)
        errors.update(qa.errors(bare, variants, probes, form))
        return {v: 1.0 - float(e.mean()) for v, e in errors.items()}

    run("query_attention/question", qa_question)
    for name, agg in _aggregations(errors, len(split.query)).items():
        scores[f"query_attention/question/{name}"] = agg
        cost[f"query_attention/question/{name}"] = cost["query_attention/question"]
    run("query_attention/window", quality(qa, with_ids))
    # the key probes themselves (evaluate() would answer from the labels' prior without a model)
    run(
        "query_attention/keys",
        lambda: qa_keys.raw_scores(bare, variants, qa_keys.probes(bare), form),
    )
    if other_answer and lc.case(tok).more_questions:
        other, _ = lc.case(tok).more_questions[0]
        from benchmarks.quality.quality_tasks import split_prompt

        ids = split_prompt(tok, lc.case(tok), question=other).query
        t1 = time.process_time()
        got = answer.answer_ids(kv, ["none", *variants], [ProfilingQuery(token_ids=tuple(ids))],
                                form=form)[0]  # fmt: skip
        decode_s = time.process_time() - t1
        exact = [float(a == got[0]) for a in got[1:]]
        scores["answer/other-exact"] = dict(zip(variants, exact, strict=True))
        cost["answer/other-exact"] = decode_s
        texts = [tok.decode(a, skip_special_tokens=True).strip() for a in got]
        sims, embed_s = timed(lambda: _similarity(answer, texts[0], texts[1:], variants))
        scores["answer/other-similarity"] = sims
        cost["answer/other-similarity"] = decode_s + embed_s
    own = [lc.answers[v] for v in variants]
    sims, embed_s = timed(lambda: _similarity(answer, lc.answers["none"], own, variants))
    label_decode_s = lc.row["full_decode_s"] + lc.row["variants_s"]
    scores["answer/similarity"] = sims
    # the label run's wall times, its decode over its prefill, in this run's prefill CPU time
    cost["answer/similarity"] = label_decode_s / lc.row["prefill_s"] * prefill_cpu_s + embed_s
    scores["answer/exact"] = {v: float(lc.exact[v]) for v in variants}
    cost["answer/exact"] = label_decode_s / lc.row["prefill_s"] * prefill_cpu_s
    return {
        "case": lc.name, "context_tokens": lc.context_tokens, "query_tokens": len(split.query),
        "prefill_s": round(prefill_s, 4), "prefill_cpu_s": round(prefill_cpu_s, 4),
        "cost_cpu_s": {k: round(c, 4) for k, c in cost.items()},
        "scores": {k: {v: round(x, 5) for v, x in s.items()} for k, s in scores.items()},
    }  # fmt: skip


STRIDES = (3, 4, 5)
"""``--query-attention-only``'s readings in bf16: every 3rd (the default), 4th and 5th layer."""


def score_cost_case(ctx: dict[str, Any], lc: LabelledCase) -> dict[str, Any]:
    """``--query-attention-only``: the case's prefill, then ``query_attention`` on its question
    before issue 26's speed-up (``/before``: the LM head in the pass, ``gather`` and prefix
    sums; :mod:`kvtierd.profiler.query_attention_reference`) and after (every layer in the
    KV's dtype, and the question's pass in bf16 read at every :data:`STRIDES`-th layer, the
    pass stopping after the last layer read), each timed in this process beside the prefill
    and beside a prefill as a server runs it (:func:`serving_prefill_cpu_s`)."""
    from kvtierd.profiler.quality import ContextKV, StoredForm
    from kvtierd.profiler.query_attention import Probes, QueryAttentionEvaluator
    from kvtierd.profiler.query_attention_reference import reference_errors
    from kvtierd.profiler.window_queries import pass_for_context

    answer, model_dir = ctx["answer"], ctx["model_dir"]
    variants = list(lc.accuracy)
    split = lc.split(ctx["tokenizer"])
    form = StoredForm(chunk_tokens=CHUNK)
    t0, c0 = time.perf_counter(), time.process_time()
    kv = answer.encode_context(split.context, window=WINDOW)
    prefill_s, prefill_cpu_s = time.perf_counter() - t0, time.process_time() - c0
    serving_cpu_s = serving_prefill_cpu_s(answer, split.context)
    bare = ContextKV(kv.keys, kv.values)
    scores: dict[str, dict[str, float]] = {}
    cost: dict[str, float] = {}

    def before() -> dict[str, float]:
        seen = pass_for_context(model_dir, kv.keys, kv.values, split.query, lm_head=True)
        probes = Probes(seen.queries, seen.keys, seen.values)
        errors = reference_errors(bare, variants, probes, form)
        return {v: 1.0 - float(e.mean()) for v, e in errors.items()}

    def after(stride: int, dtype: str = "") -> Scorer:
        qa = QueryAttentionEvaluator(model_dir=model_dir, calibrate=False, layer_stride=stride,
                                     question_dtype=dtype)  # fmt: skip
        return lambda: qa.raw_scores(bare, variants, qa.question_probes(kv, split.query), form)

    name = "query_attention/question"
    readings = [(f"{name}/before", before), (name, after(1))]
    readings += [(f"{name}/stride{k}-bf16", after(k, "bfloat16")) for k in STRIDES]
    for key, fn in readings:
        scores[key], cost[key] = timed(fn)
    return {
        "case": lc.name, "context_tokens": lc.context_tokens, "query_tokens": len(split.query),
        "prefill_s": round(prefill_s, 4), "prefill_cpu_s": round(prefill_cpu_s, 4),
        "serving_prefill_cpu_s": round(serving_cpu_s, 4),
        "cost_cpu_s": {k: round(c, 4) for k, c in cost.items()},
        "scores": {k: {v: round(x, 6) for v, x in s.items()} for k, s in scores.items()},
    }  # fmt: skip


def _similarity(answer: Any, full: str, others: list[str], variants: list[str]) -> dict[str, float]:
    sims = answer.embedder.similarity([full] * len(others), others)
    return dict(zip(variants, sims, strict=True))


def _aggregations(errors: dict[str, Any], tokens: int) -> dict[str, dict[str, float]]:
    """Other a-priori readings of the same ``[L, H, G*T]`` errors (module docstring)."""
    names = ("last", "last8", "headmax", "stride2", "stride3", "last8-stride2")
    out: dict[str, dict[str, float]] = {n: {} for n in names}
    for v, e in errors.items():
        lyr, h, gt = (int(s) for s in e.shape)
        per = e.reshape(lyr, h, gt // tokens, tokens)  # [L, H, G, T]
        out["last"][v] = 1.0 - float(per[..., -1].mean())
        out["last8"][v] = 1.0 - float(per[..., -8:].mean())
        out["stride2"][v] = 1.0 - float(per[::2].mean())
        out["stride3"][v] = 1.0 - float(per[::3].mean())
        out["last8-stride2"][v] = 1.0 - float(per[::2, ..., -8:].mean())
        out["headmax"][v] = 1.0 - float(per.amax(dim=(1, 2)).mean())
    return out


# ---- agreement -------------------------------------------------------------------------------


def pair_agreement(
    truth: dict[str, float], est: dict[str, float], min_gap: float = 1e-9
) -> tuple[float, int]:
    """(agreeing weight, pairs) over variant pairs whose ``truth`` differs by >= ``min_gap``:
    a pair counts 1 when ``est`` orders it as ``truth`` does, 0.5 when ``est`` ties it."""
    names = [v for v in truth if v in est]
    agree, pairs = 0.0, 0
    for i, a in enumerate(names):
        for b in names[i + 1 :]:
            dt = truth[a] - truth[b]
            if abs(dt) < min_gap:
                continue
            pairs += 1
            de = est[a] - est[b]
            agree += 0.5 if de == 0 else float((de > 0) == (dt > 0))
    return agree, pairs


def prior_scores(labels: list[LabelledCase]) -> dict[str, dict[str, float]]:
    """Leave-one-out mean accuracy per variant (over the other cases labelled with it), by
    case name."""
    total: dict[str, float] = {}
    count: dict[str, int] = {}
    for c in labels:
        for v, a in c.accuracy.items():
            total[v] = total.get(v, 0.0) + a
            count[v] = count.get(v, 0) + 1
    return {
        c.name: {v: (total[v] - a) / max(count[v] - 1, 1) for v, a in c.accuracy.items()}
        for c in labels
    }


def summary_rows(
    rows: list[dict[str, Any]], labels: dict[str, LabelledCase]
) -> list[dict[str, Any]]:
    """Per estimator: agreement (all pairs, big-gap pairs), Spearman, cost, cases."""
    names: list[str] = []
    for row in rows:
        names += [k for k in row["scores"] if k not in names]
    out = []
    for name in names:
        have = [r for r in rows if name in r["scores"]]
        agree = pairs = big_agree = big_pairs = 0.0
        rhos, costs, serving = [], [], []
        for r in have:
            truth = labels[r["case"]].accuracy
            est = r["scores"][name]
            a, p = pair_agreement(truth, est)
            b, q = pair_agreement(truth, est, BIG_GAP)
            agree, pairs, big_agree, big_pairs = agree + a, pairs + p, big_agree + b, big_pairs + q
            names = [v for v in truth if v in est]
            rho = spearman([truth[v] for v in names], [est[v] for v in names])
            if rho is not None:
                rhos.append(rho)
            if name in r.get("cost_cpu_s", {}) and "prefill_cpu_s" in r:
                costs.append(r["cost_cpu_s"][name] / r["prefill_cpu_s"])
                if "serving_prefill_cpu_s" in r:
                    serving.append(r["cost_cpu_s"][name] / r["serving_prefill_cpu_s"])
        out.append({
            "estimator": name, "cases": len(have), "pairs": int(pairs),
            "agree": agree / pairs if pairs else float("nan"),
            "big_pairs": int(big_pairs),
            "big_agree": big_agree / big_pairs if big_pairs else float("nan"),
            "spearman": statistics.fmean(rhos) if rhos else float("nan"),
            "spearman_cases": len(rhos),
            "cost_median": statistics.median(costs) if costs else 0.0,
            "cost_p90": _quantile(costs, 0.9) if costs else 0.0,
            "serving_median": statistics.median(serving) if serving else None,
            "serving_p90": _quantile(serving, 0.9) if serving else None,
        })  # fmt: skip
    return out


# ---- calibration -----------------------------------------------------------------------------


def isotonic(points: Sequence[tuple[float, float, float]]) -> list[tuple[float, float, float]]:
    """Pool-adjacent-violators over ``(x, y, weight)`` sorted by x: blocks ``(x, y, weight)``
    (weighted means) whose ``y`` is non-decreasing in ``x``."""
    blocks: list[list[float]] = []
    for x, y, w in sorted(points):
        blocks.append([x * w, y * w, w])
        while len(blocks) > 1 and blocks[-2][1] / blocks[-2][2] > blocks[-1][1] / blocks[-1][2]:
            x2, y2, w2 = blocks.pop()
            blocks[-1] = [blocks[-1][0] + x2, blocks[-1][1] + y2, blocks[-1][2] + w2]
    return [(bx / w, by / w, w) for bx, by, w in blocks]


def fit_calibration(
    pairs: Sequence[tuple[float, float]], bins: int = 10
) -> tuple[tuple[float, float], ...]:
    """Monotone knots ``(raw, quality)`` from ``(raw score, label)`` pairs: equal-count bins of
    the raw score, their mean labels made non-decreasing (isotonic), and ``(1, 1)`` at the end
    (the original scores 1 and answers as itself)."""
    ordered = sorted(pairs)
    size = max(1, len(ordered) // bins)
    points = []
    for i in range(0, len(ordered), size):
        chunk = ordered[i : i + size]
        xs = [x for x, _ in chunk]
        ys = [y for _, y in chunk]
        points.append((statistics.fmean(xs), statistics.fmean(ys), float(len(chunk))))
    knots = [(round(x, 4), round(y, 4)) for x, y, _ in isotonic(points)]
    knots = [k for k in knots if k[0] < 1.0]
    return (*knots, (1.0, 1.0))


def calibration_report(rows: list[dict[str, Any]], labels: dict[str, LabelledCase]) -> str:
    """The calibration of ``query_attention/question`` to exact match and to accuracy: fitted
    on the even cases, judged on the odd (mean absolute error per variant of the predicted
    share, against the unfitted raw score), then the knots fitted on every case."""
    from kvtierd.profiler.quality_tables import calibrate

    name = "query_attention/question"
    have = [r for r in rows if name in r["scores"]]

    def pairs(rs: list[dict[str, Any]], label: str) -> list[tuple[float, float]]:
        out = []
        for r in rs:
            lc = labels[r["case"]]
            truth = lc.exact if label == "exact" else lc.accuracy
            out += [(r["scores"][name][v], float(truth[v])) for v in truth]
        return out

    lines = ["\n**Calibration of query_attention/question** (raw score -> share)\n"]
    for label in ("exact", "accuracy"):
        fit, test = have[0::2], have[1::2]
        knots = fit_calibration(pairs(fit, label))
        test_pairs = pairs(test, label)
        mae_cal = statistics.fmean(abs(calibrate(x, knots) - y) for x, y in test_pairs)
        mae_raw = statistics.fmean(abs(x - y) for x, y in test_pairs)
        share = _variant_share_error(test, labels, name, knots, label)
        lines.append(
            f"- {label}: fitted on {len(fit)} cases, held-out {len(test)}: per (case, variant) "
            f"mean |predicted - label| {mae_cal:.3f} (raw score as the prediction: "
            f"{mae_raw:.3f}); per variant, |mean predicted - mean label| {share:.3f}"
        )
        lines.append(f"  - knots on all {len(have)} cases: {fit_calibration(pairs(have, label))}")
    return "\n".join(lines) + "\n"


def _variant_share_error(
    rows: list[dict[str, Any]],
    labels: dict[str, LabelledCase],
    name: str,
    knots: tuple[tuple[float, float], ...],
    label: str,
) -> float:
    from kvtierd.profiler.quality_tables import calibrate

    pred: dict[str, list[float]] = {}
    true: dict[str, list[float]] = {}
    for r in rows:
        lc = labels[r["case"]]
        truth = lc.exact if label == "exact" else lc.accuracy
        for v in truth:
            pred.setdefault(v, []).append(calibrate(r["scores"][name][v], knots))
            true.setdefault(v, []).append(float(truth[v]))
    return statistics.fmean(
        abs(statistics.fmean(pred[v]) - statistics.fmean(true[v])) for v in pred
    )


def constants(
    rows: list[dict[str, Any]],
    labels: dict[str, LabelledCase],
    name: str = "query_attention/question",
) -> str:
    """``CALIBRATION`` (exact match, every scored case) and ``PRIOR`` (mean exact match per
    method and ratio over every labelled case, ratios labelled on 5 cases or more, made
    non-decreasing in the ratio) for ``kvtierd/profiler/query_attention.py``; the calibration
    of the raw scores of the reading ``name``."""
    from kvtierd.variants import parse_variant

    pairs = [(r["scores"][name][v], float(labels[r["case"]].exact[v]))
             for r in rows if name in r["scores"] for v in labels[r["case"]].exact]  # fmt: skip
    shares: dict[str, dict[float, list[int]]] = {}
    for c in labels.values():
        for v, e in c.exact.items():
            p = parse_variant(v)
            shares.setdefault(p.method_name, {}).setdefault(p.ratio, []).append(e)
    # ratios labelled on at least 5 cases, the share made non-decreasing in the ratio
    prior = {
        m: tuple((round(r, 3), round(y, 3)) for r, y, _ in
                 isotonic([(r, statistics.fmean(es), len(es)) for r, es in by.items()
                           if len(es) >= 5]))
        for m, by in sorted(shares.items())
    }  # fmt: skip
    return f"CALIBRATION = {fit_calibration(pairs)}\nPRIOR = {prior}\n"


def _quantile(xs: list[float], q: float) -> float:
    s = sorted(xs)
    return s[min(len(s) - 1, int(q * len(s)))]


def table(summary: list[dict[str, Any]]) -> str:
    """The summary as markdown; a column of the cost over a serving prefill when the rows
    timed one (``--query-attention-only``)."""
    serving = any(s.get("serving_median") is not None for s in summary)
    lines = [
        "| estimator | cases | pairs agreeing (ties ½) | pairs with Δacc ≥ 0.25 agreeing "
        "| mean Spearman (cases) | cost / prefill, median (p90) |"
        + (" cost / serving prefill, median (p90) |" if serving else ""),
        "|---|---|---|---|---|---|" + ("---|" if serving else ""),
    ]
    for s in summary:
        line = (
            f"| {s['estimator']} | {s['cases']} | {s['agree']:.3f} ({s['pairs']}) | "
            f"{s['big_agree']:.3f} ({s['big_pairs']}) | {s['spearman']:.3f} "
            f"({s['spearman_cases']}) | {s['cost_median']:.3f} ({s['cost_p90']:.3f}) |"
        )
        if serving:
            med, p90 = s.get("serving_median"), s.get("serving_p90")
            line += f" {med:.3f} ({p90:.3f}) |" if med is not None else " — |"
        lines.append(line)
    return "\n".join(lines) + "\n"


def plot(summary: list[dict[str, Any]], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7.5, 4.8))
    for s in summary:
        if s["estimator"].count("/") > 1 or s["estimator"] == "query_attention/window":
            continue
        x = max(s["cost_median"], 1e-3)
        ax.scatter(x, s["agree"], s=30)
        ax.annotate(s["estimator"], (x, s["agree"]), fontsize=7, xytext=(4, 2),
                    textcoords="offset points")  # fmt: skip
    ax.axvline(0.10, color="grey", ls="--", lw=0.8)
    ax.text(0.105, ax.get_ylim()[0] + 0.01, "10% of a prefill", fontsize=7, color="grey")
    ax.set_xscale("log")
    ax.set_xlabel("cost per context for the grid / the context's prefill (median, log)")
    ax.set_ylabel("share of variant pairs ordered as accuracy")
    ax.set_title("Quality estimators on the labelled cases")
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)


def report(out: Path, label_files: Sequence[Path] = (LABELS,)) -> str:
    labels = {c.name: c for path in label_files for c in load_labels(path)}
    rows = [r for r in read_jsonl(out) if r["case"] in labels]
    priors = prior_scores(list(labels.values()))
    for r in rows:
        r["scores"]["prior"] = priors[r["case"]]
        r.setdefault("cost_cpu_s", {})["prior"] = 0.0
    add_blends(rows, labels, priors)
    summary = summary_rows(rows, labels)
    if out == SCORES:  # the figure is of the full run's estimators only
        plot(summary, FIGURE)
    odd = summary_rows(rows[1::2], labels)
    held = [s for s in odd if s["estimator"].startswith("query_attention/question")]
    return (
        table(summary)
        + "\n**query_attention/question aggregations on the odd cases only**\n\n"
        + table(held)
        + calibration_report(rows, labels)
    )


def add_blends(
    rows: list[dict[str, Any]], labels: dict[str, LabelledCase], priors: dict[str, Any]
) -> None:
    """``query_attention/{question,window}+prior``: the evaluator's default reading — its raw
    score calibrated (knots fitted on the even cases' exact match), averaged with equal weights
    with the leave-one-out prior — at its raw score's cost."""
    from kvtierd.profiler.quality_tables import calibrate

    blended = ("query_attention/question", "query_attention/window",
               *(f"query_attention/question/{k}" for k in ("before", "stride2", "stride3", "bf16",
                                                          "stride3-bf16", "stride4-bf16",
                                                          "stride5-bf16")))  # fmt: skip
    for name in blended:
        fit = [r for r in rows[0::2] if name in r["scores"]]
        if not fit:
            continue
        knots = fit_calibration([(r["scores"][name][v], float(labels[r["case"]].exact[v]))
                                 for r in fit for v in labels[r["case"]].exact])  # fmt: skip
        for r in rows:
            if name in r["scores"]:
                prior = priors[r["case"]]
                r["scores"][f"{name}+prior"] = {
                    v: 0.5 * calibrate(x, knots) + 0.5 * prior[v]
                    for v, x in r["scores"][name].items()
                }
                if name in r.get("cost_cpu_s", {}):
                    r["cost_cpu_s"][f"{name}+prior"] = r["cost_cpu_s"][name]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, default=SCORES)
    parser.add_argument("--labels", type=Path, nargs="+", default=[LABELS],
                        help="label files (quality_labels.py)")  # fmt: skip
    parser.add_argument("--answer-cases", type=int, default=8,
                        help="cases also scored by `answer` on another question")  # fmt: skip
    parser.add_argument("--threads", type=int, default=1,
                        help="torch threads: 1, as the label run (2 threads on 2 shared cores "
                             "ran small ops ~9x slower here)")  # fmt: skip
    parser.add_argument("--limit", type=int, default=0, help="at most this many cases")
    parser.add_argument("--attention-every", type=int, default=1,
                        help="the `attention` evaluators (1-4 prefills each) on every k-th "
                             "case only")  # fmt: skip
    parser.add_argument("--query-attention-only", action="store_true",
                        help="only query_attention on the question, before and after issue "
                             "26's speed-up (score_cost_case); use another --out")  # fmt: skip
    parser.add_argument("--report", action="store_true", help="only the table and the plot")
    parser.add_argument("--constants-of", default="query_attention/question",
                        help="the reading whose raw scores --constants calibrates")  # fmt: skip
    parser.add_argument("--constants", action="store_true",
                        help="print CALIBRATION and PRIOR fitted on the labels")  # fmt: skip
    args = parser.parse_args()
    if args.constants:
        labels = {c.name: c for path in args.labels for c in load_labels(path)}
        rows = [r for r in read_jsonl(args.out) if r["case"] in labels]
        print(constants(rows, labels, args.constants_of))
        return
    if not args.report:
        run(args)
    print(report(args.out, args.labels))


def run(args: argparse.Namespace) -> None:
    import torch
    from transformers import AutoTokenizer

    from kvtierd.model_fetch import fetch_model
    from kvtierd.profiler.answer import AnswerEvaluator

    torch.set_num_threads(args.threads)
    model = fetch_model(log=print)
    answer = AnswerEvaluator(str(model), max_new_tokens=16, max_batch=33)
    answer.load()[0].to(torch.float32)
    from kvtierd.profiler.window_queries import window_model

    window_model(str(model), torch.float32, torch.device("cpu"))  # loaded before any timing
    if args.query_attention_only:  # the bf16 readings' pass
        window_model(str(model), torch.bfloat16, torch.device("cpu"))
    ctx = {"tokenizer": AutoTokenizer.from_pretrained(model), "answer": answer,
           "model_dir": str(model)}  # fmt: skip
    labels = [c for path in args.labels for c in load_labels(path)]
    if args.limit:
        labels = labels[: args.limit]
    done = {r["case"] for r in read_jsonl(args.out)}
    with_other = sum("answer/other-exact" in r["scores"] for r in read_jsonl(args.out))
    print(f"{len(labels)} labelled cases, {len(done)} scored; {machine()}", flush=True)
    for lc in labels:
        if lc.name in done:
            continue
        other = with_other < args.answer_cases
        index = labels.index(lc)
        if args.query_attention_only:
            row = score_cost_case(ctx, lc)
        else:
            row = score_case(ctx, lc, other, attention=index % args.attention_every == 0)
        with_other += "answer/other-exact" in row["scores"]
        with args.out.open("a") as f:
            f.write(json.dumps(row) + "\n")
        costs = ", ".join(f"{k} {c / row['prefill_cpu_s']:.3f}"
                          for k, c in row["cost_cpu_s"].items() if k.count("/") == 1)  # fmt: skip
        print(f"{lc.name}: prefill {row['prefill_cpu_s']:.2f} s CPU; cost/prefill {costs}",
              flush=True)  # fmt: skip


if __name__ == "__main__":
    main()
