"""``kv-size MODEL_DIR_OR_PRESET --tokens N``: KV-cache bytes of a context, per variant.

Original bytes per token = ``2 * layers * kv_heads * head_dim * dtype_bytes`` (K and V), read
from a Hugging Face ``config.json`` or a built-in preset. Variant sizes follow the rules of
``kvtierd/kernels/variants.py`` (kept-token count per method, KIVI int8/int4 with fp16 scale and
zero per group of 32). kvtierctl may not import ``kvtierd.kernels`` (the CLI stays
gRPC-only and torch-free by contract), so the arithmetic is repeated here and
``tests/cli/test_kv_size.py`` holds it equal to ``variants.variant_size_bytes``.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from kvtierd.cli.exit_codes import CliError, ExitCode
from kvtierd.cli.output import Output, human_bytes
from kvtierd.errors import ConfigError
from kvtierd.policy_config import (
    DEFAULT_METHODS,
    DROP_METHOD_OPTIONS,
    check_variant,
    expand_variants,
    load_policy,
)

DTYPE_BYTES = {"float32": 4, "float": 4, "bfloat16": 2, "float16": 2, "half": 2,
               "float8_e4m3fn": 1, "float8_e5m2": 1, "fp8": 1}  # fmt: skip
DEFAULT_VARIANTS = (*expand_variants(DEFAULT_METHODS, (1.0, 0.5, 0.2)), "int4")

# Kept-count rules and quantization parameters of kvtierd.kernels.variants (module docstring).
_PAGE_METHODS = ("paged_eviction_block",)
_QUANT_BITS = {"int8": 8, "int4": 4}
_GROUP = 32
_SCALE_ZERO_BYTES = 4


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
        return DTYPE_BYTES[self.dtype]

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
        if dtype not in DTYPE_BYTES:
            raise CliError(
                ExitCode.INVALID, f"--dtype {dtype!r}; allowed: {', '.join(DTYPE_BYTES)}"
            )
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
    if dtype not in DTYPE_BYTES:
        raise CliError(ExitCode.INVALID, f"{path}: dtype {dtype!r} not one of {list(DTYPE_BYTES)}")
    return ModelGeometry(path.parent.name, layers, kv_heads, head_dim, dtype)


def kept_tokens(num_tokens: int, variant: str) -> int:
    """Kept count ``M`` of ``variant`` for ``num_tokens`` (kvtierd.kernels.variants, steps 1-4)."""
    drop = variant.partition("+")[0]
    method_text, at, ratio_text = drop.partition("@")
    if not at:
        return num_tokens
    n = num_tokens
    target = math.floor(float(ratio_text) * n + 0.5)
    method, *parts = method_text.split("-")
    if method not in _PAGE_METHODS:
        return max(target, 1)
    options = {o[0]: o[1] for o in DROP_METHOD_OPTIONS[method]}
    options |= {k: int(v) for k, _, v in (p.partition("=") for p in parts)}
    page = options["page"]
    if options["keep_ends"]:
        pages = -(-n // page)
        if pages <= 2:
            return n
        fixed, lowest, highest = page + (n - (pages - 1) * page), 0, pages - 2
    else:
        fixed, lowest, highest = n % page, (0 if n % page else 1), n // page
    extra = max(target - fixed, 0)
    return fixed + page * min(max((2 * extra + page) // (2 * page), lowest), highest)


def variant_bytes(g: ModelGeometry, num_tokens: int, variant: str) -> int:
    """Payload bytes of one context of ``num_tokens`` stored as ``variant``."""
    m = kept_tokens(num_tokens, variant)
    quant = variant.rpartition("+")[2] if "+" in variant else variant
    bits = _QUANT_BITS.get(quant, 0)
    lh = g.num_layers * g.num_kv_heads
    if not bits:
        return 2 * lh * m * g.head_dim * g.dtype_bytes
    codes = 2 * lh * m * (-(-g.head_dim * bits // 8))
    keys = lh * (-(-m // _GROUP)) * g.head_dim * _SCALE_ZERO_BYTES
    values = lh * m * (-(-g.head_dim // _GROUP)) * _SCALE_ZERO_BYTES
    return codes + keys + values


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
        out.append(VariantSize(v, kept_tokens(num_tokens, v), size, size / original))
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
