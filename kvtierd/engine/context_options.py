"""What the placer is offered for each context (EvicPress §4.1, §4.2): the variants it can be
stored as, with exact sizes and, once profiled, quality and restore cost; what recomputing it
costs; how often it is read. Worked out from the context's sources (``ContextIndex.sources``),
the running policy's grid, what can be served (``servable.py``) and the profiler's records.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

from kvtierd.engine.index import ContextIndex
from kvtierd.engine.servable import Servability, ServableForm
from kvtierd.engine.state import ContextRecord, RunningPolicy
from kvtierd.errors import CorruptObjectError, InvalidArgumentError
from kvtierd.kernels.chunk_codec import ChunkFormat
from kvtierd.sizes import KvGeometry, dtype_bytes, grid_size_bytes
from kvtierd.types import ORIGINAL_VARIANT, ObjectMeta, VariantProfile
from kvtierd.variants import parse_variant

if TYPE_CHECKING:
    from kvtierd.profiler import Profiler, StoredForm

UNKNOWN_PREFILL_S = 60.0
"""Recompute cost assumed for a context of unknown length (documented in docs/daemon.md)."""
NO_LAYOUT = "no chunk layout: placed as stored, not profiled"  # what happens to opaque objects

Geometry = tuple[ChunkFormat | None, int, int]
"""Chunk format, token count and original bytes of a context's sources."""


@dataclass(frozen=True, slots=True)
class GridRow:
    """A context's options as columns: variant names, exact sizes, quality (0 until profiled)
    and restore seconds, in the order the placer is offered them."""

    names: tuple[str, ...]
    size_bytes: tuple[int, ...]
    quality: tuple[float, ...]
    restore_s: tuple[float, ...]


