"""LMCache ``KV_2LTD`` chunks <-> the bytes kvtierd stores, for shape-preserving variants.

``none`` stores the chunk as it is. ``int8`` / ``int4`` store KIVI-style codes (keys per channel,
values per token, ``kvtierd.kernels.quant``) packed back to back in one uint8 object::

    k.codes | k.scale | k.zero | v.codes | v.scale | v.zero

Every size follows from the chunk shape, the bits and the group size, which the object's
``layout`` string records (``KV_2LTD;2x2x16x128;bfloat16;h=2;int8;g=32``), so a stored object
decodes without other state. Quantization runs where the tensor is: on a CUDA device the
Triton kernels run (``backend="auto"``), on CPU the torch reference.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass
from typing import TYPE_CHECKING

from kvtierd.errors import CorruptObjectError, InvalidArgumentError
from kvtierd.sizes import DEFAULT_GROUP_SIZE
from kvtierd.variants import parse_variant

if TYPE_CHECKING:
    import torch

# torch is imported inside the functions that move tensors: the daemon parses chunk layouts
# on its start-up path and should not pay torch's import for that.

LAYOUT_PREFIX = "KV_2LTD"
CHUNK_DTYPE_BYTES = {"float16": 2, "bfloat16": 2, "float32": 4}  # what vLLM's KV is kept in
QUANTS = ("", "int8", "int4")


@dataclass(frozen=True, slots=True)
class ChunkFormat:
    """How one stored chunk is encoded: its ``[2, L, T, H*D]`` shape, dtype and quantization."""

    shape: tuple[int, int, int, int]
    dtype: str
    num_kv_heads: int
    quant: str = ""  # "", "int8" or "int4"
    group_size: int = DEFAULT_GROUP_SIZE

    @property
    def bits(self) -> int:
        return {"": 0, "int8": 8, "int4": 4}[self.quant]

    @property
    def head_dim(self) -> int:
        return self.shape[3] // self.num_kv_heads

    def layout(self) -> str:
        dims = "x".join(str(d) for d in self.shape)
        base = f"{LAYOUT_PREFIX};{dims};{self.dtype};h={self.num_kv_heads}"
        return f"{base};{self.quant};g={self.group_size}" if self.quant else base

    @classmethod
    def parse(cls, layout: str) -> ChunkFormat:
        """The format a layout string names; raises ``CorruptObjectError`` for one that is not
        a kvtierd chunk layout. Parsed once per string (a format is immutable, and a daemon
        holds many chunks of the same few layouts)."""
        return _parse_layout(layout)

    def _invalid(self) -> str:
        """Why this format cannot describe a chunk, or ``""``."""
        if self.shape[0] != 2 or min(self.shape) < 1:
            return f"the shape must be [2, L, T, H*D] with every dimension >= 1, got {self.shape}"
        if self.dtype not in CHUNK_DTYPE_BYTES:
            return f"dtype {self.dtype!r} is not one of {', '.join(CHUNK_DTYPE_BYTES)}"
        if self.num_kv_heads < 1 or self.shape[3] % self.num_kv_heads:
            return f"h={self.num_kv_heads} must be >= 1 and divide H*D = {self.shape[3]}"
        if self.quant not in QUANTS:
            return f"quantization {self.quant!r} is not one of int8, int4"
        g = self.group_size
        if g < 2 or g & (g - 1):
            return f"g={g}: the group size must be a power of two >= 2"
        return ""

    def _part_shapes(self) -> list[tuple[tuple[int, ...], str]]:
        """The quantized parts' shapes and dtypes (``uint8`` codes, ``float16`` parameters)."""
        _, lyr, t, _ = self.shape
        h, d, g = self.num_kv_heads, self.head_dim, self.group_size
        code_d = math.ceil(d * self.bits / 8)
        k_param = (lyr, h, math.ceil(t / g), d)
        v_param = (lyr, h, t, math.ceil(d / g))
        codes = (lyr, h, t, code_d)
        f16, u8 = "float16", "uint8"
        return [(codes, u8), (k_param, f16), (k_param, f16), (codes, u8), (v_param, f16),
                (v_param, f16)]  # fmt: skip

    def _quant_parts(self) -> list[tuple[tuple[int, ...], torch.dtype]]:
        return [(shape, _torch_dtype(dt)) for shape, dt in self._part_shapes()]

    def encoded_bytes(self) -> int:
        """Bytes of the stored chunk (torch-free: checked at every put)."""
        if not self.quant:
            size = CHUNK_DTYPE_BYTES.get(self.dtype) or _torch_dtype(self.dtype).itemsize
            return math.prod(self.shape) * size
        item = {"uint8": 1, "float16": 2}
        return sum(math.prod(s) * item[dt] for s, dt in self._part_shapes())


