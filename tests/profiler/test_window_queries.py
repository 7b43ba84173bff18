"""Window queries captured at prefill equal the model's own RoPE-applied queries."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from kvtierd.errors import InvalidArgumentError
from kvtierd.profiler.window_queries import (
    prefill_with_window_queries,
    window_model,
    window_queries_after_prefix,
)


def reference_queries(model: Any, ids: torch.Tensor, window: int) -> torch.Tensor:
    """q_proj of each attention's input, rotated with the model's own rotary embedding."""
    from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

    seen: dict[int, torch.Tensor] = {}

    def hook(module: Any, args: Any, kwargs: dict[str, Any]) -> None:
        h = kwargs["hidden_states"] if "hidden_states" in kwargs else args[0]
        cos, sin = kwargs["position_embeddings"]
        q = module.q_proj(h).view(*h.shape[:-1], -1, module.head_dim).transpose(1, 2)
        q, _ = apply_rotary_pos_emb(q, q, cos, sin)
        seen[module.layer_idx] = q[0, :, -window:]

    handles = [
        layer.self_attn.register_forward_pre_hook(hook, with_kwargs=True)
        for layer in model.model.layers
    ]
    with torch.inference_mode():
        model(input_ids=ids)
    for handle in handles:
        handle.remove()
    return torch.stack([seen[i] for i in range(len(seen))])


def check(model: Any, ids: torch.Tensor, window: int) -> torch.Tensor:
    with torch.inference_mode():
        plain = model(input_ids=ids).logits
    cache, queries = prefill_with_window_queries(model, ids, window)
    cfg = model.config
    assert queries.shape == (
        cfg.num_hidden_layers, cfg.num_attention_heads, min(window, ids.shape[1]), cfg.head_dim
    )  # fmt: skip
    assert torch.equal(queries, reference_queries(model, ids, window))
    assert cache.get_seq_length() == ids.shape[1]
    # the capture runs the model's own attention: the prefill is unchanged, and so is the model
    with torch.inference_mode():
        assert torch.equal(model(input_ids=ids).logits, plain)
    assert model.config._attn_implementation == "sdpa"
    return queries


def test_tiny_model_queries_match_the_reference(tiny_llama_dir: Path) -> None:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tiny_llama_dir, attn_implementation="sdpa")
    ids = torch.randint(5, 500, (1, 50), generator=torch.Generator().manual_seed(0))
    check(model, ids, 16)
    check(model, ids[:, :7], 16)  # shorter than the window: every token's query


@pytest.mark.model
def test_real_model_queries_match_the_reference(real_model: Path) -> None:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(
        real_model, dtype=torch.bfloat16, attn_implementation="sdpa"
    )
    ids = torch.randint(100, 40000, (1, 200), generator=torch.Generator().manual_seed(1))
    queries = check(model, ids, 64)
    assert queries.dtype == torch.bfloat16


def test_bad_arguments_are_named(tiny_llama_dir: Path) -> None:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tiny_llama_dir)
    with pytest.raises(InvalidArgumentError, match="window must be >= 1"):
        prefill_with_window_queries(model, torch.ones((1, 4), dtype=torch.long), 0)
    with pytest.raises(InvalidArgumentError, match=r"input_ids must be \[1, N\]"):
        prefill_with_window_queries(model, torch.ones((2, 4), dtype=torch.long), 4)


def recomputed(model: Any, ids: torch.Tensor, window: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(queries captured at the whole prefill, queries recomputed from its stored prefix KV)."""
    cache, queries = prefill_with_window_queries(model, ids, window)
    p = ids.shape[1] - window
    keys = torch.stack([layer.keys[0, :, :p] for layer in cache.layers])
    values = torch.stack([layer.values[0, :, :p] for layer in cache.layers])
    return queries, window_queries_after_prefix(model, keys, values, ids[:, p:])


def test_tiny_model_queries_recomputed_from_the_stored_prefix(tiny_llama_dir: Path) -> None:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tiny_llama_dir, attn_implementation="sdpa")
    ids = torch.randint(5, 500, (1, 80), generator=torch.Generator().manual_seed(2))
    for window in (16, 80):  # a window as long as the context: no prefix at all
        captured, again = recomputed(model, ids, window)
        torch.testing.assert_close(again, captured, rtol=1e-5, atol=1e-5)
    assert model.config._attn_implementation == "sdpa"
    with pytest.raises(InvalidArgumentError, match=r"window_ids must be \[1, W >= 1\]"):
        window_queries_after_prefix(model, torch.zeros(2, 2, 0, 16), torch.zeros(2, 2, 0, 16),
                                    torch.ones((1, 0), dtype=torch.long))  # fmt: skip
    with pytest.raises(InvalidArgumentError, match=r"must be equal \[L=2, H, P, D\]"):
        window_queries_after_prefix(model, torch.zeros(3, 2, 4, 16), torch.zeros(3, 2, 4, 16),
                                    ids[:, :4])  # fmt: skip


