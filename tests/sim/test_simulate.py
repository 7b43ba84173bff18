"""Simulator: presets, calibration, determinism, trace loading, headline and plots (small)."""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest

from kvtierd.sim import SimulationConfig, headline, run_simulation, run_sweep
from kvtierd.sim.frontier import frontier, ttft_at_quality
from kvtierd.sim.plots import plot_frontier
from kvtierd.sim.replay import loaded_ttft_s, prepare, qps_at_ttft
from kvtierd.sim.variants import VariantSpace, quant_ratio
from kvtierd.sim.workload import MODELS, WorkloadConfig, load_trace_timestamps

SMALL = SimulationConfig(workload=WorkloadConfig(n_contexts=60, n_requests=1500, seed=3))


def test_model_presets_match_the_paper():
    assert MODELS["llama-3.1-8b"].kv_bytes_per_token == 131072  # 0.125 MiB, §6.2: 0.12 GB/1K
    assert MODELS["qwen3-30b-a3b"].kv_bytes_per_token * 1000 / 2**30 == pytest.approx(0.0916, 1e-3)
    assert quant_ratio("int8") == 0.5625
    assert quant_ratio("int4") == 0.3125


def test_calibration_follows_section_4_2():
    prep = prepare(SMALL)
    names = prep.variants.names
    assert names[0] == "none" and len(names) == 1 + 27 + 2
    q = prep.variants.quality
    assert np.all(q[:, 0] == 1.0)
    # Quality falls monotonically with the kept ratio for each method.
    kd = [names.index(f"keydiff@{r:g}") for r in VariantSpace().ratios]
    assert np.all(np.diff(q[:, kd], axis=1) <= 1e-12)
    assert np.all(prep.variants.size_bytes[:, kd[-1]] < prep.variants.size_bytes[:, 0])


def test_same_seed_same_result_and_sweep_headline(tmp_path):
    a = run_simulation(SMALL)
    b = run_simulation(SMALL)
    assert a.summary() == b.summary()
    sweep = run_sweep(SMALL, alphas=(0.1, 1.0, 10.0), fixed_methods=("knorm",), fixed_ratios=(0.5,))
    qs, ts = frontier(sweep.evicpress)
    assert np.all(np.diff(qs) > 0) and np.all(np.diff(ts) > 0)
    assert ttft_at_quality((qs, ts), 2.0) is None
    rows = {r.baseline: r for r in headline(sweep)}
    assert set(rows) == {"fixed:knorm", "lru", "lfu", "prefill"}
    assert rows["prefill"].reduction_min is not None and rows["prefill"].reduction_min > 1.0
    assert plot_frontier(sweep, tmp_path / "f.png").stat().st_size > 1000


def test_queueing_grows_with_load():
    r = run_simulation(replace(SMALL, placer="lru"))
    assert loaded_ttft_s(r, 0.01) == pytest.approx(r.ttft_mean_s, rel=0.05)
    assert loaded_ttft_s(r, 1.0 / r.ttft_mean_s) > 2 * r.ttft_mean_s
    qps = qps_at_ttft(r, 2 * r.ttft_mean_s)
    assert loaded_ttft_s(r, qps) <= 2 * r.ttft_mean_s + 1e-9


def test_trace_loader_reads_azure_and_burstgpt(tmp_path):
    azure = tmp_path / "azure.csv"
    azure.write_text(
        "TIMESTAMP,ContextTokens,GeneratedTokens\n"
        "2023-11-16 18:15:46.6805900,374,44\n2023-11-16 18:15:50.9951690,396,109\n"
    )
    assert load_trace_timestamps(str(azure)).tolist() == pytest.approx([0.0, 4.314579])
    burst = tmp_path / "burst.csv"
    burst.write_text("Timestamp,Model,Request tokens\n5,a,1\n7.5,a,2\n")
    assert load_trace_timestamps(str(burst)).tolist() == [0.0, 2.5]
