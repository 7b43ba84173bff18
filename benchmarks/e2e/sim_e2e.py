"""The simulator's prediction for ``bench_e2e.py``'s workload, beside the measurement (issue 13).

    python -m benchmarks.e2e.sim_e2e --quality benchmarks/out/quality/cases.jsonl  # after bench_e2e
    python -m benchmarks.e2e.sim_e2e --calibration configs/sim/smollm2-vllm-cpu.yaml

Give it the workload arguments ``bench_e2e`` ran with (the defaults are the same). It rebuilds
that workload: the contexts (their token counts, through the tokenizer), the warm-up pass (each
context's first questions, one at a time), the timed requests (Zipf context, question, Azure-trace
arrival) and the tier capacities (those a measured kvtierd system's daemon ran with, else
bench_e2e's rule), and writes it as ``<out>/workload.json`` in ``kvtierd sim
predict``'s format. With ``--system-prompt-tokens N`` the contexts count the system prompt and
the file says ``shared_prefix_tokens`` (its whole chunks, the KV every context shares), which
the simulator serves as one more context every request needs (``kvtierd/sim/replay.py``).
Per context, the quality of each variant is bench_quality's measured
similarity (``--quality cases.jsonl``: the same case, else the mean of its task and length),
else the calibration's.

What the measured stack had is taken from ``<out>`` (issue 30, ``e2e_measured.py``): the KV
dtype its cached systems' vLLM kept (float32 on an AMX CPU: the contexts' sizes against the
tiers), the tiers its daemons ran with, LMCache's tiers as it holds them (the disk holds the
CPU's chunks too) and each ``fixed-<V>`` system's measured similarity as ``V``'s quality where
``--quality`` gives none, and what the EvicPress daemon's estimator profiled as each context's
``profile``: what its placer was offered and decided on. The calibration is fitted from the
measurements in ``<out>``
(``e2e_calibration.py``: the ``prefill`` system's line and decode hold from its own requests,
the cached systems' line from their warm-ups and misses, the tiers from the hits of ``lru``
and of the quantized fixed systems for kvtierd and of ``lmcache`` for LMCache) and written as
``<out>/calibration-<backend>.yaml``, unless ``--calibration`` names a file. Each
``bench_e2e`` system is simulated with the matching placer: ``prefill``; ``lmcache`` and
``lru`` as ``lru``; ``fixed-<V>`` as ``fixed:<V>``; ``evicpress-a<alpha>`` as EvicPress on
bench_e2e's policy grid, frequencies learned online; the kvtierd ones offered what the daemon
offers (:data:`kvtierd.sim.offers.DAEMON`; bench_e2e's warm-up is each context's first request)
and their lookups holding what they find (:data:`HOLD_S`, ``kvtierd/sim/executing.py``).
Where ``<out>/<system>.json`` holds a measurement, the table puts the predicted TTFT (mean /
p50 / p90, with queueing at the measured arrival times) beside the measured one, their ratio,
the hits predicted and measured (vLLM's log), and per class of request the simulator predicts
(a tier, recompute, miss) the measured mean TTFT of those same requests; then the TTFT
reduction at equal quality the simulator predicts. A measurement whose requests differ from
the rebuilt ones (other arguments) is refused.

Writes ``<out>/simulated.md`` and ``<out>/simulated.json`` (docs/simulator.md).
:func:`simulate_run` does the same for one run's arguments and returns what it wrote, with
per system the ratio of predicted to measured mean TTFT (one seed of a multi-seed run).
"""

from __future__ import annotations

import argparse
import json
import statistics
from collections import defaultdict
from dataclasses import replace
from pathlib import Path
from typing import Any

import yaml

