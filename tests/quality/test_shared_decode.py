"""Questions decoded at once over a shared context KV (benchmarks/quality/shared_decode.py)
give the answers one decode per question gives: a tiny local Llama in float32, our kernels,
offline."""

from __future__ import annotations

import os

import pytest

from benchmarks._support.tiny_llama import build_tiny_llama
from benchmarks.quality.shared_decode import answer_questions, decode_rows
from kvtierd.profiler import ProfilingQuery
from kvtierd.profiler.answer import AnswerEvaluator
from kvtierd.profiler.quality import StoredForm

os.environ["HF_HUB_OFFLINE"] = "1"

CONTEXT = "The apple costs 412 coins. The river is 88 miles long. The tower is old. " * 6
QUESTIONS = [
    "What does the apple cost?",
    "How long is the river?",
    "How old is the tower, and who built it?",  # another length: a group of its own
    "What does the river cost?",
]


@pytest.fixture(scope="module")
def evaluator(tmp_path_factory: pytest.TempPathFactory) -> AnswerEvaluator:
    ev = AnswerEvaluator(str(build_tiny_llama(tmp_path_factory.mktemp("tiny"))), max_new_tokens=6)
    ev.load()  # float32: the kernels take no float64
    return ev


def test_batched_questions_answer_as_one_decode_per_question(evaluator: AnswerEvaluator) -> None:
    kv = evaluator.encode_context(CONTEXT, window=64)
    queries = [evaluator.query_ids(ProfilingQuery(text=q)) for q in QUESTIONS]
    assert len({len(q) for q in queries}) > 1  # the grouping by length is exercised
    form = StoredForm(chunk_tokens=16)
    variants = ["none", "knorm@0.5", "snapkv@0.5"]
    one = evaluator.answer_ids(kv, variants, [ProfilingQuery(token_ids=tuple(q))
                                              for q in queries], form=form)  # fmt: skip
    many = answer_questions(evaluator, kv, variants, queries, form=form, max_rows=2)
    assert many == one
    assert any(a for row in many for a in row)


def test_rows_of_unequal_length_are_refused(evaluator: AnswerEvaluator) -> None:
    model, _ = evaluator.load()
    kv = evaluator.encode_context(CONTEXT)
    with pytest.raises(ValueError, match="rows of equal length"):
        decode_rows(model, kv.keys, kv.values, [[1, 2], [3]], context_tokens=kv.num_tokens,
                    max_new_tokens=2, eos_token_ids=frozenset())  # fmt: skip
