"""benchmarks/e2e/sim_e2e.py: bench_e2e's workload rebuilt for ``kvtierd sim predict`` (real
tokenizer), predicted per system and compared with a measurement of the same requests."""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

import pytest

from benchmarks.e2e.bench_e2e import kv_bytes_per_token, systems, workload_args
from benchmarks.e2e.e2e_workload import make_contexts, make_requests, trace_gaps
from benchmarks.e2e.sim_e2e import (
    build_workload,
    compare,
    placer_for,
    simulate_argv,
    simulate_run,
)
from kvtierd.sim.calibration import load_calibration
from kvtierd.sim.given import parse_workload
from kvtierd.sim.predict import predict

pytestmark = pytest.mark.model

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def tokenizer(real_model: Path) -> Any:
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(real_model)


def test_rebuilt_workload_predicted_and_compared(
    tokenizer: Any, real_model: Path, tmp_path: Path
) -> None:
    args = argparse.Namespace(contexts=5, lengths=[1024], requests=12, qps=0.5, zipf=1.0,
                              seed=0, chunk=256, cpu_share=0.1, ssd_share=0.4,
                              quality=None, out=tmp_path / "e2e",
                              warmup_questions=3, system_prompt_tokens=0,
                              workload="tasks")  # fmt: skip
    quality = tmp_path / "cases.jsonl"
    row = {"case": "x", "task": "niah_single", "length": 1024,
           "results": {"knorm@0.5": {"similarity": 0.8}}}  # fmt: skip
    quality.write_text(json.dumps(row) + "\n")
    args.quality = quality
    doc = build_workload(args, tokenizer, real_model)
    warm = [r for r in doc["requests"] if not r.get("measured", True)]
    timed = [r for r in doc["requests"] if r.get("measured", True)]
    # bench_e2e's warm-up: each context's first 3 questions, question by question
    assert [(r["context"], r["question"]) for r in warm][:7] == [
        (0, 0),
        (1, 0),
        (2, 0),
        (3, 0),
        (4, 0),
        (0, 1),
        (1, 1),
    ]
    assert len(warm) == 12 and len(timed) == 12  # contexts 0, 2 and 3 have 2 questions only
    contexts = make_contexts(tokenizer, 5, [1024], 0)
    sent = make_requests(contexts, num=12, qps=0.5, zipf_s=1.0, seed=0, gaps=trace_gaps())
    assert [(r["context"], r["question"], r["at_s"]) for r in timed] == [
        (r.context, r.question, r.at_s) for r in sent
    ]  # the requests bench_e2e sends
    assert all(768 <= c["tokens"] <= 1024 and c["tokens"] % 256 == 0 for c in doc["contexts"])
    assert doc["contexts"][0]["quality"] == {"knorm@0.5": 0.8}  # niah_single at 1024 tokens
    assert doc["contexts"][1]["quality"] == {}  # niah_multikey: not in the quality file
    assert doc["model"]["kv_heads"] == 3 and doc["model"]["layers"] == 30
    # no measurement in --out: bench_e2e's rule, the CPU tier at least two largest prompts' KV
    largest = max(c["tokens"] for c in doc["contexts"]) + 64
    per_token = kv_bytes_per_token(real_model)  # in the dtype the stack serves in on this CPU
    total = sum(c["tokens"] for c in doc["contexts"])
    capacities = [t["capacity_bytes"] for t in doc["tiers"]]
    assert capacities == [2 * per_token * largest, int(per_token * total * 0.4)]

    given = parse_workload(doc, "w.json")
    cal = load_calibration(REPO / "configs/sim/smollm2-vllm-cpu.yaml", per_token)
    grid = ["knorm", "keydiff", "int8", "int4", "keydiff+int8"]
    every = systems([2.0], ["knorm@0.5"], real_model, grid, [1.0, 0.75, 0.5, 0.25])
    cfg, grid = placer_for("fixed-knorm@0.5", every["fixed-knorm@0.5"].policy)
    assert cfg.placer == "fixed:knorm@0.5" and grid == ("knorm@0.5",)
    cfg, grid = placer_for("evicpress-a2", every["evicpress-a2"].policy)
    assert cfg.placer == "evicpress" and cfg.alpha == 2.0 and "keydiff@0.5+int8" in grid
    pred = predict(cfg, given, cal, [v for v in grid if v == "knorm@0.5"])
    assert len(pred.ids) == 12 and pred.ttft_s.min() > 0
    measured = {"outcomes": [
        {"index": r["index"], "context": r["context"], "question": r["question"],
         "ttft_s": t, "error": ""} for r, t in zip(timed, pred.ttft_s.tolist(), strict=True)
    ]}  # fmt: skip
    c = compare(pred, measured, doc)
    assert c["requests"] == 12 and c["predicted"] == c["measured"]
    measured["outcomes"][0]["question"] += 1
    with pytest.raises(SystemExit, match="run sim_e2e with the arguments bench_e2e ran with"):
        compare(pred, measured, doc)


