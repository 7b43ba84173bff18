"""``kv-size MODEL_DIR_OR_PRESET --tokens N``: KV-cache bytes of a context, per variant.

Original bytes per token = ``2 * layers * kv_heads * head_dim * dtype_bytes`` (K and V), read
from a Hugging Face ``config.json`` or a built-in preset. Variant sizes are the daemon's own
(:mod:`kvtierd.sizes`: kept-token count per method, KIVI int8/int4 with fp16 scale and zero per
group of 32), from the bottom layer kvtierctl may import (it may not import
``kvtierd.kernels``: the CLI stays gRPC-only and torch-free by contract).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from kvtierd.cli.exit_codes import CliError, ExitCode
from kvtierd.cli.output import Output, human_bytes
from kvtierd.errors import ConfigError
from kvtierd.policy_config import DEFAULT_METHODS, check_variant, load_policy
from kvtierd.sizes import DTYPE_ALIASES, DTYPE_BYTES, dtype_bytes, variant_kept_tokens
from kvtierd.sizes import variant_size_bytes as _variant_size_bytes
from kvtierd.variants import expand_variants

DEFAULT_VARIANTS = (*expand_variants(DEFAULT_METHODS, (1.0, 0.5, 0.2)), "int4")
DTYPES = (*DTYPE_BYTES, *DTYPE_ALIASES)


@dataclass(frozen=True, slots=True)
class ModelGeometry:
    """What sets a model's KV size; ``dtype`` as written in ``config.json``."""

    name: str
    num_layers: int
    num_kv_heads: int
    head_dim: int
    dtype: str = "bfloat16"

    @property
    def dtype_bytes(self) -> int:
        return dtype_bytes(self.dtype)

    @property
    def bytes_per_token(self) -> int:
        return 2 * self.num_layers * self.num_kv_heads * self.head_dim * self.dtype_bytes


# From each model's published config.json (bf16 weights and KV).
PRESETS = {
    g.name.lower(): g
    for g in (
        ModelGeometry("Llama-3.1-8B", num_layers=32, num_kv_heads=8, head_dim=128),
        ModelGeometry("Mistral-7B", num_layers=32, num_kv_heads=8, head_dim=128),
        ModelGeometry("Qwen2.5-14B", num_layers=48, num_kv_heads=8, head_dim=128),
        ModelGeometry("Qwen3-30B-A3B", num_layers=48, num_kv_heads=4, head_dim=128),
    )
}


def geometry(model: str, dtype: str | None = None) -> ModelGeometry:
    """A preset name (``org/`` prefix and case ignored) or a directory with ``config.json``."""
    path = Path(model)
    if path.is_dir() or path.name == "config.json":
        g = _from_config(path / "config.json" if path.is_dir() else path)
    elif model.rsplit("/", 1)[-1].lower() in PRESETS:
        g = PRESETS[model.rsplit("/", 1)[-1].lower()]
    else:
        known = ", ".join(p.name for p in PRESETS.values())
        raise CliError(
            ExitCode.INVALID,
            f"{model!r} is neither a model directory with config.json nor a preset ({known})",
        )
    if dtype:
        if dtype not in DTYPES:
            raise CliError(ExitCode.INVALID, f"--dtype {dtype!r}; allowed: {', '.join(DTYPES)}")
        g = ModelGeometry(g.name, g.num_layers, g.num_kv_heads, g.head_dim, dtype)
    return g


def _from_config(path: Path) -> ModelGeometry:
    try:
        raw: dict[str, Any] = json.loads(path.read_text())
    except (OSError, ValueError) as e:
        raise CliError(ExitCode.INVALID, f"cannot read {path}: {e}") from e
    cfg = raw.get("text_config") or raw  # multimodal configs nest the language model's
    try:
        layers = int(cfg["num_hidden_layers"])
        heads = int(cfg["num_attention_heads"])
        kv_heads = int(cfg.get("num_key_value_heads") or heads)
        head_dim = int(cfg.get("head_dim") or cfg["hidden_size"] // heads)
    except (KeyError, TypeError, ValueError) as e:
        raise CliError(
            ExitCode.INVALID,
            f"{path}: needs num_hidden_layers, num_attention_heads and head_dim or hidden_size "
            f"(num_key_value_heads optional): {e!r}",
        ) from e
    dtype = str(cfg.get("torch_dtype") or cfg.get("dtype") or raw.get("torch_dtype") or "bfloat16")
    if dtype not in DTYPES:
        raise CliError(ExitCode.INVALID, f"{path}: dtype {dtype!r} not one of {list(DTYPES)}")
    return ModelGeometry(path.parent.name, layers, kv_heads, head_dim, dtype)


def variant_bytes(g: ModelGeometry, num_tokens: int, variant: str) -> int:
    """Payload bytes of one context of ``num_tokens`` stored as ``variant``."""
    return _variant_size_bytes(
        g.num_layers, g.num_kv_heads, g.head_dim, num_tokens, g.dtype_bytes, variant
    )


def _variants(args: argparse.Namespace) -> tuple[str, ...]:
    try:
        if args.policy:
            return load_policy(args.policy).variants
        if args.variant:
            return tuple(dict.fromkeys(check_variant(v, "--variant") for v in args.variant))
    except ConfigError as e:
        raise CliError(ExitCode.INVALID, str(e)) from e
    return DEFAULT_VARIANTS


@dataclass(frozen=True, slots=True)
class VariantSize:
    variant: str
    kept_tokens: int
    size_bytes: int
    ratio: float  # of the original's bytes


def sizes(g: ModelGeometry, num_tokens: int, variants: tuple[str, ...]) -> list[VariantSize]:
    original = g.bytes_per_token * num_tokens
    out = []
    for v in variants:
        size = variant_bytes(g, num_tokens, v)
        out.append(VariantSize(v, variant_kept_tokens(num_tokens, v), size, size / original))
    return out


def run_kv_size(args: argparse.Namespace, out: Output) -> ExitCode:
    if args.tokens < 1:
        raise CliError(ExitCode.INVALID, f"--tokens must be >= 1, got {args.tokens}")
    g = geometry(args.model, args.dtype)
    rows = sizes(g, args.tokens, _variants(args))
    if out.as_json:
        out.json(
            {
                "model": g.name,
                "num_layers": g.num_layers,
                "num_kv_heads": g.num_kv_heads,
                "head_dim": g.head_dim,
                "dtype": g.dtype,
                "dtype_bytes": g.dtype_bytes,
                "tokens": args.tokens,
                "bytes_per_token": g.bytes_per_token,
                "variants": [dataclasses.asdict(r) for r in rows],
            }
        )
        return ExitCode.OK
    out.line(
        f"{g.name}: {g.num_layers} layers x {g.num_kv_heads} KV heads x {g.head_dim} head dim x "
        f"{g.dtype_bytes} B ({g.dtype}) x 2 (K, V) = {human_bytes(g.bytes_per_token)} per token"
    )
    out.table(
        f"{args.tokens} tokens",
        ("variant", "kept tokens", "bytes", "size", "of original"),
        [
            (r.variant, r.kept_tokens, r.size_bytes, human_bytes(r.size_bytes), f"{r.ratio:.1%}")
            for r in rows
        ],
    )
    return ExitCode.OK
