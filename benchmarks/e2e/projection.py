"""The EvicPress paper's setting, projected by the simulator from published figures (issue 30.5).

    .venv/bin/python -m benchmarks.e2e.projection     # table; files in benchmarks/out/projection
    .venv/bin/python -m benchmarks.e2e.projection --requests 300 --contexts 40 --rates 0.2

**A projection, not a measurement.** No GPU ran: the simulator (:mod:`kvtierd.sim`) replays a
workload through each system's placer and prices every request from the setting's published
figures (``configs/sim/llama31-8b-h100.yaml``: Llama-3.1-8B on one H100, prefill as a roofline,
the paper's 80 GB DRAM and 800 GB SSD tiers and unbounded remote store, each figure cited there).

The workload is the paper's (§6.1): 555 contexts with LongBench lengths (Table 2, the
simulator's six datasets with both lengths and sensitivities), Zipf popularity, and the arrival
times of the Azure LLM inference **conversation** trace in the repository
(``benchmarks/data/AzureLLMInferenceTrace_conv.csv``), its gaps scaled to each ``--rates`` mean
rate. The paper also used Azure's code trace; it is not in the repository (nor in the shared
data folder), so it is not projected.

**Quality comes from the project's measurements**, not from the paper's sensitivity model: each
context takes the per-variant accuracy of one labelled quality-benchmark case
(``benchmarks/data/quality_labels.jsonl``: the share of the planted facts SmolLM2-135M's answer
keeps with that variant, over the 1k-token RULER-style cases its full KV answers), drawn at
random with the seed. Those are a 135M model's answers on 1k-token contexts, applied to an 8B
model's 12k-108k-token contexts: an assumption the table's quality column rests on. Variants
offered: those measured on every labelled case, less the ``streamingllm`` controls.

Systems: ``prefill`` (vLLM alone, every prompt prefilled); ``lmcache`` (LMCache alone: LRU over
its CPU and disk backends, DRAM and SSD, no remote store; no published figure tells its load
costs from kvtierd's, so they are the same); ``lru`` (kvtierd's LRU over DRAM, SSD and remote);
``fixed-int8`` and ``fixed-keydiff@0.5`` (one variant for every context, LRU); ``evicpress-a<A>``
(EvicPress at each ``--alphas`` value, frequencies learned online). TTFT adds waiting on one LLM
server serving in arrival order (``kvtierd.sim.timing.queued_ttft_s``). The rows "at equal
quality" put each baseline beside the fastest EvicPress alpha whose quality is within 3 points.
"""

from __future__ import annotations

import argparse
import json
import time
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import numpy as np

from benchmarks._support.common import REPO, machine
from benchmarks.e2e.projection_setting import Setting, load_setting
from benchmarks.e2e.sim_e2e import HOLD_S
from kvtierd.policies.model import FloatArray, IntArray
from kvtierd.sim.offers import DAEMON
from kvtierd.sim.replay import (
    Prepared,
    SimulationConfig,
    SimulationResult,
    prepared,
    run_simulation,
)
from kvtierd.sim.timing import queued_ttft_s
from kvtierd.sim.variant_space import Form, VariantTable, shape
from kvtierd.sim.workload import WorkloadConfig, make_workload
from kvtierd.types import ORIGINAL_VARIANT

SETTING = REPO / "configs/sim/llama31-8b-h100.yaml"
TRACE = REPO / "benchmarks/data/AzureLLMInferenceTrace_conv.csv"
LABELS = REPO / "benchmarks/data/quality_labels.jsonl"
CONTROLS = ("streamingllm",)  # the labels' known-bad control method, in no policy's grid
WITHIN = 0.03  # "equal quality": within 3 points (the paper's "within 3%")


@dataclass(frozen=True, slots=True)
class System:
    """A system as the simulator runs it: its placer spec, alpha and whether it has the
    remote store (LMCache alone has only its CPU and disk backends). ``own_labels``: the
    placer knows each context's own measured qualities (an upper bound), not its task's."""

    name: str
    placer: str
    alpha: float = 1.0
    remote: bool = True
    own_labels: bool = False
    daemon: bool = True  # kvtierd's: its lookups hold what they find (HOLD_S)


def systems(alphas: list[float]) -> list[System]:
    base = [System("prefill", "prefill", daemon=False),
            System("lmcache", "lru", remote=False, daemon=False),
            System("lru", "lru"), System("fixed-int8", "fixed:int8"),
            System("fixed-keydiff@0.5", "fixed:keydiff@0.5")]  # fmt: skip
    ours = [System(f"evicpress-a{a:g}", "evicpress", a) for a in alphas]
    bound = System(f"evicpress-a{alphas[0]:g} (own labels)", "evicpress", alphas[0],
                   own_labels=True)  # fmt: skip
    return [*base, *ours, bound]


@dataclass(frozen=True, slots=True)
class CaseQuality:
    """One labelled case: the accuracy of each variant (``measured``) and what a profile
    that has not seen this case's answers knows: the mean over the other cases of its task
    (``profiled``)."""

    task: str
    measured: dict[str, float]
    profiled: dict[str, float]


