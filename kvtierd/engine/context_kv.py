"""A stored context as tensors, and a compressed variant of it as new objects.

A context whose objects are LMCache ``KV_2LTD`` chunks (their ``layout`` is a
:class:`~kvtierd.kernels.chunk_codec.ChunkFormat` string) can be read back as canonical
``[L, H, N, D]`` keys and values — for the profiler — and re-encoded as another variant by the
executor. Quantized variants keep the chunking and the client's keys (LMCache finds the same
keys and decodes them by their layout). Token-dropping variants are stored in the one servable
form (``kernels/placeholder.py``, DESIGN.md §1): the first ``N`` tokens' KV (``servable.py``)
compressed to ``M`` kept entries whose keys are rotated by ``M - N``, cut into new chunks under
keys the daemon derives (``ctx\0variant\0i``, the kept positions in each object's
``kept_indices``), and a :class:`~kvtierd.kernels.placeholder.Manifest` naming them, which the
router finds by the digest of the ``N`` tokens and the plugin loads them through.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from kvtierd.engine.profiling.observation_window import form_queries, window_of
from kvtierd.errors import CorruptObjectError, InvalidArgumentError
from kvtierd.kernels.chunk_codec import ChunkFormat, chunk_format, decode_chunk, encode_chunk
from kvtierd.kernels.placeholder import Manifest, placeholder_ids
from kvtierd.types import ORIGINAL_VARIANT, ObjectMeta

if TYPE_CHECKING:
    import torch

    from kvtierd.engine.servable import ServableForm
    from kvtierd.variants import Variant

SEPARATOR = "\x00"  # clients cannot use it in keys (validate.py), so derived keys never clash


def variant_key(key: str, variant: str) -> str:
    """Storage key of a client key's object in a daemon-made variant."""
    return f"{key}{SEPARATOR}{variant}"


def client_key(storage_key: str) -> str:
    """The key a client knows an object by: its own key for a quantized variant
    (``key\0variant``), the derived key itself for a token-dropped chunk (``ctx\0variant\0i``).
    A client's key in the original (most objects) is returned without a ``split`` (a list per
    object; a restart asks for every object's, issue 42)."""
    if SEPARATOR not in storage_key:
        return storage_key
    parts = storage_key.split(SEPARATOR)
    return parts[0] if len(parts) == 2 else storage_key


def marker_key(context_id: str, variant: str) -> str:
    """The object whose presence marks a daemon-made quantized variant as complete (written
    last); a token-dropped variant's marker is its placeholder manifest
    (``kernels.placeholder.manifest_key`` of its digest), which the router reads."""
    return f"{context_id}{SEPARATOR}{variant}{SEPARATOR}manifest"  # stored keys: kept


MARKER_LAYOUT = "kvtierd-variant-manifest"  # stored in objects' metadata: never renamed


@dataclass(frozen=True, slots=True)
class EncodedObject:
    client_key: str
    meta: ObjectMeta
    data: bytes


@dataclass(frozen=True, slots=True)
class EncodedVariant:
    """A variant's new objects, and for a token-dropped one its placeholder manifest."""

    objects: list[EncodedObject]
    manifest: Manifest | None = None


def chunk_formats(metas: list[ObjectMeta]) -> list[ChunkFormat]:
    """The chunk format of every object, or ``InvalidArgumentError`` if one is not a chunk."""
    formats = []
    for meta in metas:
        try:
            formats.append(ChunkFormat.parse(meta.layout))
        except CorruptObjectError as e:
            raise InvalidArgumentError(
                f"object {meta.key!r} is not a KV_2LTD chunk (layout {meta.layout!r}): "
                "only chunked KV contexts can be profiled or compressed"
            ) from e
    return formats


def decode_context(payloads: list[bytes], formats: list[ChunkFormat]) -> torch.Tensor:
    """Chunks in order -> one ``[2, L, N, H*D]`` tensor."""
    import torch

    parts = []
    for data, fmt in zip(payloads, formats, strict=True):
        out = torch.empty(fmt.shape, dtype=getattr(torch, fmt.dtype))
        decode_chunk(torch.frombuffer(bytearray(data), dtype=torch.uint8), fmt, out)
        parts.append(out)
    return torch.cat(parts, dim=2)


