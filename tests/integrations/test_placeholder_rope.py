"""The RoPE a token-dropped context is rotated with (``placeholder_store.rope_spec``), held to
the model's own rotary embedding (transformers, no engine), and the position encodings the
plugin refuses (``placeholder.model_rope``).

A key rotated at position ``p`` and then by ``delta`` must equal the key rotated at
``p + delta``: the kept keys of a context are moved by ``M - N`` this way (DESIGN.md §1)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from kvtierd.errors import InvalidArgumentError
from kvtierd.integrations.placeholder_store import rope_spec
from kvtierd.kernels.placeholder import model_rope, read_model_rope
from kvtierd.kernels.rope import rotate_keys

HEAD_DIM = 64
LLAMA = {"model_type": "llama", "hidden_size": 256, "num_attention_heads": 4, "vocab_size": 100}


@pytest.mark.parametrize(
    "scaling",
    [
        None,
        {"rope_type": "linear", "factor": 4.0},
        {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
         "original_max_position_embeddings": 1024},
        {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 1024},
    ],
    ids=["default", "linear", "llama3", "yarn"],
)  # fmt: skip
def test_a_delta_rotation_moves_keys_as_the_model_places_them(
    scaling: dict[str, Any] | None, tmp_path: Path
) -> None:
    transformers = pytest.importorskip("transformers")
    from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding, rotate_half

    config = transformers.LlamaConfig(
        hidden_size=256, num_attention_heads=4, num_key_value_heads=2, head_dim=HEAD_DIM,
        vocab_size=100, max_position_embeddings=8192, rope_theta=50000.0, rope_scaling=scaling,
    )  # fmt: skip
    config.save_pretrained(tmp_path)
    embedding = LlamaRotaryEmbedding(config)
    keys = torch.randn(1, 2, 3, HEAD_DIM, generator=torch.Generator().manual_seed(0))

    def at(positions: list[int]) -> torch.Tensor:
        cos, sin = embedding(keys, torch.tensor([positions]))
        return keys * cos[:, None] + rotate_half(keys) * sin[:, None]

    positions, delta = [700, 1500, 3000], -512  # past the original length: scaling matters
    spec = rope_spec(str(tmp_path), read_model_rope(str(tmp_path)))
    moved = rotate_keys(at(positions), spec, delta)
    want = at([p + delta for p in positions])
    assert float((moved - want).abs().max()) < 1e-3 * float(want.abs().max())


@pytest.mark.parametrize(
    ("config", "why"),
    [
        ({"rope_scaling": {"rope_type": "dynamic", "factor": 2.0}}, "length-dependent"),
        ({"rope_parameters": {"rope_type": "longrope"}}, "length-dependent"),
        ({"rope_scaling": {"type": "mrope", "mrope_section": [16, 24, 24]}}, "M-RoPE"),
        ({"model_type": "bloom"}, "ALiBi"),
        ({"alibi": True}, "ALiBi"),
        ({"architectures": ["GPTJForCausalLM"]}, "GPTJForCausalLM rotates adjacent pairs"),
        ({"architectures": ["CohereForCausalLM"]}, "GPT-J style"),
        ({"architectures": ["ChatGLMModel"], "original_rope": True}, "GPT-J style"),
    ],
)
def test_inexact_position_encodings_are_refused_with_the_reason(
    config: dict[str, Any], why: str
) -> None:
    with pytest.raises(InvalidArgumentError, match=why):
        model_rope({**LLAMA, **config})


def test_neox_style_architectures_are_accepted() -> None:
    for config in ({"architectures": ["LlamaForCausalLM"]},
                   {"architectures": ["ChatGLMModel"], "original_rope": False}):  # fmt: skip
        assert model_rope({**LLAMA, **config}).head_dim == HEAD_DIM


def test_a_llama3_config_is_read() -> None:
    config = {**LLAMA, "head_dim": 32, "partial_rotary_factor": 0.5, "bos_token_id": 1,
              "eos_token_id": [2, 9], "rope_parameters": {"rope_type": "llama3",
                                                          "rope_theta": 5e5}}  # fmt: skip
    r = model_rope(config)
    assert (r.rope_type, r.theta, r.head_dim, r.rotary_dim) == ("llama3", 5e5, 32, 16)
    assert (r.vocab_size, r.special_ids) == (100, (1, 2, 9))
