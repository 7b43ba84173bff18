"""The torch CPU connector against vLLM-CPU's own cache writer (no engine, a few seconds).

vLLM's ``cpu_attn_reshape_and_cache`` writes distinct bit patterns into a paged cache; the
connector must read them back as the same K and V (``from_gpu``), and what it writes
(``to_gpu``) must equal what the op writes for the same tokens.
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest

pytestmark = pytest.mark.vllm

NB, H, BS, D, L = 3, 2, 128, 64, 2
SLOTS = [130, 131, 5, 260, 200, 6]


def _kv(t: int, offset: int):
    import torch

    idx = torch.arange(t * H * D, dtype=torch.int32).view(t, H, D)
    return (idx + 0x3C00 + offset).to(torch.int16).view(torch.bfloat16)


def _written_by_vllm(isa: str):
    import torch

    ops = pytest.importorskip("vllm._custom_ops")
    caches = []
    for layer in range(L):
        cache = torch.zeros(NB, H, BS, 2 * D, dtype=torch.bfloat16)
        kc, vc = cache.view(NB, H, 2 * BS, D).chunk(2, dim=2)
        slots = torch.tensor(SLOTS, dtype=torch.long)
        ops.cpu_attn_reshape_and_cache(
            _kv(len(SLOTS), 7 * layer), _kv(len(SLOTS), 0x400 + 7 * layer), kc, vc, slots, isa
        )
        caches.append(cache)
    return caches


@pytest.mark.parametrize("isa", ["vec", "vec16"])
def test_connector_matches_vllm_cpu_cache_layout(isa: str) -> None:
    import torch

    pytest.importorskip("lmcache")
    from lmcache.v1.memory_management import MemoryFormat

    from kvtierd.integrations.paged_cpu import TorchPagedCPUConnector

    caches = _written_by_vllm(isa)
    conn = TorchPagedCPUConnector(L, H, D)
    t = len(SLOTS)
    obj = SimpleNamespace(
        tensor=torch.zeros(2, L, t, H * D, dtype=torch.bfloat16),
        metadata=SimpleNamespace(fmt=MemoryFormat.UNDEFINED),
    )
    slot_mapping = torch.tensor(SLOTS)
    conn.from_gpu(obj, 0, t, kvcaches=caches, slot_mapping=slot_mapping)
    for layer in range(L):
        assert torch.equal(obj.tensor[0, layer], _kv(t, 7 * layer).reshape(t, H * D))
        assert torch.equal(obj.tensor[1, layer], _kv(t, 0x400 + 7 * layer).reshape(t, H * D))

    fresh = [torch.zeros_like(c) for c in caches]
    conn.to_gpu(obj, 0, t, kvcaches=fresh, slot_mapping=slot_mapping)
    for got, want in zip(fresh, caches, strict=True):
        assert torch.equal(got.view(torch.int16), want.view(torch.int16))


def test_to_gpu_skips_tokens_vllm_already_has() -> None:
    import torch

    pytest.importorskip("lmcache")
    from lmcache.v1.memory_management import MemoryFormat

    from kvtierd.integrations.paged_cpu import TorchPagedCPUConnector

    conn = TorchPagedCPUConnector(L, H, D)
    obj = SimpleNamespace(
        tensor=torch.ones(2, L, 4, H * D, dtype=torch.bfloat16),
        metadata=SimpleNamespace(fmt=MemoryFormat.KV_2LTD),
    )
    caches = [torch.zeros(NB, H, BS, 2 * D, dtype=torch.bfloat16) for _ in range(L)]
    conn.to_gpu(obj, 0, 4, kvcaches=caches, slot_mapping=torch.arange(4), vllm_cached_tokens=2)
    region = caches[0].view(NB, H, 2 * BS * D)
    k = region[:, :, : BS * D].view(NB, H, D, BS)
    assert bool((k[0, :, :, :2] == 0).all())
    assert bool((k[0, :, :, 2:4] == 1).all())
