"""Variant names, kept-token counts and exact byte sizes — pure Python, no torch.

The placer, the daemon and the profiler need a variant's size without running a kernel, and
``kvtierd.policies`` must stay torch-free (DESIGN.md §3.2), so everything here is integer
arithmetic that a numpy port can copy line for line.

Variant string grammar (DESIGN.md §2, ratio = kept size / original size)::

    variant  := "none" | quant | drop | drop "+" quant
    drop     := method "@" ratio          e.g. "knorm@0.5", "paged_eviction_block@0.25"
    quant    := "int8" | "int4"           e.g. "int4", "snapkv@0.3+int8"

Kept count ``M`` for ``N`` tokens (same ``M`` in every layer and KV head):

1. ``M = floor(ratio * N + 0.5)`` (round half up, never Python's banker's rounding);
2. with ``chunk_tokens = C > 1`` and ``M < N``: ``M = C * floor(M / C + 0.5)``, at least ``C``,
   at most ``N`` (``M = N`` — ratio 1.0 — is the identity and is never rounded);
3. ``M = max(M, min(min_kept, N), 1)`` — ``min_kept`` is the method's always-kept tokens
   (snapkv's query window, streamingllm's sinks), so tiny ratios keep at least those;
4. page methods (``paged_eviction_block``, page size ``B``): whole pages are kept or dropped and
   the first and the last (possibly partial) page always stay; with ``P = ceil(N / B)`` pages and
   ``F`` tokens in the first + last page, ``M = F + B * k`` where ``k`` is the number of middle
   pages nearest to ``(round(ratio * N) - F) / B``, clamped to ``[0, P - 2]``. ``chunk_tokens``
   does not apply to page methods (the page is the chunk).

Byte size of a variant (payload only: the tensors a stored object holds; kept indices are
metadata, ``4 * L * H * M`` bytes as int32 when a caller stores them)::

    unquantized:  2 * L * H * M * D * dtype_bytes
    int8 / int4 (b bits, group G, fp16 scale and zero = 2 + 2 bytes per group):
        codes   2 * L * H * M * ceil(D * b / 8)
        keys    L * H * ceil(M / G) * D * 4        (per channel, groups of G tokens)
        values  L * H * M * ceil(D / G) * 4        (per token, groups of G channels)
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from types import MappingProxyType

ORIGINAL = "none"
QUANT_BITS: MappingProxyType[str, int] = MappingProxyType({"int8": 8, "int4": 4})
DEFAULT_GROUP_SIZE = 32
SCALE_ZERO_BYTES = 4  # fp16 scale + fp16 zero per quantization group


@dataclass(frozen=True, slots=True)
class CountRule:
    """How a token-dropping method turns a ratio into a kept count (see module docstring).

    ``min_kept`` tokens are always kept (snapkv window, streamingllm sinks); ``page_tokens`` > 0
    makes the method keep whole pages of that many tokens.
    """

    min_kept: int = 0
    page_tokens: int = 0


COUNT_RULES: MappingProxyType[str, CountRule] = MappingProxyType(
    {
        "knorm": CountRule(),
        "keydiff": CountRule(),
        "snapkv": CountRule(min_kept=64),
        "paged_eviction": CountRule(),
        "paged_eviction_block": CountRule(page_tokens=16),
        "streamingllm": CountRule(min_kept=4),
    }
)
"""Count rules of the registered token-dropping methods at their default parameters."""


@dataclass(frozen=True, slots=True)
class Variant:
    """A parsed variant: an optional token-dropping step, then an optional quantization."""

    method: str = ORIGINAL
    ratio: float = 1.0
    quant: str = ""

    @property
    def drops_tokens(self) -> bool:
        return self.method != ORIGINAL

    @property
    def quant_bits(self) -> int:
        """8 or 4 for a quantized variant, 0 for none."""
        return QUANT_BITS.get(self.quant, 0)

    def __str__(self) -> str:
        drop = f"{self.method}@{self.ratio:g}" if self.drops_tokens else ""
        if drop and self.quant:
            return f"{drop}+{self.quant}"
        return drop or self.quant or ORIGINAL


def _bad(text: str, why: str) -> ValueError:
    methods = ", ".join(sorted(COUNT_RULES))
    quants = ", ".join(QUANT_BITS)
    return ValueError(
        f"bad variant {text!r}: {why}; expected 'none', '<method>@<ratio>', '<quant>' or "
        f"'<method>@<ratio>+<quant>' with method in [{methods}], quant in [{quants}], "
        "0 < ratio <= 1"
    )


def parse_variant(text: str) -> Variant:
    """Parse ``"knorm@0.5+int8"``-style strings; raises ``ValueError`` naming what is wrong."""
    if not isinstance(text, str) or not text.strip():
        raise _bad(str(text), "empty")
    s = text.strip()
    if s == ORIGINAL:
        return Variant()
    drop, plus, quant = s.partition("+")
    if not plus and drop in QUANT_BITS:
        return Variant(quant=drop)
    if plus and quant not in QUANT_BITS:
        raise _bad(text, f"unknown quantization {quant!r}")
    method, at, ratio_text = drop.partition("@")
    if method == ORIGINAL and not at:
        return Variant(quant=quant)
    if method not in COUNT_RULES:
        raise _bad(text, f"unknown method {method!r}")
    if not at:
        raise _bad(text, f"method {method!r} needs a ratio ('{method}@0.5')")
    try:
        ratio = float(ratio_text)
    except ValueError as e:
        raise _bad(text, f"ratio {ratio_text!r} is not a number") from e
    if not (0.0 < ratio <= 1.0) or math.isnan(ratio):
        raise _bad(text, f"ratio {ratio_text!r} is outside (0, 1]")
    return Variant(method=method, ratio=ratio, quant=quant)


def as_variant(variant: Variant | str) -> Variant:
    return variant if isinstance(variant, Variant) else parse_variant(variant)


def _round_half_up(x: float) -> int:
    return math.floor(x + 0.5)


def kept_token_count(
    num_tokens: int,
    ratio: float,
    *,
    chunk_tokens: int = 1,
    rule: CountRule = CountRule(),
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
        return _page_count(n, target, rule.page_tokens)
    m = target
    if chunk_tokens > 1 and m < n:  # M = N (ratio 1.0) stays the identity
        m = min(max(chunk_tokens * _round_half_up(m / chunk_tokens), chunk_tokens), n)
    return max(m, min(rule.min_kept, n), 1)


def _page_count(n: int, target: int, page: int) -> int:
    pages = -(-n // page)
    if pages <= 2:
        return n
    forced = page + (n - (pages - 1) * page)
    extra = max(target - forced, 0)
    middle = min((2 * extra + page) // (2 * page), pages - 2)
    return forced + middle * page


def variant_kept_tokens(num_tokens: int, variant: Variant | str, *, chunk_tokens: int = 1) -> int:
    """Kept count of ``variant`` at the registered methods' default parameters."""
    v = as_variant(variant)
    if not v.drops_tokens:
        return num_tokens
    return kept_token_count(
        num_tokens, v.ratio, chunk_tokens=chunk_tokens, rule=COUNT_RULES[v.method]
    )


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
