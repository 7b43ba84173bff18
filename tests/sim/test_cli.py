"""``kvtierd sim run | sweep | report`` on tiny workloads (no daemon)."""

from __future__ import annotations

import io
import json
import sys
from collections.abc import Callable
from pathlib import Path

import pytest
from PIL import Image
from rich.console import Console

from kvtierd.cli.output import Output
from kvtierd.sim.cli import main
from tests.cli_result import Result

ROOT = Path(__file__).resolve().parents[2]
POLICIES = ROOT / "configs" / "policies"
TINY = ("--contexts", "40", "--requests", "400", "--dram", "40GB", "--ssd", "100GB")
ALPHAS = ("--alphas", "0.1", "1", "10")


Sim = Callable[..., Result]


@pytest.fixture
def sim(capsys: pytest.CaptureFixture[str]) -> Sim:
    """``sim("run", "--json")`` runs ``kvtierd sim run --json`` in process."""

    def run(*argv: str) -> Result:
        capsys.readouterr()
        code = main(list(argv))
        captured = capsys.readouterr()
        return Result(code, captured.out, captured.err)

    return run


def test_one_run_json(sim: Sim) -> None:
    r = sim("run", *TINY, "--json")
    assert r.code == 0, r.err
    doc = r.json()
    assert doc["config"]["placer"] == "evicpress" and doc["config"]["requests"] == 400
    assert [t["capacity_bytes"] for t in doc["config"]["tiers"]] == [40e9, 100e9, None]
    (run,) = doc["runs"]
    assert run["placer"] == "evicpress" and run["alpha"] == 1.0
    assert 0 < run["quality_mean"] < 1 and 0 < run["ttft_p50_s"] <= run["ttft_p99_s"]
    assert set(run["hit_rate"]) == {"dram", "ssd", "remote", "recompute", "miss"}
    assert doc["config"]["frequency"] == "online" and doc["config"]["recompute_slower_loads"]
    assert sum(run["hit_rate"].values()) == pytest.approx(1.0)


def test_table_and_seed(sim: Sim) -> None:
    r = sim("run", *TINY, "--placer", "lru")
    assert r.code == 0 and "lru" in r.out and "served from" in r.out
    # Deterministic in the seed. Not asserted for EvicPress: its insert refinement gives HiGHS
    # 0.1 s (kvtierd.policies.evicpress.INSERT_LIMITS), so on a loaded machine two runs of the
    # same seed can differ slightly (docs/simulator.md).
    runs = [sim("run", *TINY, "--placer", "lru", "--seed", s, "--json").json()["runs"][0]
            for s in "001"]  # fmt: skip
    assert runs[0] == runs[1]
    assert runs[0]["ttft_mean_s"] != runs[2]["ttft_mean_s"]


@pytest.mark.parametrize(
    ("policy", "placer", "full_quality"),
    [("lru.yaml", "lru", True), ("fixed-knorm-0.5.yaml", "fixed:knorm@0.5", False),
     ("fixed-int8.yaml", "fixed:int8", False), ("evicpress.yaml", "evicpress", False)],
)  # fmt: skip
def test_policy_files(sim: Sim, policy: str, placer: str, full_quality: bool) -> None:
    r = sim("run", *TINY, "--policy", str(POLICIES / policy), "--json")
    assert r.code == 0, r.err
    run = r.json()["runs"][0]
    assert run["placer"] == placer
    assert (run["quality_mean"] == 1.0) is full_quality


def test_policy_grid_and_alpha_reach_the_simulator(sim: Sim, tmp_path: Path) -> None:
    f = tmp_path / "p.yaml"
    f.write_text("placer: evicpress\nalpha: 7\nvariants: {methods: [knorm], ratios: [1.0, 0.5]}\n")
    doc = sim("run", *TINY, "--policy", str(f), "--json").json()
    assert doc["config"]["variants"] == 2 and doc["runs"][0]["alpha"] == 7.0  # none, knorm@0.5
    assert (
        sim("run", *TINY, "--policy", str(f), "--alpha", "3", "--json").json()["runs"][0]["alpha"]
        == 3.0
    )


def test_trace_csv_drives_arrivals(sim: Sim, tmp_path: Path) -> None:
    csv = tmp_path / "trace.csv"
    rows = [f"2023-11-16 18:{m:02d}:{s:02d}.000000,100,10" for m in range(10) for s in range(60)]
    csv.write_text("TIMESTAMP,ContextTokens,GeneratedTokens\n" + "\n".join(rows) + "\n")
    r = sim("run", *TINY, "--trace", str(csv), "--json")
    assert r.code == 0, r.err
    assert r.json()["config"]["arrival"] == "trace"
    assert r.json()["runs"][0]["ttft_mean_s"] > 0


