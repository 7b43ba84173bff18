"""``simulate``: replay a simulated workload through one placer, or sweep every placer.

One configuration prints its TTFT (mean, p50, p99), mean quality and the share of requests
served by each tier; ``--sweep`` runs EvicPress at every ``--alphas`` value and the baselines
(``fixed:<method>@<ratio>``, ``lru``, ``lfu``, ``prefill``) on one shared workload and prints
every run, the headline table (TTFT reduction at equal quality) and QPS at equal TTFT.
No daemon is involved: this is ``kvtierd.sim`` behind a command line.
"""

from __future__ import annotations

import argparse
from dataclasses import asdict
from typing import Any

from kvtierd.cli.exit_codes import CliError, ExitCode
from kvtierd.cli.output import Output
from kvtierd.errors import KvtierError
from kvtierd.sim.frontier import Sweep, headline, qps_comparison, run_sweep, sweep_configs
from kvtierd.sim.options import build_config
from kvtierd.sim.replay import SimulationConfig, SimulationResult, run_simulation

FIXED_METHODS = ("keydiff", "knorm", "snapkv")
FIXED_RATIOS = (0.9, 0.7, 0.5, 0.3, 0.1)
OTHERS = ("lru", "lfu", "prefill")


def _simulator_error(e: Exception) -> CliError:
    """Bad input the simulator found (unknown preset, empty trace, unknown variant)."""
    return CliError(ExitCode.INVALID, f"simulation: {e}")


def simulate_one(cfg: SimulationConfig) -> SimulationResult:
    try:
        return run_simulation(cfg)
    except (KvtierError, ValueError, KeyError, OSError) as e:
        raise _simulator_error(e) from e


def sweep(cfg: SimulationConfig, args: argparse.Namespace, out: Output) -> Sweep:
    """Every run of the sweep on ``cfg``'s workload, with a progress bar on a terminal."""
    configs = sweep_configs(
        cfg,
        args.alphas,
        fixed_methods=FIXED_METHODS,
        fixed_ratios=FIXED_RATIOS,
        others=OTHERS,
        oracle=not args.no_oracle,
    )
    with out.progress("simulating", len(configs)) as step:
        try:
            return run_sweep(cfg, configs, step)
        except (KvtierError, ValueError, KeyError, OSError) as e:
            raise _simulator_error(e) from e


def run_row(r: SimulationResult) -> list[object]:
    hits = " ".join(f"{k} {v:.0%}" for k, v in r.hit_rate.items())
    return [
        r.placer,
        f"{r.alpha:g}",
        f"{r.quality_mean:.3f}",
        f"{r.ttft_mean_s:.3f}",
        f"{r.ttft_p50_s:.3f}",
        f"{r.ttft_p99_s:.3f}",
        hits,
    ]


RUN_COLUMNS = ("placer", "alpha", "quality", "TTFT mean s", "p50 s", "p99 s", "served from")


def _rows(sw: Sweep, oracle: bool) -> list[dict[str, Any]]:
    if oracle and not sw.oracle:
        return []
    rows = [asdict(r) for r in headline(sw, oracle=oracle)]
    for row in rows:
        for k, v in row.items():
            row[k] = float(v) if k.startswith("reduction") and v is not None else v
    return rows


def headline_payload(sw: Sweep, quality_target: float) -> dict[str, Any]:
    """The headline table (EvicPress with online frequencies), the same table for EvicPress
    with oracle frequencies (the upper bound; empty when not run) and the QPS comparison as
    plain values (``qps`` None when no configuration reaches the quality target)."""
    try:
        q = qps_comparison(sw, quality_target)
        qps: dict[str, Any] | None = asdict(q) | {"ratio": q.ratio}
    except ValueError:
        qps = None
    return {"headline": _rows(sw, False), "headline_oracle": _rows(sw, True), "qps": qps,
            "quality_target": quality_target}  # fmt: skip


def print_headline(out: Output, payload: dict[str, Any]) -> None:
    def x(v: float | None) -> str:
        return "-" if v is None else f"{v:.2f}x"

    bound = {r["baseline"]: r for r in payload["headline_oracle"]}
    out.table(
        "TTFT reduction at equal quality (EvicPress frontier, frequencies learned online, vs "
        "baseline; upper bound: EvicPress given each context's true frequency)",
        ("baseline", "points", "min", "median", "max", "upper bound (oracle) median"),
        [
            [
                r["baseline"],
                r["points"],
                x(r["reduction_min"]),
                x(r["reduction_median"]),
                x(r["reduction_max"]),
                x(bound[r["baseline"]]["reduction_median"]) if bound else "-",
            ]
            for r in payload["headline"]
        ],
    )
    q = payload["qps"]
    if q is None:
        out.line(f"QPS at equal TTFT: no configuration reaches quality {payload['quality_target']}")
        return
    out.line(
        f"QPS at mean TTFT <= {q['ttft_target_s']:.3f} s, quality >= {q['quality_target']:g}: "
        f"EvicPress {q['evicpress_qps']:.2f} (alpha {q['evicpress_alpha']:g}) vs "
        f"{q['baseline']} {q['baseline_qps']:.2f} -> {q['ratio']:.2f}x"
    )


def config_summary(cfg: SimulationConfig) -> dict[str, Any]:
    wl = cfg.workload
    return {
        "placer": cfg.placer,
        "alpha": cfg.alpha,
        "selection": cfg.selection,
        "frequency": cfg.frequency,
        "recompute_slower_loads": cfg.recompute_slower_loads,
        "model": wl.model,
        "contexts": wl.n_contexts,
        "requests": wl.n_requests,
        "arrival": wl.arrival,
        "trace": wl.trace_path,
        "seed": wl.seed,
        "system_prompt_tokens": wl.shared_prefix_tokens,
        "variants": len(cfg.variants.names()),
        "tiers": [
            {
                "name": t.name,
                "capacity_bytes": t.capacity_bytes,
                "load_bandwidth_bytes_per_s": t.load_bandwidth_bytes_per_s,
            }
            for t in cfg.tiers
        ],
    }


def run_one(args: argparse.Namespace, out: Output) -> ExitCode:
    """``kvtierd sim run``."""
    cfg = build_config(args)
    with out.working(f"simulating {cfg.label}"):
        r = simulate_one(cfg)
    if out.as_json:
        out.json({"config": config_summary(cfg), "runs": [r.summary()]})
    else:
        out.table(f"simulation of {cfg.label} ({cfg.workload.model})", RUN_COLUMNS, [run_row(r)])
    return ExitCode.OK


def run_sweep_command(args: argparse.Namespace, out: Output) -> ExitCode:
    """``kvtierd sim sweep``."""
    cfg = build_config(args)
    sw = sweep(cfg, args, out)
    payload = headline_payload(sw, args.quality_target)
    everything = (*sw.evicpress, *sw.oracle, *sw.baselines)
    if out.as_json:
        runs = [r.summary() for r in everything]
        out.json({"config": config_summary(cfg), "runs": runs, **payload})
        return ExitCode.OK
    out.table(
        f"sweep ({cfg.workload.model}, {cfg.workload.n_requests} requests)",
        RUN_COLUMNS,
        [run_row(r) for r in everything],
    )
    print_headline(out, payload)
    return ExitCode.OK
