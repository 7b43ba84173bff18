"""One launch over every layer: ``_tl_common.layer_runs`` stacks the layers' views when they are
evenly spaced in one storage (a contiguous ``[L, H, N, D]``, or one allocation holding every
layer's paged cache), and falls back to a launch per layer otherwise (vLLM's per-layer caches);
both paths score and gather exactly as the torch reference."""

from __future__ import annotations

import pytest
import torch
from _kernel_helpers import make_kv, paged_source

from kvtierd.kernels._tl_common import layer_runs, source_runs
from kvtierd.kernels.base import gather_kv, select_kept
from kvtierd.kernels.layout import KVSource
from kvtierd.kernels.registry import get_method
from kvtierd.kernels.rope import RopeSpec
from kvtierd.kernels.snapkv import SnapKVMethod

L, H, N, D, BS = 3, 2, 45, 32, 8


def _one_allocation_paged(k: torch.Tensor, v: torch.Tensor) -> KVSource:
    """The per-layer paged caches of ``paged_source``, copied into slices of one tensor."""
    per_layer = paged_source(k, v, BS, "flash")
    nb = per_layer.layer_keys[0].shape[0]
    whole = torch.empty((L, 2, nb, BS, H, D), dtype=k.dtype)
    for i in range(L):
        whole[i, 0] = per_layer.layer_keys[i]
        whole[i, 1] = per_layer.layer_values[i]
    return KVSource.from_vllm_paged(list(whole.unbind(0)), per_layer.block_table, N)


def _sources() -> dict[str, tuple[KVSource, int]]:
    k, v = make_kv(L, H, N, D, torch.bfloat16)
    return {
        "contiguous": (KVSource.from_contiguous(k, v), 1),
        "paged, one allocation": (_one_allocation_paged(k, v), 1),
        "paged, a tensor per layer": (paged_source(k, v, BS, "flash"), L),
    }


@pytest.mark.parametrize("name", list(_sources()))
def test_layer_runs_stack_when_the_memory_allows(name: str) -> None:
    source, runs_wanted = _sources()[name]
    runs = layer_runs(source.layer_keys, source.layer_values)
    assert len(runs) == runs_wanted
    assert sum(r.keys.shape[0] for r in runs) == L
    for r in runs:
        for i in range(r.keys.shape[0]):
            for got, want in ((r.keys[i], source.layer_keys), (r.values[i], source.layer_values)):
                # (unused paged blocks hold NaN)
                torch.testing.assert_close(got, want[r.first + i], atol=0, rtol=0, equal_nan=True)


@pytest.mark.parametrize("make", ["contiguous", "kv_2ltd"])
def test_sources_made_from_one_tensor_carry_their_stacked_run(make: str) -> None:
    """``source_runs`` takes the stacked views without looking at each layer's: they are
    exactly the run ``layer_runs`` finds."""
    k, v = make_kv(L, H, N, D, torch.bfloat16)
    if make == "contiguous":
        source = KVSource.from_contiguous(k, v)
    else:
        kv = torch.stack([k, v]).permute(0, 1, 3, 2, 4).reshape(2, L, N, H * D)
        source = KVSource.from_kv_2ltd(kv, H)
    (got,) = source_runs(source)
    (want,) = layer_runs(source.layer_keys, source.layer_values)
    assert got.first == want.first == 0
    for a, b in ((got.keys, want.keys), (got.values, want.values)):
        assert (a.data_ptr(), a.shape, a.stride()) == (b.data_ptr(), b.shape, b.stride())


def test_uneven_layers_are_not_stacked() -> None:
    k, v = make_kv(L, H, N, D, torch.float32)
    source = KVSource.from_contiguous(k, v)
    keys = (source.layer_keys[0], source.layer_keys[2], source.layer_keys[1])  # out of order
    assert len(layer_runs(keys, source.layer_values)) == L


@pytest.mark.parametrize("name", list(_sources()))
@pytest.mark.parametrize("method", ["knorm", "keydiff", "paged_eviction", "snapkv"])
def test_scores_and_gather_in_one_launch_match_the_reference(name: str, method: str) -> None:
    source, _ = _sources()[name]
    m = SnapKVMethod(window=16) if method == "snapkv" else get_method(method)
    q = torch.randn(L, 2 * H, 16, D, generator=torch.Generator().manual_seed(2))
    q = q.to(torch.bfloat16) if method == "snapkv" else None
    ref = m.score(source, q, backend="torch")
    tri = m.score(source, q, backend="triton")
    torch.testing.assert_close(tri, ref, atol=1e-5, rtol=1e-5)
    kept = select_kept(ref, N // 2, backend="torch")
    rope = RopeSpec.standard(D, theta=10000.0)
    for kwargs in ({}, {"rope": rope, "delta": N // 2 - N}):
        rk, rv = gather_kv(source, kept, backend="torch", **kwargs)  # type: ignore[arg-type]
        tk, tv = gather_kv(source, kept, backend="triton", **kwargs)  # type: ignore[arg-type]
        assert torch.equal(tv, rv)
        torch.testing.assert_close(tk, rk, atol=1e-2, rtol=7.8e-3)
