"""Variant names, kept-token counts and exact byte sizes — pure Python, no torch.

The placer, the daemon and the profiler need a variant's size without running a kernel, and
``kvtierd.policies`` must stay torch-free (DESIGN.md §3.2), so everything here is integer
arithmetic that a numpy port can copy line for line.

Variant string grammar (DESIGN.md §2, ratio = kept size / original size)::

    variant  := "none" | quant | drop | drop "+" quant
    drop     := method options "@" ratio      e.g. "knorm@0.5", "snapkv-window=32@0.25"
    options  := ("-" name "=" integer)*       the method's parameters (METHOD_OPTIONS)
    quant    := "int8" | "int4"               e.g. "int4", "snapkv@0.3+int8"

Method options set a method's parameters in the variant name itself, so the name alone says
how a stored object was made (the daemon, the router, the profiler and the size formulas all
read the same string). Options are written in ``METHOD_OPTIONS`` order, each at most once,
and only when they differ from the default: every variant has one spelling
(``snapkv-window=64@0.5`` is refused — that is ``snapkv@0.5``).

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

import math
from collections.abc import Mapping
from dataclasses import dataclass
from types import MappingProxyType

ORIGINAL = "none"
QUANT_BITS: MappingProxyType[str, int] = MappingProxyType({"int8": 8, "int4": 4})
DEFAULT_GROUP_SIZE = 32
SCALE_ZERO_BYTES = 4  # fp16 scale + fp16 zero per quantization group


@dataclass(frozen=True, slots=True)
class MethodOption:
    """An integer parameter of a token-dropping method, set in a variant name (``-name=value``).

    Allowed values: ``minimum + step * k`` for ``k >= 0``, up to ``maximum`` when one is set.
    """

    name: str
    default: int
    minimum: int
    maximum: int | None = None
    step: int = 1
    doc: str = ""

    def check(self, value: int) -> str:
        """``""`` when ``value`` is allowed, else why not."""
        too_big = self.maximum is not None and value > self.maximum
        if value < self.minimum or too_big or (value - self.minimum) % self.step:
            return f"{self.name}={value} is not allowed; {self.allowed()}"
        return ""

    def allowed(self) -> str:
        top = f" and <= {self.maximum}" if self.maximum is not None else ""
        odd = ", odd" if self.step == 2 and self.minimum % 2 else ""
        return (
            f"{self.name} must be an integer >= {self.minimum}{top}{odd} (default {self.default})"
        )


METHOD_OPTIONS: MappingProxyType[str, tuple[MethodOption, ...]] = MappingProxyType(
    {
        "knorm": (),
        "keydiff": (),
        "snapkv": (
            MethodOption("window", 64, 1, doc="observation window: queries of the last tokens"),
            MethodOption("pool", 5, 1, step=2, doc="avg-pool width (kvpress kernel_size), odd"),
        ),
        "paged_eviction": (
            MethodOption("sinks", 0, 0, doc="first tokens always kept (0: the paper's rule)"),
        ),
        "paged_eviction_block": (
            MethodOption("page", 16, 1, doc="tokens per page"),
            MethodOption("keep_ends", 0, 0, 1, doc="1: the first and last page always stay"),
        ),
        "streamingllm": (MethodOption("sinks", 4, 0, doc="first tokens always kept"),),
    }
)
"""Each token-dropping method's options, in the order a variant name writes them; the method's
constructor takes them as keyword arguments of the same names."""


def option_default(method: str, name: str) -> int:
    """The default value of ``method``'s option ``name``."""
    return next(o.default for o in METHOD_OPTIONS[method] if o.name == name)


@dataclass(frozen=True, slots=True)
class CountRule:
    """How a token-dropping method turns a ratio into a kept count (see module docstring).

    ``page_tokens`` > 0 makes the method keep whole pages of that many tokens; ``keep_ends``
    makes the first and the last page always stay (rule 4).
    """

    page_tokens: int = 0
    keep_ends: bool = False


COUNT_RULES: MappingProxyType[str, CountRule] = MappingProxyType(
    {
        "knorm": CountRule(),
        "keydiff": CountRule(),
        "snapkv": CountRule(),
        "paged_eviction": CountRule(),
        "paged_eviction_block": CountRule(page_tokens=16),
        "streamingllm": CountRule(),
    }
)
"""Count rules of the registered token-dropping methods at their default options."""

Options = tuple[tuple[str, int], ...]
"""A variant's method options: ``(name, value)`` pairs in ``METHOD_OPTIONS`` order, defaults
left out."""