def case_qualities(path: Path) -> list[CaseQuality]:
    """Per labelled case (its full KV answered it), the accuracy of every variant measured on
    every such case, less the controls (module docstring), and its task's leave-one-out mean."""
    rows = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    rows = [r for r in rows if r.get("full_accuracy") == 1.0 and "accuracy" in r]
    if not rows:
        raise ValueError(f"{path}: no labelled case (full_accuracy 1.0 with accuracy per variant)")
    common = set.intersection(*(set(r["accuracy"]) for r in rows))
    keep = sorted(v for v in common if Form.of(v).method not in CONTROLS)
    out = []
    for k, r in enumerate(rows):
        others = [o for j, o in enumerate(rows) if j != k and o["task"] == r["task"]]
        own = {v: float(r["accuracy"][v]) for v in keep}
        # a task with one labelled case: nothing else to go by, the profile is its own answers
        prof = (
            {v: float(np.mean([o["accuracy"][v] for o in others])) for v in keep} if others else own
        )
        out.append(CaseQuality(r["task"], own, prof))
    return out


def variant_table(
    tokens: FloatArray, setting: Setting, qualities: list[dict[str, float]], case_of: IntArray
) -> VariantTable:
    """Sizes from the model's geometry, each context's quality from its case, restore at the
    GPU memory's bandwidth: dequantizing reads the stored bytes and writes the original's,
    re-rotating kept keys reads and writes them once."""
    names = (ORIGINAL_VARIANT, *qualities[0])
    per_token = float(setting.model.kv_bytes_per_token)
    n, v = tokens.size, len(names)
    size, kept, quality, restore = (np.empty((n, v)) for _ in range(4))
    for j, name in enumerate(names):
        form = Form.of(name)
        sh = shape(form, tokens, per_token, setting.model.dtype_bytes)
        size[:, j], kept[:, j] = sh.size_bytes, sh.kept_tokens
        moved = np.zeros(n)
        if form.quant:
            moved += sh.size_bytes + sh.kept_tokens * per_token
        if form.method:
            moved += sh.kept_tokens * per_token  # the keys (half the KV), read and written
        restore[:, j] = moved / setting.hbm_bandwidth_bytes_per_s
        quality[:, j] = [1.0 if name == ORIGINAL_VARIANT else qualities[c][name] for c in case_of]
    return VariantTable(names, size, quality, restore, kept)


@dataclass(frozen=True, slots=True, eq=False)
class Preps:
    """The workload twice: quality as measured, and the placer's profiles from the task's
    other cases (``task``) or from each context's own case (``own``)."""

    task: Prepared
    own: Prepared


def prepare(setting: Setting, args: argparse.Namespace) -> Preps:
    """The paper's workload on the trace's arrivals, with measured qualities (module doc)."""
    model = setting.model.name
    cfg = WorkloadConfig(model=model, n_contexts=args.contexts, n_requests=args.requests,
                         zipf_s=args.zipf, arrival="trace", trace_path=str(args.trace),
                         seed=args.seed)  # fmt: skip
    wl = make_workload(cfg, warmup_fraction=0.2)
    if wl.model != setting.model:
        wl = replace(wl, model=setting.model)
    cases = case_qualities(args.labels)
    case_of = np.random.default_rng(args.seed + 2).integers(len(cases), size=args.contexts)
    tokens = wl.own_tokens.astype(np.float64)
    measured = variant_table(tokens, setting, [c.measured for c in cases], case_of)
    profiled = variant_table(tokens, setting, [c.profiled for c in cases], case_of)
    own = prepared(wl, measured, setting.prefill)
    # requests get their own case's quality; the placer decides on its task's other cases
    return Preps(replace(own, profiles=prepared(wl, profiled, setting.prefill).profiles), own)


def at_rate(preps: Preps, qps: float) -> Preps:
    """The same requests with the trace's gaps scaled to a mean rate of ``qps``."""
    t = preps.own.workload.arrival_s
    base = (t.size - 1) / max(float(t[-1] - t[0]), 1e-9)
    wl = replace(preps.own.workload, arrival_s=(t - t[0]) * (base / qps))
    return Preps(replace(preps.task, workload=wl), replace(preps.own, workload=wl))


def run_system(system: System, setting: Setting, preps: Preps) -> dict[str, Any]:
    prep = preps.own if system.own_labels else preps.task
    tiers = tuple(t for t in setting.tiers if system.remote or t.capacity_bytes is not None)
    # the daemon's rules (issue 30.4, checked beside bench_e2e): a compressed form only under
    # a trusted profile, a token-dropped one only once the router can serve it; and what a
    # lookup finds stays until the plugin's hold ends (the simulated LRU's misses, seeds 1-3)
    cfg = SimulationConfig(tiers=tiers, placer=system.placer, alpha=system.alpha, offers=DAEMON,
                           hold_s=HOLD_S if system.daemon else 0.0)  # fmt: skip
    r: SimulationResult = run_simulation(cfg, prep)
    ttft = queued_ttft_s(r.arrival_s, r.service_s, setting.decode_s)
    return {"system": system.name, "evicpress": system.placer == "evicpress",
            "bound": system.own_labels, "quality": r.quality_mean,
            "ttft_mean_s": float(ttft.mean()), "ttft_p50_s": float(np.percentile(ttft, 50)),
            "ttft_p90_s": float(np.percentile(ttft, 90)), "service_mean_s": r.ttft_mean_s,
            "served": r.hit_rate}  # fmt: skip


