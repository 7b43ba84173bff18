# ruff: noqa: N803, PLR0917
# mypy: disable-error-code="untyped-decorator,no-untyped-def"
# Triton kernels: upper-case constexpr names and long positional argument lists are the
# Triton idiom; their parameters cannot carry Python type annotations.
"""Triton window attention for ``snapkv`` (spec: ``snapkv.py``), read through the block table.

Two kernels, each one launch over every layer when the layers' views stack
(``_tl_common.layer_runs``), each with a program per (KV head, block of keys, layer) that reads
its keys once for the ``G`` query heads of its GQA group:

1. ``_block_stats``: per query head and window query, the softmax max ``m`` and sum ``l`` of the
   logits over the block's keys it sees (window query ``i``: keys ``t <= N - W + i``, the causal
   mask); torch then merges the blocks (``m = max m_b``, ``l = sum l_b exp(m_b - m)``);
2. ``_window_probs``: per block of the ``N - W`` prefix keys (every window query sees them),
   ``exp(logit - m) / l`` summed over the window queries (/ W) and the group's heads (/ G).

Logits are float32: 16-bit keys and queries go to the tensor cores as they are (their products
are exact in float32, summed in float32), float32 ones use ``input_precision="ieee"`` (no TF32).
Pooling then runs in torch on the small ``[L, H, N - W]`` score tensor.

Its cost is a ``W x N`` attention per layer and query head, twice (``2 * 2 * L * Hq * W * N * D``
flops) over the keys read twice. (The first version ran the statistics as one program per query
head looping over all N keys, 32 programs per layer in 32 launches, in float32 FMA: 0.8 s at
8k tokens on an H200, gpu-check 2026-11-26.)
"""

from __future__ import annotations

import math
import os

import torch
import triton
import triton.language as tl

from kvtierd.kernels._tl_common import block_d, check_device, source_runs, token_offset
from kvtierd.kernels.layout import KVSource

BLOCK_N = 64


@triton.jit
def _load_keys(k_ptr, bt_ptr, h, t, D, N_KEYS, block_size, ks_blk, ks_slot, ks_h, ks_d,
               BLOCK_D: tl.constexpr):  # fmt: skip
    """Keys ``t`` of head ``h`` as ``[BLOCK_D, BLOCK_N]`` (transposed for the dot), 0 outside."""
    d = tl.arange(0, BLOCK_D)
    tm = t < N_KEYS
    row = token_offset(bt_ptr, t, tm, block_size, ks_blk, ks_slot) + h * ks_h
    km = (d < D)[:, None] & tm[None, :]
    return tl.load(k_ptr + row[None, :] + d.to(tl.int64)[:, None] * ks_d, mask=km, other=0.0)


@triton.jit
def _logits(q_ptr, qh, k, W, D, scale, qs_h, qs_w, qs_d,
            IEEE: tl.constexpr, BLOCK_W: tl.constexpr, BLOCK_D: tl.constexpr):  # fmt: skip
    """float32 ``[BLOCK_W, BLOCK_N]`` logits of query head ``qh``'s window against ``k``."""
    w = tl.arange(0, BLOCK_W)
    d = tl.arange(0, BLOCK_D)
    qm = (w < W)[:, None] & (d < D)[None, :]
    q_off = qh * qs_h + w.to(tl.int64)[:, None] * qs_w + d.to(tl.int64)[None, :] * qs_d
    q = tl.load(q_ptr + q_off, mask=qm, other=0.0)
    if IEEE:
        s = tl.dot(q.to(tl.float32), k.to(tl.float32), input_precision="ieee")
    else:
        s = tl.dot(q, k, out_dtype=tl.float32)
    return s * scale


@triton.jit
def _block_stats(
    q_ptr, k_ptr, bt_ptr, mb_ptr, lb_ptr, H, G, W, D, N_CTX, NB, block_size, scale,
    qs_l, qs_h, qs_w, qs_d, ks_l, ks_blk, ks_slot, ks_h, ks_d,
    IEEE: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_W: tl.constexpr, BLOCK_D: tl.constexpr,
):  # fmt: skip
    h = tl.program_id(0).to(tl.int64)
    b = tl.program_id(1)
    layer = tl.program_id(2).to(tl.int64)
    q_ptr += layer * qs_l
    k_ptr += layer * ks_l
    t = b * BLOCK_N + tl.arange(0, BLOCK_N)
    w = tl.arange(0, BLOCK_W)
    k = _load_keys(k_ptr, bt_ptr, h, t, D, N_CTX + W, block_size, ks_blk, ks_slot, ks_h, ks_d,
                   BLOCK_D)  # fmt: skip
    seen = (t[None, :] <= N_CTX + w[:, None]) & (t < N_CTX + W)[None, :]
    for g in range(G):
        qh = h * G + g
        s = _logits(q_ptr, qh, k, W, D, scale, qs_h, qs_w, qs_d, IEEE, BLOCK_W, BLOCK_D)
        s = tl.where(seen, s, float("-inf"))
        m_b = tl.max(s, axis=1)
        m_safe = tl.where(m_b == float("-inf"), 0.0, m_b)  # a row that sees no key here: l = 0
        l_b = tl.sum(tl.exp(s - m_safe[:, None]), axis=1)
        out = ((layer * H * G + qh) * NB + b) * W + w
        tl.store(mb_ptr + out, m_b, mask=w < W)
        tl.store(lb_ptr + out, l_b, mask=w < W)


