"""The headline on several seeds (issue 30): ``bench_e2e`` once per seed on one workload where
placement decides, then each ratio's interval across the seeds.

    .venv/bin/python -m benchmarks.e2e.e2e_matrix                    # every run not yet measured
    .venv/bin/python -m benchmarks.e2e.e2e_matrix --runs seed1       # some of them
    .venv/bin/python -m benchmarks.e2e.e2e_matrix --report-only      # tables from what is on disk

**The workload** (:data:`WORKLOAD`, the same for every run; the seed changes the documents,
the popularity ranks and the arrivals):

* 30 contexts of 1,024 or 2,048 tokens and 150 timed requests at 0.5 QPS (Azure-trace gaps,
  Zipf s = 1): every context is asked once in the warm-up, so no timed request is a context's
  first (the issue's bound is 20%), and the timed window is 300 s of arrivals;
* the tiers (CPU 5%, SSD 16% of all original KV, in the dtype vLLM keeps; bench_e2e raises the
  CPU tier to two of the largest prompts' KV, LMCache's floor, about 9% here) hold a quarter
  of the working set: the working set is about 4x the tiers (bench_e2e prints it), the top of
  the issue's 2-4x, so that even int8 (a quarter of float32, plus its scales) does not keep
  everything and the placer must choose;
* answers of at most 16 tokens (the facts the accuracy check reads fit in them; 24 cost
  another 0.3 s of decoding per request at 35 ms a token here, and queueing behind it);
* 4,096-token documents are left out: their miss (about 3 s here) would queue the next
  arrivals for longer than the 2 s mean gap, and a miss is already 4-5x a hit at 2,048.

**The systems** (:data:`SYSTEMS`): ``prefill`` (the reference answers and the misses' time),
``lmcache`` alone, ``lru``, ``fixed-int8`` and EvicPress at alpha 2 (the preset's estimator);
seeds 2 and 3 leave ``lmcache`` out (:data:`LEAN`: it does not move the headline); ``--lean``
does so for every run selected (reruns on new code).
Token-dropping fixed variants are left out of these runs: at the quality of the others they are
not a baseline (bench_e2e measures them on its own), and each system costs about 7 minutes.

**Where contexts differ** (issue 39, the ``kinds-seed<N>`` runs): the same arrivals, lengths and
tiers on ``--workload kinds`` (documents of ``context_kinds.py``'s kinds, built to differ in
the compression they keep their answers through: facts told three times, or once among
filler), with the frontier of
fixed policies (:data:`KINDS_SYSTEMS`: ``lru``, fixed int8, int4 and keydiff@0.7+int8),
EvicPress and ``evicpress-prior-a2`` (profiles from the prior only). EvicPress is judged
against that frontier (``e2e_frontier.py``: its TTFT against the frontier's at its share of
identical answers, and its share against the frontier's at its TTFT), per run and across
runs. Not simulated.

**The runs** (:data:`RUNS`): seeds 1-3, and seed 1 again with a shared 1,024-token system
prompt before every document (issue 29: four whole chunks; the headline with and without it
on the same documents and arrivals); the kinds runs on seeds 1 and 2. Each run's systems run
back to back (``bench_e2e --out <out>/<run>``); a run whose systems are all on disk is not run
again.

**The tables** (``<out>/matrix.md``, ``matrix.json``): per run, bench_e2e's rows with their 95%
bootstrap intervals and the ceiling; per run and baseline, the ratio baseline / EvicPress of
mean TTFT with its paired 95% bootstrap interval (``e2e_stats.ratio_bootstrap``) and whether
EvicPress is at equal quality (its shares of identical answers and of accurate ones each at
least the low end of the baseline's 95% interval, ``e2e_answers.equal_quality``; before issue
39 similarity within 3 points decided, and hid a 16% drop in identical answers), and the
baseline's room (:func:`room`: its mean over the ceiling, the most any policy could gain
over it on that trace); the simulator's prediction of every system (``sim_e2e.simulate_argv``,
calibrated from the run: predicted / measured mean TTFT); across runs, each ratio's mean
with its 95% t-interval (``e2e_stats.across_seeds``), the headline (the ratio against the
fastest baseline at equal quality of each run), each EvicPress system against the fixed
frontier, and on how many runs the simulator is within 25% for every system. The wall time
of every run is recorded.
"""

