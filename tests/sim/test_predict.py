"""``kvtierd sim predict``: a calibration and a given workload, checked against TTFTs worked out
by hand, and the errors a bad file gets."""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import pytest

from kvtierd.errors import InvalidArgumentError
from kvtierd.sim.calibration import fit_line, parse_calibration
from kvtierd.sim.cli import main

# 32 bytes of KV per token: 2 (K, V) x 1 layer x 1 head x 8 dims x 2 bytes
MODEL = {"name": "toy", "layers": 1, "q_heads": 1, "kv_heads": 1, "head_dim": 8,
         "active_params": 1e6, "max_context_tokens": 8192, "dtype_bytes": 2}  # fmt: skip
CALIBRATION = """\
prefill: {overhead_s: 0.1, seconds_per_token: 0.001}
decode_s: 0.2
tiers:
  - {name: cpu, overhead_s: 0.05, bandwidth_bytes_per_s: 320000}
quality:
  knorm@0.5: 0.75
"""


def workload(**over: Any) -> dict[str, Any]:
    """Two contexts (1,000 and 2,000 tokens), each asked once to warm up, then c0 at 0 s, c1 at
    10 s, c0 at 10.5 s, every query 10 tokens."""
    reqs = [(-10.0, 0, False), (-9.0, 1, False), (0.0, 0, True), (10.0, 1, True), (10.5, 0, True)]
    doc = {
        "model": MODEL,
        "tiers": [{"name": "cpu", "capacity_bytes": 10**9}],
        "contexts": [{"tokens": 1000}, {"tokens": 2000, "quality": {"knorm@0.5": 0.9}}],
        "requests": [
            {"index": k, "at_s": t, "context": c, "query_tokens": 10, "measured": m}
            for k, (t, c, m) in enumerate(reqs)
        ],
    }
    return doc | over


@pytest.fixture
def files(tmp_path: Path) -> tuple[Path, Path]:
    w, c = tmp_path / "workload.json", tmp_path / "calibration.yaml"
    w.write_text(json.dumps(workload()))
    c.write_text(CALIBRATION)
    return w, c


def predict(
    capsys: pytest.CaptureFixture[str], files: tuple[Path, Path], *extra: str
) -> dict[str, Any]:
    w, c = files
    assert main(["predict", "--workload", str(w), "--calibration", str(c), "--json", *extra]) == 0
    doc: dict[str, Any] = json.loads(capsys.readouterr().out)
    return doc


def test_lru_hits_by_hand(capsys: pytest.CaptureFixture[str], files: tuple[Path, Path]) -> None:
    """A hit: prefill overhead 0.1 + the query's 10 tokens 0.01 + tier overhead 0.05 + bytes /
    bandwidth (c0: 32,000 B = 0.1 s; c1: 0.2 s). The third request arrives at 10.5 s while the
    engine is held until 10.36 + 0.2 (decode) = 10.56 s: it waits 0.06 s."""
    doc = predict(capsys, files, "--placer", "lru")
    reqs = doc["requests"]
    assert [r["index"] for r in reqs] == [2, 3, 4] and {r["served"] for r in reqs} == {"cpu"}
    assert [r["service_s"] for r in reqs] == pytest.approx([0.26, 0.36, 0.26])
    assert [r["ttft_s"] for r in reqs] == pytest.approx([0.26, 0.36, 0.32])
    assert doc["prediction"]["hit_rate"]["cpu"] == 1.0
    assert doc["classes"]["cpu"]["requests"] == 3
    assert doc["calibration"]["tiers"][0]["bandwidth_bytes_per_s"] == 320000


def test_prefill_queues_by_hand(
    capsys: pytest.CaptureFixture[str], files: tuple[Path, Path]
) -> None:
    """Every request prefilled: 0.1 + 0.001 x (context + 10) s; the third waits for the second
    (10 + 2.11 + 0.2 decode = 12.31 s): 12.31 + 1.11 - 10.5 = 2.92 s."""
    reqs = predict(capsys, files, "--placer", "prefill")["requests"]
    assert [r["served"] for r in reqs] == ["miss"] * 3
    assert [r["ttft_s"] for r in reqs] == pytest.approx([1.11, 2.11, 2.92])


def test_a_load_slower_than_prefill_is_recomputed(
    capsys: pytest.CaptureFixture[str], files: tuple[Path, Path]
) -> None:
    """At 32,000 B/s c0's load takes 1 s + 0.05 + 0.11 > its 1.11 s prefill: recomputed."""
    files[1].write_text(CALIBRATION.replace("320000", "32000"))
    reqs = predict(capsys, files, "--placer", "lru")["requests"]
    assert [r["served"] for r in reqs] == ["recompute"] * 3
    assert reqs[0]["service_s"] == pytest.approx(1.11)
    old = predict(capsys, files, "--placer", "lru", "--no-recompute")["requests"]
    assert [r["served"] for r in old] == ["cpu"] * 3
    assert old[0]["service_s"] == pytest.approx(1.16)


