"""Across-context ranking metrics (benchmarks/quality/ranking.py): they judge how an estimator
ranks contexts within a variant, so a score that is blind to the context gets 0.5 however well
it orders the variants of each context."""

from __future__ import annotations

import itertools
import random
from typing import Any

import pytest

from benchmarks.quality.context_labels import RULES, VARIANTS, ContextLabels
from benchmarks.quality.ranking import (
    concordance,
    context_auc,
    context_spearman,
    mean_spearman,
    spearman,
)

# three contexts, two variants: "a" keeps every answer, "c" loses most
LABELS = {
    "a": {"int4": 1.0, "knorm@0.5": 0.8},
    "b": {"int4": 0.9, "knorm@0.5": 0.5},
    "c": {"int4": 0.7, "knorm@0.5": 0.1},
}


def test_a_context_blind_score_gets_half_whatever_it_orders_across_variants() -> None:
    # the per-variant prior: orders int4 above knorm@0.5 in every context (perfect pair
    # agreement across variants), and says nothing about which context is which
    prior = {c: {"int4": 0.95, "knorm@0.5": 0.5} for c in LABELS}
    got = context_auc(LABELS, prior)
    assert got.pairs == 6 and got.auc == 0.5
    assert mean_spearman(LABELS, prior) is None


def test_a_score_that_ranks_contexts_right_gets_one_and_reversed_gets_zero() -> None:
    right = {c: {v: x + 0.01 for v, x in row.items()} for c, row in LABELS.items()}
    wrong = {c: {v: -x for v, x in row.items()} for c, row in LABELS.items()}
    assert context_auc(LABELS, right).auc == 1.0
    assert context_auc(LABELS, wrong).auc == 0.0
    assert mean_spearman(LABELS, right) == pytest.approx(1.0)
    assert context_spearman(LABELS, wrong, "int4") == pytest.approx(-1.0)


def test_pairs_with_equal_labels_do_not_count_and_score_ties_count_half() -> None:
    got = concordance([1.0, 1.0, 0.0], [0.2, 0.9, 0.2])
    # pairs: (0, 2) tied in score -> 0.5, (1, 2) right -> 1; (0, 1) equal labels: no pair
    assert (got.pairs, got.agreed) == (2, 1.5)
    with pytest.raises(ValueError, match="2 labels but 3 scores"):
        concordance([1.0, 0.0], [1.0, 0.0, 0.5])


def test_only_contexts_scored_for_a_variant_count() -> None:
    partial = {"a": {"int4": 0.9}, "b": {"int4": 0.8}}  # no "c", no knorm@0.5
    got = context_auc(LABELS, partial, ["int4", "knorm@0.5"])
    assert got.pairs == 1 and got.auc == 1.0


def test_spearman_with_ties_and_short_or_constant_sides() -> None:
    assert spearman([1, 1, 2, 2], [1, 2, 3, 4]) == pytest.approx(0.894, abs=1e-3)
    assert spearman([1, 2], [1, 2]) is None
    assert spearman([1, 1, 1], [1, 2, 3]) is None


def test_the_checked_in_labels_and_their_report() -> None:
    """benchmarks/data/context_labels.jsonl and context_scores.jsonl as checked in: at least 80
    contexts of at least 4 kinds at 1k and 2k tokens with both halves, and the report's prior
    row at exactly 0.5 whatever the labels (a context-blind score)."""
    from benchmarks.quality.bench_context_ranking import coverage_calibration, report
    from benchmarks.quality.context_labels import load_context_labels, table

    contexts = load_context_labels()
    assert len(contexts) >= 80
    assert len({c.kind for c in contexts}) >= 4 and {c.length for c in contexts} == {1024, 2048}
    assert {c.half for c in contexts} == {"fit", "held-out"}
    assert all(len(c.questions) >= 4 for c in contexts)
    assert "split-half rho" in table(contexts)
    out = report()
    prior = next(line for line in out.splitlines() if line.startswith("| first put | prior |"))
    assert prior.split("|")[3].strip() == "0.50"
    knots = coverage_calibration()
    assert knots[-1] == (1.0, 1.0)
    assert all(a[0] < b[0] and a[1] <= b[1] for a, b in itertools.pairwise(knots))