from __future__ import annotations

import argparse
import json
import math
import subprocess
import sys
import time
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from benchmarks._support.common import REPO, machine
from benchmarks.e2e.e2e_answers import equal_quality, is_ours
from benchmarks.e2e.e2e_stats import Interval, across_seeds, ratio_bootstrap

WORKLOAD: dict[str, str | list[str]] = {
    "--contexts": "30", "--lengths": ["1024", "2048"], "--requests": "150", "--qps": "0.5",
    "--zipf": "1.0", "--cpu-share": "0.05", "--ssd-share": "0.16", "--max-tokens": "16",
    "--warmup-questions": "1", "--alphas": "2",
}  # fmt: skip
"""bench_e2e's arguments for every run (module docstring says why each); a run adds its
``--workload`` and ``--fixed`` (:class:`Run`)."""

SYSTEMS = ("prefill", "lmcache", "lru", "fixed-int8", "evicpress-a2")
OURS = "evicpress-a2"
KINDS_FIXED = ("int8", "int4", "keydiff@0.7+int8")
"""The fixed policies of the kinds runs (issue 39): quantized at two widths and one
token-dropping form, with ``lru`` (every context whole) the frontier EvicPress is judged
against."""
KINDS_SYSTEMS = ("prefill", "lru", *(f"fixed-{v}" for v in KINDS_FIXED), OURS,
                 "evicpress-prior-a2")  # fmt: skip
"""The systems of the kinds runs: the frontier, EvicPress, and EvicPress with profiles from
the prior only (what per-context profiles buy is the difference)."""
SIM_WITHIN = 0.25
"""The issue's bar for the simulator: predicted mean TTFT within 25% of the measured one."""


LEAN = tuple(s for s in SYSTEMS if s != "lmcache")  # what --lean leaves of a run's systems
"""The systems of the later seeds: LMCache alone was the slowest by far on the first two runs
(7.1 s and 3.2 s mean against 1.0-2.0 s for every other baseline), so it does not move the
headline, and leaving it out saves about 9 minutes a run."""


@dataclass(frozen=True, slots=True)
class Run:
    name: str
    seed: int
    system_prompt_tokens: int = 0
    systems: tuple[str, ...] = SYSTEMS
    workload: str = "tasks"  # bench_e2e's --workload
    fixed: tuple[str, ...] = ("int8",)  # bench_e2e's --fixed


def _kinds(seed: int) -> Run:
    return Run(f"kinds-seed{seed}", seed, systems=KINDS_SYSTEMS, workload="kinds",
               fixed=KINDS_FIXED)  # fmt: skip


RUNS = (Run("seed1", 1), Run("seed1-sp1024", 1, 1024), Run("seed2", 2, systems=LEAN),
        Run("seed3", 3, systems=LEAN), _kinds(1), _kinds(2))  # fmt: skip


def bench_args(run: Run, out: Path) -> list[str]:
    """The bench_e2e command line of ``run`` (into ``out/<run.name>``)."""
    args = [sys.executable, "-m", "benchmarks.e2e.bench_e2e", "--seed", str(run.seed),
            "--system-prompt-tokens", str(run.system_prompt_tokens),
            "--out", str(out / run.name), "--systems", *run.systems,
            "--workload", run.workload, "--fixed", *run.fixed]  # fmt: skip
    for flag, value in WORKLOAD.items():
        args += [flag, *(value if isinstance(value, list) else [value])]
    return args


