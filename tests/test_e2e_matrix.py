"""The multi-seed table (benchmarks/e2e/e2e_matrix.py, issue 30) on hand-made runs."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from benchmarks.e2e.e2e_matrix import (
    KINDS_SYSTEMS,
    LEAN,
    OURS,
    RUNS,
    SYSTEMS,
    Run,
    bench_args,
    headline,
    measured,
    report,
    selected_runs,
)

# per system: its TTFT on every request, share of identical answers (its interval's low end
# 0.05 below), accuracy and accuracy interval's low end
FAST = {"prefill": (1.0, 1.0, 0.7, 0.6), "lmcache": (0.8, 0.98, 0.7, 0.6),
        "lru": (0.6, 0.98, 0.7, 0.6), "fixed-int8": (0.4, 0.98, 0.7, 0.6),
        OURS: (0.2, 0.97, 0.65, 0.55)}  # fmt: skip


def _write_run(root: Path, name: str, systems: dict[str, tuple[float, float, float, float]],
               scale: float = 1.0, similarity: float = 0.98) -> None:  # fmt: skip
    d = root / name
    d.mkdir(parents=True)
    rows: dict[str, dict[str, Any]] = {}
    for s, (ttft, exact, acc, acc_low) in systems.items():
        outs = [{"index": i, "ttft_s": ttft * scale * (1 + 0.1 * (i % 3)), "error": ""}
                for i in range(30)]  # fmt: skip
        (d / f"{s}.json").write_text(json.dumps({"outcomes": outs}))
        mean = sum(o["ttft_s"] for o in outs) / len(outs)
        intervals = {"accuracy": [acc, acc_low, acc + 0.1],
                     "exact": [exact, exact - 0.05, min(1.0, exact + 0.05)]}  # fmt: skip
        rows[s] = {"ttft_mean_s": mean, "similarity": similarity, "accuracy": acc,
                   "exact": exact, "intervals": intervals}  # fmt: skip
    for row in rows.values():
        row["ceiling_s"] = 0.1 * scale
    (d / "summary.json").write_text(json.dumps(rows))
    (d / "summary.md").write_text(f"(bench_e2e's summary of {name})\n")


def test_ratios_per_run_and_across_runs(tmp_path: Path) -> None:
    _write_run(tmp_path, "seed1", FAST)
    _write_run(tmp_path, "seed2", FAST, scale=1.0)
    text, data = report(tmp_path, [Run("seed1", 1), Run("seed2", 2)], {"seed1": 600.0}, sim=False)
    ratios = data["runs"]["seed1"]["ratios"]
    assert ratios["fixed-int8"]["ratio"][0] == pytest.approx(2.0)  # 0.4 / 0.2 on every request
    assert ratios["lru"]["ratio"][0] == pytest.approx(3.0)
    assert all(r["equal_quality"] for r in ratios.values())
    # the fastest baseline at equal quality, prefill aside
    assert data["runs"]["seed1"]["headline"][0] == "fixed-int8"
    assert "| fixed-int8 | 2.000 [2.000, 2.000] | 2 of 2 |" in text
    assert "**Headline**" in text and "(fixed-int8, fixed-int8): 2.000" in text
    assert "seed 1, 10 min" in text
    # room: fixed int8's mean (0.44 s) over the ceiling (0.1 s): no policy could gain more
    assert ratios["fixed-int8"]["room"] == pytest.approx(4.4)
    assert "| fixed-int8 | 2.000 [2.000, 2.000] | yes | 4.40x |" in text


def test_a_run_without_a_ceiling_has_no_room(tmp_path: Path) -> None:
    _write_run(tmp_path, "seed1", FAST)
    summary = tmp_path / "seed1" / "summary.json"
    rows = json.loads(summary.read_text())
    for row in rows.values():
        del row["ceiling_s"]  # a summary from before the ceiling was recorded
    summary.write_text(json.dumps(rows))
    text, data = report(tmp_path, [Run("seed1", 1)], {}, sim=False)
    assert data["runs"]["seed1"]["ratios"]["lru"]["room"] is None
    assert "| lru | 3.000 [3.000, 3.000] | yes | - |" in text


def test_a_baseline_of_better_quality_is_not_at_equal_quality(tmp_path: Path) -> None:
    worse = dict(FAST)
    worse[OURS] = (0.2, 0.90, 0.65, 0.55)  # below the low end of int8's identical answers
    _write_run(tmp_path, "seed1", worse)
    _, data = report(tmp_path, [Run("seed1", 1)], {}, sim=False)
    assert not data["runs"]["seed1"]["ratios"]["fixed-int8"]["equal_quality"]
    assert headline(data["runs"]["seed1"]["ratios"]) is None
    # similarity decides nothing (issue 39): the same answers at any similarity are equal
    _write_run(tmp_path, "seed3", FAST, similarity=0.5)
    _, data = report(tmp_path, [Run("seed3", 3)], {}, sim=False)
    assert data["runs"]["seed3"]["ratios"]["fixed-int8"]["equal_quality"]
    low_acc = dict(FAST)
    low_acc[OURS] = (0.2, 0.98, 0.55, 0.5)  # below the low end of the baselines' accuracy
    _write_run(tmp_path, "seed2", low_acc)
    text, data = report(tmp_path, [Run("seed2", 2)], {}, sim=False)
    assert data["runs"]["seed2"]["headline"] is None
    assert "no baseline is at" in text


def test_a_summary_without_identical_answers_is_refused(tmp_path: Path) -> None:
    _write_run(tmp_path, "seed1", FAST)
    summary = tmp_path / "seed1" / "summary.json"
    rows = json.loads(summary.read_text())
    for row in rows.values():
        del row["exact"]  # a summary from before issue 39
    summary.write_text(json.dumps(rows))
    with pytest.raises(ValueError, match="rerun bench_e2e on its --out"):
        report(tmp_path, [Run("seed1", 1)], {}, sim=False)


def test_runs_not_on_disk_are_left_out(tmp_path: Path) -> None:
    _write_run(tmp_path, "seed1", {k: v for k, v in FAST.items() if k != "lmcache"})
    text, data = report(tmp_path, [Run("seed1", 1)], {}, sim=False)
    assert data["runs"] == {} and "No run measured yet" in text


def test_bench_args_name_the_workload_and_every_system(tmp_path: Path) -> None:
    args = bench_args(Run("seed1-sp1024", 1, 1024), tmp_path)
    assert args[args.index("--seed") + 1] == "1"
    assert args[args.index("--system-prompt-tokens") + 1] == "1024"
    assert args[args.index("--out") + 1] == str(tmp_path / "seed1-sp1024")
    at = args.index("--systems") + 1
    assert tuple(args[at : at + len(SYSTEMS)]) == SYSTEMS
    assert args[args.index("--lengths") + 1 : args.index("--lengths") + 3] == ["1024", "2048"]


def test_the_simulator_is_set_beside_each_run(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import benchmarks.e2e.e2e_matrix as matrix

    _write_run(tmp_path, "seed1", FAST)
    _write_run(tmp_path, "seed2", FAST)
    off = {"seed1": {s: 1.1 for s in SYSTEMS}, "seed2": {**{s: 1.0 for s in SYSTEMS}, "lru": 0.7}}
    monkeypatch.setattr(matrix, "simulated", lambda run, out: off[run.name])
    text, data = report(tmp_path, [Run("seed1", 1), Run("seed2", 2)], {})
    assert data["runs"]["seed2"]["simulated"]["lru"] == 0.7
    assert "within 25% of the measured mean TTFT for every system on 1 of 2 runs (seed1)" in text


def test_a_lean_run_names_and_needs_only_its_systems(tmp_path: Path) -> None:
    run = Run("seed2", 2, systems=LEAN)
    args = bench_args(run, tmp_path)
    at = args.index("--systems") + 1
    assert tuple(args[at : at + len(LEAN)]) == LEAN and "lmcache" not in args
    _write_run(tmp_path, "seed2", {k: v for k, v in FAST.items() if k in LEAN})
    assert measured(run, tmp_path) and not measured(Run("seed2", 2), tmp_path)
    _, data = report(tmp_path, [run], {}, sim=False)
    assert set(data["runs"]["seed2"]["ratios"]) == set(LEAN) - {OURS}


def test_lean_gives_every_selected_run_the_lean_systems() -> None:
    assert [r.name for r in selected_runs(None, lean=False)] == [r.name for r in RUNS]
    full = selected_runs(["seed1-sp1024", "seed1"], lean=False)
    assert [(r.name, r.systems) for r in full] == [("seed1", SYSTEMS), ("seed1-sp1024", SYSTEMS)]
    lean = selected_runs(["seed1-sp1024"], lean=True)
    assert [(r.name, r.system_prompt_tokens, r.systems) for r in lean] == [
        ("seed1-sp1024", 1024, LEAN)
    ]


def _judged(speedup: float, gain: float) -> dict[str, Any]:
    return {"speedup": [speedup, speedup - 0.1, speedup + 0.1],
            "share_gain": [gain, gain - 0.02, gain + 0.02]}  # fmt: skip


def test_the_kinds_runs_name_their_workload_frontier_and_prior(tmp_path: Path) -> None:
    kinds = selected_runs(["kinds-seed1", "kinds-seed2"], lean=False)
    assert [(r.name, r.seed, r.workload) for r in kinds] == [
        ("kinds-seed1", 1, "kinds"),
        ("kinds-seed2", 2, "kinds"),
    ]
    args = bench_args(kinds[0], tmp_path)
    assert args[args.index("--workload") + 1] == "kinds"
    at = args.index("--fixed") + 1
    assert args[at : at + 3] == ["int8", "int4", "keydiff@0.7+int8"]
    at = args.index("--systems") + 1
    assert tuple(args[at : at + len(KINDS_SYSTEMS)]) == KINDS_SYSTEMS == (
        "prefill", "lru", "fixed-int8", "fixed-int4", "fixed-keydiff@0.7+int8", OURS,
        "evicpress-prior-a2")  # fmt: skip
    assert selected_runs(["kinds-seed1"], lean=True)[0].systems == KINDS_SYSTEMS  # no lmcache
    # the tasks runs keep their workload and fixed int8
    args = bench_args(Run("seed1", 1), tmp_path)
    assert args[args.index("--workload") + 1] == "tasks"
    assert args[args.index("--fixed") + 1 :][:1] == ["int8"]


def test_the_frontier_judgments_are_set_across_runs(tmp_path: Path) -> None:
    systems = {"prefill": (1.0, 1.0, 0.7, 0.6), "lru": (0.6, 0.98, 0.7, 0.6),
               "fixed-int8": (0.4, 0.9, 0.7, 0.6), "fixed-int4": (0.25, 0.7, 0.6, 0.5),
               "fixed-keydiff@0.7+int8": (0.3, 0.5, 0.4, 0.3), OURS: (0.3, 0.85, 0.7, 0.6),
               "evicpress-prior-a2": (0.35, 0.8, 0.7, 0.6)}  # fmt: skip
    runs = selected_runs(["kinds-seed1", "kinds-seed2"], lean=False)
    for run, (speed, gain) in zip(runs, [(1.2, 0.05), (1.4, 0.07)], strict=True):
        _write_run(tmp_path, run.name, systems)
        summary = tmp_path / run.name / "summary.json"
        rows = json.loads(summary.read_text())
        rows[OURS]["frontier"] = _judged(speed, gain)
        rows["evicpress-prior-a2"]["frontier"] = _judged(1.0, 0.0)
        summary.write_text(json.dumps(rows))
    text, data = report(tmp_path, runs, {}, sim=True)  # the kinds runs are not simulated
    assert "Not simulated" in text
    assert data["runs"]["kinds-seed1"]["workload"] == "kinds"
    assert set(data["runs"]["kinds-seed1"]["ratios"]) == set(KINDS_SYSTEMS) - {
        OURS, "evicpress-prior-a2"}  # fmt: skip
    assert data["runs"]["kinds-seed2"]["frontier"][OURS]["speedup"][0] == 1.4
    assert f"| {OURS} | kinds-seed1 | 1.200 [1.100, 1.300]x | 0.050 [0.030, 0.070] |" in text
    # across two runs: mean 1.3, t(0.975, 1) = 12.706 times sd 0.1414 / sqrt(2) = 1.2706
    assert f"| {OURS} | across 2 | 1.300 [0.029, 2.571]x | 0.060 [-0.067, 0.187] |" in text
    assert "| evicpress-prior-a2 | across 2 | 1.000 [1.000, 1.000]x |" in text