E2E_SMALL = Path(__file__).parent / "data" / "e2e_small"
"""A real bench_e2e run, small (2026-11-23, 2 vCPU AMD EPYC, commit 2d33b40)::

    python -m benchmarks.e2e.bench_e2e --contexts 6 --lengths 1024 2048 --requests 16 --qps 0.3 \\
        --systems prefill lru --settle-s 30

its ``prefill.json``, ``lru.json``, ``summary.json`` and ``work/lru/daemon/kvtierd.yaml`` as
written, and of ``work/lru/vllm.log`` LMCache's per-request lines only (the rest is vLLM's
start-up output). It predates vLLM's usage in the outcomes (hits come from the log) and the
warm-up of three questions per context (it asked one)."""


def test_sim_e2e_calibrates_from_a_real_bench_e2e_run(tmp_path: Path) -> None:
    import shutil
    import subprocess
    import sys

    import yaml

    out = tmp_path / "e2e"
    shutil.copytree(E2E_SMALL, out)
    argv = ["--contexts", "6", "--lengths", "1024", "2048", "--requests", "16", "--qps", "0.3",
            "--systems", "prefill", "lru", "--warmup-questions", "1",
            "--out", str(out)]  # fmt: skip
    done = subprocess.run([sys.executable, "-m", "benchmarks.e2e.sim_e2e", *argv], cwd=REPO,
                          capture_output=True, text=True, timeout=300, check=False)  # fmt: skip
    assert done.returncode == 0, done.stderr
    workload = json.loads((out / "workload.json").read_text())
    assert workload["tiers"] == [{"name": "cpu", "capacity_bytes": 12976128},  # as the daemon
                                 {"name": "ssd", "capacity_bytes": 51904512}]  # fmt: skip
    cal = yaml.safe_load((out / "calibration-kvtierd.yaml").read_text())
    # Only 1 of the prefill system's requests ran alone (one length), and this run predates
    # vLLM's usage in the outcomes (no lru miss counts): every timed request's estimate is a
    # prefill sample. LMCache's log shows 11 timed requests loading their whole context (the 6
    # warm-ups all miss); 2 of them, at two lengths, ran alone: those are the tiers' samples.
    assert len(cal["prefill"]["samples"]) == 16
    assert [len(t["samples"]) for t in cal["tiers"]] == [2, 2]
    assert not (out / "calibration-lmcache.yaml").exists()  # no lmcache.json measured
    doc = json.loads((out / "simulated.json").read_text())
    prefill, lru = doc["systems"]["prefill"], doc["systems"]["lru"]
    assert prefill["comparison"]["requests"] == lru["comparison"]["requests"] == 16
    assert prefill["comparison"]["hits"] == {"predicted": 0, "measured": None}  # no LMCache
    assert lru["comparison"]["hits"]["measured"] == 11
    assert lru["prediction"]["placer"] == "lru" and prefill["prediction"]["quality_mean"] == 1.0
    text = (out / "simulated.md").read_text()
    assert "| prefill | fitted its prefill line and decode_s |" in text
    assert "| lru | fitted the tiers |" in text
    # the prefill system is predicted with its own line (its vLLM may keep another dtype)
    own = yaml.safe_load((out / "calibration-none.yaml").read_text())
    assert len(own["prefill"]["samples"]) == 16 and own["decode_s"] >= 0
    # one seed's directory of a multi-seed run: the same, as a function of bench_e2e's own
    # command line (its --max-tokens, --settle-s accepted) or of parsed arguments
    got = simulate_argv([*argv, "--max-tokens", "16", "--settle-s", "30"])
    assert got == json.loads((out / "simulated.json").read_text())
    p = argparse.ArgumentParser()
    workload_args(p)
    p.add_argument("--out", type=Path)
    assert simulate_run(p.parse_args(argv)) == got  # no --calibration, --quality: fitted
    assert set(got["ratios"]) == {"prefill", "lru"}
    assert got["ratios"]["lru"] == pytest.approx(
        lru["comparison"]["predicted"]["mean"] / lru["comparison"]["measured"]["mean"]
    )
    # a calibration file given instead: nothing is fitted, every row is held out
    given = REPO / "configs/sim/smollm2-vllm-cpu.yaml"
    done = subprocess.run([sys.executable, "-m", "benchmarks.e2e.sim_e2e", *argv, "--calibration",
                           str(given)], cwd=REPO, capture_output=True, text=True, timeout=300,
                          check=False)  # fmt: skip
    assert done.returncode == 0, done.stderr
    assert "| lru | held out (smollm2-vllm-cpu.yaml) |" in (out / "simulated.md").read_text()