def measured(run: Run, out: Path) -> bool:
    return all((out / run.name / f"{s}.json").exists() for s in run.systems)


def _ttfts(path: Path) -> list[float]:
    """Per timed request (by index) its TTFT, ``nan`` for a failed one."""
    outs = sorted(json.loads(path.read_text())["outcomes"], key=lambda o: o["index"])
    return [math.nan if o["error"] else o["ttft_s"] for o in outs]


def run_ratios(run_dir: Path, systems: tuple[str, ...] = SYSTEMS) -> dict[str, dict[str, Any]]:
    """Per baseline of one run (its ``systems`` but the EvicPress ones): baseline / EvicPress
    mean TTFT (paired interval) and whether the two are at equal quality
    (``e2e_answers.equal_quality``)."""
    rows = json.loads((run_dir / "summary.json").read_text())
    ours = _ttfts(run_dir / f"{OURS}.json")
    out = {}
    for name in systems:
        if is_ours(name) or name not in rows:
            continue
        base = _ttfts(run_dir / f"{name}.json")
        both = [(b, o) for b, o in zip(base, ours, strict=True)
                if math.isfinite(b) and math.isfinite(o)]  # fmt: skip
        r = ratio_bootstrap([b for b, _ in both], [o for _, o in both])
        out[name] = {"ratio": [r.point, r.low, r.high], "requests": len(both),
                     "equal_quality": equal_quality(rows[OURS], rows[name]),
                     "ttft_mean_s": rows[name]["ttft_mean_s"],
                     "room": room(rows[name])}  # fmt: skip
    return out


def room(row: dict[str, Any]) -> float | None:
    """The most any policy could gain over a system on its trace: its mean TTFT over the
    trace's ceiling (bench_e2e: every first request a miss, every other request at the fastest
    measured hit for its length). A goal above it cannot be met on that trace."""
    ceiling = row.get("ceiling_s")
    return row["ttft_mean_s"] / ceiling if ceiling else None


def simulated(run: Run, out: Path) -> dict[str, float]:
    """The simulator's prediction for ``run`` beside its measurement (``sim_e2e``, calibrated
    from the run's own measurements): per system, predicted / measured mean TTFT."""
    from benchmarks.e2e.sim_e2e import simulate_argv

    return dict(simulate_argv(bench_args(run, out)[3:])["ratios"])


def headline(ratios: dict[str, dict[str, Any]]) -> tuple[str, dict[str, Any]] | None:
    """The fastest baseline EvicPress is at equal quality with (``prefill`` aside: it caches
    nothing), and its ratio; ``None`` when there is none."""
    fit = [(r["ttft_mean_s"], name) for name, r in ratios.items()
           if r["equal_quality"] and name != "prefill"]  # fmt: skip
    if not fit:
        return None
    _, name = min(fit)
    return name, ratios[name]


