"""``query_attention`` on the real model: a labelled case's variants ordered as their answers."""

from __future__ import annotations

from pathlib import Path

import pytest

pytestmark = pytest.mark.model


def test_the_question_orders_variants_as_their_answers(real_model: Path) -> None:
    """benchmarks/data/quality_labels.jsonl, niah_single/1024/0: int8 and knorm@0.5 still
    answer the needle, streamingllm@0.5 and knorm@0.1 do not; the question's attention scores
    both answering variants above both failing ones."""
    import torch
    from transformers import AutoTokenizer

    from benchmarks.quality.quality_tasks import make_case, split_prompt
    from kvtierd.profiler import ContextKV, ProfilingQuery, StoredForm
    from kvtierd.profiler.query_attention import QueryAttentionEvaluator
    from kvtierd.profiler.window_queries import prefill_with_window_queries, window_model

    torch.set_num_threads(1)
    tok = AutoTokenizer.from_pretrained(real_model)
    split = split_prompt(tok, make_case(tok, "niah_single", 1024, 0))
    model = window_model(str(real_model), torch.float32, torch.device("cpu"))  # the one it uses
    cache, _ = prefill_with_window_queries(model, torch.tensor([split.context]), window=1)
    keys = torch.stack([layer.keys[0] for layer in cache.layers])
    values = torch.stack([layer.values[0] for layer in cache.layers])
    kv = ContextKV(keys, values)
    ev = QueryAttentionEvaluator(str(real_model), calibrate=False)
    names = ["int8", "knorm@0.5", "streamingllm@0.5", "knorm@0.1"]
    question = [ProfilingQuery(token_ids=tuple(split.query))]
    res = ev.evaluate(kv, names, question, form=StoredForm(chunk_tokens=16))
    print({v: round(q, 3) for v, q in res.quality.items()})
    assert res.num_queries == 1
    assert min(res["int8"], res["knorm@0.5"]) > max(res["streamingllm@0.5"], res["knorm@0.1"])
