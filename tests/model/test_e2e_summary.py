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


def _chars(text: str) -> list[int]:
    """The tokenizer's stand-in: a token per character."""
    return [ord(c) for c in text]


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
    rows = bench_e2e.summarise(results, table, 0, [1024], tokenize=_chars)
    lru = rows["lru"]
    mean, low, high = lru["intervals"]["ttft_mean_s"]
    assert mean == pytest.approx((2.0 + 2.2 + 0.5 + 0.7 + 0.6) / 5) and low <= mean <= high
    assert low < high  # five different TTFTs
    assert lru["intervals"]["similarity"][0] == pytest.approx(0.8)
    assert (lru["exact"], lru["exact_count"]) == (pytest.approx(0.8), 4)  # "41" is not "42"
    assert lru["intervals"]["exact"] == pytest.approx([0.8, 0.3755, 0.9638], abs=1e-4)  # Wilson
    # misses at 1024: prefill's five and lru's two; the fastest hit median: lru's 0.6
    misses = [2.0, 2.1, 2.2, 2.3, 2.4, 2.0, 2.2]
    miss_s = sum(misses) / len(misses)
    assert lru["ceiling_s"] == pytest.approx((2 * miss_s + 3 * 0.6) / 5)
    assert rows["prefill"]["share_of_ceiling"] == pytest.approx(
        lru["ceiling_s"] / rows["prefill"]["ttft_mean_s"]
    )
    args = argparse.Namespace(contexts=2, lengths=[1024], requests=5, qps=0.5, zipf=1.0,
                              cpu_share=0.1, ssd_share=0.4, system_prompt_tokens=0,
                              workload="tasks")  # fmt: skip
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
    rows = bench_e2e.summarise(results, table, 0, [1024], tokenize=_chars)
    assert rows["broken"]["errors"] == 1
    assert rows["lru"]["ceiling_s"] == pytest.approx((2.0 + 0.4) / 2)  # broken's 0.1 not used


def test_evicpress_is_judged_against_the_fixed_frontier(monkeypatch: pytest.MonkeyPatch) -> None:
    from kvtierd.profiler import embedder

    monkeypatch.setattr(embedder, "MiniLmEmbedder", _Exact)
    table = [[Prompt((1, 2), 1000, ("42",))]]
    n = 20

    def run(ttft: float, wrong: int) -> dict[str, Any]:  # ``wrong`` answers differ from 42
        return {"wall_s": 10.0, "outcomes": [_outcome(i, 0, ttft, 1000, "41" if i < wrong else
                                                      "42") for i in range(n)]}  # fmt: skip

    # int4: 0.3 s, half identical; int8: 0.5 s, all; EvicPress: 0.35 s, 15 of 20 (0.4 s on
    # the line between them); its prior-only twin: 0.45 s, 15 of 20; similarity: MiniLM's
    # stand-in gives EvicPress the same as int4's if it were scored by it
    results = {"prefill": run(2.0, 0), "fixed-int4": run(0.3, 10), "fixed-int8": run(0.5, 0),
               "evicpress-a2": run(0.35, 5), "evicpress-prior-a2": run(0.45, 5)}  # fmt: skip
    rows = bench_e2e.summarise(results, table, 0, None, tokenize=_chars)
    judged = rows["evicpress-a2"]["frontier"]
    assert judged["frontier"] == ["fixed-int4", "fixed-int8"] and judged["requests"] == n
    assert judged["ttft_at_share_s"] == [pytest.approx(0.4), "inside"]
    assert judged["speedup"][0] == pytest.approx(0.4 / 0.35)
    assert judged["share_gain"][0] == pytest.approx(0.75 - 0.625)
    assert rows["evicpress-prior-a2"]["frontier"]["speedup"][0] == pytest.approx(0.4 / 0.45)
    assert "frontier" not in rows["fixed-int8"] and "frontier" not in rows["prefill"]
    args = argparse.Namespace(contexts=1, lengths=[1024], requests=n, qps=0.5, zipf=1.0,
                              cpu_share=0.1, ssd_share=0.4, system_prompt_tokens=0,
                              workload="kinds")  # fmt: skip
    text = bench_e2e.report(rows, args)
    assert "workload kinds" in text and "Against the frontier of fixed policies" in text
    assert "| evicpress-a2 | 0.750 | 0.350 | 0.400 | 1.143 [" in text
    assert "| fixed-int8 | 0.500 | " in text and "1.000 (20 of 20)" in text
    # equal quality is decided by identical answers: int8's 20 of 20 is not EvicPress's 15
    assert "| fixed-int8 | 0.500 | - | no EvicPress run at its quality |" in text
    assert "| fixed-int4 | 0.300 | evicpress-a2 0.350 | 0.86x |" in text


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
    # the prior-only twin never reads the model, refining or not
    prior = refined["evicpress-prior-a2"].policy["profiling"]  # type: ignore[index]
    assert "model_dir" not in prior and "evaluator" not in prior
