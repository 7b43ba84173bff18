"""The estimator benchmark's arithmetic (benchmarks/quality/bench_estimators.py, quality_labels.py):
pair agreement with ties, Spearman, Wilson intervals, the labels' digest check, and the label
file as checked in."""

from __future__ import annotations

import pytest

from benchmarks.quality.bench_estimators import pair_agreement, prior_scores
from benchmarks.quality.quality_labels import (
    LABELS,
    LabelledCase,
    check_split,
    ids_digest,
    load_labels,
    wilson,
)
from benchmarks.quality.quality_tasks import PromptSplit
from benchmarks.quality.ranking import spearman


def test_pairs_count_only_differing_truth_and_ties_count_half() -> None:
    truth = {"a": 1.0, "b": 0.5, "c": 0.5, "d": 0.0}
    # pairs with differing truth: ab ac ad bd cd (bc is tied in truth: not a pair)
    assert pair_agreement(truth, {"a": 0.9, "b": 0.6, "c": 0.7, "d": 0.1}) == (5.0, 5)
    assert pair_agreement(truth, {"a": 0.1, "b": 0.6, "c": 0.7, "d": 0.9}) == (0.0, 5)
    flat = {v: 0.5 for v in truth}
    assert pair_agreement(truth, flat) == (2.5, 5)
    # only pairs whose truth differs by at least the gap: ad, and ab/ac/bd/cd at 0.5
    assert pair_agreement(truth, flat, min_gap=0.75) == (0.5, 1)


def test_spearman_with_ties_and_constant_sides() -> None:
    assert spearman([1, 2, 3, 4], [10, 20, 30, 40]) == pytest.approx(1.0)
    assert spearman([1, 2, 3, 4], [4, 3, 2, 1]) == pytest.approx(-1.0)
    assert spearman([1, 1, 2, 2], [1, 2, 3, 4]) == pytest.approx(0.894, abs=1e-3)
    assert spearman([1, 1, 1], [1, 2, 3]) is None


def test_wilson_interval() -> None:
    lo, hi = wilson(8, 10)
    assert (round(lo, 3), round(hi, 3)) == (0.490, 0.943)  # the textbook value
    assert wilson(0, 0) == (0.0, 1.0)
    lo, hi = wilson(60, 60)
    assert hi == pytest.approx(1.0) and 0.93 < lo < 0.95


def row(name: str, acc: dict[str, float]) -> dict[str, object]:
    return {
        "case": name, "task": "niah_single", "length": 1024, "seed": 0, "prompt_tokens": 3,
        "context_tokens": 2, "sha256": ids_digest([1, 2, 3]), "full_answer": "x",
        "full_accuracy": 1.0, "accuracy": acc, "exact": {v: 0 for v in acc},
    }  # fmt: skip


def test_prior_is_the_other_cases_mean() -> None:
    cases = [LabelledCase.of(row(str(i), {"k": a})) for i, a in enumerate([1.0, 0.0, 0.5])]
    assert prior_scores(cases) == {"0": {"k": 0.25}, "1": {"k": 0.75}, "2": {"k": 0.5}}


def test_a_regenerated_prompt_must_match_the_labels() -> None:
    r = row("niah_single/1024/0", {})
    check_split(r, PromptSplit(ids=(1, 2, 3), context_tokens=2))
    with pytest.raises(ValueError, match="the task generator or the tokenizer changed"):
        check_split(r, PromptSplit(ids=(1, 2, 4), context_tokens=2))


@pytest.mark.skipif(not LABELS.exists(), reason="no labels checked in")
def test_checked_in_labels_are_whole() -> None:
    cases = load_labels()
    assert cases, "the label file holds no case the full KV answers"
    for c in cases:
        assert set(c.accuracy) == set(c.exact) and c.accuracy
        assert all(0.0 <= a <= 1.0 for a in c.accuracy.values())
        assert all(e in (0, 1) for e in c.exact.values())
        # an unchanged answer holds the same facts as the full KV's (accuracy 1.0)
        assert all(c.accuracy[v] == 1.0 for v, e in c.exact.items() if e)
