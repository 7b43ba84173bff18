"""A tiny Llama built locally (no downloads): config, word-level tokenizer, seeded weights.

vLLM loads the same safetensors that ``transformers`` saved, so a transformers forward pass is a
reference for vLLM's logits (issue 6, test c). The init scale is raised above Llama's 0.02 so
that the logits are far from uniform and a wrong KV shows up in them.
"""

from __future__ import annotations

import json
from pathlib import Path

VOCAB = 1024
SPECIAL = ["<unk>", "<s>", "</s>"]


def build_tiny_llama(directory: Path, *, seed: int = 0, init_std: float = 0.3) -> Path:
    """Write ``config.json``, ``model.safetensors`` (bf16) and a tokenizer into ``directory``."""
    import torch
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    directory.mkdir(parents=True, exist_ok=True)
    if (directory / "model.safetensors").exists():
        return directory
    config = LlamaConfig(
        vocab_size=VOCAB,
        hidden_size=256,
        intermediate_size=512,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=64,
        max_position_embeddings=4096,
        rope_theta=10000.0,
        initializer_range=init_std,
        bos_token_id=1,
        eos_token_id=2,
        tie_word_embeddings=False,
        torch_dtype="bfloat16",
    )
    torch.manual_seed(seed)
    model = LlamaForCausalLM(config).to(torch.bfloat16)
    model.save_pretrained(directory, safe_serialization=True)

    words = SPECIAL + [f"w{i}" for i in range(VOCAB - len(SPECIAL))]
    tok = Tokenizer(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok, unk_token="<unk>", bos_token="<s>", eos_token="</s>"
    )
    fast.save_pretrained(directory)
    cfg = json.loads((directory / "tokenizer_config.json").read_text())
    cfg["add_bos_token"] = False
    cfg["chat_template"] = (
        "{% for m in messages %}{{ m['content'] }} {% endfor %}"
        "{% if add_generation_prompt %}w7 {% endif %}"
    )
    (directory / "tokenizer_config.json").write_text(json.dumps(cfg))
    return directory


def words(ids: list[int]) -> str:
    """The text whose word-level tokenization is ``ids`` (ids >= 3)."""
    return " ".join(f"w{i - len(SPECIAL)}" for i in ids)
