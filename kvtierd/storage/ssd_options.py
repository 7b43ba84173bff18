"""Validated options of the SSD tier (``TierConfig.options``; documented in
:mod:`kvtierd.storage.ssd`)."""

from __future__ import annotations

import logging
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from kvtierd.config import parse_size
from kvtierd.errors import InvalidArgumentError
from kvtierd.storage.aligned_io import ALIGN

logger = logging.getLogger(__name__)

_ALLOWED = ("o_direct", "queue_depth", "part_bytes", "fsync", "index_checkpoint_s")
_MAX_QUEUE_DEPTH = 64
PART_BYTES_BEFORE = "chunk_bytes"
"""``part_bytes``'s name before issue 17 ("chunk" is LMCache's unit of KV), accepted one release
with a logged warning."""


@dataclass(frozen=True, slots=True)
class SsdOptions:
    """``o_direct`` is ``"auto"``, True or False; ``part_bytes`` a multiple of 4096."""

    o_direct: str | bool = "auto"
    queue_depth: int = 4
    part_bytes: int = 4 << 20
    fsync: bool = True
    index_checkpoint_s: float = 300.0  # 0: only at stop; the checkpoint is never turned off

    @property
    def o_direct_auto(self) -> bool:
        return self.o_direct == "auto"

    @classmethod
    def from_mapping(cls, raw: Mapping[str, Any], tier: str = "ssd") -> SsdOptions:
        """Validate raw options (of the tier named ``tier``); errors name the option and the
        allowed values."""
        raw = _renamed(raw, tier)
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
        part = parse_size(raw.get("part_bytes", 4 << 20), "ssd option part_bytes")
        if part < ALIGN or part % ALIGN:
            raise InvalidArgumentError(
                f"ssd option part_bytes: a positive multiple of {ALIGN} bytes, got {part}"
            )
        fsync = raw.get("fsync", True)
        if not isinstance(fsync, bool):
            raise InvalidArgumentError(f"ssd option fsync: true or false, got {fsync!r}")
        every = raw.get("index_checkpoint_s", 300.0)
        if type(every) not in (int, float) or not 0 <= every <= 86400:
            raise InvalidArgumentError(
                f"ssd option index_checkpoint_s: seconds in 0..86400 (0: at stop only), "
                f"got {every!r}"
            )
        return cls(o_direct=o_direct, queue_depth=depth, part_bytes=part, fsync=fsync,
                   index_checkpoint_s=float(every))  # fmt: skip


def _renamed(raw: Mapping[str, Any], tier: str) -> Mapping[str, Any]:
    """``raw`` with ``chunk_bytes`` read as ``part_bytes`` (and logged); both at once is an
    error, since the two could disagree."""
    if PART_BYTES_BEFORE not in raw:
        return raw
    if "part_bytes" in raw:
        raise InvalidArgumentError(
            f"ssd options part_bytes and {PART_BYTES_BEFORE} both given: {PART_BYTES_BEFORE} is "
            f"part_bytes's name before this release; give part_bytes only"
        )
    logger.warning(
        "ssd tier %r: option %s is deprecated, use part_bytes (the same transfer piece, renamed "
        "because a chunk is LMCache's unit of KV); %s will be refused from the next release",
        tier, PART_BYTES_BEFORE, PART_BYTES_BEFORE,
    )  # fmt: skip
    new = {k: v for k, v in raw.items() if k != PART_BYTES_BEFORE}
    new["part_bytes"] = raw[PART_BYTES_BEFORE]
    return new
