"""How well an estimator ranks *contexts* within one variant (issue 39, item 2; DESIGN.md §3.11).

The placer needs to know which contexts keep their answers under a variant and which lose
them; the variants' own order is the same for every context, so a context-blind table (the
per-variant prior) already orders the variants of any one context. These metrics compare
contexts with each other inside one variant only, never across variants, so that a score which
is constant within a variant gets exactly 0.5 (AUC) and no Spearman at all, whatever it does
across variants.

* :func:`context_auc`: over every variant, every pair of contexts whose labels differ, the
  share the score orders the same way (ties in the score count half) — the concordance index
  (Harrell's C), which is the ROC AUC when labels are 0/1; pooled over variants by pairs.
* :func:`context_spearman`: per variant, Spearman's rank correlation between score and label
  across contexts (``None`` where either is constant); :func:`mean_spearman` averages the
  variants that have one.
"""

from __future__ import annotations

import random
import statistics
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

Table = Mapping[str, Mapping[str, float]]
"""``context -> variant -> value`` (a label or an estimator's score)."""


@dataclass(frozen=True, slots=True)
class Concordance:
    """Pairs of contexts with different labels, and how many the score orders right."""

    pairs: int
    agreed: float  # ties in the score count half

    @property
    def auc(self) -> float | None:
        return self.agreed / self.pairs if self.pairs else None

    def __add__(self, other: Concordance) -> Concordance:
        return Concordance(self.pairs + other.pairs, self.agreed + other.agreed)


def concordance(labels: Sequence[float], scores: Sequence[float]) -> Concordance:
    """Within one variant: pairs of contexts whose labels differ, ordered by the score."""
    if len(labels) != len(scores):
        raise ValueError(f"{len(labels)} labels but {len(scores)} scores")
    pairs, agreed = 0, 0.0
    for i in range(len(labels)):
        for j in range(i + 1, len(labels)):
            if labels[i] == labels[j]:
                continue
            pairs += 1
            d = (labels[i] - labels[j]) * (scores[i] - scores[j])
            agreed += 1.0 if d > 0 else 0.5 if scores[i] == scores[j] else 0.0
    return Concordance(pairs, agreed)


def _columns(labels: Table, scores: Table, variant: str) -> tuple[list[float], list[float]]:
    """Label and score of ``variant`` for every context both tables have it for."""
    have = [c for c in labels if variant in labels[c] and variant in scores.get(c, {})]
    return [labels[c][variant] for c in have], [scores[c][variant] for c in have]


def variants_of(labels: Table) -> list[str]:
    seen: dict[str, None] = {}
    for row in labels.values():
        seen.update(dict.fromkeys(row))
    return list(seen)


def context_auc(labels: Table, scores: Table, variants: Sequence[str] = ()) -> Concordance:
    """Pooled across-context concordance over ``variants`` (default: every labelled one)."""
    total = Concordance(0, 0.0)
    for v in variants or variants_of(labels):
        total += concordance(*_columns(labels, scores, v))
    return total


def bootstrap_auc(
    labels: Table, scores: Table, variants: Sequence[str], resamples: int = 400, seed: int = 0
) -> tuple[float, float] | None:
    """95% percentile interval of :func:`context_auc` over contexts drawn with replacement
    (a context drawn twice makes no pair with itself: equal labels)."""
    names = [c for c in labels if c in scores]
    rng = random.Random(seed)
    aucs = []
    for _ in range(resamples):
        drawn = [rng.choice(names) for _ in names]
        lab = {f"{i}": labels[c] for i, c in enumerate(drawn)}
        sco = {f"{i}": scores[c] for i, c in enumerate(drawn)}
        auc = context_auc(lab, sco, variants).auc
        if auc is not None:
            aucs.append(auc)
    if not aucs:
        return None
    aucs.sort()
    return aucs[int(0.025 * (len(aucs) - 1))], aucs[int(0.975 * (len(aucs) - 1))]


def context_spearman(labels: Table, scores: Table, variant: str) -> float | None:
    return spearman(*_columns(labels, scores, variant))


def mean_spearman(labels: Table, scores: Table, variants: Sequence[str] = ()) -> float | None:
    rhos = [r for v in variants or variants_of(labels)
            if (r := context_spearman(labels, scores, v)) is not None]  # fmt: skip
    return statistics.fmean(rhos) if rhos else None


def spearman(x: Sequence[float], y: Sequence[float]) -> float | None:
    """Spearman's rank correlation (average ranks for ties); ``None`` when either side is
    constant or has fewer than 3 values."""
    if len(x) != len(y):
        raise ValueError(f"{len(x)} values against {len(y)}")
    if len(x) < 3:
        return None
    rx, ry = ranks(x), ranks(y)
    mx, my = statistics.fmean(rx), statistics.fmean(ry)
    sxy = sum((a - mx) * (b - my) for a, b in zip(rx, ry, strict=True))
    sx = sum((a - mx) ** 2 for a in rx) ** 0.5
    sy = sum((b - my) ** 2 for b in ry) ** 0.5
    return None if sx == 0 or sy == 0 else sxy / (sx * sy)


def ranks(xs: Sequence[float]) -> list[float]:
    """0-based ranks, ties given their average rank."""
    order = sorted(range(len(xs)), key=lambda i: xs[i])
    out = [0.0] * len(xs)
    i = 0
    while i < len(order):
        j = i
        while j + 1 < len(order) and xs[order[j + 1]] == xs[order[i]]:
            j += 1
        for k in range(i, j + 1):
            out[order[k]] = (i + j) / 2
        i = j + 1
    return out