from benchmarks._support.common import REPO, machine
from benchmarks.e2e.bench_e2e import (
    MAX_MODEL_LEN,
    _first_asks,
    _pct,
    kv_bytes_per_token,
    reductions,
    shared_tokens,
    systems,
    tier_sizes,
    workload_args,
)
from benchmarks.e2e.e2e_calibration import TIER_SOURCE, Lengths, fit_calibrations, measured_hits
from benchmarks.e2e.e2e_measured import (
    estimator_profiles,
    inclusive,
    kv_dtype_bytes,
    measured_quality,
    measured_sizes,
)
from benchmarks.e2e.e2e_workload import (
    check_fits,
    make_documents,
    make_requests,
    trace_gaps,
)
from benchmarks.quality.quality_tasks import Case
from kvtierd.integrations.plugin_settings import PluginSettings
from kvtierd.policies.loader import parse_policy
from kvtierd.sim.calibration import Calibration, load_calibration
from kvtierd.sim.given import GivenWorkload, measured_variants, parse_workload
from kvtierd.sim.offers import DAEMON
from kvtierd.sim.predict import Prediction, predict
from kvtierd.sim.replay import SimulationConfig
from kvtierd.sim.variant_space import Form
from kvtierd.variants import expand_variants

WITHIN = 0.25  # the goal: the prediction within 25% of the measurement
HOLD_S = PluginSettings().hold_s
"""How long a kvtierd system's lookups hold what they find (bench_e2e's LMCache configuration
leaves the plugin's ``kvtierd.hold_s`` at its default): the simulated daemon defers dropping or
compressing a held context (``kvtierd/sim/executing.py``)."""
UNLOADED = ("miss", "recompute", "prefix")
"""Classes of request that did not load their whole context (the rest name a tier)."""


def model_preset(model: Path, dtype_bytes: int = 2) -> dict[str, Any]:
    """The model's geometry in ``kvtierd sim``'s workload format (from its config.json), its KV
    kept in ``dtype_bytes`` per element."""
    cfg = json.loads((model / "config.json").read_text())
    heads = cfg["num_attention_heads"]
    return {"name": model.name, "layers": cfg["num_hidden_layers"], "q_heads": heads,
            "kv_heads": cfg["num_key_value_heads"],
            "head_dim": cfg.get("head_dim") or cfg["hidden_size"] // heads,
            "active_params": float(cfg.get("num_parameters", 1.35e8)),
            "max_context_tokens": cfg.get("max_position_embeddings", 8192),
            "dtype_bytes": dtype_bytes}  # fmt: skip


def case_qualities(path: Path | None) -> dict[str, dict[str, float]]:
    """bench_quality's ``cases.jsonl``: mean similarity per variant, by case name and by
    ``task/length`` (its mean over cases)."""
    if path is None:
        return {}
    sums: dict[str, dict[str, list[float]]] = defaultdict(lambda: defaultdict(list))
    for line in path.read_text().splitlines():
        if not line.strip():
            continue
        row = json.loads(line)
        for key in (row["case"], f"{row['task']}/{row['length']}"):
            for variant, r in row["results"].items():
                sums[key][variant].append(float(r["similarity"]))
    return {k: {v: statistics.fmean(xs) for v, xs in d.items()} for k, d in sums.items()}


