"""A compressed context survives a restart wherever a move took it.

A daemon-made variant counts as complete at start only when its marker is found on a
persistent tier (the object the compression writes last: a quantized variant's key list, a
token-dropped one's placeholder manifest; engine/variant_writer.py). A context compressed in the CPU
tier has its marker there; each way its objects reach a persistent tier later — a plan's
move, a drain, the shutdown flush — must take the marker along, or the restart deletes the
variant as a compression cut short: bytes the daemon held and said it kept are lost.
"""

from __future__ import annotations

import time
import uuid

import numpy as np
import pytest
import torch

from kvtierd.client import KVClient
from kvtierd.kernels.chunk_codec import ChunkFormat
from kvtierd.kernels.placeholder import (
    MODEL_CARD_LAYOUT,
    Manifest,
    ModelCard,
    manifest_key,
    model_card_key,
)
from kvtierd.kernels.rope import RopeSpec
from kvtierd.router_protocol import context_digest
from kvtierd.rpc import kvtier_pb2 as pb

L, H, D, T, CHUNKS = 2, 2, 32, 16, 4  # a context: 4 chunks of 8 KiB (bf16)
MODEL = "/models/tiny"
VARIANTS = ["int8", "knorm@0.5"]  # a quantized variant and a token-dropped one


def _settle(c: KVClient) -> None:
    deadline = time.monotonic() + 20
    while c.status().pending_plans and time.monotonic() < deadline:
        time.sleep(0.02)


def _register_card(c: KVClient) -> None:
    """The LMCache plugin's model card: the daemon writes token-dropped forms only with it."""
    card = ModelCard(MODEL, D, RopeSpec.standard(D).inv_freq, 1000, (0, 1))
    data = np.frombuffer(card.to_bytes(), np.uint8)
    c.put(model_card_key(MODEL), data, context_id="card", layout=MODEL_CARD_LAYOUT)


def _put_context(c: KVClient, seed: int) -> str:
    """A context of LMCache chunks with its token ids (what the router sends); its id."""
    g = torch.Generator().manual_seed(seed)
    layout = ChunkFormat((2, L, T, H * D), "bfloat16", H).layout()
    keys = [f"{MODEL}@1@0@{seed:08x}{i:08x}@bfloat16" for i in range(CHUNKS)]
    for key in keys:
        chunk = torch.randn(2, L, T, H * D, generator=g).to(torch.bfloat16)
        c.put(key, chunk, context_id=keys[0], layout=layout, token_count=T)
    c.set_context_tokens(keys[0], [1000 * seed + i for i in range(CHUNKS * T)])
    return keys[0]


def _served_keys(c: KVClient, context_id: str, variant: str, seed: int) -> list[str]:
    """The keys a client loads the compressed context by: its own (quantized), or the
    placeholder chunks its manifest names (token-dropped)."""
    if variant == "int8":
        return [f"{MODEL}@1@0@{seed:08x}{i:08x}@bfloat16" for i in range(CHUNKS)]
    digest = context_digest(MODEL, [1000 * seed + i for i in range(CHUNKS * T)])
    manifest = Manifest.from_bytes(bytes(c.get(manifest_key(digest))))
    assert manifest.source_context == context_id
    return [manifest_key(digest), *manifest.chunk_keys]


def _compress_in_cpu(c: KVClient, variant: str, seed: int) -> dict[str, bytes]:
    """A context compressed to ``variant`` by the executor in the CPU tier; the bytes of what
    serves it (objects and marker), read while it is there."""
    cid = _put_context(c, seed)
    c.call(c.admin.ApplyPolicy, pb.ApplyPolicyRequest(
        yaml=f"placer: fixed\nvariant: {variant}\n", source="test.yaml"))  # fmt: skip
    _settle(c)
    ctx = next(x for x in c.contexts() if x.context_id == cid)
    assert (ctx.variant, ctx.tier) == (variant, "cpu")
    return {key: bytes(c.get(key)) for key in _served_keys(c, cid, variant, seed)}


