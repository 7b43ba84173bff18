"""Checks on what clients say about objects, with messages that name the bad value."""

from __future__ import annotations

import math
from collections.abc import Iterable

from kvtierd.engine.context_kv import MARKER_LAYOUT
from kvtierd.errors import CorruptObjectError, InvalidArgumentError
from kvtierd.kernels.chunk_codec import LAYOUT_PREFIX, ChunkFormat
from kvtierd.kernels.placeholder import (
    KEPT_LAYOUT,
    MANIFEST_LAYOUT,
    MAX_CARD_BYTES,
    MODEL_CARD_LAYOUT,
)
from kvtierd.sizes import DTYPE_BYTES
from kvtierd.types import ObjectMeta
from kvtierd.variants import parse_variant

MAX_KEY_BYTES = 1024
# Layouts without a format to check: none, an LMCache chunk whose format is not given, a model
# card, a daemon-made variant's marker, a placeholder variant's kept indices and manifest (the
# plugin's store request). Any other layout must be a KV_2LTD chunk format.
OPAQUE_LAYOUTS = (
    "", LAYOUT_PREFIX, MODEL_CARD_LAYOUT, MARKER_LAYOUT, KEPT_LAYOUT, MANIFEST_LAYOUT,
)  # fmt: skip


def validate_meta(meta: ObjectMeta, max_size_bytes: int) -> None:
    """Raise ``InvalidArgumentError`` for a malformed object description."""
    if not meta.key:
        raise InvalidArgumentError("object key is empty")
    if "\x00" in meta.key or "\x00" in meta.context_id or "\x00" in meta.parent_context_id:
        raise InvalidArgumentError("object keys and context ids may not contain NUL characters")
    if len(meta.key.encode()) > MAX_KEY_BYTES:
        raise InvalidArgumentError(f"object key is longer than {MAX_KEY_BYTES} bytes")
    for name in ("context_id", "parent_context_id"):
        if len(getattr(meta, name).encode()) > MAX_KEY_BYTES:
            raise InvalidArgumentError(f"{name} is longer than {MAX_KEY_BYTES} bytes")
    if meta.parent_context_id and meta.parent_context_id == meta.context:
        raise InvalidArgumentError(
            f"object {meta.key!r}: context {meta.context!r} cannot be its own parent"
        )
    if meta.size_bytes <= 0:
        raise InvalidArgumentError(
            f"object {meta.key!r}: size_bytes must be > 0, got {meta.size_bytes}"
        )
    if meta.size_bytes > max_size_bytes:
        raise InvalidArgumentError(
            f"object {meta.key!r} of {meta.size_bytes} bytes is larger than any tier or the "
            f"per-object limit allows ({max_size_bytes} bytes)"
        )
    if meta.dtype not in DTYPE_BYTES:
        known = ", ".join(sorted(DTYPE_BYTES))
        raise InvalidArgumentError(
            f"object {meta.key!r}: unknown dtype {meta.dtype!r}; known: {known}"
        )
    if meta.shape:
        if any(d < 0 for d in meta.shape):
            raise InvalidArgumentError(
                f"object {meta.key!r}: negative dimension in shape {meta.shape}"
            )
        expected = math.prod(meta.shape) * DTYPE_BYTES[meta.dtype]
        if expected != meta.size_bytes:
            raise InvalidArgumentError(
                f"object {meta.key!r}: layout mismatch: shape {list(meta.shape)} of {meta.dtype} "
                f"is {int(expected)} bytes but size_bytes is {meta.size_bytes}"
            )
    _check_variant_and_layout(meta)
    if len(meta.kept_indices) % 4:
        raise InvalidArgumentError(
            f"object {meta.key!r}: kept_indices must hold int32 values, "
            f"got {len(meta.kept_indices)} bytes"
        )


def _check_variant_and_layout(meta: ObjectMeta) -> None:
    """The variant and layout are parsed here, before anything is allocated: a variant the
    daemon cannot parse (``zzz@9.9+int99``) or a layout with ``h=0`` was stored, then failed
    in the placer (INTERNAL, the object kept) and stopped profiling (issue 27.4, 27.5)."""
    try:
        parse_variant(meta.variant)
    except ValueError as e:
        raise InvalidArgumentError(f"object {meta.key!r}: variant: {e}") from None
    if meta.layout == MODEL_CARD_LAYOUT and meta.size_bytes > MAX_CARD_BYTES:
        raise InvalidArgumentError(
            f"object {meta.key!r}: a model card is at most {MAX_CARD_BYTES} bytes, "
            f"got size_bytes {meta.size_bytes}"
        )
    if meta.layout in OPAQUE_LAYOUTS:
        return
    allowed = ", ".join(repr(x) for x in OPAQUE_LAYOUTS)
    if not meta.layout.startswith(f"{LAYOUT_PREFIX};"):
        raise InvalidArgumentError(
            f"object {meta.key!r}: layout {meta.layout[:200]!r} is not one kvtierd knows: "
            f"allowed are {allowed} or a chunk format "
            f"'{LAYOUT_PREFIX};<2>x<L>x<T>x<H*D>;<dtype>;h=<H>[;<int8|int4>;g=<G>]'"
        )
    try:
        fmt = ChunkFormat.parse(meta.layout)
    except CorruptObjectError as e:
        raise InvalidArgumentError(f"object {meta.key!r}: layout: {e}") from None
    if fmt.encoded_bytes() != meta.size_bytes:
        raise InvalidArgumentError(
            f"object {meta.key!r}: layout {meta.layout!r} is {fmt.encoded_bytes()} bytes, "
            f"but size_bytes is {meta.size_bytes}"
        )


def _geometry(layout: str) -> tuple[int, int, int, str, int] | None:
    """What every chunk of one context shares: ``(2, L, H*D, dtype, H)`` of a chunk layout
    (its token count ``T`` and its quantization may differ chunk to chunk); ``None`` for a
    layout that is no chunk format."""
    if not layout.startswith(f"{LAYOUT_PREFIX};"):
        return None
    fmt = ChunkFormat.parse(layout)
    return fmt.shape[0], fmt.shape[1], fmt.shape[3], fmt.dtype, fmt.num_kv_heads


def check_one_layout(meta: ObjectMeta, others: Iterable[ObjectMeta]) -> None:
    """Refuse a chunk whose geometry is not that of the chunks its context already has (held
    or being put): a context is decoded as one tensor, and chunks of two geometries (each
    valid alone) made the executor's concatenation raise while it compressed the context for
    another tenant's put (issue 40.2). ``InvalidArgumentError`` names the context and both
    layouts."""
    mine = _geometry(meta.layout)
    if mine is None:
        return
    # the first chunk found stands for them all: each was checked against those before it
    other = next((o for o in others if o.key != meta.key and _geometry(o.layout)), None)
    if other is not None and _geometry(other.layout) != mine:
        raise InvalidArgumentError(
            f"object {meta.key!r}: layout {meta.layout!r} does not match layout "
            f"{other.layout!r} of the other chunks of context {meta.context_id!r}: every "
            "chunk of one context has the same layers, heads, head size and dtype"
        )
