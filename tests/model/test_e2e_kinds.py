"""bench_e2e's ``--workload kinds`` (issue 39) on the real tokenizer: each request's prompt is
the labels' (``context_labels.prompts``: the same context, question and lead), so the end to
end run asks what the labels measured."""

from __future__ import annotations

from pathlib import Path

import pytest

from benchmarks.e2e.e2e_workload import make_documents
from benchmarks.quality.context_labels import prompts as label_prompts
from benchmarks.quality.quality_labels import CHUNK


@pytest.mark.model
def test_kind_prompts_are_the_labels_prompts(real_model: Path) -> None:
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(real_model)
    docs = make_documents(tokenizer, "kinds", n=2, lengths=[1024], seed=1, chunk_tokens=CHUNK)
    for case, row in zip(docs.contexts, docs.table, strict=True):
        context, queries = label_prompts(tokenizer, case)  # type: ignore[arg-type]
        assert [list(p.ids) for p in row] == [context + q for q in queries], case.name
        assert {p.context_tokens for p in row} == {len(context)}