def build_workload(args: argparse.Namespace, tokenizer: Any, model: Path) -> dict[str, Any]:
    """bench_e2e's workload as ``kvtierd sim predict`` reads it (module docstring), its KV
    sizes in the dtype the measurement kept it in (:func:`kv_dtype_bytes`)."""
    try:
        docs = make_documents(tokenizer, args.workload, n=args.contexts, lengths=args.lengths,
                              seed=args.seed, chunk_tokens=args.chunk,
                              system_tokens=args.system_prompt_tokens)  # fmt: skip
        contexts, table = docs.contexts, docs.table
        check_fits(table, max_model_len=MAX_MODEL_LEN, max_tokens=0,
                   system_tokens=args.system_prompt_tokens)  # fmt: skip
    except ValueError as e:
        raise SystemExit(f"error: {e}") from e
    timed = make_requests(contexts, num=args.requests, qps=args.qps, zipf_s=args.zipf,
                          seed=args.seed, gaps=trace_gaps())  # fmt: skip
    quality = case_qualities(args.quality)
    profiled = estimator_profiles(args.out)
    shared = shared_tokens(args)
    ctx_rows = []
    for case, row in zip(contexts, table, strict=True):
        group = case.task if isinstance(case, Case) else case.kind  # --workload kinds: KindCase
        own = quality.get(case.name) or quality.get(f"{group}/{case.length}") or {}
        ctx: dict[str, Any] = {"tokens": row[0].context_tokens, "quality": own}
        if profile := profiled.get(row[0].context_tokens - shared):  # its own tokens'
            ctx["profile"] = profile
        ctx_rows.append(ctx)
    warm = _first_asks(table, args.warmup_questions)  # one at a time, before the timed run
    requests = []
    for k, r in enumerate(warm):
        p = table[r.context][r.question]
        requests.append({"index": -1 - k, "at_s": -1.0 - len(warm) + k, "context": r.context,
                         "question": r.question, "measured": False,
                         "query_tokens": len(p.ids) - p.context_tokens})  # fmt: skip
    for r in timed:
        p = table[r.context][r.question]
        requests.append({"index": r.index, "at_s": r.at_s, "context": r.context,
                         "question": r.question,
                         "query_tokens": len(p.ids) - p.context_tokens})  # fmt: skip
    sizes = measured_sizes(args.out) or tier_sizes(table, kv_bytes_per_token(model), args)
    tiers = [{"name": name, "capacity_bytes": size} for name, size in sizes.items()]
    preset = model_preset(model, kv_dtype_bytes(args.out, model))
    doc = {"model": preset, "tiers": tiers, "contexts": ctx_rows, "requests": requests,
           "chunk_tokens": args.chunk}  # fmt: skip
    if shared:  # absent without one: the file as before the option
        doc["shared_prefix_tokens"] = shared
    return doc


def placer_for(
    name: str, policy: dict[str, Any] | None
) -> tuple[SimulationConfig, tuple[str, ...]]:
    """A bench_e2e system as a simulated placer and the variants it may use (``()``: all
    measured)."""
    if name == "prefill":
        return SimulationConfig(placer="prefill", warmup_fraction=0.0), ()
    if policy is None:  # lmcache: its own LRU, no daemon to hold what a lookup found
        return SimulationConfig(placer="lru", warmup_fraction=0.0), ()
    if policy["placer"] == "lru":
        return SimulationConfig(placer="lru", warmup_fraction=0.0, hold_s=HOLD_S), ()
    p = parse_policy(yaml.safe_dump(policy), name)
    spec = f"fixed:{p.fixed_variant}" if p.placer == "fixed" else p.placer
    cfg = SimulationConfig(placer=spec, alpha=p.alpha, selection=p.selection,
                           half_life_s=p.frequency_half_life_s, warmup_fraction=0.0,
                           offers=DAEMON, hold_s=HOLD_S)  # fmt: skip
    grid = (p.fixed_variant,) if p.placer == "fixed" else expand_variants(p.methods, p.ratios)
    return cfg, grid


