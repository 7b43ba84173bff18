"""Checks on what clients say about objects, with messages that name the bad value."""

from __future__ import annotations

import math

from kvtierd.errors import InvalidArgumentError
from kvtierd.sizes import DTYPE_BYTES
from kvtierd.types import ObjectMeta

MAX_KEY_BYTES = 1024


def validate_meta(meta: ObjectMeta, max_size_bytes: int) -> None:
    """Raise ``InvalidArgumentError`` for a malformed object description."""
    if not meta.key:
        raise InvalidArgumentError("object key is empty")
    if "\x00" in meta.key or "\x00" in meta.context_id:
        raise InvalidArgumentError("object keys and context ids may not contain NUL characters")
    if len(meta.key.encode()) > MAX_KEY_BYTES:
        raise InvalidArgumentError(f"object key is longer than {MAX_KEY_BYTES} bytes")
    if len(meta.context_id.encode()) > MAX_KEY_BYTES:
        raise InvalidArgumentError(f"context_id is longer than {MAX_KEY_BYTES} bytes")
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
    if len(meta.kept_indices) % 4:
        raise InvalidArgumentError(
            f"object {meta.key!r}: kept_indices must hold int32 values, "
            f"got {len(meta.kept_indices)} bytes"
        )