def test_bad_inputs(sim: Sim, tmp_path: Path) -> None:
    r = sim("run", *TINY, "--placer", "nope")
    assert r.code == 5 and "unknown placer 'nope'" in r.err and r.out == ""
    bad = tmp_path / "bad.yaml"
    bad.write_text("placer: evicpress\nalpha: -1\n")
    r = sim("run", *TINY, "--policy", str(bad))
    assert r.code == 5 and f"{bad}:2" in r.err
    paged = tmp_path / "paged.yaml"
    paged.write_text("placer: evicpress\nvariants: {methods: [paged_eviction]}\n")
    r = sim("run", *TINY, "--policy", str(paged))
    assert r.code == 5 and "paged_eviction" in r.err and "no quality model" in r.err
    assert sim("run", *TINY, "--placer", "fixed:knorm@0.55").code == 5
    assert sim("run", *TINY, "--trace", str(tmp_path / "none.csv")).code == 5
    empty = tmp_path / "empty.csv"
    empty.write_text("TIMESTAMP,ContextTokens,GeneratedTokens\n")
    r = sim("run", *TINY, "--trace", str(empty))
    assert r.code == 5 and "no requests" in r.err
    assert sim("run", *TINY, "--dram", "lots").code == 2
    assert sim("run", *TINY, "--requests", "0").code == 2


def test_sweep_json_and_headline(sim: Sim) -> None:
    r = sim("sweep", *TINY, *ALPHAS, "--json")
    assert r.code == 0, r.err
    doc = r.json()
    placers = [x["placer"] for x in doc["runs"]]
    assert placers[:6] == ["evicpress"] * 3 + ["evicpress (oracle)"] * 3
    assert [x["alpha"] for x in doc["runs"][:6]] == [0.1, 1.0, 10.0] * 2
    assert len(placers) == 6 + 15 + 3
    assert {"lru", "lfu", "prefill", "fixed:knorm@0.5"} <= set(placers)
    families = {"fixed:keydiff", "fixed:knorm", "fixed:snapkv", "lru", "lfu", "prefill"}
    assert {row["baseline"] for row in doc["headline"]} == families
    assert {row["baseline"] for row in doc["headline_oracle"]} == families
    prefill = next(row for row in doc["headline"] if row["baseline"] == "prefill")
    assert prefill["points"] == 1 and prefill["reduction_min"] > 1  # cache beats recompute
    assert doc["qps"]["evicpress_qps"] > 0 and doc["qps"]["quality_target"] == 0.8
    text = sim("sweep", *TINY, *ALPHAS).out
    assert "TTFT reduction at equal quality" in text and "QPS at mean TTFT" in text
    assert "upper bound (oracle)" in text
    quick = sim("sweep", *TINY, *ALPHAS, "--no-oracle", "--json").json()
    assert len(quick["runs"]) == 3 + 15 + 3 and quick["headline_oracle"] == []


def test_frequency_and_recompute_flags(sim: Sim) -> None:
    """``--frequency oracle`` names the run as the upper bound; ``--no-recompute`` brings back
    loads slower than prefill (the LRU family's remote hits)."""
    oracle = sim("run", *TINY, "--frequency", "oracle", "--json").json()
    assert oracle["runs"][0]["placer"] == "evicpress (oracle)"
    fair = sim("run", *TINY, "--placer", "lru", "--json").json()["runs"][0]
    old = sim("run", *TINY, "--placer", "lru", "--no-recompute", "--json").json()["runs"][0]
    assert old["hit_rate"]["recompute"] == 0 and fair["hit_rate"]["recompute"] > 0
    assert fair["ttft_mean_s"] < old["ttft_mean_s"]
    with pytest.raises(SystemExit) as usage:
        sim("run", *TINY, "--frequency", "psychic")
    assert usage.value.code == 2


def test_unreachable_quality_target_is_reported_not_fatal(sim: Sim) -> None:
    r = sim("sweep", *TINY, *ALPHAS, "--quality-target", "1.5", "--json")
    assert r.code == 0 and r.json()["qps"] is None
    r = sim("sweep", *TINY, *ALPHAS, "--quality-target", "1.5")
    assert "no configuration reaches quality 1.5" in r.out


def _image(path: Path) -> tuple[int, int]:
    with Image.open(path) as im:
        im.verify()
    with Image.open(path) as im:
        assert im.format == "PNG"
        im.load()
        lo, hi = im.convert("L").getextrema()
        assert isinstance(lo, int) and isinstance(hi, int) and hi - lo > 100  # drawn on
        return im.size