def compare(
    pred: Prediction,
    measured: dict[str, Any],
    doc: dict[str, Any],
    hits: dict[int, bool] | None = None,
) -> dict[str, Any]:
    """Predicted vs measured TTFT over the requests both have (measured errors left out), and
    the number of them that loaded their context, predicted and (``hits``: vLLM's log)
    measured, with the requests where the two disagree (``disagree``: per side, each
    request's index, context, predicted class and measured TTFT): where to look first when
    a row is off (issue 30: seed 2's EvicPress, predicted to load 4 contexts vLLM computed)."""
    timed = {r["index"]: r for r in doc["requests"] if r.get("measured", True)}
    outs = {o["index"]: o for o in measured["outcomes"] if not o["error"]}
    for i, o in outs.items():
        r = timed.get(i)
        if r is None or (r["context"], r["question"]) != (o["context"], o["question"]):
            raise SystemExit(f"request {i} of the measurement is not the rebuilt workload's: "
                             "run sim_e2e with the arguments bench_e2e ran with")  # fmt: skip
    pairs = [(t, outs[i]["ttft_s"], s) for i, t, s in
             zip(pred.ids, pred.ttft_s.tolist(), pred.result.served_as(), strict=True)
             if i in outs]  # fmt: skip
    got = sorted(m for _, m, _ in pairs)
    want = sorted(t for t, _, _ in pairs)
    classes: dict[str, list[tuple[float, float]]] = defaultdict(list)
    for t, m, s in pairs:
        classes[s].append((t, m))
    # a hit loads its whole context, as measured_hits counts (``prefix``: the system prompt only)
    loaded = sum(s not in UNLOADED for _, _, s in pairs)
    logged = None if hits is None else sum(hits.get(i, False) for i in outs)
    disagree: dict[str, list[dict[str, Any]]] = {"predicted_loaded": [], "measured_loaded": []}
    for i, s in zip(pred.ids, pred.result.served_as(), strict=True):
        if hits is None or i not in outs or (s not in UNLOADED) == hits.get(i, False):
            continue
        side = "measured_loaded" if hits.get(i, False) else "predicted_loaded"
        disagree[side].append({"index": i, "context": outs[i]["context"], "predicted": s,
                               "ttft_s": outs[i]["ttft_s"]})  # fmt: skip
    return {
        "requests": len(pairs),
        "hits": {"predicted": loaded, "measured": logged},
        "disagree": disagree,
        "measured": {"mean": statistics.fmean(got), "p50": _pct(got, 50), "p90": _pct(got, 90)},
        "predicted": {"mean": statistics.fmean(want), "p50": _pct(want, 50),
                      "p90": _pct(want, 90)},
        "by_class": {s: {"requests": len(v), "predicted": statistics.fmean(t for t, _ in v),
                         "measured": statistics.fmean(m for _, m in v)}
                     for s, v in classes.items()},
    }  # fmt: skip


def role(name: str, args: argparse.Namespace) -> str:
    """What a system's measurement did for the calibration fitted from it (``held out``: its
    timed hits fitted nothing; a cached system's warm-up and misses time the prefill line)."""
    if args.calibration is not None:
        return f"held out ({args.calibration.name})"
    if name == "prefill":
        return "fitted its prefill line and decode_s"
    if name in TIER_SOURCE.values():
        return "fitted the tiers"
    form = Form.of(name.removeprefix("fixed-")) if name.startswith("fixed-") else None
    if form is not None and form.quant and not form.method:
        return "fitted the tiers (its hits, at their bytes)"
    return "held out"


def report(
    rows: dict[str, dict[str, Any]], measured: dict[str, dict[str, Any]], args: argparse.Namespace
) -> str:
    """The prediction beside the measurement per system, then the TTFT reduction at equal
    quality as the simulator predicts it (bench_e2e's rule, on predicted rows)."""
    lines = [f"{machine()}; workload {args.out / 'workload.json'}\n",
             "| system | calibration | predicted quality / measured similarity | predicted TTFT "
             "mean / p50 / p90 (s) | measured (s) | predicted / measured (mean) | hits "
             "predicted / measured | served as predicted: predicted / measured mean TTFT "
             "(requests) |", "|---|---|---|---|---|---|---|---|"]  # fmt: skip
    for name, r in rows.items():
        p, c = r["prediction"], r.get("comparison")
        sim = measured.get(name, {}).get("similarity")
        quality = f"{p['quality_mean']:.3f} / " + ("-" if sim is None else f"{sim:.3f}")
        cell = f"{p['ttft_mean_s']:.2f} / {p['ttft_p50_s']:.2f} / {p['ttft_p90_s']:.2f}"
        head = f"| {name} | {role(name, args)} | {quality} | {cell} |"
        if c is None:
            lines.append(f"{head} not measured | - | - | - |")
            continue
        m, ratio = c["measured"], c["predicted"]["mean"] / c["measured"]["mean"]
        verdict = "within 25%" if abs(ratio - 1) <= WITHIN else "OFF"
        by = "; ".join(f"{s} {v['predicted']:.2f} / {v['measured']:.2f} ({v['requests']})"
                       for s, v in sorted(c["by_class"].items()))  # fmt: skip
        got = f"{m['mean']:.2f} / {m['p50']:.2f} / {m['p90']:.2f}"
        h = c["hits"]
        hit = f"{h['predicted']} / {'-' if h['measured'] is None else h['measured']}"
        lines.append(f"{head} {got} | {ratio:.2f} ({verdict}) | {hit} | {by} |")
    lines += disagreements(rows)
    predicted = {
        k: {
            "ttft_mean_s": r["prediction"]["ttft_mean_s"],
            "similarity": r["prediction"]["quality_mean"],
        }
        for k, r in rows.items()
    }
    lines += ["\nPredicted TTFT reduction at equal quality (within 3 points):\n",
              "| baseline | its TTFT (s) | best EvicPress within 3% | reduction |",
              "|---|---|---|---|", *reductions(predicted, _within_3_points)]  # fmt: skip
    return "\n".join(lines) + "\n"


