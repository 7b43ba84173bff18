"""The plugin serves a daemon-made token-dropped variant (issue 17.1) without vLLM: the plugin
(with LMCache's real config, key type and hashing) registers the model card, the daemon
compresses a context the placer chose to compress, the router's own lookup finds the rewrite,
and LMCache's keys of the placeholder prompt — tagged as the router tags them — hit and load
the daemon's chunks through the plugin."""

from __future__ import annotations

import asyncio
import json
import time
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch

from kvtierd.client import AsyncKVClient, KVClient
from kvtierd.integrations.router.rewrite import find_rewrite
from kvtierd.kernels.chunk_codec import ChunkFormat, decode_chunk
from kvtierd.kernels.placeholder import Manifest, manifest_key
from kvtierd.router_protocol import context_digest
from kvtierd.rpc import kvtier_pb2 as pb
from tests.integrations.test_put_decision import _Allocator

L, H, D, T, CHUNKS = 2, 2, 64, 16, 4


def _model_dir(tmp_path: Path) -> Path:
    config = {"architectures": ["LlamaForCausalLM"], "model_type": "llama",
              "num_attention_heads": 4, "num_key_value_heads": H, "hidden_size": 4 * D,
              "vocab_size": 1000, "rope_theta": 10000.0, "bos_token_id": 1,
              "eos_token_id": 2}  # fmt: skip
    tmp_path.mkdir(parents=True, exist_ok=True)
    (tmp_path / "config.json").write_text(json.dumps(config))
    return tmp_path


def _plugin(socket_path: str, model: str) -> Any:
    pytest.importorskip("lmcache")
    from lmcache.v1.config import LMCacheEngineConfig

    from kvtierd.integrations.lmcache_plugin import KvtierdStoragePlugin

    config = LMCacheEngineConfig.from_defaults(
        chunk_size=T, pre_caching_hash_algorithm="sha256_cbor", local_cpu=False,
        extra_config={"kvtierd.socket_path": socket_path},
    )  # fmt: skip
    metadata = SimpleNamespace(kv_shape=(L, 2, T, H, D), model_name=model, world_size=1,
                               worker_id=0, kv_dtype=torch.bfloat16, use_mla=False)  # fmt: skip
    return KvtierdStoragePlugin("cpu", config, metadata, _Allocator())


def _keys(plugin: Any, tokens: list[int], tags: dict[str, str] | None = None) -> list[Any]:
    from lmcache.v1.token_database import ChunkedTokenDatabase

    db = ChunkedTokenDatabase(plugin.config, plugin.metadata)
    return [r[2] for r in db.process_tokens(tokens=torch.tensor(tokens), request_configs=tags)]


def test_a_daemon_variant_loads_through_the_plugin(start_daemon: Any, tmp_path: Path) -> None:
    d = start_daemon(cpu="8MiB", ssd="32MiB")
    model = str(_model_dir(tmp_path / "model"))
    plugin = _plugin(d.socket_path, model)
    prompt = [(7 * i) % 900 + 10 for i in range(CHUNKS * T + 5)]
    g = torch.Generator().manual_seed(0)
    objs = [SimpleNamespace(tensor=torch.randn(2, L, T, H * D, generator=g).to(torch.bfloat16))
            for _ in range(CHUNKS)]  # fmt: skip
    with KVClient(d.socket_path) as c:
        c.call(c.admin.ApplyPolicy, pb.ApplyPolicyRequest(
            yaml="placer: fixed\nvariant: knorm@0.5\n", source="t"))  # fmt: skip
        keys = _keys(plugin, prompt)
        assert plugin.batched_contains(keys, pin=True) == 0
        plugin.batched_submit_put_task(keys[:CHUNKS], objs)  # LMCache stores the prompt
        (ctx,) = c.contexts()
        assert ctx.variant == "none"  # no token ids yet: knorm@0.5 cannot be served
        c.set_context_tokens(ctx.context_id, prompt[: CHUNKS * T])
        deadline = time.monotonic() + 30
        while c.contexts()[0].variant != "knorm@0.5" and time.monotonic() < deadline:
            time.sleep(0.1)
        assert c.contexts()[0].variant == "knorm@0.5"

    async def rewrite() -> Any:
        async with AsyncKVClient(d.socket_path) as ac:
            return await find_rewrite(ac, model, prompt, T, 30.0)

    rw = asyncio.run(rewrite())
    n = CHUNKS * T
    assert rw is not None and rw.manifest.num_tokens == n
    assert rw.manifest_key == manifest_key(context_digest(model, prompt[:n]))
    assert rw.prompt_ids == [*rw.manifest.placeholder_ids, *prompt[n:]]
    keys = _keys(plugin, rw.prompt_ids, rw.kv_transfer_params)
    kept = rw.manifest.num_kept // T
    assert plugin.batched_contains(keys, pin=True) == kept
    loaded = plugin.batched_get_blocking(keys[:kept])
    with KVClient(d.socket_path) as c:
        for obj, key in zip(loaded, rw.manifest.chunk_keys, strict=True):
            with c.lease(key) as (info, view):
                fmt = ChunkFormat.parse(info.spec.layout)
                want = torch.empty(fmt.shape, dtype=torch.bfloat16)
                decode_chunk(torch.frombuffer(bytearray(view), dtype=torch.uint8), fmt, want)
            assert torch.equal(obj.tensor, want)
    assert plugin.stats.errors == 0, plugin.stats.last_error
    assert Manifest.from_bytes(rw.manifest.to_bytes()) == rw.manifest
    plugin.close()
