"""bench_e2e's summary (issue 30): every figure with its bootstrap interval, and the ceiling of
the trace, on outcomes made by hand (no model: the similarity embedder is a stand-in)."""

from __future__ import annotations

import argparse
from typing import Any

import pytest

from benchmarks.e2e import bench_e2e
from benchmarks.e2e.e2e_workload import Prompt


class _Exact:
    """MiniLM's stand-in: 1 for the same answer, else 0."""

    def similarity(self, a: list[str], b: list[str]) -> list[float]:
        return [float(x == y) for x, y in zip(a, b, strict=True)]


def _outcome(i: int, context: int, ttft: float, cached: int, answer: str = "42") -> dict[str, Any]:
    return {"index": i, "context": context, "question": 0, "sent_s": float(i), "ttft_s": ttft,
            "total_s": ttft + 0.5, "answer": answer, "served_from": "", "prompt_tokens": 1000,
            "cached_tokens": cached}  # fmt: skip


def test_summary_has_intervals_and_the_ceiling(monkeypatch: pytest.MonkeyPatch) -> None:
    from kvtierd.profiler import embedder

    monkeypatch.setattr(embedder, "MiniLmEmbedder", _Exact)
    table = [[Prompt((1, 2), 1000, ("42",))], [Prompt((3, 4), 1000, ("42",))]]
    trace = [(0, 0), (1, 1), (2, 0), (3, 1), (4, 0)]  # (index, context)
    results = {
        "prefill": {"wall_s": 10.0, "warmup": [],
                    "outcomes": [_outcome(i, c, 2.0 + 0.1 * i, 0) for i, c in trace]},
        "lru": {"wall_s": 10.0, "warmup": [],
                "outcomes": [_outcome(0, 0, 2.0, 0), _outcome(1, 1, 2.2, 0),
                             _outcome(2, 0, 0.5, 1000), _outcome(3, 1, 0.7, 1000),
                             _outcome(4, 0, 0.6, 1000, answer="41")]},
    }  # fmt: skip
    rows = bench_e2e.summarise(results, table, 0, [1024])
    lru = rows["lru"]
    mean, low, high = lru["intervals"]["ttft_mean_s"]
    assert mean == pytest.approx((2.0 + 2.2 + 0.5 + 0.7 + 0.6) / 5) and low <= mean <= high
    assert low < high  # five different TTFTs
    assert lru["intervals"]["similarity"][0] == pytest.approx(0.8)
    # misses at 1024: prefill's five and lru's two; the fastest hit median: lru's 0.6
    misses = [2.0, 2.1, 2.2, 2.3, 2.4, 2.0, 2.2]
    miss_s = sum(misses) / len(misses)
    assert lru["ceiling_s"] == pytest.approx((2 * miss_s + 3 * 0.6) / 5)
    assert rows["prefill"]["share_of_ceiling"] == pytest.approx(
        lru["ceiling_s"] / rows["prefill"]["ttft_mean_s"]
    )
    args = argparse.Namespace(contexts=2, lengths=[1024], requests=5, qps=0.5, zipf=1.0,
                              cpu_share=0.1, ssd_share=0.4, system_prompt_tokens=0)  # fmt: skip
    text = bench_e2e.report(rows, args)
    assert "With 95% bootstrap intervals over the requests" in text
    assert "the trace's ceiling (first requests at the measured miss time" in text
    assert f"| lru | {mean:.3f} [{low:.3f}, {high:.3f}] |" in text


def test_a_system_with_failed_requests_is_left_out_of_the_ceiling(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from kvtierd.profiler import embedder

    monkeypatch.setattr(embedder, "MiniLmEmbedder", _Exact)
    table = [[Prompt((1, 2), 1000, ("42",))]]
    failed = _outcome(1, 0, 0.0, 0) | {"error": "HTTP 500"}
    results = {
        "prefill": {"wall_s": 5.0, "outcomes": [_outcome(0, 0, 2.0, 0), _outcome(1, 0, 2.0, 0)]},
        "lru": {"wall_s": 5.0, "outcomes": [_outcome(0, 0, 2.0, 0), _outcome(1, 0, 0.4, 1000)]},
        "broken": {"wall_s": 5.0, "outcomes": [_outcome(0, 0, 0.1, 1000), failed]},
    }  # fmt: skip
    rows = bench_e2e.summarise(results, table, 0, [1024])
    assert rows["broken"]["errors"] == 1
    assert rows["lru"]["ceiling_s"] == pytest.approx((2.0 + 0.4) / 2)  # broken's 0.1 not used


def test_a_daemon_id_with_slashes_is_its_own_context() -> None:
    """LMCache's chunk keys start with the model's path: the bench took the text before the
    first slash, '', for every context, and could not tell whether each had a profile by its
    second request."""
    key = "/root/.cache/kvtierd/models/SmolLM2-135M-Instruct@1@0@128e76ed83279b84@float"
    assert bench_e2e.base_context(key) == key
    assert bench_e2e.base_context(f"{key}/knorm@0.5") == key
    assert bench_e2e.base_context("ctx/keydiff@0.5+int8") == "ctx"
    assert bench_e2e.base_context("a/b") == "a/b" and bench_e2e.base_context("c") == "c"


def test_evicpress_profiles_as_the_preset_unless_asked_to_refine(tmp_path: Any) -> None:
    every = bench_e2e.systems([2.0], [], tmp_path, ["knorm"], [1.0, 0.5])
    profiling = every["evicpress-a2"].policy["profiling"]  # type: ignore[index]
    assert profiling["estimator"] == "query_attention" and "evaluator" not in profiling
    refined = bench_e2e.systems([2.0], [], tmp_path, ["knorm"], [1.0, 0.5], refine="answer")
    assert refined["evicpress-a2"].policy["profiling"]["evaluator"] == "answer"  # type: ignore[index]
