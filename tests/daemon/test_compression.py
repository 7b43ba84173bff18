"""The executor compresses stored contexts when the placer wants another variant: quantized
variants keep the client's keys (decoded by their layout), token-dropped ones become new
chunks of the kept tokens in the servable form (rotated keys, a placeholder manifest), and only
once the daemon can write that form; both survive a restart, and a compression cut short by a crash
leaves the original."""

from __future__ import annotations

import time

import numpy as np
import pytest
import torch

from kvtierd.client import KVClient
from kvtierd.kernels.chunk_codec import ChunkFormat, decode_chunk
from kvtierd.kernels.placeholder import (
    MODEL_CARD_LAYOUT,
    Manifest,
    ModelCard,
    manifest_key,
    model_card_key,
    placeholder_ids,
)
from kvtierd.kernels.rope import RopeSpec, rotate_keys
from kvtierd.router_protocol import context_digest
from kvtierd.rpc import kvtier_pb2 as pb

L, H, D, T, CHUNKS = 2, 2, 32, 16, 4


def _chunks(seed: int) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(2, L, T, H * D, generator=g).to(torch.bfloat16) for _ in range(CHUNKS)]


def _put_context(c: KVClient, cid: str, chunks: list[torch.Tensor], durable: bool = False) -> None:
    layout = ChunkFormat((2, L, T, H * D), "bfloat16", H).layout()
    for i, chunk in enumerate(chunks):
        c.put(f"{cid}/{i}", chunk, context_id=cid, layout=layout, token_count=T, durable=durable)


def _settle(c: KVClient) -> None:
    deadline = time.monotonic() + 20
    while c.status().pending_plans and time.monotonic() < deadline:
        time.sleep(0.02)


def _apply(c: KVClient, text: str) -> None:
    c.call(c.admin.ApplyPolicy, pb.ApplyPolicyRequest(yaml=text, source="test.yaml"))
    _settle(c)


def _read_once(c: KVClient, keys: list[str]) -> None:
    """Read durable objects once: from then on the placer may compress them (docs/daemon.md)."""
    for key in keys:
        c.get(key)


def _decode(c: KVClient, key: str) -> torch.Tensor:
    with c.lease(key) as (info, view):
        fmt = ChunkFormat.parse(info.spec.layout)
        out = torch.empty(fmt.shape, dtype=torch.bfloat16)
        decode_chunk(torch.frombuffer(bytearray(view), dtype=torch.uint8), fmt, out)
    return out


def test_int8_keeps_keys_and_survives_restart(start_daemon):
    d = start_daemon(cpu="1MiB", ssd="64MiB")
    chunks = _chunks(0)
    with KVClient(d.socket_path) as c:
        _put_context(c, "doc", chunks, durable=True)
        original = sum(x.numel() * 2 for x in chunks)
        _apply(c, "placer: fixed\nvariant: int8\n")
        (ctx,) = c.contexts()  # durable and unread: kept as written (docs/daemon.md)
        assert ctx.variant == "none" and ctx.durable_unread == CHUNKS and ctx.durable_held
        _read_once(c, [f"doc/{i}" for i in range(CHUNKS)])
        _settle(c)
        (ctx,) = c.contexts()
        assert ctx.variant == "int8" and ctx.size_bytes < 0.6 * original
        keys = [f"doc/{i}" for i in range(CHUNKS)]
        assert c.lookup(keys).prefix_hits == CHUNKS  # LMCache's keys still hit
        for key, chunk in zip(keys, chunks, strict=True):
            err = (_decode(c, key).float() - chunk.float()).abs().max().item()
            assert err < 0.05 * chunk.float().abs().max().item(), (key, err)
    d.stop()
    d.start()
    with KVClient(d.socket_path) as c:
        (ctx,) = c.contexts()
        assert ctx.variant == "int8" and ctx.objects == CHUNKS


MODEL = "/models/tiny"
VOCAB = 1000


def _lmcache_key(i: int) -> str:
    """A chunk key as the LMCache plugin names objects (model@world@worker@hash@dtype)."""
    return f"{MODEL}@1@0@{i:016x}@bfloat16"


