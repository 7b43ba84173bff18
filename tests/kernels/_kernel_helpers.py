"""Shared helpers of the kernel tests (imported by name: pytest puts this folder on sys.path)."""

from __future__ import annotations

import torch

from kvtierd.kernels.layout import KVSource

DTYPES = (torch.float16, torch.bfloat16, torch.float32)

# Tolerances for float math that the two backends order differently (reductions) or round
# differently (the interpreter casts float32 -> bfloat16 by truncation, CUDA rounds to
# nearest): one unit in the last place of the output dtype, relative.
TOL = {
    torch.float16: {"atol": 1e-3, "rtol": 2**-10},
    torch.bfloat16: {"atol": 1e-2, "rtol": 2**-7},
    torch.float32: {"atol": 1e-6, "rtol": 1e-5},
}
SCORE_TOL = {"atol": 1e-5, "rtol": 1e-5}  # float32 scores, any input dtype


def make_kv(
    layers: int, heads: int, tokens: int, dim: int, dtype: torch.dtype, *, seed: int = 0
) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    k = torch.randn(layers, heads, tokens, dim, generator=g).to(dtype)
    v = torch.randn(layers, heads, tokens, dim, generator=g).to(dtype)
    return k, v


def paged_source(
    keys: torch.Tensor, values: torch.Tensor, block_size: int, layout: str, seed: int = 1
) -> KVSource:
    """Scatter [L, H, N, D] into a vLLM-style paged cache with a shuffled block table."""
    lyr, h, n, d = keys.shape
    nb_needed = -(-n // block_size)
    num_blocks = nb_needed + 3
    g = torch.Generator().manual_seed(seed)
    table = torch.randperm(num_blocks, generator=g)[:nb_needed].to(torch.int32)
    caches = []
    for layer in range(lyr):
        if layout == "flash":
            c = torch.full((2, num_blocks, block_size, h, d), float("nan"), dtype=keys.dtype)
            view_k, view_v = c[0], c[1]
        else:
            # vLLM-CPU: per (block, head), K transposed [D, bs] then V [bs, D] (layout.py)
            c = torch.full((num_blocks, h, block_size, 2 * d), float("nan"), dtype=keys.dtype)
            region = c.view(num_blocks, h, 2, block_size * d)
            k_t = region[:, :, 0].view(num_blocks, h, d, block_size)
            v_r = region[:, :, 1].view(num_blocks, h, block_size, d)
        for t in range(0, n, block_size):
            blk = int(table[t // block_size])
            span = min(block_size, n - t)
            if layout == "flash":
                view_k[blk, :span] = keys[layer, :, t : t + span].permute(1, 0, 2)
                view_v[blk, :span] = values[layer, :, t : t + span].permute(1, 0, 2)
            else:
                k_t[blk, :, :, :span] = keys[layer, :, t : t + span].transpose(1, 2)
                v_r[blk, :, :span] = values[layer, :, t : t + span]
        caches.append(c)
    return KVSource.from_vllm_paged(caches, table, n, kv_layout=layout)  # type: ignore[arg-type]


def assert_same_kept(
    got: torch.Tensor, want: torch.Tensor, ref_scores: torch.Tensor, tol: float = 1e-5
) -> None:
    """Kept sets must be identical, except where float rounding reorders near-tied scores:
    every position in one set but not the other must score within ``tol`` of the cut."""
    assert got.shape == want.shape and got.dtype == want.dtype == torch.int32
    assert torch.equal(got, got.sort(dim=-1).values), "kept positions not ascending"
    if torch.equal(got, want):
        return
    m = want.shape[-1]
    for idx in zip(*torch.nonzero((got != want).any(dim=-1), as_tuple=True), strict=True):
        row_s = ref_scores[idx]
        cut = torch.sort(row_s, descending=True, stable=True).values[m - 1]
        diff = set(got[idx].tolist()) ^ set(want[idx].tolist())
        for p in diff:
            assert abs(float(row_s[p]) - float(cut)) <= tol * max(1.0, abs(float(cut))), (
                f"row {tuple(int(i) for i in idx)}: position {p} score {float(row_s[p])} is not "
                f"near the cut {float(cut)}"
            )