def test_a_lookup_hold_keeps_a_context_the_placer_dropped(
    capsys: pytest.CaptureFixture[str], files: tuple[Path, Path]
) -> None:
    """Three 1,000-token contexts, a tier for two: c0 is found at 0 s, c2's put at 5 s drops
    c1, c1's put at 6 s drops c0, asked at 7 s: computed, unless c0's hold (30 s from 0 s)
    kept it (``--hold-s``, kvtierd/sim/executing.py)."""
    asks = [(-10.0, 0, False), (-9.0, 1, False), (0.0, 0, True), (5.0, 2, True),
            (6.0, 1, True), (7.0, 0, True)]  # fmt: skip
    doc = workload(tiers=[{"name": "cpu", "capacity_bytes": 64_000}],
                   contexts=[{"tokens": 1000}] * 3,
                   requests=[{"index": k, "at_s": t, "context": c, "query_tokens": 10,
                              "measured": m} for k, (t, c, m) in enumerate(asks)])  # fmt: skip
    files[0].write_text(json.dumps(doc))
    plain = predict(capsys, files, "--placer", "lru")["requests"]
    held = predict(capsys, files, "--placer", "lru", "--hold-s", "30")["requests"]
    assert [r["served"] for r in plain] == ["cpu", "miss", "miss", "miss"]
    assert [r["served"] for r in held] == ["cpu", "miss", "miss", "cpu"]
    w, c = files
    bad = ["predict", "--workload", str(w), "--calibration", str(c), "--hold-s", "-1"]
    assert main(bad) == 2


def test_fixed_variant_uses_measured_quality(
    capsys: pytest.CaptureFixture[str], files: tuple[Path, Path]
) -> None:
    """``fixed:knorm@0.5``: c0 takes the calibration's 0.75, c1 its own 0.9; half the bytes."""
    doc = predict(capsys, files, "--placer", "fixed:knorm@0.5")
    assert [r["quality"] for r in doc["requests"]] == [0.75, 0.9, 0.75]
    assert doc["requests"][0]["service_s"] == pytest.approx(0.1 + 0.01 + 0.05 + 0.05)
    w, c = files
    code = main(["predict", "--workload", str(w), "--calibration", str(c), "--placer",
                 "fixed:int4"])  # fmt: skip
    assert code == 5 and "no quality measured for 'int4'" in capsys.readouterr().err


def test_evicpress_policy_grid(
    capsys: pytest.CaptureFixture[str], files: tuple[Path, Path], tmp_path: Path
) -> None:
    policy = tmp_path / "p.yaml"
    policy.write_text(
        "placer: evicpress\nalpha: 0.01\nvariants: {methods: [knorm], ratios: [0.5]}\n"
    )
    doc = predict(capsys, files, "--policy", str(policy))
    # alpha 0.01: quality is worth little, so the smaller variant is loaded
    assert doc["prediction"]["quality_mean"] < 1.0
    assert doc["prediction"]["placer"] == "evicpress" and doc["prediction"]["alpha"] == 0.01
    text = predict(capsys, files, "--policy", str(policy), "--frequency", "oracle")
    assert text["prediction"]["placer"] == "evicpress (oracle)"


def test_fits_recover_a_line() -> None:
    assert fit_line([1, 2, 3], [1.5, 2.5, 3.5]) == pytest.approx((0.5, 1.0))
    assert fit_line([1, 2], [1.0, 3.0]) == pytest.approx((0.0, 1.4))  # intercept < 0: origin
    assert fit_line([2, 2], [1.0, 3.0], intercept=0.0) == pytest.approx((0.0, 1.0))
    assert fit_line([2, 4], [1.0, 3.0], slope=0.5) == pytest.approx((0.5, 0.5))
    with pytest.raises(ValueError, match="two or more different lengths"):
        fit_line([2, 2], [1.0, 3.0])


