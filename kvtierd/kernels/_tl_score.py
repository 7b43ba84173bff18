# ruff: noqa: N803, PLR0917
# mypy: disable-error-code="untyped-decorator,no-untyped-def"
# Triton kernels: upper-case constexpr names and long positional argument lists are the
# Triton idiom; their parameters cannot carry Python type annotations.
"""Triton scoring kernels for the norm family: ``knorm``, ``paged_eviction``, ``keydiff``.

One program per (KV head, block of tokens, layer), one launch over every layer when the
layers' views stack (``_tl_common.layer_runs``); reads K (and V) once through the block table
(``_tl_common.token_offset``), writes float32 ``[L, H, N]``. Keydiff's anchor is a
deterministic two-stage reduction: per-chunk partial sums of unit keys, then a torch sum.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kvtierd.kernels._tl_common import block_d, check_device, source_runs, token_offset
from kvtierd.kernels.layout import KVSource

MODE_KNORM = 0
MODE_VK_RATIO = 1
MODE_KEYDIFF = 2
NORM_EPS = 1e-12
BLOCK_N = 64
# tokens a program of keydiff's anchor pass sums: 16k programs at 32 layers x 8 heads x 32k
# tokens, each reading 128 KiB of K (sm_90 unrolls its 8 steps and has their loads in flight)
ANCHOR_CHUNK = 512


@triton.jit
def _load_rows(ptr, bt_ptr, t, h, d, N, D, block_size, s_blk, s_slot, s_h, s_d):
    tm = t < N
    row = token_offset(bt_ptr, t, tm, block_size, s_blk, s_slot) + h * s_h
    offs = row[:, None] + d[None, :].to(tl.int64) * s_d
    m = tm[:, None] & (d[None, :] < D)
    return tl.load(ptr + offs, mask=m, other=0.0).to(tl.float32)


@triton.jit
def _norm_score_kernel(
    k_ptr, v_ptr, bt_ptr, anchor_ptr, out_ptr,
    H, N, D, block_size,
    ks_l, ks_blk, ks_slot, ks_h, ks_d, vs_l, vs_blk, vs_slot, vs_h, vs_d,
    MODE: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
):  # fmt: skip
    h = tl.program_id(0).to(tl.int64)
    t = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    layer = tl.program_id(2).to(tl.int64)
    k_ptr += layer * ks_l
    v_ptr += layer * vs_l
    anchor_ptr += layer * H * D
    out_ptr += layer * H * N
    d = tl.arange(0, BLOCK_D)
    k = _load_rows(k_ptr, bt_ptr, t, h, d, N, D, block_size, ks_blk, ks_slot, ks_h, ks_d)
    k_norm = tl.sqrt(tl.sum(k * k, axis=1))
    if MODE == 0:
        score = -k_norm
    elif MODE == 1:
        v = _load_rows(v_ptr, bt_ptr, t, h, d, N, D, block_size, vs_blk, vs_slot, vs_h, vs_d)
        v_norm = tl.sqrt(tl.sum(v * v, axis=1))
        score = v_norm / tl.maximum(k_norm, 1e-12)
    else:
        a = tl.load(anchor_ptr + h * D + d, mask=d < D, other=0.0)
        a_norm = tl.sqrt(tl.sum(a * a, axis=0))
        dot = tl.sum(k * a[None, :], axis=1)
        score = -dot / tl.maximum(k_norm * a_norm, 1e-12)
    tl.store(out_ptr + h * N + t, score, mask=t < N)


@triton.jit
def _unit_key_sum_kernel(
    k_ptr, bt_ptr, out_ptr, H, N, D, block_size, ks_l, ks_blk, ks_slot, ks_h, ks_d,
    CHUNK: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
):  # fmt: skip
    """Sum of the unit keys of ``CHUNK`` tokens (``BLOCK_N`` at a time) of one (layer, head).

    A row is scaled by its reciprocal norm (one division a row, an fma an element, not a
    division an element) into a ``[BLOCK_N, BLOCK_D]`` accumulator, summed over its rows once
    at the end: the reduction across warps happens once a chunk, and the float32 partial sums
    that ``keydiff_anchors`` adds up in torch are ``CHUNK / 64`` times fewer (at 32 layers x 8
    heads x 128 and 32k tokens, 64-token chunks wrote 64 MiB of partials, read back by a torch
    sum: 6 % of the bytes of K, on top of the pass over K)."""
    h = tl.program_id(0).to(tl.int64)
    c = tl.program_id(1)
    nc = tl.num_programs(1)
    layer = tl.program_id(2).to(tl.int64)
    k_ptr += layer * ks_l
    out_ptr += layer * H * nc * D
    d = tl.arange(0, BLOCK_D)
    acc = tl.zeros([BLOCK_N, BLOCK_D], tl.float32)
    for i in range(0, CHUNK, BLOCK_N):
        t = c * CHUNK + i + tl.arange(0, BLOCK_N)
        k = _load_rows(k_ptr, bt_ptr, t, h, d, N, D, block_size, ks_blk, ks_slot, ks_h, ks_d)
        inv = 1.0 / tl.maximum(tl.sqrt(tl.sum(k * k, axis=1)), 1e-12)
        acc += k * inv[:, None]
    tl.store(out_ptr + (h * nc + c) * D + d, tl.sum(acc, axis=0), mask=d < D)


def _launch_norm(source: KVSource, mode: int, anchors: torch.Tensor | None) -> torch.Tensor:
    lyr, h, n, d = source.num_layers, source.num_kv_heads, source.num_tokens, source.head_dim
    out = torch.empty((lyr, h, n), dtype=torch.float32, device=source.device)
    for run in source_runs(source):
        k, v, first = run.keys, run.values, run.first
        anchor = anchors[first:] if anchors is not None else out[first:]
        _norm_score_kernel[(h, triton.cdiv(n, BLOCK_N), k.shape[0])](
            k, v, source.block_table, anchor, out[first:], h, n, d, source.block_size,
            *k.stride(), *v.stride(), MODE=mode, BLOCK_N=BLOCK_N, BLOCK_D=block_d(d),
        )  # fmt: skip
    return out


def norm_scores(source: KVSource, mode: int) -> torch.Tensor:
    """``-||k||`` (``MODE_KNORM``) or ``||v|| / ||k||`` (``MODE_VK_RATIO``): float32 ``[L,H,N]``."""
    check_device(source.layer_keys[0])
    return _launch_norm(source, mode, None)


def keydiff_anchors(source: KVSource) -> torch.Tensor:
    """Mean unit key per (layer, head), float32 ``[L, H, D]``."""
    check_device(source.layer_keys[0])
    lyr, h, n, d = source.num_layers, source.num_kv_heads, source.num_tokens, source.head_dim
    chunk = min(ANCHOR_CHUNK, BLOCK_N * triton.cdiv(n, BLOCK_N))
    chunks = triton.cdiv(n, chunk)
    partial = torch.empty((lyr, h, chunks, d), dtype=torch.float32, device=source.device)
    for run in source_runs(source):
        k = run.keys
        _unit_key_sum_kernel[(h, chunks, k.shape[0])](
            k, source.block_table, partial[run.first :], h, n, d, source.block_size,
            *k.stride(), CHUNK=chunk, BLOCK_N=BLOCK_N, BLOCK_D=block_d(d),
        )  # fmt: skip
    return partial.sum(dim=2) / n


def keydiff_scores(source: KVSource) -> torch.Tensor:
    """``-cos(k, anchor)``, float32 ``[L, H, N]``."""
    return _launch_norm(source, MODE_KEYDIFF, keydiff_anchors(source).contiguous())
