"""``kvtierd sim predict``: a measured stack's TTFT, predicted for a given workload.

The workload file (:mod:`.given`) says what was sent; the calibration (:mod:`.calibration`)
what the stack measured one request at a time. The replay runs the placer exactly as for a
synthetic workload, with the calibrated tiers and prefill line; each measured request's
predicted TTFT then adds waiting on one LLM server serving in arrival order (the requests
waiting together in one step, as the calibration's ``batch`` allows), held ``decode_s`` after
each first token (:func:`kvtierd.sim.timing.batched_ttft_s`), so it is comparable with
TTFTs taken at the client of an open-loop run. ``benchmarks/e2e/sim_e2e.py`` puts it beside
``bench_e2e.py``'s measurements.
"""

from __future__ import annotations

import argparse
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import Any

import numpy as np

from kvtierd.cli.exit_codes import CliError, ExitCode
from kvtierd.cli.output import Output
from kvtierd.errors import KvtierError
from kvtierd.policies.model import FloatArray
from kvtierd.sim.calibration import Calibration, load_calibration
from kvtierd.sim.given import (
    GivenWorkload,
    calibrated_prepare,
    calibrated_tiers,
    load_workload,
    measured_variants,
)
from kvtierd.sim.options import PlacerChoice, apply_choice, placer_choice
from kvtierd.sim.replay import SimulationConfig, SimulationResult, run_simulation
from kvtierd.sim.timing import batched_ttft_s


@dataclass(frozen=True, slots=True, eq=False)
class Prediction:
    """Per measured request (in order): ``ttft_s`` with queueing; ``result`` has the rest."""

    result: SimulationResult
    ttft_s: FloatArray
    ids: tuple[int, ...]

    def summary(self) -> dict[str, Any]:
        r, t = self.result, self.ttft_s
        return {
            "placer": r.placer,
            "alpha": r.alpha,
            "quality_mean": r.quality_mean,
            "ttft_mean_s": float(t.mean()),
            "ttft_p50_s": float(np.percentile(t, 50)),
            "ttft_p90_s": float(np.percentile(t, 90)),
            "service_mean_s": r.ttft_mean_s,
            "hit_rate": r.hit_rate,
        }

    def by_class(self) -> dict[str, dict[str, float]]:
        """Per class of request (a tier, ``recompute``, ``miss``, ``prefix``): count and mean
        TTFTs."""
        served = self.result.served_as()
        out = {}
        for name, count in Counter(served).items():
            mask = np.array([s == name for s in served])
            out[name] = {
                "requests": count,
                "ttft_mean_s": float(self.ttft_s[mask].mean()),
                "service_mean_s": float(self.result.service_s[mask].mean()),
            }
        return out

    def requests(self) -> list[dict[str, Any]]:
        r = self.result
        return [
            {"index": i, "served": s, "ttft_s": float(t), "service_s": float(sv),
             "quality": float(q)}
            for i, s, t, sv, q in zip(self.ids, r.served_as(), self.ttft_s, r.service_s,
                                      r.quality, strict=True)
        ]  # fmt: skip


def predict(
    cfg: SimulationConfig,
    given: GivenWorkload,
    cal: Calibration,
    variants: Sequence[str] | None = None,
) -> Prediction:
    """``cfg``'s placer on ``given``, offered ``variants`` (default: every measured one;
    ``cfg.variants`` and ``cfg.tiers`` are not used: the calibration and workload say them)."""
    chosen = measured_variants(given, cal) if variants is None else variants
    prep = calibrated_prepare(given, cal, chosen)
    run = replace(cfg, tiers=calibrated_tiers(given, cal))
    result = run_simulation(run, prep)
    ttft = batched_ttft_s(
        result.arrival_s, result.service_s, result.new_tokens, cal.batching, cal.decode_s
    )
    return Prediction(result, ttft, given.ids)


def _grid(choice: PlacerChoice, given: GivenWorkload, cal: Calibration) -> tuple[str, ...]:
    """The variants offered: the policy's grid (those with a measured quality), else every
    measured one; a ``fixed:V`` placer needs V measured."""
    have = measured_variants(given, cal)
    grid = tuple(v for v in choice.grid if v in have) if choice.policy else have
    fixed = choice.placer.partition(":")[2]
    if fixed and fixed not in have:
        raise CliError(
            ExitCode.INVALID,
            f"placer {choice.placer!r}: no quality measured for {fixed!r} (in the calibration's "
            f"quality or the workload's contexts); measured: {', '.join(have)}",
        )
    return (*grid, fixed) if fixed and fixed not in grid else grid


def run_predict(args: argparse.Namespace, out: Output) -> ExitCode:
    """``kvtierd sim predict``."""
    choice = placer_choice(args)
    try:
        given = load_workload(args.workload)
        cal = load_calibration(args.calibration, given.workload.model.kv_bytes_per_token)
        cfg = apply_choice(SimulationConfig(warmup_fraction=0.0), choice, args)
        with out.working(f"predicting {cfg.label}"):
            p = predict(cfg, given, cal, _grid(choice, given, cal))
    except (KvtierError, ValueError) as e:
        raise CliError(ExitCode.INVALID, str(e)) from e
    if out.as_json:
        out.json({"calibration": cal.summary(), "prediction": p.summary(),
                  "classes": p.by_class(), "requests": p.requests()})  # fmt: skip
        return ExitCode.OK
    s = p.summary()
    out.table(
        f"prediction for {args.workload} ({len(p.ids)} requests), calibration {args.calibration}",
        ("placer", "alpha", "quality", "TTFT mean s", "p50 s", "p90 s", "unloaded mean s"),
        [[s["placer"], f"{s['alpha']:g}", f"{s['quality_mean']:.3f}", f"{s['ttft_mean_s']:.3f}",
          f"{s['ttft_p50_s']:.3f}", f"{s['ttft_p90_s']:.3f}", f"{s['service_mean_s']:.3f}"]],
    )  # fmt: skip
    out.table(
        "by class of request",
        ("served", "requests", "TTFT mean s", "unloaded mean s"),
        [[k, v["requests"], f"{v['ttft_mean_s']:.3f}", f"{v['service_mean_s']:.3f}"]
         for k, v in p.by_class().items()],
    )  # fmt: skip
    return ExitCode.OK
