"""The variant grammar: how a context's forms are named, parsed once for every layer.

The placer, the daemon, the router, the LMCache plugin, the profiler, kvtierctl and the
simulator all read variant names, and kvtierctl and the simulator may not import
``kvtierd.kernels``, so the grammar lives in the bottom layer (DESIGN.md §3.2) as pure Python.
Kept counts and byte sizes of a parsed variant: :mod:`kvtierd.sizes`.

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

A policy's *grid* names methods without a ratio (``knorm``, ``int8``, ``knorm+int8``,
``snapkv-window=32``) and expands them over its ratios (:func:`expand_variants`); a
token-dropping step at ratio 1.0 keeps every token and is left out of a name there
(:meth:`Variant.canonical`).
"""

from __future__ import annotations

import functools
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace
from types import MappingProxyType

from kvtierd.types import ORIGINAL_VARIANT

QUANT_BITS: MappingProxyType[str, int] = MappingProxyType({"int8": 8, "int4": 4})


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
    """How a token-dropping method turns a ratio into a kept count (:mod:`kvtierd.sizes`).

    ``page_tokens`` > 0 makes the method keep whole pages of that many tokens; ``keep_ends``
    makes the first and the last page always stay.
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
"""The token-dropping methods (their names are the grammar's) and their count rules at their
default options."""

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

    method: str = ORIGINAL_VARIANT
    ratio: float = 1.0
    quant: str = ""
    options: Options = ()

    @property
    def drops_tokens(self) -> bool:
        return self.method != ORIGINAL_VARIANT

    @property
    def quant_bits(self) -> int:
        """8 or 4 for a quantized variant, 0 for none."""
        return QUANT_BITS.get(self.quant, 0)

    @property
    def count_rule(self) -> CountRule:
        return count_rule(self.method, self.options)

    @property
    def drop_method(self) -> str:
        """The token-dropping step as a grid names it, options included
        (``snapkv-window=32``); ``""`` when no token is dropped."""
        opts = "".join(f"-{k}={v}" for k, v in self.options)
        return f"{self.method}{opts}" if self.drops_tokens else ""

    @property
    def method_name(self) -> str:
        """The name without its ratio: ``knorm+int8`` for ``knorm@0.5+int8``, ``int8``,
        ``none`` (metrics labels and the simulator's groups)."""
        if not self.drops_tokens:
            return self.quant or ORIGINAL_VARIANT
        return f"{self.drop_method}+{self.quant}" if self.quant else self.drop_method

    def canonical(self) -> Variant:
        """The same form under its one name: a token-dropping step at ratio 1.0 keeps every
        token and is left out (``knorm@1+int8`` is ``int8``)."""
        return Variant(quant=self.quant) if self.drops_tokens and self.ratio >= 1.0 else self

    def __str__(self) -> str:
        drop = f"{self.drop_method}@{self.ratio:g}" if self.drops_tokens else ""
        if drop and self.quant:
            return f"{drop}+{self.quant}"
        return drop or self.quant or ORIGINAL_VARIANT


def allowed_text() -> str:
    """What the grammar allows, for error messages."""
    methods = ", ".join(sorted(COUNT_RULES))
    quants = ", ".join(QUANT_BITS)
    return (
        f"expected 'none', '<method>@<ratio>', '<quant>' or '<method>@<ratio>+<quant>' with "
        f"method in [{methods}], quant in [{quants}], 0 < ratio <= 1, and method options as "
        "'<method>-<option>=<integer>' (docs/kernels.md)"
    )


def _bad(text: str, why: str) -> ValueError:
    return ValueError(f"bad variant {text!r}: {why}; {allowed_text()}")


def parse_drop_method(text: str) -> tuple[str, Options]:
    """``"snapkv-window=32"`` -> ``("snapkv", (("window", 32),))``; raises ``ValueError``
    saying why for an unknown method or an option that is unknown, out of range, at its
    default, given twice or out of order."""
    method, *written = text.split("-")
    if method not in COUNT_RULES:
        known = ", ".join(sorted(COUNT_RULES))
        raise ValueError(f"unknown method {method!r}; token-dropping methods: {known}")
    values: dict[str, int] = {}
    for part in written:
        name, eq, value = part.partition("=")
        if not eq or not value.isdigit() or str(int(value)) != value:
            raise ValueError(f"option {part!r} is not '<name>=<integer>'")
        if name in values:
            raise ValueError(f"option {name!r} given twice")
        values[name] = int(value)
    options = canonical_options(method, values)
    order = [o.name for o in METHOD_OPTIONS[method]]
    if list(values) != [n for n in order if n in values]:
        raise ValueError(f"write {method}'s options in the order {', '.join(order)}")
    if len(options) != len(values):
        defaults = [n for n in values if n not in dict(options)]
        raise ValueError(f"{', '.join(defaults)} at the default: leave it out")
    return method, options


def parse_variant(text: str) -> Variant:
    """Parse ``"knorm@0.5+int8"``-style strings; raises ``ValueError`` naming what is wrong.

    Parsed once per name (a :class:`Variant` is immutable, so every caller may share it): the
    placer's options size every variant of every context, and a grid names a few dozen."""
    if not isinstance(text, str) or not text.strip():
        raise _bad(str(text), "empty")
    return _parse_cached(text)


@functools.lru_cache(maxsize=4096)
def _parse_cached(text: str) -> Variant:
    s = text.strip()
    if s == ORIGINAL_VARIANT:
        return Variant()
    drop, plus, quant = s.partition("+")
    if not plus and drop in QUANT_BITS:
        return Variant(quant=drop)
    if plus and quant not in QUANT_BITS:
        raise _bad(text, f"unknown quantization {quant!r}")
    method_text, at, ratio_text = drop.partition("@")
    if method_text == ORIGINAL_VARIANT and not at:
        return Variant(quant=quant)
    try:
        method, options = parse_drop_method(method_text)
    except ValueError as e:
        raise _bad(text, str(e)) from e
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


def parse_grid_method(text: str) -> Variant:
    """A grid method (a token-dropping method with its options, a quantization, or
    ``<drop>+<quant>``) as a variant at ratio 1.0; raises ``ValueError`` saying why not."""
    drop, plus, quant = text.partition("+")
    if drop in QUANT_BITS and not plus:
        return Variant(quant=drop)
    if drop.split("-")[0] not in COUNT_RULES or (plus and quant not in QUANT_BITS):
        raise ValueError(
            f"unknown method {text!r}; allowed values: {', '.join(sorted(COUNT_RULES))}, "
            f"{', '.join(QUANT_BITS)} or <drop method>+<quantization> (e.g. knorm+int8)"
        )
    try:
        method, options = parse_drop_method(drop)
    except ValueError as e:
        raise ValueError(
            f"bad method {text!r}: {e} (method options are written <method>-<option>=<integer>, "
            "e.g. snapkv-window=32; docs/kernels.md)"
        ) from e
    return Variant(method=method, quant=quant, options=options)


def expand_variants(methods: Sequence[str], ratios: Sequence[float]) -> tuple[str, ...]:
    """The grid of variant names: ``"none"`` first, then each method at each ratio.

    A token-dropping method at ratio 1.0 is the original (or the bare quantization when composed
    with one); a quantization alone ignores the ratios. Duplicates are removed, order kept.
    Raises ``ValueError`` for a method :func:`parse_grid_method` refuses.
    """
    out: dict[str, None] = {ORIGINAL_VARIANT: None}
    for m in methods:
        base = parse_grid_method(m)
        for ratio in ratios if base.drops_tokens else (1.0,):
            out[str(replace(base, ratio=ratio).canonical())] = None
    return tuple(out)