@functools.lru_cache(maxsize=1024)
def _parse_layout(layout: str) -> ChunkFormat:
    parts = layout.split(";")
    try:
        if parts[0] != LAYOUT_PREFIX or len(parts) not in (4, 6):
            raise ValueError(layout)
        shape = tuple(int(d) for d in parts[1].split("x"))
        heads = int(parts[3].removeprefix("h="))
        quant, group = ("", DEFAULT_GROUP_SIZE)
        if len(parts) == 6:
            quant, group = parts[4], int(parts[5].removeprefix("g="))
    except ValueError as e:
        raise CorruptObjectError(f"not a kvtierd chunk layout: {layout!r}") from e
    if len(shape) != 4:
        raise CorruptObjectError(f"chunk layout {layout!r} does not have 4 dimensions")
    fmt = ChunkFormat((shape[0], shape[1], shape[2], shape[3]), parts[2], heads, quant, group)
    if why := fmt._invalid():
        # A layout is a client's word: one with h=0 or g=0 divided by zero in the placer and
        # stopped the profiling loop (issue 27.4), so every reader gets it checked. (Refused
        # layouts raise, so the cache holds only valid ones.)
        raise CorruptObjectError(f"chunk layout {layout!r}: {why}")
    return fmt


def _torch_dtype(name: str) -> torch.dtype:
    import torch

    dt = getattr(torch, name, None)
    if not isinstance(dt, torch.dtype):
        raise InvalidArgumentError(f"{name!r} is not a torch dtype")
    return dt


def chunk_format(kv: torch.Tensor, num_kv_heads: int, variant: str) -> ChunkFormat:
    """The format a chunk takes under a shape-preserving ``variant`` (none/int8/int4)."""
    v = parse_variant(variant)
    if v.drops_tokens:
        raise InvalidArgumentError(
            f"variant {variant!r} drops tokens; chunks are encoded with none/int8/int4 only"
        )
    if kv.dim() != 4 or kv.shape[0] != 2:
        raise InvalidArgumentError(f"a KV_2LTD chunk is [2, L, T, H*D], got {tuple(kv.shape)}")
    shape = (int(kv.shape[0]), int(kv.shape[1]), int(kv.shape[2]), int(kv.shape[3]))
    dtype = str(kv.dtype).removeprefix("torch.")
    return ChunkFormat(shape, dtype, num_kv_heads, v.quant)


def _split_lhtd(kv: torch.Tensor, h: int) -> tuple[torch.Tensor, torch.Tensor]:
    _, lyr, t, hd = kv.shape
    k = kv[0].reshape(lyr, t, h, hd // h).permute(0, 2, 1, 3)
    v = kv[1].reshape(lyr, t, h, hd // h).permute(0, 2, 1, 3)
    return k.contiguous(), v.contiguous()


def encode_chunk(kv: torch.Tensor, fmt: ChunkFormat) -> torch.Tensor:
    """The bytes to store for ``kv`` (a contiguous CPU tensor; ``kv`` itself for ``none``)."""
    import torch

    from kvtierd.kernels.quant import quantize_kv

    if not fmt.quant:
        return kv.contiguous().cpu()
    device = torch.device("cuda") if torch.cuda.is_available() else kv.device
    k, v = _split_lhtd(kv.to(device), fmt.num_kv_heads)
    qk, qv = quantize_kv(k, v, fmt.bits, fmt.group_size)
    parts = [qk.codes, qk.scale, qk.zero, qv.codes, qv.scale, qv.zero]
    return torch.cat([p.contiguous().view(torch.uint8).reshape(-1) for p in parts]).cpu()


def decode_chunk(payload: torch.Tensor, fmt: ChunkFormat, out: torch.Tensor) -> None:
    """Write the chunk stored as ``payload`` (uint8 ``[bytes]``) into ``out`` ``[2, L, T, H*D]``."""
    import torch

    from kvtierd.kernels.api import to_kv_2ltd
    from kvtierd.kernels.quant import dequantize
    from kvtierd.kernels.results import QuantizedTensor

    if tuple(out.shape) != fmt.shape:
        raise InvalidArgumentError(f"chunk {fmt.shape} into a buffer of {tuple(out.shape)}")
    if payload.numel() != fmt.encoded_bytes():
        raise CorruptObjectError(
            f"chunk of {payload.numel()} bytes, its layout {fmt.layout()!r} says "
            f"{fmt.encoded_bytes()}"
        )
    dtype = _torch_dtype(fmt.dtype)
    if not fmt.quant:
        out.copy_(payload.view(dtype).reshape(fmt.shape))
        return
    device = torch.device("cuda") if torch.cuda.is_available() else out.device
    raw = payload.to(device)
    tensors, pos = [], 0
    for shape, dt in fmt._quant_parts():
        n = math.prod(shape) * dt.itemsize
        tensors.append(raw[pos : pos + n].view(dt).reshape(shape))
        pos += n
    d, b, g = fmt.head_dim, fmt.bits, fmt.group_size
    qk = QuantizedTensor(tensors[0], tensors[1], tensors[2], b, g, "channel", d, dtype)
    qv = QuantizedTensor(tensors[3], tensors[4], tensors[5], b, g, "token", d, dtype)

    out.copy_(to_kv_2ltd(dequantize(qk), dequantize(qv)))
