"""The simulator's prediction for ``bench_e2e.py``'s workload, beside the measurement (issue 13).

    python -m benchmarks.sim_e2e                       # after python -m benchmarks.bench_e2e
    python -m benchmarks.sim_e2e --calibration my.yaml --quality benchmarks/out/quality/cases.jsonl

Give it the workload arguments ``bench_e2e`` ran with (the defaults are the same). It rebuilds
that workload: the contexts (their token counts, through the tokenizer), the warm-up pass (each
context once, its main question), the timed requests (Zipf context, question, Azure-trace
arrival) and the tier capacities, and writes it as ``<out>/workload.json`` in ``kvtierd sim
predict``'s format. Per context, the quality of each variant is bench_quality's measured
similarity (``--quality cases.jsonl``: the same case, else the mean of its task and length),
else the calibration's.

Each ``bench_e2e`` system is simulated with the matching placer: ``prefill``; ``lmcache`` and
``lru`` as ``lru``; ``fixed-<V>`` as ``fixed:<V>``; ``evicpress-a<alpha>`` as EvicPress on
bench_e2e's policy grid, frequencies learned online. The calibration (``--calibration``,
default ``configs/sim/smollm2-vllm-cpu.yaml``) holds the stack's prefill line, load model per
tier and variant qualities, measured one request at a time. Where ``<out>/<system>.json``
holds a measurement, the table puts the predicted TTFT (mean / p50 / p90, with queueing at the
measured arrival times) beside the measured one, their ratio, and per class of request the
simulator predicts (a tier, recompute, miss) the measured mean TTFT of those same requests.
A measurement whose requests differ from the rebuilt ones (other arguments) is refused.

Writes ``<out>/simulated.md`` and ``<out>/simulated.json``.
"""

from __future__ import annotations

import argparse
import json
import statistics
from collections import defaultdict
from pathlib import Path
from typing import Any

import yaml

from benchmarks.bench_e2e import kv_bytes_per_token, systems
from benchmarks.common import REPO, machine
from benchmarks.e2e_workload import make_contexts, make_requests, prompts, trace_gaps
from kvtierd.policy_config import expand_variants, parse_policy
from kvtierd.sim.calibration import load_calibration
from kvtierd.sim.given import measured_variants, parse_workload
from kvtierd.sim.predict import Prediction, predict
from kvtierd.sim.replay import SimulationConfig

WITHIN = 0.25  # the goal: the prediction within 25% of the measurement


def model_preset(model: Path) -> dict[str, Any]:
    """The model's geometry in ``kvtierd sim``'s workload format (from its config.json)."""
    cfg = json.loads((model / "config.json").read_text())
    heads = cfg["num_attention_heads"]
    return {"name": model.name, "layers": cfg["num_hidden_layers"], "q_heads": heads,
            "kv_heads": cfg["num_key_value_heads"],
            "head_dim": cfg.get("head_dim") or cfg["hidden_size"] // heads,
            "active_params": float(cfg.get("num_parameters", 1.35e8)),
            "max_context_tokens": cfg.get("max_position_embeddings", 8192),
            "dtype_bytes": 2}  # fmt: skip


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
    """bench_e2e's workload as ``kvtierd sim predict`` reads it (module docstring)."""
    contexts = make_contexts(tokenizer, args.contexts, args.lengths, args.seed)
    table = prompts(tokenizer, contexts, args.chunk)
    timed = make_requests(contexts, num=args.requests, qps=args.qps, zipf_s=args.zipf,
                          seed=args.seed, gaps=trace_gaps())  # fmt: skip
    quality = case_qualities(args.quality)
    ctx_rows = []
    for case, row in zip(contexts, table, strict=True):
        own = quality.get(case.name) or quality.get(f"{case.task}/{case.length}") or {}
        ctx_rows.append({"tokens": row[0].context_tokens, "quality": own})
    requests = [  # the warm-up: each context once, one at a time, before the timed run
        {"index": -1 - i, "at_s": -1.0 - len(table) + i, "context": i,
         "query_tokens": len(row[0].ids) - row[0].context_tokens, "measured": False}
        for i, row in enumerate(table)
    ]  # fmt: skip
    for r in timed:
        p = table[r.context][r.question]
        requests.append({"index": r.index, "at_s": r.at_s, "context": r.context,
                         "question": r.question,
                         "query_tokens": len(p.ids) - p.context_tokens})  # fmt: skip
    total = kv_bytes_per_token(model) * sum(row[0].context_tokens for row in table)
    tiers = [{"name": "cpu", "capacity_bytes": int(total * args.cpu_share)},
             {"name": "ssd", "capacity_bytes": int(total * args.ssd_share)}]  # fmt: skip
    return {"model": model_preset(model), "tiers": tiers, "contexts": ctx_rows,
            "requests": requests}  # fmt: skip


def placer_for(
    name: str, policy: dict[str, Any] | None
) -> tuple[SimulationConfig, tuple[str, ...]]:
    """A bench_e2e system as a simulated placer and the variants it may use (``()``: all
    measured)."""
    if name == "prefill":
        return SimulationConfig(placer="prefill", warmup_fraction=0.0), ()
    if policy is None or policy["placer"] == "lru":  # lmcache (its own LRU) and lru
        return SimulationConfig(placer="lru", warmup_fraction=0.0), ()
    p = parse_policy(yaml.safe_dump(policy), name)
    spec = f"fixed:{p.fixed_variant}" if p.placer == "fixed" else p.placer
    cfg = SimulationConfig(placer=spec, alpha=p.alpha, selection=p.selection,
                           half_life_s=p.frequency_half_life_s, warmup_fraction=0.0)  # fmt: skip
    grid = (p.fixed_variant,) if p.placer == "fixed" else expand_variants(p.methods, p.ratios)
    return cfg, grid


