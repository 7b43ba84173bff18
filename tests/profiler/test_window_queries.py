"""Window queries captured at prefill equal the model's own RoPE-applied queries."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from kvtierd.errors import InvalidArgumentError
from kvtierd.profiler.window_queries import prefill_with_window_queries


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
