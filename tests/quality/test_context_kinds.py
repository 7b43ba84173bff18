"""The contexts that differ in kind (benchmarks/quality/context_kinds.py) and the
reconstruction probes (kvtierd/profiler/reconstruction.py), without a model: a whitespace
tokenizer stands in for SmolLM2's (lengths only)."""

from __future__ import annotations

import hashlib
from typing import Any

import pytest

from benchmarks.quality.context_kinds import (
    KINDS,
    MAX_TELLINGS,
    MIN_FACTS,
    QUESTIONS,
    Redundancy,
    draw_redundancy,
    make_kind_case,
)
from benchmarks.quality.context_labels import ContextLabels, half, split_half
from kvtierd.errors import InvalidArgumentError
from kvtierd.profiler.reconstruction import reconstruction_ids

PINNED = "2bea111409fe6f9358b72d5c01f910ffa17672ad340834d8fed3a31a52dc3d2e"
"""The digest of :func:`make_kind_case`'s cases below (no redundancy), taken before the knob."""


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


def test_without_redundancy_the_contexts_are_the_ones_the_e2e_workload_was_built_on() -> None:
    # a digest of the cases as they were before the redundancy knob: the e2e workload
    # (benchmarks/e2e/e2e_workload.py) builds its documents with these arguments
    digest = hashlib.sha256()
    for kind in KINDS:
        for seed in (0, 5):
            digest.update(repr(make_kind_case(Words(), kind, 600, seed)).encode())
    assert digest.hexdigest() == PINNED


@pytest.mark.parametrize("kind", KINDS)
def test_redundancy_retells_each_fact_and_asks_about_every_one(kind: str) -> None:
    once = make_kind_case(Words(), kind, 1200, 1, Redundancy(1, 0.9))
    thrice = make_kind_case(Words(), kind, 1200, 1, Redundancy(3, 0.9))
    sparse = make_kind_case(Words(), kind, 1200, 1, Redundancy(1, 0.2))
    for case, least in ((once, 1), (thrice, 3), (sparse, 1)):
        assert len(case.document.split()) <= 1200 and len(case.questions) >= MIN_FACTS
        for *_, answer in case.questions:
            assert case.document.count(answer) >= least, (kind, answer)
    # every fact is asked about: as many questions as facts, more than QUESTIONS
    assert len(once.questions) >= len(thrice.questions)
    assert len(once.questions) > QUESTIONS
    assert sparse.fact_share < once.fact_share


def test_redundancy_is_drawn_from_the_seed_over_a_wide_range() -> None:
    drawn = [draw_redundancy("chat", 1024, s) for s in range(40)]
    assert drawn == [draw_redundancy("chat", 1024, s) for s in range(40)]
    assert {d.tellings for d in drawn} == set(range(1, MAX_TELLINGS + 1))
    shares = [d.fact_share for d in drawn]
    assert min(shares) < 0.3 and max(shares) > 0.8
    with pytest.raises(ValueError, match=r"1 <= tellings <= 4 and 0 < fact_share <= 1"):
        Redundancy(0, 0.5)
    with pytest.raises(ValueError, match=r"got 2, 1\.5"):
        Redundancy(2, 1.5)


def test_a_labelled_context_regenerates_with_its_redundancy() -> None:
    row = {"case": "code/1200/3", "kind": "code", "length": 1200, "seed": 3, "fact_share": 0.5,
           "context_tokens": 10, "sha256": "x", "asked": ["q"] * 4, "redundancy": [2, 0.4],
           "exact": {"int4": [1, 1, 0, 0]}, "answered": {"int4": [1, 1, 1, 0]}}  # fmt: skip
    lc = ContextLabels.of(row)
    assert lc.redundancy == Redundancy(2, 0.4)
    assert lc.case(Words()) == make_kind_case(Words(), "code", 1200, 3, Redundancy(2, 0.4))
    assert ContextLabels.of({**row, "redundancy": None}).case(Words()) == make_kind_case(
        Words(), "code", 1200, 3
    )
