"""Mechanics of benchmarks/quality/needle_check.py on a tiny random Llama (no quality claim).

The needle check's figures rest on two things this test holds: the captured window queries are
the model's own (RoPE included), and the compressed-cache path answers like plain generation
when nothing is dropped (position ids continue from N, the mask follows the cache).
"""

from __future__ import annotations

import pytest
import torch

from benchmarks.quality.needle_check import (
    answer_with_variant,
    check_window_queries,
    prefill_context,
)

transformers = pytest.importorskip("transformers")


@pytest.fixture(scope="module")
def model() -> object:
    cfg = transformers.LlamaConfig(
        vocab_size=97,
        hidden_size=96,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=6,
        num_key_value_heads=2,
        head_dim=16,
        max_position_embeddings=512,
        rope_theta=10000.0,
        initializer_range=0.2,
        eos_token_id=96,
    )
    torch.manual_seed(0)
    return transformers.LlamaForCausalLM(cfg).eval()


def _ids(n: int, seed: int) -> torch.Tensor:
    return torch.randint(0, 96, (1, n), generator=torch.Generator().manual_seed(seed))


def test_window_queries_are_the_models(model: object) -> None:
    ctx = prefill_context(model, _ids(150, 1), window=16)
    assert ctx.keys.shape == (2, 2, 150, 16) and ctx.queries.shape == (2, 6, 16, 16)
    assert check_window_queries(ctx) < 1e-5
    wrong = type(ctx)(ctx.keys, ctx.values, ctx.queries.flip(2), ctx.last_attention)
    assert check_window_queries(wrong) > 1e-2  # the check can fail


def test_full_kv_path_answers_like_generate(model: object) -> None:
    context, question = _ids(120, 2), _ids(7, 3)
    ctx = prefill_context(model, context, window=8)
    kept, out = answer_with_variant(model, ctx, "none", question, max_new_tokens=6)
    full = torch.cat([context, question], dim=1)
    want = model.generate(  # type: ignore[attr-defined]
        full, max_new_tokens=6, do_sample=False, eos_token_id=96, pad_token_id=96
    )
    assert kept == 120
    assert len(out) == 6  # no end-of-sequence token in these ids
    assert out == want[0, full.shape[1] :].tolist()


@pytest.mark.parametrize("variant", ["snapkv-window=8@0.5", "knorm@0.25", "streamingllm@0.1"])
def test_dropped_variants_keep_their_count(model: object, variant: str) -> None:
    ctx = prefill_context(model, _ids(120, 4), window=8)
    kept, out = answer_with_variant(model, ctx, variant, _ids(5, 5), max_new_tokens=3)
    assert kept == round(float(variant.rpartition("@")[2]) * 120)
    assert len(out) <= 3