def test_calibration_from_samples() -> None:
    """Samples on exact lines: prefill 0.2 + 0.0016 / token (probes' query: 40 tokens); the cpu
    tier 0.15 s + 1 s per 1.6 MB (50,000 tokens x 32 B), after the query's 0.264 s prefill."""
    pre = [[n, 0.2 + 0.0016 * (n + 40)] for n in (768, 1792, 3584)]
    hit = [[n, 0.2 + 0.0016 * 40 + 0.15 + n * 32 / 1.6e6] for n in (768, 3584)]
    cal = parse_calibration(
        f"prefill: {{samples: {pre}}}\nquery_tokens: 40\ntiers: [{{name: cpu, samples: {hit}}}]\n",
        "cal.yaml",
        kv_bytes_per_token=32,
    )
    assert cal.prefill.overhead_s == pytest.approx(0.2)
    assert cal.prefill.seconds_per_token == pytest.approx(0.0016)
    (cpu,) = cal.tiers
    assert cpu.load_overhead_s == pytest.approx(0.15)
    assert cpu.load_bandwidth_bytes_per_s == pytest.approx(1.6e6)
    assert cal.quality == {"none": 1.0}


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("prefill: {overhead_s: 0.1}\ntiers: [{name: cpu, overhead_s: 0, "
         "bandwidth_bytes_per_s: 1}]", "prefill: give samples, or overhead_s and seconds_per"),
        ("prefill: {samples: [[100, 1.0], [100, 1.1]]}\ntiers: []",
         "prefill.samples: needs samples at two or more different lengths"),
        ("prefill: {overhead_s: 0.1, seconds_per_token: 0.001, speed: 3}\ntiers: []",
         "prefill: unknown key 'speed'; allowed: samples, overhead_s, seconds_per_token"),
        ("prefill: {overhead_s: -1, seconds_per_token: 0.001}\ntiers: []",
         "prefill.overhead_s: expected a number >= 0, got -1"),
        ("prefill: {overhead_s: 0, seconds_per_token: 0.001}\ntiers: []",
         "tiers: expected a list of tiers, fastest first"),
        ("prefill: {overhead_s: 0, seconds_per_token: 0.001}\n"
         "tiers: [{name: cpu, samples: [[100, 0.5]]}]",
         "tiers[0].samples: needs samples at two or more different lengths"),
        ("prefill: {overhead_s: 0, seconds_per_token: 0.001}\n"
         "tiers: [{name: cpu, overhead_s: 0, bandwidth_bytes_per_s: 1}]\nquality: {knorm: 0.5}",
         "quality.knorm: bad variant 'knorm': method 'knorm' needs a ratio"),
        ("prefill: {overhead_s: 0, seconds_per_token: 0.001}\n"
         "tiers: [{name: cpu, overhead_s: 0, bandwidth_bytes_per_s: 1}]\nquality: {int8: 2}",
         "quality.int8: a quality is in [0, 1], got 2.0"),
        ("prefill: [", "document: not valid YAML"),
    ],
)  # fmt: skip
def test_calibration_errors_name_the_key(text: str, message: str) -> None:
    with pytest.raises(InvalidArgumentError, match=f"^cal.yaml: {message}".replace("[", r"\[")):
        parse_calibration(text, "cal.yaml", kv_bytes_per_token=32)


def test_a_load_that_does_not_grow_with_size_is_a_fixed_cost() -> None:
    # 40 query tokens at 1 ms: 0.04 s of each hit is its query's prefill; the rest does not
    # grow from 100 to 200 tokens (0.56 then 0.46 s): a fixed 0.51 s, no cost per byte.
    text = ("prefill: {overhead_s: 0, seconds_per_token: 0.001}\nquery_tokens: 40\n"
            "tiers: [{name: cpu, samples: [[100, 0.6], [200, 0.5]]},\n"
            "        {name: ssd, overhead_s: 0.2, samples: [[100, 0.3], [200, 0.2]]}]")  # fmt: skip
    cal = parse_calibration(text, "cal.yaml", kv_bytes_per_token=32)
    cpu, ssd = cal.tiers
    assert cal.summary()["tiers"][0]["bandwidth_bytes_per_s"] is None  # JSON has no infinity
    assert cpu.load_bandwidth_bytes_per_s == math.inf
    assert cpu.load_overhead_s == pytest.approx(0.51)
    assert ssd.load_bandwidth_bytes_per_s == math.inf and ssd.load_overhead_s == 0.2


def test_workload_errors(capsys: pytest.CaptureFixture[str], files: tuple[Path, Path]) -> None:
    w, c = files

    def run() -> str:
        assert main(["predict", "--workload", str(w), "--calibration", str(c)]) == 5
        return capsys.readouterr().err

    w.write_text(json.dumps(workload(tiers=[{"name": "gpu", "capacity_bytes": 1}])))
    assert "tier 'gpu' of" in run() and "calibrated: cpu" in run()
    bad = workload()
    bad["requests"][3]["at_s"] = -20.0
    w.write_text(json.dumps(bad))
    assert "requests[3]: requests must be in time order" in run()
    bad = workload()
    bad["requests"][0]["context"] = 7
    w.write_text(json.dumps(bad))
    assert "requests[0]: context must be an index below 2, got 7" in run()
    w.write_text("{")
    assert "not valid JSON" in run()
    w.unlink()
    assert "cannot read" in run()


def test_evicpress_predicts_on_a_fixed_cost_tier(
    capsys: pytest.CaptureFixture[str], files: tuple[Path, Path], tmp_path: Path
) -> None:
    """bench_e2e's run calibrated kvtierd's CPU tier as a fixed cost (bandwidth inf), and
    EvicPress's utility model refused it ('load_bandwidth_bytes_per_s must be a finite
    number'): the prediction stopped with a traceback."""
    w, c = files
    tier = "{name: cpu, overhead_s: 0.05, bandwidth_bytes_per_s: 320000}"
    fixed = "{name: cpu, samples: [[10, 0.3], [20, 0.3]]}"  # loads that do not grow with size
    c.write_text(CALIBRATION.replace(tier, fixed))
    policy = tmp_path / "p.yaml"
    policy.write_text("placer: evicpress\nvariants: {methods: [knorm], ratios: [0.5]}\n")
    doc = predict(capsys, (w, c), "--policy", str(policy))
    assert doc["prediction"]["placer"] == "evicpress"
