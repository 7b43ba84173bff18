"""benchmarks/e2e/projection.py (issue 30.5): the projection runs end to end on a tiny slice of the
paper's setting, its figures are the setting file's, and the setting file is validated."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from benchmarks._support.common import REPO, cpu_model
from benchmarks.e2e.projection import SETTING, at_equal_quality, case_qualities, load, main
from benchmarks.e2e.projection_setting import load_setting, parse_setting
from benchmarks.e2e.sim_e2e import HOLD_S
from kvtierd.errors import InvalidArgumentError
from kvtierd.sim.workload import WorkloadConfig, make_workload


def test_the_committed_setting_is_the_papers_deployment() -> None:
    s = load_setting(SETTING)
    # 32 layers x 8 KV heads x 128 dims x 2 (K and V) x 2 bytes
    assert s.model.kv_bytes_per_token == 32 * 8 * 128 * 2 * 2 == 131072
    assert [(t.name, t.capacity_bytes) for t in s.tiers] == [
        ("dram", 80 * 10**9), ("ssd", 800 * 10**9), ("remote", None)]  # fmt: skip
    assert s.peak_flops_per_s * s.utilisation == pytest.approx(989e12 * 0.4)


def test_a_tiny_projection_prices_prefill_from_the_setting(tmp_path: Path) -> None:
    out = tmp_path / "out"
    args = ["--contexts", "12", "--requests", "120", "--rates", "0.05", "--alphas", "1",
            "--seed", "3", "--out", str(out)]  # fmt: skip
    result = main(args)
    md = (out / "projection.md").read_text()
    assert md.startswith("Projection (not a measurement)") and cpu_model() in md
    assert json.loads((out / "projection.json").read_text())["machine"] == result["machine"]
    rows = {r["system"]: r for r in result["rates"][0]["rows"]}
    assert list(rows) == ["prefill", "lmcache", "lru", "fixed-int8", "fixed-keydiff@0.5",
                          "evicpress-a1", "evicpress-a1 (own labels)"]  # fmt: skip
    # vLLM alone prefills every measured request: the roofline worked out by hand here
    wl = make_workload(WorkloadConfig(n_contexts=12, n_requests=120, arrival="trace",
                                      trace_path=str(REPO / result["trace"]), seed=3))  # fmt: skip
    n = (wl.context_tokens[wl.request_context] + wl.query_tokens)[wl.measured].astype(float)
    flops = 2 * 8.03e9 * n + 4 * 32 * 32 * 128 * n * n / 2
    assert rows["prefill"]["service_mean_s"] == pytest.approx(np.mean(flops / (989e12 * 0.4)))
    assert rows["prefill"]["quality"] == 1.0 and rows["prefill"]["served"]["miss"] == 1.0
    # LMCache alone has no remote store; caching beats prefilling everything
    assert "remote" not in rows["lmcache"]["served"]
    for name, r in rows.items():
        assert 0.0 <= r["quality"] <= 1.0 and r["ttft_p50_s"] <= r["ttft_p90_s"], name
        if name != "prefill":
            assert r["service_mean_s"] < rows["prefill"]["service_mean_s"], name


def test_equal_quality_takes_the_fastest_fair_evicpress_and_never_the_bound() -> None:
    def row(name: str, quality: float, ttft: float, bound: bool = False) -> dict[str, object]:
        ours = name.startswith("evicpress")
        return {"system": name, "evicpress": ours, "bound": bound, "quality": quality,
                "ttft_mean_s": ttft}  # fmt: skip

    rows = [row("fixed-int8", 1.0, 3.0), row("fixed-keydiff@0.5", 0.8, 1.0),
            row("evicpress-a1", 0.95, 0.5), row("evicpress-a10", 0.99, 1.5),
            row("evicpress-a1 (own labels)", 1.0, 0.1, bound=True)]  # fmt: skip
    assert at_equal_quality(rows) == [
        {"baseline": "fixed-int8", "evicpress": "evicpress-a10", "ratio": 2.0},
        {"baseline": "fixed-keydiff@0.5", "evicpress": "evicpress-a1", "ratio": 2.0}]  # fmt: skip


def test_a_server_at_full_load_is_marked_saturated() -> None:
    assert load(0.5, {"service_mean_s": 1.2}) == "0.60"
    assert load(0.5, {"service_mean_s": 2.0}) == "1.00 (saturated)"


def test_a_profile_knows_only_the_other_cases_of_its_task(tmp_path: Path) -> None:
    labels = tmp_path / "labels.jsonl"
    rows = [("a", 1.0, {"int8": 1.0, "knorm@0.5": 1.0, "streamingllm@0.5": 0.0}),
            ("a", 1.0, {"int8": 0.5, "knorm@0.5": 0.0, "streamingllm@0.5": 0.0}),
            ("a", 1.0, {"int8": 1.0, "knorm@0.5": 0.5, "streamingllm@0.5": 0.0}),
            ("b", 0.0, {}), ("b", 1.0, {"int8": 1.0, "knorm@0.5": 0.25})]  # fmt: skip
    labels.write_text("".join(
        json.dumps({"task": t, "full_accuracy": f, **({"accuracy": a} if a else {})}) + "\n"
        for t, f, a in rows))  # fmt: skip
    cases = case_qualities(labels)
    assert [c.measured for c in cases] == [  # the controls and unanswered cases left out
        {"int8": 1.0, "knorm@0.5": 1.0}, {"int8": 0.5, "knorm@0.5": 0.0},
        {"int8": 1.0, "knorm@0.5": 0.5}, {"int8": 1.0, "knorm@0.5": 0.25}]  # fmt: skip
    assert cases[0].profiled == {"int8": 0.75, "knorm@0.5": 0.25}
    assert cases[1].profiled == {"int8": 1.0, "knorm@0.5": 0.75}
    assert cases[3].profiled == cases[3].measured  # alone in its task: nothing else to go by


@pytest.mark.parametrize(
    ("edit", "message"),
    [
        (("  utilisation: 0.4", "  utilisation: 1.5"), "prefill.utilisation: a share"),
        (("  utilisation: 0.4", "  utilisation: 0.4\n  mfu: 0.5"), "prefill: unknown key 'mfu'"),
        (
            ("    bandwidth_bytes_per_s: 13.0e+9", "    bandwidth_bytes_per_s: fast"),
            "tiers[1].bandwidth_bytes_per_s: expected a number > 0, got 'fast'",
        ),
        (("  kv_heads: 8", "  kv_heads: 8.5"), "model.kv_heads: expected a whole number"),
        (("decode_s: 0.0", ""), "document: missing key 'decode_s'"),
    ],
)
def test_a_bad_setting_names_the_file_and_the_key(edit: tuple[str, str], message: str) -> None:
    text = SETTING.read_text()
    assert edit[0] in text
    with pytest.raises(InvalidArgumentError) as e:
        parse_setting(text.replace(edit[0], edit[1], 1), "s.yaml")
    assert str(e.value).startswith("s.yaml: ") and message in str(e.value)


def test_the_projection_places_under_the_daemons_offer_rules(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The placer is offered what kvtierd's daemon would offer it (issue 30.4's rules, checked
    beside bench_e2e), not every variant from the first put."""
    from benchmarks.e2e import projection
    from kvtierd.sim.offers import DAEMON

    seen = []
    real = projection.run_simulation

    def spy(cfg, prep):  # type: ignore[no-untyped-def]
        seen.append(cfg)
        return real(cfg, prep)

    monkeypatch.setattr(projection, "run_simulation", spy)
    main(["--contexts", "12", "--requests", "60", "--rates", "0.05", "--alphas", "1",
          "--out", str(tmp_path)])  # fmt: skip
    assert seen and all(c.offers == DAEMON for c in seen)
    # kvtierd's systems hold what a lookup finds for the plugin's hold (as sim_e2e checked
    # them beside bench_e2e); LMCache alone and prefill have no daemon to hold anything
    holds = sorted({c.hold_s for c in seen})
    assert holds == [0.0, HOLD_S] and HOLD_S > 0
    assert sum(c.hold_s == 0 for c in seen) == 2  # prefill, lmcache