def report(
    out: Path, runs: list[Run], wall: dict[str, float], sim: bool = True
) -> tuple[str, dict[str, Any]]:
    """``matrix.md``'s text and ``matrix.json``'s content from the runs on disk (``sim``: with
    the simulator's prediction beside each run)."""
    done = [r for r in runs if (out / r.name / "summary.json").exists() and measured(r, out)]
    lines = [f"# bench_e2e on several seeds (issue 30)  {time.strftime('%Y-%m-%d')}",
             f"\n{machine()}\n", "Workload of every run: " + " ".join(
                 f"{k} {' '.join(v) if isinstance(v, list) else v}" for k, v in WORKLOAD.items())
             + "\n"]  # fmt: skip
    data: dict[str, Any] = {"machine": machine(), "workload": WORKLOAD, "runs": {}}
    for run in done:
        summary = (out / run.name / "summary.md").read_text()
        ratios = run_ratios(out / run.name, run.systems)
        best = headline(ratios)
        rows = json.loads((out / run.name / "summary.json").read_text())
        data["runs"][run.name] = {"seed": run.seed, "system_prompt_tokens":
                                  run.system_prompt_tokens, "workload": run.workload,
                                  "systems": list(run.systems), "wall_s": wall.get(run.name),
                                  "ratios": ratios, "headline": best,
                                  "frontier": {k: r["frontier"] for k, r in rows.items()
                                               if "frontier" in r}}  # fmt: skip
        took = f", {wall[run.name] / 60:.0f} min" if run.name in wall else ""
        kind = f", workload {run.workload}" if run.workload != "tasks" else ""
        lines += [f"\n## {run.name} (seed {run.seed}{kind}"
                  + (f", {run.system_prompt_tokens}-token system prompt" if
                     run.system_prompt_tokens else "") + f"{took})\n",
                  f"Systems: {', '.join(run.systems)}\n", summary,
                  f"\n{OURS} against each baseline (baseline / {OURS} mean TTFT, paired 95% "
                  "bootstrap over the requests; room: the baseline's mean over the trace's "
                  "ceiling, the most any policy could gain over it):\n",
                  "| baseline | ratio | equal quality | room |", "|---|---|---|---|"]  # fmt: skip
        for name, r in ratios.items():
            most = "-" if r["room"] is None else f"{r['room']:.2f}x"
            lines.append(f"| {name} | {Interval(*r['ratio'])} | "
                         f"{'yes' if r['equal_quality'] else 'no'} | {most} |")  # fmt: skip
        if sim and run.workload != "tasks":
            lines.append(f"\nNot simulated: the simulator's bar (issue 30) is on the tasks "
                         f"workload, not {run.workload}")  # fmt: skip
        elif sim:
            predicted = simulated(run, out)
            data["runs"][run.name]["simulated"] = predicted
            lines += ["\nThe simulator beside it (`benchmarks.e2e.sim_e2e`, calibrated from this "
                      "run; `simulated.md` in its directory): predicted / measured mean TTFT\n",
                      "| " + " | ".join(predicted) + " |",
                      "|" + "---|" * len(predicted),
                      "| " + " | ".join(f"{v:.2f}" for v in predicted.values()) + " |"]  # fmt: skip
    lines += _across(data["runs"])
    return "\n".join(lines) + "\n", data


def _across(runs: dict[str, Any]) -> list[str]:
    """The across-runs table: each baseline's ratio, and the headline, with t-intervals."""
    if not runs:
        return ["\nNo run measured yet."]
    lines = [f"\n## Across runs ({len(runs)}: {', '.join(runs)})\n",
             "Mean of the per-run ratios with its 95% Student-t interval over the runs "
             "(no interval from one run):\n",
             "| baseline | ratio across runs | runs at equal quality |",
             "|---|---|---|"]  # fmt: skip
    baselines = dict.fromkeys(name for r in runs.values() for name in r["ratios"])
    for name in baselines:
        values = [r["ratios"][name] for r in runs.values() if name in r["ratios"]]
        if not values:
            continue
        across = across_seeds([v["ratio"][0] for v in values])
        fair = sum(v["equal_quality"] for v in values)
        lines.append(f"| {name} | {across} | {fair} of {len(values)} |")
    sims = {name: r["simulated"] for name, r in runs.items() if "simulated" in r}
    if sims:
        within = [name for name, ratios in sims.items()
                  if all(abs(v - 1) <= SIM_WITHIN for v in ratios.values())]  # fmt: skip
        lines.append(f"\nThe simulator within {SIM_WITHIN:.0%} of the measured mean TTFT for "
                     f"every system on {len(within)} of {len(sims)} runs"
                     + (f" ({', '.join(within)})" if within else ""))  # fmt: skip
    lines += _frontier_across(runs)
    best = [r["headline"] for r in runs.values()]
    if all(b is not None for b in best):
        across = across_seeds([b[1]["ratio"][0] for b in best])
        lines.append(f"\n**Headline**: {OURS} against the fastest baseline at equal quality of "
                     f"each run ({', '.join(b[0] for b in best)}): {across}x")  # fmt: skip
    else:
        lines.append(f"\n**Headline**: in some run no baseline is at {OURS}'s quality")
    return lines