def compare(pred: Prediction, measured: dict[str, Any], doc: dict[str, Any]) -> dict[str, Any]:
    """Predicted vs measured TTFT over the requests both have (measured errors left out)."""
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
    return {
        "requests": len(pairs),
        "measured": {"mean": statistics.fmean(got), "p50": _pct(got, 50), "p90": _pct(got, 90)},
        "predicted": {"mean": statistics.fmean(want), "p50": _pct(want, 50),
                      "p90": _pct(want, 90)},
        "by_class": {s: {"requests": len(v), "predicted": statistics.fmean(t for t, _ in v),
                         "measured": statistics.fmean(m for _, m in v)}
                     for s, v in classes.items()},
    }  # fmt: skip


def _pct(xs: list[float], p: float) -> float:
    return xs[min(len(xs) - 1, round(p / 100 * (len(xs) - 1)))]


def report(rows: dict[str, dict[str, Any]], args: argparse.Namespace) -> str:
    where = args.out / "workload.json"
    lines = [f"{machine()}; calibration {args.calibration}; workload {where}\n",
             "| system | predicted quality | predicted TTFT mean / p50 / p90 (s) | measured "
             "(s) | predicted / measured (mean) | served as predicted: predicted / measured "
             "mean TTFT (requests) |", "|---|---|---|---|---|---|"]  # fmt: skip
    for name, r in rows.items():
        p = r["prediction"]
        cell = f"{p['ttft_mean_s']:.2f} / {p['ttft_p50_s']:.2f} / {p['ttft_p90_s']:.2f}"
        c = r.get("comparison")
        if c is None:
            lines.append(f"| {name} | {p['quality_mean']:.3f} | {cell} | not measured | - | - |")
            continue
        m, ratio = c["measured"], c["predicted"]["mean"] / c["measured"]["mean"]
        verdict = "within 25%" if abs(ratio - 1) <= WITHIN else "OFF"
        by = "; ".join(f"{s} {v['predicted']:.2f} / {v['measured']:.2f} ({v['requests']})"
                       for s, v in sorted(c["by_class"].items()))  # fmt: skip
        got = f"{m['mean']:.2f} / {m['p50']:.2f} / {m['p90']:.2f}"
        lines.append(f"| {name} | {p['quality_mean']:.3f} | {cell} | {got} | {ratio:.2f} "
                     f"({verdict}) | {by} |")  # fmt: skip
    return "\n".join(lines) + "\n"


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--systems", nargs="*", help="default: all of bench_e2e's")
    p.add_argument("--alphas", type=float, nargs="+", default=[0.5, 2.0, 8.0])
    p.add_argument("--fixed", nargs="+", default=["int8", "knorm@0.5", "keydiff@0.5"])
    p.add_argument("--contexts", type=int, default=30)
    p.add_argument("--lengths", type=int, nargs="+", default=[1024, 2048, 4096])
    p.add_argument("--requests", type=int, default=150)
    p.add_argument("--qps", type=float, default=0.5)
    p.add_argument("--zipf", type=float, default=1.0)
    p.add_argument("--cpu-share", type=float, default=0.10)
    p.add_argument("--ssd-share", type=float, default=0.40)
    p.add_argument("--chunk", type=int, default=256, help="LMCache chunk_size")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--calibration", type=Path,
                   default=REPO / "configs/sim/smollm2-vllm-cpu.yaml")  # fmt: skip
    p.add_argument("--quality", type=Path, help="bench_quality's cases.jsonl")
    p.add_argument("--out", type=Path, default=REPO / "benchmarks/out/e2e")
    args = p.parse_args()

    from transformers import AutoTokenizer

    from kvtierd.model_fetch import fetch_model

    model = fetch_model(log=print)
    doc = build_workload(args, AutoTokenizer.from_pretrained(model), model)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "workload.json").write_text(json.dumps(doc, indent=1))
    given = parse_workload(doc, str(args.out / "workload.json"))
    cal = load_calibration(args.calibration, given.workload.model.kv_bytes_per_token)
    every = systems(args.alphas, args.fixed, model)
    rows = {}
    have = measured_variants(given, cal)
    for name in args.systems or list(every):
        cfg, grid = placer_for(name, every[name].policy)
        fixed = cfg.placer.partition(":")[2]
        if fixed and fixed not in have:
            print(f"  {name}: skipped, no quality measured for {fixed} (--quality, or the "
                  "calibration's quality)", flush=True)  # fmt: skip
            continue
        pred = predict(cfg, given, cal, [v for v in grid if v in have] if grid else None)
        row: dict[str, Any] = {"prediction": pred.summary(), "classes": pred.by_class()}
        measured = args.out / f"{name}.json"
        if measured.exists():
            row["comparison"] = compare(pred, json.loads(measured.read_text()), doc)
        rows[name] = row
        print(f"  {name}: predicted mean TTFT {pred.summary()['ttft_mean_s']:.2f} s", flush=True)
    text = report(rows, args)
    (args.out / "simulated.md").write_text(text)
    (args.out / "simulated.json").write_text(json.dumps({"calibration": cal.summary(),
                                                         "systems": rows}, indent=1))  # fmt: skip
    print(text)


if __name__ == "__main__":
    main()