def _assert_kept(c: KVClient, variant: str, stored: dict[str, bytes]) -> None:
    """After the restart: the context is there in its variant, every byte as it was."""
    (ctx,) = c.contexts()
    assert ctx.variant == variant, (ctx.variant, ctx.objects)
    assert ctx.objects == len(stored) - (variant != "int8")  # (the manifest is no object)
    assert {key: bytes(c.get(key)) for key in stored} == stored


def _remote(request: pytest.FixtureRequest) -> dict[str, object]:
    cluster = request.getfixturevalue("redis_cluster")
    return {
        "name": "remote", "kind": "remote", "capacity": "64MiB",  # bounded: no reference copy
        "options": {"nodes": cluster.addresses, "namespace": f"moves-{uuid.uuid4().hex[:12]}",
                    "value_bytes": 1 << 20},
    }  # fmt: skip


@pytest.mark.parametrize("variant", VARIANTS)
@pytest.mark.parametrize("store", ["ssd", pytest.param("remote", marks=pytest.mark.redis)])
def test_drained_down_a_compressed_context_survives_a_restart(
    start_daemon, request, variant, store
):
    """Compressed in the CPU tier, drained to the SSD tier (and on to the remote store):
    the restart finds it whole in its variant. (No shutdown flush: only the drain moves it.)"""
    extra = [_remote(request)] if store == "remote" else []
    d = start_daemon(cpu="1MiB", ssd="64MiB", extra_tiers=extra, shutdown_flush_s=0)
    with KVClient(d.socket_path, timeout_s=20) as c:
        _register_card(c)
        stored = _compress_in_cpu(c, variant, seed=1)
        for tier in ("cpu", "ssd")[: 1 if store == "ssd" else 2]:
            c.drain(tier)
            _settle(c)
        assert [x.tier for x in c.contexts()] == [store]
    assert d.stop() == 0
    d.start()
    with KVClient(d.socket_path, timeout_s=20) as c:
        _assert_kept(c, variant, stored)


@pytest.mark.parametrize("variant", VARIANTS)
def test_flushed_at_shutdown_a_compressed_context_survives_a_restart(start_daemon, variant):
    """Compressed in the CPU tier, written to the SSD tier by the shutdown flush."""
    d = start_daemon(cpu="1MiB", ssd="64MiB")
    with KVClient(d.socket_path, timeout_s=20) as c:
        _register_card(c)
        stored = _compress_in_cpu(c, variant, seed=2)
    assert d.stop() == 0
    assert "shutdown flush: wrote 1 of 1 cpu-tier contexts" in d.logs()
    d.start()
    with KVClient(d.socket_path, timeout_s=20) as c:
        _assert_kept(c, variant, stored)


@pytest.mark.parametrize("variant", VARIANTS)
def test_moved_down_by_a_plan_a_compressed_context_survives_a_restart(start_daemon, variant):
    """Compressed in a CPU tier with room for one compressed context: a second one pushes
    the first down to the SSD tier (the placer's ``move``). Only that one is asked for after
    the restart: the second was in the CPU tier and is gone (no shutdown flush)."""
    d = start_daemon(cpu="24KiB", ssd="64MiB", shutdown_flush_s=0)
    with KVClient(d.socket_path, timeout_s=20) as c:
        _register_card(c)
        stored = _compress_in_cpu(c, variant, seed=3)
        second = _put_context(c, seed=4)
        _settle(c)
        where = {x.context_id: (x.variant, x.tier) for x in c.contexts()}
        assert where[second] == (variant, "cpu")
        assert sorted(where.values()) == [(variant, "cpu"), (variant, "ssd")]
    assert d.stop() == 0
    d.start()
    with KVClient(d.socket_path, timeout_s=20) as c:
        _assert_kept(c, variant, stored)