def _frontier_across(runs: dict[str, Any]) -> list[str]:
    """Each EvicPress system against the fixed frontier (``e2e_frontier.py``) on the runs that
    judged it: per run the speedup at equal identical answers and the answers gained at equal
    TTFT (paired bootstrap), across runs their means with 95% t-intervals."""
    judged: dict[str, dict[str, Any]] = {}
    for run, r in runs.items():
        for name, j in r.get("frontier", {}).items():
            judged.setdefault(name, {})[run] = j
    if not judged:
        return []
    lines = ["\nAgainst the frontier of fixed policies (issue 39; per run: bench_e2e's summary "
             "above), speedup = the frontier's TTFT at the system's share of identical answers "
             "over its TTFT, answers gained = its share less the frontier's at its TTFT; "
             "across runs: the mean with its 95% Student-t interval (per run: paired "
             "bootstrap):\n",
             "| system | run | speedup at equal answers | answers gained at equal TTFT |",
             "|---|---|---|---|"]  # fmt: skip
    for name, per in judged.items():
        for run, j in per.items():
            lines.append(f"| {name} | {run} | {Interval(*j['speedup'])}x | "
                         f"{Interval(*j['share_gain'])} |")  # fmt: skip
        speed = across_seeds([j["speedup"][0] for j in per.values()])
        gain = across_seeds([j["share_gain"][0] for j in per.values()])
        lines.append(f"| {name} | across {len(per)} | {speed}x | {gain} |")
    return lines


def selected_runs(names: list[str] | None, *, lean: bool) -> list[Run]:
    """The runs named (every run when none is), in :data:`RUNS` order; ``lean``: each without
    ``lmcache`` (for the tasks runs :data:`LEAN`'s systems: a shorter matrix, for reruns on
    new code)."""
    runs = [r for r in RUNS if not names or r.name in names]
    if not lean:
        return runs
    return [replace(r, systems=tuple(s for s in r.systems if s != "lmcache")) for r in runs]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--runs", nargs="+", choices=[r.name for r in RUNS],
                   help="default: every run")  # fmt: skip
    p.add_argument("--report-only", action="store_true", help="only the tables from disk")
    p.add_argument("--no-sim", action="store_true", help="without the simulator's prediction")
    p.add_argument("--lean", action="store_true",
                   help=f"every run without lmcache (the tasks runs with the later seeds' "
                        f"systems: {', '.join(LEAN)})")  # fmt: skip
    p.add_argument("--out", type=Path, default=REPO / "benchmarks/out/e2e-matrix")
    args = p.parse_args()
    out = args.out.resolve()
    out.mkdir(parents=True, exist_ok=True)
    runs = selected_runs(args.runs, lean=args.lean)
    wall_path = out / "wall.json"
    wall = json.loads(wall_path.read_text()) if wall_path.exists() else {}
    for run in runs if not args.report_only else []:
        if measured(run, out) and (out / run.name / "summary.json").exists():
            print(f"== {run.name}: on disk", flush=True)
            continue
        print(f"== {run.name}: {' '.join(bench_args(run, out)[1:])}", flush=True)
        t0 = time.perf_counter()
        done = subprocess.run(bench_args(run, out), cwd=REPO, check=False)
        if done.returncode != 0:
            raise SystemExit(f"error: bench_e2e failed on {run.name} (exit {done.returncode})")
        wall[run.name] = time.perf_counter() - t0
        wall_path.write_text(json.dumps(wall, indent=1))
    text, data = report(out, runs, wall, sim=not args.no_sim)
    (out / "matrix.md").write_text(text)
    (out / "matrix.json").write_text(json.dumps(data, indent=1))
    print(text)


if __name__ == "__main__":
    main()