def _labelled(name: str, seed: int, kept_of_4: int) -> ContextLabels:
    """A hand-made context of four questions, ``kept_of_4`` of them kept by every variant."""
    answers = tuple(int(i < kept_of_4) for i in range(4))
    kept = {rule: dict.fromkeys(VARIANTS, answers) for rule in RULES}
    return ContextLabels(name=name, kind="logs", length=1024, seed=seed, fact_share=0.5,
                         context_tokens=1000, digest="", questions=("q",) * 4,
                         kept=kept)  # fmt: skip


def test_the_fitted_candidate_learns_its_weights_on_the_fit_half_only() -> None:
    """One reading follows the labels, the others are noise: fitted on the fit half, the
    regression ranks held-out contexts by that reading — and learns the sign from the fit half:
    with the fit half's labels reversed it ranks the same held-out contexts backwards."""
    from benchmarks.quality.bench_context_ranking import FITTED, fitted_scores

    rng = random.Random(0)
    kept = [i % 5 for i in range(20)]  # 0..4 questions kept, even seeds fit, odd held out

    def rows(signal: list[float]) -> dict[str, dict[str, Any]]:
        out: dict[str, dict[str, Any]] = {}
        for i, s in enumerate(signal):
            scores = {f: dict.fromkeys(VARIANTS, rng.random()) for f in FITTED}
            scores["ngram"] = dict.fromkeys(VARIANTS, s + 0.01 * rng.random())
            out[f"c{i}"] = {"scores": scores}
        return out

    contexts = [_labelled(f"c{i}", i, k) for i, k in enumerate(kept)]
    fit = [c for c in contexts if c.half == "fit"]
    held = [c for c in contexts if c.half == "held-out"]
    labels = {c.name: {v: c.share(v) for v in VARIANTS} for c in held}
    follows = rows([k / 4 for k in kept])
    assert context_auc(labels, fitted_scores(follows, fit, held), VARIANTS).auc == 1.0
    # the fit half's reading reversed, the held-out half's as before: the sign came from fit
    reversed_on_fit = rows([(1 - k / 4) if i % 2 == 0 else k / 4 for i, k in enumerate(kept)])
    assert context_auc(labels, fitted_scores(reversed_on_fit, fit, held), VARIANTS).auc == 0.0
    del follows["c3"]["scores"]["recon"]  # a held-out context without one reading: no candidate
    assert fitted_scores(follows, fit, held) == {}


def test_the_checked_in_redundancy_labels_and_their_report() -> None:
    """benchmarks/data/context_labels_redundancy.jsonl (issue 39, item 1): at least 80 contexts
    of at least 4 kinds at 1k and 2k tokens, both halves, at least 4 answered questions each;
    every one scored in context_scores_redundancy.jsonl, and the report's prior row at 0.5."""
    from benchmarks._support.common import REPO
    from benchmarks.quality.bench_context_ranking import report
    from benchmarks.quality.context_labels import load_context_labels

    data = REPO / "benchmarks" / "data"
    labels = data / "context_labels_redundancy.jsonl"
    contexts = load_context_labels(labels)
    assert len(contexts) >= 80
    assert len({c.kind for c in contexts}) >= 4 and {c.length for c in contexts} == {1024, 2048}
    assert {c.half for c in contexts} == {"fit", "held-out"}
    assert all(len(c.questions) >= 4 and c.redundancy is not None for c in contexts)
    out = report(data / "context_scores_redundancy.jsonl", labels)
    held = sum(c.half == "held-out" for c in contexts)
    assert f"{held} held-out contexts (of {len(contexts)} labelled" in out
    prior = next(line for line in out.splitlines() if line.startswith("| first put | prior |"))
    assert prior.split("|")[3].strip() == "0.50"
    assert any(line.startswith("| first put | fitted |") for line in out.splitlines())
