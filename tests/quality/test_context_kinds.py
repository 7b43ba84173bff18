"""The contexts that differ in kind (benchmarks/quality/context_kinds.py) and the
reconstruction probes (kvtierd/profiler/reconstruction.py), without a model: a whitespace
tokenizer stands in for SmolLM2's (lengths only)."""

from __future__ import annotations

from typing import Any

import pytest

from benchmarks.quality.context_kinds import KINDS, QUESTIONS, make_kind_case
from benchmarks.quality.context_labels import ContextLabels, half, split_half
from kvtierd.errors import InvalidArgumentError
from kvtierd.profiler.reconstruction import reconstruction_ids


class Words:
    """Counts words as tokens."""

    def __call__(self, text: str, add_special_tokens: bool = False) -> dict[str, Any]:
        return {"input_ids": text.split()}


@pytest.mark.parametrize("kind", KINDS)
def test_each_kind_is_deterministic_sized_and_asks_about_its_facts(kind: str) -> None:
    one = make_kind_case(Words(), kind, 600, 3)
    assert one == make_kind_case(Words(), kind, 600, 3)
    assert one != make_kind_case(Words(), kind, 600, 4)
    assert len(one.document.split()) <= 600
    assert 4 <= len(one.questions) <= QUESTIONS
    for question, lead, answer in one.questions:
        assert answer in one.document and question.endswith("?") and lead
    assert 0.0 < one.fact_share < 1.0


def test_redundant_kinds_tell_each_fact_more_than_once_and_dense_ones_once() -> None:
    for kind, least in (("narrative", 3), ("logs", 3), ("table", 1), ("code", 1)):
        case = make_kind_case(Words(), kind, 600, 0)
        for _, _, answer in case.questions:
            assert case.document.count(answer) >= least, (kind, answer)
    with pytest.raises(ValueError, match="unknown kind 'poem'"):
        make_kind_case(Words(), "poem", 600, 0)


def test_the_halves_split_by_seed_and_the_reliability_splits_questions() -> None:
    assert [half(s) for s in range(3)] == ["fit", "held-out", "fit"]

    def ctx(name: str, kept: list[int]) -> ContextLabels:
        return ContextLabels(name, "table", 1024, 0, 0.5, 10, "x", ("q",) * len(kept),
                             {"exact": {"int4": tuple(kept)}, "answered": {}})  # fmt: skip

    # odd and even questions agree on the order of the three contexts: rho 1
    contexts = [ctx("a", [1, 1, 1, 1]), ctx("b", [1, 1, 0, 0]), ctx("c", [0, 0, 0, 0])]
    assert split_half(contexts, "int4", "exact") == pytest.approx(1.0)


def test_reconstruction_probes_are_spans_spread_over_the_context() -> None:
    ids = list(range(100))
    got = reconstruction_ids(ids, spans=3, span_tokens=4)
    assert got == [0, 1, 2, 3, 48, 49, 50, 51, 96, 97, 98, 99]
    assert reconstruction_ids(ids[:6], spans=4, span_tokens=4) == [0, 1, 2, 3]
    assert reconstruction_ids([7], spans=4, span_tokens=16) == [7]
    with pytest.raises(InvalidArgumentError, match="token ids"):
        reconstruction_ids([])
    with pytest.raises(InvalidArgumentError, match="spans and span_tokens must be >= 1"):
        reconstruction_ids(ids, spans=0)
