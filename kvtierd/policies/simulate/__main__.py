"""``python -m kvtierd.policies.simulate``: run the headline sweep, print it, write JSON + PNGs.

Example::

    python -m kvtierd.policies.simulate --model llama-3.1-8b \\
        --trace ../shared/data/AzureLLMInferenceTrace_conv.csv --out /tmp/sim
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence
from dataclasses import asdict, replace
from pathlib import Path

from kvtierd.policies.simulate.engine import SimulationConfig
from kvtierd.policies.simulate.frontier import (
    DEFAULT_ALPHAS,
    headline,
    qps_comparison,
    run_sweep,
)
from kvtierd.policies.simulate.plots import plot_frontier, plot_qps
from kvtierd.policies.simulate.workload import MODELS, WorkloadConfig


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m kvtierd.policies.simulate")
    parser.add_argument("--model", default="llama-3.1-8b", choices=sorted(MODELS))
    parser.add_argument("--trace", default="", help="CSV trace (Azure / BurstGPT) for arrivals")
    parser.add_argument("--arrival", default="", help="poisson | bursty | trace")
    parser.add_argument("--n-contexts", type=int, default=555)
    parser.add_argument("--n-requests", type=int, default=20000)
    parser.add_argument("--zipf", type=float, default=0.8)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--selection", default="per_byte", choices=["per_byte", "absolute"])
    parser.add_argument("--alphas", type=float, nargs="*", default=list(DEFAULT_ALPHAS))
    parser.add_argument("--quality-target", type=float, default=0.8)
    parser.add_argument("--out", default="", help="folder for results.json and PNG plots")
    args = parser.parse_args(argv)
    arrival = args.arrival or ("trace" if args.trace else "poisson")
    wl = WorkloadConfig(
        model=args.model,
        n_contexts=args.n_contexts,
        n_requests=args.n_requests,
        zipf_s=args.zipf,
        arrival=arrival,
        trace_path=args.trace,
        seed=args.seed,
    )
    cfg = replace(SimulationConfig(), workload=wl, selection=args.selection)
    sweep = run_sweep(cfg, alphas=args.alphas)
    rows = headline(sweep)
    qps = qps_comparison(sweep, args.quality_target)
    print("TTFT reduction at equal quality (EvicPress frontier vs baseline):")
    for row in rows:
        if row.points:
            print(
                f"  {row.baseline:16s} {row.reduction_min:5.2f}x .. {row.reduction_max:5.2f}x"
                f" (median {row.reduction_median:.2f}x over {row.points} points)"
            )
        else:
            print(f"  {row.baseline:16s} frontier does not reach its quality")
    print(
        f"QPS at mean TTFT <= {qps.ttft_target_s:.3f} s, quality >= {qps.quality_target}: "
        f"EvicPress {qps.evicpress_qps:.2f} (alpha {qps.evicpress_alpha:g}) vs "
        f"{qps.baseline} {qps.baseline_qps:.2f} -> {qps.ratio:.2f}x"
    )
    if args.out:
        out = Path(args.out)
        out.mkdir(parents=True, exist_ok=True)
        payload = {
            "config": asdict(cfg),
            "evicpress": [r.summary() for r in sweep.evicpress],
            "baselines": [r.summary() for r in sweep.baselines],
            "headline": [asdict(r) for r in rows],
            "qps": asdict(qps) | {"ratio": qps.ratio},
        }
        (out / "results.json").write_text(json.dumps(payload, indent=2, default=str))
        plot_frontier(sweep, out / "frontier.png")
        best_e = next(r for r in sweep.evicpress if r.alpha == qps.evicpress_alpha)
        best_b = next(r for r in sweep.baselines if r.placer == qps.baseline)
        runs = {f"evicpress a={best_e.alpha:g}": best_e, best_b.placer: best_b}
        runs.update({r.placer: r for r in sweep.baselines if r.placer in ("lru", "prefill")})
        plot_qps(runs, out / "ttft_vs_qps.png", max_qps=2.5 * max(qps.evicpress_qps, 0.1))
        print(f"wrote {out}/results.json, frontier.png, ttft_vs_qps.png")
    return 0


if __name__ == "__main__":
    sys.exit(main())