def test_sim_e2e_without_a_measurement_says_what_to_run(tmp_path: Path) -> None:
    import subprocess
    import sys

    done = subprocess.run(
        [sys.executable, "-m", "benchmarks.e2e.sim_e2e", "--contexts", "2", "--lengths", "1024",
         "--requests", "3", "--out", str(tmp_path)],
        cwd=REPO, capture_output=True, text=True, timeout=300, check=False,
    )  # fmt: skip
    assert done.returncode == 1
    assert "run bench_e2e first (at least --systems prefill lru), or give --calibration" in (
        done.stderr
    )


def test_a_shared_system_prompt_in_the_rebuilt_workload(
    tokenizer: Any, real_model: Path, tmp_path: Path
) -> None:
    """``--system-prompt-tokens 1024``: the contexts count it, the file says the 1,024 tokens
    every context shares, the tiers count them once; the simulator then has every request
    find the prefix cached after the warm-up, and prefill longer prompts."""
    base = dict(contexts=5, lengths=[1024], requests=12, qps=0.5, zipf=1.0, seed=0, chunk=256,
                cpu_share=0.1, ssd_share=0.4, quality=None, out=tmp_path / "e2e",
                warmup_questions=1, workload="tasks")  # fmt: skip
    plain = build_workload(argparse.Namespace(**base, system_prompt_tokens=0), tokenizer,
                           real_model)  # fmt: skip
    shared = build_workload(argparse.Namespace(**base, system_prompt_tokens=1024), tokenizer,
                            real_model)  # fmt: skip
    assert "shared_prefix_tokens" not in plain and shared["shared_prefix_tokens"] == 1024
    for a, b in zip(plain["contexts"], shared["contexts"], strict=True):
        assert b["tokens"] - 1024 in (a["tokens"], a["tokens"] - 256, a["tokens"] + 256)
    own = sum(c["tokens"] - 1024 for c in shared["contexts"])
    per_token = kv_bytes_per_token(real_model)
    assert shared["tiers"][1]["capacity_bytes"] == int(per_token * (own + 1024) * 0.4)
    cal = load_calibration(REPO / "configs/sim/smollm2-vllm-cpu.yaml", per_token)
    every = systems([2.0], [], real_model, ["knorm"], [1.0, 0.5])
    lru, _ = placer_for("lru", every["lru"].policy)
    prefill, _ = placer_for("prefill", None)
    with_prefix = predict(lru, parse_workload(shared, "w.json"), cal).result.hit_rate
    without = predict(lru, parse_workload(plain, "w.json"), cal).result.hit_rate
    assert with_prefix["shared_prefix_cached"] == 1.0 and "shared_prefix_cached" not in without
    slow = predict(prefill, parse_workload(shared, "w.json"), cal).result.service_s
    fast = predict(prefill, parse_workload(plain, "w.json"), cal).result.service_s
    assert (slow > fast).all()  # 1,024 more tokens to prefill in every prompt
