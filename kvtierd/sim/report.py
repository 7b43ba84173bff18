"""``kvtierd sim report``: the sweep, then the paper's figures as PNGs and ``results.json``.

* ``frontier.png`` — mean TTFT against mean quality, EvicPress's alpha sweep vs every baseline
  (paper Fig. 7);
* ``ttft_vs_qps.png`` — mean TTFT under load for the best EvicPress and baseline configurations
  at the quality target, plus LRU and full prefill (Fig. 8); skipped when no configuration
  reaches the target;
* ``placements.png`` — tier occupancy of EvicPress (the report's ``--alpha``, default 1 as in
  the paper) next to ``lru`` and ``fixed:keydiff@0.5``, and per tier the share of contexts by
  kept ratio and method (Fig. 11).

The headline table is printed as ``kvtierd sim sweep`` prints it.
"""

from __future__ import annotations

import argparse
import json
from dataclasses import replace
from pathlib import Path
from typing import Any

from kvtierd.cli.exit_codes import CliError, ExitCode
from kvtierd.cli.output import Output
from kvtierd.sim.commands import config_summary, headline_payload, print_headline, sweep
from kvtierd.sim.frontier import Sweep
from kvtierd.sim.options import build_config
from kvtierd.sim.placements import final_placements
from kvtierd.sim.plots import have_matplotlib, plot_frontier, plot_placements, plot_qps
from kvtierd.sim.replay import SimulationConfig

OCCUPANCY_BASELINES = ("lru", "fixed:keydiff@0.5")


def _qps_plot(sw: Sweep, qps: dict[str, Any], path: Path) -> Path:
    best_e = next(r for r in sw.evicpress if r.alpha == qps["evicpress_alpha"])
    best_b = next(r for r in sw.baselines if r.placer == qps["baseline"])
    runs = {f"evicpress a={best_e.alpha:g}": best_e, best_b.placer: best_b}
    runs.update({r.placer: r for r in sw.baselines if r.placer in ("lru", "prefill")})
    return plot_qps(runs, path, max_qps=2.5 * max(qps["evicpress_qps"], 0.1))


def _placements(cfg: SimulationConfig, out: Output) -> list[Any]:
    configs = [replace(cfg, placer="evicpress")]
    configs += [replace(cfg, placer=p) for p in OCCUPANCY_BASELINES]
    if cfg.placer not in ("evicpress", *OCCUPANCY_BASELINES):
        configs.append(cfg)
    runs = []
    with out.progress("placements", len(configs)) as step:
        for c in configs:
            runs.append(final_placements(c))
            step(c.placer)
    return runs


def _write(
    out_dir: Path, cfg: SimulationConfig, sw: Sweep, payload: dict[str, Any], out: Output
) -> tuple[list[Path], list[Any]]:
    files = [plot_frontier(sw, out_dir / "frontier.png")]
    if payload["qps"] is not None:
        files.append(_qps_plot(sw, payload["qps"], out_dir / "ttft_vs_qps.png"))
    placed = _placements(cfg, out)
    files.append(plot_placements(placed, out_dir / "placements.png"))
    results = {
        "config": config_summary(cfg),
        "evicpress": [r.summary() for r in sw.evicpress],
        "evicpress_oracle": [r.summary() for r in sw.oracle],
        "baselines": [r.summary() for r in sw.baselines],
        **payload,
        "placements": [p.as_dict() for p in placed],
    }
    path = out_dir / "results.json"
    path.write_text(json.dumps(results, indent=2, default=str) + "\n")
    files.append(path)
    return files, placed


def run_report(args: argparse.Namespace, out: Output) -> ExitCode:
    if not have_matplotlib():
        raise CliError(
            ExitCode.INVALID,
            "kvtierd sim report draws its figures with matplotlib, which is not installed: "
            "install the sim extra (pip install -e '.[sim]'); run and sweep need no extra",
        )
    cfg = build_config(args)
    out_dir = Path(args.out)
    try:
        out_dir.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise CliError(ExitCode.INVALID, f"cannot create --out {out_dir}: {e.strerror}") from e
    sw = sweep(cfg, args, out)
    payload = headline_payload(sw, args.quality_target)
    files, placed = _write(out_dir, cfg, sw, payload, out)
    if out.as_json:
        out.json(
            {
                **payload,
                "files": [str(f) for f in files],
                "placements": [p.as_dict() for p in placed],
            }
        )
        return ExitCode.OK
    print_headline(out, payload)
    main = placed[0]
    out.table(
        f"placements of evicpress (alpha {main.alpha:g}) by tier, method and kept ratio",
        ("tier", "method", "ratio", "contexts", "GB"),
        [
            [g.tier, g.method, f"{g.ratio:g}", g.contexts, f"{g.bytes / 1e9:.1f}"]
            for g in main.groups
        ],
    )
    out.table("files", ("file",), [[str(f)] for f in files])
    return ExitCode.OK