def _within_3_points(ours: dict[str, Any], base: dict[str, Any]) -> bool:
    """Equal quality for a prediction: the simulator predicts a similarity, not which answers
    stay identical, so its rule stays the similarity within 3 points (bench_e2e's before issue
    39)."""
    return bool(ours["similarity"] >= base["similarity"] - 0.03)


def disagreements(rows: dict[str, dict[str, Any]], most: int = 8) -> list[str]:
    """Per measured system, the requests the simulator predicts to load their context where
    vLLM computed it, and the other way (index, context, measured TTFT; the first ``most``)."""
    lines = []
    for name, r in rows.items():
        d = r.get("comparison", {}).get("disagree", {})
        for side, what in (("predicted_loaded", "predicted loaded, measured computed"),
                           ("measured_loaded", "predicted computed, measured loaded")):  # fmt: skip
            got = d.get(side, [])
            if got:
                shown = ", ".join(f"{x['index']} (c{x['context']}, {x['ttft_s']:.2f} s)"
                                  for x in got[:most])  # fmt: skip
                more = f" and {len(got) - most} more" if len(got) > most else ""
                lines.append(f"- {name}: {what}: {len(got)} requests: {shown}{more}")
    return (
        ["\nRequests where the prediction and vLLM disagree on loading the context:\n", *lines]
        if lines
        else []
    )


def calibrations(
    args: argparse.Namespace, doc: dict[str, Any], kv_per_token: int
) -> dict[str, Calibration]:
    """Per backend (``none``: the ``prefill`` system, ``kvtierd``, ``lmcache``), the
    calibration to predict it with: the file ``--calibration`` names, else fitted from the
    measurements in ``--out`` (:func:`benchmarks.e2e.e2e_calibration.fit_calibrations`)."""
    if args.calibration is not None:
        cal = load_calibration(args.calibration, kv_per_token)
        return {"none": cal, "kvtierd": cal, "lmcache": cal}
    return fit_calibrations(args.out, doc, kv_per_token)