def split_kv(kv: torch.Tensor, num_kv_heads: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``[2, L, N, H*D]`` -> keys and values ``[L, H, N, D]``."""
    _, layers, n, hd = kv.shape
    shape = (layers, n, num_kv_heads, hd // num_kv_heads)
    k = kv[0].reshape(shape).permute(0, 2, 1, 3).contiguous()
    v = kv[1].reshape(shape).permute(0, 2, 1, 3).contiguous()
    return k, v


def encode_variant(
    context_id: str,
    metas: list[ObjectMeta],
    kv: torch.Tensor,
    formats: list[ChunkFormat],
    variant: str,
    *,
    form: ServableForm | None = None,
) -> EncodedVariant:
    """The objects of ``variant`` for a context given as ``kv`` ``[2, L, N, H*D]``; a
    token-dropping variant needs its servable ``form`` (with its digest)."""
    from kvtierd.variants import parse_variant

    v = parse_variant(variant)
    heads = formats[0].num_kv_heads
    if v.drops_tokens:
        if form is None or not form.digest:
            raise InvalidArgumentError(f"{variant} drops tokens: it needs its servable form")
        return _encode_dropped(context_id, metas[0], kv, form=form, v=v)
    out, start = [], 0
    for meta, fmt in zip(metas, formats, strict=True):
        chunk = kv[:, :, start : start + fmt.shape[2]]
        start += fmt.shape[2]
        key = client_key(meta.key)  # (a daemon-made int8 chunk is stored as key\0int8)
        out.append(_encoded(key, variant_key(key, variant), meta, chunk, heads=heads, v=v))
    return EncodedVariant(out)


def _encode_dropped(
    context_id: str, base: ObjectMeta, kv: torch.Tensor, *, form: ServableForm, v: Variant
) -> EncodedVariant:
    """The servable form: the first ``N`` tokens compressed to ``M`` (keys rotated by
    ``M - N``, the same count in every layer and head), chunked as the context is, and the
    placeholder manifest naming the chunks. Quantization (``+int8``) is applied chunk by chunk
    to the kept entries, as the plugin applies it."""
    from dataclasses import replace as with_fields

    from kvtierd.kernels.api import compress_dense, dense_kv, to_kv_2ltd
    from kvtierd.sizes import count_unit

    n, chunk, heads = form.num_tokens, form.chunk_tokens, form.num_kv_heads
    keys, values = split_kv(kv[:, :, :n], heads)
    queries = None
    if window_of(v):  # snapkv: the queries of the N tokens' last window (window.py)
        queries = form_queries(form.model_dir, form.window_ids, keys, values)
    c = compress_dense(keys, values, with_fields(v, quant=""), rope=form.card.rope(),
                       queries=queries, chunk_tokens=count_unit(v, chunk))  # fmt: skip
    if c.num_kept != form.num_kept:
        raise InvalidArgumentError(f"{v} kept {c.num_kept} of {n} tokens, not {form.num_kept}")
    dense_keys, dense_values = dense_kv(c)  # dense already: nothing was quantized
    kept_kv = to_kv_2ltd(dense_keys.to(kv.dtype), dense_values.to(kv.dtype))
    out = []
    for i in range(form.num_kept // chunk):
        lo, hi = i * chunk, (i + 1) * chunk
        key = f"{context_id}{SEPARATOR}{v}{SEPARATOR}{i}"
        kept = c.kept[:, :, lo:hi].contiguous().numpy().astype("<i4").tobytes()
        # numbered as they follow each other (base's position is the context's first's)
        meta = base.replace(key=key, token_count=chunk, kept_indices=kept, position=i)
        out.append(_encoded(key, key, meta, kept_kv[:, :, lo:hi], heads=heads, v=v))
    card = form.card
    ids = placeholder_ids(form.digest, str(v), form.num_kept, card.vocab_size, card.special_ids)
    manifest = Manifest(form.digest, str(v), n, form.num_kept, c.rope_delta, tuple(ids),
                        tuple(o.client_key for o in out), context_id)  # fmt: skip
    return EncodedVariant(out, manifest)


def _encoded(
    client: str, storage: str, meta: ObjectMeta, chunk: torch.Tensor, *, heads: int, v: Variant
) -> EncodedObject:
    fmt = chunk_format(chunk.contiguous(), heads, v.quant or ORIGINAL_VARIANT)
    import torch

    encoded = encode_chunk(chunk.contiguous(), fmt).contiguous().view(-1)
    data = encoded.view(torch.uint8).numpy().tobytes()
    new = meta.replace(
        key=storage,
        variant=str(v),
        layout=fmt.layout(),
        dtype="uint8",
        shape=(len(data),),
        size_bytes=len(data),
        checksum=0,
        durable=False,  # made by the daemon from objects already read: not protected again
    )
    return EncodedObject(client, new, data)