def count_rule(method: str, options: Options = ()) -> CountRule:
    """The count rule of ``method`` with ``options`` (only page methods have options that
    change the count)."""
    rule = COUNT_RULES.get(method, CountRule())
    if not rule.page_tokens:
        return rule
    values = dict(options)
    return CountRule(
        page_tokens=values.get("page", rule.page_tokens),
        keep_ends=bool(values.get("keep_ends", rule.keep_ends)),
    )


def canonical_options(method: str, values: Mapping[str, int]) -> Options:
    """Check ``values`` against ``METHOD_OPTIONS[method]`` and return them in canonical form
    (schema order, defaults left out); raises ``ValueError`` naming the bad option."""
    schema = {o.name: o for o in METHOD_OPTIONS.get(method, ())}
    for name, value in values.items():
        if name not in schema:
            known = ", ".join(schema) or "none"
            raise ValueError(f"{method} has no option {name!r}; its options: {known}")
        if isinstance(value, bool) or not isinstance(value, int):
            raise ValueError(f"{method} option {name} must be an integer, got {value!r}")
        if why := schema[name].check(value):
            raise ValueError(f"{method}: {why}")
    return tuple(
        (o.name, values[o.name])
        for o in schema.values()
        if values.get(o.name, o.default) != o.default
    )


@dataclass(frozen=True, slots=True)
class Variant:
    """A parsed variant: an optional token-dropping step, then an optional quantization."""

    method: str = ORIGINAL
    ratio: float = 1.0
    quant: str = ""
    options: Options = ()

    @property
    def drops_tokens(self) -> bool:
        return self.method != ORIGINAL

    @property
    def quant_bits(self) -> int:
        """8 or 4 for a quantized variant, 0 for none."""
        return QUANT_BITS.get(self.quant, 0)

    @property
    def count_rule(self) -> CountRule:
        return count_rule(self.method, self.options)

    def __str__(self) -> str:
        opts = "".join(f"-{k}={v}" for k, v in self.options)
        drop = f"{self.method}{opts}@{self.ratio:g}" if self.drops_tokens else ""
        if drop and self.quant:
            return f"{drop}+{self.quant}"
        return drop or self.quant or ORIGINAL


def _bad(text: str, why: str) -> ValueError:
    methods = ", ".join(sorted(COUNT_RULES))
    quants = ", ".join(QUANT_BITS)
    return ValueError(
        f"bad variant {text!r}: {why}; expected 'none', '<method>@<ratio>', '<quant>' or "
        f"'<method>@<ratio>+<quant>' with method in [{methods}], quant in [{quants}], "
        "0 < ratio <= 1, and method options as '<method>-<option>=<integer>' (docs/kernels.md)"
    )


def _parse_options(text: str, method: str, written: list[str]) -> Options:
    """``written`` = the ``name=value`` parts after the method name."""
    values: dict[str, int] = {}
    for part in written:
        name, eq, value = part.partition("=")
        if not eq or not value.isdigit() or str(int(value)) != value:
            raise _bad(text, f"option {part!r} is not '<name>=<integer>'")
        if name in values:
            raise _bad(text, f"option {name!r} given twice")
        values[name] = int(value)
    try:
        options = canonical_options(method, values)
    except ValueError as e:
        raise _bad(text, str(e)) from e
    order = [o.name for o in METHOD_OPTIONS[method]]
    if list(values) != [n for n in order if n in values]:
        raise _bad(text, f"write {method}'s options in the order {', '.join(order)}")
    if len(options) != len(values):
        defaults = [n for n in values if n not in dict(options)]
        raise _bad(text, f"{', '.join(defaults)} at the default: leave it out")
    return options


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
    method_text, at, ratio_text = drop.partition("@")
    if method_text == ORIGINAL and not at:
        return Variant(quant=quant)
    method, *written = method_text.split("-")
    if method not in COUNT_RULES:
        raise _bad(text, f"unknown method {method!r}")
    options = _parse_options(text, method, written)
    if not at:
        raise _bad(text, f"method {method!r} needs a ratio ('{method_text}@0.5')")
    try:
        ratio = float(ratio_text)
    except ValueError as e:
        raise _bad(text, f"ratio {ratio_text!r} is not a number") from e
    if not (0.0 < ratio <= 1.0) or math.isnan(ratio):
        raise _bad(text, f"ratio {ratio_text!r} is outside (0, 1]")
    return Variant(method=method, ratio=ratio, quant=quant, options=options)


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
