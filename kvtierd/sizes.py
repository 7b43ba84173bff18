"""Kept-token counts, exact byte sizes of variants and dtype widths — pure Python, no torch.

The placer, the daemon, the profiler, kvtierctl (``kv-size``) and object validation need sizes
without running a kernel, and neither ``kvtierd.policies`` nor kvtierctl may import torch or
``kvtierd.kernels`` (DESIGN.md §3.2), so everything here is integer arithmetic in the bottom
layer; ``tests/kernels/test_kernels_variants.py`` holds it equal to the bytes the kernels
produce. Variant names: :mod:`kvtierd.variants`.

Kept count ``M`` for ``N`` tokens (same ``M`` in every layer and KV head):

1. ``M = floor(ratio * N + 0.5)`` (round half up, never Python's banker's rounding);
2. with ``chunk_tokens = C > 1`` and ``M < N``: ``M = C * floor(M / C + 0.5)``, at least ``C``,
   at most ``N`` (``M = N`` — ratio 1.0 — is the identity and is never rounded);
3. ``M = max(M, 1)``: exactly the count asked for, also below snapkv's window or streamingllm's
   sinks (as kvpress does);
4. page methods (``paged_eviction_block``, page size ``B``): whole pages are kept or dropped.
   ``N = B * P + r``: the ``r`` trailing tokens are not a full page yet (the page vLLM is still
   filling; PagedEviction evicts only once the last page is full) and always stay, and ``k``
   of the ``P`` full pages are kept, ``k`` nearest to ``(round(ratio * N) - r) / B`` within
   ``[1 if r == 0 else 0, P]``: ``M = r + B * k``. With ``keep_ends=1`` the first and the last
   (possibly partial) page always stay instead: ``F`` = their tokens, ``M = F + B * k``, ``k``
   nearest to ``(round(ratio * N) - F) / B`` within ``[0, ceil(N / B) - 2]``.
   ``chunk_tokens`` does not apply to page methods (the page is the chunk).

Byte size of a variant (payload only: the tensors a stored object holds; kept indices are
metadata, ``4 * L * H * M`` bytes as int32 when a caller stores them)::

    unquantized:  2 * L * H * M * D * dtype_bytes
    int8 / int4 (b bits, group G, fp16 scale and zero = 2 + 2 bytes per group):
        codes   2 * L * H * M * ceil(D * b / 8)
        keys    L * H * ceil(M / G) * D * 4        (per channel, groups of G tokens)
        values  L * H * M * ceil(D / G) * 4        (per token, groups of G channels)
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass
from types import MappingProxyType

from kvtierd.variants import CountRule, Variant, as_variant

DEFAULT_GROUP_SIZE = 32
SCALE_ZERO_BYTES = 4  # fp16 scale + fp16 zero per quantization group

DTYPE_BYTES: MappingProxyType[str, int] = MappingProxyType(
    {
        "uint8": 1, "int8": 1, "bool": 1, "float8_e4m3fn": 1, "float8_e5m2": 1,
        "float16": 2, "bfloat16": 2, "int16": 2,
        "float32": 4, "int32": 4, "uint32": 4,
        "float64": 8, "int64": 8,
    }
)  # fmt: skip
"""Bytes per element of each dtype an object or a model's KV may have (torch's names)."""

DTYPE_ALIASES: MappingProxyType[str, str] = MappingProxyType(
    {"float": "float32", "half": "float16", "fp8": "float8_e4m3fn"}
)
"""Other spellings a model's ``config.json`` (torch aliases) or vLLM's ``kv_cache_dtype``
(``fp8``) use for a dtype of :data:`DTYPE_BYTES`."""


def dtype_bytes(name: str) -> int:
    """Bytes per element of dtype ``name`` (an alias of :data:`DTYPE_ALIASES` allowed);
    raises ``ValueError`` listing the known names."""
    width = DTYPE_BYTES.get(DTYPE_ALIASES.get(name, name))
    if width is None:
        known = ", ".join([*DTYPE_BYTES, *DTYPE_ALIASES])
        raise ValueError(f"unknown dtype {name!r}; known: {known}")
    return width


TOKEN_RULE = CountRule()
"""The count rule of a method that keeps single tokens (rules 1-3)."""


def _round_half_up(x: float) -> int:
    return math.floor(x + 0.5)


def kept_token_count(
    num_tokens: int,
    ratio: float,
    *,
    chunk_tokens: int = 1,
    rule: CountRule = TOKEN_RULE,
) -> int:
    """``M`` for ``N`` tokens under ``rule`` (module docstring, steps 1-4)."""
    if num_tokens < 1:
        raise ValueError(f"num_tokens must be >= 1, got {num_tokens}")
    if not (0.0 < ratio <= 1.0):
        raise ValueError(f"ratio must be in (0, 1], got {ratio}")
    if chunk_tokens < 1:
        raise ValueError(f"chunk_tokens must be >= 1, got {chunk_tokens}")
    n = num_tokens
    target = _round_half_up(ratio * n)
    if rule.page_tokens > 0:
        if chunk_tokens != 1:
            raise ValueError(
                f"chunk_tokens={chunk_tokens} does not apply to a page method (pages of "
                f"{rule.page_tokens} tokens); pass chunk_tokens=1"
            )
        return _page_count(n, target, rule.page_tokens, rule.keep_ends)
    m = target
    if chunk_tokens > 1 and m < n:  # M = N (ratio 1.0) stays the identity
        m = min(max(chunk_tokens * _round_half_up(m / chunk_tokens), chunk_tokens), n)
    return max(m, 1)


def _page_count(n: int, target: int, page: int, keep_ends: bool) -> int:
    """Rule 4: the always-kept tokens plus the whole pages nearest to the rest of ``target``."""
    if keep_ends:
        pages = -(-n // page)
        if pages <= 2:
            return n
        fixed, lowest, highest = page + (n - (pages - 1) * page), 0, pages - 2
    else:
        fixed, highest = n % page, n // page
        lowest = 0 if fixed else 1
    extra = max(target - fixed, 0)
    return fixed + page * min(max((2 * extra + page) // (2 * page), lowest), highest)


def count_unit(variant: Variant | str, chunk_tokens: int) -> int:
    """What a variant's kept count is rounded to when it is stored in chunks of
    ``chunk_tokens``: whole chunks, or single tokens for a page method, whose count rule keeps
    whole pages itself (rule 4)."""
    return 1 if as_variant(variant).count_rule.page_tokens else chunk_tokens


def variant_kept_tokens(num_tokens: int, variant: Variant | str, *, chunk_tokens: int = 1) -> int:
    """Kept count of ``variant`` (its method options included)."""
    v = as_variant(variant)
    if not v.drops_tokens:
        return num_tokens
    return kept_token_count(num_tokens, v.ratio, chunk_tokens=chunk_tokens, rule=v.count_rule)


def quantized_size_bytes(  # noqa: PLR0917 - the formula's six dimensions
    num_layers: int, num_kv_heads: int, head_dim: int, num_tokens: int, bits: int, group_size: int
) -> int:
    """Bytes of KIVI-quantized K and V of ``num_tokens`` tokens (module docstring)."""
    lh = num_layers * num_kv_heads
    codes = 2 * lh * num_tokens * (-(-head_dim * bits // 8))
    key_params = lh * (-(-num_tokens // group_size)) * head_dim * SCALE_ZERO_BYTES
    value_params = lh * num_tokens * (-(-head_dim // group_size)) * SCALE_ZERO_BYTES
    return codes + key_params + value_params


def variant_size_bytes(  # noqa: PLR0917 - the signature the policies call
    num_layers: int,
    num_kv_heads: int,
    head_dim: int,
    num_tokens: int,
    dtype_bytes: int,
    variant: Variant | str,
    *,
    chunk_tokens: int = 1,
    group_size: int = DEFAULT_GROUP_SIZE,
) -> int:
    """Exact payload bytes of one context's KV stored as ``variant`` (module docstring).

    Equals ``CompressedKV.payload_bytes`` of what ``kvtierd.kernels.api.compress_kv`` returns
    for the same arguments (a test holds the two together).
    """
    for name, val in (
        ("num_layers", num_layers),
        ("num_kv_heads", num_kv_heads),
        ("head_dim", head_dim),
        ("num_tokens", num_tokens),
        ("dtype_bytes", dtype_bytes),
        ("group_size", group_size),
    ):
        if val < 1:
            raise ValueError(f"{name} must be >= 1, got {val}")
    v = as_variant(variant)
    m = variant_kept_tokens(num_tokens, v, chunk_tokens=chunk_tokens)
    if v.quant:
        return quantized_size_bytes(num_layers, num_kv_heads, head_dim, m, v.quant_bits, group_size)
    return 2 * num_layers * num_kv_heads * m * head_dim * dtype_bytes


@dataclass(frozen=True, slots=True)
class KvGeometry:
    """What a context's variant sizes depend on besides the variant: its KV's shape
    (``num_layers`` x ``num_kv_heads`` x ``num_tokens`` x ``head_dim``, ``dtype_bytes`` each)
    and the chunks it is stored in (``chunk_tokens`` tokens; a kept count is rounded to them)."""

    num_layers: int
    num_kv_heads: int
    head_dim: int
    num_tokens: int
    dtype_bytes: int
    chunk_tokens: int = 1


@functools.lru_cache(maxsize=1 << 16)
def grid_size_bytes(geometry: KvGeometry, variants: tuple[str, ...]) -> tuple[int, ...]:
    """:func:`variant_size_bytes` of each of ``variants`` for a context of ``geometry``, stored
    in its chunks (:func:`count_unit`). Cached: contexts of the same shape (the same token
    count, say) share one computation, and a context's options ask for it again whenever they
    are rebuilt (a rebalance of 100,000 contexts x 60 variants sized 6 million variants)."""
    g = geometry
    shape = (g.num_layers, g.num_kv_heads, g.head_dim, g.num_tokens, g.dtype_bytes)
    return tuple(
        variant_size_bytes(*shape, name, chunk_tokens=count_unit(name, g.chunk_tokens))
        for name in variants
    )
