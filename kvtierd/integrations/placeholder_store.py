"""Build and store a request's token-dropped variant under a placeholder identity.

Runs inside the LMCache plugin on the chunks of one put (the request's context, in order from
token 0): the chunks are joined into ``[2, L, N, H*D]``, compressed with the kernels (kept keys
rotated by ``M - N``, the same kept count in every layer and head), cut into chunks again and
stored under the LMCache chunk keys of the placeholder prompt, with a manifest for the router.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import Any

import torch

from kvtierd.errors import InvalidArgumentError
from kvtierd.integrations.daemon_io import PutItem, put_many
from kvtierd.integrations.placeholder import (
    Manifest,
    kept_key,
    manifest_key,
    placeholder_ids,
    read_model_rope,
)
from kvtierd.integrations.plugin_settings import key_string, tag
from kvtierd.kernels.api import compress_kv, dense_kv, to_kv_2ltd
from kvtierd.kernels.chunk_codec import chunk_format, encode_chunk
from kvtierd.kernels.layout import KVSource
from kvtierd.kernels.rope import RopeSpec
from kvtierd.kernels.variants import parse_variant

logger = logging.getLogger(__name__)

SNAPKV_UNAVAILABLE = (
    "snapkv is not available through the LMCache plugin: it scores tokens with the queries of "
    "the context's last window, and vLLM's paged cache keeps no queries (only K and V reach a "
    "KV connector); use knorm, keydiff, paged_eviction or streamingllm here, or compress with "
    "snapkv offline through the profiler, which runs the model and has the queries"
)


def rope_spec(model: str) -> RopeSpec:
    """The model's RoPE for the delta rotation; refuses models where it is not exact."""
    r = read_model_rope(model)
    return RopeSpec.standard(r.head_dim, theta=r.theta, rotary_dim=r.rotary_dim)


def _placeholder_keys(plugin: Any, ids: list[int]) -> list[str]:
    """LMCache's chunk keys of the placeholder prompt (the same hashing as its lookups)."""
    from lmcache.v1.token_database import ChunkedTokenDatabase

    db = ChunkedTokenDatabase(plugin.config, plugin.metadata)
    return [key_string(r[2]) for r in db.process_tokens(tokens=torch.tensor(ids))]


def store_placeholder_variant(
    plugin: Any, keys: Sequence[Any], objs: Sequence[Any], variant: str
) -> Manifest:
    v = parse_variant(variant)
    if v.method == "snapkv":
        raise InvalidArgumentError(SNAPKV_UNAVAILABLE)
    digest = tag(keys[0], "kvtierd_context")
    if not digest:
        raise InvalidArgumentError(
            f"variant {variant!r} drops tokens but the request names no context "
            "(lmcache.tag.kvtierd_context, set by `kvtierd router`)"
        )
    chunk = plugin.chunk_tokens
    n_tag = tag(keys[0], "kvtierd_context_tokens")
    n = int(n_tag) if n_tag else sum(int(o.tensor.shape[2]) for o in objs)
    if n % chunk or n > len(objs) * chunk:
        raise InvalidArgumentError(
            f"context of {n} tokens: must be a multiple of chunk_size {chunk} and within the "
            f"{len(objs)} chunks stored by this request"
        )
    kv = torch.cat([o.tensor for o in objs[: n // chunk]], dim=2)
    device = torch.device("cuda") if torch.cuda.is_available() else kv.device
    source = KVSource.from_kv_2ltd(kv.to(device), plugin.num_kv_heads)
    rope = rope_spec(str(plugin.metadata.model_name))
    dropped = compress_kv(source, f"{v.method}@{v.ratio:g}", rope=rope, chunk_tokens=chunk)
    m = dropped.num_kept
    if m % chunk:
        raise InvalidArgumentError(f"kept count {m} is not a multiple of chunk_size {chunk}")
    keys_d, values_d = dense_kv(dropped)
    data = to_kv_2ltd(keys_d, values_d).cpu()
    r = read_model_rope(str(plugin.metadata.model_name))
    ids = placeholder_ids(digest, str(v), m, r.vocab_size, r.special_ids)
    chunk_keys = _placeholder_keys(plugin, ids)
    quant = v.quant or "none"
    items = []
    for i, key in enumerate(chunk_keys):
        part = data[:, :, i * chunk : (i + 1) * chunk].contiguous()
        fmt = chunk_format(part, plugin.num_kv_heads, quant)
        enc = encode_chunk(part, fmt)
        items.append(
            PutItem(
                key,
                enc,
                f"{digest}/{v}",
                str(v),
                fmt.layout(),
                chunk,
                b"",
                tuple(enc.shape) if not fmt.quant else (),
            )
        )
    manifest = Manifest(digest, str(v), n, m, dropped.rope_delta, tuple(ids), tuple(chunk_keys))
    kept = dropped.kept.to(torch.int32).cpu().contiguous()
    items.append(
        PutItem(
            kept_key(digest),
            kept,
            f"{digest}/{v}",
            str(v),
            "kept[L,H,M]",
            m,
            b"",
            tuple(kept.shape),
        )
    )
    meta = torch.frombuffer(bytearray(manifest.to_bytes()), dtype=torch.uint8)
    items.append(PutItem(manifest_key(digest), meta, f"{digest}/{v}", str(v), "manifest", 0))
    put_many(plugin.client, items, durable=plugin.settings.durable)
    plugin.stats.placeholder_variants += 1
    logger.info("kvtierd plugin: stored %s of context %s: %d -> %d tokens", v, digest, n, m)
    return manifest
