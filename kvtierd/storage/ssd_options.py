"""Validated options of the SSD tier (``TierConfig.options``; documented in
:mod:`kvtierd.storage.ssd`)."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from kvtierd.config import parse_size
from kvtierd.errors import InvalidArgumentError
from kvtierd.storage.aligned_io import ALIGN

_ALLOWED = ("o_direct", "queue_depth", "chunk_bytes", "fsync")
_MAX_QUEUE_DEPTH = 64


@dataclass(frozen=True, slots=True)
class SsdOptions:
    """``o_direct`` is ``"auto"``, True or False; ``chunk_bytes`` a multiple of 4096."""

    o_direct: str | bool = "auto"
    queue_depth: int = 4
    chunk_bytes: int = 4 << 20
    fsync: bool = True

    @property
    def o_direct_auto(self) -> bool:
        return self.o_direct == "auto"

    @classmethod
    def from_mapping(cls, raw: Mapping[str, Any]) -> SsdOptions:
        """Validate raw options; errors name the option and the allowed values."""
        unknown = sorted(set(raw) - set(_ALLOWED))
        if unknown:
            raise InvalidArgumentError(
                f"unknown ssd tier option(s) {', '.join(unknown)}; allowed: {', '.join(_ALLOWED)}"
            )
        o_direct = raw.get("o_direct", "auto")
        if not (o_direct == "auto" or isinstance(o_direct, bool)):
            raise InvalidArgumentError(
                f"ssd option o_direct: auto, true or false, got {o_direct!r}"
            )
        depth = raw.get("queue_depth", 4)
        if type(depth) is not int or not 1 <= depth <= _MAX_QUEUE_DEPTH:
            raise InvalidArgumentError(
                f"ssd option queue_depth: an integer in 1..{_MAX_QUEUE_DEPTH}, got {depth!r}"
            )
        chunk = parse_size(raw.get("chunk_bytes", 4 << 20), "ssd option chunk_bytes")
        if chunk < ALIGN or chunk % ALIGN:
            raise InvalidArgumentError(
                f"ssd option chunk_bytes: a positive multiple of {ALIGN} bytes, got {chunk}"
            )
        fsync = raw.get("fsync", True)
        if not isinstance(fsync, bool):
            raise InvalidArgumentError(f"ssd option fsync: true or false, got {fsync!r}")
        return cls(o_direct=o_direct, queue_depth=depth, chunk_bytes=chunk, fsync=fsync)