def at_equal_quality(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Per baseline, the fastest EvicPress row within :data:`WITHIN` of its quality (the
    own-labels bound left out: no profile knows a request's answers)."""
    ours = [r for r in rows if r["evicpress"] and not r["bound"]]
    out = []
    for b in (r for r in rows if not r["evicpress"]):
        fair = [r for r in ours if r["quality"] >= b["quality"] - WITHIN]
        best = min(fair, key=lambda r: r["ttft_mean_s"]) if fair else None
        out.append({"baseline": b["system"], "evicpress": best and best["system"],
                    "ratio": best and b["ttft_mean_s"] / best["ttft_mean_s"]})  # fmt: skip
    return out


def load(qps: float, row: dict[str, Any]) -> str:
    """The LLM server's utilisation (rate x unloaded mean TTFT): at 1 or more its queue grows
    for as long as the trace runs, and the TTFT columns only say how long that was."""
    rho = qps * row["service_mean_s"]
    return f"{rho:.2f}" + (" (saturated)" if rho >= 1 else "")


def markdown(result: dict[str, Any]) -> str:
    lines = [f"Projection (not a measurement) from {result['setting']['source']}; "
             f"{result['contexts']} contexts, {result['requests']} requests (first 20% warm-up), "
             f"seed {result['seed']}; ran on {result['machine']}\n"]  # fmt: skip
    for block in result["rates"]:
        lines += [f"\n{block['qps']:g} requests/s:\n",
                  "| system | quality | TTFT mean s | p50 s | p90 s | unloaded mean s | "
                  "server load | served from |", "|---|---|---|---|---|---|---|---|"]  # fmt: skip
        for r in block["rows"]:
            served = " ".join(f"{k} {v:.0%}" for k, v in r["served"].items() if v)
            cells = [r["quality"], r["ttft_mean_s"], r["ttft_p50_s"], r["ttft_p90_s"],
                     r["service_mean_s"]]  # fmt: skip
            numbers = " | ".join(f"{x:.3f}" for x in cells)
            lines.append(f"| {r['system']} | {numbers} | {load(block['qps'], r)} | {served} |")
        eq = ", ".join(f"{e['baseline']} {e['ratio']:.2f}x ({e['evicpress']})" if e["ratio"]
                       else f"{e['baseline']} -" for e in block["equal_quality"])  # fmt: skip
        lines.append(f"\nEvicPress at equal quality (within {WITHIN:g}): {eq}")
    return "\n".join(lines) + "\n"


def _shown(path: Path) -> Path:
    """``path`` relative to the repository when it is inside it (as the files record it)."""
    path = path.resolve()
    return path.relative_to(REPO) if path.is_relative_to(REPO) else path


def main(argv: list[str] | None = None) -> dict[str, Any]:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--setting", type=Path, default=SETTING)
    p.add_argument("--trace", type=Path, default=TRACE)
    p.add_argument("--labels", type=Path, default=LABELS)
    p.add_argument("--contexts", type=int, default=555, help="the paper's 555 (§6.1)")
    p.add_argument("--requests", type=int, default=5000)
    p.add_argument("--rates", type=float, nargs="+", default=[0.1, 0.25, 0.5])
    p.add_argument("--alphas", type=float, nargs="+", default=[1.0, 10.0, 100.0])
    p.add_argument("--zipf", type=float, default=0.8)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", type=Path, default=REPO / "benchmarks/out/projection")
    args = p.parse_args(argv)
    setting = replace(load_setting(args.setting), source=str(_shown(args.setting)))
    started = time.perf_counter()
    preps = prepare(setting, args)
    result: dict[str, Any] = {
        "projection": True, "machine": machine(), "date": time.strftime("%Y-%m-%d %H:%M UTC",
        time.gmtime()), "setting": setting.summary(), "contexts": args.contexts,
        "requests": args.requests, "seed": args.seed, "zipf": args.zipf,
        "trace": str(_shown(args.trace)), "rates": [],
    }  # fmt: skip
    for qps in args.rates:
        at = at_rate(preps, qps)
        rows = [run_system(s, setting, at) for s in systems(args.alphas)]
        result["rates"].append({"qps": qps, "rows": rows, "equal_quality": at_equal_quality(rows)})
    result["seconds"] = time.perf_counter() - started
    text = markdown(result)
    print(text, end="", flush=True)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "projection.md").write_text(text)
    (args.out / "projection.json").write_text(json.dumps(result, indent=1) + "\n")
    return result


if __name__ == "__main__":
    main()
