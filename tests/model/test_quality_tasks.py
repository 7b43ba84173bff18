"""The quality benchmark's cases (benchmarks/quality/quality_tasks.py) on the real model's
tokenizer."""

from __future__ import annotations

from pathlib import Path

import pytest

from benchmarks.quality.quality_tasks import TASKS, accuracy, make_case, make_cases, split_prompt

pytestmark = pytest.mark.model


@pytest.fixture(scope="module")
def tokenizer(real_model: Path) -> object:
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(real_model)


@pytest.mark.parametrize("task", TASKS)
@pytest.mark.parametrize("length", [1024, 4096])
def test_cases_plant_their_facts_in_a_context_of_the_asked_length(
    tokenizer: object, task: str, length: int
) -> None:
    case = make_case(tokenizer, task, length, seed=3)
    assert case == make_case(tokenizer, task, length, seed=3)  # deterministic
    assert case != make_case(tokenizer, task, length, seed=4)
    assert len(case.questions) >= 2
    for question, answers in case.questions:
        assert all(a in case.document for a in answers)
        assert all(a not in question for a in answers)
    split = split_prompt(tokenizer, case)
    assert split.context_tokens % 16 == 0
    assert 0.9 * length <= len(split.ids) <= 1.1 * length
    # the context ends inside the document; the query carries the question and the template
    assert len(split.query) >= len(tokenizer(case.question)["input_ids"])
    assert split.context + split.query == list(split.ids)
    # every question of a case shares its context: the reuse the end-to-end benchmark measures
    other = split_prompt(tokenizer, case, question=case.questions[1][0])
    assert other.context == split.context and other.query != split.query


def test_accuracy_counts_each_expected_string(tokenizer: object) -> None:
    case = make_case(tokenizer, "niah_multivalue", 1024, seed=0)
    first, second = case.answers
    assert accuracy(case, f"The numbers are {first} and {second}.") == 1.0
    assert accuracy(case, f"Only {first}.") == 0.5
    assert accuracy(case, "I do not know.") == 0.0


def test_a_grid_has_every_task_and_length(tokenizer: object) -> None:
    cases = make_cases(tokenizer, list(TASKS), [1024, 2048], per=2)
    assert len(cases) == len(TASKS) * 2 * 2
    assert len({c.name for c in cases}) == len(cases)
    with pytest.raises(ValueError, match="unknown task 'x'; known: niah_single"):
        make_case(tokenizer, "x", 1024, 0)
