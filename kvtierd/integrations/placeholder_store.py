"""Build and store a request's token-dropped variant under a placeholder identity.

Runs inside the LMCache plugin on the put of a ``kvtierd router`` store request
(``store_request.py``): the context's chunks — those LMCache already held, read back from the
daemon and decoded by the layout they were stored with, then the put's own — are joined into
``[2, L, N, H*D]``, compressed with the kernels (kept keys rotated by ``M - N``, the same kept
count in every layer and head), cut into chunks again and stored under the LMCache chunk keys of
the placeholder prompt, with a manifest for the router.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import replace
from typing import Any

import torch

from kvtierd.client import KVClient
from kvtierd.errors import InvalidArgumentError, KvtierError
from kvtierd.integrations.daemon_io import PutItem, lease_many, put_many, read_bytes
from kvtierd.integrations.placeholder_serve import placeholder_chunk_keys
from kvtierd.integrations.store_request import StoreRequest
from kvtierd.kernels.api import compress_kv, dense_kv, to_kv_2ltd
from kvtierd.kernels.chunk_codec import ChunkFormat, chunk_format, decode_chunk, encode_chunk
from kvtierd.kernels.layout import KVSource
from kvtierd.kernels.placeholder import (
    KEPT_LAYOUT,
    MANIFEST_LAYOUT,
    SNAPKV_UNAVAILABLE,
    Manifest,
    ModelRope,
    kept_key,
    kept_tokens,
    manifest_key,
    placeholder_ids,
    read_model_rope,
)
from kvtierd.kernels.results import CompressedKV
from kvtierd.kernels.rope import RopeSpec
from kvtierd.sizes import count_unit
from kvtierd.variants import parse_variant

logger = logging.getLogger(__name__)


def rope_spec(model: str, rope: ModelRope) -> RopeSpec:
    """The RoPE of the model in directory ``model`` for the delta rotation (``rope``: its
    :func:`read_model_rope`, which refused the kinds where a delta rotation is inexact).

    ``linear``, ``llama3`` and ``yarn`` scale the frequencies (yarn per channel), and the
    rotation must use the model's own: they are computed as the model computes them, by
    transformers' rope functions (vLLM's agree). Rotating with the unscaled ones was as far off
    as the keys are large (tests/integrations/test_placeholder_rope.py)."""
    if rope.rope_type == "default":
        return RopeSpec.standard(rope.head_dim, theta=rope.theta, rotary_dim=rope.rotary_dim)
    from transformers import AutoConfig
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    config = AutoConfig.from_pretrained(model)
    inv_freq, _ = ROPE_INIT_FUNCTIONS[rope.rope_type](config, "cpu")
    return RopeSpec.from_inv_freq(inv_freq, rope.head_dim)


def read_chunks(client: KVClient, names: Sequence[str]) -> list[torch.Tensor]:
    """Chunks held by the daemon as LMCache's ``[2, L, T, H*D]`` tensors, in order, decoded by
    the layout each was stored with (original, or int8/int4 by whoever compressed it)."""
    if not names:
        return []
    out = []
    with lease_many(client, names) as views:
        for info, view in views:
            fmt = ChunkFormat.parse(info.spec.layout)
            chunk = torch.empty(fmt.shape, dtype=getattr(torch, fmt.dtype))
            decode_chunk(torch.frombuffer(view, dtype=torch.uint8), fmt, chunk)
            out.append(chunk)
    return out


def context_kv(
    plugin: Any, request: StoreRequest, names: Sequence[str], objs: Sequence[Any]
) -> torch.Tensor | None:
    """The context's KV ``[2, L, N, H*D]``: the chunks before the put (LMCache held them, or an
    earlier put of the request stored them) read from the daemon, then the put's own
    (``names``, ``objs``). ``None`` when the put ends inside the context: vLLM prefills the
    prompt in several steps (chunked prefill), and the put carrying the context's last chunk
    builds the variant."""
    chunk = plugin.chunk_tokens
    if request.num_tokens % chunk:
        raise InvalidArgumentError(
            f"context of {request.num_tokens} tokens: must be a multiple of chunk_size {chunk}"
        )
    context = plugin.context_chunks.get(request.context_id)
    if context is None or len(context) != request.num_tokens // chunk:
        raise InvalidArgumentError(
            f"context {request.digest}: this plugin saw no lookup of the store request covering "
            f"its {request.num_tokens} tokens, so where this put starts in it is unknown"
        )
    if names[0] not in context:
        raise InvalidArgumentError(
            f"context {request.digest}: the put starts after its {len(context)} chunks (LMCache "
            "held them all and no lookup capped the hit); nothing to build from"
        )
    start = context.index(names[0])
    fresh = len(context) - start
    if len(names) < fresh and tuple(names) == context[start : start + len(names)]:
        logger.debug("kvtierd plugin: context %s: chunks %d-%d of %d stored; the request's "
                     "next put ends it", request.digest, start, start + len(names) - 1,
                     len(context))  # fmt: skip
        return None
    if tuple(names[:fresh]) != context[start:]:
        raise InvalidArgumentError(
            f"context {request.digest}: the put's chunks are not the context's chunks "
            f"{start}-{len(context) - 1}"
        )
    held = read_chunks(plugin.client, context[:start])
    plugin.stats.held_chunks += len(held)
    return torch.cat([*held, *(o.tensor for o in objs[:fresh])], dim=2)


def _source_context(plugin: Any, request: StoreRequest) -> str:
    """The daemon context of the context's first original chunk: as this plugin stored or
    loaded it, else as the daemon says (a chunk another process stored)."""
    chunks = plugin.context_chunks.get(request.context_id)
    if not chunks:
        return ""
    known = str(plugin.links.context_of(chunks[0]))
    if known:
        return known
    try:
        with lease_many(plugin.client, [chunks[0]]) as ((info, _),):
            return str(info.spec.context_id)
    except KvtierError as e:  # evicted meanwhile: the variant serves, unreported
        logger.warning("kvtierd plugin: context %s: no source context (%s)", request.context_id,
                       e)  # fmt: skip
        return ""


def stored_manifest(client: KVClient, key: str) -> Manifest | None:
    if not client.lookup([key]).found[0]:
        return None
    return Manifest.from_bytes(read_bytes(client, key))


def store_placeholder_variant(
    plugin: Any, request: StoreRequest, names: Sequence[str], objs: Sequence[Any]
) -> Manifest | None:
    """Build ``request``'s variant from the context's chunks and store it with its manifest;
    a context already stored as that variant is left as it is (a repeated store request).
    ``None``: the put ends before the context does, a later put of the request builds it."""
    v = parse_variant(request.variant)
    if v.method == "snapkv" and not request.window_ids:
        raise InvalidArgumentError(SNAPKV_UNAVAILABLE)
    digest, n, chunk = request.digest, request.num_tokens, plugin.chunk_tokens
    keyed = str(v) if request.scope else ""  # the variant the manifest's key names
    salt = request.key_prefix
    existing = stored_manifest(plugin.client, salt + manifest_key(digest, keyed))
    if existing is not None:
        if (existing.variant, existing.num_tokens) == (str(v), n):
            return existing
        raise InvalidArgumentError(
            f"context {digest} is already stored as {existing.variant}; evict it first "
            f"(kvtierctl evict {salt}{digest}/{existing.variant})"
        )
    model = str(plugin.metadata.model_name)
    r = read_model_rope(model)  # before any KV is read: refuses models it cannot serve
    kv = context_kv(plugin, request, names, objs)
    if kv is None:
        return None
    source = KVSource.from_kv_2ltd(kv.to(plugin.codec_device), plugin.num_kv_heads)
    m = kept_tokens(n, v, chunk)  # the router checked that it is whole chunks
    if m % chunk:
        raise InvalidArgumentError(f"kept count {m} is not a multiple of chunk_size {chunk}")
    dropped = compress_kv(source, replace(v, quant=""), rope=rope_spec(model, r),
                          queries=_window_queries(plugin, model, request, kv),
                          chunk_tokens=count_unit(v, chunk))  # fmt: skip
    if dropped.num_kept != m:
        raise InvalidArgumentError(f"{v} kept {dropped.num_kept} of {n} tokens, not {m}")
    ids = placeholder_ids(digest, str(v), m, r.vocab_size, r.special_ids)
    chunk_keys = placeholder_chunk_keys(plugin, ids, salt)  # a rewritten request's own keys
    original = "" if request.scope else _source_context(plugin, request)
    manifest = Manifest(
        digest, str(v), n, m, dropped.rope_delta, tuple(ids), tuple(chunk_keys), original
    )
    items = _variant_items(plugin, manifest, dropped, keyed, salt)
    put_many(plugin.client, items, durable=plugin.settings.durable)
    plugin.stats.placeholder_variants += 1
    logger.info("kvtierd plugin: stored %s of context %s%s: %d -> %d tokens", v, digest,
                f" (scope {request.scope})" if request.scope else "", n, m)  # fmt: skip
    return manifest


def _window_queries(
    plugin: Any, model: str, request: StoreRequest, kv: torch.Tensor
) -> torch.Tensor | None:
    """snapkv's window queries, recomputed from the served checkpoint's weights (vLLM keeps
    none): the context's last window after its stored KV (``profiler.window_queries``)."""
    if not request.window_ids:
        return None
    from kvtierd.profiler.window_queries import queries_for_kv_2ltd

    return queries_for_kv_2ltd(model, kv.to(plugin.codec_device), plugin.num_kv_heads,
                               request.window_ids, len(request.window_ids))  # fmt: skip