@triton.jit
def _window_probs(
    q_ptr, k_ptr, bt_ptr, m_ptr, l_ptr, out_ptr, H, G, W, D, N_CTX, block_size, scale,
    qs_l, qs_h, qs_w, qs_d, ks_l, ks_blk, ks_slot, ks_h, ks_d,
    IEEE: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_W: tl.constexpr, BLOCK_D: tl.constexpr,
):  # fmt: skip
    h = tl.program_id(0).to(tl.int64)
    t = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    layer = tl.program_id(2).to(tl.int64)
    q_ptr += layer * qs_l
    k_ptr += layer * ks_l
    m_ptr += layer * H * G * W
    l_ptr += layer * H * G * W
    out_ptr += layer * H * N_CTX
    w = tl.arange(0, BLOCK_W)
    k = _load_keys(k_ptr, bt_ptr, h, t, D, N_CTX, block_size, ks_blk, ks_slot, ks_h, ks_d,
                   BLOCK_D)  # fmt: skip
    acc = tl.zeros([BLOCK_N], tl.float32)
    for g in range(G):
        qh = h * G + g
        s = _logits(q_ptr, qh, k, W, D, scale, qs_h, qs_w, qs_d, IEEE, BLOCK_W, BLOCK_D)
        m_i = tl.load(m_ptr + qh * W + w, mask=w < W, other=0.0)
        l_i = tl.load(l_ptr + qh * W + w, mask=w < W, other=1.0)
        p = tl.exp(s - m_i[:, None]) / l_i[:, None]
        p = tl.where((w < W)[:, None], p, 0.0)
        acc += tl.sum(p, axis=0) / W
    tl.store(out_ptr + h * N_CTX + t, acc / G, mask=t < N_CTX)


def _ieee(source: KVSource, queries: torch.Tensor) -> bool:
    """float32 dots unless keys and queries are the same 16-bit type (exact products). Under
    the interpreter bfloat16 goes through float32 too: its ``tl.dot`` of bfloat16 tiles is
    wrong (triton 3.9 on CPU: errors of 1e10 on a 16x16 product), while float16 runs the
    16-bit path there as on the GPU."""
    same = source.dtype == queries.dtype
    if os.environ.get("TRITON_INTERPRET") == "1":
        return not (same and queries.dtype == torch.float16)
    return not (same and queries.dtype in (torch.float16, torch.bfloat16))


def window_attention(source: KVSource, queries: torch.Tensor) -> torch.Tensor:
    """Mean window attention (softmax over all keys under the causal mask) on the prefix keys,
    averaged over each GQA group: float32 ``[L, H, N - W]`` (before pooling); ``W`` = the
    queries' third dimension. Requires ``N > W`` (checked by the caller)."""
    check_device(source.layer_keys[0], queries)
    lyr, h, n, d = source.num_layers, source.num_kv_heads, source.num_tokens, source.head_dim
    hq, w = int(queries.shape[1]), int(queries.shape[2])
    g, n_ctx = hq // h, n - w
    scale = 1.0 / math.sqrt(d)
    nb = triton.cdiv(n, BLOCK_N)
    dev = source.device
    m_b = torch.empty((lyr, hq, nb, w), dtype=torch.float32, device=dev)
    l_b = torch.empty_like(m_b)
    out = torch.empty((lyr, h, n_ctx), dtype=torch.float32, device=dev)
    meta = {
        "IEEE": _ieee(source, queries),
        "BLOCK_N": BLOCK_N,
        "BLOCK_W": max(16, int(triton.next_power_of_2(w))),
        "BLOCK_D": block_d(d),
    }
    runs = source_runs(source)
    for run in runs:
        k, q, first = run.keys, queries[run.first :], run.first
        _block_stats[(h, nb, k.shape[0])](
            q, k, source.block_table, m_b[first:], l_b[first:], h, g, w, d, n_ctx, nb,
            source.block_size, scale, *q.stride(), *k.stride(), **meta,
        )  # fmt: skip
    m = m_b.amax(dim=2)
    lsum = (l_b * torch.exp(m_b - m[:, :, None])).sum(dim=2)
    m, lsum = m.contiguous(), lsum.contiguous()
    for run in runs:
        k, q, first = run.keys, queries[run.first :], run.first
        _window_probs[(h, triton.cdiv(n_ctx, BLOCK_N), k.shape[0])](
            q, k, source.block_table, m[first:], lsum[first:], out[first:], h, g, w, d, n_ctx,
            source.block_size, scale, *q.stride(), *k.stride(), **meta,
        )  # fmt: skip
    return out
