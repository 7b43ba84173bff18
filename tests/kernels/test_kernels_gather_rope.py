"""Gather/compaction (bitwise) over every layout, and RoPE delta rotation fused into it."""

from __future__ import annotations

import math

import pytest
import torch
from _kernel_helpers import DTYPES, TOL, make_kv, paged_source

from kvtierd.kernels.api import compress_dense, compress_kv, to_kv_2ltd
from kvtierd.kernels.base import gather_kv
from kvtierd.kernels.layout import KVSource
from kvtierd.kernels.rope import RopeSpec, rotate_keys


def _kept(lyr: int, h: int, n: int, m: int, seed: int = 3) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    rows = [torch.randperm(n, generator=g)[:m].sort().values for _ in range(lyr * h)]
    return torch.stack(rows).view(lyr, h, m).to(torch.int32)


def _sources(k: torch.Tensor, v: torch.Tensor) -> dict[str, KVSource]:
    lyr, h, n, d = k.shape
    kv = torch.stack([k, v]).permute(0, 1, 3, 2, 4).reshape(2, lyr, n, h * d)
    return {
        "contiguous": KVSource.from_contiguous(k, v),
        "strided": KVSource.from_contiguous(
            k.transpose(1, 2).contiguous().transpose(1, 2),
            v.transpose(1, 2).contiguous().transpose(1, 2),
        ),
        "kv_2ltd": KVSource.from_kv_2ltd(kv, h),
        "paged_flash": paged_source(k, v, 16, "flash"),
        "paged_cpu": paged_source(k, v, 8, "cpu"),
    }


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_gather_is_bitwise_on_every_layout(dtype: torch.dtype) -> None:
    k, v = make_kv(2, 3, 45, 24, dtype)
    kept = _kept(2, 3, 45, 19)
    want_k, want_v = gather_kv(KVSource.from_contiguous(k, v), kept, backend="torch")
    idx = kept.long().unsqueeze(-1).expand(-1, -1, -1, 24)
    assert torch.equal(want_k, k.gather(2, idx)) and torch.equal(want_v, v.gather(2, idx))
    for name, src in _sources(k, v).items():
        for backend in ("torch", "triton"):
            got_k, got_v = gather_kv(src, kept, backend=backend)  # type: ignore[arg-type]
            assert torch.equal(got_k, want_k), (name, backend)
            assert torch.equal(got_v, want_v), (name, backend)


@pytest.mark.parametrize("style", ["neox", "gptj"])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_fused_rotation_matches_reference(dtype: torch.dtype, style: str) -> None:
    k, v = make_kv(2, 2, 40, 24, dtype)
    kept = _kept(2, 2, 40, 13)
    rope = RopeSpec.standard(24, rotary_dim=16, style=style)  # type: ignore[arg-type]
    want_k, want_v = gather_kv(
        KVSource.from_contiguous(k, v), kept, rope=rope, delta=-27, backend="torch"
    )
    for name, src in _sources(k, v).items():
        got_k, got_v = gather_kv(src, kept, rope=rope, delta=-27, backend="triton")
        torch.testing.assert_close(got_k, want_k, **TOL[dtype], msg=name)
        assert torch.equal(got_v, want_v)
        assert torch.equal(got_k[..., 16:], want_k[..., 16:])  # beyond rotary_dim: untouched


@pytest.mark.parametrize("style", ["neox", "gptj"])
def test_rotate_delta_then_minus_delta_is_identity(style: str) -> None:
    k, _ = make_kv(1, 2, 30, 32, torch.float32)
    spec = RopeSpec.standard(32, rotary_dim=24, style=style)  # type: ignore[arg-type]
    back = rotate_keys(rotate_keys(k, spec, 1234), spec, -1234)
    torch.testing.assert_close(back, k, atol=1e-5, rtol=1e-5)
    src = KVSource.from_contiguous(k, k)
    kept = torch.arange(30, dtype=torch.int32).expand(1, 2, 30).contiguous()
    fwd, _ = gather_kv(src, kept, rope=spec, delta=777, backend="triton")
    back, _ = gather_kv(
        KVSource.from_contiguous(fwd, fwd), kept, rope=spec, delta=-777, backend="triton"
    )
    torch.testing.assert_close(back, k, atol=1e-5, rtol=1e-5)


def _rope_at(x: torch.Tensor, spec: RopeSpec, positions: list[int]) -> torch.Tensor:
    """Rotate token t of ``x`` [..., T, D] to positions[t] (pre-RoPE -> post-RoPE)."""
    return torch.stack(
        [rotate_keys(x[..., t : t + 1, :], spec, p)[..., 0, :] for t, p in enumerate(positions)],
        dim=-2,
    )


@pytest.mark.parametrize("backend", ["torch", "triton"])
@pytest.mark.parametrize("style", ["neox", "gptj"])
def test_attention_after_compression_matches_original_positions(style: str, backend: str) -> None:
    """A query at M+i over the rotated kept keys == at N+i over the original kept keys."""
    torch.manual_seed(0)
    lyr, h, n, d, extra = 1, 2, 48, 32, 3
    spec = RopeSpec.standard(d, rotary_dim=24, style=style, theta=500.0)  # type: ignore[arg-type]
    k_pre, v = make_kv(lyr, h, n, d, torch.float64 if False else torch.float32)
    k = _rope_at(k_pre, spec, list(range(n)))  # what a cache holds: keys rotated by position
    out = compress_dense(k, v, "knorm@0.5", rope=spec, backend=backend)  # type: ignore[arg-type]
    m = out.num_kept
    assert out.rope_delta == m - n
    q_pre = torch.randn(lyr, h, extra, d)
    idx = out.kept.long().unsqueeze(-1).expand(-1, -1, -1, d)
    k_orig, v_orig = k.gather(2, idx), v.gather(2, idx)
    q_orig = _rope_at(q_pre, spec, [n + i for i in range(extra)])
    q_new = _rope_at(q_pre, spec, [m + i for i in range(extra)])
    assert isinstance(out.keys, torch.Tensor) and isinstance(out.values, torch.Tensor)
    a_orig = torch.softmax(q_orig @ k_orig.transpose(-1, -2) / math.sqrt(d), -1) @ v_orig
    a_new = torch.softmax(q_new @ out.keys.transpose(-1, -2) / math.sqrt(d), -1) @ out.values
    torch.testing.assert_close(a_new, a_orig, atol=1e-5, rtol=1e-4)
    # without the rotation the attention is wrong (the test can fail)
    a_bad = torch.softmax(q_new @ k_orig.transpose(-1, -2) / math.sqrt(d), -1) @ v_orig
    assert (a_bad - a_orig).abs().max() > 1e-3


def test_kv_2ltd_round_trip_and_output() -> None:
    k, v = make_kv(2, 2, 20, 8, torch.bfloat16)
    kv = to_kv_2ltd(k, v)
    assert kv.shape == (2, 2, 20, 16)
    src = KVSource.from_kv_2ltd(kv, 2)
    dk, dv = src.to_dense()
    assert torch.equal(dk, k) and torch.equal(dv, v)
    out = compress_kv(src, "none", backend="triton")
    assert torch.equal(out.keys, k)  # type: ignore[arg-type]