def _variant_items(
    plugin: Any, manifest: Manifest, dropped: CompressedKV, keyed: str, salt: str
) -> list[PutItem]:
    """The placeholder chunks (in the variant's quantization), the kept indices and the
    manifest, the last two under keys naming ``keyed`` (``placeholder.manifest_key``); the
    kept indices, the manifest and the context id begin with the request's ``salt`` prefix, as
    its chunk keys do."""
    v = parse_variant(manifest.variant)
    chunk, context_id = plugin.chunk_tokens, f"{salt}{manifest.digest}/{v}"
    keys_d, values_d = dense_kv(dropped)
    data = to_kv_2ltd(keys_d, values_d).cpu()
    items = []
    for i, key in enumerate(manifest.chunk_keys):
        part = data[:, :, i * chunk : (i + 1) * chunk].contiguous()
        fmt = chunk_format(part, plugin.num_kv_heads, v.quant or "none")
        enc = encode_chunk(part, fmt)
        shape = tuple(enc.shape) if not fmt.quant else ()
        items.append(PutItem(key, enc, context_id, str(v), fmt.layout(), chunk, b"", shape))
    kept = dropped.kept.to(torch.int32).cpu().contiguous()
    items.append(PutItem(salt + kept_key(manifest.digest, keyed), kept, context_id, str(v),
                         KEPT_LAYOUT, manifest.num_kept, b"", tuple(kept.shape)))  # fmt: skip
    meta = torch.frombuffer(bytearray(manifest.to_bytes()), dtype=torch.uint8)
    key = salt + manifest_key(manifest.digest, keyed)
    items.append(PutItem(key, meta, context_id, str(v), MANIFEST_LAYOUT, 0))
    return items