class ContextOptions:
    """The options of the contexts of ``index`` under the running ``policy``: their grid
    (servable variants as ``servable`` says), sized from their sources and priced with what
    the current ``profiler()`` measured (``None`` before it is configured)."""

    def __init__(
        self,
        *,
        index: ContextIndex,
        policy: RunningPolicy,
        servable: Servability,
        profiler: Callable[[], Profiler | None],
    ) -> None:
        self._index = index
        self._policy = policy
        self._servability = servable
        self._profiler = profiler
        self._variants: list[str] = []
        self._variants_of: object = None
        # context -> (variant, keys, reference copies, its geometry): the stamp it was worked
        # out for and the value in one tuple (a stamp tuple in a pair was 48 bytes more a
        # context, issue 42)
        self._geometry_cache: dict[str, tuple[str, int, int, Geometry]] = {}
        # Bumped when a profile appears, goes, or a context changes form (its grid may
        # shrink to the form it has): what derived figures (the write advice's prior) key on.
        self.version = 0

    def changed(self) -> None:
        """Some context's options changed (see :attr:`version`)."""
        self.version += 1

    def forget(self, context_id: str) -> int:
        """A context's bytes are gone; returns its token count as last computed (0 when its
        geometry was never asked for)."""
        self.version += 1
        cached = self._geometry_cache.pop(context_id, None)
        return 0 if cached is None else cached[3][1]

    def variants(self) -> list[str]:
        """The running policy's grid (cached per policy)."""
        policy = self._policy.current
        if self._variants_of is not policy:
            names = dict.fromkeys([*policy.variants, policy.fixed_variant])
            self._variants = [n for n in names if n]
            self._variants_of = policy
        return self._variants

    def grid(self, ctx: ContextRecord) -> tuple[VariantProfile, ...]:
        """The context's variants with exact sizes and, once profiled, quality and restore
        (:meth:`grid_row`, as objects)."""
        row = self.grid_row(ctx)
        return tuple(
            VariantProfile(*v)
            for v in zip(row.names, row.size_bytes, row.quality, row.restore_s, strict=True)
        )

    def grid_row(self, ctx: ContextRecord) -> GridRow:
        """The context's variants with exact sizes and, once profiled, quality and restore:
        what the executor can make from its sources (``ContextIndex.sources``). The whole grid
        while the original is at hand (stored, or kept as a reference copy). A context kept
        only quantized (int8, no reference copy) is its own source: its form first, then the
        variants quantized the same or coarser (``index.derivable``), never the original,
        which cannot be restored. Its profile measures quality against its dequantized KV, so
        the quantization's own loss is not in it (measured lossless-equivalent for int8 on
        SmolLM2, benchmarks/RESULTS.md). A token-dropped form without a reference copy has
        only itself. Sizes come from :func:`~kvtierd.sizes.grid_size_bytes` (each variant
        parsed and sized once per context shape)."""
        variants = self.variants()
        if len(variants) <= 1:  # eviction-only policy: nothing to size (the put path is hot)
            return GridRow((ctx.variant,), (ctx.size_bytes,), (1.0,), (0.0,))
        fmt, tokens, original_bytes = self.geometry_of(ctx)
        if fmt is None:
            return GridRow((ctx.variant,), (ctx.size_bytes,), (1.0,), (0.0,))
        profiled = self.profiled(ctx.context_id)
        own = self._index.self_sourced(ctx)
        names = tuple(self.servable_variants(ctx, variants))
        geometry = KvGeometry(fmt.shape[1], fmt.num_kv_heads, fmt.head_dim, tokens,
                              _dtype_bytes(fmt.dtype), fmt.shape[2])  # fmt: skip
        sizes = grid_size_bytes(geometry, names)
        quality, restore = [], []
        for name in names:
            known = profiled.get(name)
            # Unprofiled: quality 0 keeps a quality-seeking placer away until it is measured;
            # a fixed-variant placer ignores quality. A self-sourced form is what its profile
            # is measured against: 1, as the original of any other context.
            quality.append(known.quality if known else 1.0 if own and name == ctx.variant else 0.0)
            restore.append(known.restore_s if known else 0.0)
        if own:
            return GridRow(names, sizes, tuple(quality), tuple(restore))
        return GridRow((ORIGINAL_VARIANT, *names), (original_bytes, *sizes),
                       (1.0, *quality), (0.0, *restore))  # fmt: skip

    def servable_variants(self, ctx: ContextRecord, variants: list[str]) -> list[str]:
        """The lossy ``variants`` the context can be stored as (servable.py); for a
        self-sourced context its own form first and those it can make (:meth:`grid`)."""
        lossy = [v for v in variants if v != ORIGINAL_VARIANT]
        if self._index.token_drop_refused(ctx):  # a segment of a tree: quantization only
            lossy = [v for v in lossy if not parse_variant(v).drops_tokens]
        if self._index.self_sourced(ctx):
            made = (v for v in lossy if self._index.can_make(ctx, v))
            lossy = list(dict.fromkeys((ctx.variant, *made)))
        profiler = self._profiler()
        if profiler is None:
            return lossy
        return self._servability.options(ctx.context_id, ctx.variant, lossy, self.sources(ctx),
                                         profiler.queries)  # fmt: skip

    def servable_form(self, ctx: ContextRecord, variant: str) -> ServableForm:
        """The servable form of ``variant`` with its digest, or ``InvalidArgumentError`` with
        why the daemon cannot write it (servable.py)."""
        profiler = self._profiler()
        if profiler is None:
            raise InvalidArgumentError("the profiler, which keeps token ids, is not configured")
        queries = profiler.queries
        return self._servability.form(ctx.context_id, variant, self.sources(ctx), queries)

    def sources(self, ctx: ContextRecord) -> list[ObjectMeta]:
        """The chunks the context's variants are made from (``ContextIndex.sources``)."""
        return [obj.meta for obj in self._index.sources(ctx)]

    def profiled_variants(self, ctx: ContextRecord) -> list[str]:
        """The grid a profile scores: the policy's, and a self-sourced context's own form (an
        option of its, which the policy's grid may not name: its quality and restore cost)."""
        own = [ctx.variant] if self._index.self_sourced(ctx) else []
        return list(dict.fromkeys([*self.variants(), *own]))

    def unchoosable(self, ctx: ContextRecord) -> str:
        """Why a profile of the context would have nothing to choose between (``""``: it
        would), as what happens to it (the message says so after ``context ID:``). A
        self-sourced form (int8 only) is profiled against its dequantized KV (:meth:`grid`)
        when the policy names a variant that can be made from it."""
        if self.geometry_of(ctx)[0] is None:
            if self.sources(ctx):  # objects whose layout is no chunk format (opaque bytes)
                return NO_LAYOUT
            # a token-dropped form, no reference copy
            return f"not profiled: it is stored only as {ctx.variant!r}, its original is not kept"
        own = self._index.self_sourced(ctx)
        if own and not any(v != ctx.variant and self._index.can_make(ctx, v)
                           for v in self.variants()):  # fmt: skip
            return (
                f"not profiled: it is stored only as {ctx.variant!r}, its original is not kept, "
                "and the policy names no variant made from it"
            )
        return ""

    def opaque(self, ctx: ContextRecord) -> bool:
        """Whether the context is stored as objects with no chunk layout (:data:`NO_LAYOUT`);
        a pass over its objects."""
        return self.geometry_of(ctx)[0] is None and bool(self.sources(ctx))

    def stored_form_of(self, ctx: ContextRecord) -> StoredForm:
        """How the context's variants are stored: in chunks of its objects' size, so the
        quality the profiler measures is that of the variant the executor will write."""
        from kvtierd.profiler import StoredForm

        fmt, _, _ = self.geometry_of(ctx)
        return StoredForm(chunk_tokens=fmt.shape[2]) if fmt is not None else StoredForm()

    def geometry_of(self, ctx: ContextRecord) -> Geometry:
        """Chunk format, token count and bytes of the context's original (of its sources:
        quantized chunks count as the original they dequantize to); cached until the
        context gains objects or changes form (a put of chunk k would otherwise re-parse the
        k layouts before it). The stamp is read off the record, not off :meth:`sources`:
        listing the sources to check the cache is itself a pass over the context's keys. A
        context without a chunk layout is not cached: its first object says so at once, and
        an entry was 110 bytes a context (issue 42: 1M one-object contexts)."""
        variant, keys, reference = ctx.variant, len(ctx.keys), len(ctx.reference or ())
        cached = self._geometry_cache.get(ctx.context_id)
        if cached is not None and (cached[0], cached[1], cached[2]) == (variant, keys, reference):
            return cached[3]
        value = _geometry(self.sources(ctx))
        if value[0] is not None:  # no layout: found at the first object again, nothing kept
            self._geometry_cache[ctx.context_id] = (variant, keys, reference, value)
        return value

    def profiled(self, context_id: str) -> dict[str, VariantProfile]:
        """The context's profiled variants, as far as they may move it: none while its profile
        is below ``min_queries`` (it then keeps the original, as an unprofiled context)."""
        profiler = self._profiler()
        if profiler is None or not profiler.trusted(context_id):
            return {}
        try:
            profile = profiler.profile_of(context_id)
        except KeyError:
            return {}
        return {v.variant: v for v in profile.variants}

    def prefill_s(self, ctx: ContextRecord) -> float:
        """Seconds to recompute the context when dropped: from its token count
        (:meth:`tokens_of`) at today's prefill speed; else profiled; else
        :data:`UNKNOWN_PREFILL_S` — an object whose tokens nobody told us cannot be assumed
        cheap to recompute (with 0, a quality-seeking placer would rate dropping it as good
        as storing it)."""
        profiler = self._profiler()
        if profiler is None:
            return UNKNOWN_PREFILL_S
        tokens = self.tokens_of(ctx)
        if tokens:  # at today's prefill speed, which served requests may have taught since
            return profiler.ttft.prefill_s(tokens)
        profiled = self.profiled_prefill_s(ctx.context_id)
        return UNKNOWN_PREFILL_S if profiled is None else profiled

    def tokens_of(self, ctx: ContextRecord) -> int:
        """The context's token count: from its chunk layouts, else its objects'
        ``token_count`` (0 when neither says)."""
        _, tokens, _ = self.geometry_of(ctx)
        if not tokens:
            tokens = sum(self._index.objects[k].meta.token_count for k in ctx.keys)
        return tokens

    def profiled_prefill_s(self, context_id: str) -> float | None:
        """The recompute time the context's profile measured (``None``: not profiled)."""
        profiler = self._profiler()
        record = None if profiler is None else profiler.record(context_id)
        return None if record is None else record.profile.prefill_s

    def profiler(self) -> Profiler | None:
        """The running profiler (``None`` before it is configured)."""
        return self._profiler()

    def epoch(self) -> tuple[object, ...]:
        """What every context's options depend on alike: the policy (its grid), the profiler
        (its records, speed model) and the model cards (what can be served). A change of any
        makes every kept row stale (``option_rows.py``)."""
        cards = tuple(map(id, self._servability.cards.values()))
        return (self._policy.current, self._profiler(), cards)

    def prefill_tokens_s(self, tokens: int) -> float:
        """Seconds to prefill ``tokens`` tokens (:data:`UNKNOWN_PREFILL_S` when not known)."""
        profiler = self._profiler()
        if profiler is None or tokens <= 0:
            return UNKNOWN_PREFILL_S
        return profiler.ttft.prefill_s(tokens)

    def frequency(self, context_id: str) -> float | None:
        profiler = self._profiler()
        if profiler is None:
            return None
        f = profiler.frequency.frequency(context_id, time.time())
        return f if f > 0 else None


def _geometry(metas: list[ObjectMeta]) -> Geometry:
    """Chunk format, tokens and original bytes; a chunk stored quantized counts with the
    bytes its original would have."""
    tokens, nbytes, fmt = 0, 0, None
    for meta in metas:
        try:
            fmt = ChunkFormat.parse(meta.layout)
        except CorruptObjectError:
            return None, 0, 0
        tokens += fmt.shape[2]
        dense = math.prod(fmt.shape) * _dtype_bytes(fmt.dtype)
        nbytes += dense if fmt.quant else meta.size_bytes
    return fmt, tokens, nbytes


def _dtype_bytes(name: str) -> int:
    """``sizes.dtype_bytes``, lenient: a layout's dtype is not validated, 16-bit if unknown."""
    try:
        return dtype_bytes(name)
    except ValueError:
        return 2
