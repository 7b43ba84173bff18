"""The KV a child context is served after (issue 29): its ancestors' stored KV, root first.

A child context (a document after a shared system prompt) holds only its own chunks; a request
for it loads its ancestors' chunks first, its own keys were computed at positions after theirs,
and its attention reads them. The profiler scores it that way (``ContextKV.prefix_keys``), from
the ancestors' stored bytes, never a prefill. Siblings are often profiled one after another (the
three documents after one system prompt): the last prefix read is kept, and read again only
when an ancestor changed (its objects, its form).
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

from kvtierd.engine.index import ContextIndex
from kvtierd.engine.mover import TierMover
from kvtierd.engine.state import ContextRecord
from kvtierd.errors import KvtierError

if TYPE_CHECKING:
    import torch

logger = logging.getLogger(__name__)

Stamp = tuple[tuple[str, str, int], ...]  # (id, variant, objects) of each ancestor, root first
AncestorKV = tuple["torch.Tensor", "torch.Tensor"]


class AncestorReader:
    """Reads the ancestors' KV of a context through ``mover`` (module docstring)."""

    def __init__(self, *, index: ContextIndex, mover: TierMover) -> None:
        self._index = index
        self._mover = mover
        self._last: tuple[Stamp, AncestorKV] | None = None
        self.reads = 0  # prefixes read from storage (the rest came from the kept one)

    async def prefix_of(self, ctx: ContextRecord) -> AncestorKV | None:
        """``(keys, values)`` ``[L, H, P, D]`` of the ancestors of ``ctx``, root first, in the
        dtype and geometry of the first; ``None`` for a root, or when an ancestor cannot be
        read or is of another geometry (logged: the context is then profiled alone, as
        before issue 29)."""
        import torch

        chain = [self._index.contexts.get(cid) for cid in reversed(self._index.ancestors(ctx))]
        if not chain or any(a is None for a in chain):
            return None
        ancestors = [a for a in chain if a is not None]
        stamp = tuple((a.context_id, a.variant, len(a.keys)) for a in ancestors)
        if self._last is not None and self._last[0] == stamp:
            return self._last[1]
        parts = []
        try:
            for ancestor in ancestors:
                parts.append(await self._mover.context_tensors(ancestor))
        except KvtierError as e:
            logger.info("context %s: profiled without its ancestors' KV: %s", ctx.context_id, e)
            return None
        keys, values = parts[0]
        geometry = (keys.shape[0], keys.shape[1], keys.shape[3])
        if any((k.shape[0], k.shape[1], k.shape[3]) != geometry for k, _ in parts):
            logger.info("context %s: its ancestors' KV differ in geometry: profiled alone",
                        ctx.context_id)  # fmt: skip
            return None
        prefix = (
            torch.cat([k.to(keys.dtype) for k, _ in parts], dim=2),
            torch.cat([v.to(values.dtype) for _, v in parts], dim=2),
        )
        self._last = (stamp, prefix)
        self.reads += 1
        return prefix
