"""A tiny random-weight Llama built locally (tests and benchmarks; nothing is downloaded)."""

from __future__ import annotations

from pathlib import Path


def build_tiny_llama(
    path: Path, *, layers: int = 2, hidden: int = 64, init_range: float = 0.15
) -> Path:
    """Save a Llama (4 query heads, 2 KV heads, head dim ``hidden / 4``) with MiniLM's WordPiece
    tokenizer into ``path``, laid out as any Hugging Face model directory."""
    import torch
    from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

    from kvtierd.profiler.embedder import minilm_path

    tok = AutoTokenizer.from_pretrained(minilm_path(), local_files_only=True)
    cfg = LlamaConfig(
        vocab_size=len(tok),
        hidden_size=hidden,
        intermediate_size=2 * hidden,
        num_hidden_layers=layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=8192,
        initializer_range=init_range,
        bos_token_id=tok.cls_token_id,
        eos_token_id=tok.sep_token_id,
        pad_token_id=tok.pad_token_id,
    )
    torch.manual_seed(0)
    LlamaForCausalLM(cfg).eval().save_pretrained(path)
    tok.save_pretrained(path)
    return path
