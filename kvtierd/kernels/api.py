"""What the daemon, the profiler and the LMCache plugin call: one variant in, one result out.

src = KVSource.from_contiguous(keys, values)          # or from_kv_2ltd / from_vllm_paged
out = compress_kv(src, "knorm@0.5+int8", rope=RopeSpec.standard(128))
keys, values = dense_kv(out)                           # dequantized [L, H, M, D]
chunk = to_kv_2ltd(keys, values)                       # LMCache's [2, L, M, H*D]
"""

from __future__ import annotations

import torch

from kvtierd.errors import InvalidArgumentError
from kvtierd.kernels.base import Backend, gather_kv
from kvtierd.kernels.layout import KVSource
from kvtierd.kernels.quant import dequantize, quantize_kv
from kvtierd.kernels.registry import get_method
from kvtierd.kernels.results import CompressedKV, KVTensor, QuantizedTensor
from kvtierd.kernels.rope import RopeSpec
from kvtierd.sizes import DEFAULT_GROUP_SIZE
from kvtierd.variants import Variant, as_variant


def compress_kv(
    source: KVSource,
    variant: Variant | str,
    *,
    queries: torch.Tensor | None = None,
    rope: RopeSpec | None = None,
    chunk_tokens: int = 1,
    group_size: int = DEFAULT_GROUP_SIZE,
    backend: Backend = "auto",
) -> CompressedKV:
    """Compress one context's KV into ``variant`` (``"none"``, ``"knorm@0.5"``, ``"int4"``,
    ``"snapkv@0.3+int8"``, ...). Token-dropping variants rotate the kept keys by ``M - N`` when
    ``rope`` is given (needed to load them into vLLM, DESIGN.md §1); ``queries`` are required by
    ``snapkv`` only. The result always owns fresh dense (or quantized) tensors."""
    if not isinstance(source, KVSource):
        raise InvalidArgumentError(f"source must be a KVSource, got {type(source).__name__}")
    v = as_variant(variant)
    if v.drops_tokens:
        dropped = get_method(v.method, v.options).compress(
            source, v.ratio, queries=queries, chunk_tokens=chunk_tokens, rope=rope, backend=backend
        )
        if not (
            isinstance(dropped.keys, torch.Tensor) and isinstance(dropped.values, torch.Tensor)
        ):
            raise TypeError("token-dropping methods return dense tensors")
        keys, values = dropped.keys, dropped.values
        kept, delta = dropped.kept, dropped.rope_delta
    else:
        n = source.num_tokens
        kept = torch.arange(n, dtype=torch.int32, device=source.device)
        kept = kept.expand(source.num_layers, source.num_kv_heads, n).contiguous()
        keys, values = gather_kv(source, kept, backend=backend)
        delta = 0
    out_k: KVTensor = keys
    out_v: KVTensor = values
    if v.quant:
        out_k, out_v = quantize_kv(keys, values, v.quant_bits, group_size, backend)
    return CompressedKV(
        keys=out_k,
        values=out_v,
        kept=kept,
        num_tokens=source.num_tokens,
        variant=str(v),
        rope_delta=delta,
    )


def compress_dense(
    keys: torch.Tensor,
    values: torch.Tensor,
    variant: Variant | str,
    *,
    queries: torch.Tensor | None = None,
    rope: RopeSpec | None = None,
    chunk_tokens: int = 1,
    group_size: int = DEFAULT_GROUP_SIZE,
    backend: Backend = "auto",
) -> CompressedKV:
    """:func:`compress_kv` on canonical ``[L, H, N, D]`` keys and values."""
    return compress_kv(
        KVSource.from_contiguous(keys, values),
        variant,
        queries=queries,
        rope=rope,
        chunk_tokens=chunk_tokens,
        group_size=group_size,
        backend=backend,
    )


def dense_kv(c: CompressedKV, backend: Backend = "auto") -> tuple[torch.Tensor, torch.Tensor]:
    """Dense ``[L, H, M, D]`` keys and values of a result (dequantizing when quantized)."""

    def one(t: KVTensor) -> torch.Tensor:
        return dequantize(t, backend) if isinstance(t, QuantizedTensor) else t

    return one(c.keys), one(c.values)


def to_kv_2ltd(keys: torch.Tensor, values: torch.Tensor) -> torch.Tensor:
    """``[L, H, M, D]`` keys and values -> LMCache ``KV_2LTD`` ``[2, L, M, H*D]`` (a copy)."""
    if keys.shape != values.shape or keys.dim() != 4:
        raise InvalidArgumentError(
            f"need equal [L, H, M, D] keys and values, got {tuple(keys.shape)}, "
            f"{tuple(values.shape)}"
        )
    kv = torch.stack([keys, values]).permute(0, 1, 3, 2, 4)
    return kv.reshape(2, keys.shape[0], keys.shape[2], keys.shape[1] * keys.shape[3])