def _register_card(c: KVClient, refused: str = "") -> ModelCard:
    spec = RopeSpec.standard(D)
    card = ModelCard(MODEL, D, spec.inv_freq, VOCAB, (0, 1), refused=refused)
    data = np.frombuffer(card.to_bytes(), np.uint8)
    c.put(model_card_key(MODEL), data, context_id="card", layout=MODEL_CARD_LAYOUT)
    assert not c.lookup([model_card_key(MODEL)]).found[0]
    return card


def _put_lmcache_context(c: KVClient, chunks: list[torch.Tensor]) -> list[str]:
    layout = ChunkFormat((2, L, T, H * D), "bfloat16", H).layout()
    keys = [_lmcache_key(i) for i in range(len(chunks))]
    for key, chunk in zip(keys, chunks, strict=True):
        c.put(key, chunk, context_id=keys[0], layout=layout, token_count=T)
    return keys


def test_token_dropping_variant_is_stored_servable(start_daemon):
    """knorm@0.5 of a context whose model card and tokens are known: the kept keys rotated by
    M - N, under a placeholder manifest the router finds by the digest of the N tokens."""
    d = start_daemon(cpu="1MiB", ssd="64MiB")
    chunks = _chunks(1)
    tokens = list(range(100, 100 + CHUNKS * T + 5))  # the prompt runs 5 tokens past the chunks
    with KVClient(d.socket_path) as c:
        card = _register_card(c)
        keys = _put_lmcache_context(c, chunks)
        c.set_context_tokens(keys[0], tokens)
        _apply(c, "placer: fixed\nvariant: knorm@0.5\n")
        (ctx,) = c.contexts()  # the card is no object: the engine keeps it
        assert ctx.variant == "knorm@0.5"
        assert ctx.objects == CHUNKS // 2  # M = N/2 tokens in chunks of T
        assert not any(c.lookup(keys).found)
        n = CHUNKS * T
        digest = context_digest(MODEL, tokens[:n])
        manifest = Manifest.from_bytes(bytes(c.get(manifest_key(digest))))
        assert (manifest.num_tokens, manifest.num_kept, manifest.rope_delta) == (n, n // 2, -n // 2)
        assert manifest.source_context == keys[0]
        ids = placeholder_ids(digest, "knorm@0.5", n // 2, VOCAB, (0, 1))
        assert list(manifest.placeholder_ids) == ids
        assert c.lookup(list(manifest.chunk_keys)).prefix_hits == CHUNKS // 2
        kv = torch.cat(chunks, dim=2).float()
        k_all = kv[0].reshape(L, n, H, D).permute(0, 2, 1, 3)
        for i, key in enumerate(manifest.chunk_keys):
            with c.lease(key) as (info, _):
                kept = np.frombuffer(info.spec.kept_indices, "<i4").reshape(L, H, T)
            assert (np.diff(kept, axis=2) > 0).all() and kept.max() < n
            got = _decode(c, key).float()[0].reshape(L, T, H, D).permute(0, 2, 1, 3)
            idx = torch.from_numpy(kept.astype(np.int64))[..., None].expand(L, H, T, D)
            want = rotate_keys(k_all.gather(2, idx), card.rope(), -n // 2)
            assert (got - want).abs().max().item() < 0.05, i  # one bf16 rounding


def test_token_dropped_chunks_come_back_in_order_after_a_restart(start_daemon):
    """A token-dropped form's placeholder chunks are numbered as they follow each other
    (issue 31): a restart lists them in the manifest's order, the order they are served in."""
    d = start_daemon(cpu="16KiB", ssd="64MiB")  # too small for it: compressed on the SSD
    chunks = _chunks(4) + _chunks(5)
    with KVClient(d.socket_path) as c:
        _register_card(c)
        keys = _put_lmcache_context(c, chunks)
        c.set_context_tokens(keys[0], list(range(100, 100 + len(chunks) * T)))
        _apply(c, "placer: fixed\nvariant: knorm@0.5\n")
        (ctx,) = c.contexts()
        assert (ctx.variant, ctx.tier) == ("knorm@0.5", "ssd")
        described = c.call(c.admin.DescribeContext, pb.DescribeContextRequest(context_id=keys[0]))
        placeholders = [o.spec.key for o in described.objects]
        assert len(placeholders) == len(chunks) // 2
    assert d.stop() == 0
    d.start()
    with KVClient(d.socket_path) as c:
        described = c.call(c.admin.DescribeContext, pb.DescribeContextRequest(context_id=keys[0]))
        assert [o.spec.key for o in described.objects] == placeholders
        assert described.summary.variant == "knorm@0.5"


@pytest.mark.parametrize("missing", ["card", "tokens", "refused"])
def test_token_dropping_waits_until_servable(start_daemon, missing):
    """Without the model card, the context's tokens, or with a model that cannot load dropped
    tokens exactly, the placer is not offered knorm@0.5 (the context stays whole), and
    DescribeContext says why; the variant follows once the tokens arrive."""
    d = start_daemon(cpu="1MiB", ssd="64MiB")
    with KVClient(d.socket_path) as c:
        if missing != "card":
            _register_card(c, refused="model x: ALiBi" if missing == "refused" else "")
        keys = _put_lmcache_context(c, _chunks(5))
        if missing != "tokens":
            c.set_context_tokens(keys[0], list(range(CHUNKS * T)))
        _apply(c, "placer: fixed\nvariant: knorm@0.5\n")
        ctx = next(x for x in c.contexts() if x.context_id == keys[0])
        assert ctx.variant == "none" and c.lookup(keys).prefix_hits == CHUNKS
        desc = c.call(c.admin.DescribeContext, pb.DescribeContextRequest(context_id=keys[0]))
        why = {"card": "no model card", "tokens": "no token ids", "refused": "ALiBi"}[missing]
        assert "left out until they can be served" in desc.reason and why in desc.reason
        if missing == "tokens":
            c.set_context_tokens(keys[0], list(range(CHUNKS * T)))
            _settle(c)
            ctx = next(x for x in c.contexts() if x.context_id == keys[0])
            assert ctx.variant == "knorm@0.5"


def test_variant_covers_what_the_prompts_agree_on(start_daemon):
    """Two prompts that share the context's first 3 chunks and differ after: the variant
    covers those 3 chunks (N = 48), so a prompt with either question finds it."""
    d = start_daemon(cpu="1MiB", ssd="64MiB")
    first = list(range(CHUNKS * T + 3))
    second = first[: 3 * T + 2] + [7] * 20
    with KVClient(d.socket_path) as c:
        _register_card(c)
        keys = _put_lmcache_context(c, _chunks(6))
        c.set_context_tokens(keys[0], first)
        c.set_context_tokens(keys[0], second)
        _apply(c, "placer: fixed\nvariant: knorm@0.5\n")
        digest = context_digest(MODEL, first[: 3 * T])
        manifest = Manifest.from_bytes(bytes(c.get(manifest_key(digest))))
        assert (manifest.num_tokens, manifest.num_kept) == (3 * T, 2 * T)  # 24 -> 2 chunks


@pytest.mark.slow
def test_compression_cut_short_keeps_the_original(start_daemon):
    d = start_daemon(cpu="1MiB", ssd="64MiB")
    chunks = _chunks(2)
    with KVClient(d.socket_path) as c:
        _put_context(c, "doc", chunks, durable=True)
        _settle(c)
    # A crash between writing the variant's objects and its manifest: leave objects with no
    # manifest on the SSD tier by writing them through a second, offline tier instance.
    d.stop()
    import asyncio

    from kvtierd.config import load_daemon_config
    from kvtierd.engine.context_kv import encode_variant
    from kvtierd.storage import create_tier
    from kvtierd.types import ObjectMeta

    async def leave_partial() -> None:
        ssd = create_tier(load_daemon_config(d.config).tier("ssd"))
        await ssd.start()
        metas = sorted(ssd.metas(), key=lambda m: m.key)
        kv = torch.cat(chunks, dim=2)
        fmts = [ChunkFormat.parse(m.layout) for m in metas]
        for obj in encode_variant("doc", list(metas), kv, fmts, "int8").objects[:2]:
            meta: ObjectMeta = obj.meta
            await ssd.put(meta, memoryview(obj.data))
        await ssd.close()

    asyncio.run(leave_partial())
    d.start()
    with KVClient(d.socket_path) as c:
        (ctx,) = c.contexts()
        assert ctx.variant == "none" and ctx.objects == CHUNKS
        assert bytes(c.get("doc/0")) == chunks[0].view(torch.uint8).numpy().tobytes()
        ssd = {t.name: t for t in c.tiers()}["ssd"]
        assert ssd.object_count == CHUNKS  # the partial variant's objects were deleted


def _put_int8(c: KVClient, cid: str, key: str, chunk: torch.Tensor) -> None:
    """What the LMCache plugin does when the write advice says int8: quantize, store in form."""
    from kvtierd.kernels.chunk_codec import chunk_format, encode_chunk

    fmt = chunk_format(chunk, H, "int8")
    data = encode_chunk(chunk, fmt)
    c.put(key, data, context_id=cid, variant="int8", layout=fmt.layout(), token_count=T,
          durable=True)  # fmt: skip


def test_chunks_added_in_form_join_a_compressed_context(start_daemon):
    """A context the daemon compressed to int8 keeps receiving int8 chunks from a client (a
    longer prompt extending it): they stay after a restart (they are not an original that
    the variant superseded), and a later compression re-encodes them with the rest."""
    d = start_daemon(cpu="1MiB", ssd="0")  # ssd unbounded: it keeps the reference original
    chunks, extra = _chunks(3), _chunks(4)[:2]
    keys = [f"doc/{i}" for i in range(CHUNKS + 2)]
    with KVClient(d.socket_path) as c:
        _put_context(c, "doc", chunks, durable=True)
        _read_once(c, keys[:CHUNKS])
        _apply(c, "placer: fixed\nvariant: int8\n")
        assert c.advise("doc").variant == "int8"
        for key, chunk in zip(keys[CHUNKS:], extra, strict=True):
            _put_int8(c, "doc", key, chunk)
        _settle(c)
        (ctx,) = c.contexts()
        assert (ctx.variant, ctx.objects) == ("int8", CHUNKS + 2)
    d.stop()
    d.start()
    with KVClient(d.socket_path) as c:
        (ctx,) = c.contexts()
        assert (ctx.variant, ctx.objects) == ("int8", CHUNKS + 2)
        assert c.lookup(keys).prefix_hits == CHUNKS + 2
        _read_once(c, keys[CHUNKS:])  # the client's durable int8 chunks, protected until read
        _apply(c, "placer: fixed\nvariant: int4\n")
        (ctx,) = c.contexts()
        assert (ctx.variant, ctx.objects) == ("int4", CHUNKS + 2)
        for key, chunk in zip(keys, chunks + extra, strict=True):
            with c.lease(key) as (info, _):
                assert info.spec.layout.endswith(";int4;g=32"), (key, info.spec.layout)
            err = (_decode(c, key).float() - chunk.float()).abs().max().item()
            assert err < 0.25 * chunk.float().abs().max().item(), (key, err)


def test_another_token_dropping_variant_replaces_the_manifest(start_daemon):
    """knorm@0.5, then keydiff@0.25 of the same context (from its reference copy): one
    placeholder manifest per digest, so the new variant's replaces the old one's, and its
    chunks are the only ones left."""
    d = start_daemon(cpu="1MiB", ssd="0")  # ssd unbounded: it keeps the reference original
    tokens = list(range(CHUNKS * T))
    with KVClient(d.socket_path) as c:
        _register_card(c)
        keys = _put_lmcache_context(c, _chunks(7))
        c.set_context_tokens(keys[0], tokens)
        key = manifest_key(context_digest(MODEL, tokens))
        old = None
        for variant, kept in (("knorm@0.5", CHUNKS // 2), ("keydiff@0.25", CHUNKS // 4)):
            _apply(c, f"placer: fixed\nvariant: {variant}\n")
            (ctx,) = c.contexts()
            manifest = Manifest.from_bytes(bytes(c.get(key)))
            assert (ctx.variant, ctx.objects, manifest.variant) == (variant, kept, variant)
            assert c.lookup(list(manifest.chunk_keys)).prefix_hits == kept
            if old is not None:
                assert not any(c.lookup(list(old.chunk_keys)).found)
            old = manifest