@pytest.mark.model
def test_real_model_snapkv_keeps_the_same_tokens_from_recomputed_queries(real_model: Path) -> None:
    """The recomputed queries differ from the prefill's by matmul rounding at most, and snapkv
    keeps the same tokens from either. In float32: in bf16 the rounding depends on the CPU
    (bit-identical on an AVX-512 EPYC, 1.5% of kept tokens swapped at near-ties on an AMX Xeon;
    issue 25), and this test is about the recomputation, not the CPU's bf16 matmul."""
    from transformers import AutoModelForCausalLM

    from kvtierd.kernels.api import compress_dense

    model = AutoModelForCausalLM.from_pretrained(
        real_model, dtype=torch.float32, attn_implementation="sdpa"
    )
    ids = torch.randint(100, 40000, (1, 512), generator=torch.Generator().manual_seed(3))
    captured, again = recomputed(model, ids, 64)
    cos = torch.nn.functional.cosine_similarity(again, captured, dim=-1)
    assert cos.min() > 0.99999, cos.min()
    cache, _ = prefill_with_window_queries(model, ids, 64)
    keys = torch.stack([layer.keys[0] for layer in cache.layers])
    values = torch.stack([layer.values[0] for layer in cache.layers])
    kept = [compress_dense(keys, values, "snapkv@0.25", queries=q).kept for q in (captured, again)]
    same = (kept[0].sort(-1).values == kept[1].sort(-1).values).float().mean()
    assert same > 0.99, same


@pytest.mark.model
def test_queries_for_a_stored_context_as_a_connector_sees_it(real_model: Path) -> None:
    """From LMCache's KV_2LTD of a context and its last window's token ids, the model in the
    checkpoint's directory gives the queries the context's prefill attended with."""
    from transformers import AutoModelForCausalLM

    from kvtierd.kernels.api import to_kv_2ltd
    from kvtierd.profiler.window_queries import queries_for_kv_2ltd

    model = AutoModelForCausalLM.from_pretrained(
        real_model, dtype=torch.bfloat16, attn_implementation="sdpa"
    )
    ids = torch.randint(100, 40000, (1, 320), generator=torch.Generator().manual_seed(4))
    cache, captured = prefill_with_window_queries(model, ids, 64)
    keys = torch.stack([layer.keys[0] for layer in cache.layers])
    values = torch.stack([layer.values[0] for layer in cache.layers])
    kv = to_kv_2ltd(keys, values)
    again = queries_for_kv_2ltd(str(real_model), kv, int(keys.shape[1]), ids[0].tolist(), 64)
    cos = torch.nn.functional.cosine_similarity(again.float(), captured.float(), dim=-1)
    assert cos.min() > 0.999, cos.min()
    with pytest.raises(InvalidArgumentError, match="2 token ids for a window of 64"):
        queries_for_kv_2ltd(str(real_model), kv, int(keys.shape[1]), [1, 2], 64)
    with pytest.raises(InvalidArgumentError, match="cannot load a causal LM"):
        queries_for_kv_2ltd("/nonexistent", kv, int(keys.shape[1]), ids[0].tolist(), 64)


def test_threads_sharing_the_window_model_each_get_their_queries(tiny_llama_dir: Path) -> None:
    """The daemon profiles on one thread and builds variants on another, both through the one
    model ``window_model`` loads: a capture switches that model's attention function, so two
    passes at once would switch it back under each other (layers captured by neither)."""
    import threading

    from kvtierd.profiler.window_queries import queries_for_context

    model = window_model(str(tiny_llama_dir), torch.float32, torch.device("cpu"))
    ids = torch.randint(5, 500, (1, 96), generator=torch.Generator().manual_seed(5))
    cache, _ = prefill_with_window_queries(model, ids, 16)
    keys = torch.stack([layer.keys[0] for layer in cache.layers])
    values = torch.stack([layer.values[0] for layer in cache.layers])
    want = queries_for_context(str(tiny_llama_dir), keys, values, ids[0].tolist(), 16)
    start, failures = threading.Barrier(2), []

    def run() -> None:
        start.wait()
        for _ in range(30):
            try:
                got = queries_for_context(str(tiny_llama_dir), keys, values, ids[0].tolist(), 16)
                assert torch.equal(got, want)
            except (InvalidArgumentError, AssertionError) as e:
                failures.append(e)

    threads = [threading.Thread(target=run) for _ in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not failures, failures[:2]
    assert model.config._attn_implementation == "sdpa"