def simulate_run(args: argparse.Namespace, model: Path | None = None) -> dict[str, Any]:
    """Predict every system of one bench_e2e run (``args``: its workload arguments, as
    :func:`benchmarks.e2e.bench_e2e.workload_args` parses them, with ``out`` its output directory,
    ``calibration`` and ``quality`` as this command's options, ``None`` for none) and put each
    beside its measurement. Writes ``workload.json``, ``calibration-*.yaml``, ``simulated.md``
    and ``simulated.json`` into ``args.out`` and returns what ``simulated.json`` holds:
    ``{"calibration", "systems": {name: {"prediction", "classes", "comparison"}}, "ratios":
    {name: predicted / measured mean TTFT}}`` (one seed's directory of a multi-seed run).
    bench_e2e's own arguments will do: without ``calibration`` and ``quality`` it fits the
    calibration from ``out`` and takes the fixed systems' measured quality."""
    from transformers import AutoTokenizer

    args = argparse.Namespace(**{"calibration": None, "quality": None, **vars(args)})

    if model is None:
        from kvtierd.model_fetch import fetch_model

        model = fetch_model(log=print)
    doc = build_workload(args, AutoTokenizer.from_pretrained(model), model)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "workload.json").write_text(json.dumps(doc, indent=1))
    given = parse_workload(doc, str(args.out / "workload.json"))
    cals = calibrations(args, doc, given.workload.model.kv_bytes_per_token)
    lengths = Lengths(doc)
    every = systems(args.alphas, args.fixed, model, args.evicpress_methods,
                    args.evicpress_ratios, label=args.evicpress_label)  # fmt: skip
    measured = {n: json.loads(p.read_text()) for n in every
                if (p := args.out / f"{n}.json").exists()}  # fmt: skip
    seen = measured_quality(args.out)
    cals = {b: replace(c, quality={**seen, **c.quality}) for b, c in cals.items()}
    rows = {}
    for name in args.systems or list(every):
        backend = every[name].backend
        if backend not in cals:
            continue
        on = inclusive(given) if backend == "lmcache" else given
        row = simulate(name, every[name].policy, on, cals[backend])
        if row is None:
            continue
        pred = row.pop("_prediction")
        if name in measured:
            log = args.out / "work" / name / "vllm.log"
            hits = measured_hits(measured[name], lengths, log)
            row["comparison"] = compare(pred, measured[name], doc, hits)
        rows[name] = row
        print(f"  {name}: predicted mean TTFT {row['prediction']['ttft_mean_s']:.2f} s", flush=True)
    summary = args.out / "summary.json"
    measured_rows = json.loads(summary.read_text()) if summary.exists() else {}
    text = report(rows, measured_rows, args)
    (args.out / "simulated.md").write_text(text)
    ratios = {n: r["comparison"]["predicted"]["mean"] / r["comparison"]["measured"]["mean"]
              for n, r in rows.items() if "comparison" in r}  # fmt: skip
    result = {"calibration": {b: c.summary() for b, c in cals.items()}, "systems": rows,
              "ratios": ratios}  # fmt: skip
    (args.out / "simulated.json").write_text(json.dumps(result, indent=1))
    print(text)
    return result


def parser() -> argparse.ArgumentParser:
    """This command's arguments: bench_e2e's workload arguments, ``--calibration``,
    ``--quality``, ``--out``, and bench_e2e's other arguments, accepted so that a run's own
    command line predicts it (they do not change what the simulator is given)."""
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    workload_args(p)
    p.add_argument(
        "--calibration",
        type=Path,
        help="a calibration file (default: fitted from the measurements in --out)",
    )
    p.add_argument("--quality", type=Path, help="bench_quality's cases.jsonl")
    p.add_argument("--out", type=Path, default=REPO / "benchmarks/out/e2e")
    unused = "bench_e2e's; not used by the prediction"
    p.add_argument("--max-tokens", type=int, help=unused)
    p.add_argument("--settle-s", type=float, help=unused)
    p.add_argument("--daemon-log-level", help=unused)
    return p


def simulate_argv(argv: list[str]) -> dict[str, Any]:
    """:func:`simulate_run` for a run given as bench_e2e's command line (its arguments after
    ``-m benchmarks.e2e.bench_e2e``, with ``--out`` the run's directory)."""
    return simulate_run(parser().parse_args(argv))


def main() -> None:
    simulate_run(parser().parse_args())


def simulate(
    name: str, policy: dict[str, Any] | None, given: GivenWorkload, cal: Calibration
) -> dict[str, Any] | None:
    """One system's prediction (``None``, with a note, when its fixed variant has no measured
    quality)."""
    cfg, grid = placer_for(name, policy)
    have = measured_variants(given, cal)
    fixed = cfg.placer.partition(":")[2]
    if fixed and fixed not in have:
        print(f"  {name}: skipped, no quality measured for {fixed} (--quality, or the "
              "calibration's quality)", flush=True)  # fmt: skip
        return None
    pred = predict(cfg, given, cal, [v for v in grid if v in have] if grid else None)
    return {"prediction": pred.summary(), "classes": pred.by_class(), "_prediction": pred}


if __name__ == "__main__":
    main()