def test_report_writes_figures_and_results(sim: Sim, tmp_path: Path) -> None:
    out = tmp_path / "report"
    r = sim("report", *TINY, *ALPHAS, "--out", str(out))
    assert r.code == 0, r.err
    names = ("frontier.png", "ttft_vs_qps.png", "placements.png")
    for name in names:
        assert name in r.out
        w, h = _image(out / name)
        assert w >= 600 and h >= 400
    assert "TTFT reduction at equal quality" in r.out and "placements of evicpress" in r.out
    results = json.loads((out / "results.json").read_text())
    assert len(results["evicpress"]) == 3 and len(results["baselines"]) == 18
    assert [r["placer"] for r in results["evicpress_oracle"]] == ["evicpress (oracle)"] * 3
    placed = results["placements"]
    assert [p["placer"] for p in placed] == ["evicpress", "lru", "fixed:keydiff@0.5"]
    for p in placed:
        for t in p["tiers"]:
            assert t["capacity_bytes"] is None or t["used_bytes"] <= t["capacity_bytes"]
    evic = placed[0]
    assert sum(g["contexts"] for g in evic["groups"]) == 40
    assert any(g["method"] != "none" and g["tier"] != "dropped" for g in evic["groups"])
    assert {g["method"] for g in placed[2]["groups"] if g["tier"] != "dropped"} == {"keydiff"}


def test_report_json_and_extra_placer(sim: Sim, tmp_path: Path) -> None:
    out = tmp_path / "r"
    r = sim("report", *TINY, *ALPHAS, "--placer", "lfu", "--out", str(out), "--json")
    assert r.code == 0, r.err
    doc = r.json()
    assert sorted(Path(f).name for f in doc["files"]) == sorted(
        ["frontier.png", "ttft_vs_qps.png", "placements.png", "results.json"]
    )
    assert [p["placer"] for p in doc["placements"]][-1] == "lfu"
    assert doc["headline"] and doc["qps"] is not None


def test_report_without_qps_figure_and_bad_out(sim: Sim, tmp_path: Path) -> None:
    out = tmp_path / "r"
    r = sim("report", *TINY, *ALPHAS, "--quality-target", "1.5", "--out", str(out), "--json")
    assert r.code == 0 and not (out / "ttft_vs_qps.png").exists()
    _image(out / "placements.png")
    blocker = tmp_path / "file"
    blocker.write_text("")
    r = sim("report", *TINY, *ALPHAS, "--out", str(blocker / "x"))
    assert r.code == 5 and "cannot create --out" in r.err


def test_report_without_the_sim_extra_says_so_before_the_sweep(
    sim: Sim, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # as if not installed: import fails
    r = sim("report", *TINY, "--out", str(tmp_path / "r"))
    assert r.code == 5 and "install the sim extra" in r.err
    assert not (tmp_path / "r").exists()  # refused before any work
    assert sim("run", *TINY, "--placer", "lru").code == 0  # run needs no extra


def test_progress_bar_draws_on_a_terminal() -> None:
    out = Output(as_json=False)
    buf = io.StringIO()
    out.err = Console(file=buf, force_terminal=True, width=100)
    with out.progress("simulating", 2) as step:
        step("evicpress a=1")
        step("lru")
    assert "simulating" in buf.getvalue()
    quiet = Output(as_json=True)
    quiet.err = Console(file=io.StringIO(), force_terminal=True)
    with quiet.progress("simulating", 1) as step:
        step("x")
    assert quiet.err.file.getvalue() == ""  # type: ignore[attr-defined]


def test_kvtierd_dispatches_sim(capsys: pytest.CaptureFixture[str]) -> None:
    """``kvtierd sim ...`` is this command line (the one way to run the simulator)."""
    from kvtierd.main import main as kvtierd

    assert kvtierd(["sim", "run", *TINY, "--placer", "prefill", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["runs"][0]["hit_rate"]["miss"] == 1.0
    assert kvtierd(["sim", "run", *TINY, "--placer", "nope"]) == 5
    assert capsys.readouterr().err.startswith("kvtierd sim: unknown placer")
    assert kvtierd(["--help"]) == 0 and "sim " in capsys.readouterr().out


def test_every_command_and_flag_is_documented() -> None:
    import argparse

    from kvtierd.sim.cli import build_parser

    doc = (ROOT / "docs" / "simulator.md").read_text()
    subs = next(a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction))
    for name, parser in subs.choices.items():
        assert f"kvtierd sim {name}" in doc, name
        for action in parser._actions:
            for flag in action.option_strings:
                assert flag in doc or flag in ("-h", "--help"), (name, flag)
