"""A pure-torch LMCache GPU connector for vLLM-CPU's paged KV layout.

LMCache 0.5.6 ships no connector for a CPU worker (``CreateGPUConnector`` raises "No supported
cpu connector found", and LMCache then silently runs without a cache). This one copies between
LMCache's ``KV_2LTD`` chunks ``[2, L, T, H*D]`` and vLLM-CPU's per-layer caches
``[num_blocks, H, block_size, 2*D]``. That shape is not the memory layout: vLLM-CPU's
``cpu_attn_reshape_and_cache`` (ISAs ``vec`` and ``vec16``) writes each (block, head) region of
``2 * bs * D`` elements as **K transposed** ``[D, bs]`` followed by V ``[bs, D]`` (probed by
writing distinct bit patterns through the op, see ``tests/integrations/test_paged_cpu.py``;
notes/vllm-cpu-lmcache.md's "index 0 of dim 2 is K ``[bs, D]``" is wrong for K). The ``amx``
ISA (bf16 on AMX CPUs) packs blocks differently and is refused. A token's slot is
``block * block_size + offset`` (vLLM's slot mapping).

This module imports LMCache at the top: it is only imported from inside the connector, after
vLLM's worker has started (notes/vllm-cpu-lmcache.md: importing LMCache earlier crashes it).
"""

from __future__ import annotations

from typing import Any

import torch
from lmcache.v1.gpu_connector.gpu_connectors import GPUConnectorInterface
from lmcache.v1.memory_management import MemoryFormat

from kvtierd.errors import InvalidArgumentError


def check_cpu_isa(kv_dtype: torch.dtype) -> None:
    """Refuse the ``amx`` attention ISA, whose block packing this connector does not know
    (vLLM picks it for bf16 KV on CPUs with AMX tiles, ``cpu_attn._get_attn_isa``)."""
    if kv_dtype == torch.bfloat16 and torch.cpu._is_amx_tile_supported():
        raise InvalidArgumentError(
            "vLLM-CPU uses its AMX attention kernels on this CPU (bf16 KV), whose KV block "
            "layout the kvtierd CPU connector does not support; use dtype float16 or a CPU "
            "without AMX"
        )


class TorchPagedCPUConnector(GPUConnectorInterface):  # type: ignore[misc]
    """``KV_2LTD`` chunks <-> vLLM-CPU paged caches, by index arithmetic on the slot mapping."""

    def __init__(self, num_layers: int, num_kv_heads: int, head_dim: int) -> None:
        self.num_layers = num_layers
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.kvcaches: list[torch.Tensor] | None = None

    @classmethod
    def from_metadata(cls, metadata: Any) -> TorchPagedCPUConnector:
        """From LMCache's metadata: ``kv_shape = (L, 2, chunk, H, D)``."""
        num_layers, _, _, num_kv_heads, head_dim = (int(x) for x in metadata.kv_shape)
        if metadata.use_mla:
            raise InvalidArgumentError("the CPU connector does not support MLA models")
        return cls(num_layers, num_kv_heads, head_dim)

    def get_shape(self, num_tokens: int) -> torch.Size:
        return torch.Size([2, self.num_layers, num_tokens, self.num_kv_heads * self.head_dim])

    def _layers(self, kwargs: dict[str, Any]) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """Each layer as (K ``[nb, H, D, bs]``, V ``[nb, H, bs, D]``) views of its memory."""
        caches = kwargs.get("kvcaches", self.kvcaches)
        if caches is None:
            raise InvalidArgumentError("the CPU connector needs 'kvcaches'")
        self.kvcaches = list(caches)
        out = []
        d = self.head_dim
        for i, c in enumerate(self.kvcaches):
            nb, h, bs, d2 = (int(x) for x in c.shape)
            if c.dim() != 4 or h != self.num_kv_heads or d2 != 2 * d or not c.is_contiguous():
                raise InvalidArgumentError(
                    f"layer {i}: expected a contiguous vLLM-CPU cache [nb, {self.num_kv_heads}, "
                    f"bs, {2 * d}], got {tuple(c.shape)}"
                )
            region = c.view(nb, h, 2 * bs * d)
            out.append(
                (
                    region[:, :, : bs * d].view(nb, h, d, bs),
                    region[:, :, bs * d :].view(nb, h, bs, d),
                )
            )
        return out

    @staticmethod
    def _slots(kwargs: dict[str, Any], start: int, end: int, bs: int) -> tuple[Any, Any]:
        if "slot_mapping" not in kwargs:
            raise InvalidArgumentError("the CPU connector needs 'slot_mapping'")
        slots = kwargs["slot_mapping"][start:end].to("cpu", torch.long)
        if bool((slots < 0).any()):
            raise InvalidArgumentError(f"negative slot in tokens [{start}, {end})")
        return slots // bs, slots % bs

    def from_gpu(self, memory_obj: Any, start: int, end: int, **kwargs: Any) -> None:
        layers = self._layers(kwargs)
        block, off = self._slots(kwargs, start, end, int(layers[0][1].shape[2]))
        dst = memory_obj.tensor  # [2, L, T, H*D]
        t = end - start
        for li, (k, v) in enumerate(layers):
            # advanced indices on dims 0 and 3 (separated by slices) come first: [T, H, D]
            dst[0, li, :t].copy_(k[block, :, :, off].reshape(t, -1))
            dst[1, li, :t].copy_(v[block, :, off, :].reshape(t, -1))
        memory_obj.metadata.fmt = MemoryFormat.KV_2LTD

    def to_gpu(self, memory_obj: Any, start: int, end: int, **kwargs: Any) -> None:
        if memory_obj.metadata.fmt != MemoryFormat.KV_2LTD:
            raise InvalidArgumentError(f"expected a KV_2LTD chunk, got {memory_obj.metadata.fmt}")
        layers = self._layers(kwargs)
        # Tokens vLLM already holds may sit in blocks shared with running requests: never
        # overwrite them (LMCache's CUDA connector skips them the same way).
        skip = min(end - start, max(0, int(kwargs.get("vllm_cached_tokens", 0)) - start))
        if skip == end - start:
            return
        block, off = self._slots(kwargs, start + skip, end, int(layers[0][1].shape[2]))
        src = memory_obj.tensor
        t = end - start - skip
        shape = (t, self.num_kv_heads, self.head_dim)
        for li, (k, v) in enumerate(layers):
            k[block, :, :, off] = src[0, li, skip : skip + t].reshape(shape)
            v[block, :, off, :] = src[1, li, skip : skip + t].reshape(shape)

    def batched_from_gpu(
        self, memory_objs: Any, starts: list[int], ends: list[int], **kwargs: Any
    ) -> None:
        for obj, s, e in zip(memory_objs, starts, ends, strict=True):
            self.from_gpu(obj, s, e, **kwargs)

    def batched_to_gpu(
        self,
        memory_objs: Any = None,
        starts: list[int] | None = None,
        ends: list[int] | None = None,
        **kwargs: Any,
    ) -> None:
        if memory_objs is None or starts is None or ends is None:
            raise InvalidArgumentError("the CPU connector is not layerwise")
        for obj, s, e in zip(memory_objs, starts, ends, strict=True):
            self.to_gpu(obj, s, e, **kwargs)
